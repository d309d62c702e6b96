package cuda

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// CUDA graphs (kernels.Capturer). BeginCapture starts stream capture on
// the compute stream; ops issued until EndCapture are validated as usual
// and recorded by the driver instead of run. Memory operations and Sync
// are refused with kernels.ErrCapturing, and a refusal or an op's
// validation error poisons the capture: EndCapture then returns that error
// and no graph, as the CPU backend does.

// capture is the capture in progress (owner thread only).
type capture struct {
	ops  int
	bufs []*kernels.Buffer
	seen map[*kernels.Buffer]bool
	err  error
}

func (cp *capture) fail(op string, err error) {
	if cp.err == nil {
		cp.err = fmt.Errorf("op %d (%s): %w", cp.ops, op, err)
	}
}

// refuseInCapture returns kernels.ErrCapturing while a capture is in
// progress, and poisons it (owner thread).
func (be *Backend) refuseInCapture(op string) error {
	if be.cap == nil {
		return nil
	}
	err := fmt.Errorf("cuda: %s: %w", op, kernels.ErrCapturing)
	be.cap.fail(op, err)
	return err
}

// issue runs one op: validate (shapes, dtypes, aliasing) on the caller's
// goroutine, then on the owner thread the ownership of every buffer in args
// and enqueue. While capturing, it records args' buffers for the graph, and
// an error poisons the capture.
func (be *Backend) issue(op string, args any, validate func() error, enqueue func(c *drv.Ctx) error) error {
	err := validate()
	return be.dev.Do(func(c *drv.Ctx) error {
		if err == nil {
			for _, b := range kernels.AppendBuffers(nil, map[*kernels.Buffer]bool{}, args) {
				if err = be.own(op, "operand", b); err != nil {
					break
				}
			}
		}
		if err == nil {
			err = enqueue(c)
		}
		if cp := be.cap; cp != nil {
			if err != nil {
				cp.fail(op, err)
				return err
			}
			cp.bufs = kernels.AppendBuffers(cp.bufs, cp.seen, args)
			cp.ops++
		}
		return err
	})
}

// launch enqueues the kernel the registry keys by key on the compute
// stream (owner thread), after checking the launch against its entry.
func (be *Backend) launch(key any, grid, block drv.Dim3, shared int, args ...any) error {
	return be.launchOn(be.stream, key, grid, block, shared, args...)
}

// launchOn is launch on stream s (the copy stream, for staged work).
func (be *Backend) launchOn(s *drv.Stream, key any, grid, block drv.Dim3, shared int, args ...any) error {
	k, ok := be.kernels[key]
	if !ok {
		return fmt.Errorf("cuda: launch %v: no such kernel loaded for %s", key, be.info.Arch)
	}
	if err := k.spec.check(be.info.Arch, grid, block, shared, be.info.SharedOptin); err != nil {
		return err
	}
	// Past 48 KiB of shared memory a block needs the kernel's opt-in, and
	// its static arrays (a few KiB) count too: opt in from 32 KiB of
	// dynamic shared memory.
	if shared > 32<<10 {
		if err := k.fn.SetMaxDynamicShared(shared); err != nil {
			return fmt.Errorf("cuda: launch %s: %w", k.spec.name, err)
		}
	}
	if be.pdl && k.spec.pdl {
		return k.fn.LaunchPDL(grid, block, shared, s, args...)
	}
	return k.fn.Launch(grid, block, shared, s, args...)
}

// BeginCapture starts recording the ops issued on this backend into a CUDA
// graph.
func (be *Backend) BeginCapture() error {
	return be.dev.Do(func(*drv.Ctx) error {
		if be.cap != nil {
			return errors.New("cuda: begin capture: a capture is already in progress")
		}
		if err := be.stream.BeginCapture(); err != nil {
			return fmt.Errorf("cuda: begin capture: %w", err)
		}
		be.cap = &capture{seen: make(map[*kernels.Buffer]bool)}
		return nil
	})
}

// EndCapture stops recording and returns the instantiated graph, or the
// first error of the capture and no graph.
func (be *Backend) EndCapture() (kernels.Graph, error) {
	var g *graph
	err := be.dev.Do(func(*drv.Ctx) error {
		cp := be.cap
		if cp == nil {
			return errors.New("cuda: end capture: no capture in progress")
		}
		be.cap = nil
		dg, err := be.stream.EndCapture()
		if cp.err != nil {
			if dg != nil {
				dg.Destroy()
			}
			return fmt.Errorf("cuda: end capture: %w", cp.err)
		}
		if err != nil {
			return fmt.Errorf("cuda: end capture: %w", err)
		}
		g = &graph{be: be, g: dg, bufs: cp.bufs}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return g, nil
}

// graph is an instantiated CUDA graph with the buffers its ops reference.
type graph struct {
	be   *Backend
	g    *drv.Graph
	bufs []*kernels.Buffer

	mu        sync.Mutex
	destroyed bool
}

// Launch enqueues the graph on the compute stream. It refuses to run if any
// buffer it references was freed (the kernels would touch freed memory),
// after Destroy, or while a capture is in progress.
func (g *graph) Launch() error {
	return g.be.dev.Do(func(*drv.Ctx) error {
		if err := g.be.refuseInCapture("graph launch"); err != nil {
			return err
		}
		g.mu.Lock()
		destroyed := g.destroyed
		g.mu.Unlock()
		if destroyed {
			return errors.New("cuda: graph launch: the graph was destroyed")
		}
		for _, b := range g.bufs {
			if a := b.Owner().(*allocation); a.freed.Load() {
				return fmt.Errorf("cuda: graph launch: buffer %v is no longer live", b)
			}
		}
		if err := g.g.Launch(g.be.stream); err != nil {
			return fmt.Errorf("cuda: graph launch: %w", err)
		}
		return nil
	})
}

// Buffers returns every buffer the captured ops reference, each once.
func (g *graph) Buffers() []*kernels.Buffer { return slices.Clone(g.bufs) }

// Destroy releases the graph. It is idempotent.
func (g *graph) Destroy() error {
	g.mu.Lock()
	if g.destroyed {
		g.mu.Unlock()
		return nil
	}
	g.destroyed = true
	g.mu.Unlock()
	return g.be.dev.Do(func(*drv.Ctx) error { return g.g.Destroy() })
}
