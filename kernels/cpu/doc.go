// Package cpu is the pure-Go backend of the kernels op set: the reference
// every GPU kernel is tested against, and the default wherever there is no
// GPU (CI, laptops, the demo).
//
// Buffers live in ordinary Go memory, 8-byte aligned; Go's collector does
// not move heap objects, so a buffer's address is stable for its life. Ops
// run synchronously on the calling goroutine, fanned out over a fixed number
// of worker goroutines that the op starts and joins before it returns; no
// goroutine outlives a call. Each output element is computed by one worker
// in a fixed order, so results do not depend on the worker count or on the
// other rows of a batch. The NVFP4 quantizer is internal/nvfp4, bit for bit.
//
// It implements kernels.Capturer (capture.go): between BeginCapture and
// EndCapture each op is validated and recorded instead of run, and the
// recorded list replays as a graph, like a CUDA graph; and kernels.Liveness,
// so a graph is never launched over a freed buffer.
//
// Like every backend, it expects one goroutine to issue ops (see package
// kernels); Alloc and Free are nevertheless safe for concurrent use.
package cpu
