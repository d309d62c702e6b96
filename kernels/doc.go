// Package kernels defines the op set every layer of the model calls, and the
// device-buffer type those ops read and write.
//
// Two backends implement the op set: kernels/cpu (pure Go, the reference and
// the default everywhere) and a CUDA backend. Layers above (moe, policy) see
// only the Backend interface, so the same model code runs on either, and the
// conformance suite in kernels/kernelstest runs the same tests against both.
//
// Buffers are allocated once by a backend and keep their address for their
// whole life: CUDA graphs captured over them, and the in-place refit that
// rewrites weights under those graphs, depend on it. Views (Rows, Index) alias
// their parent's memory and never own it.
//
// Ops are enqueued in call order on the backend's stream and may run
// asynchronously; Sync waits for all of them. Upload and Download are ordered
// with the ops: Download returns data written by every op issued before it,
// and when either returns, the host slice may be reused. A Backend is not
// safe for concurrent use: one goroutine (the one that owns the device
// context) issues ops, and callers serialise through it. Scalars passed to an
// op (shapes, flags, epsilons) become part of a captured graph and must not
// change between replays; anything that changes per step lives in a Buffer.
//
// Contracts every backend keeps:
//
//   - Shapes, dtypes and ownership are checked at call time (the Validate
//     methods here, shared by all backends), and an op's outputs must not
//     overlap its inputs or each other unless the op says it works in place.
//   - Indices read from buffers (token and expert ids, gather rows, slots,
//     page-table entries) must be in range. A backend never touches memory
//     out of bounds because of one: the CPU backend returns an error naming
//     the entry; a device backend skips the affected row and reports the
//     error at the next Sync, which clears it.
//   - Batch invariance: an output row never depends on the other rows of a
//     batch (no reduction order that varies with the batch size, no
//     atomics). A device GEMM must therefore pin its algorithm (no
//     M-dependent split-K from a library heuristic).
//   - NVFP4 quantization is bit-exact with internal/nvfp4 everywhere; other
//     ops agree within the tolerances kernelstest documents.
package kernels
