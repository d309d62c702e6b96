package moe

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync/atomic"

	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// Sentinel errors.
var (
	// ErrClosed is returned by a Layer used after Close.
	ErrClosed = errors.New("moe: layer is closed")
	// ErrNotQuantized is returned by Forward when the recipe reads NVFP4
	// copies that are not built for every expert (by Requantize or
	// SetQuantized), or after a Requantize failed.
	ErrNotQuantized = errors.New("moe: NVFP4 copies not built: call Requantize after loading the weights")
	// ErrNotCalibrated is returned by Forward under RecipePerTensor before
	// the layer has its input scales (SetInputScales, or Calibrate then
	// EndCalibration).
	ErrNotCalibrated = errors.New("moe: per_tensor input scales not set: call SetInputScales, or Calibrate then EndCalibration")
)

// Layer is one MoE layer resident in backend memory.
type Layer struct {
	cfg   Config
	spec  recipeSpec
	act   kernels.Activation
	score kernels.Scoring
	be    kernels.Backend

	router *kernels.Buffer // BF16 [E, H]
	fc1    *kernels.Buffer // BF16 [E, I1, H]
	fc2    *kernels.Buffer // BF16 [E, H, I]
	fc1q   kernels.NVFP4   // [E, I1, Hp/2], [E, I1, Hp/16], alpha [E]
	fc2q   kernels.NVFP4   // [E, H, Ip/2], [E, H, Ip/16], alpha [E]
	// amax1, amax2: each expert's FC1 and FC2 amax as StageAmax last
	// measured them (F32 [E]); amaxGen counts StageAmax calls, so that a
	// hint from an older one is never used (atomic: StageAmax runs on the
	// refit path's goroutine).
	amax1, amax2 *kernels.Buffer
	amaxGen      atomic.Uint64

	// RecipePerTensor: the S_dec of FC1's and FC2's inputs (ins, F32 [2],
	// whose halves in1 and in2 the quantizers read from backend memory, so
	// a captured graph sees a new value) and their host copies; calX and
	// calH, the running maxima of those inputs over the Calibrate calls
	// since the last EndCalibration or ResetCalibration (calRuns of them).
	ins, in1, in2 *kernels.Buffer
	inScales      [2]float32
	inSet         bool
	calX, calH    *kernels.Buffer
	calRuns       int

	// Workspaces for MaxTokens tokens (R = MaxTokens * TopK sorted rows).
	logits  *kernels.Buffer // F32 [T, E]
	ids     *kernels.Buffer // I32 [T, k]
	weights *kernels.Buffer // F32 [T, k]
	acc     *kernels.Buffer // F32 [T, H]: the atomic finalize's sums (AtomicFinalize), else nil
	offsets *kernels.Buffer // I32 [E+1]
	gather  *kernels.Buffer // I32 [R]
	slots   *kernels.Buffer // I32 [R]
	xq      kernels.NVFP4   // per-token FC1 input [T, Hp/2] ...
	h       *kernels.Buffer // BF16 [R, I]: FC1 output after the activation
	hq      kernels.NVFP4   // per-row FC2 input [R, Ip/2] ...
	y       *kernels.Buffer // BF16 [R, H]: FC2 output, expert order

	owned  []*kernels.Buffer // everything New allocated, for Close
	closed bool
	// built marks the experts whose NVFP4 copies Requantize or
	// SetQuantized wrote; quantized is every expert built (a failed
	// Requantize clears both: some copies may be half rebuilt).
	built     []bool
	quantized bool
	marker    kernels.Marker
}

// SetMarker makes Forward mark its groups of ops on mk ("router": the
// router GEMM; "experts": routing, dispatch, both expert GEMMs and the
// finalize); nil stops it.
func (l *Layer) SetMarker(mk kernels.Marker) { l.marker = mk }

func (l *Layer) mark(group string) error {
	if l.marker == nil {
		return nil
	}
	return l.marker.Mark(group)
}

// New allocates a layer with zero weights: the router [E, H], the BF16
// expert stacks FC1 [E, I1, H] and FC2 [E, H, I], the recipe's NVFP4 copies,
// and all workspaces. Load weights into Router, FC1 and FC2, then call
// Requantize.
func New(be kernels.Backend, cfg Config) (*Layer, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	l := &Layer{cfg: cfg, be: be}
	l.spec, _ = cfg.Recipe.spec()
	l.act, _ = cfg.Activation.kernel()
	l.score, _ = cfg.Scoring.kernel()
	if err := l.alloc(); err != nil {
		return nil, errors.Join(err, l.Close())
	}
	if l.spec.unitScale {
		if err := l.setInputScales(1, 1); err != nil {
			return nil, errors.Join(err, l.Close())
		}
	}
	return l, nil
}

func (l *Layer) alloc() error {
	c := l.cfg
	E, H, I, I1 := c.Experts, c.Hidden, c.Intermediate, c.fc1Rows()
	Hp, Ip := nvfp4.PaddedK(H), nvfp4.PaddedK(I)
	T, R := c.MaxTokens, c.MaxTokens*c.TopK
	var err error
	buf := func(dt kernels.DType, shape ...int) *kernels.Buffer {
		if err != nil {
			return nil
		}
		var b *kernels.Buffer
		if b, err = l.be.Alloc(dt, shape...); err != nil {
			err = fmt.Errorf("moe: alloc %s%v: %w", dt, shape, err)
			return nil
		}
		l.owned = append(l.owned, b)
		return b
	}
	quant := func(lead []int, kp, scales int) kernels.NVFP4 {
		return kernels.NVFP4{
			Packed: buf(kernels.U8, append(lead, kp/2)...),
			Scales: buf(kernels.U8, append(lead, kp/nvfp4.BlockSize)...),
			Scale:  buf(kernels.F32, scales),
		}
	}
	l.router = buf(kernels.BF16, E, H)
	l.fc1 = buf(kernels.BF16, E, I1, H)
	l.fc2 = buf(kernels.BF16, E, H, I)
	if l.spec.quantWeights {
		l.fc1q = quant([]int{E, I1}, Hp, E)
		l.fc2q = quant([]int{E, H}, Ip, E)
		l.amax1, l.amax2 = buf(kernels.F32, E), buf(kernels.F32, E)
	}
	l.logits = buf(kernels.F32, T, E)
	l.ids = buf(kernels.I32, T, c.TopK)
	l.weights = buf(kernels.F32, T, c.TopK)
	l.offsets = buf(kernels.I32, E+1)
	l.gather = buf(kernels.I32, R)
	l.slots = buf(kernels.I32, R)
	if l.spec.quantActs {
		l.xq = quant([]int{T}, Hp, T)
		l.hq = quant([]int{R}, Ip, R)
	}
	if l.spec.tensorActs {
		l.ins = buf(kernels.F32, 2)
		l.calX, l.calH = buf(kernels.F32, 1), buf(kernels.F32, 1)
		if err == nil {
			if l.in1, err = l.ins.Slice(0, 1); err == nil {
				l.in2, err = l.ins.Slice(1, 2)
			}
		}
	}
	l.h = buf(kernels.BF16, R, I)
	if c.AtomicFinalize {
		l.acc = buf(kernels.F32, T, H) // zero from Alloc; FinalizeScattered clears it after each forward
	} else {
		l.y = buf(kernels.BF16, R, H)
	}
	return err
}

// Config returns the layer's configuration, defaults filled in.
func (l *Layer) Config() Config { return l.cfg }

// Router returns the BF16 router weight [E, H].
func (l *Layer) Router() *kernels.Buffer { return l.router }

// FC1 returns the BF16 FC1 stack [E, I1, H] ([gate; up] for SwiGLU).
func (l *Layer) FC1() *kernels.Buffer { return l.fc1 }

// FC2 returns the BF16 FC2 stack [E, H, I].
func (l *Layer) FC2() *kernels.Buffer { return l.fc2 }

// Routing returns the buffer of expert ids the last Forward routed its
// tokens to: I32 [MaxTokens, TopK], valid for the first T rows.
func (l *Layer) Routing() *kernels.Buffer { return l.ids }

// Quantized returns the NVFP4 copies of FC1 and FC2 (zero values when the
// recipe runs on BF16 weights). Their buffers never change.
func (l *Layer) Quantized() (fc1, fc2 kernels.NVFP4) { return l.fc1q, l.fc2q }

// Requantize rebuilds the NVFP4 copies of the given experts (all of them
// when none are given) from the BF16 stacks, into the same buffers. It is a
// no-op for recipes without weight copies.
func (l *Layer) Requantize(experts ...int) error { return l.RequantizeHinted(AmaxHint{}, experts...) }

// AmaxHint says which experts' amax StageAmax measured for one
// requantization (RequantizeHinted). The zero value holds none.
type AmaxHint struct {
	l   *Layer
	gen uint64
	has []bool // by expert
}

// StageAmax measures the FC1 and FC2 amax of the given experts on the
// backend's staging path (kernels.AmaxStager: after every byte staged so
// far, off the op stream; the caller's StageSync waits for it), for a
// RequantizeHinted of the same experts once their BF16 weights are final:
// the refit path calls it when a version's bytes are all in, before the
// commit, so the commit's requantization reads each matrix once. It holds
// no experts where the backend cannot (or the recipe has no copies). A
// later StageAmax supersedes the hint. It may run on another goroutine
// than the layer's others (package doc), while the layer is open.
func (l *Layer) StageAmax(experts ...int) (AmaxHint, error) {
	st, ok := l.be.(kernels.AmaxStager)
	if !ok || !l.spec.quantWeights {
		return AmaxHint{}, nil
	}
	h := AmaxHint{l: l, gen: l.amaxGen.Add(1), has: make([]bool, l.cfg.Experts)}
	err := forRuns(experts, l.cfg.Experts, func(lo, hi int) error {
		for _, m := range [][2]*kernels.Buffer{{l.amax1, l.fc1}, {l.amax2, l.fc2}} {
			dst, err := m[0].Slice(lo, hi)
			if err != nil {
				return err
			}
			src, err := m[1].Slice(lo, hi)
			if err != nil {
				return err
			}
			if err := st.StageAmax(dst, src); err != nil {
				return err
			}
		}
		for e := lo; e < hi; e++ {
			h.has[e] = true
		}
		return nil
	})
	if err != nil {
		return AmaxHint{}, fmt.Errorf("moe: stage amax: %w", err)
	}
	return h, nil
}

// RequantizeHinted is Requantize, taking the amax of the experts h holds
// from it (they must not have changed since its StageAmax) rather than
// measuring them again: the same bits, one read of their BF16 weights
// instead of two.
func (l *Layer) RequantizeHinted(h AmaxHint, experts ...int) error {
	if l.closed {
		return ErrClosed
	}
	if !l.spec.quantWeights {
		return nil
	}
	if h.l != l || h.gen != l.amaxGen.Load() {
		h.has = nil
	}
	hinted := func(e int) bool { return h.has != nil && h.has[e] }
	all := len(experts) == 0
	if all {
		experts = make([]int, l.cfg.Experts)
		for e := range experts {
			experts[e] = e
		}
	}
	// Runs of consecutive experts, hinted or not, become one op each.
	err := forRuns(experts, l.cfg.Experts, func(lo, hi int) error {
		for i := lo; i < hi; {
			j := i + 1
			for j < hi && hinted(j) == hinted(i) {
				j++
			}
			if err := l.requantize(i, j, hinted(i)); err != nil {
				return err
			}
			i = j
		}
		return nil
	})
	if err != nil {
		l.setBuilt(nil)
		return err
	}
	l.setBuilt(experts)
	return nil
}

// setBuilt marks the experts built, or (nil) none.
func (l *Layer) setBuilt(experts []int) {
	if l.built == nil {
		l.built = make([]bool, l.cfg.Experts)
	}
	if experts == nil {
		clear(l.built)
	}
	for _, e := range experts {
		l.built[e] = true
	}
	l.quantized = !slices.Contains(l.built, false)
}

// QuantizedMatrix is one expert matrix in NVFP4 as a quantized checkpoint
// holds it: codes [rows, Kp/2] and block scales [rows, Kp/16] (rows and Kp
// as the layer's copy of that matrix has them) and the matrix's global
// decode scale S_dec, its GEMM's alpha.
type QuantizedMatrix struct {
	Packed, Scales []byte
	Scale          float32
}

// SetQuantized writes expert e's NVFP4 copies as given, in place of a
// requantization of its BF16 weights: FC1 (for SwiGLU its gate rows, then
// its up rows, one matrix with one scale) and FC2. It is how a model loads
// a checkpoint quantized already; the BF16 stacks are the caller's to
// fill (the dequantized values), and a later Requantize of the expert
// replaces the copies with this worker's quantization of them.
func (l *Layer) SetQuantized(e int, fc1, fc2 QuantizedMatrix) error {
	if l.closed {
		return ErrClosed
	}
	if !l.spec.quantWeights {
		return fmt.Errorf("moe: set quantized expert %d: recipe %s keeps no NVFP4 copies", e, l.cfg.Recipe)
	}
	if e < 0 || e >= l.cfg.Experts {
		return fmt.Errorf("moe: set quantized expert %d of %d", e, l.cfg.Experts)
	}
	type part struct {
		name string
		dst  kernels.NVFP4
		src  QuantizedMatrix
	}
	parts := []part{{"FC1", l.fc1q, fc1}, {"FC2", l.fc2q, fc2}}
	for i, m := range parts { // every check before any write: a refusal changes nothing
		dst, err := sliceNVFP4(m.dst, e, e+1)
		if err != nil {
			return fmt.Errorf("moe: set quantized expert %d %s: %w", e, m.name, err)
		}
		if len(m.src.Packed) != dst.Packed.Size() || len(m.src.Scales) != dst.Scales.Size() {
			return fmt.Errorf("moe: set quantized expert %d %s: %d code bytes and %d block scales, want %d and %d",
				e, m.name, len(m.src.Packed), len(m.src.Scales), dst.Packed.Size(), dst.Scales.Size())
		}
		parts[i].dst = dst
	}
	for _, m := range parts {
		err := l.be.Upload(m.dst.Packed, 0, m.src.Packed)
		if err == nil {
			err = l.be.Upload(m.dst.Scales, 0, m.src.Scales)
		}
		if err == nil {
			err = l.be.Upload(m.dst.Scale, 0, binary.LittleEndian.AppendUint32(nil, math.Float32bits(m.src.Scale)))
		}
		if err != nil {
			l.setBuilt(nil) // a copy may be half written
			return fmt.Errorf("moe: set quantized expert %d %s: %w", e, m.name, err)
		}
	}
	l.setBuilt([]int{e})
	return nil
}

// forRuns calls fn for each run [lo, hi) of consecutive experts of
// experts (in order), checking each lies in [0, n).
func forRuns(experts []int, n int, fn func(lo, hi int) error) error {
	for i := 0; i < len(experts); {
		j := i + 1
		for j < len(experts) && experts[j] == experts[j-1]+1 {
			j++
		}
		lo, hi := experts[i], experts[j-1]+1
		if lo < 0 || hi > n {
			return fmt.Errorf("moe: experts %d..%d of %d", lo, hi-1, n)
		}
		if err := fn(lo, hi); err != nil {
			return err
		}
		i = j
	}
	return nil
}

func (l *Layer) requantize(lo, hi int, hinted bool) error {
	for _, m := range []struct {
		src  *kernels.Buffer
		dst  kernels.NVFP4
		amax *kernels.Buffer
	}{{l.fc1, l.fc1q, l.amax1}, {l.fc2, l.fc2q, l.amax2}} {
		var args kernels.QuantizeArgs
		var err error
		args.Mode = kernels.PerMatrix
		args.Src, err = m.src.Slice(lo, hi)
		if err == nil {
			args.Dst, err = sliceNVFP4(m.dst, lo, hi)
		}
		if err == nil && hinted {
			args.Amax, err = m.amax.Slice(lo, hi)
		}
		if err == nil {
			err = l.be.Quantize(args)
		}
		if err != nil {
			return fmt.Errorf("moe: requantize experts %d..%d: %w", lo, hi-1, err)
		}
	}
	return nil
}

func sliceNVFP4(q kernels.NVFP4, lo, hi int) (kernels.NVFP4, error) {
	var out kernels.NVFP4
	var err error
	if out.Packed, err = q.Packed.Slice(lo, hi); err != nil {
		return out, err
	}
	if out.Scales, err = q.Scales.Slice(lo, hi); err != nil {
		return out, err
	}
	out.Scale, err = q.Scale.Slice(lo, hi)
	return out, err
}

// SetInputScales sets RecipePerTensor's activation scales: the S_dec
// (input_scale) of FC1's input and of FC2's input, each positive and
// finite. The values go to the backend memory the quantizers read, in
// order with the layer's other ops, so graphs captured earlier replay
// with them.
func (l *Layer) SetInputScales(fc1, fc2 float32) error {
	if l.closed {
		return ErrClosed
	}
	if !l.spec.tensorActs || l.spec.unitScale {
		return fmt.Errorf("moe: input scales: recipe %s takes none (only %s does)", l.cfg.Recipe, RecipePerTensor)
	}
	return l.setInputScales(fc1, fc2)
}

func (l *Layer) setInputScales(fc1, fc2 float32) error {
	for _, v := range []struct {
		name string
		s    float32
	}{{"fc1", fc1}, {"fc2", fc2}} {
		if !(v.s > 0) || math.IsInf(float64(v.s), 0) {
			return fmt.Errorf("moe: input scales: %s input scale %v: want a positive finite value", v.name, v.s)
		}
	}
	if err := l.be.Upload(l.ins, 0, kernels.Float32Bytes([]float32{fc1, fc2})); err != nil { // both or neither
		return fmt.Errorf("moe: input scales: %w", err)
	}
	l.inScales, l.inSet = [2]float32{fc1, fc2}, true
	return nil
}

// InputScales returns RecipePerTensor's activation scales (FC1's input,
// FC2's input) and whether they are set.
func (l *Layer) InputScales() (fc1, fc2 float32, ok bool) {
	return l.inScales[0], l.inScales[1], l.inSet
}

// Calibrate runs a forward of x into out, as Forward does, with each
// token's own activation scale (the per_token recipe's quantization), and
// folds the largest |value| of FC1's input (x) and of FC2's input (the
// activation's output) into the layer's running maxima. The first
// Calibrate after New, EndCalibration or ResetCalibration starts them
// afresh. The backend must measure amax on its op stream (kernels.Amaxer).
func (l *Layer) Calibrate(out, x *kernels.Buffer) error {
	if l.closed {
		return ErrClosed
	}
	if !l.spec.tensorActs || l.spec.unitScale {
		return fmt.Errorf("moe: calibrate: recipe %s takes no input scales (only %s does)", l.cfg.Recipe, RecipePerTensor)
	}
	if _, ok := l.be.(kernels.Amaxer); !ok {
		return fmt.Errorf("moe: calibrate: the backend measures no amax on its op stream")
	}
	T, err := l.checkForward(out, x)
	if err != nil || T == 0 {
		return err
	}
	if err := l.forward(out, x, T, true); err != nil {
		return fmt.Errorf("moe: calibrate %d tokens: %w", T, err)
	}
	l.calRuns++
	return nil
}

// EndCalibration sets the input scales from the maxima of the Calibrate
// calls since the last EndCalibration or ResetCalibration (CalibratedScales)
// and returns them; either way the next Calibrate starts afresh.
func (l *Layer) EndCalibration() (fc1, fc2 float32, err error) {
	defer l.ResetCalibration()
	if fc1, fc2, err = l.CalibratedScales(); err != nil {
		return 0, 0, err
	}
	if err := l.SetInputScales(fc1, fc2); err != nil {
		return 0, 0, err
	}
	return fc1, fc2, nil
}

// CalibratedScales returns the input scales the maxima of the Calibrate
// calls since the last EndCalibration or ResetCalibration give (as a
// tensor's global scale comes from its amax: S_dec = RN(1 / min(RN(2688 /
// amax), FLT_MAX)), 1 for an amax of 0), without setting them. It fails
// when no Calibrate ran or a maximum is not finite.
func (l *Layer) CalibratedScales() (fc1, fc2 float32, err error) {
	if l.closed {
		return 0, 0, ErrClosed
	}
	if !l.spec.tensorActs || l.spec.unitScale {
		return 0, 0, fmt.Errorf("moe: calibrated scales: recipe %s takes no input scales (only %s does)", l.cfg.Recipe, RecipePerTensor)
	}
	if l.calRuns == 0 {
		return 0, 0, fmt.Errorf("moe: calibrated scales: no Calibrate since the last calibration ended")
	}
	if err := l.be.Sync(); err != nil {
		return 0, 0, fmt.Errorf("moe: calibrated scales: %w", err)
	}
	var scales [2]float32
	for i, b := range []*kernels.Buffer{l.calX, l.calH} {
		raw := make([]byte, 4)
		if err := l.be.Download(raw, b, 0); err != nil {
			return 0, 0, fmt.Errorf("moe: calibrated scales: %w", err)
		}
		amax := math.Float32frombits(binary.LittleEndian.Uint32(raw))
		if math.IsNaN(float64(amax)) || math.IsInf(float64(amax), 0) {
			return 0, 0, fmt.Errorf("moe: calibrated scales: %s input amax %v over %d calls: not finite", []string{"fc1", "fc2"}[i], amax, l.calRuns)
		}
		_, scales[i] = nvfp4.EncodeScale(amax)
	}
	return scales[0], scales[1], nil
}

// ResetCalibration drops the maxima of the Calibrate calls so far: the next
// Calibrate starts afresh. The input scales stay as they are.
func (l *Layer) ResetCalibration() { l.calRuns = 0 }

// Forward computes out = MoE(x) for the T tokens of x (BF16 [T, H], T <=
// MaxTokens) into out (BF16 [T, H]).
func (l *Layer) Forward(out, x *kernels.Buffer) error {
	if l.closed {
		return ErrClosed
	}
	if l.spec.tensorActs && !l.inSet {
		return ErrNotCalibrated
	}
	T, err := l.checkForward(out, x)
	if err != nil || T == 0 {
		return err
	}
	if err := l.forward(out, x, T, false); err != nil {
		return fmt.Errorf("moe: forward %d tokens: %w", T, err)
	}
	return nil
}

// checkForward checks Forward's operands and returns the token count.
func (l *Layer) checkForward(out, x *kernels.Buffer) (int, error) {
	c := l.cfg
	if x == nil || x.DType() != kernels.BF16 || x.Rank() != 2 || x.Dim(1) != c.Hidden || x.Dim(0) > c.MaxTokens {
		return 0, fmt.Errorf("moe: forward: input %v, want bf16 [tokens, %d] with at most %d tokens", x, c.Hidden, c.MaxTokens)
	}
	if l.spec.quantWeights && !l.quantized {
		return 0, ErrNotQuantized
	}
	T := x.Dim(0)
	if out == nil || out.DType() != kernels.BF16 || out.Rank() != 2 || out.Dim(0) != T || out.Dim(1) != c.Hidden {
		return 0, fmt.Errorf("moe: forward: output %v, want bf16 [%d, %d]", out, T, c.Hidden)
	}
	return T, nil
}

// forward runs the layer on T tokens. With calibrate the activations take
// per-row scales and their amax folds into calX and calH.
func (l *Layer) forward(out, x *kernels.Buffer, T int, calibrate bool) error {
	c := l.cfg
	R := T * c.TopK
	v := kernels.Views{}
	logits, ids, weights := v.Rows(l.logits, T), v.Rows(l.ids, T), v.Rows(l.weights, T)
	gather, slots, h := v.Rows(l.gather, R), v.Rows(l.slots, R), v.Rows(l.h, R)
	var y, acc *kernels.Buffer
	if l.cfg.AtomicFinalize {
		acc = v.Rows(l.acc, T)
	} else {
		y = v.Rows(l.y, R)
	}
	var xq, hq kernels.NVFP4
	if l.spec.quantActs {
		xq, hq = v.NVFP4Rows(l.xq, T), v.NVFP4Rows(l.hq, R)
	}
	if v.Err != nil {
		return v.Err
	}

	if err := l.mark("router"); err != nil {
		return err
	}
	if err := l.be.Gemm(logits, x, l.router); err != nil {
		return err
	}
	if err := l.mark("experts"); err != nil {
		return err
	}
	ra := kernels.RouteArgs{Logits: logits, IDs: ids, Weights: weights, Scoring: l.score, Renormalize: c.Renormalize, Scale: c.RoutedScaling}
	pa := kernels.PermuteArgs{IDs: ids, Offsets: l.offsets, Rows: gather, Slots: slots}
	fc1In, fc2In := kernels.Operand{BF16: x}, kernels.Operand{BF16: h}
	// quantArgs quantizes an expert GEMM's input: per row, or with the
	// layer's scale (in) for every row.
	quantArgs := func(src *kernels.Buffer, dst kernels.NVFP4, in *kernels.Buffer) kernels.QuantizeArgs {
		if l.spec.tensorActs && !calibrate {
			return kernels.QuantizeArgs{Src: src, Dst: dst, Mode: kernels.PerTensor, Input: in}
		}
		return kernels.QuantizeArgs{Src: src, Dst: dst, Mode: kernels.PerRow}
	}
	amax := func(src, dst *kernels.Buffer) error {
		if !calibrate {
			return nil
		}
		return l.be.(kernels.Amaxer).Amax(kernels.AmaxArgs{Src: src, Dst: dst, Accumulate: l.calRuns > 0})
	}
	if err := amax(x, l.calX); err != nil {
		return err
	}
	var qa *kernels.QuantizeArgs
	if l.spec.quantActs {
		q := quantArgs(x, xq, l.in1)
		qa = &q
		fc1In = kernels.Operand{Q: xq}
	}
	if d, ok := l.be.(kernels.Dispatcher); ok {
		if err := d.Dispatch(ra, pa, qa); err != nil {
			return err
		}
	} else {
		if err := l.be.Route(ra); err != nil {
			return err
		}
		if err := l.be.Permute(pa); err != nil {
			return err
		}
		if qa != nil {
			if err := l.be.Quantize(*qa); err != nil {
				return err
			}
		}
	}
	fc1W, fc2W := kernels.Operand{BF16: l.fc1}, kernels.Operand{BF16: l.fc2}
	if l.spec.quantWeights {
		fc1W, fc2W = kernels.Operand{Q: l.fc1q}, kernels.Operand{Q: l.fc2q}
	}
	// FC1 + activation, rounded to BF16 (the grouped GEMM's output type).
	err := l.be.GroupedGemm(kernels.GroupedGemmArgs{A: fc1In, Gather: gather, W: fc1W, Offsets: l.offsets, Act: l.act, Out: h})
	if err != nil {
		return err
	}
	if err := amax(h, l.calH); err != nil {
		return err
	}
	if l.spec.quantActs {
		if err := l.be.Quantize(quantArgs(h, hq, l.in2)); err != nil {
			return err
		}
		fc2In = kernels.Operand{Q: hq}
	}
	if l.cfg.AtomicFinalize {
		err = l.be.GroupedGemm(kernels.GroupedGemmArgs{A: fc2In, W: fc2W, Offsets: l.offsets, Act: kernels.Identity,
			Scatter: &kernels.Scatter{Acc: acc, Tokens: gather, Weights: weights, Slots: slots}})
		if err != nil {
			return err
		}
		return l.be.FinalizeScattered(out, acc)
	}
	err = l.be.GroupedGemm(kernels.GroupedGemmArgs{A: fc2In, W: fc2W, Offsets: l.offsets, Act: kernels.Identity, Out: y})
	if err != nil {
		return err
	}
	return l.be.Finalize(kernels.FinalizeArgs{Out: out, Rows: y, Weights: weights, Slots: slots})
}

// Close frees every buffer of the layer. It is idempotent.
func (l *Layer) Close() error {
	var errs []error
	for _, b := range l.owned {
		if b != nil {
			errs = append(errs, l.be.Free(b))
		}
	}
	l.owned, l.closed = nil, true
	return errors.Join(errs...)
}
