package policy

import (
	"fmt"

	"github.com/rollout-worker/rollout-worker/cudagraph"
)

// Graphs runs the engine's decode-only steps as captured graphs, one per
// batch-size bucket: a step of n sequences is padded to the smallest bucket
// >= n (padding rows store nothing and are ignored) and the bucket's graph
// of Model.Forward + sampling is replayed over the staged inputs. The
// graphs read the weights through fixed buffers, so after a refit they
// replay the new weights without being captured again.
type Graphs struct {
	set *cudagraph.Set
}

var _ StepRunner = (*Graphs)(nil)

// NewGraphs prepares graphs for the given buckets (captured on first use).
// Each bucket must fit the model's per-step maxima.
func NewGraphs(m *Model, buckets []int, metrics *cudagraph.Metrics) (*Graphs, error) {
	o := m.opts
	for _, b := range buckets {
		if b > o.MaxSeqs || b > o.MaxTokens || b > o.MaxLogitRows {
			return nil, fmt.Errorf("policy: graph bucket %d exceeds the model's per-step maxima (%d sequences, %d tokens, %d logit rows)",
				b, o.MaxSeqs, o.MaxTokens, o.MaxLogitRows)
		}
	}
	set, err := cudagraph.NewSet(m.be, buckets, func(b int) error {
		return m.Forward(Shape{T: b, S: b, L: b}, true)
	}, metrics)
	if err != nil {
		return nil, fmt.Errorf("policy: graphs: %w", err)
	}
	return &Graphs{set: set}, nil
}

// DefaultBuckets returns powers of two up to max, and max itself.
func DefaultBuckets(max int) []int {
	var b []int
	for n := 1; n < max; n *= 2 {
		b = append(b, n)
	}
	return append(b, max)
}

// Pad returns the bucket a step of n sequences runs in.
func (g *Graphs) Pad(n int) (int, error) { return g.set.Bucket(n) }

// Run replays (capturing on first use) the graph of a padded step.
func (g *Graphs) Run(padded int) error { return g.set.Run(padded) }

// Stats returns capture and replay counts.
func (g *Graphs) Stats() cudagraph.Stats { return g.set.Stats() }

// Close destroys the graphs. It is idempotent.
func (g *Graphs) Close() error { return g.set.Close() }
