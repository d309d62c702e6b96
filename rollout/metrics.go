package rollout

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Request results (the "result" label of rollout_worker_requests_total).
const (
	resultOK         = "ok"          // every sample finished by stop or length
	resultAborted    = "aborted"     // some samples were aborted (drain, stop)
	resultCancelled  = "cancelled"   // some samples were aborted: the client cancelled the request
	resultClientGone = "client_gone" // some samples were aborted: nothing subscribed to the reply subject any more
	resultFailed     = "failed"      // a sample failed (non-finite logits): the rest were aborted
	resultNoReply    = "no_reply"
	resultNotFound   = "not_found" // a cancel for a request this worker does not hold
	resultInternal   = ReasonInternal
)

// metrics are the service's Prometheus metrics.
type metrics struct {
	requests  *prometheus.CounterVec // by endpoint, result
	samples   *prometheus.CounterVec // by finish_reason
	tokens    prometheus.Counter
	queue     prometheus.Gauge
	latencies prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rollout_worker_requests_total",
			Help: "Requests answered, by endpoint and result (ok, aborted, cancelled, client_gone, bad_request, overloaded, draining, version_not_reached, internal, no_reply, not_found)."},
			[]string{"endpoint", "result"}),
		samples: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rollout_worker_samples_total",
			Help: "Samples sent, by finish reason (stop, length, abort)."}, []string{"finish_reason"}),
		tokens: prometheus.NewCounter(prometheus.CounterOpts{Name: "rollout_worker_generated_tokens_total",
			Help: "Tokens generated in the samples sent."}),
		queue: prometheus.NewGauge(prometheus.GaugeOpts{Name: "rollout_worker_queue_depth",
			Help: "Requests admitted and not yet finished (generate and score)."}),
		latencies: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "rollout_worker_request_seconds",
			Help:    "Generate requests end to end: arrival to summary.",
			Buckets: prometheus.ExponentialBuckets(1e-3, 2, 20)}), // 1 ms .. 524 s
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.samples, m.tokens, m.queue, m.latencies} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("rollout: metrics: %w", err)
		}
	}
	return m, nil
}
