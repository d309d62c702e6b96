package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
)

// Quantization recipes (docs/NVFP4.md sections 3 and 4) and block-scale
// layouts (section 6).
const (
	modePerTensor  = "per-tensor"
	modePerToken   = "per-token"
	layoutLinear   = "linear"
	layoutSwizzled = "swizzled"
)

// Suffixes of the three output tensors written for an input tensor T.
const (
	suffixPacked      = ".packed"
	suffixBlockScales = ".block_scales"
	suffixScale       = ".scale"
)

const quantizeUsage = `Usage: rollout-worker quantize --in IN.safetensors --out OUT.safetensors
       [--mode per-tensor|per-token] [--layout linear|swizzled] [--match REGEX]

Quantize every selected BF16 tensor T of IN to NVFP4 (docs/NVFP4.md) and
write OUT, atomically, with three tensors per input tensor of shape [N, K]
or [E, N, K] (K a multiple of 16):

  T.packed        U8   [..., N, K/2]   E2M1 codes, element 2j in the low nibble
  T.block_scales  U8   E4M3 block scales: [..., N, K/16] (linear) or the
                       128x4-swizzled bytes of each matrix, [..., rows_p*cols_p]
  T.scale         F32  decode scales: [] or [E] (per-tensor: S_dec of each
                       matrix), [..., N] (per-token: each row's scale)

Any selected tensor that is not BF16, has another rank, K % 16 != 0, or holds
NaN or Inf is an error, and OUT is then not written. Only the quantized
tensors are written; unselected tensors are not copied.

Flags:
`

// quantizeConfig is a validated quantize invocation.
type quantizeConfig struct {
	in, out string
	mode    string         // modePerTensor or modePerToken
	layout  string         // layoutLinear or layoutSwizzled
	match   *regexp.Regexp // nil selects every tensor
	workers int            // >= 1
}

// quantizeStats summarises a finished run.
type quantizeStats struct {
	tensors, matrices int
	bytesIn, bytesOut int64 // selected BF16 data read; size of OUT
}

func runQuantize(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("quantize", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), quantizeUsage)
		fs.PrintDefaults()
	}
	in := fs.String("in", "", "input safetensors `file` (required)")
	out := fs.String("out", "", "output safetensors `file` (required; written atomically)")
	mode := fs.String("mode", modePerTensor, "global scale: per-tensor (one per matrix) or per-token (one per row)")
	layout := fs.String("layout", layoutLinear, "block-scale layout: linear or swizzled (128x4)")
	match := fs.String("match", "", "quantize only tensors whose name matches this Go `regexp` (default: all)")
	workers := fs.Int("workers", runtime.NumCPU(), "matrices quantized in parallel")
	if err := parseFlags(fs, args); err != nil {
		return err
	}

	cfg := quantizeConfig{in: *in, out: *out, mode: *mode, layout: *layout, workers: *workers}
	switch {
	case cfg.in == "":
		return usageErrorf("--in is required")
	case cfg.out == "":
		return usageErrorf("--out is required")
	case cfg.mode != modePerTensor && cfg.mode != modePerToken:
		return usageErrorf("--mode must be %s or %s, not %q", modePerTensor, modePerToken, cfg.mode)
	case cfg.layout != layoutLinear && cfg.layout != layoutSwizzled:
		return usageErrorf("--layout must be %s or %s, not %q", layoutLinear, layoutSwizzled, cfg.layout)
	case cfg.workers < 1:
		return usageErrorf("--workers must be at least 1, not %d", cfg.workers)
	}
	if *match != "" {
		re, err := regexp.Compile(*match)
		if err != nil {
			return usageErrorf("--match: %v", err)
		}
		cfg.match = re
	}
	if same, err := sameFile(cfg.in, cfg.out); err == nil && same {
		return usageErrorf("--out %s is the input file", cfg.out)
	}

	st, err := quantizeFile(ctx, cfg)
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "quantize: %s -> %s: %d tensors (%d matrices), %s, %s block scales: %d bytes BF16 in, %d bytes out\n",
		cfg.in, cfg.out, st.tensors, st.matrices, cfg.mode, cfg.layout, st.bytesIn, st.bytesOut)
	return nil
}

// sameFile reports whether a and b name the same existing file.
func sameFile(a, b string) (bool, error) {
	sa, err := os.Stat(a)
	if err != nil {
		return false, err
	}
	sb, err := os.Stat(b)
	if err != nil {
		return false, err
	}
	return os.SameFile(sa, sb), nil
}

// qtensor is one selected input tensor and its quantized outputs.
type qtensor struct {
	in      stfile.Tensor
	e, n, k int  // matrices, rows and columns (e = 1 for rank 2)
	rank3   bool // scale shape [E] / [E, N] rather than [] / [N]
	blocks  int  // k / 16
	scaleSz int  // block-scale bytes per matrix

	packed, blockScales, scale []byte // outputs, filled by the workers
}

// quantizeFile reads cfg.in, quantizes the selected tensors and writes cfg.out.
// On error cfg.out is not created (stfile.Write is atomic).
func quantizeFile(ctx context.Context, cfg quantizeConfig) (quantizeStats, error) {
	var st quantizeStats
	f, err := stfile.Open(cfg.in)
	if err != nil {
		return st, err
	}
	defer f.Close()

	qs, err := selectTensors(f, cfg)
	if err != nil {
		return st, err
	}
	for _, q := range qs {
		st.tensors++
		st.matrices += q.e
		st.bytesIn += int64(len(q.in.Data))
	}
	if err := quantizeAll(ctx, qs, cfg); err != nil {
		return st, err
	}

	outs := make([]stfile.Tensor, 0, 3*len(qs))
	for _, q := range qs {
		lead := q.in.Shape[:len(q.in.Shape)-2] // [] or [E]
		bs := append(slices.Clone(lead), uint64(q.n), uint64(q.blocks))
		if cfg.layout == layoutSwizzled {
			bs = append(slices.Clone(lead), uint64(q.scaleSz))
		}
		ss := slices.Clone(lead) // per-tensor: [] or [E]
		if cfg.mode == modePerToken {
			ss = append(ss, uint64(q.n))
		}
		outs = append(outs,
			stfile.Tensor{Name: q.in.Name + suffixPacked, DType: stfile.U8,
				Shape: append(slices.Clone(lead), uint64(q.n), uint64(q.k/2)), Data: q.packed},
			stfile.Tensor{Name: q.in.Name + suffixBlockScales, DType: stfile.U8, Shape: bs, Data: q.blockScales},
			stfile.Tensor{Name: q.in.Name + suffixScale, DType: stfile.F32, Shape: ss, Data: q.scale},
		)
	}
	meta := map[string]string{
		"format":            "nvfp4",
		"block_size":        strconv.Itoa(nvfp4.BlockSize),
		"mode":              cfg.mode,
		"layout":            cfg.layout,
		"block_scale_dtype": "float8_e4m3fn",
	}
	if err := stfile.Write(cfg.out, outs, meta); err != nil {
		return st, err
	}
	if fi, err := os.Stat(cfg.out); err == nil {
		st.bytesOut = fi.Size()
	}
	return st, nil
}

// selectTensors picks the tensors cfg.match selects, checks that each can be
// quantized and allocates its outputs.
func selectTensors(f *stfile.File, cfg quantizeConfig) ([]*qtensor, error) {
	names := f.Names()
	var qs []*qtensor
	for _, name := range names {
		if cfg.match != nil && !cfg.match.MatchString(name) {
			continue
		}
		t, err := f.Tensor(name)
		if err != nil {
			return nil, err
		}
		q, err := newQTensor(t, cfg.mode, cfg.layout)
		if err != nil {
			return nil, fmt.Errorf("%s: tensor %q: %w", cfg.in, name, err)
		}
		qs = append(qs, q)
	}
	switch {
	case len(qs) > 0:
		return qs, nil
	case cfg.match != nil:
		return nil, fmt.Errorf("%s: --match %q selects none of its %d tensors", cfg.in, cfg.match, len(names))
	default:
		return nil, fmt.Errorf("%s: no tensors to quantize", cfg.in)
	}
}

func newQTensor(t stfile.Tensor, mode, layout string) (*qtensor, error) {
	if t.DType != stfile.BF16 {
		return nil, fmt.Errorf("dtype %s, want BF16 (select the BF16 weights with --match)", t.DType)
	}
	q := &qtensor{in: t, e: 1}
	switch len(t.Shape) {
	case 2:
	case 3:
		q.rank3 = true
		q.e = int(t.Shape[0])
	default:
		return nil, fmt.Errorf("rank %d (shape %v), want a matrix [N, K] or a stack of matrices [E, N, K]", len(t.Shape), t.Shape)
	}
	if slices.Contains(t.Shape, 0) {
		return nil, fmt.Errorf("shape %v has a zero dimension", t.Shape)
	}
	// stfile checked that the shape's product fits in an int.
	q.n, q.k = int(t.Shape[len(t.Shape)-2]), int(t.Shape[len(t.Shape)-1])
	if q.k%nvfp4.BlockSize != 0 {
		return nil, fmt.Errorf("K = %d (last dimension of shape %v) is not a multiple of %d", q.k, t.Shape, nvfp4.BlockSize)
	}
	q.blocks = q.k / nvfp4.BlockSize
	q.scaleSz = q.n * q.blocks
	if layout == layoutSwizzled {
		rowsP, colsP := nvfp4.SwizzledDims(q.n, q.blocks)
		q.scaleSz = rowsP * colsP
	}
	scales := q.e // per-tensor: one per matrix
	if mode == modePerToken {
		scales *= q.n // one per row
	}
	q.packed = make([]byte, q.e*q.n*q.k/2)
	q.blockScales = make([]byte, q.e*q.scaleSz)
	q.scale = make([]byte, 4*scales)
	return q, nil
}

// job is one matrix: matrix e of tensor q.
type job struct {
	q *qtensor
	e int
}

// quantizeAll quantizes every matrix of qs on cfg.workers goroutines, which
// it starts and joins. It returns the first error in tensor order.
func quantizeAll(ctx context.Context, qs []*qtensor, cfg quantizeConfig) error {
	var jobs []job
	for _, q := range qs {
		for e := range q.e {
			jobs = append(jobs, job{q, e})
		}
	}
	// Biggest first, so one large matrix does not start last.
	order := make([]int, len(jobs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return len(jobs[b].q.in.Data)/jobs[b].q.e - len(jobs[a].q.in.Data)/jobs[a].q.e
	})

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, len(jobs))
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(cfg.workers, len(jobs)) {
		wg.Go(func() {
			var w quantScratch
			for {
				i := int(next.Add(1) - 1)
				if i >= len(order) || ctx.Err() != nil {
					return
				}
				j := order[i]
				if err := w.quantize(jobs[j], cfg); err != nil {
					errs[j] = fmt.Errorf("%s: %w", cfg.in, err)
					cancel()
					return
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return context.Cause(ctx) // nil unless the caller cancelled
}

// quantScratch holds one goroutine's scratch buffers.
type quantScratch struct {
	src       []uint16
	linear    []byte
	rowScales []float32
}

// quantize quantizes matrix j.e of tensor j.q into its outputs.
func (w *quantScratch) quantize(j job, cfg quantizeConfig) error {
	q := j.q
	n, k := q.n, q.k
	elems := n * k
	data := q.in.Data[2*j.e*elems : 2*(j.e+1)*elems]
	w.src = grow(w.src, elems)
	for i := range w.src {
		h := binary.LittleEndian.Uint16(data[2*i:])
		if !bf16.IsFinite(h) {
			return fmt.Errorf("tensor %q: element %s is %v; NaN and Inf cannot be quantized",
				q.in.Name, elementIndex(q, j.e, i), bf16.ToFloat32(h))
		}
		w.src[i] = h
	}

	packed := q.packed[j.e*elems/2 : (j.e+1)*elems/2]
	linear := q.blockScales[j.e*q.scaleSz : (j.e+1)*q.scaleSz]
	if cfg.layout == layoutSwizzled {
		w.linear = grow(w.linear, n*q.blocks)
		linear = w.linear
	}
	switch cfg.mode {
	case modePerTensor:
		sDec, err := nvfp4.QuantizeMatrix(packed, linear, w.src, n, k)
		if err != nil {
			return fmt.Errorf("tensor %q: %w", q.in.Name, err)
		}
		binary.LittleEndian.PutUint32(q.scale[4*j.e:], math.Float32bits(sDec))
	case modePerToken:
		w.rowScales = grow(w.rowScales, n)
		if err := nvfp4.QuantizePerRow(packed, linear, w.rowScales, w.src, n, k); err != nil {
			return fmt.Errorf("tensor %q: %w", q.in.Name, err)
		}
		out := q.scale[4*j.e*n : 4*(j.e+1)*n]
		for r, s := range w.rowScales {
			binary.LittleEndian.PutUint32(out[4*r:], math.Float32bits(s))
		}
	}
	if cfg.layout == layoutSwizzled {
		dst := q.blockScales[j.e*q.scaleSz : (j.e+1)*q.scaleSz]
		if err := nvfp4.Swizzle(dst, linear, n, q.blocks); err != nil {
			return fmt.Errorf("tensor %q: %w", q.in.Name, err)
		}
	}
	return nil
}

// elementIndex formats the index of element i of matrix e of q.
func elementIndex(q *qtensor, e, i int) string {
	if q.rank3 {
		return fmt.Sprintf("[%d, %d, %d]", e, i/q.k, i%q.k)
	}
	return fmt.Sprintf("[%d, %d]", i/q.k, i%q.k)
}

// grow returns s resized to n elements, reusing its storage when it can.
func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}
