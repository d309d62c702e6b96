package cuda

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// Config configures the CUDA backend.
type Config struct {
	// Driver says where the CUDA libraries and headers are and which device
	// to open (see internal/cuda.Config; empty fields take their
	// environment variables, then the defaults).
	Driver drv.Config
	// StagingBytes is the size of each of the pinned host buffers that
	// Stage streams through (stageRing of them) and that a staged delta
	// (StageScatterBF16) goes through (two, each with a device buffer of
	// the size): default 8 MiB, at least minStagingBytes.
	StagingBytes int
}

// stageRing is how many pinned buffers Stage cycles through.
const stageRing = 8

// stageSlot is one of Stage's pinned buffers and the event after its last
// copy; busy while that copy may be in flight.
type stageSlot struct {
	buf  []byte
	ev   *drv.Event
	busy bool
}

// Backend is the CUDA implementation of kernels.Backend, with
// kernels.Capturer (CUDA graphs), kernels.Liveness and kernels.Stager.
//
// Every driver call runs on the device's owner thread through Device.Do;
// the mutable state below is touched only there, so Do's serialisation is
// its lock.
//
// Like every kernels.Backend it is driven by one goroutine. A capture in
// progress refuses memory operations and Sync from any goroutine, and the
// refusal fails that capture; Stage alone may come from another goroutine
// at any time (it waits for a capture to end).
type Backend struct {
	dev     *drv.Device
	log     *zap.Logger
	info    drv.Info
	staging int

	closeOnce sync.Once
	closeErr  error
	stageMu   sync.Mutex // one Stage at a time: they share the pinned buffers

	// Owner-thread state.
	stream *drv.Stream // every op and graph launch
	copyS  *drv.Stream // Stage's host-to-device copies, overlapping the ops
	// kernels holds every kernel the device runs, by registry key, with
	// its loaded function (New fills it; read-only after).
	kernels map[any]loadedKernel
	errw    drv.DevicePtr // the device error word (see errors.go)
	// sampleScr is the wide sampler's scratch (sampleScratch bytes, zeroed
	// once: each launch leaves its counters at zero).
	sampleScr drv.DevicePtr
	// fp4TileRows is the average rows per expert above which NVFP4 grouped
	// GEMMs run the tiled kernel (defaultTileRows; tests force either).
	fp4TileRows int
	// fp4Tile8Rows is the average rows per expert above which the tiled
	// kernel runs its 8-warp variant (defaultTile8Rows; tests force either).
	fp4Tile8Rows int
	// fp4WSRows is the average rows per expert above which the tiled
	// kernel is the warp-specialised wgmma one (defaultWSRows; only on
	// sm_90a, the one target with wgmma; tests force either).
	fp4WSRows int
	// fp4WS192Rows is the average rows per expert above which that kernel
	// takes 192-row tiles (defaultWS192Rows on sm_90a; tests force either).
	fp4WS192Rows int
	// pdl: launch the kernels the registry marks pdl with programmatic
	// stream serialization (always, but for TestPDLSameBits).
	pdl bool
	// streamJ is the n8 tiles a warp of a streamed 16-row-tile kernel
	// multiplies: 0 picks by the launch's size (streamFewBlocks), 1 or 2
	// force it (tests compare them).
	streamJ int
	// streamM8Rows is the average rows per expert at or below which NVFP4
	// streamed launches take 8-row tiles (streamPlan; tests force it).
	streamM8Rows int
	// narrow8 is the kernel for Gemms of at most gemmNarrow8M rows
	// (kGemmNarrow8; tests force kGemmNarrow, which gives the same bits).
	narrow8 plainKernel
	// sampleWide: Sample serves rows that keep every token (or greedy
	// ones) with the wide sampler (always, but for tests that compare it
	// with model_sample alone).
	sampleWide bool
	// denseTile, when set, is the tiled dense GEMM every tiled launch
	// takes (tests compare the variants); zero: planDenseTile picks.
	denseTile denseTileKernel
	pinned    [2][]byte
	events    [2]*drv.Event
	busy      [2]bool // a copy from pinned[i] may still be in flight
	// ring is Stage's pinned buffers, ringNext the next to fill (both
	// guarded by stageMu; a slot's busy flag and event are touched on the
	// owner thread, under stageMu).
	ring     [stageRing]stageSlot
	ringNext int
	// scratch[i] is the device copy of pinned[i] a staged delta's spans,
	// words and values are read from (StageScatterBF16); stageErr is the
	// error word of the kernels on the copy stream, read back through
	// stageErrHost (pinned).
	scratch      [2]drv.DevicePtr
	stageErr     drv.DevicePtr
	stageErrHost []byte
	cap          *capture
}

var (
	_ kernels.Backend  = (*Backend)(nil)
	_ kernels.Capturer = (*Backend)(nil)
	_ kernels.Liveness = (*Backend)(nil)
	_ kernels.Stager   = (*Backend)(nil)
)

// allocation owns one root buffer's device memory. Every buffer, root or
// view, carries its root's allocation as its kernels owner, so ownership,
// liveness and aliasing are exact: views of one allocation are compared
// with each other, views of different allocations never overlap.
type allocation struct {
	be   *Backend
	ptr  drv.DevicePtr
	size int
	// freed is set by Free on the owner thread. It is atomic so that Live
	// reads it on any goroutine without a round trip to the owner thread:
	// a graph replay checks every buffer it references, hundreds a step.
	freed atomic.Bool
}

// loadedKernel is a kernel's registry entry and its function.
type loadedKernel struct {
	spec *kernelSpec
	fn   *drv.Function
}

// New opens the device, compiles the embedded kernels with NVRTC for its
// architecture (or takes them from the cubin cache) and loads them. An error
// that means no usable GPU matches internal/cuda.ErrNoDevice. A nil logger
// discards logs.
func New(cfg Config, log *zap.Logger) (*Backend, error) {
	if log == nil {
		log = zap.NewNop()
	}
	if cfg.StagingBytes == 0 {
		cfg.StagingBytes = 8 << 20
	}
	if cfg.StagingBytes < minStagingBytes {
		return nil, fmt.Errorf("cuda backend: staging buffers of %d bytes: want at least %d (the largest delta span)", cfg.StagingBytes, minStagingBytes)
	}
	dev, err := drv.Open(cfg.Driver)
	if err != nil {
		return nil, err
	}
	be := &Backend{dev: dev, log: log, info: dev.Info(), staging: cfg.StagingBytes, kernels: make(map[any]loadedKernel),
		fp4TileRows: defaultTileRows, fp4Tile8Rows: defaultTile8Rows, fp4WSRows: math.MaxInt32, fp4WS192Rows: math.MaxInt32, pdl: true,
		streamM8Rows: defaultM8Rows, narrow8: kGemmNarrow8, sampleWide: true}
	if be.hasWGMMA() {
		be.fp4WSRows, be.fp4WS192Rows = defaultWSRows, defaultWS192Rows
	}
	progs, outs, err := compileKernels(dev, be.info.Arch, log)
	if err != nil {
		dev.Close()
		return nil, fmt.Errorf("cuda backend: %w", err)
	}
	err = dev.Do(func(c *drv.Ctx) error {
		for i, p := range progs {
			mod, err := c.LoadModule(outs[i].Cubin)
			if err != nil {
				return fmt.Errorf("load %s: %w", p.label, err)
			}
			for _, k := range p.kernels {
				f, err := mod.Function(outs[i].Lowered[k.expr])
				if err != nil {
					return fmt.Errorf("kernel %s (%s): %w", k.name, k.expr, err)
				}
				be.kernels[k.key] = loadedKernel{spec: k, fn: f}
			}
		}
		var err error
		if be.stream, err = c.NewStream(); err != nil {
			return err
		}
		if be.copyS, err = c.NewStream(); err != nil {
			return err
		}
		if be.errw, err = c.Alloc(errWordBytes); err != nil {
			return err
		}
		if err := c.Memset8(be.errw, 0, errWordBytes); err != nil {
			return err
		}
		if be.sampleScr, err = c.Alloc(sampleScratch); err != nil {
			return err
		}
		if err := c.Memset8(be.sampleScr, 0, sampleScratch); err != nil {
			return err
		}
		if be.stageErr, err = c.Alloc(errWordBytes); err != nil {
			return err
		}
		if err := c.Memset8(be.stageErr, 0, errWordBytes); err != nil {
			return err
		}
		if be.stageErrHost, err = c.HostAlloc(errWordBytes); err != nil {
			return err
		}
		for i := range be.ring {
			if be.ring[i].buf, err = c.HostAlloc(cfg.StagingBytes); err != nil {
				return err
			}
			if be.ring[i].ev, err = c.NewEvent(); err != nil {
				return err
			}
		}
		for i := range be.pinned {
			if be.pinned[i], err = c.HostAlloc(cfg.StagingBytes); err != nil {
				return err
			}
			if be.scratch[i], err = c.Alloc(cfg.StagingBytes); err != nil {
				return err
			}
			if be.events[i], err = c.NewEvent(); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		dev.Close()
		return nil, fmt.Errorf("cuda backend: %w", err)
	}
	log.Info("cuda backend ready", zap.String("device", be.info.Name), zap.String("arch", be.info.Arch),
		zap.Int("sms", be.info.SMs), zap.Int("kernels", len(be.kernels)))
	return be, nil
}

// Close waits for outstanding work and releases the device (every buffer,
// graph and module with it). It is idempotent.
func (be *Backend) Close() error {
	be.closeOnce.Do(func() { be.closeErr = be.dev.Close() })
	return be.closeErr
}

// Name returns "cuda".
func (be *Backend) Name() string { return "cuda" }

// Info describes the device.
func (be *Backend) Info() drv.Info { return be.info }

// hasWGMMA reports whether the kernels were built for sm_90a, the one
// target with wgmma (gemm_fp4_ws).
func (be *Backend) hasWGMMA() bool { return be.info.Arch == "sm_90a" }

// MemInfo returns the device's free and total memory in bytes.
func (be *Backend) MemInfo() (free, total int64, err error) {
	err = be.dev.Do(func(c *drv.Ctx) error {
		free, total, err = c.MemInfo()
		return err
	})
	return free, total, err
}

// ptr returns b's device address (0 for a nil buffer).
func ptr(b *kernels.Buffer) drv.DevicePtr {
	if b == nil {
		return 0
	}
	return drv.DevicePtr(b.Addr())
}

// own checks that b is a live buffer of this backend; name is for the error.
func (be *Backend) own(op, name string, b *kernels.Buffer) error {
	if b == nil {
		return fmt.Errorf("cuda: %s: %s is missing", op, name)
	}
	a, ok := b.Owner().(*allocation)
	if !ok || a.be != be {
		return fmt.Errorf("cuda: %s: %s %v: %w", op, name, b, kernels.ErrForeignBuffer)
	}
	if a.freed.Load() {
		return fmt.Errorf("cuda: %s: %s %v was freed", op, name, b)
	}
	return nil
}

// Alloc returns a zeroed buffer of its own device allocation.
func (be *Backend) Alloc(dt kernels.DType, shape ...int) (*kernels.Buffer, error) {
	size, err := kernels.SizeOf(dt, shape)
	if err != nil {
		return nil, fmt.Errorf("cuda: alloc: %w", err)
	}
	var b *kernels.Buffer
	err = be.dev.Do(func(c *drv.Ctx) error {
		if err := be.refuseInCapture("alloc"); err != nil {
			return err
		}
		p, err := c.Alloc(max(size, 1)) // every buffer has an address
		if err != nil {
			return err
		}
		if err := c.Memset8(p, 0, max(size, 1)); err != nil {
			c.Free(p)
			return err
		}
		a := &allocation{be: be, ptr: p, size: size}
		if b, err = kernels.NewDeviceBuffer(a, dt, shape, uintptr(p)); err != nil {
			c.Free(p)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: alloc %s%v: %w", dt, shape, err)
	}
	return b, nil
}

// Free releases a buffer from Alloc. Views cannot be freed.
func (be *Backend) Free(b *kernels.Buffer) error {
	return be.dev.Do(func(c *drv.Ctx) error {
		if err := be.refuseInCapture("free"); err != nil {
			return err
		}
		if err := be.own("free", "buffer", b); err != nil {
			return err
		}
		a := b.Owner().(*allocation)
		if drv.DevicePtr(b.Addr()) != a.ptr || b.Size() != a.size {
			return fmt.Errorf("cuda: free %v: a view, not a buffer from Alloc", b)
		}
		if err := c.Free(a.ptr); err != nil {
			return fmt.Errorf("cuda: free %v: %w", b, err)
		}
		a.freed.Store(true)
		return nil
	})
}

// Live reports whether b is a buffer, or a view of one, of this backend
// whose allocation has not been freed.
func (be *Backend) Live(b *kernels.Buffer) bool {
	if b == nil {
		return false
	}
	a, ok := b.Owner().(*allocation)
	if !ok || a.be != be {
		return false
	}
	return !a.freed.Load()
}

// span checks that [off, off+n) lies inside b.
func span(op string, b *kernels.Buffer, off, n int) error {
	if off < 0 || n < 0 || off+n > b.Size() {
		return fmt.Errorf("cuda: %s: %d bytes at offset %d of %v (%d bytes)", op, n, off, b, b.Size())
	}
	return nil
}

// Upload copies src into dst at byte offset off. It is ordered after every
// op issued before it.
func (be *Backend) Upload(dst *kernels.Buffer, off int, src []byte) error {
	return be.dev.Do(func(c *drv.Ctx) error {
		if err := be.refuseInCapture("upload"); err != nil {
			return err
		}
		if err := be.own("upload", "dst", dst); err != nil {
			return err
		}
		if err := span("upload", dst, off, len(src)); err != nil {
			return err
		}
		return c.HtoD(ptr(dst).Add(off), src)
	})
}

// Download copies len(dst) bytes of src from byte offset off, after every
// op issued before it has finished.
func (be *Backend) Download(dst []byte, src *kernels.Buffer, off int) error {
	return be.dev.Do(func(c *drv.Ctx) error {
		if err := be.refuseInCapture("download"); err != nil {
			return err
		}
		if err := be.own("download", "src", src); err != nil {
			return err
		}
		if err := span("download", src, off, len(dst)); err != nil {
			return err
		}
		return c.DtoH(dst, ptr(src).Add(off))
	})
}

// Copy copies src into dst; both must have the same size in bytes.
func (be *Backend) Copy(dst, src *kernels.Buffer) error {
	return be.dev.Do(func(c *drv.Ctx) error {
		if err := be.refuseInCapture("copy"); err != nil {
			return err
		}
		if err := be.own("copy", "dst", dst); err != nil {
			return err
		}
		if err := be.own("copy", "src", src); err != nil {
			return err
		}
		if dst.Size() != src.Size() {
			return fmt.Errorf("cuda: copy: %v (%d bytes) into %v (%d bytes)", src, src.Size(), dst, dst.Size())
		}
		return c.DtoD(ptr(dst), ptr(src), dst.Size())
	})
}

// CopyAll copies src[i] into dst[i] on the compute stream, every pair
// checked first, in one call to the owner thread (kernels.BatchCopier).
func (be *Backend) CopyAll(dst, src []*kernels.Buffer) error {
	if len(dst) != len(src) {
		return fmt.Errorf("cuda: copy all: %d destinations for %d sources", len(dst), len(src))
	}
	return be.dev.Do(func(c *drv.Ctx) error {
		if err := be.refuseInCapture("copy all"); err != nil {
			return err
		}
		for i := range dst {
			if err := be.own("copy all", "dst", dst[i]); err != nil {
				return err
			}
			if err := be.own("copy all", "src", src[i]); err != nil {
				return err
			}
			if dst[i].Size() != src[i].Size() {
				return fmt.Errorf("cuda: copy all: pair %d: %v (%d bytes) into %v (%d bytes)", i, src[i], src[i].Size(), dst[i], dst[i].Size())
			}
		}
		for i := range dst {
			if err := c.DtoDAsync(ptr(dst[i]), ptr(src[i]), dst[i].Size(), be.stream); err != nil {
				return fmt.Errorf("cuda: copy all: pair %d: %w", i, err)
			}
		}
		return nil
	})
}

// Zero clears dst.
func (be *Backend) Zero(dst *kernels.Buffer) error {
	return be.dev.Do(func(c *drv.Ctx) error {
		if err := be.refuseInCapture("zero"); err != nil {
			return err
		}
		if err := be.own("zero", "dst", dst); err != nil {
			return err
		}
		return c.Memset8(ptr(dst), 0, dst.Size())
	})
}

// Sync waits for every enqueued op and reports (and clears) the first index
// error a kernel recorded since the last Sync.
func (be *Backend) Sync() error {
	return be.dev.Do(func(c *drv.Ctx) error {
		if err := be.refuseInCapture("sync"); err != nil {
			return err
		}
		if err := be.stream.Sync(); err != nil {
			return err
		}
		return be.takeError(c)
	})
}

// Stage copies src into dst at byte offset off through a ring of pinned
// buffers (stageRing of them) on the copy stream, so the transfer overlaps
// the ops on the compute stream and the next Stage's copy into the next
// buffer. It may be called from any goroutine, is never captured, and
// returns once src may be reused: the copy to the device may still be in
// flight until StageSync. Each slice takes one call to the owner thread,
// which issues the copy and makes sure the next buffer's earlier copy (a
// ring ago) is done.
func (be *Backend) Stage(dst *kernels.Buffer, off int, src []byte) error {
	be.stageMu.Lock()
	defer be.stageMu.Unlock()
	if dst == nil {
		return errors.New("cuda: stage: dst is missing")
	}
	if a, ok := dst.Owner().(*allocation); !ok || a.be != be {
		return fmt.Errorf("cuda: stage: dst %v: %w", dst, kernels.ErrForeignBuffer)
	}
	if err := span("stage", dst, off, len(src)); err != nil {
		return err
	}
	for len(src) > 0 {
		n := min(len(src), be.staging)
		i := be.ringNext
		sl, next := &be.ring[i], &be.ring[(i+1)%len(be.ring)]
		// The owner thread never reads sl.buf while it is not busy; sl is
		// busy here only when the last issue could not free it.
		if sl.busy {
			if err := be.outsideCapture(func(*drv.Ctx) error {
				sl.busy = false
				return sl.ev.Sync()
			}); err != nil {
				return fmt.Errorf("cuda: stage: %w", err)
			}
		}
		copy(sl.buf, src[:n])
		to := ptr(dst).Add(off)
		if err := be.outsideCapture(func(c *drv.Ctx) error {
			if err := be.own("stage", "dst", dst); err != nil {
				return err
			}
			if err := c.HtoDAsync(to, sl.buf[:n], be.copyS); err != nil {
				return err
			}
			sl.busy = true
			if err := sl.ev.Record(be.copyS); err != nil {
				return err
			}
			if next.busy { // a ring ago: done but for a backlog on the link
				next.busy = false
				return next.ev.Sync()
			}
			return nil
		}); err != nil {
			return fmt.Errorf("cuda: stage: %w", err)
		}
		be.ringNext = (i + 1) % len(be.ring)
		src, off = src[n:], off+n
	}
	return nil
}

// StageSync waits for every Stage copy so far (the whole copy stream).
func (be *Backend) StageSync() error {
	be.stageMu.Lock()
	defer be.stageMu.Unlock()
	return be.outsideCapture(func(*drv.Ctx) error {
		if err := be.copyS.Sync(); err != nil {
			return fmt.Errorf("cuda: stage sync: %w", err)
		}
		for i := range be.ring {
			be.ring[i].busy = false
		}
		return nil
	})
}

// outsideCapture runs fn on the owner thread when no stream capture is in
// progress. Stage comes from the refit goroutine at any moment, and its
// copies, event records and event waits on the owner thread must not fall
// between BeginCapture and EndCapture of the engine's goroutine (the
// driver may invalidate a thread-local capture over them); a capture lasts
// one step's op issue, so waiting for it is short.
func (be *Backend) outsideCapture(fn func(*drv.Ctx) error) error {
	for {
		capturing := false
		err := be.dev.Do(func(c *drv.Ctx) error {
			if be.cap != nil {
				capturing = true
				return nil
			}
			return fn(c)
		})
		if !capturing {
			return err
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// Time enqueues fn's work n times between two events on the compute stream
// and returns the device time per call, measured by the events (no host
// gaps counted). fn must only issue ops or launch graphs on this backend.
func (be *Backend) Time(n int, fn func() error) (time.Duration, error) {
	if n < 1 {
		return 0, fmt.Errorf("cuda: time: %d calls", n)
	}
	var start, end *drv.Event
	err := be.dev.Do(func(c *drv.Ctx) error {
		var err error
		if start, err = c.NewEvent(); err != nil {
			return err
		}
		if end, err = c.NewEvent(); err != nil {
			return err
		}
		return start.Record(be.stream)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: time: %w", err)
	}
	defer be.dev.Do(func(*drv.Ctx) error { return errors.Join(start.Destroy(), end.Destroy()) })
	for range n {
		if err := fn(); err != nil {
			return 0, err
		}
	}
	var d time.Duration
	err = be.dev.Do(func(c *drv.Ctx) error {
		if err := end.Record(be.stream); err != nil {
			return err
		}
		if err := end.Sync(); err != nil {
			return err
		}
		var err error
		d, err = c.Elapsed(start, end)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: time: %w", err)
	}
	return d / time.Duration(n), nil
}
