package policy

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/moe"
)

// sameRouting compares the routed experts of two sample lists.
func sameRouting(a, b []Sample) error {
	for i := range a {
		if len(a[i].Routed) != len(b[i].Routed) {
			return fmt.Errorf("sample %d: %d routing entries vs %d", i, len(a[i].Routed), len(b[i].Routed))
		}
		for j := range a[i].Routed {
			if !slices.Equal(a[i].Routed[j], b[i].Routed[j]) {
				return fmt.Errorf("sample %d token %d: routed %v vs %v", i, j, a[i].Routed[j], b[i].Routed[j])
			}
		}
	}
	return nil
}

// TestPreemptedEqualsUnpreempted: with KV pages on demand and a cache far
// smaller than the requests' max_tokens, samples are preempted and
// recomputed, and every sample's tokens, logprobs, routed experts and
// finish reason are bitwise those of the same requests on a cache that
// reserves everything up front.
func TestPreemptedEqualsUnpreempted(t *testing.T) {
	cfg := testConfig()
	for _, recipe := range []moe.Recipe{moe.RecipeBF16, moe.RecipePerToken, moe.RecipePerTensor, moe.RecipeUnitScale} {
		t.Run(string(recipe), func(t *testing.T) {
			reqs := make([]Request, 6)
			for i := range reqs {
				reqs[i] = Request{ID: fmt.Sprint("r", i), Prompt: prompt(uint64(40+i), 5+7*i, cfg.VocabSize), N: 1 + i%3,
					Params: SamplingParams{Temperature: 0.9, TopP: 0.95, MaxTokens: 60 + 10*i, Seed: uint64(i), RoutedExperts: i%2 == 0}}
			}
			opts := testOptions()
			opts.Recipe = recipe
			opts.KVPages = 512
			ref := generateAll(t, startEngine(t, newRandomModel(t, cfg, opts, 4), EngineConfig{}), reqs)

			opts.KVPages = 20 // 160 slots; the requests' max_tokens alone sum to 1130
			e := startEngine(t, newRandomModel(t, cfg, opts, 4), EngineConfig{KVOnDemand: true})
			got := generateAll(t, e, reqs)
			st := e.Stats()
			if st.Preemptions == 0 || st.Recomputed == 0 {
				t.Fatalf("stats %+v: the cache was meant to force preemptions", st)
			}
			t.Logf("%d preemptions, %d tokens recomputed, %d forwarded", st.Preemptions, st.Recomputed, st.Tokens)
			for i := range reqs {
				if err := sameSamples(ref[i], got[i]); err != nil {
					t.Fatalf("request %d, preempted vs reserved: %v", i, err)
				}
				if err := sameRouting(ref[i], got[i]); err != nil {
					t.Fatalf("request %d, preempted vs reserved: %v", i, err)
				}
			}
			// The engine releases a finished sequence after it hands out its
			// last sample: give it until a deadline to settle.
			deadline := time.Now().Add(10 * time.Second)
			for st = e.Stats(); (st.KVPagesUsed != 0 || st.Preempted != 0 || st.Running != 0) && time.Now().Before(deadline); st = e.Stats() {
				time.Sleep(time.Millisecond)
			}
			if st.KVPagesUsed != 0 || st.Preempted != 0 || st.Running != 0 {
				t.Fatalf("after the last sample: %+v", st)
			}
		})
	}
}

// TestLongTailThroughSmallCache: 64 samples with long-tailed lengths (each
// stops at one of a few stop tokens, or at max_tokens 200) go through a
// cache of 64 pages, about 4% of their summed max_tokens. Every sample
// completes, bitwise as on a cache that holds them all.
func TestLongTailThroughSmallCache(t *testing.T) {
	cfg := testConfig()
	opts := testOptions()
	r := rand.New(rand.NewPCG(3, 5))
	reqs := make([]Request, 16)
	sum := 0
	for i := range reqs {
		reqs[i] = Request{ID: fmt.Sprint("r", i), Prompt: prompt(uint64(70+i), 8+r.IntN(40), cfg.VocabSize), N: 4,
			Params: SamplingParams{Temperature: 1, MaxTokens: 200, Seed: uint64(100 + i), Stop: []int32{int32(r.IntN(cfg.VocabSize))}}}
		sum += reqs[i].N * reqs[i].Params.MaxTokens
	}
	opts.KVPages = 2048
	ref := generateAll(t, startEngine(t, newRandomModel(t, cfg, opts, 6), EngineConfig{}), reqs)

	opts.KVPages = 64
	if slots := opts.KVPages * opts.PageSize; slots*20 > sum {
		t.Fatalf("a cache of %d slots is not far smaller than %d tokens of max_tokens", slots, sum)
	}
	e := startEngine(t, newRandomModel(t, cfg, opts, 6), EngineConfig{KVOnDemand: true})
	got := generateAll(t, e, reqs)
	lengths := map[FinishReason]int{}
	for i := range reqs {
		if err := sameSamples(ref[i], got[i]); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		for _, s := range got[i] {
			lengths[s.Finish]++
		}
	}
	if lengths[FinishStop]+lengths[FinishLength] != 64 || lengths[FinishStop] == 0 || lengths[FinishLength] == 0 {
		t.Fatalf("finish reasons %v: want all 64 samples complete, by stop and by length", lengths)
	}
	st := e.Stats()
	t.Logf("finish reasons %v, %d preemptions, %d tokens recomputed of %d forwarded", lengths, st.Preemptions, st.Recomputed, st.Tokens)
	if st.Preemptions == 0 {
		t.Fatal("no preemption: the cache was meant to be too small")
	}
}

// TestOnDemandAdmission: with pages on demand, a request whose samples
// could never all hold their max_tokens at once is admitted (one sample at
// its longest must fit), and one whose single sample cannot is refused.
func TestOnDemandAdmission(t *testing.T) {
	cfg := testConfig()
	opts := testOptions()
	opts.KVPages = 16 // 128 slots
	m := newRandomModel(t, cfg, opts, 7)
	reserving := NewEngine(m, EngineConfig{})
	wide := Request{ID: "wide", Prompt: prompt(1, 10, cfg.VocabSize), N: 8, Params: SamplingParams{Temperature: 1, MaxTokens: 100, Seed: 1}}
	if _, err := reserving.Submit(wide); err == nil {
		t.Fatal("reserving the whole max_tokens: a request of 8 x 110 tokens was accepted by a cache of 128 slots")
	}
	e := startEngine(t, m, EngineConfig{KVOnDemand: true})
	got := generate(t, e, wide)
	for _, s := range got {
		if s.Finish != FinishLength || len(s.Tokens) != 100 {
			t.Fatalf("sample %d: %d tokens, finish %s", s.Index, len(s.Tokens), s.Finish)
		}
	}
	long := Request{ID: "long", Prompt: prompt(2, 40, cfg.VocabSize), N: 1, Params: SamplingParams{Temperature: 1, MaxTokens: 100, Seed: 1}}
	if _, err := e.Submit(long); err == nil {
		t.Fatal("a sample of 140 tokens was accepted by a cache of 128 slots")
	}
}

// multiTurn returns the requests of a multi-turn episode: each turn's
// prompt is the previous turn's prompt followed by new tokens, so every
// turn after the first starts with a prefix the cache holds.
func multiTurn(cfg Config, id string, seed uint64, turns int) []Request {
	var p []int32
	out := make([]Request, turns)
	for i := range out {
		p = append(p, prompt(seed+uint64(i), 9+5*i, cfg.VocabSize)...)
		out[i] = Request{ID: fmt.Sprintf("%s-%d", id, i), Prompt: slices.Clone(p), N: 2,
			Params: SamplingParams{Temperature: 1, MaxTokens: 12, Seed: seed + uint64(i), RoutedExperts: true}}
	}
	return out
}

// TestPrefixHitEqualsCold: with the prefix cache, turns of multi-turn
// episodes share the KV pages of their common prefixes, and every sample
// is bitwise what a cold engine (no cache) produces; hits are counted.
func TestPrefixHitEqualsCold(t *testing.T) {
	cfg := testConfig()
	for _, recipe := range []moe.Recipe{moe.RecipeBF16, moe.RecipePerToken, moe.RecipePerTensor, moe.RecipeUnitScale} {
		t.Run(string(recipe), func(t *testing.T) {
			opts := testOptions()
			opts.Recipe = recipe
			cold := startEngine(t, newRandomModel(t, cfg, opts, 8), EngineConfig{})
			warm := startEngine(t, newRandomModel(t, cfg, opts, 8), EngineConfig{PrefixCache: true})
			for ep := range 3 {
				for _, req := range multiTurn(cfg, fmt.Sprint("ep", ep), uint64(10*ep), 4) {
					want, got := generate(t, cold, req), generate(t, warm, req)
					if err := sameSamples(want, got); err != nil {
						t.Fatalf("%s, prefix cache vs cold: %v", req.ID, err)
					}
					if err := sameRouting(want, got); err != nil {
						t.Fatalf("%s, prefix cache vs cold: %v", req.ID, err)
					}
				}
			}
			st := warm.Stats()
			t.Logf("%d of %d prompt tokens from the prefix cache, %d pages cached", st.PrefixHits, st.PromptTokens, st.CachedPages)
			if st.PrefixHits == 0 || st.PrefixHits*3 < st.PromptTokens {
				t.Fatalf("stats %+v: want most prompt tokens of the later turns from the cache", st)
			}
			if cs := cold.Stats(); cs.PrefixHits != 0 || cs.CachedPages != 0 {
				t.Fatalf("cold engine: stats %+v", cs)
			}
		})
	}
}

// TestNoPrefixHitAcrossVersions: a prompt cached under one policy version
// is not reused after a weight commit moves the version: the request
// after the commit is prefilled whole, and its samples are bitwise those
// of a cold engine loaded with the new weights. Under the same version the
// same prompt does hit.
func TestNoPrefixHitAcrossVersions(t *testing.T) {
	cfg := testConfig()
	opts := testOptions()
	m := newRandomModel(t, cfg, opts, 9)
	e := startEngine(t, m, EngineConfig{PrefixCache: true, Version: 1})
	req := Request{ID: "p", Prompt: prompt(3, 40, cfg.VocabSize), N: 2, Params: SamplingParams{Temperature: 1, MaxTokens: 10, Seed: 3}}
	first := generate(t, e, req)
	hits := e.Stats().PrefixHits
	if again := generate(t, e, req); sameSamples(first, again) != nil || e.Stats().PrefixHits == hits {
		t.Fatalf("same prompt, same version: want a prefix hit and the same samples (hits %d -> %d)", hits, e.Stats().PrefixHits)
	}

	if err := e.AtBoundary(t.Context(), func() error {
		fillRandom(t, m, 10)
		e.SetVersion(2)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	hits = e.Stats().PrefixHits
	got := generate(t, e, req)
	if st := e.Stats(); st.PrefixHits != hits {
		t.Fatalf("after the version change: %d prompt tokens from the cache, want 0", st.PrefixHits-hits)
	}
	want := generate(t, startEngine(t, newRandomModel(t, cfg, opts, 10), EngineConfig{}), req)
	if err := sameSamples(want, got); err != nil {
		t.Fatalf("after the version change vs a cold engine with the new weights: %v", err)
	}
	for _, s := range got {
		if len(s.Versions) == 0 || s.Versions[0] != 2 {
			t.Fatalf("sample %d versions %v, want 2", s.Index, s.Versions)
		}
	}
}

// TestPrefixCacheWithPreemption: the prefix cache and KV pages on demand
// together, through a cache too small for the work: cached pages are
// evicted when pages run short, preempted samples reuse cached prefixes
// when recomputed, and every sample is bitwise as on a large cache.
func TestPrefixCacheWithPreemption(t *testing.T) {
	cfg := testConfig()
	opts := testOptions()
	eps := make([][]Request, 4)
	for ep := range eps {
		eps[ep] = multiTurn(cfg, fmt.Sprint("ep", ep), uint64(20*ep), 3)
	}
	var reqs []Request // turn by turn: the four episodes' first turns, then their second, ...
	for turn := range 3 {
		for ep := range eps {
			reqs = append(reqs, eps[ep][turn])
		}
	}
	for i := range reqs {
		reqs[i].Params.MaxTokens = 40
	}
	opts.KVPages = 512
	ref := generateAll(t, startEngine(t, newRandomModel(t, cfg, opts, 11), EngineConfig{}), reqs)
	opts.KVPages = 24
	e := startEngine(t, newRandomModel(t, cfg, opts, 11), EngineConfig{KVOnDemand: true, PrefixCache: true})
	got := make([][]Sample, len(reqs))
	for i := 0; i < len(reqs); i += 4 { // a turn at a time: later turns find earlier ones cached
		copy(got[i:], generateAll(t, e, reqs[i:min(i+4, len(reqs))]))
	}
	for i := range reqs {
		if err := sameSamples(ref[i], got[i]); err != nil {
			t.Fatalf("%s: %v", reqs[i].ID, err)
		}
		if err := sameRouting(ref[i], got[i]); err != nil {
			t.Fatalf("%s: %v", reqs[i].ID, err)
		}
	}
	st := e.Stats()
	t.Logf("%d preemptions, %d of %d prompt tokens from the cache, %d cached pages evicted, %d cached at the end",
		st.Preemptions, st.PrefixHits, st.PromptTokens, st.Evicted, st.CachedPages)
	if st.Preemptions == 0 || st.PrefixHits == 0 || st.Evicted == 0 {
		t.Fatalf("stats %+v: want preemptions, prefix hits and evictions", st)
	}
}
