package cudagraph

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the Prometheus counters of graph sets, labelled by bucket
// (the batch size, in decimal). One Metrics may be shared by several Sets;
// their counts add up per bucket.
type Metrics struct {
	Captures   *prometheus.CounterVec // rollout_worker_graph_captures_total
	Replays    *prometheus.CounterVec // rollout_worker_graph_replays_total
	Recaptures *prometheus.CounterVec // rollout_worker_graph_recaptures_total
}

// NewMetrics creates the counters and registers them on reg; a nil reg
// leaves them unregistered (still counting).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	counter := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "rollout_worker", Subsystem: "graph", Name: name, Help: help,
		}, []string{"bucket"})
	}
	m := &Metrics{
		Captures:   counter("captures_total", "Decode-step graphs captured, per batch-size bucket (recaptures included)."),
		Replays:    counter("replays_total", "Decode-step graph replays, per batch-size bucket."),
		Recaptures: counter("recaptures_total", "Captures of a bucket that already had a graph; 0 in normal operation."),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.Captures, m.Replays, m.Recaptures} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("cudagraph: register metrics: %w", err)
			}
		}
	}
	return m, nil
}
