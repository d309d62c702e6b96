// Package cuda is the thin layer between the CUDA backend and NVIDIA's
// libraries: it loads libcuda.so.1 (the driver API) and libnvrtc.so (the
// runtime compiler) with github.com/ebitengine/purego, so the module builds
// with CGO_ENABLED=0 on machines without CUDA and the same binary runs on a
// GPU host.
//
// # Loading
//
// Open(Config) dlopens the driver and opens one device. Library paths, the
// CUDA include directory (NVRTC needs it as -I for cuda_bf16.h and friends)
// and the cubin cache directory come from Config, else from the
// environment (ROLLOUT_WORKER_LIBCUDA, ROLLOUT_WORKER_LIBNVRTC,
// ROLLOUT_WORKER_CUDA_INCLUDE, ROLLOUT_WORKER_CUBIN_CACHE), else from
// defaults. When no device is usable (no library, no GPU, a driver that
// cannot run), the error matches ErrNoDevice, so GPU tests skip:
//
//	d, err := cuda.Open(cuda.Config{})
//	if errors.Is(err, cuda.ErrNoDevice) {
//		t.Skip("no CUDA device: " + err.Error())
//	}
//
// # Ownership and concurrency
//
// A Device owns the device's primary context through one goroutine that is
// locked to its OS thread for the Device's whole life; the context is
// current on that thread only. All driver work reaches it through a queue:
// Device.Do(fn) runs fn on the owner thread with a *Ctx and returns fn's
// error. Do may be called from any number of goroutines; calls run one at a
// time in arrival order. fn must not call Do again (deadlock).
//
// A *Ctx, and the Streams, Events, Modules, Functions and Graphs made from
// it, may be kept between Do calls, but their methods may be called only
// inside a Do function: on any other thread they return ErrWrongThread
// instead of calling the driver. Device memory is a DevicePtr (a plain
// address); pinned host memory from Ctx.HostAlloc is a []byte outside the
// Go heap, valid until FreeHost or Close.
//
// Compilation needs no context: Device.Compile, Compiler.Compile and
// CompileAll (several programs at once) may be called from any goroutine,
// and each resulting cubin is loaded with Ctx.LoadModule inside Do.
//
// Close stops the owner goroutine after the request in progress, frees the
// pinned host memory, destroys the device's stream and releases the primary
// context (which the driver destroys, with every allocation, module, event
// and graph in it, when no one else in the process holds it). Close is
// idempotent; Do after Close returns ErrClosed.
//
// # Errors
//
// Every failed driver call becomes an *Error naming the call, its arguments
// and the driver's name and description of the code, e.g.
//
//	cuda: cuMemAlloc_v2(1073741824): CUDA_ERROR_OUT_OF_MEMORY (out of memory)
//
// Kernel faults are asynchronous: they surface at the next synchronising
// call (Stream.Sync, Event.Sync, Ctx.Synchronize, DtoH, ...). A compile
// failure is a *CompileError carrying NVRTC's log.
//
// # Ordering and graphs
//
// Streams are blocking streams: the synchronous calls (Alloc, Free, HtoD,
// DtoH, DtoD, Memset8, Synchronize), which use the legacy default stream,
// are ordered with the work on every stream. Asynchronous copies take
// pinned memory only. Stream.BeginCapture records the work issued on the
// stream into a graph (thread-local capture mode) until Stream.EndCapture,
// which instantiates it; meanwhile the synchronous calls return
// ErrCapturing. A Graph replays the captured kernels on the device
// addresses it was captured with: write new inputs into the same buffers
// before each Graph.Launch.
//
// # Compiling
//
// Compiler compiles CUDA C++ with NVRTC for one arch (ArchFor gives
// "sm_90a" on H100/H200) with CompileOptions (C++17, -I include directory,
// IEEE float math) and caches cubins on disk under ProgramKey, a sha256 of
// the source, the headers the program is given, its name expressions,
// options, arch and NVRTC version. A program's kernels are found by name
// (extern "C") or by NVRTC name expressions, whose lowered names
// Compiled.Lowered holds and the cache keeps beside the cubin (key.names).
// Cache files are written atomically (temporary file, then rename).
// CompileAll compiles several programs concurrently (NVRTC is thread-safe
// across programs), each under its own key.
package cuda
