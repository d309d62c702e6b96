package cpu

// Internal tests: the re-allocation case of Live needs to put a new root at
// a freed root's address, which Go's allocator cannot be made to do while
// the old buffer is reachable.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// fixture allocates buffers and remembers each one's initial contents, so a
// test can put every buffer back as it was before running a step again.
type fixture struct {
	t    *testing.T
	be   *Backend
	r    *rand.Rand
	bufs []*kernels.Buffer
	init [][]byte
}

func newFixture(t *testing.T, seed uint64) *fixture {
	t.Helper()
	be, err := New(Config{Workers: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{t: t, be: be, r: rand.New(rand.NewPCG(seed, 1))}
}

// buf allocates a buffer holding raw (nil: zeros).
func (f *fixture) buf(raw []byte, dt kernels.DType, shape ...int) *kernels.Buffer {
	f.t.Helper()
	b, err := f.be.Alloc(dt, shape...)
	if err != nil {
		f.t.Fatal(err)
	}
	if raw == nil {
		raw = make([]byte, b.Size())
	}
	if err := f.be.Upload(b, 0, raw); err != nil {
		f.t.Fatal(err)
	}
	f.bufs = append(f.bufs, b)
	f.init = append(f.init, slices.Clone(raw))
	return b
}

func (f *fixture) zeros(dt kernels.DType, shape ...int) *kernels.Buffer {
	return f.buf(nil, dt, shape...)
}

// randBF16 is a buffer of N(0, std^2) BF16 values.
func (f *fixture) randBF16(std float64, shape ...int) *kernels.Buffer {
	n, _ := kernels.SizeOf(kernels.BF16, shape)
	return f.buf(f.bf16Bytes(n/2, std), kernels.BF16, shape...)
}

func (f *fixture) bf16Bytes(n int, std float64) []byte {
	raw := make([]byte, 2*n)
	for i := range n {
		binary.LittleEndian.PutUint16(raw[2*i:], bf16.FromFloat32(float32(f.r.NormFloat64()*std)))
	}
	return raw
}

func (f *fixture) i32(vals []int32, shape ...int) *kernels.Buffer {
	return f.buf(i32Raw(vals...), kernels.I32, shape...)
}

func (f *fixture) f32(vals []float32, shape ...int) *kernels.Buffer {
	raw := make([]byte, 4*len(vals))
	for i, v := range vals {
		binary.LittleEndian.PutUint32(raw[4*i:], math.Float32bits(v))
	}
	return f.buf(raw, kernels.F32, shape...)
}

func i32Raw(vals ...int32) []byte {
	raw := make([]byte, 4*len(vals))
	for i, v := range vals {
		binary.LittleEndian.PutUint32(raw[4*i:], uint32(v))
	}
	return raw
}

// reset puts every buffer back to its initial contents.
func (f *fixture) reset() {
	f.t.Helper()
	for i, b := range f.bufs {
		if err := f.be.Upload(b, 0, f.init[i]); err != nil {
			f.t.Fatal(err)
		}
	}
}

// set uploads raw into b and makes it b's initial contents.
func (f *fixture) set(b *kernels.Buffer, raw []byte) {
	f.t.Helper()
	if err := f.be.Upload(b, 0, raw); err != nil {
		f.t.Fatal(err)
	}
	f.init[slices.Index(f.bufs, b)] = slices.Clone(raw)
}

// snapshot returns the contents of every buffer.
func (f *fixture) snapshot() [][]byte {
	f.t.Helper()
	out := make([][]byte, len(f.bufs))
	for i, b := range f.bufs {
		out[i] = make([]byte, b.Size())
		if err := f.be.Download(out[i], b, 0); err != nil {
			f.t.Fatal(err)
		}
	}
	return out
}

func (f *fixture) capture(step func() error) kernels.Graph {
	f.t.Helper()
	if err := f.be.BeginCapture(); err != nil {
		f.t.Fatal(err)
	}
	if err := step(); err != nil {
		f.t.Fatalf("op during capture: %v", err)
	}
	g, err := f.be.EndCapture()
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { _ = g.Destroy() })
	return g
}

// checkSame fails unless the two snapshots are equal, naming the buffer.
func (f *fixture) checkSame(what string, got, want [][]byte) {
	f.t.Helper()
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			f.t.Fatalf("%s: buffer %d %v differs", what, i, f.bufs[i])
		}
	}
}

// replayMatchesDirect is the core check of capture: for each input variant,
// the graph's launch leaves every buffer exactly as running step directly
// does; and capturing changes nothing.
func (f *fixture) replayMatchesDirect(step func() error, variants ...func()) {
	f.t.Helper()
	f.reset()
	before := f.snapshot()
	g := f.capture(step)
	f.checkSame("after capture (ops must not run)", f.snapshot(), before)

	for i, vary := range append([]func(){func() {}}, variants...) {
		vary()
		f.reset()
		if err := step(); err != nil {
			f.t.Fatalf("variant %d: direct: %v", i, err)
		}
		want := f.snapshot()
		for range 2 { // a graph launches any number of times
			f.reset()
			if err := g.Launch(); err != nil {
				f.t.Fatalf("variant %d: launch: %v", i, err)
			}
			f.checkSame("launch vs direct", f.snapshot(), want)
		}
	}
}

// moeStep is a small MoE layer forward: router GEMM, top-k, permute, NVFP4
// activations, grouped GEMMs (NVFP4 SwiGLU up, BF16 down) and finalize.
type moeStep struct {
	x, router, logits, ids, weights, offsets, rows, slots *kernels.Buffer
	xq, w1q                                               kernels.NVFP4
	up, w2, down, out                                     *kernels.Buffer
	all                                                   []*kernels.Buffer // every operand, in no particular order
}

const (
	moeT, moeH, moeE, moeK, moeI = 6, 32, 4, 2, 16
)

func newMoEStep(f *fixture) *moeStep {
	f.t.Helper()
	T, H, E, K, I := moeT, moeH, moeE, moeK, moeI
	s := &moeStep{
		x: f.randBF16(1, T, H), router: f.randBF16(0.5, E, H),
		logits: f.zeros(kernels.F32, T, E), ids: f.zeros(kernels.I32, T, K), weights: f.zeros(kernels.F32, T, K),
		offsets: f.zeros(kernels.I32, E+1), rows: f.zeros(kernels.I32, T*K), slots: f.zeros(kernels.I32, T*K),
		xq:  kernels.NVFP4{Packed: f.zeros(kernels.U8, T, H/2), Scales: f.zeros(kernels.U8, T, H/16), Scale: f.zeros(kernels.F32, T)},
		w1q: kernels.NVFP4{Packed: f.zeros(kernels.U8, E, 2*I, H/2), Scales: f.zeros(kernels.U8, E, 2*I, H/16), Scale: f.zeros(kernels.F32, E)},
		up:  f.zeros(kernels.BF16, T*K, I), w2: f.randBF16(0.2, E, H, I), down: f.zeros(kernels.BF16, T*K, H), out: f.zeros(kernels.BF16, T, H),
	}
	// The expert weights are quantized once, directly, like a load.
	w1 := f.randBF16(0.2, E, 2*I, H)
	if err := f.be.Quantize(kernels.QuantizeArgs{Src: w1, Dst: s.w1q, Mode: kernels.PerMatrix}); err != nil {
		f.t.Fatal(err)
	}
	for _, b := range []*kernels.Buffer{s.w1q.Packed, s.w1q.Scales, s.w1q.Scale} {
		raw := make([]byte, b.Size())
		if err := f.be.Download(raw, b, 0); err != nil {
			f.t.Fatal(err)
		}
		f.set(b, raw)
	}
	s.all = []*kernels.Buffer{s.x, s.router, s.logits, s.ids, s.weights, s.offsets, s.rows, s.slots,
		s.xq.Packed, s.xq.Scales, s.xq.Scale, s.w1q.Packed, s.w1q.Scales, s.w1q.Scale, s.up, s.w2, s.down, s.out}
	return s
}

func (s *moeStep) run(be kernels.Backend) error {
	for _, op := range []func() error{
		func() error { return be.Gemm(s.logits, s.x, s.router) },
		func() error {
			return be.Route(kernels.RouteArgs{Logits: s.logits, IDs: s.ids, Weights: s.weights,
				Scoring: kernels.Softmax, Renormalize: true, Scale: 1})
		},
		func() error {
			return be.Permute(kernels.PermuteArgs{IDs: s.ids, Offsets: s.offsets, Rows: s.rows, Slots: s.slots})
		},
		func() error { return be.Quantize(kernels.QuantizeArgs{Src: s.x, Dst: s.xq, Mode: kernels.PerRow}) },
		func() error {
			return be.GroupedGemm(kernels.GroupedGemmArgs{A: kernels.Operand{Q: s.xq}, Gather: s.rows,
				W: kernels.Operand{Q: s.w1q}, Offsets: s.offsets, Act: kernels.SwiGLU, Out: s.up})
		},
		func() error {
			return be.GroupedGemm(kernels.GroupedGemmArgs{A: kernels.Operand{BF16: s.up},
				W: kernels.Operand{BF16: s.w2}, Offsets: s.offsets, Act: kernels.Identity, Out: s.down})
		},
		func() error {
			return be.Finalize(kernels.FinalizeArgs{Out: s.out, Rows: s.down, Weights: s.weights, Slots: s.slots})
		},
	} {
		if err := op(); err != nil {
			return err
		}
	}
	return nil
}

func TestCaptureMoEStep(t *testing.T) {
	f := newFixture(t, 1)
	s := newMoEStep(f)
	f.replayMatchesDirect(func() error { return s.run(f.be) },
		func() { f.set(s.x, f.bf16Bytes(moeT*moeH, 1)) },
		func() { f.set(s.router, f.bf16Bytes(moeE*moeH, 3)) }, // new routing, same buffers
	)
}

// modelStep is a one-layer dense decode step of two sequences that touches
// every model op: embedding, norm, projections, RoPE, KV write, paged
// attention, residual add, LM head, sampling and scoring.
type modelStep struct {
	ids, table, norm, wq, wk, wv, wo, lm, h, hn, q, k, v, att, o, logits *kernels.Buffer
	pos, cos, sin, slots, pageTable, seqLens, queryStart                 *kernels.Buffer
	cache                                                                kernels.KVCache
	temp, topK, topP, seeds, sampleIDs, tokens, lps, lps2                *kernels.Buffer
}

const (
	mdT, mdH, mdQH, mdKVH, mdD, mdV, mdMaxPos, mdPages, mdPageSize = 2, 16, 2, 1, 8, 32, 16, 4, 4
)

func newModelStep(f *fixture) *modelStep {
	T, H, QH, KVH, D, V := mdT, mdH, mdQH, mdKVH, mdD, mdV
	cosT, sinT := make([]byte, 2*mdMaxPos*D/2), make([]byte, 2*mdMaxPos*D/2)
	for p := range mdMaxPos {
		for i := range D / 2 {
			a := float64(p) * math.Pow(10000, -2*float64(i)/float64(D))
			binary.LittleEndian.PutUint16(cosT[2*(p*D/2+i):], bf16.FromFloat32(float32(math.Cos(a))))
			binary.LittleEndian.PutUint16(sinT[2*(p*D/2+i):], bf16.FromFloat32(float32(math.Sin(a))))
		}
	}
	return &modelStep{
		ids: f.i32([]int32{3, 17}, T), table: f.randBF16(1, V, H), norm: f.randBF16(1, H),
		wq: f.randBF16(0.3, QH*D, H), wk: f.randBF16(0.3, KVH*D, H), wv: f.randBF16(0.3, KVH*D, H),
		wo: f.randBF16(0.3, H, QH*D), lm: f.randBF16(0.3, V, H),
		h: f.zeros(kernels.BF16, T, H), hn: f.zeros(kernels.BF16, T, H), q: f.zeros(kernels.BF16, T, QH*D),
		k: f.zeros(kernels.BF16, T, KVH*D), v: f.zeros(kernels.BF16, T, KVH*D), att: f.zeros(kernels.BF16, T, QH, D),
		o: f.zeros(kernels.BF16, T, H), logits: f.zeros(kernels.F32, T, V),
		// Sequence 0 has 3 tokens (the new one at position 2, slot 2),
		// sequence 1 has 2 (position 1, slot 9); pages 0,1 and 2,3.
		pos: f.i32([]int32{2, 1}, T), cos: f.buf(cosT, kernels.BF16, mdMaxPos, D/2), sin: f.buf(sinT, kernels.BF16, mdMaxPos, D/2),
		slots: f.i32([]int32{2, 9}, T), pageTable: f.i32([]int32{0, 1, 2, 3}, 2, 2), seqLens: f.i32([]int32{3, 2}, 2),
		queryStart: f.i32([]int32{0, 1, 2}, 3),
		cache:      kernels.KVCache{K: f.randBF16(1, mdPages, mdPageSize, KVH, D), V: f.randBF16(1, mdPages, mdPageSize, KVH, D)},
		temp:       f.f32([]float32{0.8, 1.2}, T), topK: f.i32([]int32{0, 5}, T), topP: f.f32([]float32{1, 0.9}, T),
		seeds: f.i32([]int32{7, 0, 8, 1}, T, 2), sampleIDs: f.i32([]int32{0, 1}, T),
		tokens: f.zeros(kernels.I32, T), lps: f.zeros(kernels.F32, T), lps2: f.zeros(kernels.F32, T),
	}
}

func (m *modelStep) run(t *testing.T, be kernels.Backend) error {
	view := func(b *kernels.Buffer, shape ...int) *kernels.Buffer {
		v, err := b.Reshape(shape...)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	q3, k3, v3 := view(m.q, mdT, mdQH, mdD), view(m.k, mdT, mdKVH, mdD), view(m.v, mdT, mdKVH, mdD)
	for _, op := range []func() error{
		func() error { return be.Embed(kernels.EmbedArgs{Out: m.h, Table: m.table, IDs: m.ids}) },
		func() error { return be.RMSNorm(kernels.RMSNormArgs{Out: m.hn, Src: m.h, Weight: m.norm, Eps: 1e-6}) },
		func() error { return be.Gemm(m.q, m.hn, m.wq) },
		func() error { return be.Gemm(m.k, m.hn, m.wk) },
		func() error { return be.Gemm(m.v, m.hn, m.wv) },
		func() error { return be.RoPE(kernels.RoPEArgs{X: q3, Positions: m.pos, Cos: m.cos, Sin: m.sin}) },
		func() error { return be.RoPE(kernels.RoPEArgs{X: k3, Positions: m.pos, Cos: m.cos, Sin: m.sin}) },
		func() error { return be.KVWrite(kernels.KVWriteArgs{Cache: m.cache, K: k3, V: v3, Slots: m.slots}) },
		func() error {
			return be.Attention(kernels.AttentionArgs{Out: m.att, Q: q3, Cache: m.cache, PageTable: m.pageTable,
				SeqLens: m.seqLens, QueryStart: m.queryStart, Scale: float32(1 / math.Sqrt(mdD))})
		},
		func() error { return be.Gemm(m.o, view(m.att, mdT, mdQH*mdD), m.wo) },
		func() error { return be.Add(kernels.AddArgs{Out: m.h, A: m.h, B: m.o}) },
		func() error { return be.Gemm(m.logits, m.h, m.lm) },
		func() error {
			return be.Sample(kernels.SampleArgs{Logits: m.logits, Temperature: m.temp, TopK: m.topK, TopP: m.topP,
				Seeds: m.seeds, SampleIDs: m.sampleIDs, Positions: m.pos, Tokens: m.tokens, LogProbs: m.lps})
		},
		func() error {
			return be.LogProbs(kernels.LogProbsArgs{Logits: m.logits, Tokens: m.tokens, LogProbs: m.lps2})
		},
	} {
		if err := op(); err != nil {
			return err
		}
	}
	return nil
}

func TestCaptureModelStep(t *testing.T) {
	f := newFixture(t, 2)
	m := newModelStep(f)
	f.replayMatchesDirect(func() error { return m.run(t, f.be) },
		func() { f.set(m.ids, i32Raw(5, 30)) },
		func() { f.set(m.seeds, i32Raw(1, 2, 3, 4)) },
		func() { f.set(m.pos, i32Raw(3, 0)); f.set(m.slots, i32Raw(3, 8)); f.set(m.seqLens, i32Raw(4, 1)) },
	)
}

// The graph lists exactly the buffers its ops name, each once.
func TestGraphBuffers(t *testing.T) {
	f := newFixture(t, 3)
	s := newMoEStep(f)
	g := f.capture(func() error { return s.run(f.be) })
	got := g.Buffers()
	if len(got) != len(s.all) {
		t.Fatalf("Buffers() has %d entries, want %d", len(got), len(s.all))
	}
	for _, b := range s.all {
		if !slices.Contains(got, b) {
			t.Fatalf("Buffers() lacks %v", b)
		}
	}

	// Views are listed as themselves; nil operands (no gather) are not.
	x2, _ := s.x.Rows(2)
	o2, _ := s.logits.Rows(2)
	g = f.capture(func() error { return f.be.Gemm(o2, x2, s.router) })
	if got := g.Buffers(); !slices.Equal(got, []*kernels.Buffer{o2, x2, s.router}) {
		t.Fatalf("Buffers() = %v, want the dst view, the a view and w", got)
	}
}

func TestCaptureRefusesMemoryOps(t *testing.T) {
	f := newFixture(t, 4)
	a, b := f.zeros(kernels.F32, 4), f.zeros(kernels.F32, 4)
	host := make([]byte, 16)
	for _, tc := range []struct {
		op string
		fn func() error
	}{
		{"alloc", func() error { _, err := f.be.Alloc(kernels.F32, 4); return err }},
		{"upload", func() error { return f.be.Upload(a, 0, host) }},
		{"download", func() error { return f.be.Download(host, a, 0) }},
		{"copy", func() error { return f.be.Copy(a, b) }},
		{"zero", func() error { return f.be.Zero(a) }},
		{"sync", func() error { return f.be.Sync() }},
		{"free", func() error { return f.be.Free(a) }}, // last: the others use a
	} {
		t.Run(tc.op, func(t *testing.T) {
			if err := f.be.BeginCapture(); err != nil {
				t.Fatal(err)
			}
			err := tc.fn()
			if !errors.Is(err, kernels.ErrCapturing) || !strings.Contains(err.Error(), tc.op) {
				t.Fatalf("%s during capture: %v, want ErrCapturing naming the op", tc.op, err)
			}
			g, err := f.be.EndCapture()
			if g != nil || !errors.Is(err, kernels.ErrCapturing) {
				t.Fatalf("EndCapture after a refused %s: %v, %v; want no graph and ErrCapturing", tc.op, g, err)
			}
			if err := tc.fn(); err != nil { // allowed again once the capture is over
				t.Fatalf("%s after capture: %v", tc.op, err)
			}
		})
	}
	if f.be.Live(a) {
		t.Fatal("the free subtest did not free a")
	}
}

func TestCaptureValidationError(t *testing.T) {
	f := newFixture(t, 5)
	s := newMoEStep(f)
	other, err := New(Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	foreign, err := other.Alloc(kernels.F32, moeT, moeE)
	if err != nil {
		t.Fatal(err)
	}
	lv, _ := s.logits.Reshape(moeT*moeE/moeK, moeK)
	aliased, _ := lv.Rows(moeT) // F32 [T, k] over the logits
	for _, tc := range []struct {
		name string
		bad  func() error
		is   error
		want string
	}{
		{"shape", func() error { return f.be.Gemm(s.logits, s.x, s.w2) }, nil, "gemm"},
		{"alias", func() error {
			return f.be.Route(kernels.RouteArgs{Logits: s.logits, IDs: s.ids, Weights: aliased, Scoring: kernels.Softmax, Scale: 1})
		}, nil, "route"},
		{"foreign", func() error { return f.be.Gemm(foreign, s.x, s.router) }, kernels.ErrForeignBuffer, "gemm"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			direct := tc.bad()
			if direct == nil {
				t.Fatal("the bad op succeeded outside capture")
			}
			if err := f.be.BeginCapture(); err != nil {
				t.Fatal(err)
			}
			if err := s.run(f.be); err != nil {
				t.Fatal(err)
			}
			err := tc.bad()
			if err == nil || err.Error() != direct.Error() {
				t.Fatalf("bad op during capture: %v, want the direct call's error %v", err, direct)
			}
			if err := f.be.Gemm(s.logits, s.x, s.router); err != nil { // later good ops are still accepted
				t.Fatal(err)
			}
			g, err := f.be.EndCapture()
			if g != nil || err == nil || !strings.Contains(err.Error(), "op 7 ("+tc.want) || !strings.Contains(err.Error(), direct.Error()) {
				t.Fatalf("EndCapture: %v, %v; want no graph and an error naming op 7 and %q", g, err, direct)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Fatalf("EndCapture: %v, want it to wrap %v", err, tc.is)
			}
		})
	}
}

func TestCaptureNesting(t *testing.T) {
	f := newFixture(t, 6)
	if _, err := f.be.EndCapture(); err == nil {
		t.Fatal("EndCapture without BeginCapture succeeded")
	}
	if err := f.be.BeginCapture(); err != nil {
		t.Fatal(err)
	}
	if err := f.be.BeginCapture(); err == nil {
		t.Fatal("nested BeginCapture succeeded")
	}
	g, err := f.be.EndCapture() // the outer capture is unharmed
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Launch(); err != nil { // an empty graph
		t.Fatal(err)
	}
	if _, err := f.be.EndCapture(); err == nil {
		t.Fatal("second EndCapture succeeded")
	}
}

// Data-dependent errors are not checked at capture (the data is not there
// yet); Launch reports them, naming the op.
func TestLaunchDataError(t *testing.T) {
	f := newFixture(t, 7)
	s := newMoEStep(f)
	g := f.capture(func() error { return s.run(f.be) })
	if err := g.Launch(); err != nil {
		t.Fatal(err)
	}
	bad := slices.Repeat(i32Raw(99), moeT*moeK)
	g2 := f.capture(func() error {
		return f.be.Permute(kernels.PermuteArgs{IDs: s.ids, Offsets: s.offsets, Rows: s.rows, Slots: s.slots})
	})
	f.set(s.ids, bad)
	err := g2.Launch()
	if err == nil || !strings.Contains(err.Error(), "op 0 (permute)") || !strings.Contains(err.Error(), "names expert 99") {
		t.Fatalf("Launch with expert 99: %v", err)
	}
	if err := g2.Destroy(); err != nil {
		t.Fatal(err)
	}
	if err := g2.Destroy(); err != nil {
		t.Fatal("second Destroy:", err)
	}
	if err := g2.Launch(); err == nil {
		t.Fatal("Launch after Destroy succeeded")
	}
	// A launch during a capture is refused, and fails the capture.
	if err := f.be.BeginCapture(); err != nil {
		t.Fatal(err)
	}
	if err := g.Launch(); !errors.Is(err, kernels.ErrCapturing) {
		t.Fatalf("Launch during capture: %v", err)
	}
	if _, err := f.be.EndCapture(); !errors.Is(err, kernels.ErrCapturing) {
		t.Fatalf("EndCapture after a launch during capture: %v", err)
	}
}

func TestLive(t *testing.T) {
	f := newFixture(t, 8)
	be := f.be
	b := f.zeros(kernels.BF16, 4, 8)
	v, _ := b.Slice(1, 3)
	full, _ := b.Rows(4)
	other, _ := New(Config{}, nil)
	ob, _ := other.Alloc(kernels.BF16, 4, 8)
	switch {
	case !be.Live(b), !be.Live(v), !be.Live(full):
		t.Fatal("a fresh buffer or its views are not live")
	case be.Live(nil), be.Live(ob):
		t.Fatal("nil or another backend's buffer is live")
	}
	if err := be.Free(b); err != nil {
		t.Fatal(err)
	}
	if be.Live(b) || be.Live(v) || be.Live(full) {
		t.Fatal("a freed buffer or its views are live")
	}

	// A new root at the freed root's address (the memory reused) is live;
	// the freed root is not, nor are its views... though the new root's own
	// views are.
	b2, err := kernels.NewHostBuffer(be, kernels.BF16, []int{4, 8}, b.Host(), b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	be.register(b2)
	v2, _ := b2.Slice(1, 3)
	switch {
	case !be.Live(b2), !be.Live(v2):
		t.Fatal("the re-allocation or its view is not live")
	case be.Live(b):
		t.Fatal("the freed root is live after a re-allocation at its address")
	}
	if err := be.Free(b2); err != nil {
		t.Fatal(err)
	}
	if be.Live(b2) || be.Live(v2) {
		t.Fatal("the re-allocation is live after Free")
	}
}

// A graph over a freed buffer is not launched at all.
func TestLaunchStaleBuffer(t *testing.T) {
	f := newFixture(t, 9)
	s := newMoEStep(f)
	g := f.capture(func() error { return s.run(f.be) })
	before := f.snapshot()
	if err := f.be.Free(s.up); err != nil {
		t.Fatal(err)
	}
	if err := g.Launch(); err == nil || !strings.Contains(err.Error(), "no longer live") {
		t.Fatalf("Launch over a freed buffer: %v", err)
	}
	f.checkSame("after a refused launch", f.snapshot(), before)
}

// The set of freed roots forgets roots the collector has reclaimed.
func TestFreedSetPrunes(t *testing.T) {
	be, _ := New(Config{}, nil)
	for i := range 500 {
		b, err := be.Alloc(kernels.U8, 8)
		if err != nil {
			t.Fatal(err)
		}
		if err := be.Free(b); err != nil {
			t.Fatal(err)
		}
		if i%50 == 0 {
			runtime.GC()
		}
	}
	if n := len(be.freed.m); n >= 500 {
		t.Fatalf("freed set holds all %d freed roots", n)
	}
}
