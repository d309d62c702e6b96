package genbench

import (
	"context"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

// TestLongTailRuns: with a stop probability the samples have long-tailed
// lengths; the same requests on the same cache with pages reserved and on
// demand generate the same tokens, and on demand more samples decode at
// once (the cache reserves only one request's max_tokens at a time).
func TestLongTailRuns(t *testing.T) {
	cfg, err := policy.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	opts := policy.ModelOptions{Recipe: moe.RecipeBF16, MaxSeqs: 32, MaxTokens: 64, MaxLogitRows: 64, PageSize: 16, KVPages: 80}
	m, err := policy.NewRandomModel(context.Background(), be, cfg, opts, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	gc := Config{Requests: 6, N: 4, PromptLen: 20, MaxTokens: 100, Params: policy.SamplingParams{Temperature: 1}, Seed: 3, StopProb: 0.02}
	reserved, err := Run(context.Background(), m, policy.EngineConfig{}, gc)
	if err != nil {
		t.Fatal(err)
	}
	onDemand, err := Run(context.Background(), m, policy.EngineConfig{KVOnDemand: true}, gc)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("reserved %+v", reserved)
	t.Logf("on demand %+v", onDemand)
	for _, r := range []Result{reserved, onDemand} {
		if r.Samples != 24 || r.Stopped == 0 || r.Stopped == 24 || r.Longest > 100 || r.MeanLength() >= 100 || r.PeakPages > 80 || r.PeakPages == 0 {
			t.Fatalf("result %+v: want 24 samples of long-tailed lengths within the cache", r)
		}
	}
	if reserved.Tokens != onDemand.Tokens || reserved.Stopped != onDemand.Stopped || reserved.Longest != onDemand.Longest {
		t.Fatalf("reserved %d tokens (%d stopped, longest %d), on demand %d (%d, %d): want the same samples",
			reserved.Tokens, reserved.Stopped, reserved.Longest, onDemand.Tokens, onDemand.Stopped, onDemand.Longest)
	}
	if onDemand.MeanRunning <= reserved.MeanRunning {
		t.Fatalf("samples decoding at once: %.1f on demand, %.1f reserved", onDemand.MeanRunning, reserved.MeanRunning)
	}
}
