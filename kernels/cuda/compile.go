package cuda

import (
	"fmt"
	"time"

	"go.uber.org/zap"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
)

// compileKernels compiles (or takes from the cache) every program of the
// registry's kernels for arch, concurrently, off the device's owner
// thread. It logs each program's time and cache hit at debug level and the
// total at info level.
func compileKernels(dev *drv.Device, arch string, log *zap.Logger) ([]program, []*drv.Compiled, error) {
	progs, err := programs(arch, kernelRegistry())
	if err != nil {
		return nil, nil, err
	}
	ps := make([]drv.Program, len(progs))
	for i, p := range progs {
		ps[i] = p.prog
	}
	start := time.Now()
	outs, err := dev.CompileAll(ps, 0, func(i int, out *drv.Compiled) {
		logCompiled(log, progs[i].label, out)
	})
	if err != nil {
		return nil, nil, err
	}
	logTotal(log, arch, outs, time.Since(start))
	return progs, outs, nil
}

// logCompiled logs one program's compilation (debug) and a cache write
// failure (warn).
func logCompiled(log *zap.Logger, label string, out *drv.Compiled) {
	log.Debug("kernel program", zap.String("program", label), zap.Duration("elapsed", out.Elapsed), zap.Bool("cached", out.Cached))
	if out.CacheErr != nil {
		log.Warn("kernel cache write failed", zap.String("program", label), zap.Error(out.CacheErr))
	}
}

// logTotal logs the whole compilation (info).
func logTotal(log *zap.Logger, arch string, outs []*drv.Compiled, total time.Duration) {
	hits := 0
	for _, o := range outs {
		if o.Cached {
			hits++
		}
	}
	log.Info("kernels compiled", zap.String("arch", arch), zap.Int("programs", len(outs)), zap.Int("cached", hits),
		zap.Duration("elapsed", total))
}

// WarmResult is one program of Warm.
type WarmResult struct {
	Program string        // unit, and kernel for per-kernel programs
	Cached  bool          // already in the cache
	Elapsed time.Duration // compile (or cache read) time
}

// Warm compiles every kernel program the backend uses on arch into the
// cubin cache cfg names (internal/cuda.Config.CacheDir and its
// environment default), without a GPU when arch is given: for baking the
// cache into an image. An empty arch takes the device's. It needs NVRTC
// (and its include directory), not a device, unless arch is empty.
func Warm(cfg drv.Config, arch string, workers int) ([]WarmResult, error) {
	if arch == "" {
		dev, err := drv.Open(cfg)
		if err != nil {
			return nil, err
		}
		arch = dev.Info().Arch
		if err := dev.Close(); err != nil {
			return nil, err
		}
	}
	comp, err := drv.NewCompiler(cfg, arch)
	if err != nil {
		return nil, err
	}
	if comp.CacheDir() == "" {
		return nil, fmt.Errorf("cuda: warm: the cubin cache is off")
	}
	progs, err := programs(arch, kernelRegistry())
	if err != nil {
		return nil, err
	}
	ps := make([]drv.Program, len(progs))
	for i, p := range progs {
		ps[i] = p.prog
	}
	outs, err := comp.CompileAll(ps, workers, nil)
	if err != nil {
		return nil, err
	}
	res := make([]WarmResult, len(outs))
	for i, o := range outs {
		if o.CacheErr != nil {
			return nil, fmt.Errorf("cuda: warm %s: %w", progs[i].label, o.CacheErr)
		}
		res[i] = WarmResult{Program: progs[i].label, Cached: o.Cached, Elapsed: o.Elapsed}
	}
	return res, nil
}
