package main

import (
	"errors"
	"fmt"

	"go.uber.org/zap"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	kcuda "github.com/rollout-worker/rollout-worker/kernels/cuda"
)

// newBackend opens the compute backend --device names: cpu, cuda, or auto
// (cuda where a GPU is usable, else cpu). closeBackend releases it, after
// everything allocated on it. A nil logger discards logs.
func newBackend(device string, log *zap.Logger) (be kernels.Backend, closeBackend func() error, err error) {
	if log == nil {
		log = zap.NewNop()
	}
	noop := func() error { return nil }
	switch device {
	case "cpu":
		be, err := cpu.New(cpu.Config{}, log)
		return be, noop, err
	case "cuda", "auto":
		g, err := kcuda.New(kcuda.Config{}, log)
		switch {
		case err == nil:
			return g, g.Close, nil
		case device == "auto" && errors.Is(err, drv.ErrNoDevice):
			log.Info("no CUDA device, using the CPU backend", zap.Error(err))
			be, err := cpu.New(cpu.Config{}, log)
			return be, noop, err
		}
		return nil, nil, fmt.Errorf("--device %s: %w", device, err)
	}
	return nil, nil, usageErrorf("--device %q: want auto, cpu or cuda", device)
}
