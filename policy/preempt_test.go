package policy

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

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
	for _, recipe := range []moe.Recipe{moe.RecipeBF16, moe.RecipePerToken} {
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
