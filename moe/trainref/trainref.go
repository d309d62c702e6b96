// Package trainref is a pure-Go reference of the training side's NVFP4 MoE
// forward: what the RL trainer computes for the same layer, weights and
// tokens as the generation path (moe.Layer with moe.RecipePerToken). The
// train-gen parity test (moe/moetest) measures how far the two are apart.
//
// The training side is Transformer Engine's NVFP4BlockScaling recipe in a
// Megatron MoE layer, configured as the generation path is: activations
// quantized with one global scale per token (row-scaled), 1x16 blocks, E4M3
// block scales, FP32 global scales, no random Hadamard transform, no
// stochastic rounding (round to nearest even). Every quantizer here is
// internal/nvfp4's (docs/NVFP4.md), and the expert weights are the BF16
// stacks quantized by that recipe, so both sides quantize the same BF16
// values to the same bits. For T tokens the reference computes:
//
//  1. The router, exactly as the layer's: FP32 logits from the BF16 inputs
//     and router weights, summed in the CPU backend's order (four
//     interleaved lanes), then softmax or sigmoid, top-k (ties to the lower
//     expert id), renormalisation and routed scaling as kernels.Route
//     specifies them. On the CPU backend the routing is the layer's, bit
//     for bit.
//  2. x quantized per token.
//  3. FC1 against the quantized FC1 stack with FP32 accumulation: each
//     16-element block's sum of products is exact in FP32 (its elements are
//     E2M1 codes times the block's two E4M3 scales), and the blocks are added
//     in k order into one FP32 accumulator, as a block-scaled MMA adds one
//     scaled block at a time. The accumulator is multiplied by
//     RN(per_token_scale * alpha), the two global decode scales combined
//     into one GEMM alpha, and rounded to BF16: FC1's output type.
//  4. The activation in FP32 on those BF16 values (squared ReLU relu(h)^2,
//     or SwiGLU silu(gate) * up), multiplied in FP32 by the token's routing
//     weight and rounded to BF16 once (Megatron's fused weighted activations
//     weighted_squared_relu and weighted_swiglu; eager PyTorch would round
//     the activation to BF16 before the multiplication, one more BF16 step).
//  5. That row quantized per row, FC2 as FC1 (no activation), output
//     rounded to BF16.
//  6. The token's k rows, already weighted, added in FP32 in k order and
//     rounded to BF16 once (Transformer Engine's fused unpermute).
//
// How this differs from the generation path (docs/NVFP4.md section 5,
// docs/MOE.md "Train-gen parity", which has the figures):
//
//   - FC1's output rounding. Training rounds FC1's scaled accumulators to
//     BF16 and applies the activation to the rounded values; generation
//     fuses the activation into FC1's epilogue on the FP32 values and rounds
//     once after it.
//   - Where the routing weight enters. Training scales FC2's input by it
//     before FC2's quantizer; generation applies it in the finalize,
//     out = bf16(sum_j RN(w_j * y_j)), after FC2. With per-token scales
//     FC2's quantizer is nearly indifferent to a scale on its row, so this
//     moves the BF16 roundings rather than the scales; elements and blocks
//     near a decision boundary take the neighbouring code or block scale.
//   - FP32 accumulation order and scale association. Generation adds
//     element products in four interleaved FP32 lanes on the CPU (in fixed
//     k16 slices on the GPU) and applies acc * per_token_scale * alpha as two
//     roundings; the reference adds exact block sums in k order and applies
//     one combined scale. Both change only the last bits of FP32, which
//     rarely decide a BF16 rounding.
//
// A Variant moves the reference onto the generation path one difference at a
// time, to measure what each contributes; Generation takes both placement
// differences, leaving only the FP32 order and association.
package trainref

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/moe"
)

// Weights are a layer's BF16 weights as bit patterns, in the layer's
// layouts: Router [E, H], FC1 [E, I1, H] (I1 = 2I for SwiGLU: the I gate
// rows, then the I up rows), FC2 [E, H, I].
type Weights struct{ Router, FC1, FC2 []uint16 }

// Variant selects where the reference follows the generation path instead
// of the training forward. The zero value is the training forward.
type Variant struct {
	// FP32FC1 applies the activation to FC1's scaled FP32 accumulators and
	// rounds to BF16 once after it, as generation's fused epilogue does,
	// instead of rounding FC1's output to BF16 first.
	FP32FC1 bool
	// ProbsAfterFC2 leaves FC2's input unweighted and applies the routing
	// weights in the finalize, out = bf16(sum_j RN(w_j * y_j)), as
	// generation does, instead of to the activation's output.
	ProbsAfterFC2 bool
}

// Generation is the variant with both of generation's placements: it
// differs from the generation path only in the order of FP32 additions and
// the association of the two global scales.
var Generation = Variant{FP32FC1: true, ProbsAfterFC2: true}

// Reference is one MoE layer's weights, with the expert stacks quantized.
// It is immutable after New and safe for concurrent use.
type Reference struct {
	cfg      moe.Config
	router   []uint16 // BF16 [E, H]
	fc1, fc2 stack
}

// stack is an NVFP4 expert stack [E, N, Kp]: codes, block scales and one
// decode scale (alpha) per expert.
type stack struct {
	packed, scales []byte
	alpha          []float32
	n, kp          int
}

// New quantizes the expert stacks of w with one global scale per expert
// (nvfp4.QuantizeMatrix, the generation path's weight recipe). Only cfg's
// shape, activation and routing fields are read: the reference is always
// NVFP4 with per-token activations, whatever cfg.Recipe says.
func New(cfg moe.Config, w Weights) (*Reference, error) {
	switch {
	case cfg.Hidden <= 0 || cfg.Intermediate <= 0:
		return nil, fmt.Errorf("trainref: hidden %d and intermediate %d must be positive", cfg.Hidden, cfg.Intermediate)
	case cfg.Experts <= 0 || cfg.TopK <= 0 || cfg.TopK > cfg.Experts:
		return nil, fmt.Errorf("trainref: top-%d of %d experts", cfg.TopK, cfg.Experts)
	case cfg.Activation != moe.ReLU2 && cfg.Activation != moe.SwiGLU:
		return nil, fmt.Errorf("trainref: unknown activation %q", cfg.Activation)
	case cfg.Scoring != moe.Softmax && cfg.Scoring != moe.Sigmoid:
		return nil, fmt.Errorf("trainref: unknown scoring %q", cfg.Scoring)
	case !(cfg.RoutedScaling >= 0) || math.IsInf(float64(cfg.RoutedScaling), 0):
		return nil, fmt.Errorf("trainref: routed scaling %v must be a positive finite factor", cfg.RoutedScaling)
	}
	if cfg.RoutedScaling == 0 {
		cfg.RoutedScaling = 1
	}
	E, H, I := cfg.Experts, cfg.Hidden, cfg.Intermediate
	i1 := I
	if cfg.Activation == moe.SwiGLU {
		i1 = 2 * I
	}
	if len(w.Router) != E*H || len(w.FC1) != E*i1*H || len(w.FC2) != E*H*I {
		return nil, fmt.Errorf("trainref: weights of %d, %d and %d values, want router %dx%d, FC1 %dx%dx%d, FC2 %dx%dx%d",
			len(w.Router), len(w.FC1), len(w.FC2), E, H, E, i1, H, E, H, I)
	}
	r := &Reference{cfg: cfg, router: w.Router}
	var err1, err2 error
	r.fc1, err1 = quantizeStack(w.FC1, E, i1, H)
	r.fc2, err2 = quantizeStack(w.FC2, E, H, I)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("trainref: %w", err)
	}
	return r, nil
}

// quantizeStack quantizes mats matrices of n x k BF16 values, one global
// scale per matrix (the same bits as nvfp4.QuantizeStack), in parallel.
func quantizeStack(src []uint16, mats, n, k int) (stack, error) {
	kp := nvfp4.PaddedK(k)
	s := stack{packed: make([]byte, mats*n*kp/2), scales: make([]byte, mats*n*kp/nvfp4.BlockSize), alpha: make([]float32, mats), n: n, kp: kp}
	errs := make([]error, mats)
	parallel(mats, func(m int) {
		pb, sb := n*kp/2, n*kp/nvfp4.BlockSize
		s.alpha[m], errs[m] = nvfp4.QuantizeMatrix(s.packed[m*pb:(m+1)*pb], s.scales[m*sb:(m+1)*sb], src[m*n*k:(m+1)*n*k], n, k)
	})
	return s, errors.Join(errs...)
}

// Config returns the configuration the reference was built with, routed
// scaling filled in.
func (r *Reference) Config() moe.Config { return r.cfg }

// Route returns the routing of the tokens of x (BF16 [T, H]): expert ids
// [T, k] and routing weights [T, k], computed as the layer computes them.
func (r *Reference) Route(x []uint16) (ids []int32, weights []float32, err error) {
	T, err := r.tokens(x)
	if err != nil {
		return nil, nil, err
	}
	ids, weights = r.route(x, T)
	return ids, weights, nil
}

func (r *Reference) tokens(x []uint16) (int, error) {
	if len(x)%r.cfg.Hidden != 0 {
		return 0, fmt.Errorf("trainref: input of %d values is not a whole number of %d-wide tokens", len(x), r.cfg.Hidden)
	}
	return len(x) / r.cfg.Hidden, nil
}

func (r *Reference) route(x []uint16, T int) ([]int32, []float32) {
	E, H, k := r.cfg.Experts, r.cfg.Hidden, r.cfg.TopK
	ids, weights := make([]int32, T*k), make([]float32, T*k)
	xf, wf := make([]float32, H), make([]float32, H)
	logits, s, taken := make([]float32, E), make([]float32, E), make([]bool, E)
	for t := range T {
		widen(xf, x[t*H:(t+1)*H])
		for e := range E {
			widen(wf, r.router[e*H:(e+1)*H])
			logits[e] = laneDot(xf, wf)
		}
		switch r.cfg.Scoring {
		case moe.Softmax:
			m := logits[0]
			for _, l := range logits[1:] {
				m = max(m, l)
			}
			var sum float32
			for i, l := range logits {
				s[i] = float32(math.Exp(float64(l - m)))
				sum += s[i]
			}
			for i := range s {
				s[i] /= sum
			}
		case moe.Sigmoid:
			for i, l := range logits {
				s[i] = 1 / (1 + float32(math.Exp(float64(-l))))
			}
		}
		clear(taken)
		id, w := ids[t*k:(t+1)*k], weights[t*k:(t+1)*k]
		for j := range k { // repeated argmax: ties to the lower id, NaN below every number
			best := -1
			for i, v := range s {
				if !taken[i] && (best < 0 || v > s[best] || (s[best] != s[best] && v == v)) {
					best = i
				}
			}
			taken[best] = true
			id[j], w[j] = int32(best), s[best]
		}
		if r.cfg.Renormalize {
			var sum float32
			for _, v := range w {
				sum += v
			}
			if sum != 0 {
				for j := range w {
					w[j] /= sum
				}
			}
		}
		for j := range w {
			w[j] *= r.cfg.RoutedScaling
		}
	}
	return ids, weights
}

// Forward returns the output of the layer for the tokens of x (BF16 [T, H]
// as bit patterns): BF16 [T, H], computed as the training forward with the
// given variant's departures (the zero Variant: none).
func (r *Reference) Forward(x []uint16, v Variant) ([]uint16, error) {
	T, err := r.tokens(x)
	if err != nil {
		return nil, err
	}
	c := r.cfg
	E, H, I, k := c.Experts, c.Hidden, c.Intermediate, c.TopK
	ids, weights := r.route(x, T)
	xq, err := quantizeRows(x, T, H)
	if err != nil {
		return nil, fmt.Errorf("trainref: quantize x: %w", err)
	}

	// Each expert's assignments, in token order; y holds FC2's BF16 output
	// per assignment (t, j) at row t*k+j.
	assigned := make([][]int, E)
	for a, id := range ids {
		assigned[id] = append(assigned[id], a)
	}
	y := make([]uint16, T*k*H)
	errs := make([]error, E)
	parallel(E, func(e int) {
		z := make([]float32, r.fc1.n)
		h := make([]uint16, I)
		for _, a := range assigned[e] {
			t := a / k
			// FC1: FP32 accumulation, one combined global scale.
			s1 := float32(xq.scale[t] * r.fc1.alpha[e])
			for n := range z {
				z[n] = float32(r.fc1.dot(xq, t, e, n) * s1)
				if !v.FP32FC1 {
					z[n] = bf16.Round(z[n]) // FC1's BF16 output
				}
			}
			for n := range h {
				var act float32
				if c.Activation == moe.SwiGLU {
					g, u := z[n], z[I+n]
					act = g / (1 + float32(math.Exp(float64(-g)))) * u
				} else {
					g := max(z[n], 0)
					act = g * g
				}
				if !v.ProbsAfterFC2 {
					act = float32(act * weights[a])
				}
				h[n] = bf16.FromFloat32(act)
			}
			hq, err := quantizeRows(h, 1, I)
			if err != nil {
				errs[e] = fmt.Errorf("trainref: quantize FC2 input: %w", err)
				return
			}
			s2 := float32(hq.scale[0] * r.fc2.alpha[e])
			out := y[a*H : (a+1)*H]
			for n := range out {
				out[n] = bf16.FromFloat32(float32(r.fc2.dot(hq, 0, e, n) * s2))
			}
		}
	})
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}

	out := make([]uint16, T*H)
	acc := make([]float32, H)
	for t := range T {
		clear(acc)
		for j := range k {
			a := t*k + j
			w := weights[a]
			for n, b := range y[a*H : (a+1)*H] {
				f := bf16.ToFloat32(b)
				if v.ProbsAfterFC2 {
					f = float32(w * f)
				}
				acc[n] += f
			}
		}
		for n, f := range acc {
			out[t*H+n] = bf16.FromFloat32(f)
		}
	}
	return out, nil
}

// qrows are rows quantized per row, decoded for the GEMM: each element's
// E2M1 value (without its block scale), each block's E4M3 scale as FP32,
// and each row's decode scale (per_token_scale).
type qrows struct {
	v, sf, scale []float32
	kp           int
}

func quantizeRows(src []uint16, rows, k int) (qrows, error) {
	kp := nvfp4.PaddedK(k)
	packed, scales := make([]byte, rows*kp/2), make([]byte, rows*kp/nvfp4.BlockSize)
	q := qrows{v: make([]float32, rows*kp), sf: make([]float32, len(scales)), scale: make([]float32, rows), kp: kp}
	if err := nvfp4.QuantizePerRow(packed, scales, q.scale, src, rows, k); err != nil {
		return q, err
	}
	for i, b := range packed {
		q.v[2*i], q.v[2*i+1] = nvfp4.E2M1Decode(b), nvfp4.E2M1Decode(b>>4)
	}
	for i, b := range scales {
		q.sf[i] = nvfp4.E4M3Decode(b)
	}
	return q, nil
}

// e2m1Pairs[b] are the values of the two codes packed in byte b; e4m3[b] is
// the value of scale byte b.
var e2m1Pairs, e4m3 = func() (p [256][2]float32, s [256]float32) {
	for b := range 256 {
		p[b] = [2]float32{nvfp4.E2M1Decode(uint8(b)), nvfp4.E2M1Decode(uint8(b) >> 4)}
		s[b] = nvfp4.E4M3Decode(uint8(b))
	}
	return p, s
}()

// dot returns the FP32 accumulation of activation row m of a against row n
// of expert e, before the global scales: block by block in k order,
// acc = RN(acc + sum_block * (SFa * SFw)). Each term is exact in FP32: the
// products of two E2M1 values are multiples of 1/4 up to 36, so a block's
// 16 of them sum exactly (below 2^12 quarters) in any order; the product of
// two E4M3 scales has at most 8 significant bits, so the scaled block sum
// has at most 20. Only the additions into acc round, which also makes the
// result the same with or without FMA contraction.
func (s *stack) dot(a qrows, m, e, n int) float32 {
	r := e*s.n + n
	packed := s.packed[r*s.kp/2 : (r+1)*s.kp/2]
	scales := s.scales[r*s.kp/nvfp4.BlockSize : (r+1)*s.kp/nvfp4.BlockSize]
	av := a.v[m*a.kp : (m+1)*a.kp]
	asf := a.sf[m*a.kp/nvfp4.BlockSize : (m+1)*a.kp/nvfp4.BlockSize]
	var acc float32
	for b, sf := range scales {
		x := av[b*nvfp4.BlockSize:][:nvfp4.BlockSize]
		p := packed[b*nvfp4.BlockSize/2:][:nvfp4.BlockSize/2]
		var s0, s1 float32
		for j, c := range p {
			pair := &e2m1Pairs[c]
			s0 += x[2*j] * pair[0]
			s1 += x[2*j+1] * pair[1]
		}
		acc += (s0 + s1) * (asf[b] * e4m3[sf])
	}
	return acc
}

// widen decodes BF16 bit patterns into dst (exact).
func widen(dst []float32, src []uint16) {
	for i, h := range src {
		dst[i] = bf16.ToFloat32(h)
	}
}

// laneDot is the router GEMM's dot product in the CPU backend's order:
// element i into lane i%4 (a tail past the last multiple of 4 into lane 0),
// then (l0+l1)+(l2+l3). Products of two BF16 values are exact in FP32.
func laneDot(a, b []float32) float32 {
	var l0, l1, l2, l3 float32
	i := 0
	for ; i+4 <= len(a); i += 4 {
		l0 += a[i] * b[i]
		l1 += a[i+1] * b[i+1]
		l2 += a[i+2] * b[i+2]
		l3 += a[i+3] * b[i+3]
	}
	for ; i < len(a); i++ {
		l0 += a[i] * b[i]
	}
	return (l0 + l1) + (l2 + l3)
}

// parallel runs fn(0..n-1) on up to GOMAXPROCS goroutines.
func parallel(n int, fn func(i int)) {
	next := make(chan int, n)
	for i := range n {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for range min(n, runtime.GOMAXPROCS(0)) {
		wg.Go(func() {
			for i := range next {
				fn(i)
			}
		})
	}
	wg.Wait()
}
