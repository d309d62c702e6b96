package genbench

import (
	"bytes"
	"context"
	"encoding/csv"
	"math"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

// TestDecodeFloor: the Qwen3-30B-A3B decode floors of docs/PERF.md, from
// its byte counts (per layer 37.7 MB of attention projections, 0.5 MB of
// router, 2.65 MB per touched expert in NVFP4 or 9.44 MB in BF16; a 622 MB
// LM head; 96 KB of KV cache per token of context over 48 layers).
func TestDecodeFloor(t *testing.T) {
	cfg, err := policy.Preset("qwen3-30b-a3b")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		recipe         moe.Recipe
		batch, context int
		wantMS         float64
	}{
		{moe.RecipePerToken, 1, 128, 0.81},
		{moe.RecipePerToken, 1, 1024, 0.83},
		{moe.RecipePerToken, 64, 128, 4.5},
		{moe.RecipePerToken, 64, 1024, 5.8},
		{moe.RecipePerToken, 256, 1024, 10.4},
		{moe.RecipeBF16, 64, 128, 14.03}, // 125.9 experts touched x 9.44 MB a layer
	} {
		_, floor := DecodeFloor(cfg, tc.recipe, tc.batch, tc.context)
		got := floor.Seconds() * 1e3
		if math.Abs(got-tc.wantMS) > 0.02*tc.wantMS+0.01 {
			t.Errorf("%s batch %d context %d: floor %.3f ms, want %.2f", tc.recipe, tc.batch, tc.context, got, tc.wantMS)
		}
	}
}

// TestDecodeSweep runs a small sweep on the CPU backend and checks the
// points and the reports.
func TestDecodeSweep(t *testing.T) {
	cfg, err := policy.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dc := DecodeConfig{Batches: []int{1, 3}, Contexts: []int{5, 40}, Warmup: 1, Steps: 2, Seed: 1}
	var points []DecodePoint
	for _, rc := range []moe.Recipe{moe.RecipePerToken, moe.RecipeBF16} {
		opts := policy.ModelOptions{Recipe: rc, MaxSeqs: 3, MaxTokens: 3, MaxLogitRows: 3, PageSize: 16, KVPages: DecodeKVPages(dc, 16)}
		m, err := policy.NewRandomModel(context.Background(), be, cfg, opts, 1)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		g, err := policy.NewGraphs(m, policy.DefaultBuckets(3), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { g.Close() })
		pts, err := Decode(context.Background(), m, g, dc)
		if err != nil {
			t.Fatal(err)
		}
		if st := g.Stats(); st.Replays < uint64(len(pts)*(dc.Warmup+dc.Steps)) {
			t.Fatalf("%d graph replays for %d points of %d steps: steps did not replay graphs", st.Replays, len(pts), dc.Warmup+dc.Steps)
		}
		points = append(points, pts...)
	}
	if len(points) != 8 {
		t.Fatalf("%d points, want 8", len(points))
	}
	for _, p := range points {
		if p.Step <= 0 || p.Floor <= 0 || p.Device != 0 || p.TokensPerSecond() <= 0 {
			t.Errorf("point %+v: want a positive step time and floor, no device time on the CPU", p)
		}
	}
	var table, csvOut, svg bytes.Buffer
	if err := DecodeTable(&table, points); err != nil {
		t.Fatal(err)
	}
	if lines := strings.Count(table.String(), "\n"); lines != 9 || !strings.Contains(table.String(), "vs BF16") {
		t.Fatalf("table:\n%s", table.String())
	}
	if err := DecodeCSV(&csvOut, points); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&csvOut).ReadAll()
	if err != nil || len(rows) != 9 || rows[0][3] != "step_us" {
		t.Fatalf("csv: %d rows, %v", len(rows), err)
	}
	if err := DecodeChart("decode", points).SVG(&svg); err != nil {
		t.Fatal(err)
	}
	if s := svg.String(); strings.Count(s, "<polyline") != 6 || !strings.Contains(s, "NVFP4 floor, context 40") {
		t.Fatalf("chart: %d lines, want 4 recipes x contexts and 2 floors", strings.Count(s, "<polyline"))
	}
}

func TestDecodeRefusesWhatDoesNotFit(t *testing.T) {
	cfg, err := policy.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	opts := policy.ModelOptions{Recipe: moe.RecipeBF16, MaxSeqs: 2, MaxTokens: 2, MaxLogitRows: 2, PageSize: 16, KVPages: 4}
	m, err := policy.NewRandomModel(context.Background(), be, cfg, opts, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	g, err := policy.NewGraphs(m, policy.DefaultBuckets(2), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	for _, tc := range []struct {
		dc   DecodeConfig
		want string
	}{
		{DecodeConfig{Batches: []int{3}, Contexts: []int{8}, Steps: 1}, "takes 1..2 sequences"},
		{DecodeConfig{Batches: []int{2}, Contexts: []int{100}, Steps: 1}, "needs 14 KV pages, the cache has 4"},
		{DecodeConfig{Batches: []int{1}, Contexts: []int{1020}, Steps: 8}, "exceeds the model's 1024 positions"},
		{DecodeConfig{Batches: []int{1}, Contexts: []int{8}}, "at least one step"},
	} {
		if _, err := Decode(context.Background(), m, g, tc.dc); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want %q", tc.dc, err, tc.want)
		}
	}
}
