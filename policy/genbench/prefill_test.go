package genbench

import (
	"bytes"
	"context"
	"math"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

// TestPrefillFloor: 16 prompts of 4096 tokens on Qwen3-30B-A3B, about 111 k
// tokens/s at 790 TFLOP/s (docs/PERF.md): 2 x 2.73 B active weights a
// token and the causal attention scores.
func TestPrefillFloor(t *testing.T) {
	cfg, err := policy.Preset("qwen3-30b-a3b")
	if err != nil {
		t.Fatal(err)
	}
	flops, floor := PrefillFloor(cfg, 16, 4096)
	rate := 16 * 4096 / floor.Seconds()
	if math.Abs(rate-111.7e3) > 1e3 {
		t.Errorf("floor %.0f tokens/s (%.3g FLOPs), want about 111.7 k", rate, flops)
	}
	// Twice the prompts: twice the work; twice the length: more than
	// twice (the attention scores grow with the square).
	f2, _ := PrefillFloor(cfg, 32, 4096)
	f3, _ := PrefillFloor(cfg, 16, 8192)
	if math.Abs(f2-2*flops) > 1e-9*flops || f3 <= 2*flops {
		t.Errorf("FLOPs %.4g, twice the prompts %.4g, twice as long %.4g", flops, f2, f3)
	}
}

// TestPrefillPasses: the passes cover every prompt token once, in order,
// each pass at most a chunk, each sequence on its own pages, and each
// prompt samples once, at its last token.
func TestPrefillPasses(t *testing.T) {
	cfg, err := policy.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	for _, pc := range []PrefillConfig{
		{Prompts: 3, PromptLen: 40, Chunk: 32},
		{Prompts: 5, PromptLen: 7, Chunk: 16},
		{Prompts: 2, PromptLen: 16, Chunk: 100},
	} {
		const ps = 16
		passes := prefillPasses(cfg, pc, ps)
		seen := map[int32]bool{}
		samples, maxSeqs := 0, 0
		for i, in := range passes {
			if len(in.Tokens) > pc.Chunk || len(in.Tokens) == 0 {
				t.Fatalf("%+v: pass %d carries %d tokens", pc, i, len(in.Tokens))
			}
			maxSeqs = max(maxSeqs, len(in.SeqLens))
			for s := range in.SeqLens {
				lo, hi := in.QueryStart[s], in.QueryStart[s+1]
				if in.Positions[hi-1]+1 != in.SeqLens[s] {
					t.Fatalf("%+v: pass %d sequence %d ends at position %d, length %d", pc, i, s, in.Positions[hi-1], in.SeqLens[s])
				}
				for q := lo; q < hi; q++ {
					pos := in.Positions[q]
					if q > lo && pos != in.Positions[q-1]+1 {
						t.Fatalf("%+v: pass %d: positions not consecutive", pc, i)
					}
					if want := in.PageTable[s][int(pos)/ps]*ps + pos%ps; in.Slots[q] != want || seen[want] {
						t.Fatalf("%+v: pass %d: slot %d for position %d (want %d, once)", pc, i, in.Slots[q], pos, want)
					}
					seen[in.Slots[q]] = true
				}
			}
			samples += len(in.LogitRows)
			if len(in.Sampling) != len(in.LogitRows) {
				t.Fatalf("%+v: pass %d: %d sampling rows for %d logit rows", pc, i, len(in.Sampling), len(in.LogitRows))
			}
		}
		if len(seen) != pc.Prompts*pc.PromptLen || samples != pc.Prompts {
			t.Errorf("%+v: %d slots written, %d samples; want %d and %d", pc, len(seen), samples, pc.Prompts*pc.PromptLen, pc.Prompts)
		}
		if maxSeqs > PrefillSeqs(pc) {
			t.Errorf("%+v: a pass carries %d sequences, PrefillSeqs says at most %d", pc, maxSeqs, PrefillSeqs(pc))
		}
	}
}

// TestPrefillRun prefills on the CPU backend with both recipes and checks
// the results and the table; a model too small for the passes is refused.
func TestPrefillRun(t *testing.T) {
	cfg, err := policy.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pc := PrefillConfig{Prompts: 3, PromptLen: 40, Chunk: 32, Runs: 1, Seed: 2}
	var results []PrefillResult
	for _, rc := range []moe.Recipe{moe.RecipePerToken, moe.RecipeBF16} {
		opts := policy.ModelOptions{Recipe: rc, MaxSeqs: PrefillSeqs(pc), MaxTokens: pc.Chunk, MaxLogitRows: PrefillSeqs(pc),
			PageSize: 16, KVPages: PrefillKVPages(pc, 16)}
		m, err := policy.NewRandomModel(context.Background(), be, cfg, opts, 1)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		r, err := Prefill(context.Background(), m, pc)
		if err != nil {
			t.Fatal(err)
		}
		if r.Passes != 4 || r.Time <= 0 || r.FLOPs <= 0 || r.Tokens() != 120 || r.Recipe != rc {
			t.Fatalf("%s: %+v", rc, r)
		}
		results = append(results, r)
		if _, err := Prefill(context.Background(), m, PrefillConfig{Prompts: 3, PromptLen: 40, Chunk: 64, Runs: 1}); err == nil {
			t.Errorf("%s: passes of 64 tokens on a model of 32: no error", rc)
		}
	}
	var buf bytes.Buffer
	if err := PrefillTable(&buf, results); err != nil {
		t.Fatal(err)
	}
	if got := strings.Count(buf.String(), "\n"); got != 3 || !strings.Contains(buf.String(), "of floor") {
		t.Errorf("table:\n%s", buf.String())
	}
}
