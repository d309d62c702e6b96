package cuda

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

// TestNarrowGemmRows runs the router's Gemm (N 256, K 7168 and one longer
// K that takes more than one round of loads a warp in every kernel) on the
// first M rows of one matrix, for M from 1 to 40: every narrow kernel
// (gemm_narrow8 up to 8 rows, gemm_narrow, which tests
// also force there, up to 31, gemm_narrow_wide from 32) must give each row
// the bits it gets at M = 40, in FP32 and in BF16.
func TestNarrowGemmRows(t *testing.T) {
	be := gpu(t)
	defer func(k plainKernel) { be.narrow8 = k }(be.narrow8)
	r := rand.New(rand.NewPCG(61, 62))
	const N, maxM = 256, 40
	for _, K := range []int{7168, 7168 + 3584 + 8} {
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
		for _, dt := range []kernels.DType{kernels.F32, kernels.BF16} {
			gemm := func(m int, narrow8 plainKernel) []byte {
				t.Helper()
				be.narrow8 = narrow8
				a := moetest.Alloc(t, be, kernels.BF16, m, K)
				if err := be.Upload(a, 0, x[:m*K*2]); err != nil {
					t.Fatal(err)
				}
				out := moetest.Alloc(t, be, dt, m, N)
				if err := be.Gemm(out, a, w); err != nil {
					t.Fatal(err)
				}
				got := make([]byte, out.Size())
				if err := be.Download(got, out, 0); err != nil {
					t.Fatal(err)
				}
				return got
			}
			want := gemm(maxM, kGemmNarrow8)
			row := len(want) / maxM
			for _, m := range []int{1, 2, 5, 8, 9, 16, 17, 31, 32} {
				kerns := []plainKernel{kGemmNarrow8}
				if m <= gemmNarrow8M {
					kerns = []plainKernel{kGemmNarrow8, kGemmNarrow}
				}
				for _, k := range kerns {
					t.Run(fmt.Sprintf("K%d_%v_M%d_%s", K, dt, m, be.kernels[k].spec.name), func(t *testing.T) {
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

// TestDenseGemmPaths times the two dense GEMM families side by side on
// the dense GEMMs of a Qwen3-30B-A3B decoder layer and its LM head, at
// decode and prefill row counts, against the floor of docs/PERF.md (bytes
// at 4.3 TB/s, FLOPs at 790 TFLOP/s): the narrow kernels (what Gemm runs
// for every one of these shapes) and the generic tiled one. It checks only
// that both run; the figures are its output.
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
	const iters = 20
	t.Logf("%-8s %5s %10s %10s %10s %8s %8s %8s", "gemm", "M", "floor us", "narrow us", "generic us", "narrow/f", "gener/f", "gen/nar")
	for _, s := range shapes {
		w := alloc(kernels.BF16, s.n, s.k)
		fill(w)
		for _, m := range []int{1, 8, 64, 256, 2048} {
			a := alloc(kernels.BF16, m, s.k)
			fill(a)
			out := alloc(s.out, m, s.n)
			var d [2]time.Duration
			for i, path := range []gemmPath{gemmForceNarrow, gemmForceGeneric} {
				if err := be.gemm(out, a, w, path); err != nil { // warm
					t.Fatal(err)
				}
				var err error
				if d[i], err = be.Time(iters, func() error { return be.gemm(out, a, w, path) }); err != nil {
					t.Fatal(err)
				}
			}
			ob := 2
			if s.out == kernels.F32 {
				ob = 4
			}
			bytes := float64(2*(m+s.n)*s.k + ob*m*s.n)
			floor := max(bytes/4.3e12, 2*float64(m)*float64(s.n)*float64(s.k)/790e12)
			us := func(d time.Duration) float64 { return float64(d) / 1e3 }
			t.Logf("%-8s %5d %10.1f %10.1f %10.1f %7.2fx %7.2fx %7.2fx", s.name, m, floor*1e6, us(d[0]), us(d[1]),
				d[0].Seconds()/floor, d[1].Seconds()/floor, float64(d[1])/float64(d[0]))
			for _, b := range []*kernels.Buffer{a, out} {
				if err := be.Free(b); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := be.Free(w); err != nil {
			t.Fatal(err)
		}
	}
}
