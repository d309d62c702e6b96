package cuda

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

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
