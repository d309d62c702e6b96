package refit

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the receiver's Prometheus metrics.
type metrics struct {
	version  prometheus.Gauge
	versions *prometheus.CounterVec   // by result: applied, rejected, needs_full
	phase    *prometheus.HistogramVec // whole-version time per phase
	layer    *prometheus.HistogramVec // per-layer time per phase
	chunks   *prometheus.CounterVec   // applied versions' chunks by source: live, stream
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	buckets := prometheus.ExponentialBuckets(1e-4, 2, 20) // 0.1 ms .. 52 s
	m := &metrics{
		version: prometheus.NewGauge(prometheus.GaugeOpts{Name: "rollout_worker_refit_version",
			Help: "Policy version being served."}),
		versions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rollout_worker_refit_versions_total",
			Help: "Weight versions handled, by result."}, []string{"result"}),
		phase: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "rollout_worker_refit_phase_seconds",
			Help: "Time of each refit phase for a whole version (receive, copy, requantize, commit).", Buckets: buckets}, []string{"phase"}),
		layer: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "rollout_worker_refit_layer_seconds",
			Help: "Time of each refit phase per decoder layer (receive, copy, requantize).", Buckets: buckets}, []string{"phase"}),
		chunks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rollout_worker_refit_chunks_total",
			Help: "Chunks of applied versions by where they came from: live (core NATS) or stream (read back from a part's stream)."}, []string{"source"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.version, m.versions, m.phase, m.layer, m.chunks} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				return nil, fmt.Errorf("refit: metrics: %w", err)
			}
			return nil, err
		}
	}
	return m, nil
}

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }
