package kernels

import (
	"fmt"
	"math"

	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
)

// Scoring is the router's score function.
type Scoring uint8

// Router score functions.
const (
	Softmax Scoring = iota + 1 // softmax over all experts, then top-k
	Sigmoid                    // independent sigmoid per expert, then top-k
)

func (s Scoring) String() string {
	switch s {
	case Softmax:
		return "softmax"
	case Sigmoid:
		return "sigmoid"
	}
	return fmt.Sprintf("scoring(%d)", uint8(s))
}

// RouteArgs are the operands of Backend.Route.
//
// For each token t: scores s = softmax(Logits[t]) or sigmoid(Logits[t]) in
// FP32; the k largest, in descending order (ties to the lower expert id; a
// NaN score ranks below every number), give IDs[t] and their scores
// Weights[t]; with Renormalize the weights are divided by their sum (added
// in k order) unless that sum is 0; finally each is multiplied by Scale (the
// routed scaling factor, positive and finite; 1 leaves them unchanged).
type RouteArgs struct {
	Logits      *Buffer // F32 [T, E]
	IDs         *Buffer // I32 [T, k]
	Weights     *Buffer // F32 [T, k]
	Scoring     Scoring
	Renormalize bool
	Scale       float32
}

// Validate checks the operands and returns T, E and k.
func (a RouteArgs) Validate() (t, e, k int, err error) {
	if err := check("route", "logits", a.Logits, F32, 2); err != nil {
		return 0, 0, 0, err
	}
	t, e = a.Logits.Dim(0), a.Logits.Dim(1)
	if err := check("route", "ids", a.IDs, I32, 2); err != nil {
		return 0, 0, 0, err
	}
	k = a.IDs.Dim(1)
	if err := shapeIs("route", "ids", a.IDs, t, k); err != nil {
		return 0, 0, 0, err
	}
	if err := check("route", "weights", a.Weights, F32, 2); err != nil {
		return 0, 0, 0, err
	}
	if err := shapeIs("route", "weights", a.Weights, t, k); err != nil {
		return 0, 0, 0, err
	}
	if k < 1 || k > e {
		return 0, 0, 0, fmt.Errorf("kernels: route: top-%d of %d experts", k, e)
	}
	if a.Scoring != Softmax && a.Scoring != Sigmoid {
		return 0, 0, 0, fmt.Errorf("kernels: route: unknown %s", a.Scoring)
	}
	if !(a.Scale > 0) || math.IsInf(float64(a.Scale), 0) {
		return 0, 0, 0, fmt.Errorf("kernels: route: scale %v: want a positive finite factor", a.Scale)
	}
	return t, e, k, disjoint("route", []operand{{"ids", a.IDs}, {"weights", a.Weights}}, []operand{{"logits", a.Logits}})
}

// PermuteArgs are the operands of Backend.Permute.
//
// The T*k assignments (t, j) -> expert IDs[t, j] are sorted by expert, and
// within an expert by t then j, so the order depends only on the ids.
// Offsets[e] .. Offsets[e+1] are expert e's sorted rows; Rows[r] is the token
// of sorted row r (the row of the activations to gather); Slots[t*k+j] is the
// sorted row of assignment (t, j).
type PermuteArgs struct {
	IDs     *Buffer // I32 [T, k]
	Offsets *Buffer // I32 [E+1]
	Rows    *Buffer // I32 [T*k]
	Slots   *Buffer // I32 [T*k]
}

// Validate checks the operands and returns T, k and E.
func (a PermuteArgs) Validate() (t, k, e int, err error) {
	if err := check("permute", "ids", a.IDs, I32, 2); err != nil {
		return 0, 0, 0, err
	}
	t, k = a.IDs.Dim(0), a.IDs.Dim(1)
	if err := check("permute", "offsets", a.Offsets, I32, 1); err != nil {
		return 0, 0, 0, err
	}
	e = a.Offsets.Dim(0) - 1
	if e < 1 {
		return 0, 0, 0, fmt.Errorf("kernels: permute: offsets %s has no experts", a.Offsets)
	}
	for _, o := range []struct {
		name string
		b    *Buffer
	}{{"rows", a.Rows}, {"slots", a.Slots}} {
		if err := check("permute", o.name, o.b, I32, 1); err != nil {
			return 0, 0, 0, err
		}
		if err := shapeIs("permute", o.name, o.b, t*k); err != nil {
			return 0, 0, 0, err
		}
	}
	return t, k, e, disjoint("permute", []operand{{"offsets", a.Offsets}, {"rows", a.Rows}, {"slots", a.Slots}}, []operand{{"ids", a.IDs}})
}

// Dispatcher is implemented by backends that can run the MoE layer's
// dispatch as one step: Route, Permute on its ids and, when q is not nil,
// a PerRow or PerTensor Quantize of the activations (which needs neither), with the
// results of the separate ops, in fewer launches where the batch is small.
type Dispatcher interface {
	Dispatch(r RouteArgs, p PermuteArgs, q *QuantizeArgs) error
}

// ValidateDispatch checks the operands of Dispatcher.Dispatch: each op's
// own, p.IDs must be r.IDs, q (if any) is PerRow or PerTensor, and no output overlaps
// another output or an input. It returns T, E and k, and q's geometry.
func ValidateDispatch(r RouteArgs, p PermuteArgs, q *QuantizeArgs) (t, e, k int, qs QuantizeShape, err error) {
	if t, e, k, err = r.Validate(); err != nil {
		return 0, 0, 0, qs, err
	}
	pt, pk, pe, err := p.Validate()
	if err != nil {
		return 0, 0, 0, qs, err
	}
	if p.IDs != r.IDs {
		return 0, 0, 0, qs, fmt.Errorf("kernels: dispatch: permute ids %v are not route's ids %v", p.IDs, r.IDs)
	}
	if pt != t || pk != k || pe != e {
		return 0, 0, 0, qs, fmt.Errorf("kernels: dispatch: permute sorts %d x top-%d over %d experts, route gives %d x top-%d of %d",
			pt, pk, pe, t, k, e)
	}
	outs := []operand{{"ids", r.IDs}, {"weights", r.Weights}, {"offsets", p.Offsets}, {"rows", p.Rows}, {"slots", p.Slots}}
	ins := []operand{{"logits", r.Logits}}
	if q != nil {
		if q.Mode != PerRow && q.Mode != PerTensor {
			return 0, 0, 0, qs, fmt.Errorf("kernels: dispatch: quantize mode %s, want %s or %s", q.Mode, PerRow, PerTensor)
		}
		if qs, err = q.Validate(); err != nil {
			return 0, 0, 0, qs, err
		}
		outs = append(outs, operand{"quantize packed", q.Dst.Packed}, operand{"quantize scales", q.Dst.Scales}, operand{"quantize scale", q.Dst.Scale})
		ins = append(ins, operand{"quantize src", q.Src})
		if q.Input != nil {
			ins = append(ins, operand{"quantize input scale", q.Input})
		}
	}
	return t, e, k, qs, disjoint("dispatch", outs, ins)
}

// NVFP4 is a quantized matrix, or stack of matrices, in backend memory:
// E2M1 codes packed two per byte, linear row-major E4M3 block scales, and FP32
// decode scales (one per matrix, or one per row).
type NVFP4 struct {
	Packed *Buffer // U8 [..., rows, Kp/2]
	Scales *Buffer // U8 [..., rows, Kp/16]
	Scale  *Buffer // F32 [matrices] or [rows]
}

// QuantMode says which global scale a quantization uses.
type QuantMode uint8

// Quantization modes.
const (
	// PerMatrix uses one global scale per matrix: per expert for a 3-D
	// weight stack [E, N, K]. Scale receives each matrix's S_dec (alpha).
	PerMatrix QuantMode = iota + 1
	// PerRow uses one global scale per row: the per-token activation
	// recipe. Scale receives each row's per_token_scale.
	PerRow
	// PerTensor uses one global scale given for the whole tensor (the
	// per_tensor activation recipe): QuantizeArgs.Input holds its S_dec
	// (a calibrated input_scale), S_enc is RN(1/S_dec), and Scale receives
	// S_dec in every row, so the GEMMs read it as they read per-row scales.
	PerTensor
)

func (m QuantMode) String() string {
	switch m {
	case PerMatrix:
		return "per-matrix"
	case PerRow:
		return "per-row"
	case PerTensor:
		return "per-tensor"
	}
	return fmt.Sprintf("quantmode(%d)", uint8(m))
}

// QuantizeArgs are the operands of Backend.Quantize. Src is BF16 [R, K] or,
// in PerMatrix mode, [E, N, K]; Dst has the same leading dimensions with the
// row padded to Kp (a multiple of 16, Kp >= K) by zeros.
type QuantizeArgs struct {
	Src  *Buffer
	Dst  NVFP4
	Mode QuantMode
	// Amax, optional in PerMatrix mode: F32 [matrices], each matrix's
	// largest |value|, known to a caller that saw every value (the refit
	// receiver checks each on the host). The backend then skips its own
	// pass over the matrices for it; the result is the same bits. The CPU
	// backend checks the values and fails on one that differs.
	Amax *Buffer
	// Input, required in PerTensor mode and only there: F32 [1], the
	// tensor's S_dec. It stays in backend memory so that a captured graph
	// reads the current value, so the backend cannot check it: the caller
	// keeps it positive and finite (others quantize to meaningless rows;
	// moe.Layer.SetInputScales refuses them).
	Input *Buffer
}

// QuantizeShape is the geometry Validate derives.
type QuantizeShape struct {
	Mats, Rows, K, Kp int // Mats matrices of Rows x K (padded to Kp)
}

// Validate checks the operands and returns the geometry.
func (a QuantizeArgs) Validate() (QuantizeShape, error) {
	var s QuantizeShape
	if a.Src == nil || a.Src.DType() != BF16 || (a.Src.Rank() != 2 && a.Src.Rank() != 3) {
		return s, fmt.Errorf("kernels: quantize: src %v: want bf16 of rank 2 or 3", a.Src)
	}
	s.Mats, s.Rows, s.K = 1, a.Src.Dim(-2), a.Src.Dim(-1)
	if a.Src.Rank() == 3 {
		s.Mats = a.Src.Dim(0)
		if a.Mode == PerRow || a.Mode == PerTensor {
			return s, fmt.Errorf("kernels: quantize: %s mode takes rank-2 src, got %v", a.Mode, a.Src)
		}
	}
	if err := check("quantize", "packed", a.Dst.Packed, U8, a.Src.Rank()); err != nil {
		return s, err
	}
	s.Kp = 2 * a.Dst.Packed.Dim(-1)
	if s.Kp%nvfp4.BlockSize != 0 || s.Kp < s.K {
		return s, fmt.Errorf("kernels: quantize: packed %v holds %d elements a row, want a multiple of %d >= %d", a.Dst.Packed, s.Kp, nvfp4.BlockSize, s.K)
	}
	lead := a.Src.Shape()[:a.Src.Rank()-1]
	if err := shapeIs("quantize", "packed", a.Dst.Packed, append(lead, s.Kp/2)...); err != nil {
		return s, err
	}
	if err := check("quantize", "scales", a.Dst.Scales, U8, a.Src.Rank()); err != nil {
		return s, err
	}
	if err := shapeIs("quantize", "scales", a.Dst.Scales, append(lead, s.Kp/nvfp4.BlockSize)...); err != nil {
		return s, err
	}
	if err := check("quantize", "scale", a.Dst.Scale, F32, 1); err != nil {
		return s, err
	}
	want := s.Mats
	switch a.Mode {
	case PerMatrix:
	case PerRow, PerTensor:
		want = s.Rows
	default:
		return s, fmt.Errorf("kernels: quantize: unknown %s", a.Mode)
	}
	if err := shapeIs("quantize", "scale", a.Dst.Scale, want); err != nil {
		return s, err
	}
	if a.Amax != nil {
		if a.Mode != PerMatrix {
			return s, fmt.Errorf("kernels: quantize: an amax applies to per-matrix mode, not %s", a.Mode)
		}
		if err := check("quantize", "amax", a.Amax, F32, 1); err != nil {
			return s, err
		}
		if err := shapeIs("quantize", "amax", a.Amax, s.Mats); err != nil {
			return s, err
		}
	}
	if (a.Input != nil) != (a.Mode == PerTensor) {
		return s, fmt.Errorf("kernels: quantize: an input scale is required in %s mode and only there (mode %s)", PerTensor, a.Mode)
	}
	if a.Input != nil {
		if err := check("quantize", "input scale", a.Input, F32, 1); err != nil {
			return s, err
		}
		if err := shapeIs("quantize", "input scale", a.Input, 1); err != nil {
			return s, err
		}
	}
	ins := []operand{{"src", a.Src}}
	if a.Amax != nil {
		ins = append(ins, operand{"amax", a.Amax})
	}
	if a.Input != nil {
		ins = append(ins, operand{"input scale", a.Input})
	}
	return s, disjoint("quantize", []operand{{"packed", a.Dst.Packed}, {"scales", a.Dst.Scales}, {"scale", a.Dst.Scale}}, ins)
}

// AmaxArgs are the operands of Amaxer.Amax: Dst (F32 [1]) becomes the
// largest |value| of Src (BF16, any shape), or with Accumulate the larger
// of that and what Dst holds, a running maximum over calls (a NaN in Src
// stays: the maximum is NaN from then on). What Dst holds must be a
// non-negative value (or NaN) an earlier Amax left: backends may compare
// the FP32 bits as integers.
type AmaxArgs struct {
	Src, Dst   *Buffer
	Accumulate bool
}

// Validate checks the operands and returns Src's element count.
func (a AmaxArgs) Validate() (int, error) {
	if a.Src == nil || a.Src.DType() != BF16 {
		return 0, fmt.Errorf("kernels: amax: src %v: want bf16", a.Src)
	}
	if err := check("amax", "dst", a.Dst, F32, 1); err != nil {
		return 0, err
	}
	if err := shapeIs("amax", "dst", a.Dst, 1); err != nil {
		return 0, err
	}
	return a.Src.Size() / 2, disjoint("amax", []operand{{"dst", a.Dst}}, []operand{{"src", a.Src}})
}

// Amaxer is implemented by backends that measure a tensor's amax on the op
// stream, in order with the other ops: the calibration of the per_tensor
// recipe folds the MoE layers' expert inputs into running maxima with it.
type Amaxer interface {
	Amax(AmaxArgs) error
}

// Activation is the expert activation fused into a grouped GEMM's epilogue.
type Activation uint8

// Expert activations.
const (
	Identity Activation = iota + 1 // out = h
	ReLU2                          // out = relu(h)^2 (squared ReLU)
	SwiGLU                         // W rows are [gate; up]: out = silu(gate) * up
)

func (a Activation) String() string {
	switch a {
	case Identity:
		return "identity"
	case ReLU2:
		return "relu2"
	case SwiGLU:
		return "swiglu"
	}
	return fmt.Sprintf("activation(%d)", uint8(a))
}

// Operand is one side of a grouped GEMM: BF16 values, or NVFP4. Exactly one
// of BF16 and Q.Packed is set.
type Operand struct {
	BF16 *Buffer
	Q    NVFP4
}

// Quantized reports whether the operand is NVFP4.
func (o Operand) Quantized() bool { return o.Q.Packed != nil }

// GroupedGemmArgs are the operands of Backend.GroupedGemm.
//
// For each expert e and each sorted row r in Offsets[e] .. Offsets[e+1]:
//
//	h[r, n] = sum_k A[Gather[r], k] * W[e, n, k]     (FP32 accumulation)
//	h      *= A.Scale[Gather[r]]  if A is NVFP4 (its per-row scale)
//	h      *= W.Scale[e]          if W is NVFP4 (the expert's alpha)
//	Out[r] = bf16(act(h))
//
// NVFP4 operands are dequantized exactly (e2m1 * E4M3), so the products are
// exact and only the accumulation order is backend-specific. A's row count
// is its own (tokens); Out has one row per sorted row. With SwiGLU, W has 2N
// rows ([gate; up]) and Out has N columns.
type GroupedGemmArgs struct {
	A       Operand // [Ta, K] BF16, or NVFP4 with per-row Scale [Ta]
	Gather  *Buffer // I32 [R]: the A row of each sorted row; nil: row r itself
	W       Operand // [E, N, K] BF16, or NVFP4 with per-expert Scale [E]
	Offsets *Buffer // I32 [E+1]
	Act     Activation
	Out     *Buffer // BF16 [R, N] (N/2 for SwiGLU); nil with Scatter
	// Scatter, when set, replaces Out with the atomic finalize fused into
	// the epilogue (see Scatter).
	Scatter *Scatter
}

// Scatter is the atomic (fused) finalize: the GEMM writes no rows; each
// output row r, rounded to BF16 like Out's, is multiplied by its routing
// weight (an FP32 rounding) and added into Acc[Tokens[r]] with FP32 atomic
// additions, so the sum's order, and its last bits, may change from run to
// run and with the batch: it is not batch invariant. The weight of row r is
// Weights[t, j] for the j with Slots[t*k+j] = r, t = Tokens[r].
// FinalizeScattered then rounds Acc to BF16 and clears it. It writes and
// reads no expert rows; the deterministic finalize (GroupedGemm, then
// Finalize) is measured against it (on the H200 it is not faster:
// docs/PERF.md, "det/atomic").
type Scatter struct {
	Acc     *Buffer // F32 [T, N] (N/2 for SwiGLU), zero before the first GEMM of a forward
	Tokens  *Buffer // I32 [R]: the token of each sorted row (Permute's Rows)
	Weights *Buffer // F32 [T, k]
	Slots   *Buffer // I32 [T*k]
}

// GroupedGemmShape is the geometry Validate derives.
type GroupedGemmShape struct {
	R, Ta, E, N, K, Kp int // Kp: the padded K both operands are read with
	OutN               int
}

// Validate checks the operands and returns the geometry.
func (a GroupedGemmArgs) Validate() (GroupedGemmShape, error) {
	var s GroupedGemmShape
	var aK, wK int // logical K of each operand (padded for NVFP4)
	var aPadded, wPadded bool
	switch {
	case a.A.Quantized() && a.A.BF16 == nil:
		if err := checkNVFP4("grouped gemm", "A", a.A.Q, 2); err != nil {
			return s, err
		}
		s.Ta, aK, aPadded = a.A.Q.Packed.Dim(0), 2*a.A.Q.Packed.Dim(1), true
		if err := shapeIs("grouped gemm", "A.scale", a.A.Q.Scale, s.Ta); err != nil {
			return s, err
		}
	case !a.A.Quantized() && a.A.BF16 != nil:
		if err := check("grouped gemm", "A", a.A.BF16, BF16, 2); err != nil {
			return s, err
		}
		s.Ta, aK = a.A.BF16.Dim(0), a.A.BF16.Dim(1)
	default:
		return s, fmt.Errorf("kernels: grouped gemm: A must be exactly one of bf16 and nvfp4")
	}
	switch {
	case a.W.Quantized() && a.W.BF16 == nil:
		if err := checkNVFP4("grouped gemm", "W", a.W.Q, 3); err != nil {
			return s, err
		}
		s.E, s.N, wK, wPadded = a.W.Q.Packed.Dim(0), a.W.Q.Packed.Dim(1), 2*a.W.Q.Packed.Dim(2), true
		if err := shapeIs("grouped gemm", "W.scale", a.W.Q.Scale, s.E); err != nil {
			return s, err
		}
	case !a.W.Quantized() && a.W.BF16 != nil:
		if err := check("grouped gemm", "W", a.W.BF16, BF16, 3); err != nil {
			return s, err
		}
		s.E, s.N, wK = a.W.BF16.Dim(0), a.W.BF16.Dim(1), a.W.BF16.Dim(2)
	default:
		return s, fmt.Errorf("kernels: grouped gemm: W must be exactly one of bf16 and nvfp4")
	}
	// An NVFP4 operand's rows are zero-padded to whole blocks, so beside a
	// BF16 partner of K columns it holds exactly PaddedK(K); two operands of
	// one format must agree.
	s.K, s.Kp = min(aK, wK), max(aK, wK)
	if aPadded == wPadded && aK != wK || aPadded != wPadded && s.Kp != nvfp4.PaddedK(s.K) {
		return s, fmt.Errorf("kernels: grouped gemm: A has %d columns, W has %d", aK, wK)
	}
	if err := check("grouped gemm", "offsets", a.Offsets, I32, 1); err != nil {
		return s, err
	}
	if err := shapeIs("grouped gemm", "offsets", a.Offsets, s.E+1); err != nil {
		return s, err
	}
	if a.Scatter != nil {
		if a.Out != nil {
			return s, fmt.Errorf("kernels: grouped gemm: out and scatter are both set; the scatter writes no rows")
		}
		if err := check("grouped gemm", "scatter.tokens", a.Scatter.Tokens, I32, 1); err != nil {
			return s, err
		}
		s.R = a.Scatter.Tokens.Dim(0)
	} else {
		if err := check("grouped gemm", "out", a.Out, BF16, 2); err != nil {
			return s, err
		}
		s.R = a.Out.Dim(0)
	}
	s.OutN = s.N
	switch a.Act {
	case Identity, ReLU2:
	case SwiGLU:
		if s.N%2 != 0 {
			return s, fmt.Errorf("kernels: grouped gemm: swiglu needs an even number of W rows, got %d", s.N)
		}
		s.OutN = s.N / 2
	default:
		return s, fmt.Errorf("kernels: grouped gemm: unknown %s", a.Act)
	}
	if a.Scatter != nil {
		if err := a.Scatter.validate(s.OutN); err != nil {
			return s, err
		}
	} else if err := shapeIs("grouped gemm", "out", a.Out, s.R, s.OutN); err != nil {
		return s, err
	}
	if a.Gather != nil {
		if err := check("grouped gemm", "gather", a.Gather, I32, 1); err != nil {
			return s, err
		}
		if err := shapeIs("grouped gemm", "gather", a.Gather, s.R); err != nil {
			return s, err
		}
	} else if s.Ta != s.R {
		return s, fmt.Errorf("kernels: grouped gemm: no gather, but A has %d rows and out %d", s.Ta, s.R)
	}
	ins := []operand{{"A", a.A.BF16}, {"A.packed", a.A.Q.Packed},
		{"A.scales", a.A.Q.Scales}, {"A.scale", a.A.Q.Scale}, {"gather", a.Gather}, {"W", a.W.BF16}, {"W.packed", a.W.Q.Packed},
		{"W.scales", a.W.Q.Scales}, {"W.scale", a.W.Q.Scale}, {"offsets", a.Offsets}}
	if a.Scatter != nil {
		ins = append(ins, operand{"scatter.tokens", a.Scatter.Tokens}, operand{"scatter.weights", a.Scatter.Weights},
			operand{"scatter.slots", a.Scatter.Slots})
		return s, disjoint("grouped gemm", []operand{{"scatter.acc", a.Scatter.Acc}}, ins)
	}
	return s, disjoint("grouped gemm", []operand{{"out", a.Out}}, ins)
}

// validate checks the scatter's operands for outputs n wide (its tokens
// were checked by the caller).
func (sc *Scatter) validate(n int) error {
	if err := check("grouped gemm", "scatter.acc", sc.Acc, F32, 2); err != nil {
		return err
	}
	t := sc.Acc.Dim(0)
	if err := shapeIs("grouped gemm", "scatter.acc", sc.Acc, t, n); err != nil {
		return err
	}
	if err := check("grouped gemm", "scatter.weights", sc.Weights, F32, 2); err != nil {
		return err
	}
	k := sc.Weights.Dim(1)
	if err := shapeIs("grouped gemm", "scatter.weights", sc.Weights, t, k); err != nil {
		return err
	}
	if err := check("grouped gemm", "scatter.slots", sc.Slots, I32, 1); err != nil {
		return err
	}
	return shapeIs("grouped gemm", "scatter.slots", sc.Slots, t*k)
}

// ValidateFinalizeScattered checks FinalizeScattered's operands (out BF16
// [T, H], acc F32 [T, H]) and returns T and H.
func ValidateFinalizeScattered(out, acc *Buffer) (t, h int, err error) {
	if err := check("finalize scattered", "out", out, BF16, 2); err != nil {
		return 0, 0, err
	}
	t, h = out.Dim(0), out.Dim(1)
	if err := check("finalize scattered", "acc", acc, F32, 2); err != nil {
		return 0, 0, err
	}
	if err := shapeIs("finalize scattered", "acc", acc, t, h); err != nil {
		return 0, 0, err
	}
	return t, h, disjoint("finalize scattered", []operand{{"out", out}, {"acc", acc}}, nil)
}

// FinalizeArgs are the operands of Backend.Finalize:
//
//	Out[t] = bf16( sum_{j<k} Weights[t, j] * Rows[Slots[t*k+j]] )
//
// with each product rounded to FP32 and the sum taken in j order, so a
// token's output never depends on the batch (the deterministic finalize).
type FinalizeArgs struct {
	Out     *Buffer // BF16 [T, H]
	Rows    *Buffer // BF16 [R, H], expert outputs in sorted order
	Weights *Buffer // F32 [T, k]
	Slots   *Buffer // I32 [T*k]
}

// Validate checks the operands and returns T, H and k.
func (a FinalizeArgs) Validate() (t, h, k int, err error) {
	if err := check("finalize", "out", a.Out, BF16, 2); err != nil {
		return 0, 0, 0, err
	}
	t, h = a.Out.Dim(0), a.Out.Dim(1)
	if err := check("finalize", "weights", a.Weights, F32, 2); err != nil {
		return 0, 0, 0, err
	}
	k = a.Weights.Dim(1)
	if err := shapeIs("finalize", "weights", a.Weights, t, k); err != nil {
		return 0, 0, 0, err
	}
	if err := check("finalize", "rows", a.Rows, BF16, 2); err != nil {
		return 0, 0, 0, err
	}
	if a.Rows.Dim(1) != h {
		return 0, 0, 0, fmt.Errorf("kernels: finalize: rows %v have %d columns, out has %d", a.Rows, a.Rows.Dim(1), h)
	}
	if err := check("finalize", "slots", a.Slots, I32, 1); err != nil {
		return 0, 0, 0, err
	}
	if err := shapeIs("finalize", "slots", a.Slots, t*k); err != nil {
		return 0, 0, 0, err
	}
	return t, h, k, disjoint("finalize", []operand{{"out", a.Out}}, []operand{{"rows", a.Rows}, {"weights", a.Weights}, {"slots", a.Slots}})
}

// ValidateGemm checks Gemm's operands and returns M, N and K.
func ValidateGemm(dst, a, w *Buffer) (m, n, k int, err error) {
	if err := check("gemm", "a", a, BF16, 2); err != nil {
		return 0, 0, 0, err
	}
	if err := check("gemm", "w", w, BF16, 2); err != nil {
		return 0, 0, 0, err
	}
	m, k, n = a.Dim(0), a.Dim(1), w.Dim(0)
	if w.Dim(1) != k {
		return 0, 0, 0, fmt.Errorf("kernels: gemm: a %v and w %v disagree on K", a, w)
	}
	if dst == nil || (dst.DType() != F32 && dst.DType() != BF16) {
		return 0, 0, 0, fmt.Errorf("kernels: gemm: dst %v: want f32 or bf16", dst)
	}
	if err := shapeIs("gemm", "dst", dst, m, n); err != nil {
		return 0, 0, 0, err
	}
	return m, n, k, disjoint("gemm", []operand{{"dst", dst}}, []operand{{"a", a}, {"w", w}})
}

// ValidateGemmSet checks the GEMMs of GemmSet: each dst[i] = a * w[i]^T as
// ValidateGemm checks it, and no output overlapping another GEMM's
// operands or output. It returns M, each GEMM's N and K.
func ValidateGemmSet(dst []*Buffer, a *Buffer, w []*Buffer) (m int, n []int, k int, err error) {
	if len(dst) != len(w) || len(dst) == 0 {
		return 0, nil, 0, fmt.Errorf("kernels: gemm set: %d outputs for %d weights", len(dst), len(w))
	}
	n = make([]int, len(dst))
	outs, ins := make([]operand, len(dst)), []operand{{"a", a}}
	for i := range dst {
		if m, n[i], k, err = ValidateGemm(dst[i], a, w[i]); err != nil {
			return 0, nil, 0, fmt.Errorf("gemm %d: %w", i, err)
		}
		outs[i] = operand{fmt.Sprintf("dst[%d]", i), dst[i]}
		ins = append(ins, operand{fmt.Sprintf("w[%d]", i), w[i]})
	}
	return m, n, k, disjoint("gemm set", outs, ins)
}

func checkNVFP4(op, name string, q NVFP4, rank int) error {
	if err := check(op, name+".packed", q.Packed, U8, rank); err != nil {
		return err
	}
	if err := check(op, name+".scales", q.Scales, U8, rank); err != nil {
		return err
	}
	want := q.Packed.Shape()
	want[rank-1] = 2 * want[rank-1] / nvfp4.BlockSize
	if q.Packed.Dim(-1)*2%nvfp4.BlockSize != 0 {
		return fmt.Errorf("kernels: %s: %s.packed %v: row of %d elements is not whole blocks", op, name, q.Packed, 2*q.Packed.Dim(-1))
	}
	if err := shapeIs(op, name+".scales", q.Scales, want...); err != nil {
		return err
	}
	return check(op, name+".scale", q.Scale, F32, 1)
}

func check(op, name string, b *Buffer, dt DType, rank int) error {
	switch {
	case b == nil:
		return fmt.Errorf("kernels: %s: %s is missing", op, name)
	case b.DType() != dt:
		return fmt.Errorf("kernels: %s: %s %v: dtype %s, want %s", op, name, b, b.DType(), dt)
	case b.Rank() != rank:
		return fmt.Errorf("kernels: %s: %s %v: rank %d, want %d", op, name, b, b.Rank(), rank)
	}
	return nil
}

func shapeIs(op, name string, b *Buffer, shape ...int) error {
	if len(shape) != b.Rank() {
		return fmt.Errorf("kernels: %s: %s shape %v, want %v", op, name, b.shape, shape)
	}
	for i, d := range shape {
		if b.shape[i] != d {
			return fmt.Errorf("kernels: %s: %s shape %v, want %v", op, name, b.shape, shape)
		}
	}
	return nil
}

// operand names a buffer for error messages.
type operand struct {
	name string
	b    *Buffer
}

// overlaps reports whether two buffers of one backend share a byte.
func overlaps(a, b *Buffer) bool {
	if a == nil || b == nil || a.owner != b.owner || a.Size() == 0 || b.Size() == 0 {
		return false
	}
	return a.addr < b.addr+uintptr(b.Size()) && b.addr < a.addr+uintptr(a.Size())
}

// disjoint checks that no output overlaps an input or another output. Ops
// read inputs while other threads write outputs, so an overlap is a race
// (unless an op documents in-place use, as RMSNorm, Add and RoPE do).
func disjoint(op string, outs, ins []operand) error {
	for i, o := range outs {
		for _, p := range outs[i+1:] {
			if overlaps(o.b, p.b) {
				return fmt.Errorf("kernels: %s: outputs %s %v and %s %v overlap", op, o.name, o.b, p.name, p.b)
			}
		}
		for _, in := range ins {
			if overlaps(o.b, in.b) {
				return fmt.Errorf("kernels: %s: output %s %v overlaps input %s %v", op, o.name, o.b, in.name, in.b)
			}
		}
	}
	return nil
}
