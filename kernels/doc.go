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
// asynchronously; Sync waits for all of them. A Backend is not safe for
// concurrent use: one goroutine (the one that owns the device context) issues
// ops, and callers serialise through it. Scalars passed to an op (shapes,
// flags, epsilons) become part of a captured graph and must not change between
// replays; anything that changes per step lives in a Buffer.
package kernels
