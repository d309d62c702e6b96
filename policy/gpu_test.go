package policy

import (
	"testing"

	kcuda "github.com/rollout-worker/rollout-worker/kernels/cuda"
	"github.com/rollout-worker/rollout-worker/kernels/cuda/cudatest"
)

// TestGPUEngine reruns the engine's acceptance tests with every model on the
// CUDA backend: the Hugging Face reference logprobs (same tolerance as the
// CPU engine), a sample alone vs with 31 others (bitwise), graph replay vs
// eager execution (bitwise, no recapture), graphs across a weight commit
// (bitwise equal to a fresh GPU model loaded with the new weights, no
// recapture), determinism, scoring, chunked prefill, continuous batching,
// preempted samples bitwise equal to unpreempted ones (KV pages on
// demand), prefix-cache hits bitwise equal to cold prefills and none
// across a version change, the sampling distribution, the per_tensor
// calibration, a ModelOpt NVFP4 checkpoint's load and the KV cache sized
// from free memory (the recipe loops
// include per_tensor and unit_scale). It skips where there is no GPU.
func TestGPUEngine(t *testing.T) {
	be := cudatest.Use(t, &testBackend)
	for _, tc := range []struct {
		name string
		test func(*testing.T)
	}{
		{"HuggingFaceReference", TestHuggingFaceReference},
		{"GenerateDeterministic", TestGenerateDeterministic},
		{"BatchInvariantSamples", TestBatchInvariantSamples},
		{"GraphReplayMatchesEager", TestGraphReplayMatchesEager},
		{"GraphsAcrossWeightCommit", TestGraphsAcrossWeightCommit},
		{"ScoreMatchesGeneration", TestScoreMatchesGeneration},
		{"LongPromptsChunked", TestLongPromptsChunked},
		{"ContinuousBatching", TestContinuousBatching},
		{"PreemptedEqualsUnpreempted", TestPreemptedEqualsUnpreempted},
		{"LongTailThroughSmallCache", TestLongTailThroughSmallCache},
		{"PrefixHitEqualsCold", TestPrefixHitEqualsCold},
		{"NoPrefixHitAcrossVersions", TestNoPrefixHitAcrossVersions},
		{"PrefixCacheWithPreemption", TestPrefixCacheWithPreemption},
		{"VersionsAcrossCommit", TestVersionsAcrossCommit},
		{"RoutedExperts", TestRoutedExperts},
		{"SamplingDistribution", TestSamplingDistribution},
		{"NumericFailureFailsOnlyItsRequest", TestNumericFailureFailsOnlyItsRequest},
		{"Calibrate", TestCalibrate},
		{"PerTensorNeedsScales", TestPerTensorNeedsScales},
		{"LoadNVFP4Checkpoint", TestLoadNVFP4Checkpoint},
		{"KVPagesFromFreeMemory", func(t *testing.T) { testKVPagesFromDevice(t, be) }},
	} {
		t.Run(tc.name, tc.test)
	}
}

// testKVPagesFromDevice sizes a cache from 1% of the GPU's free memory.
func testKVPagesFromDevice(t *testing.T, be *kcuda.Backend) {
	free, _, err := be.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	opts := testOptions()
	opts.KVPages, opts.KVMemoryFraction = 0, 0.01
	m, err := NewModel(be, testConfig(), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	c := testConfig()
	perPage := int64(2*c.Layers) * int64(opts.PageSize*c.KVHeads*c.HeadDim) * 2
	got := int64(m.Options().KVPages)
	// Free memory shrank by the weights before the cache was sized.
	if got < 1 || got > int64(float64(free)*0.01)/perPage {
		t.Fatalf("%d KV pages from 1%% of %d free bytes (%d bytes a page)", got, free, perPage)
	}
	t.Logf("1%% of %.1f GiB free: %d KV pages of %d bytes", float64(free)/(1<<30), got, perPage)
}
