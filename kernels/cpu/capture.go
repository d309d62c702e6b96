package cpu

import (
	"errors"
	"fmt"
	"slices"
	"weak"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// Capture (kernels.Capturer) and liveness (kernels.Liveness) on the CPU.
//
// Every op is split in two: a prep method (prepGemm, prepRoute, ...) that
// checks what the op can check at call time (shapes, dtypes, ownership,
// aliasing: everything a device backend checks before it enqueues) and
// returns a closure, the run, that does the rest: the data-dependent checks
// (indices read from buffers) and the arithmetic. The exported op hands both
// to issue, which runs the closure at once, or, while capturing, records it
// with the op's name and operands. A graph is the list of recorded runs;
// Launch calls them in order. So a replay does exactly what the direct call
// would have done with the buffers' contents at that moment: the same code,
// the same operands, the same bits.
//
// As inside CUDA stream capture, memory operations and Sync are refused with
// kernels.ErrCapturing while capturing, and the refusal, like an op's
// validation error, poisons the capture: EndCapture returns the first such
// error and no graph, because the recorded sequence is not the one the
// caller meant to issue.

// recording is the capture in progress.
type recording struct {
	ops []recordedOp
	err error // the first error of the capture, returned by EndCapture
}

// recordedOp is one captured op: its name, operands (walked for buffers at
// EndCapture) and the closure that runs it.
type recordedOp struct {
	name string
	args any
	run  func() error
}

// gemmArgs are Gemm's operands, as one value for issue and Buffers.
type gemmArgs struct {
	Dst, A, W *kernels.Buffer
}

// issue validates an op through prep and then runs it, or records it while
// a capture is in progress. A validation error is returned either way, and
// during capture it is also remembered for EndCapture.
func issue[A any](be *Backend, op string, args A, prep func(A) (func() error, error)) error {
	run, err := prep(args)
	be.mu.Lock()
	if rec := be.rec; rec != nil {
		defer be.mu.Unlock()
		if err != nil {
			rec.fail(len(rec.ops), op, err)
			return err
		}
		rec.ops = append(rec.ops, recordedOp{name: op, args: args, run: run})
		return nil
	}
	be.mu.Unlock()
	if err != nil {
		return err
	}
	return run()
}

// fail remembers the first error of a capture, with the op that caused it.
func (r *recording) fail(i int, op string, err error) {
	if r.err == nil {
		r.err = fmt.Errorf("op %d (%s): %w", i, op, err)
	}
}

// refuseInCapture returns kernels.ErrCapturing, wrapped with op, while a
// capture is in progress, and poisons that capture.
func (be *Backend) refuseInCapture(op string) error {
	be.mu.Lock()
	defer be.mu.Unlock()
	return be.refuseLocked(op)
}

// refuseLocked is refuseInCapture with be.mu held.
func (be *Backend) refuseLocked(op string) error {
	if be.rec == nil {
		return nil
	}
	err := fmt.Errorf("cpu: %s: %w", op, kernels.ErrCapturing)
	be.rec.fail(len(be.rec.ops), op, err)
	return err
}

// BeginCapture starts recording: until EndCapture, ops are validated and
// recorded instead of run. A capture already in progress is an error (and
// is left as it was).
func (be *Backend) BeginCapture() error {
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.rec != nil {
		return errors.New("cpu: begin capture: a capture is already in progress")
	}
	be.rec = &recording{}
	return nil
}

// EndCapture stops recording and returns the graph of the recorded ops. If
// any op failed validation, or a memory operation or Sync was refused, during
// the capture, it returns that error and no graph; either way the backend is
// no longer capturing. Without a BeginCapture it is an error.
func (be *Backend) EndCapture() (kernels.Graph, error) {
	be.mu.Lock()
	rec := be.rec
	be.rec = nil
	be.mu.Unlock()
	if rec == nil {
		return nil, errors.New("cpu: end capture: no capture in progress")
	}
	if rec.err != nil {
		return nil, fmt.Errorf("cpu: end capture: %w", rec.err)
	}
	g := &graph{be: be, ops: rec.ops}
	seen := make(map[*kernels.Buffer]bool)
	for _, op := range rec.ops {
		g.bufs = kernels.AppendBuffers(g.bufs, seen, op.args)
	}
	return g, nil
}

// graph is a captured op sequence of the CPU backend.
type graph struct {
	be        *Backend
	ops       []recordedOp
	bufs      []*kernels.Buffer
	destroyed bool // guarded by be.mu
}

// Launch runs the recorded ops in order, each with the contents its buffers
// hold now. It refuses to run if any referenced buffer is no longer live (a
// device would read or write freed memory), after Destroy, or while a
// capture is in progress (kernels.ErrCapturing; that capture then fails). A data-dependent error (an index out of range) stops the
// launch at that op and names it; the ops before it have run.
func (g *graph) Launch() error {
	be := g.be
	be.mu.Lock()
	switch {
	case g.destroyed:
		be.mu.Unlock()
		return errors.New("cpu: graph launch: the graph was destroyed")
	case be.rec != nil: // refused, like a memory op, and the capture poisoned
		err := be.refuseLocked("graph launch")
		be.mu.Unlock()
		return err
	}
	for _, b := range g.bufs {
		if !be.liveLocked(b) {
			be.mu.Unlock()
			return fmt.Errorf("cpu: graph launch: buffer %v is no longer live", b)
		}
	}
	be.mu.Unlock()
	for i, op := range g.ops {
		if err := op.run(); err != nil {
			return fmt.Errorf("cpu: graph launch: op %d (%s): %w", i, op.name, err)
		}
	}
	return nil
}

// Buffers returns every buffer the recorded ops reference, each once, in
// the order the ops first name them. Views are listed as the views they are.
func (g *graph) Buffers() []*kernels.Buffer { return slices.Clone(g.bufs) }

// Destroy releases the recorded ops. It is idempotent.
func (g *graph) Destroy() error {
	g.be.mu.Lock()
	defer g.be.mu.Unlock()
	g.destroyed = true
	g.ops, g.bufs = nil, nil
	return nil
}

// Liveness.
//
// A root buffer is live while be.live maps its address to it: the pointer,
// not just the address, so a root that was freed and whose address a later
// Alloc reused is not live. A view is live while a live root contains it.
// On this backend a view keeps its root's memory reachable, so no later
// allocation can overlap a view of a freed root; the one ambiguity left, a
// freed root whose exact range a new root now covers, is what freed
// resolves.

// span is the address range of a live root buffer.
type span struct {
	lo, hi uintptr // [lo, hi)
	b      *kernels.Buffer
}

// freedSet holds weak pointers to roots given to Free. A weak pointer
// compares equal to another made from the same live pointer, and does not
// keep the buffer's memory alive.
type freedSet struct {
	m     map[weak.Pointer[kernels.Buffer]]struct{}
	prune int // prune collected entries when len(m) reaches this
}

func (f *freedSet) add(b *kernels.Buffer) {
	if f.m == nil {
		f.m = make(map[weak.Pointer[kernels.Buffer]]struct{})
	}
	f.m[weak.Make(b)] = struct{}{}
	if len(f.m) >= max(f.prune, 64) {
		for w := range f.m {
			if w.Value() == nil {
				delete(f.m, w)
			}
		}
		f.prune = 2 * len(f.m)
	}
}

func (f *freedSet) has(b *kernels.Buffer) bool {
	if len(f.m) == 0 { // the usual case: memory is planned once, nothing freed
		return false
	}
	_, ok := f.m[weak.Make(b)]
	return ok
}

// register records a new root from Alloc.
func (be *Backend) register(b *kernels.Buffer) {
	be.mu.Lock()
	defer be.mu.Unlock()
	be.live[b.Addr()] = b
	s := span{lo: b.Addr(), hi: b.Addr() + uintptr(b.Size()), b: b}
	i, _ := slices.BinarySearchFunc(be.spans, s.lo, func(s span, a uintptr) int { return cmpAddr(s.lo, a) })
	be.spans = slices.Insert(be.spans, i, s)
}

// unregisterLocked forgets a root given to Free; be.mu is held.
func (be *Backend) unregisterLocked(b *kernels.Buffer) {
	delete(be.live, b.Addr())
	if i, ok := slices.BinarySearchFunc(be.spans, b.Addr(), func(s span, a uintptr) int { return cmpAddr(s.lo, a) }); ok && be.spans[i].b == b {
		be.spans = slices.Delete(be.spans, i, i+1)
	}
	be.freed.add(b)
}

func cmpAddr(a, b uintptr) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Live reports whether b is a buffer of this backend that is still
// allocated as it was: a root from Alloc with no Free since, or a view of
// one.
func (be *Backend) Live(b *kernels.Buffer) bool {
	be.mu.Lock()
	defer be.mu.Unlock()
	return be.liveLocked(b)
}

func (be *Backend) liveLocked(b *kernels.Buffer) bool {
	if b == nil || b.Owner() != be {
		return false
	}
	if be.live[b.Addr()] == b {
		return true
	}
	// A view: the last root starting at or below its address must contain
	// it, and it must not be a freed root whose range a new root covers.
	i, ok := slices.BinarySearchFunc(be.spans, b.Addr(), func(s span, a uintptr) int { return cmpAddr(s.lo, a) })
	if !ok {
		i--
	}
	if i < 0 {
		return false
	}
	s := be.spans[i]
	return b.Addr() >= s.lo && b.Addr()+uintptr(b.Size()) <= s.hi && !be.freed.has(b)
}
