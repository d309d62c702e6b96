package cpu_test

import (
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/kernels/kernelstest"
)

func newBackend(t *testing.T) kernels.Backend {
	t.Helper()
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return be
}

func TestConformance(t *testing.T) { kernelstest.Run(t, newBackend) }

func TestConformanceOneWorker(t *testing.T) {
	kernelstest.Run(t, func(t *testing.T) kernels.Backend {
		be, err := cpu.New(cpu.Config{Workers: 1}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return be
	})
}

func TestForeignBuffer(t *testing.T) { kernelstest.Foreign(t, newBackend(t), newBackend(t)) }
