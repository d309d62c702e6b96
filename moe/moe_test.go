package moe_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/moe/moebench"
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

// TestLayer runs the layer's acceptance suite on the CPU backend.
func TestLayer(t *testing.T) { moetest.Run(t, newBackend) }

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
		{"unknown recipe", func(c *moe.Config) { c.Recipe = "per_channel" }},
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
	x := mustAlloc(t, be, kernels.BF16, 5, 32)
	x4, err := x.Rows(4)
	if err != nil {
		t.Fatal(err)
	}
	out := mustAlloc(t, be, kernels.BF16, 4, 32)
	if err := l.Forward(out, x4); !errors.Is(err, moe.ErrNotQuantized) {
		t.Errorf("Forward before Requantize: %v, want ErrNotQuantized", err)
	}
	if err := l.Requantize(); err != nil {
		t.Fatal(err)
	}
	if err := l.Forward(out, x4); err != nil {
		t.Errorf("Forward after Requantize: %v", err)
	}
	if err := l.Requantize(7); err == nil {
		t.Error("Requantize(7) of 4 experts succeeded")
	}
	if err := l.Forward(mustAlloc(t, be, kernels.BF16, 5, 32), x); err == nil {
		t.Error("Forward of 5 tokens with MaxTokens 4 succeeded")
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := l.Requantize(); !errors.Is(err, moe.ErrClosed) {
		t.Fatalf("Requantize after Close: %v, want ErrClosed", err)
	}
	if err := l.Forward(out, x4); !errors.Is(err, moe.ErrClosed) {
		t.Fatalf("Forward after Close: %v, want ErrClosed", err)
	}
}

func mustAlloc(t testing.TB, be kernels.Backend, dt kernels.DType, shape ...int) *kernels.Buffer {
	t.Helper()
	b, err := be.Alloc(dt, shape...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Free(b) })
	return b
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
					l := moetest.NewLayer(b, be, cfg, moebench.RandomWeights(cfg, 1))
					in, out := mustAlloc(b, be, kernels.BF16, T, cfg.Hidden), mustAlloc(b, be, kernels.BF16, T, cfg.Hidden)
					if err := be.Upload(in, 0, moebench.RandomBF16(rand.New(rand.NewPCG(1, 1)), T*cfg.Hidden, 1)); err != nil {
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

// TestSetQuantized: copies written as given (a quantized checkpoint's)
// count as built expert by expert, alone or with requantized experts; the
// bytes land in the expert's place; bad sizes, experts out of range and
// recipes without copies are refused, and a refusal changes nothing.
func TestSetQuantized(t *testing.T) {
	be := newBackend(t)
	cfg := moe.Config{Hidden: 32, Intermediate: 16, Experts: 4, TopK: 2, Activation: moe.SwiGLU,
		Scoring: moe.Softmax, MaxTokens: 4, Recipe: moe.RecipePerToken}
	l, err := moe.New(be, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	matrix := func(rows, k int, fill byte, scale float32) moe.QuantizedMatrix {
		m := moe.QuantizedMatrix{Packed: make([]byte, rows*k/2), Scales: make([]byte, rows*k/16), Scale: scale}
		for i := range m.Packed {
			m.Packed[i] = fill
		}
		for i := range m.Scales {
			m.Scales[i] = 0x38 // 1.0
		}
		return m
	}
	fc1, fc2 := matrix(32, 32, 0x21, 0.5), matrix(32, 16, 0x12, 0.25)
	x, out := mustAlloc(t, be, kernels.BF16, 4, 32), mustAlloc(t, be, kernels.BF16, 4, 32)
	for _, e := range []int{0, 1, 2} {
		if err := l.SetQuantized(e, fc1, fc2); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Forward(out, x); !errors.Is(err, moe.ErrNotQuantized) {
		t.Fatalf("Forward with expert 3 not built: %v, want ErrNotQuantized", err)
	}
	if err := l.Requantize(3); err != nil {
		t.Fatal(err)
	}
	if err := l.Forward(out, x); err != nil {
		t.Fatalf("Forward with experts 0-2 set and 3 requantized: %v", err)
	}
	q1, q2 := l.Quantized()
	got := make([]byte, len(fc1.Packed))
	if err := be.Download(got, q1.Packed, 2*len(fc1.Packed)); err != nil {
		t.Fatal(err)
	}
	alpha := make([]byte, 4)
	if err := be.Download(alpha, q2.Scale, 4*2); err != nil {
		t.Fatal(err)
	}
	if got[0] != 0x21 || got[len(got)-1] != 0x21 || alpha[3] != 0x3e { // 0.25 = 0x3e800000
		t.Fatalf("expert 2's copies: codes % x.., FC2 alpha % x", got[:4], alpha)
	}
	for _, tc := range []struct {
		name     string
		e        int
		fc1, fc2 moe.QuantizedMatrix
	}{
		{"expert out of range", 4, fc1, fc2},
		{"FC1 rows short", 1, matrix(16, 32, 0, 1), fc2},
		{"FC2 K wrong", 1, fc1, matrix(32, 32, 0, 1)},
	} {
		if err := l.SetQuantized(tc.e, tc.fc1, tc.fc2); err == nil {
			t.Errorf("%s: SetQuantized succeeded", tc.name)
		}
	}
	if err := l.Forward(out, x); err != nil {
		t.Fatalf("Forward after refused SetQuantized calls: %v", err)
	}
	cfg.Recipe = moe.RecipeBF16
	lb, err := moe.New(be, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer lb.Close()
	if err := lb.SetQuantized(0, fc1, fc2); err == nil {
		t.Error("SetQuantized under the bf16 recipe succeeded")
	}
}
