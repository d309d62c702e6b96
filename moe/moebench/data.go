package moebench

// Seeded random weights and inputs, loading them into a layer, and the
// per-token cosine similarity the accuracy targets are stated in: shared by
// the benchmark and the layer's tests.

import (
	"encoding/binary"
	"math"
	"math/rand/v2"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
)

// Weights are a layer's BF16 weights as little-endian bytes.
type Weights struct{ Router, FC1, FC2 []byte }

// RandomWeights draws weights for cfg, scaled so that router logits and
// expert activations are O(1) for N(0, 1) inputs.
func RandomWeights(cfg moe.Config, seed uint64) Weights {
	r := rand.New(rand.NewPCG(seed, 99))
	i1 := cfg.Intermediate
	if cfg.Activation == moe.SwiGLU {
		i1 *= 2
	}
	return Weights{
		Router: RandomBF16(r, cfg.Experts*cfg.Hidden, 1/math.Sqrt(float64(cfg.Hidden))),
		FC1:    RandomBF16(r, cfg.Experts*i1*cfg.Hidden, 1/math.Sqrt(float64(cfg.Hidden))),
		FC2:    RandomBF16(r, cfg.Experts*cfg.Hidden*cfg.Intermediate, 1/math.Sqrt(float64(cfg.Intermediate))),
	}
}

// RandomBF16 returns n BF16 values from N(0, std^2) as little-endian bytes.
func RandomBF16(r *rand.Rand, n int, std float64) []byte {
	out := make([]byte, 2*n)
	for i := range n {
		binary.LittleEndian.PutUint16(out[2*i:], bf16.FromFloat32(float32(r.NormFloat64()*std)))
	}
	return out
}

// Load writes w into the layer's BF16 weights and requantizes its copies.
func Load(be kernels.Backend, l *moe.Layer, w Weights) error {
	for _, p := range []struct {
		dst *kernels.Buffer
		src []byte
	}{{l.Router(), w.Router}, {l.FC1(), w.FC1}, {l.FC2(), w.FC2}} {
		if err := be.Upload(p.dst, 0, p.src); err != nil {
			return err
		}
	}
	return l.Requantize()
}

// Floats decodes little-endian BF16 bytes.
func Floats(b []byte) []float64 {
	out := make([]float64, len(b)/2)
	for i := range out {
		out[i] = float64(bf16.ToFloat32(binary.LittleEndian.Uint16(b[2*i:])))
	}
	return out
}

// Cosines returns the mean and the minimum over tokens of the cosine
// similarity between got and ref, both T x H row-major. Two zero rows count
// as identical.
func Cosines(got, ref []float64, h int) (mean, minimum float64) {
	t := len(ref) / h
	minimum = 1
	for tok := range t {
		var ab, aa, bb float64
		for i := tok * h; i < (tok+1)*h; i++ {
			ab += got[i] * ref[i]
			aa += got[i] * got[i]
			bb += ref[i] * ref[i]
		}
		c := 1.0
		if aa > 0 || bb > 0 {
			c = ab / math.Sqrt(aa*bb)
		}
		mean += c
		minimum = min(minimum, c)
	}
	return mean / float64(t), minimum
}
