package kernelstest

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// testGroupedGemmRows covers what the MoE layer relies on beyond the
// arithmetic: the FC2 form (no gather), rows outside the offsets left
// untouched, and a row's bits not depending on the other rows.
func testGroupedGemmRows(t *testing.T, be kernels.Backend) {
	// 300 experts, most of them empty: past the 256 that the CUDA tile
	// schedule's one-round path takes.
	for _, e := range []int{4, 300} {
		t.Run(fmt.Sprintf("e%d", e), func(t *testing.T) { testGroupedGemmRowsE(t, be, e) })
	}
}

func testGroupedGemmRowsE(t *testing.T, be kernels.Backend, E int) {
	r := rand.New(rand.NewPCG(13, 14))
	const N, K, Ta, topK = 24, 72, 9, 2
	ids := distinctIDs(r, Ta, topK, E, -1)
	offsets, _, _ := refPermute(ids, topK, E)
	R := Ta * topK
	x := randBF16(r, R*K, 1)
	w := randBF16(r, E*N*K, 0.1)
	for _, quant := range []bool{false, true} {
		t.Run(fmt.Sprintf("nvfp4=%v", quant), func(t *testing.T) {
			var A, W kernels.Operand
			if quant {
				A.Q, _ = quantHost(t, be, x, 1, R, K, kernels.PerRow)
				W.Q, _ = quantHost(t, be, w, E, N, K, kernels.PerMatrix)
			} else {
				A.BF16, W.BF16 = bf16Buf(t, be, x, R, K), bf16Buf(t, be, w, E, N, K)
			}
			// Rows [2, R-1) only: the first two and the last keep their
			// bytes.
			sub := append([]int32(nil), offsets...)
			for e := range sub {
				sub[e] = min(max(sub[e], 2), int32(R-1))
			}
			fill := make([]byte, R*N*2)
			for i := range fill {
				fill[i] = 0x5a
			}
			out := alloc(t, be, kernels.BF16, R, N)
			upload(t, be, out, fill)
			err := be.GroupedGemm(kernels.GroupedGemmArgs{A: A, W: W, Offsets: i32Buf(t, be, sub, E+1), Act: kernels.Identity, Out: out})
			if err != nil {
				t.Fatal(err)
			}
			got := download(t, be, out)
			row := 2 * N
			for _, i := range []int{0, 1, R - 1} {
				if !bytes.Equal(got[i*row:(i+1)*row], fill[i*row:(i+1)*row]) {
					t.Fatalf("row %d outside the offsets was written", i)
				}
			}
			// Each written row again as a one-row problem, with gather.
			for _, i := range []int{2, R / 2, R - 2} {
				e := 0
				for int(sub[e+1]) <= i {
					e++
				}
				one := make([]int32, E+1)
				for j := e + 1; j <= E; j++ {
					one[j] = 1
				}
				out1 := alloc(t, be, kernels.BF16, 1, N)
				err := be.GroupedGemm(kernels.GroupedGemmArgs{A: A, Gather: i32Buf(t, be, []int32{int32(i)}, 1), W: W,
					Offsets: i32Buf(t, be, one, E+1), Act: kernels.Identity, Out: out1})
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(download(t, be, out1), got[i*row:(i+1)*row]) {
					t.Fatalf("row %d alone differs from the batch", i)
				}
			}
		})
	}
}

// testQuantizeSlice quantizes experts 1..2 of a stack through Slice views,
// as an in-place requantization of touched experts does: the other experts
// keep their bytes, and the touched ones equal the codec.
func testQuantizeSlice(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(15, 16))
	const E, N, K = 4, 8, 40
	kp := nvfp4.PaddedK(K)
	src := randBF16(r, E*N*K, 1)
	S := bf16Buf(t, be, src, E, N, K)
	q := kernels.NVFP4{
		Packed: alloc(t, be, kernels.U8, E, N, kp/2),
		Scales: alloc(t, be, kernels.U8, E, N, kp/16),
		Scale:  alloc(t, be, kernels.F32, E),
	}
	for _, b := range []*kernels.Buffer{q.Packed, q.Scales, q.Scale} {
		upload(t, be, b, bytes.Repeat([]byte{0xa5}, b.Size()))
	}
	view := func(b *kernels.Buffer) *kernels.Buffer {
		v, err := b.Slice(1, 3)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	err := be.Quantize(kernels.QuantizeArgs{Src: view(S), Dst: kernels.NVFP4{Packed: view(q.Packed), Scales: view(q.Scales), Scale: view(q.Scale)}, Mode: kernels.PerMatrix})
	if err != nil {
		t.Fatal(err)
	}
	packed, scales, alpha := make([]byte, 2*N*kp/2), make([]byte, 2*N*kp/16), make([]float32, 2)
	if err := nvfp4.QuantizeStack(packed, scales, alpha, src[N*K:3*N*K], 2, N, K); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name      string
		b         *kernels.Buffer
		want      []byte
		perExpert int
	}{{"packed", q.Packed, packed, N * kp / 2}, {"scales", q.Scales, scales, N * kp / 16}, {"alpha", q.Scale, kernels.Float32Bytes(alpha), 4}} {
		got := download(t, be, c.b)
		pe := c.perExpert
		for _, e := range []int{0, 3} {
			if !bytes.Equal(got[e*pe:(e+1)*pe], bytes.Repeat([]byte{0xa5}, pe)) {
				t.Fatalf("%s of untouched expert %d changed", c.name, e)
			}
		}
		expectBytes(t, c.name, got[pe:3*pe], c.want, pe)
	}
}

// testRowInvariance checks that Route, per-row Quantize and Finalize give a
// token the same bits alone as inside a batch.
func testRowInvariance(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(17, 18))
	const T, E, k, H = 33, 10, 3, 48
	const tok = 20
	logits := make([]float32, T*E)
	for i := range logits {
		logits[i] = float32(r.NormFloat64())
	}
	route := func(l []float32, n int) ([]byte, []byte) {
		ids, w := alloc(t, be, kernels.I32, n, k), alloc(t, be, kernels.F32, n, k)
		err := be.Route(kernels.RouteArgs{Logits: f32Buf(t, be, l, n, E), IDs: ids, Weights: w, Scoring: kernels.Softmax, Renormalize: true, Scale: 2.5})
		if err != nil {
			t.Fatal(err)
		}
		return download(t, be, ids), download(t, be, w)
	}
	allIDs, allW := route(logits, T)
	oneIDs, oneW := route(logits[tok*E:(tok+1)*E], 1)
	if !bytes.Equal(oneIDs, allIDs[tok*k*4:(tok+1)*k*4]) || !bytes.Equal(oneW, allW[tok*k*4:(tok+1)*k*4]) {
		t.Fatal("route: a token alone differs from the batch")
	}

	x := edgeRows(r, T, H)
	quant := func(src []uint16, n int) []byte {
		q := kernels.NVFP4{Packed: alloc(t, be, kernels.U8, n, H/2), Scales: alloc(t, be, kernels.U8, n, H/16), Scale: alloc(t, be, kernels.F32, n)}
		if err := be.Quantize(kernels.QuantizeArgs{Src: bf16Buf(t, be, src, n, H), Dst: q, Mode: kernels.PerRow}); err != nil {
			t.Fatal(err)
		}
		return append(append(download(t, be, q.Packed), download(t, be, q.Scales)...), download(t, be, q.Scale)...)
	}
	all := quant(x, T)
	one := quant(x[tok*H:(tok+1)*H], 1)
	p, s := T*H/2, T*H/16
	want := append(append(append([]byte(nil), all[tok*H/2:(tok+1)*H/2]...), all[p+tok*H/16:p+(tok+1)*H/16]...), all[p+s+4*tok:p+s+4*tok+4]...)
	if !bytes.Equal(one, want) {
		t.Fatal("quantize: a row alone differs from the batch")
	}

	R := T * k
	y := bf16Buf(t, be, randBF16(r, R*H, 1), R, H)
	w, slots := finalizeInputs(r, T, k)
	fin := func(w []float32, slots []int32, n int) []byte {
		out := alloc(t, be, kernels.BF16, n, H)
		if err := be.Finalize(kernels.FinalizeArgs{Out: out, Rows: y, Weights: f32Buf(t, be, w, n, k), Slots: i32Buf(t, be, slots, n*k)}); err != nil {
			t.Fatal(err)
		}
		return download(t, be, out)
	}
	if !bytes.Equal(fin(w[tok*k:(tok+1)*k], slots[tok*k:(tok+1)*k], 1), fin(w, slots, T)[tok*H*2:(tok+1)*H*2]) {
		t.Fatal("finalize: a token alone differs from the batch")
	}
}

// testBadIndices: an index that would address memory out of bounds is
// reported, at the call (CPU) or at the next Sync (a device backend skips
// the row and raises its error flag). See the kernels package comment.
func testBadIndices(t *testing.T, be kernels.Backend) {
	const E, H = 3, 16
	w := alloc(t, be, kernels.BF16, E, 8, H)
	x := alloc(t, be, kernels.BF16, 2, H)
	out := alloc(t, be, kernels.BF16, 4, 8)
	ids22 := func(v ...int32) *kernels.Buffer { return i32Buf(t, be, v, 2, 2) }
	for _, c := range []struct {
		name string
		call func() error
	}{
		{"permute expert id", func() error {
			return be.Permute(kernels.PermuteArgs{IDs: ids22(0, 1, 2, 3), Offsets: alloc(t, be, kernels.I32, E+1),
				Rows: alloc(t, be, kernels.I32, 4), Slots: alloc(t, be, kernels.I32, 4)})
		}},
		{"grouped gemm gather", func() error {
			return be.GroupedGemm(kernels.GroupedGemmArgs{A: kernels.Operand{BF16: x}, Gather: i32Buf(t, be, []int32{0, 1, 2, 0}, 4),
				W: kernels.Operand{BF16: w}, Offsets: i32Buf(t, be, []int32{0, 2, 4, 4}, E+1), Act: kernels.Identity, Out: out})
		}},
		{"finalize slot", func() error {
			return be.Finalize(kernels.FinalizeArgs{Out: alloc(t, be, kernels.BF16, 2, 8), Rows: out,
				Weights: alloc(t, be, kernels.F32, 2, 2), Slots: i32Buf(t, be, []int32{0, 1, 9, 3}, 4)})
		}},
		{"embed id", func() error {
			return be.Embed(kernels.EmbedArgs{Out: alloc(t, be, kernels.BF16, 1, 8), Table: alloc(t, be, kernels.BF16, 10, 8), IDs: i32Buf(t, be, []int32{10}, 1)})
		}},
	} {
		err := c.call()
		if err == nil {
			err = be.Sync()
		}
		if err == nil {
			t.Errorf("%s: out-of-range index not reported", c.name)
		}
		if err := be.Sync(); err != nil {
			t.Errorf("%s: the error is still pending after it was reported: %v", c.name, err)
		}
	}
}

// testGroupedGemmExact runs NVFP4 x NVFP4 products whose sums FP32 holds
// exactly: random E2M1 codes (every one, both signs and both zeros), block
// scales 0.5, 1 and 2, global scales powers of two. Every correct backend
// must then give bf16(exact) bit for bit, whatever its reduction order,
// tile or dequantization trick; a flushed subnormal, a lost sign or a
// misplaced block shows up as a wrong bit. The row counts per expert span
// the tile sizes a backend may choose between, and K includes a partial
// last block pair. The one-hot cases give each activation row a single
// nonzero code, so each output is one product and the weights may take
// every E4M3 block scale but NaN (subnormals, 448, negative ones): that
// checks a backend's scale decoding over the whole format.
func testGroupedGemmExact(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(21, 22))
	blockScales := []byte{0x30, 0x38, 0x40} // E4M3 0.5, 1, 2
	for _, c := range []struct {
		name    string
		E, N, K int
		counts  []int32 // rows per expert
		act     kernels.Activation
		oneHot  bool
	}{
		{"decode", 3, 40, 1024, []int32{1, 0, 2}, kernels.Identity, false},
		{"small", 3, 136, 208, []int32{13, 7, 20}, kernels.ReLU2, false},
		{"mid", 3, 72, 1040, []int32{40, 0, 31}, kernels.Identity, false},
		{"large", 2, 264, 592, []int32{150, 77}, kernels.ReLU2, false},
		{"onehot", 2, 136, 1024, []int32{9, 30}, kernels.Identity, true},
		{"onehot_tail", 2, 72, 208, []int32{40, 3}, kernels.ReLU2, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			kp := nvfp4.PaddedK(c.K)
			offsets := make([]int32, c.E+1)
			for e, n := range c.counts {
				offsets[e+1] = offsets[e] + n
			}
			R := int(offsets[c.E])
			// Operands: codes, block scales and global scales chosen freely
			// (they need not be what a quantizer would produce).
			rnd := func(rows int) (packed, scales []byte) {
				packed, scales = make([]byte, rows*kp/2), make([]byte, rows*kp/16)
				for i := range packed {
					packed[i] = byte(r.IntN(256))
				}
				for i := range scales {
					scales[i] = blockScales[r.IntN(len(blockScales))]
				}
				return packed, scales
			}
			ap, as := rnd(R)
			wp, ws := rnd(c.E * c.N)
			if c.oneHot {
				for row := range R {
					clear(ap[row*kp/2 : (row+1)*kp/2])
					k := r.IntN(kp)
					code := byte(1 + r.IntN(14)) // any code but the zeros 0 and 8
					if code >= 8 {
						code++
					}
					ap[row*kp/2+k/2] = code << (4 * (k % 2))
					for b := range kp / 16 {
						as[row*kp/16+b] = 0x38 // 1
					}
				}
				for i := range ws {
					ws[i] = byte(r.IntN(255)) // every E4M3 byte ...
					if ws[i]&0x7f == 0x7f {   // ... but NaN
						ws[i] = 0x7e
					}
				}
			}
			aScale := make([]float32, R)
			for i := range aScale {
				aScale[i] = float32(math.Ldexp(1, r.IntN(5)-2))
			}
			alpha := make([]float32, c.E)
			for i := range alpha {
				alpha[i] = float32(math.Ldexp(1, r.IntN(3)-1))
			}
			up := func(b []byte, shape ...int) *kernels.Buffer {
				buf := alloc(t, be, kernels.U8, shape...)
				upload(t, be, buf, b)
				return buf
			}
			A := kernels.Operand{Q: kernels.NVFP4{Packed: up(ap, R, kp/2), Scales: up(as, R, kp/16), Scale: f32Buf(t, be, aScale, R)}}
			W := kernels.Operand{Q: kernels.NVFP4{Packed: up(wp, c.E, c.N, kp/2), Scales: up(ws, c.E, c.N, kp/16), Scale: f32Buf(t, be, alpha, c.E)}}
			out := alloc(t, be, kernels.BF16, R, c.N)
			if err := be.GroupedGemm(kernels.GroupedGemmArgs{A: A, W: W, Offsets: i32Buf(t, be, offsets, c.E+1), Act: c.act, Out: out}); err != nil {
				t.Fatal(err)
			}
			got := download(t, be, out)
			deq := func(packed, scales []byte, row int) []float64 {
				v := make([]float64, kp)
				for k := range kp {
					code := packed[row*kp/2+k/2] >> (4 * (k % 2)) & 15
					v[k] = float64(nvfp4.E2M1Decode(code)) * float64(nvfp4.E4M3Decode(scales[row*kp/16+k/16]))
				}
				return v
			}
			for e := range c.E {
				for row := int(offsets[e]); row < int(offsets[e+1]); row++ {
					a := deq(ap, as, row)
					for n := range c.N {
						w := deq(wp, ws, e*c.N+n)
						var sum float64 // exact: every partial sum is a multiple of 2^-4 below 2^20
						for k := range kp {
							sum += a[k] * w[k]
						}
						v := float32(float32(float32(sum)*aScale[row]) * alpha[e])
						if c.act == kernels.ReLU2 {
							v = max(v, 0)
							v *= v
						}
						want := bf16.FromFloat32(v)
						if g := uint16(got[2*(row*c.N+n)]) | uint16(got[2*(row*c.N+n)+1])<<8; g != want {
							t.Fatalf("out[%d,%d] = %#04x (%g), want %#04x (%g): exact sum %g", row, n, g, bf16.ToFloat32(g), want, bf16.ToFloat32(want), sum)
						}
					}
				}
			}
		})
	}
}
