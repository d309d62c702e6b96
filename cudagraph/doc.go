// Package cudagraph is the capture/replay abstraction the decode step runs
// through: one captured graph per batch-size bucket, replayed with inputs
// written into fixed buffers, with a registry of the buffers a capture
// references and a check that none was freed or reallocated since.
//
// It is independent of the backend. Capture drives any backend that
// implements kernels.Capturer: a real CUDA graph on the GPU, a recorded op
// list on the CPU backend (the reference, so a replay is tested bit for bit
// against running the step directly). A backend without it gets
// ErrUnsupported; callers then run the step directly.
//
// # Capture and replay
//
// Capture calls the step once with the backend in capture mode: the step's
// ops are validated and recorded, not run, and memory operations (Alloc,
// Free, Upload, Download, Copy, Zero, Sync) fail with kernels.ErrCapturing.
// So a step issues ops only: per-step inputs are uploaded into the step's
// fixed buffers before each Replay, and outputs downloaded after it. Every
// scalar the step passes to an op (shapes, flags, epsilons) and every buffer
// it names is frozen into the graph.
//
// The graph keeps a registry of the buffers its ops reference (address,
// size, the *kernels.Buffer). Replay first checks, when the backend
// implements kernels.Liveness, that every one of them is still allocated as
// it was; if not, it returns an error wrapping ErrStale that names the
// buffer, and launches nothing. Memory is planned once (every buffer is
// allocated at start: docs/MOE.md, "Buffers and ops"), so a stale buffer
// is a bug in the caller, never a reason to recapture silently.
//
// # Buckets
//
// A Set holds one graph per batch-size bucket for a step function of the
// bucket size. Run(n) picks the smallest bucket >= n, captures its graph on
// first use (or all of them up front with CaptureAll) and replays it. Rows
// n..bucket-1 are padding: the step must be written so that padding rows
// are harmless (a negative KV slot writes nothing, attention leaves rows
// outside QueryStart untouched). Captures, replays and recaptures are
// counted, as plain counters (Stats) and, with Metrics, as Prometheus
// counters labelled by bucket. A recapture is a capture of a bucket that
// already had a graph; only an explicit Invalidate causes one, so in normal
// operation the recapture count stays 0. After a refit, which rewrites
// weights in place, the same graphs replay with the new weights: no
// Invalidate is needed.
//
// # Concurrency and ownership
//
// A Graph and a Set belong to the goroutine that owns the backend (see
// package kernels: one goroutine issues ops) and are not safe for concurrent
// use. Stats and the Prometheus counters may be read from any goroutine. A
// Graph does not own the buffers it references: they stay the caller's, and
// must outlive the graph's use. Destroy (Graph) and Close (Set) release the
// captured graphs; both are idempotent.
package cudagraph
