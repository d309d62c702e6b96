// Package cudatest opens the CUDA backend for tests of the packages above
// it, skipping them where there is no GPU.
package cudatest

import (
	"errors"
	"testing"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
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
