package main

import (
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/worker"
)

// newBackend opens the compute backend --device names (worker.OpenBackend),
// with an unknown name reported as a usage error.
func newBackend(device string, log *zap.Logger) (kernels.Backend, func() error, error) {
	be, closeBackend, err := worker.OpenBackend(device, log)
	switch {
	case errors.Is(err, worker.ErrUnknownDevice):
		return nil, nil, usageErrorf("--device %q: %v", device, err)
	case err != nil:
		return nil, nil, fmt.Errorf("--device %s: %w", device, err)
	}
	return be, closeBackend, nil
}
