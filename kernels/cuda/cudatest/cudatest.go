// Package cudatest opens the CUDA backend for tests of the packages above
// it, skipping them where there is no GPU.
package cudatest

import (
	"errors"
	"testing"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
	kcuda "github.com/rollout-worker/rollout-worker/kernels/cuda"
)

// Backend opens a CUDA backend, closed when the test ends. Without a
// usable GPU the test is skipped with the reason; any other failure to
// start fails it.
func Backend(t testing.TB) *kcuda.Backend {
	t.Helper()
	be, err := kcuda.New(kcuda.Config{}, nil)
	if errors.Is(err, drv.ErrNoDevice) {
		t.Skip("no CUDA device: " + err.Error())
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := be.Close(); err != nil {
			t.Error(err)
		}
	})
	return be
}

// Use opens a CUDA backend (as Backend) and points a package's backend
// hook at it for the rest of the test; the hook is restored before the
// backend closes.
func Use(t testing.TB, hook *func(testing.TB) kernels.Backend) *kcuda.Backend {
	t.Helper()
	be := Backend(t)
	prev := *hook
	*hook = func(testing.TB) kernels.Backend { return be }
	t.Cleanup(func() { *hook = prev }) // cleanups run last-in first-out: before Close
	return be
}
