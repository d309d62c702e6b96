package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
)

// CompileAll compiles progs (or takes them from the cache) concurrently,
// at most workers at a time (0: GOMAXPROCS), starting them in slice order
// (put the slowest first), and returns their results in the same order.
// NVRTC is thread-safe across programs. After the first failure no more
// compilations start; the error names the failed programs. done, when not
// nil, is called as each program finishes, from its worker goroutine.
func (c *Compiler) CompileAll(progs []Program, workers int, done func(i int, out *Compiled)) ([]*Compiled, error) {
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	workers = min(workers, len(progs))
	outs := make([]*Compiled, len(progs))
	errs := make([]error, len(progs))
	var next atomic.Int64
	var failed atomic.Bool
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !failed.Load() {
				i := int(next.Add(1) - 1)
				if i >= len(progs) {
					return
				}
				out, err := c.Compile(progs[i])
				if err != nil {
					errs[i] = fmt.Errorf("cuda: compile %s: %w", progs[i].Name, err)
					failed.Store(true)
					return
				}
				outs[i] = out
				if done != nil {
					done(i, out)
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return outs, nil
}

// CompileAll compiles progs for this device with its Compiler (see
// Compiler.CompileAll). It does not need the owner thread.
func (d *Device) CompileAll(progs []Program, workers int, done func(i int, out *Compiled)) ([]*Compiled, error) {
	c, err := d.Compiler()
	if err != nil {
		return nil, err
	}
	return c.CompileAll(progs, workers, done)
}
