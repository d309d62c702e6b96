package trainref

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
)

// TestDotBlockTermsExact checks the accumulation dot documents: every
// block's scaled sum of products is exact in FP32 (computed here in float64
// from the codes' values), so the result is those terms added in block
// order into one FP32 accumulator, whatever the order inside a block. Rows
// span 2^-30 to 2^30 in magnitude, so block scales run from subnormal E4M3
// to 448 and some blocks underflow to a zero scale.
func TestDotBlockTermsExact(t *testing.T) {
	const rows, k = 64, 200 // padded to 208: 13 blocks, the last one partly padding
	r := rand.New(rand.NewPCG(1, 2))
	src := func(n int) []uint16 {
		v := make([]uint16, n)
		for i := range v {
			v[i] = bf16.FromFloat32(float32(r.NormFloat64() * math.Ldexp(1, r.IntN(61)-30)))
		}
		return v
	}
	a, err := quantizeRows(src(rows*k), rows, k)
	if err != nil {
		t.Fatal(err)
	}
	w, err := quantizeStack(src(2*rows*k), 2, rows, k)
	if err != nil {
		t.Fatal(err)
	}
	for m := range rows {
		for e := range 2 {
			for n := range rows {
				rw := e*w.n + n
				var want float32
				for b := range w.kp / nvfp4.BlockSize {
					var sum float64
					for i := b * nvfp4.BlockSize; i < (b+1)*nvfp4.BlockSize; i++ {
						code := w.packed[rw*w.kp/2+i/2] >> (4 * (i & 1))
						sum += float64(a.v[m*a.kp+i]) * float64(nvfp4.E2M1Decode(code))
					}
					term := sum * float64(a.sf[m*a.kp/nvfp4.BlockSize+b]) * float64(nvfp4.E4M3Decode(w.scales[rw*w.kp/nvfp4.BlockSize+b]))
					if float64(float32(term)) != term {
						t.Fatalf("row %d, expert %d row %d, block %d: term %v is not exact in FP32", m, e, n, b, term)
					}
					want += float32(term)
				}
				if got := w.dot(a, m, e, n); got != want {
					t.Fatalf("row %d, expert %d row %d: dot %v, want %v", m, e, n, got, want)
				}
			}
		}
	}
}
