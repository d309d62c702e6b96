package kernelstest

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// testScatter checks the atomic finalize (GroupedGemm with a Scatter, then
// FinalizeScattered) against the deterministic one (GroupedGemm into rows,
// then Finalize) on the same backend, for BF16 and NVFP4 operands and each
// activation. With k = 2 the two agree bit for bit whatever the order of
// the additions (0 + a + b is b + a exactly); with k = 5 (every expert)
// to the GEMM tolerance. FinalizeScattered must leave the sums cleared, so a second
// forward gives the same bits; a row whose token does not list it is an
// error, on the call or at the next Sync.
func testScatter(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(41, 42))
	const E, K, I = 5, 64, 48
	for _, quant := range []bool{false, true} {
		for _, act := range []kernels.Activation{kernels.Identity, kernels.ReLU2, kernels.SwiGLU} {
			for _, k := range []int{2, E} {
				t.Run(fmt.Sprintf("nvfp4=%v/%s/k%d", quant, act, k), func(t *testing.T) {
					const T = 11
					n := I
					if act == kernels.SwiGLU {
						n = 2 * I
					}
					outN := n
					if act == kernels.SwiGLU {
						outN = I
					}
					ids := distinctIDs(r, T, k, E, -1)
					offsets, rows, slots := refPermute(ids, k, E)
					R := T * k
					w := make([]float32, T*k)
					for i := range w {
						w[i] = r.Float32()
					}
					x := bf16Buf(t, be, randBF16(r, T*K, 1), T, K)
					wb := bf16Buf(t, be, randBF16(r, E*n*K, 0.1), E, n, K)
					A, W := kernels.Operand{BF16: x}, kernels.Operand{BF16: wb}
					if quant {
						A = kernels.Operand{Q: kernels.NVFP4{Packed: alloc(t, be, kernels.U8, T, K/2), Scales: alloc(t, be, kernels.U8, T, K/16),
							Scale: alloc(t, be, kernels.F32, T)}}
						W = kernels.Operand{Q: kernels.NVFP4{Packed: alloc(t, be, kernels.U8, E, n, K/2), Scales: alloc(t, be, kernels.U8, E, n, K/16),
							Scale: alloc(t, be, kernels.F32, E)}}
						if err := be.Quantize(kernels.QuantizeArgs{Src: x, Dst: A.Q, Mode: kernels.PerRow}); err != nil {
							t.Fatal(err)
						}
						if err := be.Quantize(kernels.QuantizeArgs{Src: wb, Dst: W.Q, Mode: kernels.PerMatrix}); err != nil {
							t.Fatal(err)
						}
					}
					O, G, S, Wt := i32Buf(t, be, offsets, E+1), i32Buf(t, be, rows, R), i32Buf(t, be, slots, R), f32Buf(t, be, w, T, k)

					y, det := alloc(t, be, kernels.BF16, R, outN), alloc(t, be, kernels.BF16, T, outN)
					if err := be.GroupedGemm(kernels.GroupedGemmArgs{A: A, Gather: G, W: W, Offsets: O, Act: act, Out: y}); err != nil {
						t.Fatal(err)
					}
					if err := be.Finalize(kernels.FinalizeArgs{Out: det, Rows: y, Weights: Wt, Slots: S}); err != nil {
						t.Fatal(err)
					}
					want := download(t, be, det)

					acc, got := alloc(t, be, kernels.F32, T, outN), alloc(t, be, kernels.BF16, T, outN)
					sc := &kernels.Scatter{Acc: acc, Tokens: G, Weights: Wt, Slots: S}
					for rep := range 2 {
						if err := be.GroupedGemm(kernels.GroupedGemmArgs{A: A, Gather: G, W: W, Offsets: O, Act: act, Scatter: sc}); err != nil {
							t.Fatal(err)
						}
						if err := be.FinalizeScattered(got, acc); err != nil {
							t.Fatal(err)
						}
						g := download(t, be, got)
						if k == 2 {
							if !bytes.Equal(g, want) {
								t.Fatalf("forward %d: the atomic finalize differs from the deterministic one", rep)
							}
						} else {
							gv, wv := kernels.BytesUint16(g), kernels.BytesUint16(want)
							var maxRef float64
							for _, v := range wv {
								maxRef = max(maxRef, math.Abs(float64(bf16.ToFloat32(v))))
							}
							for i := range wv {
								a, b := float64(bf16.ToFloat32(gv[i])), float64(bf16.ToFloat32(wv[i]))
								if !closeTo(a, b, maxRef) {
									t.Fatalf("forward %d: out[%d, %d] atomic %g, deterministic %g", rep, i/outN, i%outN, a, b)
								}
							}
						}
						for i, v := range kernels.BytesFloat32(download(t, be, acc)) {
							if v != 0 {
								t.Fatalf("forward %d: FinalizeScattered left acc[%d] = %g", rep, i, v)
							}
						}
					}

					// Row 0's token no longer lists it: an error, and nothing pending after.
					bad := append([]int32(nil), slots...)
					tok := rows[0]
					for j := range k {
						if bad[int(tok)*k+j] == 0 {
							bad[int(tok)*k+j] = int32(R) // no such row
						}
					}
					err := be.GroupedGemm(kernels.GroupedGemmArgs{A: A, Gather: G, W: W, Offsets: O, Act: act,
						Scatter: &kernels.Scatter{Acc: acc, Tokens: G, Weights: Wt, Slots: i32Buf(t, be, bad, R)}})
					if err == nil {
						err = be.Sync()
					}
					if err == nil {
						t.Fatal("a sorted row missing from its token's slots was not reported")
					}
					if err := be.Sync(); err != nil {
						t.Fatalf("the error is still pending after it was reported: %v", err)
					}
				})
			}
		}
	}
	t.Run("validation", func(t *testing.T) {
		x, w, o := alloc(t, be, kernels.BF16, 2, 64), alloc(t, be, kernels.BF16, 2, 8, 64), alloc(t, be, kernels.I32, 3)
		acc, tok, wt, sl := alloc(t, be, kernels.F32, 2, 8), alloc(t, be, kernels.I32, 4), alloc(t, be, kernels.F32, 2, 2), alloc(t, be, kernels.I32, 4)
		base := kernels.GroupedGemmArgs{A: kernels.Operand{BF16: x}, Gather: tok, W: kernels.Operand{BF16: w}, Offsets: o, Act: kernels.Identity}
		for _, c := range []struct {
			name string
			sc   kernels.Scatter
			out  *kernels.Buffer
		}{
			{"out and scatter", kernels.Scatter{Acc: acc, Tokens: tok, Weights: wt, Slots: sl}, alloc(t, be, kernels.BF16, 4, 8)},
			{"acc width", kernels.Scatter{Acc: alloc(t, be, kernels.F32, 2, 7), Tokens: tok, Weights: wt, Slots: sl}, nil},
			{"weights rows", kernels.Scatter{Acc: acc, Tokens: tok, Weights: alloc(t, be, kernels.F32, 3, 2), Slots: sl}, nil},
			{"slots length", kernels.Scatter{Acc: acc, Tokens: tok, Weights: wt, Slots: alloc(t, be, kernels.I32, 5)}, nil},
			{"acc dtype", kernels.Scatter{Acc: alloc(t, be, kernels.BF16, 2, 8), Tokens: tok, Weights: wt, Slots: sl}, nil},
		} {
			a := base
			a.Out, a.Scatter = c.out, &c.sc
			if err := be.GroupedGemm(a); err == nil {
				t.Errorf("%s: accepted", c.name)
			}
		}
		if err := be.FinalizeScattered(alloc(t, be, kernels.BF16, 2, 8), alloc(t, be, kernels.F32, 2, 9)); err == nil {
			t.Error("finalize scattered: mismatched shapes accepted")
		}
	})
}
