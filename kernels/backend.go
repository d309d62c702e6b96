package kernels

import "errors"

// Sentinel errors.
var (
	// ErrForeignBuffer is returned when an op is given a buffer that
	// another backend allocated.
	ErrForeignBuffer = errors.New("kernels: buffer belongs to another backend")
	// ErrCapturing is returned by memory operations and Sync issued while
	// a Capturer is recording.
	ErrCapturing = errors.New("kernels: not allowed during graph capture")
)

// Backend is the op set. Every op validates its arguments (shapes, dtypes,
// ownership) and returns an error naming the op and the offending operand;
// on a device backend the op is enqueued and Sync reports execution errors.
type Backend interface {
	// Name identifies the backend ("cpu", "cuda").
	Name() string

	// Alloc returns a zeroed buffer. Memory is planned once: callers
	// allocate at start and keep buffers for the life of the model.
	Alloc(dt DType, shape ...int) (*Buffer, error)
	// Free releases a buffer from Alloc. Views must not be freed.
	Free(b *Buffer) error
	// Upload copies host bytes into dst at byte offset off.
	Upload(dst *Buffer, off int, src []byte) error
	// Download copies len(dst) bytes of src, from byte offset off, to the host.
	Download(dst []byte, src *Buffer, off int) error
	// Copy copies src into dst; both must have the same size in bytes.
	Copy(dst, src *Buffer) error
	// Zero sets every byte of dst to 0.
	Zero(dst *Buffer) error
	// Sync waits until every enqueued op has finished and reports the
	// first execution error.
	Sync() error

	// Gemm computes dst[M,N] = a[M,K] * w[N,K]^T with BF16 operands and
	// FP32 accumulation in a fixed order per output element (so it is batch
	// invariant); dst is F32 or BF16 (rounded to nearest-even). w is a
	// weight: a backend may start reading it while the op enqueued just
	// before still runs, so that op must not write it (copies and ops two
	// or more places back may).
	Gemm(dst, a, w *Buffer) error
	// Route turns router logits into top-k expert ids and weights.
	Route(args RouteArgs) error
	// Permute sorts the (token, k) assignments by expert.
	Permute(args PermuteArgs) error
	// Quantize converts BF16 rows to NVFP4 with the exact recipe of
	// docs/NVFP4.md, bit-exact on every backend.
	Quantize(args QuantizeArgs) error
	// GroupedGemm runs one GEMM per expert over expert-sorted rows, with the
	// activation fused into the epilogue.
	GroupedGemm(args GroupedGemmArgs) error
	// Finalize combines each token's k expert rows, weighted, in fixed k order.
	Finalize(args FinalizeArgs) error
	// FinalizeScattered ends the atomic finalize (see Scatter): out =
	// bf16(acc), and acc is cleared for the next forward.
	FinalizeScattered(out, acc *Buffer) error
	// ScatterBF16 writes BF16 values into a buffer at the elements an index
	// list or a bitmap names, span by span: a sparse weight delta.
	ScatterBF16(args ScatterBF16Args) error

	// The dense model's ops: embedding, norms, residual adds, RoPE, the
	// paged KV cache and attention, sampling and scoring.
	ModelOps
}
