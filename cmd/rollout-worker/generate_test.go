package main

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/rollout"
	"github.com/rollout-worker/rollout-worker/worker"
)

// TestGenerateCommand drives a worker through `rollout-worker generate`.
func TestGenerateCommand(t *testing.T) {
	url, connect := testNATS(t)
	w, err := startTestWorker(t, connect("gen-w"), worker.Config{Preset: "tiny", Seed: 1, Recipe: moe.RecipePerToken, Device: "cpu", ModelID: "gen",
		WorkerID: "gen-w", KVPages: 256, PageSize: 16, MaxBatchTokens: 128, MaxSeqs: 16, Limits: rollout.Limits{MaxQueue: 8}},
		zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	gen := func(args ...string) (string, string, int) {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), append([]string{"generate", "--nats-url", url, "--model-id", "gen"}, args...), &stdout, &stderr)
		return stdout.String(), stderr.String(), code
	}
	out, errOut, code := gen("--prompt", "1,2,3", "--n", "3", "--seed", "7", "--max-tokens", "6")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var res struct {
		Samples []rollout.SampleReply `json:"samples"`
		Summary rollout.Summary       `json:"summary"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(res.Samples) != 3 || res.Summary.Samples != 3 || res.Summary.Worker != "gen-w" || res.Summary.Seed != 7 {
		t.Fatalf("result %+v", res)
	}
	for _, s := range res.Samples {
		if len(s.Tokens) != 6 || len(s.LogProbs) != 6 || len(s.Versions) != 6 || s.FinishReason != rollout.FinishLength {
			t.Fatalf("sample %+v", s)
		}
	}
	again, _, _ := gen("--prompt", "1,2,3", "--n", "3", "--seed", "7", "--max-tokens", "6")
	var res2 struct {
		Samples []rollout.SampleReply `json:"samples"`
	}
	if err := json.Unmarshal([]byte(again), &res2); err != nil {
		t.Fatal(err)
	}
	for i := range res.Samples {
		if !slices.Equal(res.Samples[i].Tokens, res2.Samples[i].Tokens) {
			t.Fatalf("same seed, sample %d: %v then %v", i, res.Samples[i].Tokens, res2.Samples[i].Tokens)
		}
	}
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--prompt", "1,x"}, 2, `"x" is not a token id`},
		{[]string{"--prompt", "1,99999", "--max-tokens", "4"}, 1, "vocabulary"},
		{[]string{"--prompt", "1", "--top-p", "1.5"}, 1, "top_p"},
	} {
		if _, errOut, code := gen(tc.args...); code != tc.code || !strings.Contains(errOut, tc.want) {
			t.Errorf("generate %v: exit %d, stderr %q; want %d and %q", tc.args, code, errOut, tc.code, tc.want)
		}
	}
}
