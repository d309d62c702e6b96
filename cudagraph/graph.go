package cudagraph

import (
	"errors"
	"fmt"
	"slices"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// Sentinel errors.
var (
	// ErrUnsupported is returned for a backend that does not implement
	// kernels.Capturer.
	ErrUnsupported = errors.New("cudagraph: backend cannot capture graphs")
	// ErrStale is returned when a buffer a graph references is no longer
	// allocated as it was at capture: freed, or freed and allocated again.
	ErrStale = errors.New("cudagraph: buffer is no longer live")
)

// BufferRef is one entry of a graph's buffer registry: a buffer its ops
// reference, with the address and size it had at capture.
type BufferRef struct {
	Addr uintptr
	Size int
	Buf  *kernels.Buffer
}

// Graph is a captured step with the registry of the buffers it references.
type Graph struct {
	g    kernels.Graph    // nil once destroyed
	live kernels.Liveness // nil when the backend cannot tell
	refs []BufferRef      // every buffer the ops reference
}

// Capture records step as a graph: it begins a capture on be, calls step
// (which issues ops on be) and ends the capture. The ops are validated and
// recorded, not run; use Replay to run them. A backend that does not
// implement kernels.Capturer gets ErrUnsupported.
//
// If step returns an error, or an op in it fails validation, Capture
// returns that error and no graph. The capture is ended in every case, even
// if step panics. A buffer that is already stale at capture is an error
// wrapping ErrStale.
func Capture(be kernels.Backend, step func() error) (*Graph, error) {
	c, ok := be.(kernels.Capturer)
	if !ok {
		return nil, fmt.Errorf("cudagraph: capture on %s: %w", be.Name(), ErrUnsupported)
	}
	if step == nil {
		return nil, errors.New("cudagraph: capture: nil step")
	}
	if err := c.BeginCapture(); err != nil {
		return nil, fmt.Errorf("cudagraph: capture: %w", err)
	}
	ended := false
	defer func() { // step panicked: leave capture mode, drop the partial graph
		if !ended {
			if g, err := c.EndCapture(); err == nil {
				_ = g.Destroy()
			}
		}
	}()
	stepErr := step()
	kg, endErr := c.EndCapture()
	ended = true
	if stepErr != nil || endErr != nil {
		if kg != nil {
			_ = kg.Destroy()
		}
		if stepErr != nil {
			// An op's error is in both; report it once.
			return nil, fmt.Errorf("cudagraph: capture: %w", stepErr)
		}
		return nil, fmt.Errorf("cudagraph: capture: %w", endErr)
	}
	g := &Graph{g: kg}
	g.live, _ = be.(kernels.Liveness)
	for _, b := range kg.Buffers() {
		g.refs = append(g.refs, BufferRef{Addr: b.Addr(), Size: b.Size(), Buf: b})
	}
	if err := g.check("capture"); err != nil {
		_ = kg.Destroy()
		return nil, err
	}
	return g, nil
}

// Buffers returns the graph's buffer registry: every buffer its ops
// reference, each once.
func (g *Graph) Buffers() []BufferRef { return slices.Clone(g.refs) }

// Check reports whether every buffer the graph references is still live,
// as Replay checks before it launches: nil, or an error wrapping ErrStale
// that names the first stale buffer. Without kernels.Liveness on the
// backend only the registry's own consistency is checked.
func (g *Graph) Check() error { return g.check("check") }

func (g *Graph) check(op string) error {
	for i, r := range g.refs {
		if r.Buf.Addr() != r.Addr || r.Buf.Size() != r.Size || (g.live != nil && !g.live.Live(r.Buf)) {
			return fmt.Errorf("cudagraph: %s: buffer %d of %d, %v (%d bytes at %#x): %w", op, i, len(g.refs), r.Buf, r.Size, r.Addr, ErrStale)
		}
	}
	return nil
}

// Replay checks the registry (see Check) and then launches the graph. If a
// buffer is stale, nothing is launched. Launch errors come back wrapped;
// on a device backend, execution errors surface at the next Sync.
func (g *Graph) Replay() error {
	if g.g == nil {
		return errors.New("cudagraph: replay: graph destroyed")
	}
	if err := g.check("replay"); err != nil {
		return err
	}
	if err := g.g.Launch(); err != nil {
		return fmt.Errorf("cudagraph: replay: %w", err)
	}
	return nil
}

// Destroy releases the captured graph. It is idempotent; a destroyed graph
// cannot be replayed.
func (g *Graph) Destroy() error {
	if g.g == nil {
		return nil
	}
	kg := g.g
	g.g = nil
	if err := kg.Destroy(); err != nil {
		return fmt.Errorf("cudagraph: destroy: %w", err)
	}
	return nil
}
