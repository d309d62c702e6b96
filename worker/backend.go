package worker

import (
	"errors"
	"fmt"

	"go.uber.org/zap"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	kcuda "github.com/rollout-worker/rollout-worker/kernels/cuda"
)

// ErrUnknownDevice is OpenBackend's error for a device name it does not know.
var ErrUnknownDevice = errors.New("unknown device")

// OpenBackend opens the compute backend a device name selects: cpu, cuda, or
// auto (cuda where a GPU and the CUDA toolchain are usable, else cpu, with a
// warning when a GPU is there but the backend could not start).
// closeBackend releases it, after everything allocated on it. A nil logger
// discards logs.
func OpenBackend(device string, log *zap.Logger) (be kernels.Backend, closeBackend func() error, err error) {
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
		case device == "auto":
			// A GPU, but no usable toolchain (NVRTC or the CUDA headers
			// missing, say): run, on the CPU, and say why loudly.
			log.Warn("CUDA device present but the CUDA backend failed; using the CPU backend (--device cuda makes this an error)", zap.Error(err))
			be, err := cpu.New(cpu.Config{}, log)
			return be, noop, err
		}
		return nil, nil, err
	}
	return nil, nil, fmt.Errorf("%w %q: want auto, cpu or cuda", ErrUnknownDevice, device)
}
