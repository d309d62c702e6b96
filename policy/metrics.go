package policy

import (
	"github.com/prometheus/client_golang/prometheus"
)

// EngineMetrics are the generation loop's Prometheus metrics.
type EngineMetrics struct {
	steps      *prometheus.CounterVec // by kind: graph, eager
	stepTime   prometheus.Histogram
	batchToks  prometheus.Histogram
	batchSeqs  prometheus.Histogram
	tokens     *prometheus.CounterVec // by kind: forwarded, generated
	pagesInUse prometheus.Gauge
	pagesTotal prometheus.Gauge
	waiting    prometheus.Gauge
	running    prometheus.Gauge
	// With KV pages on demand: preemptions, and samples waiting to be
	// recomputed.
	preemptions prometheus.Counter
	preempted   prometheus.Gauge
	// With the prefix cache: prompt tokens by hit or miss, pages cached.
	prefix      *prometheus.CounterVec
	cachedPages prometheus.Gauge
}

// NewEngineMetrics makes the metrics and registers them on reg (nil: not
// registered).
func NewEngineMetrics(reg prometheus.Registerer) (*EngineMetrics, error) {
	sizes := prometheus.ExponentialBuckets(1, 2, 12)
	m := &EngineMetrics{
		steps: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rollout_worker_engine_steps_total",
			Help: "Forward passes of the generation loop, by kind (graph: replayed from a captured graph; eager)."}, []string{"kind"}),
		stepTime: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "rollout_worker_engine_step_seconds",
			Help: "Time of one generation step (stage, forward, sample, read back).", Buckets: prometheus.ExponentialBuckets(1e-4, 2, 18)}),
		batchToks: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "rollout_worker_engine_batch_tokens",
			Help: "Tokens forwarded in one step.", Buckets: sizes}),
		batchSeqs: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "rollout_worker_engine_batch_sequences",
			Help: "Sequences in one step.", Buckets: sizes}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rollout_worker_engine_tokens_total",
			Help: "Tokens forwarded (prompt and decode), generated (sampled), and recomputed (prefilled again after a preemption)."}, []string{"kind"}),
		pagesInUse: prometheus.NewGauge(prometheus.GaugeOpts{Name: "rollout_worker_kv_pages_in_use",
			Help: "KV-cache pages held by sequences."}),
		pagesTotal: prometheus.NewGauge(prometheus.GaugeOpts{Name: "rollout_worker_kv_pages",
			Help: "KV-cache pages in all."}),
		waiting: prometheus.NewGauge(prometheus.GaugeOpts{Name: "rollout_worker_engine_waiting_requests",
			Help: "Requests queued for admission (waiting for KV pages)."}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{Name: "rollout_worker_engine_running_sequences",
			Help: "Samples being decoded."}),
		preemptions: prometheus.NewCounter(prometheus.CounterOpts{Name: "rollout_worker_engine_preemptions_total",
			Help: "Samples and prompts whose KV pages were taken back to let older samples grow (KV pages on demand)."}),
		preempted: prometheus.NewGauge(prometheus.GaugeOpts{Name: "rollout_worker_engine_preempted_sequences",
			Help: "Preempted samples waiting to be recomputed."}),
		prefix: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rollout_worker_engine_prefix_tokens_total",
			Help: "Prompt tokens of admitted requests, by result: hit (KV shared from the prefix cache) or miss (prefilled)."}, []string{"result"}),
		cachedPages: prometheus.NewGauge(prometheus.GaugeOpts{Name: "rollout_worker_kv_pages_cached",
			Help: "KV-cache pages the prefix cache holds (shared with requests, or idle and evictable)."}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.steps, m.stepTime, m.batchToks, m.batchSeqs, m.tokens, m.pagesInUse, m.pagesTotal, m.waiting, m.running, m.preemptions, m.preempted, m.prefix, m.cachedPages} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}
