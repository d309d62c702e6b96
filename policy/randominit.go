package policy

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// NewRandomModel allocates a model of cfg on be and fills every weight with
// the seeded random values WriteRandomModel writes for (cfg, seed), with no
// checkpoint on disk: the same memory plan as a loaded model, for
// benchmarks and demos at a real model's shapes. On error nothing stays
// allocated.
func NewRandomModel(ctx context.Context, be kernels.Backend, cfg Config, opts ModelOptions, seed uint64) (*Model, error) {
	m, err := NewModel(be, cfg, opts)
	if err != nil {
		return nil, err
	}
	if err := InitRandomWeights(ctx, m, seed); err != nil {
		return nil, errors.Join(err, m.Close())
	}
	return m, nil
}

// InitRandomWeights fills every weight of m with the values WriteRandomModel
// draws for (m.Config(), seed), then rebuilds the NVFP4 expert copies.
// Tensors are drawn on all cores (each from its own generator, keyed by its
// name, so the order does not matter) and uploaded by the calling goroutine,
// which alone issues backend calls; each drawing goroutine holds at most one
// tensor.
func InitRandomWeights(ctx context.Context, m *Model, seed uint64) error {
	type drawn struct {
		t    Target
		data []byte
		err  error
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	specs := make(chan randomSpec)
	out := make(chan drawn)
	var wg sync.WaitGroup
	for range max(1, runtime.GOMAXPROCS(0)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for s := range specs {
				d := drawn{}
				if d.t, d.err = m.Resolve(s.name); d.err == nil {
					d.data = randomData(seed, s)
					if len(d.data) != d.t.Size() {
						d.err = fmt.Errorf("policy: random init: %s: %d bytes for a %v tensor", s.name, len(d.data), d.t.Shape)
					}
				}
				select {
				case out <- d:
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	go func() {
		defer close(specs)
		for _, s := range randomSpecs(m.cfg) {
			select {
			case specs <- s:
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() {
		wg.Wait()
		close(out)
	}()
	var err error
	for d := range out {
		switch {
		case err != nil:
		case d.err != nil:
			err = d.err
		default:
			if e := m.be.Upload(d.t.Buffer, d.t.Offset, d.data); e != nil {
				err = fmt.Errorf("policy: random init: %s: %w", d.t.Name, e)
			}
		}
		if err != nil {
			cancel() // the drawing goroutines stop; out closes after them
		}
	}
	if err == nil && ctx.Err() != nil {
		err = fmt.Errorf("policy: random init: %w", ctx.Err())
	}
	if err != nil {
		return err
	}
	return m.Requantize()
}
