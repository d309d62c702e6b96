package refit

import (
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels/cuda/cudatest"
)

// TestGPURefit reruns the refit acceptance tests with every worker (and
// every fresh reference worker) on the CUDA backend: chunks are staged
// host-to-device on the backend's copy stream while the engine runs (delta
// tensors scattered there by model_scatter_bf16), the commit requantizes on
// the GPU, and the result is bitwise a fresh GPU worker loaded with the new
// weights. It skips where there is no GPU.
func TestGPURefit(t *testing.T) {
	cudatest.Use(t, &testBackend)
	for _, tc := range []struct {
		name string
		test func(*testing.T)
	}{
		{"Equivalence", TestRefitEquivalence},
		{"PartialFromStart", TestRefitPartialFromStart},
		{"Rejections", TestRefitRejections},
		{"LateJoin", TestRefitLateJoin},
		{"LiveAndFallback", TestRefitLiveAndFallback},
		{"Delta", TestRefitDelta},
		{"DeltaSmall", TestRefitDeltaSmall},
		{"DeltaFused", TestRefitDeltaFused},
		{"DeltaRejections", TestRefitDeltaRejections},
		{"Parts", TestRefitParts},
		{"PartServers", TestRefitPartServers},
	} {
		t.Run(tc.name, tc.test)
	}
}
