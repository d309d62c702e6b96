package cpu

import (
	"fmt"
	"math"
	"slices"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// Tile sizes of the CPU GEMMs: a work item is up to tileM rows of A against
// up to tileN rows of W. They only change how work is split, never the
// order in which an output element is summed.
const (
	tileM = 16
	tileN = 64
)

// The dot products below all sum in the same fixed order: four interleaved
// lanes (element i goes to lane i%4, a tail past the last multiple of 4 to
// lane 0), combined as (l0+l1)+(l2+l3). The order depends only on the
// length, so a row gives the same bits whichever variant computes it, alone
// or in a batch. Products of BF16 or dequantized NVFP4 values are exact in
// binary32, so FMA contraction could not change them either.

// dot returns sum_i a[i]*b[i].
func dot(a, b []float32) float32 {
	var l0, l1, l2, l3 float32
	b = b[:len(a)]
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

// dot2 returns dot(a0, b) and dot(a1, b), loading b once.
func dot2(a0, a1, b []float32) (float32, float32) {
	var l0, l1, l2, l3, m0, m1, m2, m3 float32
	a1, b = a1[:len(a0)], b[:len(a0)]
	i := 0
	for ; i+4 <= len(a0); i += 4 {
		b0, b1, b2, b3 := b[i], b[i+1], b[i+2], b[i+3]
		l0 += a0[i] * b0
		l1 += a0[i+1] * b1
		l2 += a0[i+2] * b2
		l3 += a0[i+3] * b3
		m0 += a1[i] * b0
		m1 += a1[i+1] * b1
		m2 += a1[i+2] * b2
		m3 += a1[i+3] * b3
	}
	for ; i < len(a0); i++ {
		l0 += a0[i] * b[i]
		m0 += a1[i] * b[i]
	}
	return (l0 + l1) + (l2 + l3), (m0 + m1) + (m2 + m3)
}

// dotBF16 is dot(a, widen(w)) without materialising the widened row.
func dotBF16(a []float32, w []uint16) float32 {
	var l0, l1, l2, l3 float32
	a = a[:len(w)]
	i := 0
	for ; i+4 <= len(w); i += 4 {
		l0 += a[i] * bf16.ToFloat32(w[i])
		l1 += a[i+1] * bf16.ToFloat32(w[i+1])
		l2 += a[i+2] * bf16.ToFloat32(w[i+2])
		l3 += a[i+3] * bf16.ToFloat32(w[i+3])
	}
	for ; i < len(w); i++ {
		l0 += a[i] * bf16.ToFloat32(w[i])
	}
	return (l0 + l1) + (l2 + l3)
}

// dotNVFP4 is dot(a, dequant(row)) for one quantized row of whole blocks,
// dequantizing on the fly exactly as decodeNVFP4 does.
func (be *Backend) dotNVFP4(a []float32, packed, scales []byte) float32 {
	var l0, l1, l2, l3 float32
	for b, sf := range scales {
		s := nvfp4.E4M3Decode(sf)
		p := packed[b*nvfp4.BlockSize/2:][:nvfp4.BlockSize/2]
		x := a[b*nvfp4.BlockSize:][:nvfp4.BlockSize]
		for j := 0; j < len(p); j += 2 {
			q0, q1 := &be.fp4[p[j]], &be.fp4[p[j+1]]
			l0 += x[2*j] * (q0[0] * s)
			l1 += x[2*j+1] * (q0[1] * s)
			l2 += x[2*j+2] * (q1[0] * s)
			l3 += x[2*j+3] * (q1[1] * s)
		}
	}
	return (l0 + l1) + (l2 + l3)
}

// decodeBF16 widens a BF16 row into dst, zero-filling past the row.
func decodeBF16(dst []float32, row []uint16) {
	for i, h := range row {
		dst[i] = bf16.ToFloat32(h)
	}
	clear(dst[len(row):])
}

// decodeNVFP4 dequantizes one quantized row to e2m1(q) * f32(SF), which is
// exact; the FP32 global scales are applied in the GEMM epilogue, as on the
// GPU.
func (be *Backend) decodeNVFP4(dst []float32, packed, scales []byte) {
	for b, sf := range scales {
		s := nvfp4.E4M3Decode(sf)
		p := packed[b*nvfp4.BlockSize/2:][:nvfp4.BlockSize/2]
		d := dst[b*nvfp4.BlockSize:][:nvfp4.BlockSize]
		for j, v := range p {
			pair := &be.fp4[v]
			d[2*j] = pair[0] * s
			d[2*j+1] = pair[1] * s
		}
	}
}

// operand reads rows of a BF16 or NVFP4 matrix (stack) as FP32 of width kp.
type operand struct {
	be     *Backend
	bf     []uint16
	packed []byte
	scales []byte
	scale  []float32
	k, kp  int // k: stored row length (padded for NVFP4); kp: decoded width
}

func (be *Backend) newOperand(o kernels.Operand, kp int) operand {
	if o.Quantized() {
		k := 2 * o.Q.Packed.Dim(-1)
		return operand{be: be, packed: o.Q.Packed.Host(), scales: o.Q.Scales.Host(), scale: f32s(o.Q.Scale), k: k, kp: kp}
	}
	return operand{be: be, bf: u16s(o.BF16), k: o.BF16.Dim(-1), kp: kp}
}

// row decodes global row r (of the flattened [rows, k] view) into dst[:kp].
func (o operand) row(dst []float32, r int) {
	if o.bf != nil {
		decodeBF16(dst[:o.kp], o.bf[r*o.k:(r+1)*o.k])
		return
	}
	o.be.decodeNVFP4(dst[:o.k], o.packed[r*o.k/2:(r+1)*o.k/2], o.scales[r*o.k/nvfp4.BlockSize:(r+1)*o.k/nvfp4.BlockSize])
	clear(dst[o.k:o.kp])
}

// fused reports whether dotRow can read this operand's rows in place.
func (o operand) fused() bool { return o.k == o.kp }

// dotRow returns dot(a, row r) reading the row in place (see fused).
func (o operand) dotRow(a []float32, r int) float32 {
	if o.bf != nil {
		return dotBF16(a, o.bf[r*o.k:(r+1)*o.k])
	}
	return o.be.dotNVFP4(a, o.packed[r*o.k/2:(r+1)*o.k/2], o.scales[r*o.k/nvfp4.BlockSize:(r+1)*o.k/nvfp4.BlockSize])
}

// Gemm computes dst = a * w^T with FP32 accumulation.
func (be *Backend) Gemm(dst, a, w *kernels.Buffer) error {
	return issue(be, "gemm", gemmArgs{Dst: dst, A: a, W: w}, be.prepGemm)
}

func (be *Backend) prepGemm(g gemmArgs) (func() error, error) {
	dst, a, w := g.Dst, g.A, g.W
	m, n, k, err := kernels.ValidateGemm(dst, a, w)
	if err != nil {
		return nil, err
	}
	if err := be.owns("gemm", map[string]*kernels.Buffer{"dst": dst, "a": a, "w": w}); err != nil {
		return nil, err
	}
	return func() error {
		A, W := u16s(a), u16s(w)
		var outF []float32
		var outB []uint16
		if dst.DType() == kernels.F32 {
			outF = f32s(dst)
		} else {
			outB = u16s(dst)
		}
		mt, nt := (m+tileM-1)/tileM, (n+tileN-1)/tileN
		be.parallel(mt*nt, func(item int) {
			r0, c0 := item/nt*tileM, item%nt*tileN
			r1, c1 := min(r0+tileM, m), min(c0+tileN, n)
			buf := be.getScratch((r1 - r0 + 1) * k)
			defer be.putScratch(buf)
			rows, wrow := (*buf)[:(r1-r0)*k], (*buf)[(r1-r0)*k:]
			for r := r0; r < r1; r++ {
				decodeBF16(rows[(r-r0)*k:(r-r0+1)*k], A[r*k:(r+1)*k])
			}
			for c := c0; c < c1; c++ {
				decodeBF16(wrow, W[c*k:(c+1)*k])
				for r := r0; r < r1; r++ {
					v := dot(rows[(r-r0)*k:(r-r0+1)*k], wrow)
					if outF != nil {
						outF[r*n+c] = v
					} else {
						outB[r*n+c] = bf16.FromFloat32(v)
					}
				}
			}
		})
		return nil
	}, nil
}

// GroupedGemm runs the per-expert GEMMs with the fused epilogue.
func (be *Backend) GroupedGemm(a kernels.GroupedGemmArgs) error {
	return issue(be, "grouped gemm", a, be.prepGroupedGemm)
}

func (be *Backend) prepGroupedGemm(a kernels.GroupedGemmArgs) (func() error, error) {
	s, err := a.Validate()
	if err != nil {
		return nil, err
	}
	bufs := map[string]*kernels.Buffer{"offsets": a.Offsets, "out": a.Out, "gather": a.Gather,
		"A": a.A.BF16, "A.packed": a.A.Q.Packed, "A.scales": a.A.Q.Scales, "A.scale": a.A.Q.Scale,
		"W": a.W.BF16, "W.packed": a.W.Q.Packed, "W.scales": a.W.Q.Scales, "W.scale": a.W.Q.Scale}
	if sc := a.Scatter; sc != nil {
		bufs["scatter.acc"], bufs["scatter.tokens"], bufs["scatter.weights"], bufs["scatter.slots"] = sc.Acc, sc.Tokens, sc.Weights, sc.Slots
	}
	if err := be.owns("grouped gemm", bufs); err != nil {
		return nil, err
	}
	return func() error {
		offsets := i32s(a.Offsets)
		if offsets[0] < 0 || int(offsets[s.E]) > s.R {
			return fmt.Errorf("cpu: grouped gemm: offsets run from %d to %d, out has %d rows", offsets[0], offsets[s.E], s.R)
		}
		for e := range s.E {
			if offsets[e+1] < offsets[e] {
				return fmt.Errorf("cpu: grouped gemm: offsets decrease at expert %d (%d > %d)", e, offsets[e], offsets[e+1])
			}
		}
		var gather []int32
		if a.Gather != nil {
			gather = i32s(a.Gather)
			for r := offsets[0]; r < offsets[s.E]; r++ {
				if g := gather[r]; g < 0 || int(g) >= s.Ta {
					return fmt.Errorf("cpu: grouped gemm: sorted row %d gathers row %d of %d", r, g, s.Ta)
				}
			}
		}
		// The scatter: each sorted row's routing weight, found before any
		// output is touched.
		var rowWeight []float32
		if a.Scatter != nil {
			var err error
			if rowWeight, err = scatterWeights(a.Scatter, int(offsets[0]), int(offsets[s.E])); err != nil {
				return err
			}
		}
		A, W := be.newOperand(a.A, s.Kp), be.newOperand(a.W, s.Kp)
		var out []uint16
		if a.Scatter != nil {
			out = make([]uint16, s.R*s.OutN) // the rows, scattered below
		} else {
			out = u16s(a.Out)
		}

		// Work items: (expert, tile of its rows, tile of output columns).
		type item struct{ e, r0, r1, c0, c1 int }
		var items []item
		for e := range s.E {
			for r0 := int(offsets[e]); r0 < int(offsets[e+1]); r0 += tileM {
				for c0 := 0; c0 < s.OutN; c0 += tileN {
					items = append(items, item{e, r0, min(r0+tileM, int(offsets[e+1])), c0, min(c0+tileN, s.OutN)})
				}
			}
		}
		kp := s.Kp
		be.parallel(len(items), func(i int) {
			it := items[i]
			nr := it.r1 - it.r0
			buf := be.getScratch((nr + 2) * kp)
			defer be.putScratch(buf)
			rows, w0, w1 := (*buf)[:nr*kp], (*buf)[nr*kp:(nr+1)*kp], (*buf)[(nr+1)*kp:]
			src := make([]int, nr)
			for r := it.r0; r < it.r1; r++ {
				src[r-it.r0] = r
				if gather != nil {
					src[r-it.r0] = int(gather[r])
				}
				A.row(rows[(r-it.r0)*kp:], src[r-it.r0])
			}
			// Few rows: read W in place. More: widen each W row once and reuse
			// it. Both sum in the same order (see dot).
			inPlace := nr <= 2 && W.fused()
			acc := make([]float32, 2*nr)
			halves := 1
			if a.Act == kernels.SwiGLU {
				halves = 2
			}
			for c := it.c0; c < it.c1; c++ {
				gate, up := acc[:nr], acc[nr:]
				for half := range halves {
					r := it.e*s.N + half*s.OutN + c // W row: gate, or up for SwiGLU

					dst := gate
					if half == 1 {
						dst = up
					}
					if inPlace {
						for j := range nr {
							dst[j] = W.dotRow(rows[j*kp:(j+1)*kp], r)
						}
						continue
					}
					w := w0
					if half == 1 {
						w = w1
					}
					W.row(w, r)
					j := 0
					for ; j+2 <= nr; j += 2 {
						dst[j], dst[j+1] = dot2(rows[j*kp:(j+1)*kp], rows[(j+1)*kp:(j+2)*kp], w)
					}
					if j < nr {
						dst[j] = dot(rows[j*kp:(j+1)*kp], w)
					}
				}
				for j := range nr {
					h := epilogue(gate[j], A, W, src[j], it.e)
					switch a.Act {
					case kernels.ReLU2:
						h = max(h, 0)
						h *= h
					case kernels.SwiGLU:
						u := epilogue(up[j], A, W, src[j], it.e)
						h = h / (1 + float32(math.Exp(float64(-h)))) * u
					}
					out[(it.r0+j)*s.OutN+c] = bf16.FromFloat32(h)
				}
			}
		})
		if a.Scatter != nil {
			// Sequential here; the GPU's atomic additions run in any order.
			acc, tokens := f32s(a.Scatter.Acc), i32s(a.Scatter.Tokens)
			for r := int(offsets[0]); r < int(offsets[s.E]); r++ {
				dst := acc[int(tokens[r])*s.OutN:][:s.OutN]
				for c, v := range out[r*s.OutN:][:s.OutN] {
					dst[c] += float32(rowWeight[r-int(offsets[0])] * bf16.ToFloat32(v))
				}
			}
		}
		return nil
	}, nil
}

// scatterWeights returns the routing weight of sorted rows r0..r1-1: row r
// belongs to token t = Tokens[r], and its weight is Weights[t, j] for the j
// with Slots[t*k+j] = r.
func scatterWeights(sc *kernels.Scatter, r0, r1 int) ([]float32, error) {
	tokens, slots, weights := i32s(sc.Tokens), i32s(sc.Slots), f32s(sc.Weights)
	t, k := sc.Weights.Dim(0), sc.Weights.Dim(1)
	w := make([]float32, r1-r0)
	for r := r0; r < r1; r++ {
		tok := int(tokens[r])
		if tok < 0 || tok >= t {
			return nil, fmt.Errorf("cpu: grouped gemm: scatter: sorted row %d names token %d of %d", r, tok, t)
		}
		j := slices.Index(slots[tok*k:(tok+1)*k], int32(r))
		if j < 0 {
			return nil, fmt.Errorf("cpu: grouped gemm: scatter: sorted row %d is none of token %d's %d slots", r, tok, k)
		}
		w[r-r0] = weights[tok*k+j]
	}
	return w, nil
}

// epilogue applies the FP32 global scales: acc * per_token_scale * alpha.
func epilogue(acc float32, A, W operand, row, expert int) float32 {
	if A.scale != nil {
		acc *= A.scale[row]
	}
	if W.scale != nil {
		acc *= W.scale[expert]
	}
	return acc
}
