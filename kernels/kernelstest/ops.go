package kernelstest

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/kernels"
)

func testBuffers(t *testing.T, be kernels.Backend) {
	b := alloc(t, be, kernels.F32, 4, 3)
	if got := download(t, be, b); !bytes.Equal(got, make([]byte, 48)) {
		t.Fatalf("Alloc is not zeroed: % x", got)
	}
	data := make([]byte, 48)
	for i := range data {
		data[i] = byte(i + 1)
	}
	addr := b.Addr()
	upload(t, be, b, data)
	if err := be.Upload(b, 40, []byte{0xaa, 0xbb}); err != nil {
		t.Fatalf("Upload at offset: %v", err)
	}
	data[40], data[41] = 0xaa, 0xbb
	if got := download(t, be, b); !bytes.Equal(got, data) {
		t.Fatalf("round trip: got % x, want % x", got, data)
	}
	part := make([]byte, 5)
	if err := be.Download(part, b, 7); err != nil || !bytes.Equal(part, data[7:12]) {
		t.Fatalf("Download at offset 7: % x, %v; want % x", part, err, data[7:12])
	}
	if err := be.Upload(b, 47, []byte{1, 2}); err == nil {
		t.Fatal("Upload past the end succeeded")
	}
	if b.Addr() != addr {
		t.Fatalf("address moved from %#x to %#x", addr, b.Addr())
	}

	row2, err := b.Index(2)
	if err != nil {
		t.Fatal(err)
	}
	if row2.Addr() != addr+24 || !slices.Equal(row2.Shape(), []int{3}) {
		t.Fatalf("Index(2) = %v, want f32[3] at %#x", row2, addr+24)
	}
	if got := download(t, be, row2); !bytes.Equal(got, data[24:36]) {
		t.Fatalf("Index(2) reads % x, want % x", got, data[24:36])
	}
	first, err := b.Rows(2)
	if err != nil || first.Addr() != addr || first.Size() != 24 {
		t.Fatalf("Rows(2) = %v, %v", first, err)
	}
	if _, err := b.Rows(5); err == nil {
		t.Fatal("Rows(5) of 4 rows succeeded")
	}

	c := alloc(t, be, kernels.F32, 12)
	flat, err := b.Reshape(12)
	if err != nil {
		t.Fatal(err)
	}
	if err := be.Copy(c, flat); err != nil {
		t.Fatalf("Copy: %v", err)
	}
	if got := download(t, be, c); !bytes.Equal(got, data) {
		t.Fatalf("Copy: got % x", got)
	}
	// CopyAll: several pairs in order (the second overwrites part of the
	// first's destination), and a mismatched pair refused before any copy.
	d := alloc(t, be, kernels.F32, 12)
	dHead, err := d.Rows(3)
	if err != nil {
		t.Fatal(err)
	}
	if err := kernels.CopyAll(be, []*kernels.Buffer{d, dHead}, []*kernels.Buffer{flat, row2}); err != nil {
		t.Fatalf("CopyAll: %v", err)
	}
	want := slices.Concat(data[24:36], data[12:])
	if got := download(t, be, d); !bytes.Equal(got, want) {
		t.Fatalf("CopyAll: got % x, want % x", got, want)
	}
	e := alloc(t, be, kernels.F32, 12)
	if err := kernels.CopyAll(be, []*kernels.Buffer{e, dHead}, []*kernels.Buffer{flat, flat}); err == nil {
		t.Fatal("CopyAll of a 48-byte buffer into 12 bytes succeeded")
	}
	if got := download(t, be, e); !bytes.Equal(got, make([]byte, 48)) {
		t.Fatalf("a refused CopyAll copied: % x", got)
	}
	if err := kernels.CopyAll(be, []*kernels.Buffer{e}, nil); err == nil {
		t.Fatal("CopyAll of 1 destination and 0 sources succeeded")
	}
	if err := be.Zero(row2); err != nil {
		t.Fatalf("Zero: %v", err)
	}
	clear(data[24:36])
	if got := download(t, be, b); !bytes.Equal(got, data) {
		t.Fatalf("Zero of a view: got % x, want % x", got, data)
	}
}

func testGemm(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		m, n, k int
		dt      kernels.DType
	}{
		{1, 8, 16, kernels.F32},
		{5, 33, 200, kernels.F32},
		{37, 70, 96, kernels.BF16},
		{3, 129, 7, kernels.BF16},
		{70, 40, 1030, kernels.F32}, // many rows, K not a multiple of the slices' stride
		{12, 24, 7200, kernels.F32}, // 9-31 rows and a long K: CUDA's 16 x 8 narrow kernel for the batch and for the row
	} {
		t.Run(fmt.Sprintf("%dx%dx%d_%s", tc.m, tc.n, tc.k, tc.dt), func(t *testing.T) {
			a, w := randBF16(r, tc.m*tc.k, 1), randBF16(r, tc.n*tc.k, 0.1)
			A, W := bf16Buf(t, be, a, tc.m, tc.k), bf16Buf(t, be, w, tc.n, tc.k)
			D := alloc(t, be, tc.dt, tc.m, tc.n)
			if err := be.Gemm(D, A, W); err != nil {
				t.Fatal(err)
			}
			got := readFloats(t, be, D)
			ref := make([]float64, tc.m*tc.n)
			var maxRef float64
			for i := range tc.m {
				for j := range tc.n {
					var s float64
					for k := range tc.k {
						s += float64(bf16.ToFloat32(a[i*tc.k+k])) * float64(bf16.ToFloat32(w[j*tc.k+k]))
					}
					ref[i*tc.n+j] = s
					maxRef = max(maxRef, math.Abs(s))
				}
			}
			for i, g := range got {
				if !closeTo(float64(g), ref[i], maxRef) {
					t.Fatalf("dst[%d,%d] = %g, want %g", i/tc.n, i%tc.n, g, ref[i])
				}
			}
			// Batch invariance: the last row alone gives the same bits.
			last := tc.m - 1
			A1 := bf16Buf(t, be, a[last*tc.k:], 1, tc.k)
			D1 := alloc(t, be, tc.dt, 1, tc.n)
			if err := be.Gemm(D1, A1, W); err != nil {
				t.Fatal(err)
			}
			all := download(t, be, D)
			if one := download(t, be, D1); !bytes.Equal(one, all[last*tc.n*tc.dt.Size():]) {
				t.Fatal("a row's result changes with the batch")
			}
		})
	}
}

// testGemmSet: kernels.GemmSet over three weights of one input (widths
// that can share a launch, and widths that cannot) gives each output the
// bits Gemm gives it; a set with mismatched counts or overlapping outputs
// is refused.
func testGemmSet(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(3, 4))
	const k = 96
	for _, widths := range [][]int{{256, 128, 40}, {40, 128, 256}} {
		for _, m := range []int{1, 9, 70} {
			t.Run(fmt.Sprintf("%v_m%d", widths, m), func(t *testing.T) {
				A := bf16Buf(t, be, randBF16(r, m*k, 1), m, k)
				ws, sep, set := make([]*kernels.Buffer, 3), make([]*kernels.Buffer, 3), make([]*kernels.Buffer, 3)
				for i, n := range widths {
					ws[i] = bf16Buf(t, be, randBF16(r, n*k, 0.1), n, k)
					sep[i], set[i] = alloc(t, be, kernels.BF16, m, n), alloc(t, be, kernels.BF16, m, n)
					if err := be.Gemm(sep[i], A, ws[i]); err != nil {
						t.Fatal(err)
					}
				}
				if err := kernels.GemmSet(be, set, A, ws); err != nil {
					t.Fatal(err)
				}
				for i := range widths {
					if !bytes.Equal(download(t, be, set[i]), download(t, be, sep[i])) {
						t.Fatalf("output %d: GemmSet's bits differ from Gemm's", i)
					}
				}
			})
		}
	}
	A := bf16Buf(t, be, randBF16(r, 2*k, 1), 2, k)
	W := bf16Buf(t, be, randBF16(r, 8*k, 1), 8, k)
	D := alloc(t, be, kernels.F32, 2, 8)
	for name, err := range map[string]error{
		"count":   kernels.GemmSet(be, []*kernels.Buffer{D}, A, []*kernels.Buffer{W, W}),
		"overlap": kernels.GemmSet(be, []*kernels.Buffer{D, D}, A, []*kernels.Buffer{W, W}),
		"empty":   kernels.GemmSet(be, nil, A, nil),
	} {
		if err == nil {
			t.Errorf("GemmSet (%s): no error", name)
		}
	}
}

// readFloats downloads an F32 or BF16 buffer as float32 values.
func readFloats(t *testing.T, be kernels.Backend, b *kernels.Buffer) []float32 {
	t.Helper()
	raw := download(t, be, b)
	if b.DType() == kernels.F32 {
		return kernels.BytesFloat32(raw)
	}
	out := make([]float32, b.Len())
	for i, h := range kernels.BytesUint16(raw) {
		out[i] = bf16.ToFloat32(h)
	}
	return out
}

func testRoute(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(3, 4))
	// Expert counts for each way a backend may hold the scores (the CUDA
	// one: 1, 2 or 8 registers a lane, or shared memory past 256 experts).
	for _, sh := range []struct{ T, E int }{{37, 12}, {9, 40}, {6, 256}, {5, 300}} {
		testRouteShape(t, be, r, sh.T, sh.E)
	}
}

func testRouteShape(t *testing.T, be kernels.Backend, r *rand.Rand, T, E int) {
	t.Helper()
	logits := make([]float32, T*E)
	for i := range logits {
		logits[i] = float32(r.NormFloat64() * 2)
		if i/E%5 == 0 { // every fifth token from four values: exact ties, which go to the lower id
			logits[i] = float32(r.IntN(4) - 1)
		}
	}
	L := f32Buf(t, be, logits, T, E)
	for _, tc := range []struct {
		scoring kernels.Scoring
		k       int
		renorm  bool
		scale   float32
	}{
		{kernels.Softmax, 1, false, 1},
		{kernels.Softmax, 2, true, 1},
		{kernels.Softmax, 4, false, 2.5},
		{kernels.Sigmoid, 2, false, 1},
		{kernels.Sigmoid, 4, true, 2.5},
		{kernels.Softmax, 8, true, 1},
		{kernels.Softmax, min(E, 40), true, 1},
	} {
		t.Run(fmt.Sprintf("e%d_%s_k%d_renorm%v_scale%g", E, tc.scoring, tc.k, tc.renorm, tc.scale), func(t *testing.T) {
			ids, w := alloc(t, be, kernels.I32, T, tc.k), alloc(t, be, kernels.F32, T, tc.k)
			err := be.Route(kernels.RouteArgs{Logits: L, IDs: ids, Weights: w, Scoring: tc.scoring, Renormalize: tc.renorm, Scale: tc.scale})
			if err != nil {
				t.Fatal(err)
			}
			gotIDs, gotW := kernels.BytesInt32(download(t, be, ids)), kernels.BytesFloat32(download(t, be, w))
			for tok := range T {
				s := make([]float64, E)
				var sum float64
				for e := range E {
					l := float64(logits[tok*E+e])
					if tc.scoring == kernels.Softmax {
						s[e] = math.Exp(l)
						sum += s[e]
					} else {
						s[e] = 1 / (1 + math.Exp(-l))
					}
				}
				if tc.scoring == kernels.Softmax {
					for e := range s {
						s[e] /= sum
					}
				}
				order := make([]int, E)
				for i := range order {
					order[i] = i
				}
				slices.SortStableFunc(order, func(a, b int) int {
					if s[a] != s[b] {
						if s[a] > s[b] {
							return -1
						}
						return 1
					}
					return a - b
				})
				var ksum float64
				for _, e := range order[:tc.k] {
					ksum += s[e]
				}
				for j, e := range order[:tc.k] {
					want := s[e]
					if tc.renorm {
						want /= ksum
					}
					want *= float64(tc.scale)
					if int(gotIDs[tok*tc.k+j]) != e {
						t.Fatalf("token %d: ids %v, want %v", tok, gotIDs[tok*tc.k:(tok+1)*tc.k], order[:tc.k])
					}
					if g := float64(gotW[tok*tc.k+j]); math.Abs(g-want) > 1e-6+4*math.Ldexp(want, -23) {
						t.Fatalf("token %d slot %d: weight %g, want %g", tok, j, g, want)
					}
				}
			}
		})
	}
}

// distinctIDs draws, for each of t tokens, k distinct experts out of e,
// never using expert skip (so one expert group is empty).
func distinctIDs(r *rand.Rand, t, k, e, skip int) []int32 {
	ids := make([]int32, 0, t*k)
	for range t {
		perm := r.Perm(e)
		n := 0
		for _, x := range perm {
			if x != skip && n < k {
				ids = append(ids, int32(x))
				n++
			}
		}
	}
	return ids
}

// refPermute is the reference expert sort: stable by (expert, token, k).
func refPermute(ids []int32, k, e int) (offsets, rows, slots []int32) {
	offsets = make([]int32, e+1)
	rows = make([]int32, 0, len(ids))
	slots = make([]int32, len(ids))
	for x := range e {
		offsets[x] = int32(len(rows))
		for i, id := range ids {
			if int(id) == x {
				slots[i] = int32(len(rows))
				rows = append(rows, int32(i/k))
			}
		}
	}
	offsets[e] = int32(len(rows))
	return offsets, rows, slots
}

func testPermute(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(5, 6))
	// The last: 8800 assignments, 275 for each warp of the CUDA counting sort.
	for _, tc := range []struct{ t, k, e int }{{1, 1, 2}, {7, 2, 9}, {193, 8, 16}, {1100, 8, 64}} {
		t.Run(fmt.Sprintf("t%d_k%d_e%d", tc.t, tc.k, tc.e), func(t *testing.T) {
			ids := distinctIDs(r, tc.t, tc.k, tc.e, tc.e-1)
			I := i32Buf(t, be, ids, tc.t, tc.k)
			O, R, S := alloc(t, be, kernels.I32, tc.e+1), alloc(t, be, kernels.I32, tc.t*tc.k), alloc(t, be, kernels.I32, tc.t*tc.k)
			if err := be.Permute(kernels.PermuteArgs{IDs: I, Offsets: O, Rows: R, Slots: S}); err != nil {
				t.Fatal(err)
			}
			wo, wr, ws := refPermute(ids, tc.k, tc.e)
			for _, c := range []struct {
				name      string
				got, want []int32
			}{{"offsets", kernels.BytesInt32(download(t, be, O)), wo}, {"rows", kernels.BytesInt32(download(t, be, R)), wr}, {"slots", kernels.BytesInt32(download(t, be, S)), ws}} {
				if !slices.Equal(c.got, c.want) {
					t.Fatalf("%s = %v, want %v", c.name, c.got, c.want)
				}
			}
		})
	}
}

// testDispatch checks a backend's fused dispatch (kernels.Dispatcher)
// against Route, Permute and Quantize run separately, bit for bit, at
// batch sizes inside and past the CUDA backend's one-kernel path (32
// tokens, 256 experts, top-32), with and without the quantize, and its
// argument checks.
func testDispatch(t *testing.T, be kernels.Backend) {
	d, ok := be.(kernels.Dispatcher)
	if !ok {
		t.Skip("backend has no fused dispatch (kernels.Dispatcher)")
	}
	r := rand.New(rand.NewPCG(7, 8))
	const H = 200 // not a multiple of 16: the quantized rows are padded
	for _, tc := range []struct {
		t, e, k  int
		scoring  kernels.Scoring
		quantize kernels.QuantMode // 0: none
	}{
		{1, 256, 8, kernels.Softmax, kernels.PerRow}, {5, 12, 2, kernels.Sigmoid, kernels.PerRow}, {32, 256, 8, kernels.Softmax, kernels.PerRow},
		{7, 64, 4, kernels.Softmax, 0}, {33, 256, 8, kernels.Softmax, kernels.PerRow}, {4, 300, 4, kernels.Softmax, kernels.PerRow},
		{3, 40, 33, kernels.Softmax, 0}, {1, 256, 8, kernels.Softmax, kernels.PerTensor}, {32, 256, 8, kernels.Softmax, kernels.PerTensor},
	} {
		t.Run(fmt.Sprintf("t%d_e%d_k%d_%s_quantize_%v", tc.t, tc.e, tc.k, tc.scoring, tc.quantize), func(t *testing.T) {
			logits := make([]float32, tc.t*tc.e)
			for i := range logits {
				logits[i] = float32(r.NormFloat64() * 2)
				if i%7 == 0 {
					logits[i] = float32(r.IntN(3)) // exact ties
				}
			}
			L := f32Buf(t, be, logits, tc.t, tc.e)
			X := bf16Buf(t, be, randBF16(r, tc.t*H, 1), tc.t, H)
			type outs struct {
				ids, w, off, rows, slots *kernels.Buffer
				q                        kernels.NVFP4
			}
			mk := func() outs {
				return outs{alloc(t, be, kernels.I32, tc.t, tc.k), alloc(t, be, kernels.F32, tc.t, tc.k),
					alloc(t, be, kernels.I32, tc.e+1), alloc(t, be, kernels.I32, tc.t*tc.k), alloc(t, be, kernels.I32, tc.t*tc.k),
					kernels.NVFP4{Packed: alloc(t, be, kernels.U8, tc.t, 208/2), Scales: alloc(t, be, kernels.U8, tc.t, 208/16),
						Scale: alloc(t, be, kernels.F32, tc.t)}}
			}
			var I *kernels.Buffer
			if tc.quantize == kernels.PerTensor {
				I = f32Buf(t, be, []float32{0x1.8p-10}, 1)
			}
			args := func(o outs) (kernels.RouteArgs, kernels.PermuteArgs, *kernels.QuantizeArgs) {
				var q *kernels.QuantizeArgs
				if tc.quantize != 0 {
					q = &kernels.QuantizeArgs{Src: X, Dst: o.q, Mode: tc.quantize, Input: I}
				}
				return kernels.RouteArgs{Logits: L, IDs: o.ids, Weights: o.w, Scoring: tc.scoring, Renormalize: true, Scale: 2.5},
					kernels.PermuteArgs{IDs: o.ids, Offsets: o.off, Rows: o.rows, Slots: o.slots}, q
			}
			sep, fused := mk(), mk()
			ra, pa, qa := args(sep)
			if err := be.Route(ra); err != nil {
				t.Fatal(err)
			}
			if err := be.Permute(pa); err != nil {
				t.Fatal(err)
			}
			if qa != nil {
				if err := be.Quantize(*qa); err != nil {
					t.Fatal(err)
				}
			}
			if err := d.Dispatch(args(fused)); err != nil {
				t.Fatal(err)
			}
			for _, c := range []struct {
				name      string
				want, got *kernels.Buffer
			}{
				{"ids", sep.ids, fused.ids}, {"weights", sep.w, fused.w}, {"offsets", sep.off, fused.off}, {"rows", sep.rows, fused.rows},
				{"slots", sep.slots, fused.slots}, {"packed", sep.q.Packed, fused.q.Packed}, {"scales", sep.q.Scales, fused.q.Scales},
				{"scale", sep.q.Scale, fused.q.Scale},
			} {
				if !bytes.Equal(download(t, be, c.got), download(t, be, c.want)) {
					t.Errorf("%s differ from the separate ops'", c.name)
				}
			}
		})
	}
	t.Run("Errors", func(t *testing.T) {
		L := f32Buf(t, be, make([]float32, 2*8), 2, 8)
		ids, other := alloc(t, be, kernels.I32, 2, 2), alloc(t, be, kernels.I32, 2, 2)
		w := alloc(t, be, kernels.F32, 2, 2)
		off, rows, slots := alloc(t, be, kernels.I32, 9), alloc(t, be, kernels.I32, 4), alloc(t, be, kernels.I32, 4)
		X := bf16Buf(t, be, make([]uint16, 2*32), 2, 32)
		q := kernels.NVFP4{Packed: alloc(t, be, kernels.U8, 2, 16), Scales: alloc(t, be, kernels.U8, 2, 2), Scale: alloc(t, be, kernels.F32, 2)}
		ra := kernels.RouteArgs{Logits: L, IDs: ids, Weights: w, Scoring: kernels.Softmax, Scale: 1}
		pa := kernels.PermuteArgs{IDs: ids, Offsets: off, Rows: rows, Slots: slots}
		wRow, err := w.Index(0) // F32 [2]: the first token's routing weights
		if err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			name string
			p    kernels.PermuteArgs
			q    *kernels.QuantizeArgs
			want string
		}{
			{"other ids", kernels.PermuteArgs{IDs: other, Offsets: off, Rows: rows, Slots: slots}, nil, "are not route's ids"},
			{"experts", kernels.PermuteArgs{IDs: ids, Offsets: alloc(t, be, kernels.I32, 5), Rows: rows, Slots: slots}, nil, "over 4 experts"},
			{"aliased", kernels.PermuteArgs{IDs: ids, Offsets: off, Rows: rows, Slots: rows}, nil, "overlap"},
			{"per matrix", pa, &kernels.QuantizeArgs{Src: X, Dst: q, Mode: kernels.PerMatrix}, "want per-row"},
			{"quantize into weights", pa, &kernels.QuantizeArgs{Src: X, Dst: kernels.NVFP4{Packed: q.Packed, Scales: q.Scales, Scale: wRow}, Mode: kernels.PerRow}, "overlap"},
		} {
			err := d.Dispatch(ra, tc.p, tc.q)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.want)
			}
		}
	})
}

// edgeRows returns a BF16 matrix rows x k whose rows exercise the
// quantizer's edge cases: random data, a zero row, a row with zero blocks,
// -0, subnormals, tiny values beside large ones, and huge values.
func edgeRows(r *rand.Rand, rows, k int) []uint16 {
	m := randBF16(r, rows*k, 1)
	for i := range rows {
		row := m[i*k : (i+1)*k]
		switch i % 7 {
		case 1:
			clear(row)
		case 2:
			clear(row[:min(16, k)])
			row[k-1] = 0x8000 // -0
		case 3:
			for j := range row {
				row[j] = uint16(r.IntN(0x80)) | uint16(r.IntN(2))<<15 // subnormals
			}
		case 4:
			for j := range row[:min(16, k)] {
				row[j] = bf16.FromFloat32(float32(r.NormFloat64() * 1e-30))
			}
			row[k-1] = bf16.FromFloat32(3e4)
		case 5:
			for j := range row {
				row[j] = bf16.FromFloat32(float32(r.NormFloat64() * 1e30))
			}
		}
	}
	return m
}

func testQuantize(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(7, 8))
	t.Run("per-row", func(t *testing.T) {
		for _, tc := range []struct{ rows, k, kp int }{{1, 16, 16}, {29, 200, 208}, {14, 200, 256}, {9, 2688, 2688}} {
			src := edgeRows(r, tc.rows, tc.k)
			S := bf16Buf(t, be, src, tc.rows, tc.k)
			q := kernels.NVFP4{
				Packed: alloc(t, be, kernels.U8, tc.rows, tc.kp/2),
				Scales: alloc(t, be, kernels.U8, tc.rows, tc.kp/16),
				Scale:  alloc(t, be, kernels.F32, tc.rows),
			}
			if err := be.Quantize(kernels.QuantizeArgs{Src: S, Dst: q, Mode: kernels.PerRow}); err != nil {
				t.Fatal(err)
			}
			packed, scales, scale := make([]byte, tc.rows*tc.kp/2), make([]byte, tc.rows*tc.kp/16), make([]float32, tc.rows)
			if err := nvfp4.QuantizePerRow(packed, scales, scale, src, tc.rows, tc.k); err != nil {
				t.Fatal(err)
			}
			expectBytes(t, "packed", download(t, be, q.Packed), packed, tc.kp/2)
			expectBytes(t, "scales", download(t, be, q.Scales), scales, tc.kp/16)
			expectBytes(t, "scale", download(t, be, q.Scale), kernels.Float32Bytes(scale), 4)
		}
	})
	t.Run("per-tensor", func(t *testing.T) {
		// The tensor's S_dec as a calibration would set it (from the
		// tensor's own amax), a quarter of it (values past the calibrated
		// range saturate), and extremes whose S_enc overflows or is tiny.
		for _, tc := range []struct{ rows, k, kp int }{{1, 16, 16}, {29, 200, 208}, {14, 200, 256}} {
			src := edgeRows(r, tc.rows, tc.k)
			_, calibrated := nvfp4.EncodeScale(nvfp4.AmaxBF16(src))
			for _, given := range []float32{calibrated, calibrated / 4, 1, 0x1p-140, 3e38} {
				S := bf16Buf(t, be, src, tc.rows, tc.k)
				I := f32Buf(t, be, []float32{given}, 1)
				q := kernels.NVFP4{
					Packed: alloc(t, be, kernels.U8, tc.rows, tc.kp/2),
					Scales: alloc(t, be, kernels.U8, tc.rows, tc.kp/16),
					Scale:  alloc(t, be, kernels.F32, tc.rows),
				}
				if err := be.Quantize(kernels.QuantizeArgs{Src: S, Dst: q, Mode: kernels.PerTensor, Input: I}); err != nil {
					t.Fatal(err)
				}
				pb, sb := tc.kp/2, tc.kp/16
				packed, scales, scale := make([]byte, tc.rows*pb), make([]byte, tc.rows*sb), make([]float32, tc.rows)
				sEnc, sDec := nvfp4.InputScale(given)
				for row := range tc.rows {
					if err := nvfp4.QuantizeRow(packed[row*pb:(row+1)*pb], scales[row*sb:(row+1)*sb], src[row*tc.k:(row+1)*tc.k], sEnc, sDec); err != nil {
						t.Fatal(err)
					}
					scale[row] = sDec
				}
				expectBytes(t, fmt.Sprintf("packed (S_dec %g)", given), download(t, be, q.Packed), packed, pb)
				expectBytes(t, fmt.Sprintf("scales (S_dec %g)", given), download(t, be, q.Scales), scales, sb)
				expectBytes(t, fmt.Sprintf("scale (S_dec %g)", given), download(t, be, q.Scale), kernels.Float32Bytes(scale), 4)
				if err := be.Quantize(kernels.QuantizeArgs{Src: S, Dst: q, Mode: kernels.PerTensor}); err == nil {
					t.Error("per-tensor quantization without its input scale: no error")
				}
				if err := be.Quantize(kernels.QuantizeArgs{Src: S, Dst: q, Mode: kernels.PerRow, Input: I}); err == nil {
					t.Error("per-row quantization with an input scale: no error")
				}
			}
		}
	})
	t.Run("unit-scale range", func(t *testing.T) {
		// A global scale of one (moe.RecipeUnitScale): a block's largest
		// magnitude v comes back exactly from 6 * 2^-6 (block scale 2^-6,
		// the smallest normal E4M3) to 2688 (448), saturates above, loses
		// bits below (subnormal block scales) and is zero from 6 * 2^-10 on
		// down (the block scale underflows).
		for _, tc := range []struct {
			v, want float32
		}{
			{2688, 2688}, {4000, 2688}, {1e30, 2688}, {6, 6}, {0.09375, 0.09375}, // 6 * 2^-6
			{0x1.8p-7, 0x1.8p-7},        // 6 * 2^-9: the smallest subnormal block scale
			{6 * 0x1p-10, 0}, {1e-4, 0}, // all but 1e-4 exact in BF16
		} {
			row := make([]uint16, 16)
			row[3] = bf16.FromFloat32(tc.v)
			row[7] = bf16.FromFloat32(-tc.v / 4)
			S := bf16Buf(t, be, row, 1, 16)
			I := f32Buf(t, be, []float32{1}, 1)
			q := kernels.NVFP4{Packed: alloc(t, be, kernels.U8, 1, 8), Scales: alloc(t, be, kernels.U8, 1, 1), Scale: alloc(t, be, kernels.F32, 1)}
			if err := be.Quantize(kernels.QuantizeArgs{Src: S, Dst: q, Mode: kernels.PerTensor, Input: I}); err != nil {
				t.Fatal(err)
			}
			got := make([]float32, 16)
			nvfp4.DequantizeRow(got, download(t, be, q.Packed), download(t, be, q.Scales), 1)
			if got[3] != tc.want {
				t.Errorf("block max %g: dequantized %g, want %g", tc.v, got[3], tc.want)
			}
		}
	})
	t.Run("per-matrix", func(t *testing.T) {
		for _, tc := range []struct{ e, n, k, kp int }{{1, 3, 16, 16}, {6, 24, 200, 208}, {3, 17, 72, 128}} {
			src := edgeRows(r, tc.e*tc.n, tc.k)
			if tc.e > 1 {
				clear(src[tc.n*tc.k : 2*tc.n*tc.k]) // an all-zero expert
			}
			S := bf16Buf(t, be, src, tc.e, tc.n, tc.k)
			q := kernels.NVFP4{
				Packed: alloc(t, be, kernels.U8, tc.e, tc.n, tc.kp/2),
				Scales: alloc(t, be, kernels.U8, tc.e, tc.n, tc.kp/16),
				Scale:  alloc(t, be, kernels.F32, tc.e),
			}
			if err := be.Quantize(kernels.QuantizeArgs{Src: S, Dst: q, Mode: kernels.PerMatrix}); err != nil {
				t.Fatal(err)
			}
			// The same with each matrix's amax given (the refit's host
			// check saw every value): the same bits.
			amax := make([]float32, tc.e)
			for e := range tc.e {
				amax[e] = nvfp4.AmaxBF16(src[e*tc.n*tc.k : (e+1)*tc.n*tc.k])
			}
			qa := kernels.NVFP4{
				Packed: alloc(t, be, kernels.U8, tc.e, tc.n, tc.kp/2),
				Scales: alloc(t, be, kernels.U8, tc.e, tc.n, tc.kp/16),
				Scale:  alloc(t, be, kernels.F32, tc.e),
			}
			A := alloc(t, be, kernels.F32, tc.e)
			upload(t, be, A, kernels.Float32Bytes(amax))
			if err := be.Quantize(kernels.QuantizeArgs{Src: S, Dst: qa, Mode: kernels.PerMatrix, Amax: A}); err != nil {
				t.Fatal(err)
			}
			if err := be.Sync(); err != nil {
				t.Fatal(err)
			}
			for _, p := range [][2]*kernels.Buffer{{q.Packed, qa.Packed}, {q.Scales, qa.Scales}, {q.Scale, qa.Scale}} {
				expectBytes(t, "with amax given", download(t, be, p[1]), download(t, be, p[0]), 1)
			}
			if err := be.Quantize(kernels.QuantizeArgs{Src: S, Dst: qa, Mode: kernels.PerRow, Amax: A}); err == nil {
				t.Error("per-row quantization with an amax: no error")
			}
			mp, ms := tc.n*tc.kp/2, tc.n*tc.kp/16
			packed, scales, scale := make([]byte, tc.e*mp), make([]byte, tc.e*ms), make([]float32, tc.e)
			for e := range tc.e {
				var err error
				scale[e], err = nvfp4.QuantizeMatrix(packed[e*mp:(e+1)*mp], scales[e*ms:(e+1)*ms], src[e*tc.n*tc.k:(e+1)*tc.n*tc.k], tc.n, tc.k)
				if err != nil {
					t.Fatal(err)
				}
			}
			expectBytes(t, "packed", download(t, be, q.Packed), packed, tc.kp/2)
			expectBytes(t, "scales", download(t, be, q.Scales), scales, tc.kp/16)
			expectBytes(t, "alpha", download(t, be, q.Scale), kernels.Float32Bytes(scale), 4)
		}
	})
}

// testAmax folds tensors' amax into a scalar, fresh and accumulated, over
// shapes with and without whole 16-byte units, and checks the values
// against the reference's and the errors.
func testAmax(t *testing.T, be kernels.Backend) {
	a, ok := be.(kernels.Amaxer)
	if !ok {
		t.Skip("the backend measures no amax on its op stream")
	}
	r := rand.New(rand.NewPCG(17, 18))
	D := alloc(t, be, kernels.F32, 1)
	var running float32
	for i, n := range []int{16, 200, 7, 4096, 33} {
		src := edgeRows(r, 1, n)
		if i == 2 {
			clear(src) // an all-zero tensor leaves a running maximum as it is
		}
		S := bf16Buf(t, be, src, 1, n)
		want := nvfp4.AmaxBF16(src)
		if err := a.Amax(kernels.AmaxArgs{Src: S, Dst: D}); err != nil {
			t.Fatal(err)
		}
		expectBytes(t, fmt.Sprintf("amax of %d values", n), download(t, be, D), kernels.Float32Bytes([]float32{want}), 4)
		// Onto a smaller maximum, this tensor's wins; onto the running
		// maximum of the tensors so far, the larger of the two.
		running = max(running, want)
		for _, from := range []float32{want / 2, running} {
			upload(t, be, D, kernels.Float32Bytes([]float32{from}))
			if err := a.Amax(kernels.AmaxArgs{Src: S, Dst: D, Accumulate: true}); err != nil {
				t.Fatal(err)
			}
			expectBytes(t, fmt.Sprintf("amax of %d values onto %g", n, from), download(t, be, D), kernels.Float32Bytes([]float32{max(from, want)}), 4)
		}
	}
	S := bf16Buf(t, be, make([]uint16, 16), 16)
	for _, tc := range []struct {
		name string
		args kernels.AmaxArgs
		want string
	}{
		{"f32 source", kernels.AmaxArgs{Src: D, Dst: D}, "want bf16"},
		{"wide destination", kernels.AmaxArgs{Src: S, Dst: alloc(t, be, kernels.F32, 2)}, "dst"},
		{"bf16 destination", kernels.AmaxArgs{Src: S, Dst: alloc(t, be, kernels.BF16, 1)}, "dst"},
	} {
		if err := a.Amax(tc.args); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.want)
		}
	}
}

// expectBytes compares bit for bit and names the first differing row.
func expectBytes(t *testing.T, what string, got, want []byte, rowLen int) {
	t.Helper()
	if i := firstDiff(got, want); i >= 0 {
		t.Fatalf("%s differ first at byte %d (row %d): got %#02x, want %#02x", what, i, i/rowLen, byteAt(got, i), byteAt(want, i))
	}
}

func firstDiff(a, b []byte) int {
	for i := range max(len(a), len(b)) {
		if i >= len(a) || i >= len(b) || a[i] != b[i] {
			return i
		}
	}
	return -1
}

func byteAt(b []byte, i int) int {
	if i < len(b) {
		return int(b[i])
	}
	return -1
}

// quantHost quantizes on the host with the codec and uploads the result.
func quantHost(t *testing.T, be kernels.Backend, src []uint16, mats, rows, k int, mode kernels.QuantMode) (kernels.NVFP4, []float32) {
	t.Helper()
	kp := nvfp4.PaddedK(k)
	packed, scales := make([]byte, mats*rows*kp/2), make([]byte, mats*rows*kp/16)
	var scale []float32
	if mode == kernels.PerRow {
		scale = make([]float32, rows)
		if err := nvfp4.QuantizePerRow(packed, scales, scale, src, rows, k); err != nil {
			t.Fatal(err)
		}
	} else {
		scale = make([]float32, mats)
		mp, ms := rows*kp/2, rows*kp/16
		for e := range mats {
			var err error
			if scale[e], err = nvfp4.QuantizeMatrix(packed[e*mp:(e+1)*mp], scales[e*ms:(e+1)*ms], src[e*rows*k:(e+1)*rows*k], rows, k); err != nil {
				t.Fatal(err)
			}
		}
	}
	lead := []int{rows}
	if mode == kernels.PerMatrix {
		lead = []int{mats, rows}
	}
	q := kernels.NVFP4{
		Packed: alloc(t, be, kernels.U8, append(slices.Clone(lead), kp/2)...),
		Scales: alloc(t, be, kernels.U8, append(slices.Clone(lead), kp/16)...),
		Scale:  f32Buf(t, be, scale, len(scale)),
	}
	upload(t, be, q.Packed, packed)
	upload(t, be, q.Scales, scales)
	// The reference reads the dequantized values back from these bytes.
	deq := make([]float32, mats*rows*kp)
	for i := range mats * rows {
		s := scale[i%len(scale)]
		if mode == kernels.PerMatrix {
			s = scale[i/rows]
		}
		nvfp4.DequantizeRow(deq[i*kp:(i+1)*kp], packed[i*kp/2:(i+1)*kp/2], scales[i*kp/16:(i+1)*kp/16], s)
	}
	return q, deq
}

func testGroupedGemm(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(9, 10))
	const E, K, Ta, topK = 5, 200, 23, 2
	kp := nvfp4.PaddedK(K)
	ids := distinctIDs(r, Ta, topK, E, 3)
	offsets, rows, _ := refPermute(ids, topK, E)
	R := Ta * topK
	O, G := i32Buf(t, be, offsets, E+1), i32Buf(t, be, rows, R)
	x := randBF16(r, Ta*K, 1)
	for _, act := range []kernels.Activation{kernels.Identity, kernels.ReLU2, kernels.SwiGLU} {
		const N = 48
		outN := N
		if act == kernels.SwiGLU {
			outN = N / 2
		}
		w := randBF16(r, E*N*K, 0.05)
		for _, aq := range []bool{false, true} {
			for _, wq := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s_Anvfp4=%v_Wnvfp4=%v", act, aq, wq), func(t *testing.T) {
					var A, W kernels.Operand
					aref, wref := make([]float32, Ta*kp), make([]float32, E*N*kp)
					if aq {
						A.Q, aref = quantHost(t, be, x, 1, Ta, K, kernels.PerRow)
					} else {
						A.BF16 = bf16Buf(t, be, x, Ta, K)
						for i := range Ta {
							for k := range K {
								aref[i*kp+k] = bf16.ToFloat32(x[i*K+k])
							}
						}
					}
					if wq {
						W.Q, wref = quantHost(t, be, w, E, N, K, kernels.PerMatrix)
					} else {
						W.BF16 = bf16Buf(t, be, w, E, N, K)
						for i := range E * N {
							for k := range K {
								wref[i*kp+k] = bf16.ToFloat32(w[i*K+k])
							}
						}
					}
					out := alloc(t, be, kernels.BF16, R, outN)
					err := be.GroupedGemm(kernels.GroupedGemmArgs{A: A, Gather: G, W: W, Offsets: O, Act: act, Out: out})
					if err != nil {
						t.Fatal(err)
					}
					got := readFloats(t, be, out)
					ref := make([]float64, R*outN)
					var maxRef float64
					dotRef := func(row, wrow int) float64 {
						var s float64
						for k := range kp {
							s += float64(aref[row*kp+k]) * float64(wref[wrow*kp+k])
						}
						return s
					}
					for e := range E {
						for rr := offsets[e]; rr < offsets[e+1]; rr++ {
							for n := range outN {
								h := dotRef(int(rows[rr]), e*N+n)
								switch act {
								case kernels.ReLU2:
									h = math.Max(h, 0) * math.Max(h, 0)
								case kernels.SwiGLU:
									h = h / (1 + math.Exp(-h)) * dotRef(int(rows[rr]), e*N+outN+n)
								}
								ref[int(rr)*outN+n] = h
								maxRef = max(maxRef, math.Abs(h))
							}
						}
					}
					for i, g := range got {
						if !closeTo(float64(g), ref[i], maxRef) {
							t.Fatalf("out[%d,%d] = %g, want %g (max %g)", i/outN, i%outN, g, ref[i], maxRef)
						}
					}
				})
			}
		}
	}
}

// finalizeInputs returns T tokens' k routing weights in [0, 1) and their
// slots: a random permutation of the T*k sorted rows.
func finalizeInputs(r *rand.Rand, T, k int) ([]float32, []int32) {
	w := make([]float32, T*k)
	for i := range w {
		w[i] = r.Float32()
	}
	slots := make([]int32, T*k)
	for i, p := range r.Perm(T * k) {
		slots[i] = int32(p)
	}
	return w, slots
}

func testFinalize(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(11, 12))
	// Top-k up to 8 with an even H and beyond either (the CUDA kernel has
	// a path for each): the same bits.
	for _, c := range []struct{ T, H, k int }{{19, 72, 3}, {4, 200, 8}, {5, 71, 8}, {3, 40, 9}, {2, 7168, 8}} {
		t.Run(fmt.Sprintf("T%d_H%d_k%d", c.T, c.H, c.k), func(t *testing.T) {
			T, H, k := c.T, c.H, c.k
			R := T * k
			y := randBF16(r, R*H, 1)
			w, slots := finalizeInputs(r, T, k)
			out := alloc(t, be, kernels.BF16, T, H)
			err := be.Finalize(kernels.FinalizeArgs{Out: out, Rows: bf16Buf(t, be, y, R, H), Weights: f32Buf(t, be, w, T, k), Slots: i32Buf(t, be, slots, R)})
			if err != nil {
				t.Fatal(err)
			}
			want := make([]uint16, T*H)
			for tok := range T {
				for c := range H {
					var acc float32
					for j := range k {
						// The conversion keeps the product rounded on its own
						// (no FMA on arm64), as the contract says.
						acc += float32(w[tok*k+j] * bf16.ToFloat32(y[int(slots[tok*k+j])*H+c]))
					}
					want[tok*H+c] = bf16.FromFloat32(acc)
				}
			}
			expectBytes(t, "out", download(t, be, out), kernels.Uint16Bytes(want), 2*H)
		})
	}
}

func testErrors(t *testing.T, be kernels.Backend) {
	a := alloc(t, be, kernels.BF16, 4, 32)
	w := alloc(t, be, kernels.BF16, 8, 16)
	d := alloc(t, be, kernels.F32, 4, 8)
	other := alloc(t, be, kernels.BF16, 8, 32)
	square := alloc(t, be, kernels.BF16, 4, 4)
	i32 := alloc(t, be, kernels.I32, 4, 2)
	f32 := alloc(t, be, kernels.F32, 4, 2)
	logits := alloc(t, be, kernels.F32, 4, 3)
	src := alloc(t, be, kernels.BF16, 4, 24)
	badQ := kernels.NVFP4{Packed: alloc(t, be, kernels.U8, 4, 9), Scales: alloc(t, be, kernels.U8, 4, 1), Scale: alloc(t, be, kernels.F32, 4)}
	goodQ := kernels.NVFP4{Packed: alloc(t, be, kernels.U8, 4, 16), Scales: alloc(t, be, kernels.U8, 4, 2), Scale: alloc(t, be, kernels.F32, 4)}
	stack := kernels.NVFP4{Packed: alloc(t, be, kernels.U8, 2, 8, 128), Scales: alloc(t, be, kernels.U8, 2, 8, 16), Scale: alloc(t, be, kernels.F32, 2)}
	out := alloc(t, be, kernels.BF16, 4, 8)
	offsets := alloc(t, be, kernels.I32, 3)
	for _, c := range []struct {
		name, op string
		err      error
	}{
		{"gemm K mismatch", "gemm", be.Gemm(d, a, w)},
		{"gemm dst dtype", "gemm", be.Gemm(i32, a, other)},
		{"gemm dst aliases a", "gemm", be.Gemm(square, square, alloc(t, be, kernels.BF16, 4, 4))},
		{"route k > E", "route", be.Route(kernels.RouteArgs{Logits: logits, IDs: alloc(t, be, kernels.I32, 4, 4), Weights: alloc(t, be, kernels.F32, 4, 4), Scoring: kernels.Softmax, Scale: 1})},
		{"route no scoring", "route", be.Route(kernels.RouteArgs{Logits: logits, IDs: i32, Weights: f32, Scale: 1})},
		{"route zero scale", "route", be.Route(kernels.RouteArgs{Logits: alloc(t, be, kernels.F32, 4, 2), IDs: i32, Weights: f32, Scoring: kernels.Softmax})},
		{"quantize odd padding", "quantize", be.Quantize(kernels.QuantizeArgs{Src: src, Dst: badQ, Mode: kernels.PerRow})},
		{"quantize no mode", "quantize", be.Quantize(kernels.QuantizeArgs{Src: src, Dst: goodQ})},
		{"grouped gemm no A", "grouped gemm", be.GroupedGemm(kernels.GroupedGemmArgs{W: kernels.Operand{BF16: alloc(t, be, kernels.BF16, 2, 8, 32)}, Offsets: offsets, Act: kernels.Identity, Out: out})},
		// A BF16 operand of 200 columns beside NVFP4 rows of 256: the
		// padding does not belong to 200 columns.
		{"grouped gemm mixed K", "grouped gemm", be.GroupedGemm(kernels.GroupedGemmArgs{A: kernels.Operand{BF16: alloc(t, be, kernels.BF16, 4, 200)},
			W: kernels.Operand{Q: stack}, Offsets: offsets, Act: kernels.Identity, Out: out})},
		{"finalize slots", "finalize", be.Finalize(kernels.FinalizeArgs{Out: alloc(t, be, kernels.BF16, 4, 16), Rows: alloc(t, be, kernels.BF16, 8, 16), Weights: f32, Slots: alloc(t, be, kernels.I32, 7)})},
	} {
		wantError(t, c.name, c.op, c.err)
	}
}

// wantError checks that err is a call-time error that names its op.
func wantError(t *testing.T, name, op string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: no error", name)
	} else if !strings.Contains(err.Error(), op+":") {
		t.Errorf("%s: error %q does not name the op %q", name, err, op)
	}
}

// Foreign checks that a backend refuses buffers of another backend.
func Foreign(t *testing.T, be, other kernels.Backend) {
	t.Helper()
	mine := alloc(t, be, kernels.F32, 2, 2)
	theirs := alloc(t, other, kernels.F32, 2, 2)
	if err := be.Copy(mine, theirs); !errors.Is(err, kernels.ErrForeignBuffer) {
		t.Fatalf("Copy from a foreign buffer: %v, want ErrForeignBuffer", err)
	}
}
