package policy

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// nextTokenLogits returns the model's logits after prompt, computed on the
// engine loop with pages of its own.
func nextTokenLogits(t *testing.T, e *Engine, p []int32) []float32 {
	t.Helper()
	var logits []float32
	err := e.AtBoundary(context.Background(), func() error {
		ps := e.m.opts.PageSize
		need := ceilDiv(len(p), ps)
		if !e.pages.Reserve(need) {
			return fmt.Errorf("no pages")
		}
		var pages []int32
		for range need {
			pg, err := e.pages.Take()
			if err != nil {
				return err
			}
			pages = append(pages, int32(pg))
		}
		defer func() {
			for _, pg := range pages {
				e.pages.Release(int(pg))
			}
		}()
		in := StepInput{SeqLens: []int32{int32(len(p))}, QueryStart: []int32{0, int32(len(p))}, PageTable: [][]int32{pages},
			LogitRows: []int32{int32(len(p) - 1)}}
		for i, tok := range p {
			in.Tokens = append(in.Tokens, tok)
			in.Positions = append(in.Positions, int32(i))
			in.Slots = append(in.Slots, pages[i/ps]*int32(ps)+int32(i%ps))
		}
		sh, err := e.m.Stage(in)
		if err != nil {
			return err
		}
		if err := e.m.Forward(sh, false); err != nil {
			return err
		}
		raw := make([]byte, 4*e.m.cfg.VocabSize)
		if err := e.m.be.Download(raw, e.m.ws.logits, 0); err != nil {
			return err
		}
		logits = kernels.BytesFloat32(raw)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return logits
}

// promised is the distribution SamplingParams promise over the vocabulary:
// softmax(logits / T), truncated to the top-k, then to the smallest prefix
// reaching top-p (ties by id), renormalised.
func promised(logits []float32, p SamplingParams) []float64 {
	prob := make([]float64, len(logits))
	m := math.Inf(-1)
	for i, l := range logits {
		prob[i] = float64(l / p.Temperature)
		m = max(m, prob[i])
	}
	var z float64
	for i := range prob {
		prob[i] = math.Exp(prob[i] - m)
		z += prob[i]
	}
	order := make([]int, len(prob))
	for i := range order {
		order[i] = i
		prob[i] /= z
	}
	slices.SortStableFunc(order, func(a, b int) int {
		switch {
		case prob[a] > prob[b]:
			return -1
		case prob[a] < prob[b]:
			return 1
		}
		return a - b
	})
	if p.TopK > 0 {
		order = order[:p.TopK]
	}
	if p.TopP < 1 {
		var cum float64
		for j, id := range order {
			cum += prob[id]
			if cum >= float64(p.TopP) {
				order = order[:j+1]
				break
			}
		}
	}
	out := make([]float64, len(prob))
	var kept float64
	for _, id := range order {
		kept += prob[id]
	}
	for _, id := range order {
		out[id] = prob[id] / kept
	}
	return out
}

// TestSamplingDistribution is a chi-square test (p = 0.001, fixed seeds)
// that temperature, top-k and top-p sample exactly the distribution they
// promise, end to end through the engine.
func TestSamplingDistribution(t *testing.T) {
	cfg := testConfig()
	m := newRandomModel(t, cfg, testOptions(), 8)
	e := startEngine(t, m, EngineConfig{})
	p := prompt(4, 6, cfg.VocabSize)
	logits := nextTokenLogits(t, e, p)
	const requests, n = 60, 48 // 2880 draws per case
	for _, sp := range []SamplingParams{
		{Temperature: 1},
		{Temperature: 0.7, TopK: 10},
		{Temperature: 1.3, TopP: 0.8},
		{Temperature: 1, TopK: 20, TopP: 0.9},
	} {
		t.Run(fmt.Sprintf("T%v_k%d_p%v", sp.Temperature, sp.TopK, sp.TopP), func(t *testing.T) {
			if sp.TopP == 0 {
				sp.TopP = 1
			}
			want := promised(logits, sp)
			counts := make([]int, cfg.VocabSize)
			for r := range requests {
				sp.MaxTokens, sp.Seed = 1, uint64(1000+r)
				for _, s := range generate(t, e, Request{ID: "chi", Prompt: p, N: n, Params: sp}) {
					tok := s.Tokens[0]
					if want[tok] == 0 {
						t.Fatalf("drew token %d, which the parameters exclude", tok)
					}
					counts[tok]++
				}
			}
			// Bins with an expected count under 5 are pooled.
			total := float64(requests * n)
			var stat, poolE, poolO float64
			df := -1
			for tok, w := range want {
				exp := w * total
				if exp == 0 {
					continue
				}
				if exp < 5 {
					poolE += exp
					poolO += float64(counts[tok])
					continue
				}
				stat += (float64(counts[tok]) - exp) * (float64(counts[tok]) - exp) / exp
				df++
			}
			if poolE > 0 {
				stat += (poolO - poolE) * (poolO - poolE) / poolE
				df++
			}
			// Wilson-Hilferty: the chi-square quantile at p = 0.001.
			z := 3.090
			crit := float64(df) * math.Pow(1-2/(9*float64(df))+z*math.Sqrt(2/(9*float64(df))), 3)
			t.Logf("chi-square %.1f, %d degrees of freedom, critical %.1f", stat, df, crit)
			if stat > crit {
				t.Fatalf("chi-square %.1f exceeds %.1f (df %d): the draws do not follow the promised distribution", stat, crit, df)
			}
		})
	}
}
