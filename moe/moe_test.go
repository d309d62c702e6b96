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
