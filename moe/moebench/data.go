package moebench

// Seeded random weights and inputs, loading them into a layer, and the
// per-token cosine similarity the accuracy targets are stated in: shared by
// the benchmark and the layer's tests.

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"runtime"
	"sync"

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

// RandomWeightsFast draws weights from the same distributions as
// RandomWeights but from a different stream: each 1 Mi-value chunk has its
// own generator, so the chunks are drawn on all cores and the result does
// not depend on how many there are. The benchmark needs it at the DeepSeek-V3
// layer's shapes (7.5 billion weights, a minute on one core); the layer's tests keep
// RandomWeights, whose values their accuracy figures were taken with.
func RandomWeightsFast(cfg moe.Config, seed uint64) Weights {
	i1 := cfg.Intermediate
	if cfg.Activation == moe.SwiGLU {
		i1 *= 2
	}
	return Weights{
		Router: randomBF16Chunked(seed, 1, cfg.Experts*cfg.Hidden, 1/math.Sqrt(float64(cfg.Hidden))),
		FC1:    randomBF16Chunked(seed, 2, cfg.Experts*i1*cfg.Hidden, 1/math.Sqrt(float64(cfg.Hidden))),
		FC2:    randomBF16Chunked(seed, 3, cfg.Experts*cfg.Hidden*cfg.Intermediate, 1/math.Sqrt(float64(cfg.Intermediate))),
	}
}

// randomBF16Chunked is RandomBF16 with one generator per chunk of values,
// keyed by (seed, stream, chunk index), drawn in parallel.
func randomBF16Chunked(seed, stream uint64, n int, std float64) []byte {
	const chunk = 1 << 20
	out := make([]byte, 2*n)
	chunks := (n + chunk - 1) / chunk
	next := make(chan int, chunks)
	for c := range chunks {
		next <- c
	}
	close(next)
	var wg sync.WaitGroup
	for range min(chunks, runtime.GOMAXPROCS(0)) {
		wg.Go(func() {
			for c := range next {
				r := rand.New(rand.NewPCG(seed, stream<<40|uint64(c)))
				for i := c * chunk; i < min(n, (c+1)*chunk); i++ {
					binary.LittleEndian.PutUint16(out[2*i:], bf16.FromFloat32(float32(r.NormFloat64()*std)))
				}
			}
		})
	}
	wg.Wait()
	return out
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
		c := cosine(ab, aa, bb)
		mean += c
		minimum = min(minimum, c)
	}
	return mean / float64(t), minimum
}

// cosine is ab / sqrt(aa * bb), 1 for two zero vectors (and 0 when only
// one is zero).
func cosine(ab, aa, bb float64) float64 {
	if aa == 0 && bb == 0 {
		return 1
	}
	if aa == 0 || bb == 0 {
		return 0
	}
	return ab / math.Sqrt(aa*bb)
}

// cosineStats accumulates per-token cosines over several batches of BF16
// rows without decoding whole batches to float64 (at 4096 tokens x 7168 x
// 4 inputs that would be a gigabyte per recipe).
type cosineStats struct {
	sum, min float64
	n        int
}

// add folds in the rows of got against ref, both little-endian BF16 T x h.
func (s *cosineStats) add(got, ref []byte, h int) {
	if s.n == 0 {
		s.min = 1
	}
	for lo := 0; lo+2*h <= len(ref); lo += 2 * h {
		var ab, aa, bb float64
		for i := lo; i < lo+2*h; i += 2 {
			a := float64(bf16.ToFloat32(binary.LittleEndian.Uint16(got[i:])))
			b := float64(bf16.ToFloat32(binary.LittleEndian.Uint16(ref[i:])))
			ab += a * b
			aa += a * a
			bb += b * b
		}
		c := cosine(ab, aa, bb)
		s.sum += c
		s.min = min(s.min, c)
		s.n++
	}
}

// result returns the mean and the minimum (1, 1 for no rows).
func (s *cosineStats) result() (mean, minimum float64) {
	if s.n == 0 {
		return 1, 1
	}
	return s.sum / float64(s.n), s.min
}
