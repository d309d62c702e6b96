package trainref_test

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/moe/moebench"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
	"github.com/rollout-worker/rollout-worker/moe/trainref"
)

func bits(b []byte) []uint16 {
	out := make([]uint16, len(b)/2)
	for i := range out {
		out[i] = binary.LittleEndian.Uint16(b[2*i:])
	}
	return out
}

// TestGenerationVariantMatchesLayer: with generation's placements the
// reference is the CPU layer's arithmetic up to the order of FP32 additions,
// on shapes whose rows need padding, for both scoring functions (sigmoid with
// renormalisation and routed scaling) and both activations: the routing is
// the same, most outputs are the same bits and the rest within a few BF16
// ulps; the training forward is not.
func TestGenerationVariantMatchesLayer(t *testing.T) {
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	const T = 37
	for _, act := range []moe.Activation{moe.ReLU2, moe.SwiGLU} {
		for _, sc := range []moe.Scoring{moe.Softmax, moe.Sigmoid} {
			cfg := moe.Config{Hidden: 200, Intermediate: 72, Experts: 6, TopK: 2, Activation: act, Scoring: sc,
				Renormalize: sc == moe.Sigmoid, MaxTokens: T, Recipe: moe.RecipePerToken}
			if sc == moe.Sigmoid {
				cfg.RoutedScaling = 2.5
			}
			t.Run(fmt.Sprintf("%s_%s", act, sc), func(t *testing.T) {
				w := moebench.RandomWeights(cfg, 5)
				x := moebench.RandomBF16(rand.New(rand.NewPCG(5, 6)), T*cfg.Hidden, 1)
				l := moetest.NewLayer(t, be, cfg, w)
				gen := moebench.Floats(moetest.Forward(t, be, l, x))
				layerIDs := make([]byte, T*cfg.TopK*4)
				if err := be.Download(layerIDs, l.Routing(), 0); err != nil {
					t.Fatal(err)
				}

				ref, err := trainref.New(cfg, trainref.Weights{Router: bits(w.Router), FC1: bits(w.FC1), FC2: bits(w.FC2)})
				if err != nil {
					t.Fatal(err)
				}
				ids, _, err := ref.Route(bits(x))
				if err != nil {
					t.Fatal(err)
				}
				for i, id := range ids {
					if got := int32(binary.LittleEndian.Uint32(layerIDs[4*i:])); got != id {
						t.Fatalf("assignment %d: layer expert %d, reference %d", i, got, id)
					}
				}
				for _, v := range []trainref.Variant{trainref.Generation, {}} {
					out, err := ref.Forward(bits(x), v)
					if err != nil {
						t.Fatal(err)
					}
					got := moebench.Floats(bytesOf(out))
					var same int
					var dd, rr float64
					for i := range got {
						if got[i] == gen[i] {
							same++
						}
						dd += (got[i] - gen[i]) * (got[i] - gen[i])
						rr += gen[i] * gen[i]
					}
					rel := math.Sqrt(dd / rr)
					t.Logf("%+v: %d of %d outputs equal, rel err %.3g", v, same, len(got), rel)
					if v == trainref.Generation && (rel > 1e-3 || same < len(got)*9/10) {
						t.Errorf("generation variant: %d of %d outputs equal, rel err %.3g; want >= 90%% and < 1e-3", same, len(got), rel)
					}
					if v == (trainref.Variant{}) && rel < 5e-3 {
						t.Errorf("training forward: rel err %.3g to the layer, want the known differences to show (> 5e-3)", rel)
					}
				}
			})
		}
	}
}

func bytesOf(v []uint16) []byte {
	out := make([]byte, 2*len(v))
	for i, h := range v {
		binary.LittleEndian.PutUint16(out[2*i:], h)
	}
	return out
}

func TestNewErrors(t *testing.T) {
	good := moe.Config{Hidden: 32, Intermediate: 16, Experts: 4, TopK: 2, Activation: moe.ReLU2, Scoring: moe.Softmax}
	w := trainref.Weights{Router: make([]uint16, 4*32), FC1: make([]uint16, 4*16*32), FC2: make([]uint16, 4*32*16)}
	if _, err := trainref.New(good, w); err != nil {
		t.Fatalf("New: %v", err)
	}
	for _, tc := range []struct {
		name string
		edit func(*moe.Config, *trainref.Weights)
	}{
		{"zero hidden", func(c *moe.Config, _ *trainref.Weights) { c.Hidden = 0 }},
		{"top-k over experts", func(c *moe.Config, _ *trainref.Weights) { c.TopK = 5 }},
		{"unknown activation", func(c *moe.Config, _ *trainref.Weights) { c.Activation = "gelu" }},
		{"unknown scoring", func(c *moe.Config, _ *trainref.Weights) { c.Scoring = "topk" }},
		{"negative scaling", func(c *moe.Config, _ *trainref.Weights) { c.RoutedScaling = -1 }},
		{"NaN scaling", func(c *moe.Config, _ *trainref.Weights) { c.RoutedScaling = float32(math.NaN()) }},
		{"short FC1", func(_ *moe.Config, w *trainref.Weights) { w.FC1 = w.FC1[1:] }},
		{"swiglu with relu2's FC1", func(c *moe.Config, _ *trainref.Weights) { c.Activation = moe.SwiGLU }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, ww := good, w
			tc.edit(&cfg, &ww)
			if _, err := trainref.New(cfg, ww); err == nil {
				t.Fatalf("New(%+v) succeeded", cfg)
			}
		})
	}
	ref, err := trainref.New(good, w)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ref.Forward(make([]uint16, 33), trainref.Variant{}); err == nil {
		t.Error("Forward of 33 values with hidden 32 succeeded")
	}
	out, err := ref.Forward(make([]uint16, 2*32), trainref.Variant{})
	if err != nil || len(out) != 2*32 {
		t.Fatalf("Forward of 2 zero tokens: %d values, %v", len(out), err)
	}
	for i, v := range out {
		if v != 0 {
			t.Fatalf("zero weights, zero tokens: out[%d] = %#x", i, v)
		}
	}
}
