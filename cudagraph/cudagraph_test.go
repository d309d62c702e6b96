package cudagraph_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rollout-worker/rollout-worker/cudagraph"
	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
)

const (
	maxBatch = 8
	hidden   = 16
	vocab    = 24
	topK     = 2
)

// env is a small step over buffers allocated once for the largest batch:
// h = x W^T, hn = rmsnorm(h), out = hn + bias, logits = out LM^T, then the
// top-2 of the logits. step(n) runs it on the first n rows.
type env struct {
	t                                *testing.T
	be                               *cpu.Backend
	r                                *rand.Rand
	x, w, norm, bias, lm             *kernels.Buffer // inputs and weights
	h, hn, out, logits, ids, weights *kernels.Buffer // outputs
	steps                            map[int]int     // step calls per bucket
}

func newEnv(t *testing.T) *env {
	t.Helper()
	be, err := cpu.New(cpu.Config{Workers: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, be: be, r: rand.New(rand.NewPCG(1, 2)), steps: map[int]int{}}
	e.x, e.w, e.norm = e.rand(maxBatch, hidden), e.rand(hidden, hidden), e.rand(hidden)
	e.bias, e.lm = e.rand(maxBatch, hidden), e.rand(vocab, hidden)
	e.h, e.hn, e.out = e.alloc(kernels.BF16, maxBatch, hidden), e.alloc(kernels.BF16, maxBatch, hidden), e.alloc(kernels.BF16, maxBatch, hidden)
	e.logits = e.alloc(kernels.F32, maxBatch, vocab)
	e.ids, e.weights = e.alloc(kernels.I32, maxBatch, topK), e.alloc(kernels.F32, maxBatch, topK)
	return e
}

func (e *env) alloc(dt kernels.DType, shape ...int) *kernels.Buffer {
	e.t.Helper()
	b, err := e.be.Alloc(dt, shape...)
	if err != nil {
		e.t.Fatal(err)
	}
	return b
}

// rand allocates a BF16 buffer of N(0, 1/2) values.
func (e *env) rand(shape ...int) *kernels.Buffer {
	e.t.Helper()
	b := e.alloc(kernels.BF16, shape...)
	e.randomize(b)
	return b
}

func (e *env) randomize(b *kernels.Buffer) {
	e.t.Helper()
	raw := make([]byte, b.Size())
	for i := 0; i < len(raw); i += 2 {
		binary.LittleEndian.PutUint16(raw[i:], bf16.FromFloat32(float32(e.r.NormFloat64()*0.5)))
	}
	if err := e.be.Upload(b, 0, raw); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) rows(b *kernels.Buffer, n int) *kernels.Buffer {
	v, err := b.Rows(n)
	if err != nil {
		e.t.Fatal(err)
	}
	return v
}

// step issues the ops for a batch of n.
func (e *env) step(n int) error {
	e.steps[n]++
	x, h, hn, out := e.rows(e.x, n), e.rows(e.h, n), e.rows(e.hn, n), e.rows(e.out, n)
	logits, ids, weights := e.rows(e.logits, n), e.rows(e.ids, n), e.rows(e.weights, n)
	if err := e.be.Gemm(h, x, e.w); err != nil {
		return err
	}
	if err := e.be.RMSNorm(kernels.RMSNormArgs{Out: hn, Src: h, Weight: e.norm, Eps: 1e-6}); err != nil {
		return err
	}
	if err := e.be.Add(kernels.AddArgs{Out: out, A: hn, B: e.rows(e.bias, n)}); err != nil {
		return err
	}
	if err := e.be.Gemm(logits, out, e.lm); err != nil {
		return err
	}
	return e.be.Route(kernels.RouteArgs{Logits: logits, IDs: ids, Weights: weights, Scoring: kernels.Softmax, Renormalize: true, Scale: 1})
}

func (e *env) outputs() []*kernels.Buffer {
	return []*kernels.Buffer{e.h, e.hn, e.out, e.logits, e.ids, e.weights}
}

// zero clears the outputs.
func (e *env) zero() {
	e.t.Helper()
	for _, b := range e.outputs() {
		if err := e.be.Zero(b); err != nil {
			e.t.Fatal(err)
		}
	}
}

// snapshot downloads the outputs, concatenated.
func (e *env) snapshot() []byte {
	e.t.Helper()
	var all []byte
	for _, b := range e.outputs() {
		raw := make([]byte, b.Size())
		if err := e.be.Download(raw, b, 0); err != nil {
			e.t.Fatal(err)
		}
		all = append(all, raw...)
	}
	return all
}

// direct runs step(n) directly on zeroed outputs and returns them.
func (e *env) direct(n int) []byte {
	e.t.Helper()
	e.zero()
	if err := e.step(n); err != nil {
		e.t.Fatal(err)
	}
	return e.snapshot()
}

// Replaying a captured step equals running it directly, bitwise, and
// follows new inputs written into the same buffers.
func TestReplayEqualsDirect(t *testing.T) {
	e := newEnv(t)
	e.zero()
	zeros := e.snapshot()
	g, err := cudagraph.Capture(e.be, func() error { return e.step(maxBatch) })
	if err != nil {
		t.Fatal(err)
	}
	defer g.Destroy()
	if !bytes.Equal(e.snapshot(), zeros) {
		t.Fatal("capture ran the ops")
	}
	var prev []byte
	for i := range 3 {
		if i > 0 {
			e.randomize(e.x) // a new step's inputs, same buffer
		}
		want := e.direct(maxBatch)
		if bytes.Equal(want, prev) {
			t.Fatalf("input %d: the outputs did not change", i)
		}
		prev = want
		e.zero()
		if err := g.Replay(); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(e.snapshot(), want) {
			t.Fatalf("input %d: replay differs from running the step directly", i)
		}
	}
}

// The registry holds every buffer the step names, with its address and size.
func TestRegistry(t *testing.T) {
	e := newEnv(t)
	g, err := cudagraph.Capture(e.be, func() error { return e.step(3) })
	if err != nil {
		t.Fatal(err)
	}
	refs := g.Buffers()
	want := map[uintptr]bool{} // the step names views of these roots, and w, norm, lm whole
	for _, b := range []*kernels.Buffer{e.x, e.w, e.norm, e.bias, e.lm, e.h, e.hn, e.out, e.logits, e.ids, e.weights} {
		want[b.Addr()] = true
	}
	if len(refs) != len(want) {
		t.Fatalf("registry has %d buffers, want %d", len(refs), len(want))
	}
	for _, r := range refs {
		if !want[r.Addr] || r.Buf.Addr() != r.Addr || r.Buf.Size() != r.Size {
			t.Fatalf("unexpected registry entry %+v", r)
		}
	}
	if err := g.Check(); err != nil {
		t.Fatal(err)
	}
}

// noCapture hides the CPU backend's Capturer.
type noCapture struct{ kernels.Backend }

func TestUnsupported(t *testing.T) {
	e := newEnv(t)
	be := noCapture{e.be}
	if _, err := cudagraph.Capture(be, func() error { return nil }); !errors.Is(err, cudagraph.ErrUnsupported) {
		t.Fatalf("Capture: %v, want ErrUnsupported", err)
	}
	if _, err := cudagraph.NewSet(be, []int{1}, e.step, nil); !errors.Is(err, cudagraph.ErrUnsupported) {
		t.Fatalf("NewSet: %v, want ErrUnsupported", err)
	}
}

// A failed capture returns the error and leaves the backend out of capture.
func TestCaptureErrors(t *testing.T) {
	e := newEnv(t)
	boom := errors.New("boom")
	for _, tc := range []struct {
		name string
		step func() error
		is   error
		want string
	}{
		{"step error", func() error { return boom }, boom, "boom"},
		{"bad op ignored", func() error { _ = e.be.Gemm(e.h, e.x, e.lm); return nil }, nil, "gemm"},
		{"memory op", func() error { return e.be.Upload(e.x, 0, []byte{0, 0}) }, kernels.ErrCapturing, "upload"},
		{"panic", func() error { panic(boom) }, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var g *cudagraph.Graph
			var err error
			func() {
				defer func() {
					if p := recover(); p != nil && tc.want != "" {
						panic(p)
					}
				}()
				g, err = cudagraph.Capture(e.be, tc.step)
			}()
			if tc.want != "" && (g != nil || err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("Capture: %v, %v; want no graph and an error naming %q", g, err, tc.want)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Fatalf("Capture: %v, want it to wrap %v", err, tc.is)
			}
			if err := e.be.Sync(); err != nil { // not capturing any more
				t.Fatalf("after a failed capture: %v", err)
			}
		})
	}
}

// A buffer freed after capture makes Replay fail with ErrStale, naming it,
// and nothing is launched.
func TestStaleBuffer(t *testing.T) {
	e := newEnv(t)
	g, err := cudagraph.Capture(e.be, func() error { return e.step(maxBatch) })
	if err != nil {
		t.Fatal(err)
	}
	set, err := cudagraph.NewSet(e.be, []int{maxBatch}, e.step, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := set.CaptureAll(); err != nil {
		t.Fatal(err)
	}
	if err := e.be.Free(e.bias); err != nil {
		t.Fatal(err)
	}
	e.zero()
	zeros := e.snapshot()
	err = g.Replay()
	if !errors.Is(err, cudagraph.ErrStale) || !strings.Contains(err.Error(), e.bias.String()) {
		t.Fatalf("Replay over a freed buffer: %v, want ErrStale naming %v", err, e.bias)
	}
	if err := g.Check(); !errors.Is(err, cudagraph.ErrStale) {
		t.Fatalf("Check: %v", err)
	}
	if !bytes.Equal(e.snapshot(), zeros) {
		t.Fatal("a stale graph was launched")
	}
	if err := set.Run(maxBatch); !errors.Is(err, cudagraph.ErrStale) {
		t.Fatalf("Set.Run: %v, want ErrStale", err)
	}
	if st := set.Stats(); st.Replays != 0 || st.Recaptures != 0 {
		t.Fatalf("stats after a stale run: %+v", st)
	}
	// Capturing over a buffer that is already stale fails at capture.
	if _, err := cudagraph.Capture(e.be, func() error { return e.step(1) }); !errors.Is(err, cudagraph.ErrStale) {
		t.Fatalf("Capture over a freed buffer: %v, want ErrStale", err)
	}
}

func TestSetBuckets(t *testing.T) {
	e := newEnv(t)
	set, err := cudagraph.NewSet(e.be, []int{8, 1, 4, 2, 4}, e.step, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := set.Buckets(); len(got) != 4 || got[0] != 1 || got[1] != 2 || got[2] != 4 || got[3] != 8 {
		t.Fatalf("Buckets() = %v", got)
	}
	for n, want := range map[int]int{1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8} {
		if b, err := set.Bucket(n); err != nil || b != want {
			t.Errorf("Bucket(%d) = %d, %v; want %d", n, b, err, want)
		}
	}
	for _, n := range []int{0, -1, 9} {
		if b, err := set.Bucket(n); err == nil {
			t.Errorf("Bucket(%d) = %d, want an error", n, b)
		}
		if err := set.Run(n); err == nil {
			t.Errorf("Run(%d) succeeded", n)
		}
	}
	for _, bad := range [][]int{nil, {0, 4}, {-2}} {
		if _, err := cudagraph.NewSet(e.be, bad, e.step, nil); err == nil {
			t.Errorf("NewSet(%v) succeeded", bad)
		}
	}
	if st := set.Stats(); st != (cudagraph.Stats{}) {
		t.Fatalf("stats after failed runs: %+v", st)
	}
}

func TestSetCaptureOnFirstUse(t *testing.T) {
	e := newEnv(t)
	set, err := cudagraph.NewSet(e.be, []int{1, 2, 4, 8}, e.step, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()

	want := e.direct(4) // rows 0..3 written, the rest zero
	delete(e.steps, 4)
	e.zero()
	if err := set.Run(3); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(e.snapshot(), want) {
		t.Fatal("Run(3) differs from the bucket-4 step run directly")
	}
	if st := set.Stats(); st != (cudagraph.Stats{Captures: 1, Replays: 1}) || e.steps[4] != 1 || !set.Captured(4) || set.Captured(8) {
		t.Fatalf("after Run(3): %+v, step calls %v", st, e.steps)
	}

	// Many steps of mixed sizes: each bucket is captured once, never again.
	runs := 0
	for i := range 60 {
		if err := set.Run(1 + i%7); err != nil {
			t.Fatal(err)
		}
		runs++
	}
	st := set.Stats()
	if st.Captures != 4 || st.Recaptures != 0 || st.Replays != uint64(1+runs) {
		t.Fatalf("after %d runs: %+v", runs, st)
	}
	for b, n := range e.steps {
		if n != 1 {
			t.Fatalf("bucket %d step called %d times", b, n)
		}
	}

	// An explicit invalidation is the only way to a recapture.
	if err := set.Invalidate(); err != nil {
		t.Fatal(err)
	}
	if set.Captured(4) {
		t.Fatal("graph kept after Invalidate")
	}
	if err := set.Run(4); err != nil {
		t.Fatal(err)
	}
	if st := set.Stats(); st.Captures != 5 || st.Recaptures != 1 {
		t.Fatalf("after Invalidate and Run(4): %+v", st)
	}

	if err := set.Close(); err != nil {
		t.Fatal(err)
	}
	if err := set.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if err := set.Run(1); err == nil {
		t.Fatal("Run after Close succeeded")
	}
}

func TestSetCaptureAll(t *testing.T) {
	e := newEnv(t)
	set, err := cudagraph.NewSet(e.be, []int{2, 8}, e.step, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	if err := set.CaptureAll(); err != nil {
		t.Fatal(err)
	}
	if err := set.CaptureAll(); err != nil { // nothing left to capture
		t.Fatal(err)
	}
	for _, n := range []int{1, 2, 5, 8} {
		want := e.direct(map[int]int{1: 2, 2: 2, 5: 8, 8: 8}[n])
		e.zero()
		if err := set.Run(n); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(e.snapshot(), want) {
			t.Fatalf("Run(%d) differs from running its bucket directly", n)
		}
	}
	if st := set.Stats(); st != (cudagraph.Stats{Captures: 2, Replays: 4}) {
		t.Fatalf("stats: %+v", st)
	}
}

func TestMetrics(t *testing.T) {
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	m, err := cudagraph.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cudagraph.NewMetrics(reg); err == nil {
		t.Fatal("registering the metrics twice succeeded")
	}
	if _, err := cudagraph.NewMetrics(nil); err != nil {
		t.Fatal(err)
	}
	set, err := cudagraph.NewSet(e.be, []int{1, 4}, e.step, m)
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	for _, n := range []int{3, 3, 4, 1, 2} {
		if err := set.Run(n); err != nil {
			t.Fatal(err)
		}
	}
	if err := set.Invalidate(); err != nil {
		t.Fatal(err)
	}
	if err := set.Run(1); err != nil {
		t.Fatal(err)
	}

	want := map[string]map[string]float64{
		"rollout_worker_graph_captures_total":   {"1": 2, "4": 1},
		"rollout_worker_graph_replays_total":    {"1": 2, "4": 4},
		"rollout_worker_graph_recaptures_total": {"1": 1, "4": 0},
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(mfs) != len(want) {
		t.Fatalf("gathered %d metric families, want %d", len(mfs), len(want))
	}
	for _, mf := range mfs {
		byBucket, ok := want[mf.GetName()]
		if !ok {
			t.Fatalf("unexpected metric %s", mf.GetName())
		}
		if len(mf.GetMetric()) != len(byBucket) {
			t.Fatalf("%s has %d series, want %d", mf.GetName(), len(mf.GetMetric()), len(byBucket))
		}
		for _, s := range mf.GetMetric() {
			if len(s.GetLabel()) != 1 || s.GetLabel()[0].GetName() != "bucket" {
				t.Fatalf("%s labels %v, want bucket only", mf.GetName(), s.GetLabel())
			}
			b := s.GetLabel()[0].GetValue()
			if got := s.GetCounter().GetValue(); got != byBucket[b] {
				t.Errorf("%s{bucket=%q} = %v, want %v", mf.GetName(), b, got, byBucket[b])
			}
		}
	}
	if got := testutil.ToFloat64(m.Replays.WithLabelValues("4")); got != 4 {
		t.Errorf("replays{bucket=4} = %v", got)
	}
	if st := set.Stats(); st != (cudagraph.Stats{Captures: 3, Replays: 6, Recaptures: 1}) {
		t.Errorf("stats: %+v", st)
	}
}
