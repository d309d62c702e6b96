package moetest

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/moe/moebench"
	"github.com/rollout-worker/rollout-worker/moe/trainref"
)

// testTrainGenParity is the train-gen parity check: the generation path
// (the layer with the per-token NVFP4 recipe) against the training side's
// NVFP4 forward (moe/trainref) and against the BF16 recipe, on the same
// weights and tokens, for both activations. A relative error is ||gen -
// ref|| / ||ref||, over the whole output (Frobenius) and per token.
//
// Asserted: the reference routes every token as the layer does; the
// generation path is closer to the training forward than half its distance
// to the BF16 recipe, over the whole output and for every token (the
// criterion of the public comparison of Megatron's NVFP4 MoE with
// Transformer Engine's NVFP4 training); and the reference moved onto
// generation's placements (trainref.Generation, which differs from the
// layer only in the order of FP32 additions) is within 1e-3 of the layer.
// The two single-difference variants are logged, not asserted: taking one
// of generation's placements does not reliably bring the reference closer
// to the layer (squared ReLU with the routing weight after FC2: 0.0323
// against the training forward's 0.0320); docs/MOE.md ("Train-gen parity")
// records the figures and why.
func testTrainGenParity(t *testing.T, be kernels.Backend) {
	const T = 64
	for _, act := range []moe.Activation{moe.ReLU2, moe.SwiGLU} {
		t.Run(string(act), func(t *testing.T) {
			cfg := moe.Config{Hidden: 1024, Intermediate: 512, Experts: 16, TopK: 4, Activation: act,
				Scoring: moe.Softmax, Renormalize: true, MaxTokens: T, Recipe: moe.RecipePerToken}
			w := moebench.RandomWeightsFast(cfg, 1)
			x := moebench.RandomBF16(rand.New(rand.NewPCG(1, 3)), T*cfg.Hidden, 1)

			l := NewLayer(t, be, cfg, w)
			gen := moebench.Floats(Forward(t, be, l, x))
			layerIDs := download(t, be, l.Routing())
			bcfg := cfg
			bcfg.Recipe = moe.RecipeBF16
			bf := moebench.Floats(Forward(t, be, NewLayer(t, be, bcfg, w), x))

			ref, err := trainref.New(cfg, trainref.Weights{Router: bits(w.Router), FC1: bits(w.FC1), FC2: bits(w.FC2)})
			if err != nil {
				t.Fatal(err)
			}
			xs := bits(x)
			ids, _, err := ref.Route(xs)
			if err != nil {
				t.Fatal(err)
			}
			for i, id := range ids {
				if got := int32(binary.LittleEndian.Uint32(layerIDs[4*i:])); got != id {
					t.Fatalf("token %d, slot %d: the layer routes to expert %d, the reference to %d", i/cfg.TopK, i%cfg.TopK, got, id)
				}
			}

			bfFrob, bfTok := relErr(gen, bf, cfg.Hidden)
			for _, vr := range []struct {
				name string
				v    trainref.Variant
			}{
				{"train", trainref.Variant{}},
				{"train, probs after FC2", trainref.Variant{ProbsAfterFC2: true}},
				{"train, FP32 FC1", trainref.Variant{FP32FC1: true}},
				{"gen placements", trainref.Generation},
			} {
				out, err := ref.Forward(xs, vr.v)
				if err != nil {
					t.Fatal(err)
				}
				frob, tok := relErr(gen, moebench.Floats(bitsBytes(out)), cfg.Hidden)
				t.Logf("gen vs %-24s rel err %.3g, per-token max %.3g", vr.name+":", frob, maxOf(tok))
				switch vr.v {
				case trainref.Variant{}:
					if !(frob < bfFrob/2) {
						t.Errorf("rel err to the training forward %.4f, want < half the rel err to bf16 (%.4f)", frob, bfFrob)
					}
					var worst float64
					for i := range tok {
						worst = max(worst, tok[i]/bfTok[i])
						if !(tok[i] < bfTok[i]/2) {
							t.Errorf("token %d: rel err to the training forward %.4f, want < half the rel err to bf16 (%.4f)", i, tok[i], bfTok[i])
						}
					}
					t.Logf("largest per-token ratio of the rel errs to train and to bf16: %.3f", worst)
				case trainref.Generation:
					if !(frob < 1e-3) {
						t.Errorf("rel err to the reference with generation's placements %.2g, want < 1e-3 (only FP32 accumulation order differs)", frob)
					}
				}
			}
			t.Logf("gen vs %-24s rel err %.3g, per-token max %.3g", "bf16:", bfFrob, maxOf(bfTok))
		})
	}
}

// relErr returns ||got - ref|| / ||ref|| over the whole T x h output
// (Frobenius) and for each token. A zero reference gives 0 where got is
// zero too, else +Inf.
func relErr(got, ref []float64, h int) (frob float64, perToken []float64) {
	ratio := func(d, r float64) float64 {
		switch {
		case r > 0:
			return math.Sqrt(d / r)
		case d > 0:
			return math.Inf(1)
		}
		return 0
	}
	var dd, rr float64
	for t := 0; t < len(ref)/h; t++ {
		var d, r float64
		for i := t * h; i < (t+1)*h; i++ {
			e := got[i] - ref[i]
			d += e * e
			r += ref[i] * ref[i]
		}
		dd, rr = dd+d, rr+r
		perToken = append(perToken, ratio(d, r))
	}
	return ratio(dd, rr), perToken
}

func maxOf(v []float64) float64 {
	var m float64
	for _, x := range v {
		m = max(m, x)
	}
	return m
}

// bits decodes little-endian BF16 bytes into bit patterns.
func bits(b []byte) []uint16 {
	out := make([]uint16, len(b)/2)
	for i := range out {
		out[i] = binary.LittleEndian.Uint16(b[2*i:])
	}
	return out
}

// bitsBytes encodes BF16 bit patterns as little-endian bytes.
func bitsBytes(v []uint16) []byte {
	out := make([]byte, 2*len(v))
	for i, h := range v {
		binary.LittleEndian.PutUint16(out[2*i:], h)
	}
	return out
}
