// Package cputest holds CPU backends with faults injected, for tests of
// what the layers above do when the device fails.
package cputest

import (
	"errors"
	"sync/atomic"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
)

// ErrInjected is the error an armed fault returns.
var ErrInjected = errors.New("injected device fault")

// RequantFault is the CPU backend whose requantization (a per-matrix
// Quantize) fails with ErrInjected once Armed is set: a device fault in
// the middle of a refit commit, after the BF16 weights were written.
type RequantFault struct {
	*cpu.Backend
	Armed atomic.Bool
}

// Quantize fails per-matrix quantization while armed.
func (b *RequantFault) Quantize(args kernels.QuantizeArgs) error {
	if b.Armed.Load() && args.Mode == kernels.PerMatrix {
		return ErrInjected
	}
	return b.Backend.Quantize(args)
}
