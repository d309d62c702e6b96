package cuda

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

// TestNarrowGemmRows runs the router's Gemm (N 256, K 7168, and longer
// and shorter K: more than one round of loads a warp in every narrow
// kernel; partials of unequal length; partials of no slice) on the first M
// rows of one matrix, for M from 1 to 160: every dense kernel (gemm_narrow8
// up to 8 rows, gemm_narrow8_short there for K <= 2048, gemm_narrow, which
// tests also force there, up to 31 and, forced, beyond; gemm_narrow_wide
// from 32, and each gemm_dense_tile variant wherever K allows it) must give
// each row the bits gemm_narrow_wide gives it at M = 160, in FP32 and in
// BF16.
func TestNarrowGemmRows(t *testing.T) {
	be := gpu(t)
	defer func(k plainKernel, d denseTileKernel) { be.narrow8, be.denseTile = k, d }(be.narrow8, be.denseTile)
	r := rand.New(rand.NewPCG(61, 62))
	const N, maxM = 256, 160
	for _, K := range []int{7168, 7168 + 3584 + 8, 7168 + 3584 + 32, 2048, 224} {
		x := make([]byte, maxM*K*2)
		for i := 0; i < maxM*K; i++ {
			v := bf16.FromFloat32(float32(r.NormFloat64()) * float32(1+i/K%5))
			x[2*i], x[2*i+1] = byte(v), byte(v>>8)
		}
		wb := make([]byte, N*K*2)
		for i := 0; i < N*K; i++ {
			v := bf16.FromFloat32(float32(r.NormFloat64()) / 64)
			wb[2*i], wb[2*i+1] = byte(v), byte(v>>8)
		}
		w := moetest.Alloc(t, be, kernels.BF16, N, K)
		if err := be.Upload(w, 0, wb); err != nil {
			t.Fatal(err)
		}
		// A kernel to compare: the path forced (narrow, narrow with 16 x
		// 8 blocks, or tiled), the few-row kernel set and the tile.
		type kern struct {
			name    string
			path    gemmPath
			narrow8 plainKernel
			tile    denseTileKernel
		}
		for _, dt := range []kernels.DType{kernels.F32, kernels.BF16} {
			gemm := func(m int, k kern) []byte {
				t.Helper()
				be.narrow8, be.denseTile = k.narrow8, k.tile
				a := moetest.Alloc(t, be, kernels.BF16, m, K)
				if err := be.Upload(a, 0, x[:m*K*2]); err != nil {
					t.Fatal(err)
				}
				out := moetest.Alloc(t, be, dt, m, N)
				if err := be.gemm([]*kernels.Buffer{out}, a, []*kernels.Buffer{w}, k.path); err != nil {
					t.Fatal(err)
				}
				got := make([]byte, out.Size())
				if err := be.Download(got, out, 0); err != nil {
					t.Fatal(err)
				}
				return got
			}
			want := gemm(maxM, kern{path: gemmForceNarrow, narrow8: kGemmNarrow8})
			row := len(want) / maxM
			for _, m := range []int{1, 2, 5, 8, 9, 16, 17, 31, 32, 64, 65, 130} {
				var kerns []kern
				switch {
				case m <= gemmNarrow8M:
					few := "gemm_narrow8"
					if K <= gemmNarrow8ShortK {
						few = "gemm_narrow8_short" // what the host picks for kGemmNarrow8 there
					}
					kerns = []kern{{few, gemmForceNarrow, kGemmNarrow8, denseTileKernel{}}, {"gemm_narrow", gemmForceNarrow, kGemmNarrow, denseTileKernel{}}}
				case m < gemmWideM:
					kerns = []kern{{"gemm_narrow", gemmForceNarrow, kGemmNarrow8, denseTileKernel{}}}
				default:
					kerns = []kern{{"gemm_narrow_wide", gemmForceNarrow, kGemmNarrow8, denseTileKernel{}},
						{"gemm_narrow", gemmForceNarrow16, kGemmNarrow8, denseTileKernel{}}}
				}
				if K%32 == 0 {
					for _, d := range denseTiles {
						kerns = append(kerns, kern{fmt.Sprintf("gemm_dense_tile_%dx%d", d.bm, d.bn), gemmForceTile, kGemmNarrow8, d})
					}
				}
				for _, k := range kerns {
					t.Run(fmt.Sprintf("K%d_%v_M%d_%s", K, dt, m, k.name), func(t *testing.T) {
						if got := gemm(m, k); !bytes.Equal(got, want[:m*row]) {
							for i := range m {
								if !bytes.Equal(got[i*row:(i+1)*row], want[i*row:(i+1)*row]) {
									t.Fatalf("row %d differs from the same row at M = %d", i, maxM)
								}
							}
						}
					})
				}
			}
		}
	}
}

// TestDenseGemmPaths times the dense GEMM kernels side by side on the
// dense GEMMs of a Qwen3-30B-A3B decoder layer and its LM head, at decode
// and prefill row counts, against the floor of docs/PERF.md (bytes at 4.3
// TB/s, FLOPs at 790 TFLOP/s): what Gemm picks, the narrow kernels (as the
// host picks them by rows, and with 16 x 8 blocks at every row count:
// "narrow16"), each variant of the tiled one and the generic tiled kernel. It checks only
// that they run; the figures are its output.
func TestDenseGemmPaths(t *testing.T) {
	be := gpu(t)
	pattern := make([]byte, 1<<20)
	r := rand.New(rand.NewPCG(7, 8))
	for i := 0; i < len(pattern); i += 2 {
		v := bf16.FromFloat32(float32(r.NormFloat64()) / 32)
		pattern[i], pattern[i+1] = byte(v), byte(v>>8)
	}
	alloc := func(dt kernels.DType, shape ...int) *kernels.Buffer { // freed below, as the loop goes
		t.Helper()
		b, err := be.Alloc(dt, shape...)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	fill := func(b *kernels.Buffer) {
		t.Helper()
		for off := 0; off < b.Size(); off += len(pattern) {
			if err := be.Upload(b, off, pattern[:min(len(pattern), b.Size()-off)]); err != nil {
				t.Fatal(err)
			}
		}
	}
	shapes := []struct {
		name string
		n, k int
		out  kernels.DType
	}{
		{"q", 4096, 2048, kernels.BF16},
		{"k/v", 512, 2048, kernels.BF16},
		{"o", 2048, 4096, kernels.BF16},
		{"router", 128, 2048, kernels.F32},
		{"lm head", 151936, 2048, kernels.F32},
	}
	// Each time is one launch's share of a graph of 10 to 80 launches that
	// cycle through copies of w, 150 MB of them where 80 copies reach it,
	// so that the weights come from memory as in a model's step, not from
	// L2 (the router's and k/v's do not quite).
	const replays = 5
	defer func(d denseTileKernel) { be.denseTile = d }(be.denseTile)
	t.Logf("%-8s %5s %9s %9s %9s %9s %10s %9s %9s %8s %8s", "gemm", "M", "floor us", "auto us", "narrow us", "narrow16", "tile64x128", "tile64", "generic", "auto/f", "nar/f")
	for _, s := range shapes {
		copies := (150<<20 + 2*s.n*s.k - 1) / (2 * s.n * s.k)
		launches := min(80, max(10, copies))
		ws := make([]*kernels.Buffer, min(launches, copies))
		for i := range ws {
			ws[i] = alloc(kernels.BF16, s.n, s.k)
			fill(ws[i])
		}
		for _, m := range []int{1, 8, 16, 32, 64, 128, 256, 2048} {
			a := alloc(kernels.BF16, m, s.k)
			fill(a)
			out := alloc(s.out, m, s.n)
			type run struct {
				path gemmPath
				tile denseTileKernel
			}
			runs := []run{{path: gemmAuto}, {path: gemmForceNarrow}, {path: gemmForceNarrow16}}
			for _, d := range denseTiles {
				runs = append(runs, run{gemmForceTile, d})
			}
			runs = append(runs, run{path: gemmForceGeneric})
			d := make([]time.Duration, len(runs))
			for i, r := range runs {
				be.denseTile = r.tile
				d[i] = graphTime(t, be, launches, replays, func(l int) error {
					return be.gemm([]*kernels.Buffer{out}, a, []*kernels.Buffer{ws[l%len(ws)]}, r.path)
				})
			}
			be.denseTile = denseTileKernel{}
			ob := 2
			if s.out == kernels.F32 {
				ob = 4
			}
			bytes := float64(2*(m+s.n)*s.k + ob*m*s.n)
			floor := max(bytes/4.3e12, 2*float64(m)*float64(s.n)*float64(s.k)/790e12)
			us := func(d time.Duration) float64 { return float64(d) / 1e3 }
			t.Logf("%-8s %5d %9.1f %9.1f %9.1f %9.1f %10.1f %9.1f %9.1f %7.2fx %7.2fx", s.name, m, floor*1e6, us(d[0]), us(d[1]),
				us(d[2]), us(d[3]), us(d[4]), us(d[5]), d[0].Seconds()/floor, d[1].Seconds()/floor)
			for _, b := range []*kernels.Buffer{a, out} {
				if err := be.Free(b); err != nil {
					t.Fatal(err)
				}
			}
		}
		for _, w := range ws {
			if err := be.Free(w); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestPlanDenseTile pins which dense GEMMs of a Qwen3-30B-A3B layer take
// the tiled kernel on 132 multiprocessors, and with which tile: the
// choices the H100 timings of TestDenseGemmPaths favour.
func TestPlanDenseTile(t *testing.T) {
	const sms = 132
	for _, tc := range []struct {
		name    string
		m, n, k int
		want    denseTileKernel
		ok      bool
	}{
		{"lm head, 1 row", 1, 151936, 2048, denseSmall, false},
		{"lm head, 8 rows", 8, 151936, 2048, denseSmall, false},
		{"lm head, 16 rows", 16, 151936, 2048, denseWide, true},
		{"lm head, 256 rows", 256, 151936, 2048, denseWide, true},
		{"a 7168-wide lm head, 1 row", 1, 129280, 7168, denseWide, true},
		{"q, 64 rows", 64, 4096, 2048, denseSmall, false},
		{"q, 128 rows", 128, 4096, 2048, denseSmall, true},
		{"q, 256 rows", 256, 4096, 2048, denseSmall, true},
		{"q, 2048 rows", 2048, 4096, 2048, denseWide, true},
		{"o, 128 rows", 128, 2048, 4096, denseSmall, false},
		{"o, 256 rows", 256, 2048, 4096, denseSmall, true},
		{"k/v, 256 rows", 256, 512, 2048, denseSmall, false},
		{"k/v, 2048 rows", 2048, 512, 2048, denseSmall, true},
		{"router, 2048 rows", 2048, 128, 2048, denseSmall, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := planDenseTile(tc.m, tc.n, tc.k, sms)
			if ok != tc.ok || ok && got != tc.want {
				t.Fatalf("planDenseTile(%d, %d, %d, %d) = %+v, %v; want %+v, %v", tc.m, tc.n, tc.k, sms, got, ok, tc.want, tc.ok)
			}
		})
	}
}

// TestGemmSet runs a layer's q, k and v projections (Qwen3-30B-A3B's 4096,
// 512 and 512 columns, K 2048) as one GemmSet and as three Gemms, at row
// counts that take every dense kernel, each family forced too: the bits
// must agree. A set whose widths cannot share a launch (a first width off
// denseSegAlign) must give the same bits through one launch each, and a
// set whose outputs overlap must be refused.
func TestGemmSet(t *testing.T) {
	be := gpu(t)
	r := rand.New(rand.NewPCG(5, 6))
	const K = 2048
	fill := func(b *kernels.Buffer, scale float32) {
		t.Helper()
		raw := make([]byte, b.Size())
		for i := 0; i < len(raw); i += 2 {
			v := bf16.FromFloat32(float32(r.NormFloat64()) * scale)
			raw[i], raw[i+1] = byte(v), byte(v>>8)
		}
		if err := be.Upload(b, 0, raw); err != nil {
			t.Fatal(err)
		}
	}
	download := func(b *kernels.Buffer) []byte {
		t.Helper()
		got := make([]byte, b.Size())
		if err := be.Download(got, b, 0); err != nil {
			t.Fatal(err)
		}
		return got
	}
	for _, widths := range [][]int{{4096, 512, 512}, {4000, 512, 512}} {
		ws := make([]*kernels.Buffer, len(widths))
		for i, n := range widths {
			ws[i] = moetest.Alloc(t, be, kernels.BF16, n, K)
			fill(ws[i], 1.0/64)
		}
		for _, m := range []int{1, 8, 20, 64, 128, 256} {
			a := moetest.Alloc(t, be, kernels.BF16, m, K)
			fill(a, 1)
			for _, path := range []gemmPath{gemmAuto, gemmForceNarrow, gemmForceTile} {
				t.Run(fmt.Sprintf("n%d_M%d_path%d", widths[0], m, path), func(t *testing.T) {
					sep, set := make([]*kernels.Buffer, len(widths)), make([]*kernels.Buffer, len(widths))
					for i, n := range widths {
						sep[i] = moetest.Alloc(t, be, kernels.BF16, m, n)
						set[i] = moetest.Alloc(t, be, kernels.BF16, m, n)
						if err := be.gemm(sep[i:i+1], a, ws[i:i+1], path); err != nil {
							t.Fatal(err)
						}
					}
					if err := be.gemm(set, a, ws, path); err != nil {
						t.Fatal(err)
					}
					for i := range widths {
						if !bytes.Equal(download(set[i]), download(sep[i])) {
							t.Fatalf("gemm %d (%d columns): the set's bits differ from the GEMM's alone", i, widths[i])
						}
					}
				})
			}
		}
	}
	a := moetest.Alloc(t, be, kernels.BF16, 4, K)
	w := moetest.Alloc(t, be, kernels.BF16, 256, K)
	out := moetest.Alloc(t, be, kernels.BF16, 4, 256)
	if err := be.GemmSet([]*kernels.Buffer{out, out}, a, []*kernels.Buffer{w, w}); err == nil {
		t.Fatal("GemmSet with one output twice: no error")
	}
}

// TestGemmSegmentable: which GEMM sets share one dense launch (the host's
// rule, on CPU buffers: no GPU needed). Every member must be one the
// narrow kernels take on its own, widths but the last whole multiples of
// denseSegAlign, one output type, at most denseSegMax members.
func TestGemmSegmentable(t *testing.T) {
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	buf := func(dt kernels.DType, shape ...int) *kernels.Buffer {
		t.Helper()
		b, err := be.Alloc(dt, shape...)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	const m, k = 4, 64
	a := buf(kernels.BF16, m, k)
	w := func(n int) *kernels.Buffer { return buf(kernels.BF16, n, k) }
	out := func(dt kernels.DType, n int) *kernels.Buffer { return buf(dt, m, n) }
	bf, f32 := kernels.BF16, kernels.F32
	odd := buf(kernels.BF16, 256, k+1)
	for _, tc := range []struct {
		name string
		dst  []*kernels.Buffer
		w    []*kernels.Buffer
		want bool
	}{
		{"q, k, v", []*kernels.Buffer{out(bf, 256), out(bf, 128), out(bf, 40)}, []*kernels.Buffer{w(256), w(128), w(40)}, true},
		{"a first width off the block", []*kernels.Buffer{out(bf, 40), out(bf, 128)}, []*kernels.Buffer{w(40), w(128)}, false},
		{"two output types", []*kernels.Buffer{out(bf, 128), out(f32, 128)}, []*kernels.Buffer{w(128), w(128)}, false},
		{"four gemms", []*kernels.Buffer{out(bf, 128), out(bf, 128), out(bf, 128), out(bf, 128)},
			[]*kernels.Buffer{w(128), w(128), w(128), w(128)}, false},
		{"an odd K", []*kernels.Buffer{out(bf, 256), out(bf, 256)}, []*kernels.Buffer{w(256), odd}, false},
		{"counts differ", []*kernels.Buffer{out(bf, 128)}, []*kernels.Buffer{w(128), w(128)}, false},
	} {
		if got := gemmSegmentable(tc.dst, a, tc.w); got != tc.want {
			t.Errorf("%s: gemmSegmentable = %v, want %v", tc.name, got, tc.want)
		}
	}
}
