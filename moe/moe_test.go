package moe_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

func newBackend(t testing.TB) kernels.Backend {
	t.Helper()
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return be
}

func newLayer(t testing.TB, be kernels.Backend, cfg moe.Config, w moetest.Weights) *moe.Layer {
	t.Helper()
	l, err := moe.New(be, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := l.Close(); err != nil {
			t.Error(err)
		}
	})
	if err := moetest.Load(be, l, w); err != nil {
		t.Fatal(err)
	}
	return l
}

// run uploads x (BF16 bytes, T x H) and returns the layer's output bytes.
func run(t testing.TB, be kernels.Backend, l *moe.Layer, x []byte) []byte {
	t.Helper()
	H := l.Config().Hidden
	T := len(x) / 2 / H
	in, err := be.Alloc(kernels.BF16, T, H)
	if err != nil {
		t.Fatal(err)
	}
	out, err := be.Alloc(kernels.BF16, T, H)
	if err != nil {
		t.Fatal(err)
	}
	defer be.Free(in)
	defer be.Free(out)
	if err := be.Upload(in, 0, x); err != nil {
		t.Fatal(err)
	}
	if err := l.Forward(out, in); err != nil {
		t.Fatal(err)
	}
	if err := be.Sync(); err != nil {
		t.Fatal(err)
	}
	res := make([]byte, out.Size())
	if err := be.Download(res, out, 0); err != nil {
		t.Fatal(err)
	}
	return res
}

// TestNVFP4MatchesBF16 is the seed's accuracy check: the NVFP4 recipes stay
// within NVFP4's expected error of the BF16 recipe on the same weights
// (per-token cosine mean > 0.97, minimum > 0.95), for both activations and
// both scoring functions, on non-aligned shapes (padding inside the layer).
//
// With N(0, 1) tokens the mean sits near 0.981 (squared ReLU) and 0.973
// (SwiGLU) whatever the shape; the per-token minimum over 64 tokens
// depends on the width, since a cosine over fewer elements scatters more.
// At hidden 136-256 SwiGLU minima down to 0.91-0.95 were seen; from hidden
// 200 with intermediate >= 72 every seed tried stayed above 0.95.
func TestNVFP4MatchesBF16(t *testing.T) {
	be := newBackend(t)
	const T = 64
	for _, shape := range []struct{ h, i, e, k int }{{200, 72, 6, 2}, {1000, 328, 12, 3}} {
		for _, act := range []moe.Activation{moe.ReLU2, moe.SwiGLU} {
			for _, sc := range []moe.Scoring{moe.Softmax, moe.Sigmoid} {
				for seed := uint64(1); seed <= 3; seed++ {
					base := moe.Config{Hidden: shape.h, Intermediate: shape.i, Experts: shape.e, TopK: shape.k,
						Activation: act, Scoring: sc, Renormalize: sc == moe.Sigmoid, MaxTokens: T, Recipe: moe.RecipeBF16}
					name := fmt.Sprintf("h%d_i%d_e%d_k%d_%s_%s_seed%d", shape.h, shape.i, shape.e, shape.k, act, sc, seed)
					t.Run(name, func(t *testing.T) {
						w := moetest.RandomWeights(base, seed)
						x := moetest.RandomBF16(rand.New(rand.NewPCG(seed, 3)), T*shape.h, 1)
						ref := moetest.Floats(run(t, be, newLayer(t, be, base, w), x))
						for _, recipe := range []moe.Recipe{moe.RecipePerToken, moe.RecipeWeightOnly} {
							cfg := base
							cfg.Recipe = recipe
							got := moetest.Floats(run(t, be, newLayer(t, be, cfg, w), x))
							mean, minCos := moetest.Cosines(got, ref, shape.h)
							t.Logf("%s: cosine to bf16 mean %.4f min %.4f", recipe, mean, minCos)
							if !(mean > 0.97 && minCos > 0.95) {
								t.Errorf("%s: cosine to bf16 mean %.4f (want > 0.97), min %.4f (want > 0.95)", recipe, mean, minCos)
							}
						}
					})
				}
			}
		}
	}
}

// TestBatchInvariance is the seed's test: a token's output is bitwise the
// same alone and inside batches of 193 and 1024 tokens whose other tokens
// are 100x larger and routed to the same experts.
func TestBatchInvariance(t *testing.T) {
	be := newBackend(t)
	for _, recipe := range []moe.Recipe{moe.RecipePerToken, moe.RecipeBF16, moe.RecipeWeightOnly} {
		for _, act := range []moe.Activation{moe.ReLU2, moe.SwiGLU} {
			t.Run(fmt.Sprintf("%s_%s", recipe, act), func(t *testing.T) {
				cfg := moe.Config{Hidden: 96, Intermediate: 40, Experts: 8, TopK: 2, Activation: act,
					Scoring: moe.Softmax, MaxTokens: 1024, Recipe: recipe}
				l := newLayer(t, be, cfg, moetest.RandomWeights(cfg, 4))
				r := rand.New(rand.NewPCG(5, 6))
				target := moetest.RandomBF16(r, cfg.Hidden, 1)
				alone := run(t, be, l, target)
				// 100x the target routes to the same experts (the logits
				// scale, so their order does not change).
				big := make([]byte, len(target))
				for i := 0; i < len(target); i += 2 {
					v := bf16.ToFloat32(binary.LittleEndian.Uint16(target[i:]))
					binary.LittleEndian.PutUint16(big[i:], bf16.FromFloat32(100*v))
				}
				for _, n := range []int{193, 1024} {
					for _, pos := range []int{0, n / 2, n - 1} {
						batch := bytes.Repeat(big, n)
						copy(batch[pos*len(target):], target)
						out := run(t, be, l, batch)
						if got := out[pos*len(target) : (pos+1)*len(target)]; !bytes.Equal(got, alone) {
							t.Fatalf("batch %d, position %d: output differs from the token alone", n, pos)
						}
					}
				}
			})
		}
	}
}

// TestRequantizeInPlace: after the BF16 stacks change, Requantize leaves
// every NVFP4 buffer at its address and equal, bit for bit, to a fresh
// quantization of the new weights.
func TestRequantizeInPlace(t *testing.T) {
	be := newBackend(t)
	for _, act := range []moe.Activation{moe.ReLU2, moe.SwiGLU} {
		t.Run(string(act), func(t *testing.T) {
			cfg := moe.Config{Hidden: 200, Intermediate: 72, Experts: 6, TopK: 2, Activation: act,
				Scoring: moe.Softmax, MaxTokens: 8, Recipe: moe.RecipePerToken}
			l := newLayer(t, be, cfg, moetest.RandomWeights(cfg, 7))
			fc1, fc2 := l.Quantized()
			before := addrs(fc1, fc2)

			next := moetest.RandomWeights(cfg, 8)
			// Expert 2 of the new FC1 is all zero: its alpha must become 1.
			i1 := len(next.FC1) / cfg.Experts
			clear(next.FC1[2*i1 : 3*i1])
			for _, p := range []struct {
				dst *kernels.Buffer
				src []byte
			}{{l.FC1(), next.FC1}, {l.FC2(), next.FC2}} {
				if err := be.Upload(p.dst, 0, p.src); err != nil {
					t.Fatal(err)
				}
			}
			// Only expert 4 first: the others must still hold the old copy.
			old1 := download(t, be, fc1.Packed)
			if err := l.Requantize(4); err != nil {
				t.Fatal(err)
			}
			now1 := download(t, be, fc1.Packed)
			per := len(old1) / cfg.Experts
			for e := range cfg.Experts {
				changed := !bytes.Equal(now1[e*per:(e+1)*per], old1[e*per:(e+1)*per])
				if changed != (e == 4) {
					t.Fatalf("Requantize(4): expert %d changed = %v", e, changed)
				}
			}
			if err := l.Requantize(); err != nil {
				t.Fatal(err)
			}
			f1, f2 := l.Quantized()
			if after := addrs(f1, f2); after != before {
				t.Fatalf("NVFP4 buffers moved: %v -> %v", before, after)
			}
			rows1 := cfg.Intermediate
			if act == moe.SwiGLU {
				rows1 *= 2
			}
			checkFresh(t, be, fc1, next.FC1, cfg.Experts, rows1, cfg.Hidden)
			checkFresh(t, be, fc2, next.FC2, cfg.Experts, cfg.Hidden, cfg.Intermediate)
			if alpha := download(t, be, fc1.Scale); math.Float32frombits(binary.LittleEndian.Uint32(alpha[8:])) != 1 {
				t.Fatalf("alpha of the all-zero expert is not 1: % x", alpha[8:12])
			}
		})
	}
}

func addrs(qs ...kernels.NVFP4) [6]uintptr {
	var a [6]uintptr
	for i, q := range qs {
		a[3*i], a[3*i+1], a[3*i+2] = q.Packed.Addr(), q.Scales.Addr(), q.Scale.Addr()
	}
	return a
}

func download(t *testing.T, be kernels.Backend, b *kernels.Buffer) []byte {
	t.Helper()
	out := make([]byte, b.Size())
	if err := be.Download(out, b, 0); err != nil {
		t.Fatal(err)
	}
	return out
}

// checkFresh compares q with the codec's quantization of src, per expert.
func checkFresh(t *testing.T, be kernels.Backend, q kernels.NVFP4, src []byte, e, n, k int) {
	t.Helper()
	vals := make([]uint16, len(src)/2)
	for i := range vals {
		vals[i] = binary.LittleEndian.Uint16(src[2*i:])
	}
	kp := nvfp4.PaddedK(k)
	mp, ms := n*kp/2, n*kp/nvfp4.BlockSize
	packed, scales, alpha := make([]byte, e*mp), make([]byte, e*ms), make([]byte, 4*e)
	for x := range e {
		s, err := nvfp4.QuantizeMatrix(packed[x*mp:(x+1)*mp], scales[x*ms:(x+1)*ms], vals[x*n*k:(x+1)*n*k], n, k)
		if err != nil {
			t.Fatal(err)
		}
		binary.LittleEndian.PutUint32(alpha[4*x:], math.Float32bits(s))
	}
	for _, c := range []struct {
		name      string
		got, want []byte
	}{{"packed", download(t, be, q.Packed), packed}, {"scales", download(t, be, q.Scales), scales}, {"alpha", download(t, be, q.Scale), alpha}} {
		if !bytes.Equal(c.got, c.want) {
			t.Fatalf("%s differs from a fresh quantization", c.name)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	be := newBackend(t)
	good := moe.Config{Hidden: 32, Intermediate: 16, Experts: 4, TopK: 2, Activation: moe.ReLU2,
		Scoring: moe.Softmax, MaxTokens: 4, Recipe: moe.RecipePerToken}
	for _, tc := range []struct {
		name string
		edit func(*moe.Config)
	}{
		{"zero hidden", func(c *moe.Config) { c.Hidden = 0 }},
		{"top-k over experts", func(c *moe.Config) { c.TopK = 5 }},
		{"zero top-k", func(c *moe.Config) { c.TopK = 0 }},
		{"no max tokens", func(c *moe.Config) { c.MaxTokens = 0 }},
		{"negative scaling", func(c *moe.Config) { c.RoutedScaling = -1 }},
		{"unknown recipe", func(c *moe.Config) { c.Recipe = "per_tensor" }},
		{"unknown activation", func(c *moe.Config) { c.Activation = "gelu" }},
		{"unknown scoring", func(c *moe.Config) { c.Scoring = "topk" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := good
			tc.edit(&cfg)
			if l, err := moe.New(be, cfg); err == nil {
				l.Close()
				t.Fatalf("New(%+v) succeeded", cfg)
			}
		})
	}
	l, err := moe.New(be, good)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Requantize(7); err == nil {
		t.Error("Requantize(7) of 4 experts succeeded")
	}
	x, _ := be.Alloc(kernels.BF16, 5, 32)
	if err := l.Forward(x, x); err == nil {
		t.Error("Forward of 5 tokens with MaxTokens 4 succeeded")
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := l.Requantize(); err != moe.ErrClosed {
		t.Fatalf("Requantize after Close: %v, want ErrClosed", err)
	}
}

// BenchmarkForward times the CPU MoE forward per recipe and batch size.
func BenchmarkForward(b *testing.B) {
	be := newBackend(b)
	for _, act := range []moe.Activation{moe.ReLU2, moe.SwiGLU} {
		for _, recipe := range []moe.Recipe{moe.RecipeBF16, moe.RecipePerToken} {
			for _, T := range []int{1, 16, 128} {
				cfg := moe.Config{Hidden: 1024, Intermediate: 512, Experts: 16, TopK: 4, Activation: act,
					Scoring: moe.Softmax, Renormalize: true, MaxTokens: T, Recipe: recipe}
				b.Run(fmt.Sprintf("%s/%s/tokens=%d", act, recipe, T), func(b *testing.B) {
					l := newLayer(b, be, cfg, moetest.RandomWeights(cfg, 1))
					in, _ := be.Alloc(kernels.BF16, T, cfg.Hidden)
					out, _ := be.Alloc(kernels.BF16, T, cfg.Hidden)
					if err := be.Upload(in, 0, moetest.RandomBF16(rand.New(rand.NewPCG(1, 1)), T*cfg.Hidden, 1)); err != nil {
						b.Fatal(err)
					}
					for b.Loop() {
						if err := l.Forward(out, in); err != nil {
							b.Fatal(err)
						}
					}
					b.ReportMetric(float64(T*b.N)/b.Elapsed().Seconds(), "tokens/s")
				})
			}
		}
	}
}
