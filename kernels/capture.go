package kernels

// Capturer is implemented by backends that can record a sequence of ops and
// replay it later: a CUDA graph on the GPU, a recorded op list on the CPU.
//
// Between BeginCapture and EndCapture, ops are validated and recorded but
// not run; memory operations (Alloc, Free, Upload, Download, Copy, Zero) and
// Sync are refused with ErrCapturing, as inside CUDA stream capture. The
// recorded graph reads and writes the buffers it was captured with, at their
// addresses, every time it is launched: inputs that change per step must be
// written into those buffers before a launch.
type Capturer interface {
	BeginCapture() error
	// EndCapture stops recording and returns the graph. After an error in
	// any op during capture, EndCapture returns that error and no graph.
	EndCapture() (Graph, error)
}

// Graph is a captured sequence of ops.
type Graph interface {
	// Launch enqueues the whole sequence on the backend's stream.
	Launch() error
	// Buffers returns every buffer the captured ops reference.
	Buffers() []*Buffer
	// Destroy releases the graph. It is idempotent.
	Destroy() error
}

// Liveness is implemented by backends that can tell whether a buffer is
// still allocated as it was: the buffer itself or the root it is a view of
// is live, at the same address, with no Free since. A captured graph whose
// buffers are not all live must not be launched.
type Liveness interface {
	Live(b *Buffer) bool
}

// Stager is implemented by backends that accept host bytes for a buffer
// from any goroutine while the op-issuing goroutine keeps working: the
// refit path, which streams a new weight version into staging buffers and
// resident weight stacks that no running op reads. Stage copies src into
// dst at byte offset off and returns once src may be reused (the bytes may
// still be on their way); it is never recorded by a capture. StageSync
// waits until every byte staged so far is in place, and reports a failed
// copy: ops issued after it see the bytes. The caller guarantees that no
// op reads or writes staged bytes before StageSync.
type Stager interface {
	Stage(dst *Buffer, off int, src []byte) error
	StageSync() error
}
