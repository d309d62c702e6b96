// Package kernelstest is the conformance suite of the kernels op set. It
// takes a backend as a parameter, so the CPU backend and the CUDA backend
// run the very same tests.
//
// References here are written independently of any backend: plain loops in
// float64 over exactly dequantized operands, and the bit-exact NVFP4 codec of
// internal/nvfp4 for the quantizer. Tolerances:
//
//   - Quantize and Permute: bit for bit.
//   - Finalize: bit for bit (its arithmetic is fully specified: FP32
//     products, FP32 sums in k order, one BF16 rounding).
//   - Route: the same expert ids (inputs avoid near-ties); weights within
//     4 ulp of FP32 relative plus 1e-6 absolute (exp differs by an ulp
//     between libraries).
//   - Gemm and GroupedGemm: |got - ref| <= 2^-7 |ref| + 2^-12 max|ref|,
//     where ref is the float64 result rounded once to the output type:
//     BF16 output rounding (2^-9), FP32 accumulation order and the
//     activation's exp account for less.
//   - Embed, Add and KVWrite: bit for bit (Add is bf16(float32(a) +
//     float32(b)), fully specified).
//   - RMSNorm: between the float64 references (taking the documented BF16
//     roundings) for r * (1 -+ 2^-16): the output is monotone in r, and the
//     FP32 sum of squares, division and rsqrt move r by far less. So it is
//     exact except where an intermediate value sits on a BF16 rounding
//     boundary, and there within 1 BF16 ulp; dropping the intermediate
//     rounding fails.
//   - RoPE: within 1 BF16 ulp of the float64 reference with the documented
//     roundings (FP32 subtraction before the last rounding may round twice).
//   - Attention: the GEMM tolerance against float64 attention over the
//     output's max|ref|; a sequence alone and in a batch: bit for bit.
//   - Sample: greedy is the argmax (lowest id on ties); top-k 1 and a tiny
//     top-p give the argmax; tokens equal the float64 reference draw with
//     the Philox uniform of internal/philox, except draws within 1e-5 of a
//     boundary; the same call twice, and a row alone or in a batch, give
//     the same bits; frequencies over 4000 positions within 5 sigma.
//   - Sample and LogProbs logprobs: within 1e-5 + 1e-6|ref| of float64
//     log-softmax.
//   - ScatterBF16 (and, on a kernels.DeltaStager, StageScatterBF16 and
//     StageCopy): bit for bit.
package kernelstest

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// NewBackend returns a backend for one test; it registers its own cleanup.
type NewBackend func(t *testing.T) kernels.Backend

// Run runs the whole conformance suite against the backend newBackend makes.
func Run(t *testing.T, newBackend NewBackend) {
	t.Run("Buffers", func(t *testing.T) { testBuffers(t, newBackend(t)) })
	t.Run("Gemm", func(t *testing.T) { testGemm(t, newBackend(t)) })
	t.Run("GemmSet", func(t *testing.T) { testGemmSet(t, newBackend(t)) })
	t.Run("Route", func(t *testing.T) { testRoute(t, newBackend(t)) })
	t.Run("Permute", func(t *testing.T) { testPermute(t, newBackend(t)) })
	t.Run("Dispatch", func(t *testing.T) { testDispatch(t, newBackend(t)) })
	t.Run("Quantize", func(t *testing.T) { testQuantize(t, newBackend(t)) })
	t.Run("Amax", func(t *testing.T) { testAmax(t, newBackend(t)) })
	t.Run("GroupedGemm", func(t *testing.T) { testGroupedGemm(t, newBackend(t)) })
	t.Run("Finalize", func(t *testing.T) { testFinalize(t, newBackend(t)) })
	t.Run("Scatter", func(t *testing.T) { testScatter(t, newBackend(t)) })
	t.Run("GroupedGemmExact", func(t *testing.T) { testGroupedGemmExact(t, newBackend(t)) })
	t.Run("GroupedGemmRows", func(t *testing.T) { testGroupedGemmRows(t, newBackend(t)) })
	t.Run("QuantizeSlice", func(t *testing.T) { testQuantizeSlice(t, newBackend(t)) })
	t.Run("RowInvariance", func(t *testing.T) { testRowInvariance(t, newBackend(t)) })
	t.Run("Errors", func(t *testing.T) { testErrors(t, newBackend(t)) })
	t.Run("BadIndices", func(t *testing.T) { testBadIndices(t, newBackend(t)) })
	t.Run("Embed", func(t *testing.T) { testEmbed(t, newBackend(t)) })
	t.Run("RMSNorm", func(t *testing.T) { testRMSNorm(t, newBackend(t)) })
	t.Run("AddRMSNorm", func(t *testing.T) { testAddRMSNorm(t, newBackend(t)) })
	t.Run("QKVPrep", func(t *testing.T) { testQKVPrep(t, newBackend(t)) })
	t.Run("Add", func(t *testing.T) { testAdd(t, newBackend(t)) })
	t.Run("RoPE", func(t *testing.T) { testRoPE(t, newBackend(t)) })
	t.Run("KVWrite", func(t *testing.T) { testKVWrite(t, newBackend(t)) })
	t.Run("Attention", func(t *testing.T) { testAttention(t, newBackend(t)) })
	t.Run("Sample", func(t *testing.T) { testSample(t, newBackend(t)) })
	t.Run("LogProbs", func(t *testing.T) { testLogProbs(t, newBackend(t)) })
	t.Run("ModelErrors", func(t *testing.T) { testModelErrors(t, newBackend(t)) })
	t.Run("ScatterBF16", func(t *testing.T) { testScatterBF16(t, newBackend(t)) })
}

// alloc allocates a buffer and frees it when the test ends.
func alloc(t *testing.T, be kernels.Backend, dt kernels.DType, shape ...int) *kernels.Buffer {
	t.Helper()
	b, err := be.Alloc(dt, shape...)
	if err != nil {
		t.Fatalf("Alloc(%s, %v): %v", dt, shape, err)
	}
	t.Cleanup(func() {
		if err := be.Free(b); err != nil {
			t.Errorf("Free(%v): %v", b, err)
		}
	})
	return b
}

func upload(t *testing.T, be kernels.Backend, b *kernels.Buffer, data []byte) {
	t.Helper()
	if err := be.Upload(b, 0, data); err != nil {
		t.Fatalf("Upload(%v): %v", b, err)
	}
}

func download(t *testing.T, be kernels.Backend, b *kernels.Buffer) []byte {
	t.Helper()
	if err := be.Sync(); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	out := make([]byte, b.Size())
	if err := be.Download(out, b, 0); err != nil {
		t.Fatalf("Download(%v): %v", b, err)
	}
	return out
}

func bf16Buf(t *testing.T, be kernels.Backend, vals []uint16, shape ...int) *kernels.Buffer {
	t.Helper()
	b := alloc(t, be, kernels.BF16, shape...)
	upload(t, be, b, kernels.Uint16Bytes(vals))
	return b
}

func f32Buf(t *testing.T, be kernels.Backend, vals []float32, shape ...int) *kernels.Buffer {
	t.Helper()
	b := alloc(t, be, kernels.F32, shape...)
	upload(t, be, b, kernels.Float32Bytes(vals))
	return b
}

func i32Buf(t *testing.T, be kernels.Backend, vals []int32, shape ...int) *kernels.Buffer {
	t.Helper()
	b := alloc(t, be, kernels.I32, shape...)
	upload(t, be, b, kernels.Int32Bytes(vals))
	return b
}

// randBF16 returns n BF16 values drawn from N(0, std^2).
func randBF16(r *rand.Rand, n int, std float64) []uint16 {
	out := make([]uint16, n)
	for i := range out {
		out[i] = bf16.FromFloat32(float32(r.NormFloat64() * std))
	}
	return out
}

// closeTo reports whether got is within the GEMM tolerance of ref.
func closeTo(got, ref, maxRef float64) bool {
	return math.Abs(got-ref) <= math.Ldexp(math.Abs(ref), -7)+math.Ldexp(maxRef, -12)
}
