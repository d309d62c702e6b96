package worker

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/internal/natsembed"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/rollout"
)

func startNATS(t *testing.T) *nats.Conn {
	t.Helper()
	srv, err := natsembed.Start(natsembed.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

func testConfig() Config {
	return Config{Preset: "tiny", Seed: 1, Recipe: moe.RecipePerToken, Device: "cpu", ModelID: "wt", WorkerID: "wt-1",
		KVPages: 128, PageSize: 16, MaxBatchTokens: 64, MaxSeqs: 8, Graphs: true, Limits: rollout.Limits{MaxQueue: 8}}
}

// TestLifecycle: New builds, Start serves, Drain and Close end it.
func TestLifecycle(t *testing.T) {
	nc := startNATS(t)
	w, err := New(context.Background(), nc, testConfig(), zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	if w.Ready() {
		t.Fatal("ready before Start")
	}
	if err := w.Drain(context.Background()); !errors.Is(err, ErrNotStarted) {
		t.Fatalf("Drain before Start: %v, want ErrNotStarted", err)
	}
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	if err := w.Start(); err == nil {
		t.Fatal("a second Start succeeded")
	}
	if !w.Ready() {
		t.Fatal("not ready after Start")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	seed := uint64(4)
	got, sum, err := rollout.NewClient(nc, "wt").GenerateAll(ctx, rollout.GenerateRequest{Prompt: []int32{1, 2, 3}, N: 2, Temperature: 1, MaxTokens: 4, Seed: &seed})
	if err != nil || len(got) != 2 || sum.Error != "" {
		t.Fatalf("generate: %d samples, summary %+v, error %v", len(got), sum, err)
	}
	if err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// TestEngineFailureFailsTheWorker: when the engine loop stops on its own
// (here: a weight buffer freed under it), Failed closes, Err says why and
// Ready turns false, so serve exits non-zero and /readyz fails.
func TestEngineFailureFailsTheWorker(t *testing.T) {
	nc := startNATS(t)
	w, err := New(context.Background(), nc, testConfig(), zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	emb, err := w.m.Resolve("model.embed_tokens.weight")
	if err != nil {
		t.Fatal(err)
	}
	if err := w.m.Backend().Free(emb.Buffer); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	seed := uint64(5)
	st, err := rollout.NewClient(nc, "wt").Generate(ctx, rollout.GenerateRequest{Prompt: []int32{1, 2}, N: 1, Temperature: 1, MaxTokens: 4, Seed: &seed})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	select {
	case <-w.Failed():
	case <-ctx.Done():
		t.Fatal("the worker did not fail")
	}
	if err := w.Err(); err == nil || !strings.Contains(err.Error(), "engine") {
		t.Fatalf("Err() = %v, want the engine's failure", err)
	}
	if w.Ready() {
		t.Fatal("a failed worker reports ready")
	}
}

func TestDefaultModelID(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Preset: "small"}, "small"},
		{Config{Preset: "tiny"}, "tiny"},
		{Config{ModelDir: "/models/Qwen3-30B-A3B/"}, "Qwen3-30B-A3B"},
		{Config{ModelDir: "/models/qwen3.moe v2", Preset: "tiny"}, "qwen3_moe_v2"},
		{Config{ModelDir: "/" + strings.Repeat("x", 80)}, strings.Repeat("x", 64)},
		{Config{ModelDir: "/"}, "model"},
	} {
		if got := DefaultModelID(tc.cfg); got != tc.want {
			t.Errorf("DefaultModelID(%+v) = %q, want %q", tc.cfg, got, tc.want)
		}
	}
}

// TestOnDemandPagesAndPrefixCache: a worker with KV pages on demand and
// the prefix cache serves a request its cache could not reserve whole
// (4 samples x 80 tokens in 128 slots), preempting as it goes, and the
// same request again from the cached prompt, with the same samples; the
// metrics count both.
func TestOnDemandPagesAndPrefixCache(t *testing.T) {
	nc := startNATS(t)
	cfg := testConfig()
	cfg.KVPages, cfg.KVOnDemand, cfg.PrefixCache = 8, true, true
	reg := prometheus.NewRegistry()
	w, err := New(context.Background(), nc, cfg, zap.NewNop(), reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	seed := uint64(9)
	prompt := make([]int32, 20)
	for i := range prompt {
		prompt[i] = int32(3 + 7*i)
	}
	req := rollout.GenerateRequest{Prompt: prompt, N: 4, Temperature: 1, MaxTokens: 60, Seed: &seed, ReturnLogprobs: true}
	c := rollout.NewClient(nc, "wt")
	first, sum, err := c.GenerateAll(ctx, req)
	if err != nil || len(first) != 4 || sum.Error != "" {
		t.Fatalf("generate: %d samples, summary %+v, error %v", len(first), sum, err)
	}
	again, _, err := c.GenerateAll(ctx, req)
	if err != nil || len(again) != 4 {
		t.Fatalf("generate again: %d samples, error %v", len(again), err)
	}
	for i := range first {
		a, b := first[i], again[i]
		if a.Index != b.Index || len(a.Tokens) != 60 || !slices.Equal(a.Tokens, b.Tokens) || !slices.Equal(a.LogProbs, b.LogProbs) {
			t.Fatalf("sample %d: %v %v vs %v %v", i, a.Tokens, a.LogProbs, b.Tokens, b.LogProbs)
		}
	}
	got := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			for _, l := range m.GetLabel() {
				name += "/" + l.GetValue()
			}
			got[name] = m.GetCounter().GetValue()
		}
	}
	if got["rollout_worker_engine_preemptions_total"] == 0 || got["rollout_worker_engine_prefix_tokens_total/hit"] != 16 {
		t.Fatalf("preemptions %v, prefix hit tokens %v: want preemptions and the second request's first page (16 tokens) from the cache",
			got["rollout_worker_engine_preemptions_total"], got["rollout_worker_engine_prefix_tokens_total/hit"])
	}
}

// TestPerTensorInputScales: a per_tensor worker of a preset (no
// checkpoint scales) needs an input scales file, takes one that fits its model and serves with it; a file for
// another depth or scales with another recipe are refused.
func TestPerTensorInputScales(t *testing.T) {
	nc := startNATS(t)
	mc, err := policy.PresetLayers("tiny", 0)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	scales := make([]policy.InputScales, mc.Layers)
	for i := range scales {
		scales[i] = policy.InputScales{FC1: 1.0 / 512, FC2: 1.0 / 2048}
	}
	good, short := filepath.Join(dir, "good.safetensors"), filepath.Join(dir, "short.safetensors")
	if err := policy.WriteInputScales(good, mc, scales, nil); err != nil {
		t.Fatal(err)
	}
	oneLayer := mc
	oneLayer.Layers = 1
	if err := policy.WriteInputScales(short, oneLayer, scales[:1], nil); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		recipe moe.Recipe
		file   string
		want   string // "" for success
	}{
		{"per_tensor without scales", moe.RecipePerTensor, "", "recipe per_tensor has no input scales"},
		{"scales with per_token", moe.RecipePerToken, good, "only the per_tensor recipe takes them"},
		{"scales of one layer", moe.RecipePerTensor, short, "layer 1 has no gate_proj, up_proj, w1 or w3 input_scale"},
		{"per_tensor", moe.RecipePerTensor, good, ""},
		{"unit_scale", moe.RecipeUnitScale, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig()
			cfg.Recipe, cfg.InputScales, cfg.ModelID = tc.recipe, tc.file, "wt-"+string(tc.recipe)
			w, err := New(context.Background(), nc, cfg, zap.NewNop(), prometheus.NewRegistry())
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("New: %v, want an error containing %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { w.Close() })
			if err := w.Start(); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			seed := uint64(5)
			got, sum, err := rollout.NewClient(nc, cfg.ModelID).GenerateAll(ctx, rollout.GenerateRequest{Prompt: []int32{1, 2, 3}, N: 2, Temperature: 1, MaxTokens: 4, Seed: &seed})
			if err != nil || len(got) != 2 || sum.Error != "" {
				t.Fatalf("generate: %d samples, summary %+v, error %v", len(got), sum, err)
			}
		})
	}
}
