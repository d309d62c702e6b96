package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

// TestFP4GemmPaths times the two NVFP4 x NVFP4 grouped GEMM kernels side by
// side on the seed's expert shapes (hidden 7168, intermediate 2048) and
// checks that they agree. Each case spreads its rows over `touched`
// experts of 32 resident ones and rotates between 4 disjoint expert sets
// where 32 allow it, so the weights come from memory, not from the 60 MB
// L2. The bandwidth printed counts the weight and activation bytes read.
func TestFP4GemmPaths(t *testing.T) {
	be := gpu(t)
	if testing.Short() {
		t.Skip("-short: 1 GB of weights")
	}
	const E, H, I, iters = 32, 7168, 2048, 50
	r := rand.New(rand.NewPCG(31, 32))
	randFP4 := func(lead ...int) kernels.NVFP4 {
		rows, k := 1, lead[len(lead)-1]
		for _, d := range lead[:len(lead)-1] {
			rows *= d
		}
		packed, scales := make([]byte, rows*k/2), make([]byte, rows*k/16)
		for i := range packed {
			packed[i] = byte(r.Uint32())
		}
		for i := range scales {
			scales[i] = byte(0x28 + r.IntN(0x20)) // E4M3 2^-2 .. 2^2
		}
		q := kernels.NVFP4{
			Packed: moetest.Alloc(t, be, kernels.U8, append(lead[:len(lead)-1:len(lead)-1], k/2)...),
			Scales: moetest.Alloc(t, be, kernels.U8, append(lead[:len(lead)-1:len(lead)-1], k/16)...),
		}
		nsc := rows
		if len(lead) == 3 {
			nsc = lead[0]
		}
		sc := make([]float32, nsc)
		for i := range sc {
			sc[i] = float32(math.Ldexp(1+r.Float64(), -8))
		}
		q.Scale = moetest.Alloc(t, be, kernels.F32, nsc)
		for _, u := range []struct {
			b *kernels.Buffer
			d []byte
		}{{q.Packed, packed}, {q.Scales, scales}, {q.Scale, kernels.Float32Bytes(sc)}} {
			if err := be.Upload(u.b, 0, u.d); err != nil {
				t.Fatal(err)
			}
		}
		return q
	}
	weights := map[string]kernels.NVFP4{
		"fc1_relu2":  randFP4(E, I, H),
		"fc1_swiglu": randFP4(E, 2*I, H),
		"fc2":        randFP4(E, H, I),
	}
	defer func(staged bool) { be.fp4Staged = staged }(be.fp4Staged)
	for _, c := range []struct {
		w             string
		act           kernels.Activation
		rows, touched int
	}{
		{"fc1_relu2", kernels.ReLU2, 1, 8}, {"fc2", kernels.Identity, 1, 8}, {"fc1_swiglu", kernels.SwiGLU, 1, 8},
		{"fc1_relu2", kernels.ReLU2, 2, 32}, {"fc2", kernels.Identity, 2, 32},
		{"fc1_relu2", kernels.ReLU2, 4, 32}, {"fc2", kernels.Identity, 4, 32},
		{"fc1_relu2", kernels.ReLU2, 16, 32}, {"fc2", kernels.Identity, 16, 32}, {"fc1_swiglu", kernels.SwiGLU, 16, 32},
		{"fc1_relu2", kernels.ReLU2, 128, 32}, {"fc2", kernels.Identity, 128, 32},
	} {
		t.Run(fmt.Sprintf("%s_rows%d_experts%d", c.w, c.rows, c.touched), func(t *testing.T) {
			W := weights[c.w]
			n, k := W.Packed.Dim(1), 2*W.Packed.Dim(2)
			outN := n
			if c.act == kernels.SwiGLU {
				outN = n / 2
			}
			R := c.rows * c.touched
			A := randFP4(R, k)
			sets := max(1, min(4, E/c.touched))
			var offs []*kernels.Buffer
			for s := range sets {
				o := make([]int32, E+1)
				for e := range E {
					o[e+1] = o[e]
					if e >= s*c.touched && e < (s+1)*c.touched {
						o[e+1] += int32(c.rows)
					}
				}
				b := moetest.Alloc(t, be, kernels.I32, E+1)
				if err := be.Upload(b, 0, kernels.Int32Bytes(o)); err != nil {
					t.Fatal(err)
				}
				offs = append(offs, b)
			}
			run := func(out *kernels.Buffer, i int) error {
				return be.GroupedGemm(kernels.GroupedGemmArgs{A: kernels.Operand{Q: A}, W: kernels.Operand{Q: W},
					Offsets: offs[i%sets], Act: c.act, Out: out})
			}
			bytesRead := float64(c.touched*n*k)*(0.5+1.0/16) + float64(R*k)*(0.5+1.0/16)
			var outs [2][]byte
			var times [2]float64
			for p, staged := range []bool{false, true} {
				be.fp4Staged = staged
				out := moetest.Alloc(t, be, kernels.BF16, R, outN)
				i := 0
				d, err := be.Time(iters, func() error { i++; return run(out, i) })
				if err != nil {
					t.Fatal(err)
				}
				if err := run(out, 0); err != nil { // the checked output: expert set 0
					t.Fatal(err)
				}
				outs[p] = make([]byte, out.Size())
				if err := be.Download(outs[p], out, 0); err != nil {
					t.Fatal(err)
				}
				times[p] = d.Seconds()
			}
			t.Logf("%s rows/expert %d, %d experts, %dx%d: streamed %.1f us (%.2f TB/s), staged %.1f us (%.2f TB/s): streamed %.2fx faster",
				c.w, c.rows, c.touched, n, k, times[0]*1e6, bytesRead/times[0]/1e12, times[1]*1e6, bytesRead/times[1]/1e12, times[1]/times[0])
			var maxAbs float64
			for i := 0; i < len(outs[1]); i += 2 {
				maxAbs = max(maxAbs, math.Abs(float64(bf16.ToFloat32(uint16(outs[1][i])|uint16(outs[1][i+1])<<8))))
			}
			for i := 0; i < len(outs[0]); i += 2 {
				a := float64(bf16.ToFloat32(uint16(outs[0][i]) | uint16(outs[0][i+1])<<8))
				b := float64(bf16.ToFloat32(uint16(outs[1][i]) | uint16(outs[1][i+1])<<8))
				if math.Abs(a-b) > math.Ldexp(math.Abs(b), -7)+math.Ldexp(maxAbs, -12) || math.IsNaN(a) != math.IsNaN(b) {
					t.Fatalf("out[%d,%d]: streamed %g, staged %g (max %g)", i/2/outN, i/2%outN, a, b, maxAbs)
				}
			}
		})
	}
}
