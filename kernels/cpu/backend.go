package cpu

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// Config configures the CPU backend.
type Config struct {
	// Workers is the number of goroutines an op fans out to; 0 means
	// runtime.GOMAXPROCS(0).
	Workers int
}

// Backend is the CPU implementation of kernels.Backend.
type Backend struct {
	workers int
	log     *zap.Logger

	mu    sync.Mutex
	live  map[uintptr]*kernels.Buffer // root buffers from Alloc, by address
	spans []span                      // the same roots, sorted by address (views find their root here)
	freed freedSet                    // roots given to Free, so that a freed root never counts as a view
	rec   *recording                  // the capture in progress, nil when not capturing

	scratch sync.Pool // *[]float32: rows that operands are decoded into
	fp4     [256][2]float32
}

var (
	_ kernels.Backend  = (*Backend)(nil)
	_ kernels.Capturer = (*Backend)(nil)
	_ kernels.Liveness = (*Backend)(nil)
)

// New returns a CPU backend. A nil logger discards logs.
func New(cfg Config, log *zap.Logger) (*Backend, error) {
	if cfg.Workers < 0 {
		return nil, fmt.Errorf("cpu: workers %d < 0", cfg.Workers)
	}
	if cfg.Workers == 0 {
		cfg.Workers = runtime.GOMAXPROCS(0)
	}
	if log == nil {
		log = zap.NewNop()
	}
	be := &Backend{workers: cfg.Workers, log: log, live: make(map[uintptr]*kernels.Buffer)}
	be.scratch.New = func() any { return new([]float32) }
	for b := range be.fp4 {
		be.fp4[b] = [2]float32{nvfp4.E2M1Decode(uint8(b)), nvfp4.E2M1Decode(uint8(b) >> 4)}
	}
	log.Debug("cpu backend ready", zap.Int("workers", cfg.Workers))
	return be, nil
}

// getScratch returns a pooled float32 slice of length n; putScratch returns it.
func (be *Backend) getScratch(n int) *[]float32 {
	p := be.scratch.Get().(*[]float32)
	if cap(*p) < n {
		*p = make([]float32, n)
	}
	*p = (*p)[:n]
	return p
}

func (be *Backend) putScratch(p *[]float32) { be.scratch.Put(p) }

// Name returns "cpu".
func (be *Backend) Name() string { return "cpu" }

// Alloc returns a zeroed, 8-byte aligned buffer.
func (be *Backend) Alloc(dt kernels.DType, shape ...int) (*kernels.Buffer, error) {
	if err := be.refuseInCapture("alloc"); err != nil {
		return nil, err
	}
	size, err := kernels.SizeOf(dt, shape)
	if err != nil {
		return nil, fmt.Errorf("cpu: alloc: %w", err)
	}
	words := make([]uint64, max(1, (size+7)/8)) // never empty: every buffer has an address
	mem := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(words))), len(words)*8)[:size:size]
	b, err := kernels.NewHostBuffer(be, dt, shape, mem, uintptr(unsafe.Pointer(unsafe.SliceData(words))))
	if err != nil {
		return nil, fmt.Errorf("cpu: alloc: %w", err)
	}
	be.register(b)
	return b, nil
}

// Free releases a buffer from Alloc.
func (be *Backend) Free(b *kernels.Buffer) error {
	be.mu.Lock()
	defer be.mu.Unlock()
	if err := be.refuseLocked("free"); err != nil {
		return err
	}
	if b == nil || be.live[b.Addr()] != b {
		return fmt.Errorf("cpu: free %v: not a live buffer of this backend", b)
	}
	be.unregisterLocked(b)
	return nil
}

// Sync returns nil: CPU ops complete before they return.
func (be *Backend) Sync() error { return be.refuseInCapture("sync") }

// Upload copies src into dst at byte offset off.
func (be *Backend) Upload(dst *kernels.Buffer, off int, src []byte) error {
	if err := be.refuseInCapture("upload"); err != nil {
		return err
	}
	h, err := be.host("upload", "dst", dst)
	if err != nil {
		return err
	}
	if off < 0 || off+len(src) > len(h) {
		return fmt.Errorf("cpu: upload: %d bytes at offset %d into %v (%d bytes)", len(src), off, dst, len(h))
	}
	copy(h[off:], src)
	return nil
}

// Download copies len(dst) bytes of src from byte offset off.
func (be *Backend) Download(dst []byte, src *kernels.Buffer, off int) error {
	if err := be.refuseInCapture("download"); err != nil {
		return err
	}
	h, err := be.host("download", "src", src)
	if err != nil {
		return err
	}
	if off < 0 || off+len(dst) > len(h) {
		return fmt.Errorf("cpu: download: %d bytes at offset %d from %v (%d bytes)", len(dst), off, src, len(h))
	}
	copy(dst, h[off:])
	return nil
}

// Copy copies src into dst.
func (be *Backend) Copy(dst, src *kernels.Buffer) error {
	if err := be.refuseInCapture("copy"); err != nil {
		return err
	}
	d, err := be.host("copy", "dst", dst)
	if err != nil {
		return err
	}
	s, err := be.host("copy", "src", src)
	if err != nil {
		return err
	}
	if len(d) != len(s) {
		return fmt.Errorf("cpu: copy: %v (%d bytes) into %v (%d bytes)", src, len(s), dst, len(d))
	}
	copy(d, s)
	return nil
}

// Zero clears dst.
func (be *Backend) Zero(dst *kernels.Buffer) error {
	if err := be.refuseInCapture("zero"); err != nil {
		return err
	}
	h, err := be.host("zero", "dst", dst)
	if err != nil {
		return err
	}
	clear(h)
	return nil
}

// host returns b's storage after checking that this backend owns it.
func (be *Backend) host(op, name string, b *kernels.Buffer) ([]byte, error) {
	if b == nil {
		return nil, fmt.Errorf("cpu: %s: %s is missing", op, name)
	}
	if b.Owner() != be || (b.Host() == nil && b.Size() > 0) {
		return nil, fmt.Errorf("cpu: %s: %s %v: %w", op, name, b, kernels.ErrForeignBuffer)
	}
	return b.Host(), nil
}

func (be *Backend) owns(op string, bufs map[string]*kernels.Buffer) error {
	for name, b := range bufs {
		if b == nil {
			continue
		}
		if _, err := be.host(op, name, b); err != nil {
			return err
		}
	}
	return nil
}

// Typed views of host storage. Alloc aligns to 8 bytes and views keep
// element alignment, so the casts are sound.
func u16s(b *kernels.Buffer) []uint16 {
	h := b.Host()
	return unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(h))), len(h)/2)
}

func f32s(b *kernels.Buffer) []float32 {
	h := b.Host()
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(h))), len(h)/4)
}

func i32s(b *kernels.Buffer) []int32 {
	h := b.Host()
	return unsafe.Slice((*int32)(unsafe.Pointer(unsafe.SliceData(h))), len(h)/4)
}

// parallel runs fn(i) for every i in [0, n) on up to be.workers goroutines,
// handing out items dynamically (expert groups are uneven). All goroutines
// are joined before it returns.
func (be *Backend) parallel(n int, fn func(i int)) {
	w := min(be.workers, n)
	if w <= 1 {
		for i := range n {
			fn(i)
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for range w {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				fn(i)
			}
		})
	}
	wg.Wait()
}

var _ kernels.Stager = (*Backend)(nil)

// Stage copies src into dst at byte offset off. Unlike Upload it may be
// called from any goroutine and is never captured (see kernels.Stager).
// StageSync returns at once: Stage copies before it returns.
func (be *Backend) StageSync() error { return nil }

// StageAmax writes each matrix's largest |value| of src into dst at once
// (kernels.AmaxStager).
func (be *Backend) StageAmax(dst, src *kernels.Buffer) error {
	mats, per, err := kernels.ValidateAmax(dst, src)
	if err != nil {
		return fmt.Errorf("cpu: %w", err)
	}
	for _, b := range []*kernels.Buffer{dst, src} {
		if b.Owner() != be || (b.Host() == nil && b.Size() > 0) {
			return fmt.Errorf("cpu: stage amax: %v: %w", b, kernels.ErrForeignBuffer)
		}
	}
	vals, out := u16s(src), f32s(dst)
	for m := range mats {
		out[m] = nvfp4.AmaxBF16(vals[m*per : (m+1)*per])
	}
	return nil
}

func (be *Backend) Stage(dst *kernels.Buffer, off int, src []byte) error {
	if dst == nil || dst.Owner() != be || (dst.Host() == nil && dst.Size() > 0) {
		return fmt.Errorf("cpu: stage: dst %v: %w", dst, kernels.ErrForeignBuffer)
	}
	h := dst.Host()
	if off < 0 || off+len(src) > len(h) {
		return fmt.Errorf("cpu: stage: %d bytes at offset %d into %v (%d bytes)", len(src), off, dst, len(h))
	}
	copy(h[off:], src)
	return nil
}
