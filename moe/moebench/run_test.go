package moebench

import (
	"bytes"
	"context"
	"errors"
	"math"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
)

func newCPU(t *testing.T) *cpu.Backend {
	t.Helper()
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return be
}

// timed is a backend with an event timer and no graph capture: it counts
// the calls the timer makes.
type timed struct {
	kernels.Backend
	calls int
}

func (b *timed) Time(n int, fn func() error) (time.Duration, error) {
	for range n {
		b.calls++
		if err := fn(); err != nil {
			return 0, err
		}
	}
	return time.Microsecond, nil
}

// timedCapturer keeps the CPU backend's graph capture and adds the timer.
type timedCapturer struct {
	*cpu.Backend
	calls int
}

func (b *timedCapturer) Time(n int, fn func() error) (time.Duration, error) {
	b.calls += n
	for range n {
		if err := fn(); err != nil {
			return 0, err
		}
	}
	return time.Microsecond, nil
}

var tinyShape = moe.Config{Hidden: 48, Intermediate: 24, Experts: 4, TopK: 2, Activation: moe.SwiGLU, Scoring: moe.Softmax, Renormalize: true}

func TestRun(t *testing.T) {
	cfg := Config{Layer: tinyShape, Tokens: []int{1, 7}, Recipes: []moe.Recipe{moe.RecipePerToken, moe.RecipeBF16},
		Iters: 3, Warmup: 1, Inputs: 4, Seed: 5}
	var cosines []float64 // per mode: graph replays must compute what eager forwards do
	for _, tc := range []struct {
		name   string
		be     func(t *testing.T) (kernels.Backend, func() int)
		eager  bool
		timing string
	}{
		{"graphs", func(t *testing.T) (kernels.Backend, func() int) { return newCPU(t), nil }, false, "graphs+wall"},
		{"eager", func(t *testing.T) (kernels.Backend, func() int) { return newCPU(t), nil }, true, "eager+wall"},
		{"timer", func(t *testing.T) (kernels.Backend, func() int) {
			b := &timed{Backend: newCPU(t)}
			return b, func() int { return b.calls }
		}, false, "eager+events"},
		{"graphs and timer", func(t *testing.T) (kernels.Backend, func() int) {
			b := &timedCapturer{Backend: newCPU(t)}
			return b, func() int { return b.calls }
		}, false, "graphs+events"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be, calls := tc.be(t)
			c := cfg
			c.Eager = tc.eager
			var progress strings.Builder
			results, err := Run(context.Background(), be, c, &progress)
			if err != nil {
				t.Fatal(err)
			}
			if len(results) != 4 {
				t.Fatalf("%d results, want 2 batch sizes x 2 recipes", len(results))
			}
			for _, r := range results {
				if r.Timing != tc.timing || r.Mean <= 0 {
					t.Errorf("%d tokens %s: timing %q (want %q), mean %v", r.Tokens, r.Recipe, r.Timing, tc.timing, r.Mean)
				}
				if r.Floor != ForwardFloor(tinyShape, r.Tokens) {
					t.Errorf("%d tokens: floor %+v", r.Tokens, r.Floor)
				}
				if r.Recipe == moe.RecipeBF16 && (r.CosMean != 1 || r.CosMin != 1) {
					t.Errorf("bf16 against itself: %v %v", r.CosMean, r.CosMin)
				}
				if r.Recipe == moe.RecipePerToken && (r.CosMean < 0.9 || r.CosMin > r.CosMean) {
					t.Errorf("nvfp4 cosine mean %v, min %v", r.CosMean, r.CosMin)
				}
			}
			if calls != nil && calls() != len(results)*c.Iters {
				t.Errorf("timer ran %d calls, want %d", calls(), len(results)*c.Iters)
			}
			if !strings.Contains(progress.String(), "nvfp4") {
				t.Errorf("progress %q", progress.String())
			}
			var cos []float64
			for _, r := range results {
				cos = append(cos, r.CosMean, r.CosMin)
			}
			if cosines == nil {
				cosines = cos
			} else {
				for i := range cos {
					if cos[i] != cosines[i] {
						t.Errorf("cosines %v differ from the graph replays' %v: different outputs", cos, cosines)
						break
					}
				}
			}
		})
	}
}

func TestRunErrors(t *testing.T) {
	be := newCPU(t)
	ok := Config{Layer: tinyShape, Tokens: []int{2}, Recipes: []moe.Recipe{moe.RecipeBF16}, Iters: 1, Inputs: 1}
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"no bf16", func(c *Config) { c.Recipes = []moe.Recipe{moe.RecipePerToken} }, "must include"},
		{"twice", func(c *Config) { c.Recipes = []moe.Recipe{moe.RecipeBF16, moe.RecipeBF16} }, "listed twice"},
		{"zero tokens", func(c *Config) { c.Tokens = []int{0} }, "batch of 0 tokens"},
		{"no iters", func(c *Config) { c.Iters = 0 }, "iters >= 1"},
		{"bad shape", func(c *Config) { c.Layer.TopK = 9 }, "top-9 of 4 experts"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			tc.edit(&c)
			if _, err := Run(context.Background(), be, c, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Run(ctx, be, ok, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled run: %v", err)
	}
}

// corrupting flips the first code byte of every per-matrix quantization:
// the refit check must catch it.
type corrupting struct{ kernels.Backend }

func (b corrupting) Quantize(a kernels.QuantizeArgs) error {
	if err := b.Backend.Quantize(a); err != nil || a.Mode != kernels.PerMatrix {
		return err
	}
	return b.Upload(a.Dst.Packed, 0, []byte{0x5a})
}

func TestRunRefit(t *testing.T) {
	for _, tc := range []struct {
		name     string
		act      moe.Activation
		corrupt  bool
		mismatch string
	}{
		{"relu2", moe.ReLU2, false, ""},
		{"swiglu", moe.SwiGLU, false, ""},
		{"corrupted", moe.ReLU2, true, "fc1 codes differ from internal/nvfp4 first at byte 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var be kernels.Backend = newCPU(t)
			if tc.corrupt {
				be = corrupting{be}
			}
			cfg := RefitConfig{Layer: moe.Config{Hidden: 40, Intermediate: 20, Experts: 3, Activation: tc.act}, Iters: 2, Seed: 3}
			res, err := RunRefit(context.Background(), be, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if res.Mean <= 0 || res.Timing != "wall" || res.Iters != 2 || !res.SameAddresses {
				t.Errorf("result %+v", res)
			}
			read, written, floor := RequantizeFloor(cfg.Layer)
			if res.Read != read || res.Written != written || res.Floor != floor {
				t.Errorf("floor %v %v %v, want %v %v %v", res.Read, res.Written, res.Floor, read, written, floor)
			}
			if res.BitExact == tc.corrupt || !strings.HasPrefix(res.Mismatch, tc.mismatch) {
				t.Errorf("bit-exact %v, mismatch %q; want %v, %q", res.BitExact, res.Mismatch, !tc.corrupt, tc.mismatch)
			}
			var b strings.Builder
			if err := res.Report(&b, be.Name()); err != nil {
				t.Fatal(err)
			}
			if want := map[bool]string{false: "copies bit-exact", true: "copies FAILED: fc1 codes"}[tc.corrupt]; !strings.Contains(b.String(), want) {
				t.Errorf("report lacks %q:\n%s", want, b.String())
			}
		})
	}
	if _, err := RunRefit(context.Background(), newCPU(t), RefitConfig{Layer: moe.Config{Hidden: 8, Intermediate: 8, Experts: 1}}); err == nil {
		t.Error("zero iterations: no error")
	}
}

// TestRandomWeightsFast: the values do not depend on the number of cores,
// and they have the distribution RandomWeights has.
func TestRandomWeightsFast(t *testing.T) {
	n := 1<<20 + 77 // two chunks, the second partial
	prev := runtime.GOMAXPROCS(1)
	one := randomBF16Chunked(9, 2, n, 0.5)
	runtime.GOMAXPROCS(4)
	four := randomBF16Chunked(9, 2, n, 0.5)
	runtime.GOMAXPROCS(prev)
	if !bytes.Equal(one, four) {
		t.Fatal("values depend on GOMAXPROCS")
	}
	var sum, sq float64
	for _, v := range Floats(one) {
		sum += v
		sq += v * v
	}
	if mean, std := sum/float64(n), math.Sqrt(sq/float64(n)); math.Abs(mean) > 0.005 || math.Abs(std-0.5) > 0.005 {
		t.Errorf("mean %v, std %v; want 0, 0.5", mean, std)
	}
	w, ref := RandomWeightsFast(tinyShape, 1), RandomWeights(tinyShape, 1)
	if len(w.Router) != len(ref.Router) || len(w.FC1) != len(ref.FC1) || len(w.FC2) != len(ref.FC2) {
		t.Errorf("sizes %d %d %d, want %d %d %d", len(w.Router), len(w.FC1), len(w.FC2), len(ref.Router), len(ref.FC1), len(ref.FC2))
	}
}
