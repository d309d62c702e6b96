package cpu

import (
	"fmt"
	"math"
	"sync/atomic"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// Route computes softmax or sigmoid scores and the top-k per token.
func (be *Backend) Route(a kernels.RouteArgs) error {
	return issue(be, "route", a, be.prepRoute)
}

func (be *Backend) prepRoute(a kernels.RouteArgs) (func() error, error) {
	t, e, k, err := a.Validate()
	if err != nil {
		return nil, err
	}
	if err := be.owns("route", map[string]*kernels.Buffer{"logits": a.Logits, "ids": a.IDs, "weights": a.Weights}); err != nil {
		return nil, err
	}
	return func() error {
		logits, ids, weights := f32s(a.Logits), i32s(a.IDs), f32s(a.Weights)
		be.parallel(t, func(tok int) {
			s := make([]float32, e)
			taken := make([]bool, e)
			route(s, taken, logits[tok*e:(tok+1)*e], ids[tok*k:(tok+1)*k], weights[tok*k:(tok+1)*k], a)
		})
		return nil
	}, nil
}

// route handles one token; s and taken are scratch of length E.
func route(s []float32, taken []bool, logits []float32, ids []int32, w []float32, a kernels.RouteArgs) {
	switch a.Scoring {
	case kernels.Softmax:
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
	case kernels.Sigmoid:
		for i, l := range logits {
			s[i] = 1 / (1 + float32(math.Exp(float64(-l))))
		}
	}
	// Selection by repeated argmax: k is small, and the strict comparison
	// makes ties go to the lower expert id. NaN ranks below every number.
	for j := range ids {
		best := -1
		for i, v := range s {
			if !taken[i] && (best < 0 || ranksAbove(v, s[best])) {
				best = i
			}
		}
		taken[best] = true
		ids[j], w[j] = int32(best), s[best]
	}
	if a.Renormalize {
		var sum float32
		for _, v := range w {
			sum += v
		}
		if sum != 0 { // sigmoid scores can all underflow to 0
			for j := range w {
				w[j] /= sum
			}
		}
	}
	for j := range w {
		w[j] *= a.Scale
	}
}

// ranksAbove reports whether score a is preferred to b: the larger number,
// and any number over NaN.
func ranksAbove(a, b float32) bool { return a > b || (b != b && a == a) }

// Permute sorts the assignments by expert with a stable counting sort.
func (be *Backend) Permute(a kernels.PermuteArgs) error {
	return issue(be, "permute", a, be.prepPermute)
}

func (be *Backend) prepPermute(a kernels.PermuteArgs) (func() error, error) {
	_, k, e, err := a.Validate()
	if err != nil {
		return nil, err
	}
	if err := be.owns("permute", map[string]*kernels.Buffer{"ids": a.IDs, "offsets": a.Offsets, "rows": a.Rows, "slots": a.Slots}); err != nil {
		return nil, err
	}
	return func() error {
		ids, offsets, rows, slots := i32s(a.IDs), i32s(a.Offsets), i32s(a.Rows), i32s(a.Slots)
		clear(offsets)
		for i, id := range ids {
			if id < 0 || int(id) >= e {
				return fmt.Errorf("cpu: permute: assignment (%d, %d) names expert %d of %d", i/k, i%k, id, e)
			}
			offsets[id+1]++
		}
		for i := 1; i <= e; i++ {
			offsets[i] += offsets[i-1]
		}
		next := make([]int32, e)
		copy(next, offsets[:e])
		for i, id := range ids {
			r := next[id]
			next[id]++
			rows[r] = int32(i / k)
			slots[i] = r
		}
		return nil
	}, nil
}

// dispatch is Dispatch's operands.
type dispatch struct {
	R kernels.RouteArgs
	P kernels.PermuteArgs
	Q *kernels.QuantizeArgs
}

// Dispatch runs Route, Permute on its ids and, when q is not nil, the
// activations' Quantize as one op (kernels.Dispatcher).
func (be *Backend) Dispatch(r kernels.RouteArgs, p kernels.PermuteArgs, q *kernels.QuantizeArgs) error {
	return issue(be, "dispatch", dispatch{r, p, q}, be.prepDispatch)
}

func (be *Backend) prepDispatch(a dispatch) (func() error, error) {
	if _, _, _, _, err := kernels.ValidateDispatch(a.R, a.P, a.Q); err != nil {
		return nil, err
	}
	runs := make([]func() error, 0, 3)
	route, err := be.prepRoute(a.R)
	if err != nil {
		return nil, err
	}
	permute, err := be.prepPermute(a.P)
	if err != nil {
		return nil, err
	}
	runs = append(runs, route, permute)
	if a.Q != nil {
		quantize, err := be.prepQuantize(*a.Q)
		if err != nil {
			return nil, err
		}
		runs = append(runs, quantize)
	}
	return func() error {
		for _, run := range runs {
			if err := run(); err != nil {
				return err
			}
		}
		return nil
	}, nil
}

// Quantize runs the NVFP4 codec over rows (and matrices) in parallel.
func (be *Backend) Quantize(a kernels.QuantizeArgs) error {
	return issue(be, "quantize", a, be.prepQuantize)
}

func (be *Backend) prepQuantize(a kernels.QuantizeArgs) (func() error, error) {
	s, err := a.Validate()
	if err != nil {
		return nil, err
	}
	bufs := map[string]*kernels.Buffer{"src": a.Src, "packed": a.Dst.Packed, "scales": a.Dst.Scales, "scale": a.Dst.Scale}
	if a.Amax != nil {
		bufs["amax"] = a.Amax
	}
	if a.Input != nil {
		bufs["input scale"] = a.Input
	}
	if err := be.owns("quantize", bufs); err != nil {
		return nil, err
	}
	return func() error {
		src, packed, scales, scale := u16s(a.Src), a.Dst.Packed.Host(), a.Dst.Scales.Host(), f32s(a.Dst.Scale)
		rows := s.Mats * s.Rows
		pb, sb := s.Kp/2, s.Kp/nvfp4.BlockSize
		var rowErr atomic.Pointer[error] // geometry was validated: only a bug sets it
		quantRow := func(r int, sEnc, sDec float32) {
			if err := nvfp4.QuantizeRow(packed[r*pb:(r+1)*pb], scales[r*sb:(r+1)*sb], src[r*s.K:(r+1)*s.K], sEnc, sDec); err != nil {
				rowErr.CompareAndSwap(nil, &err)
			}
		}
		switch a.Mode {
		case kernels.PerRow:
			be.parallel(rows, func(r int) {
				sEnc, sDec := nvfp4.EncodeScale(nvfp4.AmaxBF16(src[r*s.K : (r+1)*s.K]))
				quantRow(r, sEnc, sDec)
				scale[r] = sDec
			})
		case kernels.PerTensor:
			sEnc, sDec := nvfp4.InputScale(f32s(a.Input)[0])
			be.parallel(rows, func(r int) {
				quantRow(r, sEnc, sDec)
				scale[r] = sDec
			})
		case kernels.PerMatrix:
			// The max is exact and order-free, so splitting it is safe.
			amax := make([]float32, rows)
			be.parallel(rows, func(r int) { amax[r] = nvfp4.AmaxBF16(src[r*s.K : (r+1)*s.K]) })
			enc := make([]float32, s.Mats)
			for m := range s.Mats {
				var mx float32
				for _, v := range amax[m*s.Rows : (m+1)*s.Rows] {
					mx = max(mx, v) // NaN propagates, as in AmaxBF16
				}
				if a.Amax != nil {
					// Equal bits, or both NaN (rows may carry NaNs of other payloads).
					if hint := f32s(a.Amax)[m]; math.Float32bits(hint) != math.Float32bits(mx) && !(hint != hint && mx != mx) {
						return fmt.Errorf("cpu: quantize: matrix %d: amax given %g, its values' is %g", m, hint, mx)
					}
				}
				enc[m], scale[m] = nvfp4.EncodeScale(mx)
			}
			be.parallel(rows, func(r int) { quantRow(r, enc[r/s.Rows], scale[r/s.Rows]) })
		}
		if err := rowErr.Load(); err != nil {
			return fmt.Errorf("cpu: quantize: %w", *err)
		}
		return nil
	}, nil
}

var _ kernels.Amaxer = (*Backend)(nil)

// Amax folds a tensor's largest |value| into a scalar (kernels.Amaxer).
func (be *Backend) Amax(a kernels.AmaxArgs) error {
	return issue(be, "amax", a, be.prepAmax)
}

func (be *Backend) prepAmax(a kernels.AmaxArgs) (func() error, error) {
	if _, err := a.Validate(); err != nil {
		return nil, err
	}
	if err := be.owns("amax", map[string]*kernels.Buffer{"src": a.Src, "dst": a.Dst}); err != nil {
		return nil, err
	}
	return func() error {
		v, d := nvfp4.AmaxBF16(u16s(a.Src)), f32s(a.Dst)
		switch {
		case !a.Accumulate:
			d[0] = v
		case d[0] != d[0]: // a NaN, once in, stays
		case v != v || v > d[0]:
			d[0] = v
		}
		return nil
	}, nil
}

// Finalize sums each token's weighted expert rows in fixed k order.
func (be *Backend) Finalize(a kernels.FinalizeArgs) error {
	return issue(be, "finalize", a, be.prepFinalize)
}

func (be *Backend) prepFinalize(a kernels.FinalizeArgs) (func() error, error) {
	t, h, k, err := a.Validate()
	if err != nil {
		return nil, err
	}
	if err := be.owns("finalize", map[string]*kernels.Buffer{"out": a.Out, "rows": a.Rows, "weights": a.Weights, "slots": a.Slots}); err != nil {
		return nil, err
	}
	return func() error {
		out, rows, w, slots := u16s(a.Out), u16s(a.Rows), f32s(a.Weights), i32s(a.Slots)
		nr := a.Rows.Dim(0)
		for i, s := range slots {
			if s < 0 || int(s) >= nr {
				return fmt.Errorf("cpu: finalize: slot %d of assignment (%d, %d) is outside %d rows", s, i/k, i%k, nr)
			}
		}
		be.parallel(t, func(tok int) {
			acc := make([]float32, h)
			for j := range k {
				wj := w[tok*k+j]
				y := rows[int(slots[tok*k+j])*h:][:h]
				for c, v := range y {
					// The conversion forbids FMA contraction: the GPU does the
					// same two rounded steps (__fmul_rn, __fadd_rn).
					acc[c] += float32(wj * bf16.ToFloat32(v))
				}
			}
			o := out[tok*h:][:h]
			for c, v := range acc {
				o[c] = bf16.FromFloat32(v)
			}
		})
		return nil
	}, nil
}

// FinalizeScattered rounds the atomic finalize's sums to BF16 and clears them.
func (be *Backend) FinalizeScattered(out, acc *kernels.Buffer) error {
	return issue(be, "finalize scattered", [2]*kernels.Buffer{out, acc}, func(b [2]*kernels.Buffer) (func() error, error) {
		if _, _, err := kernels.ValidateFinalizeScattered(b[0], b[1]); err != nil {
			return nil, err
		}
		if err := be.owns("finalize scattered", map[string]*kernels.Buffer{"out": b[0], "acc": b[1]}); err != nil {
			return nil, err
		}
		return func() error {
			o, a := u16s(b[0]), f32s(b[1])
			for i, v := range a {
				o[i] = bf16.FromFloat32(v)
			}
			clear(a)
			return nil
		}, nil
	})
}
