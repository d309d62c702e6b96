package cuda

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"unsafe"
)

// Info describes the opened device.
type Info struct {
	Name          string // e.g. "NVIDIA H200"
	Ordinal       int
	Major, Minor  int    // compute capability
	SMs           int    // multiprocessors
	TotalMem      int64  // bytes of device memory
	L2Bytes       int    // L2 cache size
	SharedOptin   int    // max shared memory per block with opt-in (cuFuncSetAttribute)
	DriverVersion int    // cuDriverGetVersion, e.g. 13000
	Arch          string // NVRTC target for this device, e.g. "sm_90a" (see ArchFor)
}

// ArchFor returns the NVRTC --gpu-architecture for compute capability
// major.minor: the arch-specific target ("sm_90a") from Hopper on, so that
// wgmma, TMA and setmaxnreg are available, else the plain one ("sm_80").
// Arch-specific cubins run only on that exact compute capability.
func ArchFor(major, minor int) string {
	if major >= 9 {
		return fmt.Sprintf("sm_%d%da", major, minor)
	}
	return fmt.Sprintf("sm_%d%d", major, minor)
}

// Device is one CUDA device whose primary context is owned by a dedicated
// goroutine locked to its OS thread. Do runs work there; Device's methods are
// safe for concurrent use.
type Device struct {
	cfg   Config
	nvrtc []string // NVRTC libraries to try
	info  Info

	reqs chan request
	quit chan struct{} // closed by Close
	done chan struct{} // closed when the owner goroutine has exited

	closeOnce sync.Once
	closeErr  error // written by the owner before done is closed

	compOnce sync.Once
	comp     *Compiler
	compErr  error
}

type request struct {
	fn    func(*Ctx) error
	reply chan error
}

// Open loads the driver, starts the owner goroutine, initialises CUDA on it
// and makes the device's primary context current there. Errors meaning that
// no device is usable match ErrNoDevice.
func Open(cfg Config) (*Device, error) {
	cfg, nvrtc := cfg.resolved()
	drv, err := loadDriver(cfg.LibCUDA)
	if err != nil {
		return nil, err
	}
	d, err := start(func() (*Ctx, error) { return openCtx(drv, cfg.Ordinal) })
	if err != nil {
		return nil, err
	}
	d.cfg, d.nvrtc = cfg, nvrtc
	d.info.Arch = ArchFor(d.info.Major, d.info.Minor)
	return d, nil
}

// start launches the owner goroutine, which runs init on its locked thread
// and then serves requests until Close. It returns init's error.
func start(init func() (*Ctx, error)) (*Device, error) {
	d := &Device{
		reqs: make(chan request),
		quit: make(chan struct{}),
		done: make(chan struct{}),
	}
	started := make(chan error, 1)
	go d.loop(init, started)
	if err := <-started; err != nil {
		return nil, err
	}
	return d, nil
}

// loop is the owner goroutine.
func (d *Device) loop(init func() (*Ctx, error), started chan<- error) {
	// The thread stays locked until the goroutine exits, which discards the
	// thread together with any per-thread CUDA state.
	runtime.LockOSThread()
	ctx, err := init()
	if err != nil {
		close(d.done)
		started <- err
		return
	}
	ctx.tid = gettid()
	d.info = ctx.info
	started <- nil
	for {
		select {
		case r := <-d.reqs:
			r.reply <- ctx.run(r.fn)
		case <-d.quit:
			d.closeErr = ctx.close()
			close(d.done)
			return
		}
	}
}

// Do runs fn on the owner thread with the device's context current and
// returns fn's error. Calls from many goroutines are served one at a time,
// in arrival order. fn must not call Do (it would deadlock) and must not
// keep ctx, or objects made from it, for use after it returns: their
// methods then fail with ErrWrongThread. A panic in fn is returned as an
// error. After Close, Do returns ErrClosed.
func (d *Device) Do(fn func(*Ctx) error) error {
	reply := make(chan error, 1)
	select {
	case d.reqs <- request{fn: fn, reply: reply}:
		return <-reply
	case <-d.done:
		return ErrClosed
	}
}

// Close waits for the request in progress, synchronises the context,
// releases the primary context (which frees every allocation, module,
// stream, event and graph made in it) and stops the owner goroutine. It is
// idempotent: later calls return the first call's result.
func (d *Device) Close() error {
	d.closeOnce.Do(func() {
		close(d.quit)
		<-d.done
	})
	return d.closeErr
}

// Info describes the device.
func (d *Device) Info() Info { return d.info }

// Compiler returns the NVRTC compiler for this device's arch, loading NVRTC
// on first use. It may be used from any goroutine.
func (d *Device) Compiler() (*Compiler, error) {
	d.compOnce.Do(func() {
		d.comp, d.compErr = newCompiler(d.cfg, d.nvrtc, d.info.Arch)
	})
	return d.comp, d.compErr
}

// Compile compiles p for this device with its Compiler (see
// Compiler.Compile). It does not need the owner thread.
func (d *Device) Compile(p Program) (*Compiled, error) {
	c, err := d.Compiler()
	if err != nil {
		return nil, err
	}
	return c.Compile(p)
}

// run calls fn, turning a panic into an error so the owner survives it.
func (c *Ctx) run(fn func(*Ctx) error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("cuda: panic in Device.Do: %v\n%s", p, debug.Stack())
		}
	}()
	return fn(c)
}

// Device attributes read at open (CUdevice_attribute).
const (
	attrMultiprocessorCount = 16
	attrL2CacheSize         = 38
	attrComputeCapMajor     = 75
	attrComputeCapMinor     = 76
	attrSharedOptin         = 97
)

// openCtx initialises the driver on the calling (owner) thread, retains the
// device's primary context, makes it current and creates the default stream.
func openCtx(drv *driver, ordinal int) (*Ctx, error) {
	if r := ccall(drv.cuInit, 0); r != Success {
		return nil, drv.err("cuInit", r, 0)
	}
	var count, ver int32
	if r := ccall(drv.cuDeviceGetCount, uintptr(unsafe.Pointer(&count))); r != Success {
		return nil, drv.err("cuDeviceGetCount", r)
	}
	if ordinal < 0 || ordinal >= int(count) {
		return nil, &noDeviceError{fmt.Sprintf("cuda: device %d requested, %d present", ordinal, count)}
	}
	if r := ccall(drv.cuDriverGetVersion, uintptr(unsafe.Pointer(&ver))); r != Success {
		return nil, drv.err("cuDriverGetVersion", r)
	}
	var dev int32
	if r := ccall(drv.cuDeviceGet, uintptr(unsafe.Pointer(&dev)), uintptr(ordinal)); r != Success {
		return nil, drv.err("cuDeviceGet", r, ordinal)
	}
	info := Info{Ordinal: ordinal, DriverVersion: int(ver)}
	var name [256]byte
	if r := ccall(drv.cuDeviceGetName, uintptr(unsafe.Pointer(&name[0])), uintptr(len(name)), uintptr(dev)); r != Success {
		return nil, drv.err("cuDeviceGetName", r, dev)
	}
	info.Name = goString(&name[0])
	for _, a := range []struct {
		attr int
		dst  *int
	}{
		{attrComputeCapMajor, &info.Major},
		{attrComputeCapMinor, &info.Minor},
		{attrMultiprocessorCount, &info.SMs},
		{attrL2CacheSize, &info.L2Bytes},
		{attrSharedOptin, &info.SharedOptin},
	} {
		var v int32
		if r := ccall(drv.cuDeviceGetAttribute, uintptr(unsafe.Pointer(&v)), uintptr(a.attr), uintptr(dev)); r != Success {
			return nil, drv.err("cuDeviceGetAttribute", r, a.attr, dev)
		}
		*a.dst = int(v)
	}
	var total uint64
	if r := ccall(drv.cuDeviceTotalMem, uintptr(unsafe.Pointer(&total)), uintptr(dev)); r != Success {
		return nil, drv.err("cuDeviceTotalMem_v2", r, dev)
	}
	info.TotalMem = int64(total)

	var cu uintptr
	if r := ccall(drv.cuDevicePrimaryCtxRetain, uintptr(unsafe.Pointer(&cu)), uintptr(dev)); r != Success {
		return nil, drv.err("cuDevicePrimaryCtxRetain", r, dev)
	}
	c := &Ctx{drv: drv, dev: dev, cu: cu, info: info, pinned: map[uintptr]int{}}
	if r := ccall(drv.cuCtxSetCurrent, cu); r != Success {
		err := drv.err("cuCtxSetCurrent", r)
		ccall(drv.cuDevicePrimaryCtxRelease, uintptr(dev))
		return nil, err
	}
	var s uintptr
	if r := ccall(drv.cuStreamCreate, uintptr(unsafe.Pointer(&s)), streamDefault); r != Success {
		err := drv.err("cuStreamCreate", r, streamDefault)
		ccall(drv.cuDevicePrimaryCtxRelease, uintptr(dev))
		return nil, err
	}
	c.stream = &Stream{c: c, h: s, owned: true}
	return c, nil
}
