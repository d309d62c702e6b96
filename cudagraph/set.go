package cudagraph

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// Set holds one captured graph per batch-size bucket of a step function.
// See the package documentation for its rules.
type Set struct {
	be      kernels.Backend
	step    func(bucket int) error
	buckets []bucket // ascending by size
	closed  bool

	captures, replays, recaptures atomic.Uint64
}

// bucket is one batch size and its graph.
type bucket struct {
	size  int
	graph *Graph // nil until captured, and after Invalidate
	had   bool   // a graph was captured before: the next capture is a recapture

	// Prometheus children, resolved once; nil without Metrics.
	captures, replays, recaptures prometheus.Counter
}

// Stats are a Set's counts since NewSet.
type Stats struct {
	Captures   uint64 // graphs captured, recaptures included
	Replays    uint64 // successful graph replays
	Recaptures uint64 // captures of a bucket that already had a graph
}

// NewSet returns a Set over the given bucket sizes (any order; duplicates
// are merged) for step, which issues the ops of one step for a batch of the
// bucket's size. Nothing is captured yet. m may be nil. A backend without
// kernels.Capturer gets ErrUnsupported.
func NewSet(be kernels.Backend, buckets []int, step func(bucket int) error, m *Metrics) (*Set, error) {
	if _, ok := be.(kernels.Capturer); !ok {
		return nil, fmt.Errorf("cudagraph: new set on %s: %w", be.Name(), ErrUnsupported)
	}
	if step == nil {
		return nil, errors.New("cudagraph: new set: nil step")
	}
	if len(buckets) == 0 {
		return nil, errors.New("cudagraph: new set: no buckets")
	}
	sizes := slices.Clone(buckets)
	slices.Sort(sizes)
	sizes = slices.Compact(sizes)
	if sizes[0] < 1 {
		return nil, fmt.Errorf("cudagraph: new set: bucket %d: want a positive batch size", sizes[0])
	}
	s := &Set{be: be, step: step}
	for _, n := range sizes {
		b := bucket{size: n}
		if m != nil {
			l := strconv.Itoa(n)
			b.captures, b.replays, b.recaptures = m.Captures.WithLabelValues(l), m.Replays.WithLabelValues(l), m.Recaptures.WithLabelValues(l)
		}
		s.buckets = append(s.buckets, b)
	}
	return s, nil
}

// Buckets returns the bucket sizes, ascending.
func (s *Set) Buckets() []int {
	out := make([]int, len(s.buckets))
	for i, b := range s.buckets {
		out[i] = b.size
	}
	return out
}

// Bucket returns the smallest bucket that holds a batch of n, or an error
// when n is not positive or exceeds the largest bucket.
func (s *Set) Bucket(n int) (int, error) {
	i, err := s.index(n)
	if err != nil {
		return 0, err
	}
	return s.buckets[i].size, nil
}

func (s *Set) index(n int) (int, error) {
	if n < 1 {
		return 0, fmt.Errorf("cudagraph: batch of %d: want at least 1", n)
	}
	i, _ := slices.BinarySearchFunc(s.buckets, n, func(b bucket, n int) int { return b.size - n })
	if i == len(s.buckets) {
		return 0, fmt.Errorf("cudagraph: batch of %d exceeds the largest bucket, %d", n, s.buckets[len(s.buckets)-1].size)
	}
	return i, nil
}

// Run runs one step for a batch of n: it picks the bucket, captures the
// bucket's graph if it has none yet, and replays it. The step's inputs must
// already be in its buffers, padded to the bucket. A stale buffer is an
// error wrapping ErrStale, and nothing runs.
func (s *Set) Run(n int) error {
	if s.closed {
		return errors.New("cudagraph: run: set closed")
	}
	i, err := s.index(n)
	if err != nil {
		return err
	}
	b := &s.buckets[i]
	if b.graph == nil {
		if err := s.capture(b); err != nil {
			return err
		}
	}
	if err := b.graph.Replay(); err != nil {
		return fmt.Errorf("cudagraph: batch of %d, bucket %d: %w", n, b.size, err)
	}
	s.replays.Add(1)
	if b.replays != nil {
		b.replays.Inc()
	}
	return nil
}

// CaptureAll captures the graph of every bucket that has none, smallest
// first, stopping at the first error.
func (s *Set) CaptureAll() error {
	if s.closed {
		return errors.New("cudagraph: capture all: set closed")
	}
	for i := range s.buckets {
		if b := &s.buckets[i]; b.graph == nil {
			if err := s.capture(b); err != nil {
				return err
			}
		}
	}
	return nil
}

func (s *Set) capture(b *bucket) error {
	g, err := Capture(s.be, func() error { return s.step(b.size) })
	if err != nil {
		return fmt.Errorf("cudagraph: bucket %d: %w", b.size, err)
	}
	b.graph = g
	s.captures.Add(1)
	if b.captures != nil {
		b.captures.Inc()
	}
	if b.had {
		s.recaptures.Add(1)
		if b.recaptures != nil {
			b.recaptures.Inc()
		}
	}
	b.had = true
	return nil
}

// Invalidate destroys every captured graph, so that the next Run (or
// CaptureAll) captures each bucket again and counts a recapture. Nothing in
// normal operation needs it: refit rewrites weights in place under the
// graphs. It returns the first Destroy error.
func (s *Set) Invalidate() error { return s.destroyAll("invalidate") }

// Close destroys every graph; the Set cannot run afterwards. It is
// idempotent.
func (s *Set) Close() error {
	if s.closed {
		return nil
	}
	s.closed = true
	return s.destroyAll("close")
}

func (s *Set) destroyAll(op string) error {
	var first error
	for i := range s.buckets {
		b := &s.buckets[i]
		if b.graph == nil {
			continue
		}
		if err := b.graph.Destroy(); err != nil && first == nil {
			first = fmt.Errorf("cudagraph: %s: bucket %d: %w", op, b.size, err)
		}
		b.graph = nil
	}
	return first
}

// Captured reports whether bucket size has a graph now.
func (s *Set) Captured(size int) bool {
	i, err := s.index(size)
	return err == nil && s.buckets[i].size == size && s.buckets[i].graph != nil
}

// Stats returns the counts since NewSet. It is safe to call from any
// goroutine.
func (s *Set) Stats() Stats {
	return Stats{Captures: s.captures.Load(), Replays: s.replays.Load(), Recaptures: s.recaptures.Load()}
}
