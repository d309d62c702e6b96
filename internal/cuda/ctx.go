package cuda

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"runtime"
	"time"
	"unsafe"
)

// Driver constants used here.
const (
	streamDefault          = 0 // CU_STREAM_DEFAULT: blocking, ordered with the legacy stream
	eventDefault           = 0 // CU_EVENT_DEFAULT: timing enabled
	memHostAllocPortable   = 1 // CU_MEMHOSTALLOC_PORTABLE
	captureModeThreadLocal = 1 // CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
	funcAttrMaxDynShared   = 8 // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
)

// Ctx is the device's context as seen from the owner thread. It is valid
// only inside the function passed to Device.Do, and so are the Streams,
// Events, Modules, Functions and Graphs made from it: they may be kept
// across Do calls, but their methods must be called inside one. Called on
// another thread, every method returns ErrWrongThread.
//
// Synchronous operations (Alloc, Free, HtoD, DtoH, DtoD, Memset8,
// Synchronize) run on the legacy default stream. Streams made here are
// blocking streams, so those operations are ordered with all work already
// issued on any stream of the context, and work issued after them waits for
// them. HtoD returns once src may be reused; DtoH returns with the data.
type Ctx struct {
	drv       *driver
	tid       int // owner thread; 0 disables the check
	dev       int32
	cu        uintptr
	info      Info
	stream    *Stream
	pinned    map[uintptr]int // HostAlloc blocks: base address -> size
	capturing int             // streams being captured
}

func (c *Ctx) check() error {
	if c == nil || c.drv == nil {
		return ErrWrongThread
	}
	if c.tid != 0 && gettid() != c.tid {
		return ErrWrongThread
	}
	return nil
}

// checkSync refuses operations that would break a stream capture.
func (c *Ctx) checkSync() error {
	if err := c.check(); err != nil {
		return err
	}
	if c.capturing > 0 {
		return ErrCapturing
	}
	return nil
}

// Info describes the device.
func (c *Ctx) Info() Info { return c.info }

// Stream returns the device's own stream, created by Open and destroyed by
// Close. Methods that take a *Stream use it when given nil.
func (c *Ctx) Stream() *Stream { return c.stream }

func (c *Ctx) streamOf(s *Stream) (uintptr, error) {
	if s == nil {
		s = c.stream
	}
	if s.c != c || s.h == 0 {
		return 0, errors.New("cuda: stream is destroyed or belongs to another device")
	}
	return s.h, nil
}

// Synchronize waits for all work in the context (cuCtxSynchronize) and
// returns the first asynchronous error, if any.
func (c *Ctx) Synchronize() error {
	if err := c.checkSync(); err != nil {
		return err
	}
	if r := ccall(c.drv.cuCtxSynchronize); r != Success {
		return c.drv.err("cuCtxSynchronize", r)
	}
	return nil
}

// close runs on the owner thread at Device.Close.
func (c *Ctx) close() error {
	if c.drv == nil {
		return nil
	}
	var errs []error
	if r := ccall(c.drv.cuCtxSynchronize); r != Success {
		errs = append(errs, c.drv.err("cuCtxSynchronize", r))
	}
	for base := range c.pinned {
		if r := ccall(c.drv.cuMemFreeHost, base); r != Success {
			errs = append(errs, c.drv.err("cuMemFreeHost", r, fmt.Sprintf("%#x", base)))
		}
	}
	c.pinned = nil
	if c.stream != nil && c.stream.h != 0 {
		if r := ccall(c.drv.cuStreamDestroy, c.stream.h); r != Success {
			errs = append(errs, c.drv.err("cuStreamDestroy_v2", r))
		}
		c.stream.h = 0
	}
	if r := ccall(c.drv.cuDevicePrimaryCtxRelease, uintptr(c.dev)); r != Success {
		errs = append(errs, c.drv.err("cuDevicePrimaryCtxRelease_v2", r, c.dev))
	}
	c.drv = nil // any later use is ErrWrongThread
	return errors.Join(errs...)
}

// DevicePtr is a device address (CUdeviceptr).
type DevicePtr uint64

// Add returns p advanced by off bytes.
func (p DevicePtr) Add(off int) DevicePtr { return p + DevicePtr(off) }

func (p DevicePtr) String() string { return fmt.Sprintf("%#x", uint64(p)) }

func sizeErr(op string, n int) error {
	return fmt.Errorf("cuda: %s: invalid size %d", op, n)
}

// Alloc allocates n bytes of device memory (cuMemAlloc_v2), 256-byte aligned
// at least. The memory is not cleared.
func (c *Ctx) Alloc(n int) (DevicePtr, error) {
	if err := c.checkSync(); err != nil {
		return 0, err
	}
	if n <= 0 {
		return 0, sizeErr("Alloc", n)
	}
	var p uint64
	if r := ccall(c.drv.cuMemAlloc, uintptr(unsafe.Pointer(&p)), uintptr(n)); r != Success {
		return 0, c.drv.err("cuMemAlloc_v2", r, n)
	}
	return DevicePtr(p), nil
}

// MemInfo returns the free and total device memory in bytes
// (cuMemGetInfo_v2).
func (c *Ctx) MemInfo() (free, total int64, err error) {
	if err := c.check(); err != nil {
		return 0, 0, err
	}
	var f, t uint64
	if r := ccall(c.drv.cuMemGetInfo, uintptr(unsafe.Pointer(&f)), uintptr(unsafe.Pointer(&t))); r != Success {
		return 0, 0, c.drv.err("cuMemGetInfo_v2", r)
	}
	return int64(f), int64(t), nil
}

// Free releases memory from Alloc (cuMemFree_v2). It waits for work using it.
func (c *Ctx) Free(p DevicePtr) error {
	if err := c.checkSync(); err != nil {
		return err
	}
	if r := ccall(c.drv.cuMemFree, uintptr(p)); r != Success {
		return c.drv.err("cuMemFree_v2", r, p)
	}
	return nil
}

// HtoD copies src to device address dst (cuMemcpyHtoD_v2).
func (c *Ctx) HtoD(dst DevicePtr, src []byte) error {
	if err := c.checkSync(); err != nil || len(src) == 0 {
		return err
	}
	if r := ccall(c.drv.cuMemcpyHtoD, uintptr(dst), uintptr(unsafe.Pointer(&src[0])), uintptr(len(src))); r != Success {
		return c.drv.err("cuMemcpyHtoD_v2", r, dst, len(src))
	}
	return nil
}

// DtoH copies len(dst) bytes from device address src (cuMemcpyDtoH_v2).
func (c *Ctx) DtoH(dst []byte, src DevicePtr) error {
	if err := c.checkSync(); err != nil || len(dst) == 0 {
		return err
	}
	if r := ccall(c.drv.cuMemcpyDtoH, uintptr(unsafe.Pointer(&dst[0])), uintptr(src), uintptr(len(dst))); r != Success {
		return c.drv.err("cuMemcpyDtoH_v2", r, src, len(dst))
	}
	return nil
}

// DtoD copies n bytes between device addresses (cuMemcpyDtoD_v2).
func (c *Ctx) DtoD(dst, src DevicePtr, n int) error {
	if err := c.checkSync(); err != nil {
		return err
	}
	if n < 0 {
		return sizeErr("DtoD", n)
	}
	if n == 0 {
		return nil
	}
	if r := ccall(c.drv.cuMemcpyDtoD, uintptr(dst), uintptr(src), uintptr(n)); r != Success {
		return c.drv.err("cuMemcpyDtoD_v2", r, dst, src, n)
	}
	return nil
}

// Memset8 sets n bytes at dst to v (cuMemsetD8_v2).
func (c *Ctx) Memset8(dst DevicePtr, v byte, n int) error {
	if err := c.checkSync(); err != nil {
		return err
	}
	if n < 0 {
		return sizeErr("Memset8", n)
	}
	if n == 0 {
		return nil
	}
	if r := ccall(c.drv.cuMemsetD8, uintptr(dst), uintptr(v), uintptr(n)); r != Success {
		return c.drv.err("cuMemsetD8_v2", r, dst, v, n)
	}
	return nil
}

// HostAlloc allocates n bytes of page-locked host memory (cuMemHostAlloc),
// which asynchronous copies require. The slice is not Go memory: it stays
// valid until FreeHost or Close, and must not be used after.
func (c *Ctx) HostAlloc(n int) ([]byte, error) {
	if err := c.checkSync(); err != nil {
		return nil, err
	}
	if n <= 0 {
		return nil, sizeErr("HostAlloc", n)
	}
	var p *byte
	if r := ccall(c.drv.cuMemHostAlloc, uintptr(unsafe.Pointer(&p)), uintptr(n), memHostAllocPortable); r != Success {
		return nil, c.drv.err("cuMemHostAlloc", r, n, memHostAllocPortable)
	}
	c.pinned[uintptr(unsafe.Pointer(p))] = n
	return unsafe.Slice(p, n), nil
}

// FreeHost releases a slice returned by HostAlloc (cuMemFreeHost).
func (c *Ctx) FreeHost(b []byte) error {
	if err := c.checkSync(); err != nil {
		return err
	}
	if len(b) == 0 {
		return errors.New("cuda: FreeHost of an empty slice")
	}
	base := uintptr(unsafe.Pointer(&b[0]))
	if _, ok := c.pinned[base]; !ok {
		return errors.New("cuda: FreeHost: not a block from HostAlloc")
	}
	if r := ccall(c.drv.cuMemFreeHost, uintptr(unsafe.Pointer(&b[0]))); r != Success {
		return c.drv.err("cuMemFreeHost", r, fmt.Sprintf("%#x", base))
	}
	delete(c.pinned, base)
	return nil
}

// isPinned reports whether b lies inside one HostAlloc block.
func (c *Ctx) isPinned(b []byte) bool {
	p := uintptr(unsafe.Pointer(&b[0]))
	for base, n := range c.pinned {
		if p >= base && p+uintptr(len(b)) <= base+uintptr(n) {
			return true
		}
	}
	return false
}

var errNotPinned = errors.New("cuda: asynchronous copy needs host memory from HostAlloc")

// HtoDAsync enqueues a copy of src to dst on s (cuMemcpyHtoDAsync_v2). src
// must lie in HostAlloc memory and stay unchanged until s reaches the copy.
// It may be captured into a graph.
func (c *Ctx) HtoDAsync(dst DevicePtr, src []byte, s *Stream) error {
	if err := c.check(); err != nil || len(src) == 0 {
		return err
	}
	if !c.isPinned(src) {
		return errNotPinned
	}
	h, err := c.streamOf(s)
	if err != nil {
		return err
	}
	if r := ccall(c.drv.cuMemcpyHtoDAsync, uintptr(dst), uintptr(unsafe.Pointer(&src[0])), uintptr(len(src)), h); r != Success {
		return c.drv.err("cuMemcpyHtoDAsync_v2", r, dst, len(src))
	}
	return nil
}

// DtoHAsync enqueues a copy from src into dst on s (cuMemcpyDtoHAsync_v2).
// dst must lie in HostAlloc memory; it holds the data once s reaches the
// copy (Stream.Sync, or an Event recorded after it).
func (c *Ctx) DtoHAsync(dst []byte, src DevicePtr, s *Stream) error {
	if err := c.check(); err != nil || len(dst) == 0 {
		return err
	}
	if !c.isPinned(dst) {
		return errNotPinned
	}
	h, err := c.streamOf(s)
	if err != nil {
		return err
	}
	if r := ccall(c.drv.cuMemcpyDtoHAsync, uintptr(unsafe.Pointer(&dst[0])), uintptr(src), uintptr(len(dst)), h); r != Success {
		return c.drv.err("cuMemcpyDtoHAsync_v2", r, src, len(dst))
	}
	return nil
}

// DtoDAsync enqueues a copy of n bytes between device addresses on s
// (cuMemcpyDtoDAsync_v2).
func (c *Ctx) DtoDAsync(dst, src DevicePtr, n int, s *Stream) error {
	if err := c.check(); err != nil {
		return err
	}
	if n < 0 {
		return sizeErr("DtoDAsync", n)
	}
	if n == 0 {
		return nil
	}
	h, err := c.streamOf(s)
	if err != nil {
		return err
	}
	if r := ccall(c.drv.cuMemcpyDtoDAsync, uintptr(dst), uintptr(src), uintptr(n), h); r != Success {
		return c.drv.err("cuMemcpyDtoDAsync_v2", r, dst, src, n)
	}
	return nil
}

// Stream is a CUDA stream (a blocking one: see Ctx).
type Stream struct {
	c         *Ctx
	h         uintptr
	owned     bool // the device's own stream: destroyed by Close only
	capturing bool
}

// NewStream creates a stream (cuStreamCreate, CU_STREAM_DEFAULT).
func (c *Ctx) NewStream() (*Stream, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	var h uintptr
	if r := ccall(c.drv.cuStreamCreate, uintptr(unsafe.Pointer(&h)), streamDefault); r != Success {
		return nil, c.drv.err("cuStreamCreate", r, streamDefault)
	}
	return &Stream{c: c, h: h}, nil
}

// Sync waits until all work on s is done (cuStreamSynchronize) and returns
// the first asynchronous error, if any.
func (s *Stream) Sync() error {
	if err := s.c.check(); err != nil {
		return err
	}
	if s.capturing {
		return ErrCapturing
	}
	if r := ccall(s.c.drv.cuStreamSynchronize, s.h); r != Success {
		return s.c.drv.err("cuStreamSynchronize", r)
	}
	return nil
}

// Destroy releases s (cuStreamDestroy_v2). It is idempotent; the device's
// own stream is released by Close only.
func (s *Stream) Destroy() error {
	if err := s.c.check(); err != nil {
		return err
	}
	if s.owned {
		return errors.New("cuda: the device's stream is destroyed by Close")
	}
	if s.h == 0 {
		return nil
	}
	if s.capturing {
		return ErrCapturing
	}
	if r := ccall(s.c.drv.cuStreamDestroy, s.h); r != Success {
		return s.c.drv.err("cuStreamDestroy_v2", r)
	}
	s.h = 0
	return nil
}

// BeginCapture starts recording the work issued on s into a graph instead of
// running it (cuStreamBeginCapture_v2, thread-local mode). Until EndCapture,
// the context's synchronous operations return ErrCapturing.
func (s *Stream) BeginCapture() error {
	if err := s.c.check(); err != nil {
		return err
	}
	if s.capturing {
		return errors.New("cuda: stream is already capturing")
	}
	if r := ccall(s.c.drv.cuStreamBeginCapture, s.h, captureModeThreadLocal); r != Success {
		return s.c.drv.err("cuStreamBeginCapture_v2", r, "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL")
	}
	s.capturing = true
	s.c.capturing++
	return nil
}

// EndCapture stops recording (cuStreamEndCapture) and instantiates the
// graph (cuGraphInstantiateWithFlags). The graph reads and writes the device
// addresses it was captured with at every launch.
func (s *Stream) EndCapture() (*Graph, error) {
	c := s.c
	if err := c.check(); err != nil {
		return nil, err
	}
	if !s.capturing {
		return nil, errors.New("cuda: stream is not capturing")
	}
	var g uintptr
	r := ccall(c.drv.cuStreamEndCapture, s.h, uintptr(unsafe.Pointer(&g)))
	s.capturing = false
	c.capturing--
	if r != Success {
		if g != 0 {
			ccall(c.drv.cuGraphDestroy, g)
		}
		return nil, c.drv.err("cuStreamEndCapture", r)
	}
	var exec uintptr
	if r := ccall(c.drv.cuGraphInstantiateWithFlags, uintptr(unsafe.Pointer(&exec)), g, 0); r != Success {
		ccall(c.drv.cuGraphDestroy, g)
		return nil, c.drv.err("cuGraphInstantiateWithFlags", r, 0)
	}
	return &Graph{c: c, g: g, exec: exec}, nil
}

// Graph is an instantiated CUDA graph (the captured graph and its
// executable).
type Graph struct {
	c       *Ctx
	g, exec uintptr
}

// Launch enqueues the whole graph on s (cuGraphLaunch).
func (g *Graph) Launch(s *Stream) error {
	if err := g.c.check(); err != nil {
		return err
	}
	if g.exec == 0 {
		return errors.New("cuda: graph is destroyed")
	}
	h, err := g.c.streamOf(s)
	if err != nil {
		return err
	}
	if r := ccall(g.c.drv.cuGraphLaunch, g.exec, h); r != Success {
		return g.c.drv.err("cuGraphLaunch", r)
	}
	return nil
}

// Destroy releases the graph (cuGraphExecDestroy, cuGraphDestroy). It is
// idempotent.
func (g *Graph) Destroy() error {
	if err := g.c.check(); err != nil {
		return err
	}
	var errs []error
	if g.exec != 0 {
		if r := ccall(g.c.drv.cuGraphExecDestroy, g.exec); r != Success {
			errs = append(errs, g.c.drv.err("cuGraphExecDestroy", r))
		}
		g.exec = 0
	}
	if g.g != 0 {
		if r := ccall(g.c.drv.cuGraphDestroy, g.g); r != Success {
			errs = append(errs, g.c.drv.err("cuGraphDestroy", r))
		}
		g.g = 0
	}
	return errors.Join(errs...)
}

// Event is a CUDA event with timing enabled.
type Event struct {
	c *Ctx
	h uintptr
}

// NewEvent creates an event (cuEventCreate, CU_EVENT_DEFAULT).
func (c *Ctx) NewEvent() (*Event, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	var h uintptr
	if r := ccall(c.drv.cuEventCreate, uintptr(unsafe.Pointer(&h)), eventDefault); r != Success {
		return nil, c.drv.err("cuEventCreate", r, eventDefault)
	}
	return &Event{c: c, h: h}, nil
}

// Record marks the point in s reached so far (cuEventRecord).
func (e *Event) Record(s *Stream) error {
	if err := e.c.check(); err != nil {
		return err
	}
	h, err := e.c.streamOf(s)
	if err != nil {
		return err
	}
	if r := ccall(e.c.drv.cuEventRecord, e.h, h); r != Success {
		return e.c.drv.err("cuEventRecord", r)
	}
	return nil
}

// eventRecordExternal is CU_EVENT_RECORD_EXTERNAL: inside a stream capture
// the record becomes an event record node of the graph, so every launch
// records the event (a plain record inside a capture only orders streams).
const eventRecordExternal = 0x1

// RecordExternal marks the point in s reached so far
// (cuEventRecordWithFlags, CU_EVENT_RECORD_EXTERNAL): outside a capture it
// is Record; inside one it records the event at that point of every launch
// of the graph, which is how a graph's parts are timed.
func (e *Event) RecordExternal(s *Stream) error {
	if err := e.c.check(); err != nil {
		return err
	}
	h, err := e.c.streamOf(s)
	if err != nil {
		return err
	}
	if r := ccall(e.c.drv.cuEventRecordWithFlags, e.h, h, eventRecordExternal); r != Success {
		return e.c.drv.err("cuEventRecordWithFlags", r, "CU_EVENT_RECORD_EXTERNAL")
	}
	return nil
}

// Sync waits until the recorded work is done (cuEventSynchronize).
func (e *Event) Sync() error {
	if err := e.c.check(); err != nil {
		return err
	}
	if r := ccall(e.c.drv.cuEventSynchronize, e.h); r != Success {
		return e.c.drv.err("cuEventSynchronize", r)
	}
	return nil
}

// Elapsed returns the device time between two completed events
// (cuEventElapsedTime_v2; resolution about half a microsecond).
func (c *Ctx) Elapsed(start, end *Event) (time.Duration, error) {
	if err := c.check(); err != nil {
		return 0, err
	}
	var ms float32
	if r := ccall(c.drv.cuEventElapsedTime, uintptr(unsafe.Pointer(&ms)), start.h, end.h); r != Success {
		return 0, c.drv.err("cuEventElapsedTime_v2", r)
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// Destroy releases the event (cuEventDestroy_v2). It is idempotent.
func (e *Event) Destroy() error {
	if err := e.c.check(); err != nil || e.h == 0 {
		return err
	}
	if r := ccall(e.c.drv.cuEventDestroy, e.h); r != Success {
		return e.c.drv.err("cuEventDestroy_v2", r)
	}
	e.h = 0
	return nil
}

// Module is loaded device code.
type Module struct {
	c *Ctx
	h uintptr
}

// LoadModule loads a cubin (or PTX) image (cuModuleLoadData).
func (c *Ctx) LoadModule(image []byte) (*Module, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	if len(image) == 0 {
		return nil, errors.New("cuda: LoadModule: empty image")
	}
	if image[len(image)-1] != 0 && !isELF(image) {
		image = append(image[:len(image):len(image)], 0) // PTX text must be NUL-terminated
	}
	var h uintptr
	if r := ccall(c.drv.cuModuleLoadData, uintptr(unsafe.Pointer(&h)), uintptr(unsafe.Pointer(&image[0]))); r != Success {
		return nil, c.drv.err("cuModuleLoadData", r, fmt.Sprintf("%d bytes", len(image)))
	}
	return &Module{c: c, h: h}, nil
}

// Function looks up a kernel by its (extern "C") name (cuModuleGetFunction).
func (m *Module) Function(name string) (*Function, error) {
	if err := m.c.check(); err != nil {
		return nil, err
	}
	if m.h == 0 {
		return nil, errors.New("cuda: module is unloaded")
	}
	var h uintptr
	cname := cString(name)
	if r := ccall(m.c.drv.cuModuleGetFunction, uintptr(unsafe.Pointer(&h)), m.h, uintptr(unsafe.Pointer(&cname[0]))); r != Success {
		return nil, m.c.drv.err("cuModuleGetFunction", r, name)
	}
	return &Function{c: m.c, h: h, name: name}, nil
}

// Unload releases the module (cuModuleUnload); its Functions become
// invalid. It is idempotent.
func (m *Module) Unload() error {
	if err := m.c.check(); err != nil || m.h == 0 {
		return err
	}
	if r := ccall(m.c.drv.cuModuleUnload, m.h); r != Success {
		return m.c.drv.err("cuModuleUnload", r)
	}
	m.h = 0
	return nil
}

// Function is a kernel of a loaded Module.
type Function struct {
	c    *Ctx
	h    uintptr
	name string
}

// Name is the kernel's name.
func (f *Function) Name() string { return f.name }

// SetMaxDynamicShared allows launches with up to n bytes of dynamic shared
// memory (cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES), needed above
// 48 KiB; Info.SharedOptin is the device's limit.
func (f *Function) SetMaxDynamicShared(n int) error {
	if err := f.c.check(); err != nil {
		return err
	}
	if r := ccall(f.c.drv.cuFuncSetAttribute, f.h, funcAttrMaxDynShared, uintptr(n)); r != Success {
		return f.c.drv.err("cuFuncSetAttribute", r, f.name, "MAX_DYNAMIC_SHARED_SIZE_BYTES", n)
	}
	return nil
}

// Dim3 is a grid or block shape; a zero field counts as 1.
type Dim3 struct{ X, Y, Z int }

func (d Dim3) norm() (x, y, z uintptr, ok bool) {
	f := func(v int) uintptr {
		if v == 0 {
			return 1
		}
		return uintptr(v)
	}
	ok = d.X >= 0 && d.Y >= 0 && d.Z >= 0 && d.X <= math.MaxUint32 && d.Y <= math.MaxUint32 && d.Z <= math.MaxUint32
	return f(d.X), f(d.Y), f(d.Z), ok
}

// RawArg passes a kernel argument by value as raw bytes (a struct whose
// layout the caller has matched to the kernel's).
type RawArg []byte

// Launch enqueues f on s (cuLaunchKernel) with grid x block threads and
// shared bytes of dynamic shared memory. args are the kernel's arguments in
// order, each one of DevicePtr, int8, uint8, int16, uint16, int32, uint32,
// int64, uint64, float32, float64, bool or RawArg, matching the kernel's
// parameter types exactly (Go int and uint are refused: use a sized type).
// Launch errors that depend on the kernel's execution appear at the next
// synchronisation.
func (f *Function) Launch(grid, block Dim3, shared int, s *Stream, args ...any) error {
	return f.launch(launchPlain, grid, block, shared, s, args)
}

// LaunchPDL is Launch with programmatic stream serialization
// (cuLaunchKernelEx, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION):
// f's blocks may start before the kernel before it on s has finished, once
// that kernel's blocks have all run griddepcontrol.launch_dependents. f must
// run griddepcontrol.wait before it reads or writes memory that kernel (or
// any before it) touches. Where the driver lacks cuLaunchKernelEx it is
// Launch. It may be captured into a graph (a programmatic edge).
func (f *Function) LaunchPDL(grid, block Dim3, shared int, s *Stream, args ...any) error {
	return f.launch(launchPDL, grid, block, shared, s, args)
}

// LaunchCooperative is Launch through cuLaunchCooperativeKernel: every
// block of the grid is resident at once, so blocks may wait for each other
// (grid-wide barriers). The grid must fit the device (see
// MaxActiveBlocksPerSM). It may be captured into a graph.
func (f *Function) LaunchCooperative(grid, block Dim3, shared int, s *Stream, args ...any) error {
	return f.launch(launchCooperative, grid, block, shared, s, args)
}

type launchMode int

const (
	launchPlain launchMode = iota
	launchCooperative
	launchPDL
)

// launchConfig is CUlaunchConfig and launchAttr CUlaunchAttribute
// (cuda.h): an id padded to 8 bytes, then a 64-byte value union.
type launchConfig struct {
	gridX, gridY, gridZ    uint32
	blockX, blockY, blockZ uint32
	shared                 uint32
	_                      uint32
	stream, attrs          uintptr
	numAttrs               uint32
	_                      uint32
}

type launchAttr struct {
	id    uint32
	_     uint32
	value [64]byte
}

// launchAttrProgrammaticStreamSerialization is
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION; its value is an
// int, programmaticStreamSerializationAllowed.
const launchAttrProgrammaticStreamSerialization = 6

// MaxActiveBlocksPerSM returns how many blocks of f with block threads and
// shared bytes of dynamic shared memory fit on one multiprocessor
// (cuOccupancyMaxActiveBlocksPerMultiprocessor).
func (f *Function) MaxActiveBlocksPerSM(block, shared int) (int, error) {
	if err := f.c.check(); err != nil {
		return 0, err
	}
	var n int32
	if r := ccall(f.c.drv.cuOccupancyMaxActiveBlocksPerMultiprocessor, uintptr(unsafe.Pointer(&n)), f.h, uintptr(block), uintptr(shared)); r != Success {
		return 0, f.c.drv.err("cuOccupancyMaxActiveBlocksPerMultiprocessor", r, f.name, block, shared)
	}
	return int(n), nil
}

func (f *Function) launch(mode launchMode, grid, block Dim3, shared int, s *Stream, args []any) error {
	c := f.c
	if err := c.check(); err != nil {
		return err
	}
	gx, gy, gz, ok1 := grid.norm()
	bx, by, bz, ok2 := block.norm()
	if !ok1 || !ok2 || shared < 0 {
		return fmt.Errorf("cuda: launch %s: invalid grid %v, block %v or shared %d", f.name, grid, block, shared)
	}
	h, err := c.streamOf(s)
	if err != nil {
		return err
	}
	storage, offs, err := packArgs(args)
	if err != nil {
		return fmt.Errorf("cuda: launch %s: %w", f.name, err)
	}
	var params uintptr
	var pin runtime.Pinner
	defer pin.Unpin()
	if len(args) > 0 {
		ptrs := make([]unsafe.Pointer, len(offs))
		for i, o := range offs {
			ptrs[i] = unsafe.Pointer(&storage[o])
		}
		pin.Pin(&storage[0])
		pin.Pin(&ptrs[0])
		params = uintptr(unsafe.Pointer(&ptrs[0]))
	}
	if mode == launchPDL && c.drv.cuLaunchKernelEx != 0 {
		attr := &launchAttr{id: launchAttrProgrammaticStreamSerialization}
		attr.value[0] = 1 // little-endian int 1
		cfg := &launchConfig{gridX: uint32(gx), gridY: uint32(gy), gridZ: uint32(gz), blockX: uint32(bx), blockY: uint32(by),
			blockZ: uint32(bz), shared: uint32(shared), stream: h, attrs: uintptr(unsafe.Pointer(attr)), numAttrs: 1}
		pin.Pin(attr)
		pin.Pin(cfg)
		if r := ccall(c.drv.cuLaunchKernelEx, uintptr(unsafe.Pointer(cfg)), f.h, params, 0); r != Success {
			return c.drv.err("cuLaunchKernelEx", r, f.name, fmt.Sprintf("grid=%v block=%v shared=%d", grid, block, shared))
		}
		return nil
	}
	if mode == launchCooperative {
		if r := ccall(c.drv.cuLaunchCooperativeKernel, f.h, gx, gy, gz, bx, by, bz, uintptr(shared), h, params); r != Success {
			return c.drv.err("cuLaunchCooperativeKernel", r, f.name, fmt.Sprintf("grid=%v block=%v shared=%d", grid, block, shared))
		}
		return nil
	}
	if r := ccall(c.drv.cuLaunchKernel, f.h, gx, gy, gz, bx, by, bz, uintptr(shared), h, params, 0); r != Success {
		return c.drv.err("cuLaunchKernel", r, f.name, fmt.Sprintf("grid=%v block=%v shared=%d", grid, block, shared))
	}
	return nil
}

// packArgs lays each argument out in its own 8-byte-aligned slot(s) of
// storage (little-endian, as the device reads it) and returns the first
// slot of each.
func packArgs(args []any) (storage []uint64, offs []int, err error) {
	offs = make([]int, len(args))
	n := 0
	for i, a := range args {
		size := 8
		if r, ok := a.(RawArg); ok {
			if len(r) == 0 {
				return nil, nil, fmt.Errorf("argument %d: empty RawArg", i)
			}
			size = len(r)
		}
		offs[i] = n
		n += (size + 7) / 8
	}
	storage = make([]uint64, max(n, 1))
	for i, a := range args {
		o := offs[i]
		var v uint64
		switch x := a.(type) {
		case DevicePtr:
			v = uint64(x)
		case int8:
			v = uint64(uint8(x))
		case uint8:
			v = uint64(x)
		case int16:
			v = uint64(uint16(x))
		case uint16:
			v = uint64(x)
		case int32:
			v = uint64(uint32(x))
		case uint32:
			v = uint64(x)
		case int64:
			v = uint64(x)
		case uint64:
			v = x
		case float32:
			v = uint64(math.Float32bits(x))
		case float64:
			v = math.Float64bits(x)
		case bool:
			if x {
				v = 1
			}
		case RawArg:
			b := unsafe.Slice((*byte)(unsafe.Pointer(&storage[o])), (len(x)+7)/8*8)
			copy(b, x)
			continue
		case int, uint:
			return nil, nil, fmt.Errorf("argument %d: %T has no fixed C size; use int32/int64 or uint32/uint64", i, a)
		default:
			return nil, nil, fmt.Errorf("argument %d: unsupported type %T", i, a)
		}
		storage[o] = v
	}
	return storage, offs, nil
}

// isELF reports whether image is an ELF object (a cubin).
func isELF(image []byte) bool {
	return len(image) >= 4 && binary.BigEndian.Uint32(image) == 0x7f454c46
}
