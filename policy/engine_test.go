package policy

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
)

func testConfig() Config {
	return Config{Architecture: "Qwen3MoeForCausalLM", VocabSize: 128, Hidden: 64, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
		MaxPositions: 256, Experts: 8, TopK: 2, MoEIntermediate: 32, NormTopK: true, Activation: moe.SwiGLU,
		RMSNormEps: 1e-6, RopeTheta: 10000, QKNorm: true}
}

func testOptions() ModelOptions {
	return ModelOptions{Recipe: moe.RecipeBF16, MaxTokens: 128, MaxSeqs: 48, MaxLogitRows: 128, KVPages: 256, PageSize: 8}
}

// newRandomModel fills every weight with seeded random values: norms 1,
// matrices N(0, 1/fan_in), embeddings N(0, 1).
func newRandomModel(t testing.TB, cfg Config, opts ModelOptions, seed uint64) *Model {
	t.Helper()
	be := testBackend(t)
	m, err := NewModel(be, cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Error(err)
		}
	})
	fillRandom(t, m, seed)
	if opts.Recipe == moe.RecipePerTensor {
		// Fixed input scales, so that models of other weights (a refit's
		// before and after) quantize alike: FC1 inputs (normed, about
		// N(0, 1)) up to 5.25, FC2 inputs up to 1.3 unsaturated.
		s := make([]InputScales, cfg.Layers)
		for i := range s {
			s[i] = InputScales{FC1: 1.0 / 512, FC2: 1.0 / 2048}
		}
		if err := m.SetInputScales(s); err != nil {
			t.Fatal(err)
		}
	}
	return m
}

// fillRandom writes newRandomModel's weights for seed into m and
// requantizes its experts.
func fillRandom(t testing.TB, m *Model, seed uint64) {
	t.Helper()
	be := m.Backend()
	targets, err := m.Tensors()
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(seed, 7))
	for _, tg := range targets {
		n := tg.Size() / 2
		data := make([]byte, 2*n)
		std := 1 / math.Sqrt(float64(tg.Shape[len(tg.Shape)-1]))
		norm := len(tg.Shape) == 1
		if strings.Contains(tg.Name, "embed_tokens") {
			std = 1
		}
		for i := range n {
			v := float32(r.NormFloat64() * std)
			if norm {
				v = 1
			}
			binary.LittleEndian.PutUint16(data[2*i:], bf16.FromFloat32(v))
		}
		if err := be.Upload(tg.Buffer, tg.Offset, data); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Requantize(); err != nil {
		t.Fatal(err)
	}
}

// testBackend returns the backend the engine tests run on: a fresh CPU
// backend, unless a GPU test (gpu_test.go) has swapped in the CUDA one for
// the tests it reruns.
var testBackend = func(t testing.TB) kernels.Backend {
	t.Helper()
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return be
}

// startEngine runs an engine over m until the test ends.
func startEngine(t testing.TB, m *Model, cfg EngineConfig) *Engine {
	t.Helper()
	e := NewEngine(m, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("engine: %v", err)
		}
	})
	return e
}

// collect waits for all of a request's samples, ordered by index.
func collect(t testing.TB, h *Handle) []Sample {
	t.Helper()
	var out []Sample
	timeout := time.After(60 * time.Second)
	for {
		select {
		case s, ok := <-h.Samples():
			if !ok {
				slices.SortFunc(out, func(a, b Sample) int { return a.Index - b.Index })
				return out
			}
			out = append(out, s)
		case <-timeout:
			t.Fatalf("request %s: timed out with %d samples", h.id, len(out))
		}
	}
}

func generate(t testing.TB, e *Engine, req Request) []Sample {
	t.Helper()
	h, err := e.Submit(req)
	if err != nil {
		t.Fatal(err)
	}
	return collect(t, h)
}

// generateAll submits every request at once and collects their samples.
func generateAll(t testing.TB, e *Engine, reqs []Request) [][]Sample {
	t.Helper()
	hs := make([]*Handle, len(reqs))
	for i, r := range reqs {
		var err error
		if hs[i], err = e.Submit(r); err != nil {
			t.Fatal(err)
		}
	}
	out := make([][]Sample, len(hs))
	for i, h := range hs {
		out[i] = collect(t, h)
	}
	return out
}

func prompt(seed uint64, n, vocab int) []int32 {
	r := rand.New(rand.NewPCG(seed, 11))
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(r.IntN(vocab))
	}
	return p
}

func sameSamples(a, b []Sample) error {
	if len(a) != len(b) {
		return fmt.Errorf("%d samples vs %d", len(a), len(b))
	}
	for i := range a {
		if !slices.Equal(a[i].Tokens, b[i].Tokens) {
			return fmt.Errorf("sample %d tokens %v vs %v", i, a[i].Tokens, b[i].Tokens)
		}
		for j := range a[i].LogProbs {
			if math.Float32bits(a[i].LogProbs[j]) != math.Float32bits(b[i].LogProbs[j]) {
				return fmt.Errorf("sample %d logprob %d: %v vs %v", i, j, a[i].LogProbs[j], b[i].LogProbs[j])
			}
		}
		if a[i].Finish != b[i].Finish {
			return fmt.Errorf("sample %d finish %s vs %s", i, a[i].Finish, b[i].Finish)
		}
	}
	return nil
}

func TestGenerateDeterministic(t *testing.T) {
	cfg := testConfig()
	m := newRandomModel(t, cfg, testOptions(), 1)
	e := startEngine(t, m, EngineConfig{})
	req := Request{ID: "a", Prompt: prompt(1, 13, cfg.VocabSize), N: 4,
		Params: SamplingParams{Temperature: 1, MaxTokens: 20, Seed: 42}}
	first := generate(t, e, req)
	if len(first) != 4 {
		t.Fatalf("%d samples, want 4", len(first))
	}
	for _, s := range first {
		if len(s.Tokens) != 20 || s.Finish != FinishLength || len(s.LogProbs) != 20 || len(s.Versions) != 20 {
			t.Fatalf("sample %d: %d tokens, %d logprobs, %d versions, finish %s", s.Index, len(s.Tokens), len(s.LogProbs), len(s.Versions), s.Finish)
		}
	}
	if slices.Equal(first[0].Tokens, first[1].Tokens) {
		t.Error("samples 0 and 1 drew the same 20 tokens: the sample index does not reach the RNG")
	}
	if err := sameSamples(first, generate(t, e, req)); err != nil {
		t.Fatalf("same seed, different result: %v", err)
	}
	req.Params.Seed = 43
	if err := sameSamples(first, generate(t, e, req)); err == nil {
		t.Fatal("another seed gave the same samples")
	}
}

// TestBatchInvariantSamples: a sample's tokens and logprobs are bitwise the
// same whether its request runs alone or with 31 other requests in flight.
func TestBatchInvariantSamples(t *testing.T) {
	cfg := testConfig()
	for _, recipe := range []moe.Recipe{moe.RecipeBF16, moe.RecipePerToken, moe.RecipePerTensor, moe.RecipeUnitScale} {
		t.Run(string(recipe), func(t *testing.T) {
			opts := testOptions()
			opts.Recipe = recipe
			m := newRandomModel(t, cfg, opts, 2)
			e := startEngine(t, m, EngineConfig{})
			target := Request{ID: "target", Prompt: prompt(5, 21, cfg.VocabSize), N: 2,
				Params: SamplingParams{Temperature: 0.8, TopP: 0.9, TopK: 50, MaxTokens: 24, Seed: 7}}
			alone := generate(t, e, target)

			handles := make([]*Handle, 0, 32)
			for i := range 31 {
				h, err := e.Submit(Request{ID: fmt.Sprint("other", i), Prompt: prompt(uint64(100+i), 3+i%17, cfg.VocabSize), N: 1 + i%3,
					Params: SamplingParams{Temperature: 1, MaxTokens: 5 + i%29, Seed: uint64(i)}})
				if err != nil {
					t.Fatal(err)
				}
				handles = append(handles, h)
				if i == 15 { // the target joins a batch already decoding
					h, err := e.Submit(target)
					if err != nil {
						t.Fatal(err)
					}
					handles = append(handles, h)
				}
			}
			var crowded []Sample
			for _, h := range handles {
				got := collect(t, h)
				if h.id == "target" {
					crowded = got
				}
			}
			if err := sameSamples(alone, crowded); err != nil {
				t.Fatalf("alone vs with 31 others: %v", err)
			}
		})
	}
}

// TestContinuousBatching pushes 200 requests of mixed lengths through a KV
// cache that holds only a few at a time; every one completes, and a sample
// of them equals the same request run alone on a fresh engine.
func TestContinuousBatching(t *testing.T) {
	cfg := testConfig()
	opts := testOptions()
	opts.KVPages = 40 // 320 token slots: a handful of requests at once
	m := newRandomModel(t, cfg, opts, 3)
	e := startEngine(t, m, EngineConfig{})
	r := rand.New(rand.NewPCG(9, 9))
	reqs := make([]Request, 200)
	handles := make([]*Handle, len(reqs))
	for i := range reqs {
		reqs[i] = Request{ID: fmt.Sprint("r", i), Prompt: prompt(uint64(i), 1+r.IntN(40), cfg.VocabSize), N: 1 + r.IntN(3),
			Params: SamplingParams{Temperature: 1, MaxTokens: 1 + r.IntN(30), Seed: uint64(i), Stop: []int32{int32(r.IntN(cfg.VocabSize))}}}
		var err error
		if handles[i], err = e.Submit(reqs[i]); err != nil {
			t.Fatal(err)
		}
	}
	results := make([][]Sample, len(reqs))
	for i, h := range handles {
		results[i] = collect(t, h)
		if len(results[i]) != reqs[i].N {
			t.Fatalf("request %d: %d samples, want %d", i, len(results[i]), reqs[i].N)
		}
		for _, s := range results[i] {
			stop := reqs[i].Params.Stop[0]
			switch {
			case s.Finish == FinishStop && s.Tokens[len(s.Tokens)-1] != stop:
				t.Fatalf("request %d sample %d: finish stop without the stop token", i, s.Index)
			case s.Finish == FinishLength && len(s.Tokens) != reqs[i].Params.MaxTokens:
				t.Fatalf("request %d sample %d: finish length after %d of %d tokens", i, s.Index, len(s.Tokens), reqs[i].Params.MaxTokens)
			case s.Finish == FinishAbort:
				t.Fatalf("request %d sample %d aborted", i, s.Index)
			}
		}
	}
	if err := e.AtBoundary(context.Background(), func() error {
		if n := e.pages.InUse(); n != 0 || e.pages.Reserved() != 0 {
			return fmt.Errorf("after all requests: %d pages in use, %d reserved", n, e.pages.Reserved())
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	fresh := startEngine(t, newRandomModel(t, cfg, testOptions(), 3), EngineConfig{})
	for _, i := range []int{0, 57, 123, 199} {
		if err := sameSamples(results[i], generate(t, fresh, reqs[i])); err != nil {
			t.Fatalf("request %d in the crowd vs alone: %v", i, err)
		}
	}
}

// TestScoreMatchesGeneration: the logprob a sample reports for each token at
// temperature 1 is what teacher forcing scores for it.
func TestScoreMatchesGeneration(t *testing.T) {
	cfg := testConfig()
	m := newRandomModel(t, cfg, testOptions(), 4)
	e := startEngine(t, m, EngineConfig{})
	p := prompt(3, 17, cfg.VocabSize)
	got := generate(t, e, Request{ID: "g", Prompt: p, N: 2, Params: SamplingParams{Temperature: 1, MaxTokens: 30, Seed: 1}})
	for _, s := range got {
		full := append(slices.Clone(p), s.Tokens...)
		scores, err := e.Score(context.Background(), [][]int32{full})
		if err != nil {
			t.Fatal(err)
		}
		if len(scores[0]) != len(full)-1 {
			t.Fatalf("%d scores for %d tokens", len(scores[0]), len(full))
		}
		for i, lp := range s.LogProbs {
			if want := scores[0][len(p)-1+i]; math.Abs(float64(lp-want)) > 1e-5 {
				t.Fatalf("sample %d token %d: generation logprob %v, scoring %v", s.Index, i, lp, want)
			}
		}
	}
}

// TestVersionsAcrossCommit: tokens carry the policy version they were
// produced under; a rollout spanning a commit shows both.
func TestVersionsAcrossCommit(t *testing.T) {
	cfg := testConfig()
	m := newRandomModel(t, cfg, testOptions(), 5)
	e := startEngine(t, m, EngineConfig{Version: 1})
	h, err := e.Submit(Request{ID: "v", Prompt: prompt(1, 5, cfg.VocabSize), N: 1, Params: SamplingParams{Temperature: 1, MaxTokens: 200, Seed: 3}})
	if err != nil {
		t.Fatal(err)
	}
	for e.Stats().Generated < 3 { // let a few tokens be produced under version 1
		time.Sleep(100 * time.Microsecond)
	}
	if err := e.AtBoundary(context.Background(), func() error { e.SetVersion(2); return nil }); err != nil {
		t.Fatal(err)
	}
	s := collect(t, h)[0]
	if s.Versions[0] != 1 || s.Versions[len(s.Versions)-1] != 2 {
		t.Fatalf("versions run from %d to %d, want 1 to 2", s.Versions[0], s.Versions[len(s.Versions)-1])
	}
	for i := 1; i < len(s.Versions); i++ {
		if s.Versions[i] < s.Versions[i-1] {
			t.Fatalf("version went back at token %d", i)
		}
	}
}

func TestAbortAndStop(t *testing.T) {
	cfg := testConfig()
	m := newRandomModel(t, cfg, testOptions(), 6)
	e := NewEngine(m, EngineConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	long := Request{ID: "long", Prompt: prompt(2, 9, cfg.VocabSize), N: 3, Params: SamplingParams{Temperature: 1, MaxTokens: 240, Seed: 5}}
	h1, err := e.Submit(long)
	if err != nil {
		t.Fatal(err)
	}
	h2, err := e.Submit(long)
	if err != nil {
		t.Fatal(err)
	}
	h1.Abort()
	got1 := collect(t, h1)
	if len(got1) != 3 {
		t.Fatalf("aborted request delivered %d samples, want 3", len(got1))
	}
	for _, s := range got1 {
		if s.Finish != FinishAbort {
			t.Fatalf("aborted request: sample %d finished %s", s.Index, s.Finish)
		}
	}
	// Abort a request while its samples are decoding: they come back
	// aborted with the tokens they had, and every page is returned.
	for e.Stats().Generated < 3*5 {
		time.Sleep(100 * time.Microsecond)
	}
	h2.Abort()
	for _, s := range collect(t, h2) {
		if s.Finish != FinishAbort || len(s.Tokens) == 0 || len(s.Tokens) >= 240 {
			t.Fatalf("sample %d aborted while running: finish %s with %d tokens", s.Index, s.Finish, len(s.Tokens))
		}
	}
	if err := e.AtBoundary(context.Background(), func() error {
		if e.pages.InUse() != 0 || e.pages.Reserved() != 0 {
			return fmt.Errorf("after aborts: %d pages in use, %d reserved", e.pages.InUse(), e.pages.Reserved())
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	h2, err = e.Submit(long)
	if err != nil {
		t.Fatal(err)
	}
	cancel() // the engine stops: h2's samples end as aborted, none lost
	got := collect(t, h2)
	if len(got) != 3 {
		t.Fatalf("%d samples after shutdown, want 3", len(got))
	}
	for _, s := range got {
		if s.Finish != FinishAbort && s.Finish != FinishLength {
			t.Fatalf("sample %d: finish %s", s.Index, s.Finish)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := e.Submit(long); err == nil {
		t.Fatal("Submit after the engine stopped succeeded")
	}
}

func TestSubmitErrors(t *testing.T) {
	cfg := testConfig()
	m := newRandomModel(t, cfg, testOptions(), 7)
	e := NewEngine(m, EngineConfig{})
	ok := SamplingParams{Temperature: 1, MaxTokens: 4}
	for _, tc := range []struct {
		name string
		req  Request
		want string
	}{
		{"empty prompt", Request{N: 1, Params: ok}, "empty prompt"},
		{"token outside vocabulary", Request{Prompt: []int32{1, 128}, N: 1, Params: ok}, "outside the vocabulary"},
		{"negative token", Request{Prompt: []int32{-1}, N: 1, Params: ok}, "outside the vocabulary"},
		{"n = 0", Request{Prompt: []int32{1}, Params: ok}, "n = 0"},
		{"n too large", Request{Prompt: []int32{1}, N: 49, Params: ok}, "exceeds"},
		{"max_tokens 0", Request{Prompt: []int32{1}, N: 1, Params: SamplingParams{Temperature: 1}}, "max_tokens"},
		{"context", Request{Prompt: make([]int32, 200), N: 1, Params: SamplingParams{MaxTokens: 57}}, "exceeds the context"},
		{"negative temperature", Request{Prompt: []int32{1}, N: 1, Params: SamplingParams{Temperature: -1, MaxTokens: 1}}, "temperature"},
		{"top_p above 1", Request{Prompt: []int32{1}, N: 1, Params: SamplingParams{TopP: 1.5, MaxTokens: 1}}, "top_p"},
		{"negative top_k", Request{Prompt: []int32{1}, N: 1, Params: SamplingParams{TopK: -1, MaxTokens: 1}}, "top_k"},
		{"kv cache", Request{Prompt: make([]int32, 100), N: 40, Params: SamplingParams{MaxTokens: 150}}, "KV pages"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := e.Submit(tc.req); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// TestGraphReplayMatchesEager: decode steps replayed from captured graphs
// (padded to buckets) give bitwise the samples of eager execution, and
// nothing is recaptured, including across a weight commit.
func TestGraphReplayMatchesEager(t *testing.T) {
	cfg := testConfig()
	opts := testOptions()
	for _, recipe := range []moe.Recipe{moe.RecipeBF16, moe.RecipePerToken, moe.RecipePerTensor, moe.RecipeUnitScale} {
		t.Run(string(recipe), func(t *testing.T) {
			opts.Recipe = recipe
			eager := startEngine(t, newRandomModel(t, cfg, opts, 10), EngineConfig{})
			m := newRandomModel(t, cfg, opts, 10)
			g, err := NewGraphs(m, DefaultBuckets(opts.MaxSeqs), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { g.Close() })
			graphed := startEngine(t, m, EngineConfig{Graphs: g})
			reqs := []Request{
				{ID: "a", Prompt: prompt(1, 11, cfg.VocabSize), N: 3, Params: SamplingParams{Temperature: 1, MaxTokens: 25, Seed: 1}},
				{ID: "b", Prompt: prompt(2, 4, cfg.VocabSize), N: 5, Params: SamplingParams{Temperature: 0.7, TopK: 20, MaxTokens: 17, Seed: 2}},
				{ID: "c", Prompt: prompt(3, 30, cfg.VocabSize), N: 1, Params: SamplingParams{Temperature: 0, MaxTokens: 12}},
			}
			run := func(e *Engine) [][]Sample { return generateAll(t, e, reqs) }
			want, got := run(eager), run(graphed)
			for i := range reqs {
				if err := sameSamples(want[i], got[i]); err != nil {
					t.Fatalf("request %s, graphs vs eager: %v", reqs[i].ID, err)
				}
			}
			st := g.Stats()
			if st.Replays == 0 || st.Captures == 0 || st.Recaptures != 0 {
				t.Fatalf("graph stats %+v: want replays, captures and no recapture", st)
			}
			// Same requests, again: replays, and no bucket captured twice.
			// (How the engine's steps batch the samples depends on when the
			// requests arrive, so this round may reach a bucket the first did
			// not and capture it once.)
			run(graphed)
			if st2 := g.Stats(); st2.Recaptures != 0 || st2.Replays <= st.Replays {
				t.Fatalf("second round: stats %+v after %+v", st2, st)
			}
		})
	}
}

// TestRoutedExperts: with RoutedExperts each token carries, per layer, the k
// distinct experts of the forward pass that produced it; every sample's
// first token comes from the same prompt row, so they agree there.
func TestRoutedExperts(t *testing.T) {
	cfg := testConfig()
	e := startEngine(t, newRandomModel(t, cfg, testOptions(), 12), EngineConfig{})
	p := prompt(8, 10, cfg.VocabSize)
	got := generate(t, e, Request{ID: "r", Prompt: p, N: 3, Params: SamplingParams{Temperature: 1, MaxTokens: 9, Seed: 4, RoutedExperts: true}})
	for _, s := range got {
		if len(s.Routed) != len(s.Tokens) {
			t.Fatalf("sample %d: %d routing entries for %d tokens", s.Index, len(s.Routed), len(s.Tokens))
		}
		for i, ids := range s.Routed {
			if len(ids) != cfg.Layers*cfg.TopK {
				t.Fatalf("token %d: %d ids, want %d", i, len(ids), cfg.Layers*cfg.TopK)
			}
			for l := range cfg.Layers {
				layer := ids[l*cfg.TopK : (l+1)*cfg.TopK]
				for j, id := range layer {
					if id < 0 || int(id) >= cfg.Experts || slices.Contains(layer[:j], id) {
						t.Fatalf("token %d layer %d: experts %v", i, l, layer)
					}
				}
			}
		}
		if !slices.Equal(s.Routed[0], got[0].Routed[0]) {
			t.Fatalf("sample %d's first token routed %v, sample 0's %v", s.Index, s.Routed[0], got[0].Routed[0])
		}
	}
	plain := generate(t, e, Request{ID: "p", Prompt: p, N: 1, Params: SamplingParams{Temperature: 1, MaxTokens: 3}})
	if plain[0].Routed != nil {
		t.Fatal("routing returned without being asked for")
	}
}

// TestLongPromptsChunked: prompts longer than a step's token budget are
// prefilled in chunks, and the result is bitwise the one of a roomy engine;
// so is a step whose sampling rows do not fit (few logit rows).
func TestLongPromptsChunked(t *testing.T) {
	cfg := testConfig()
	reqs := []Request{
		{ID: "long", Prompt: prompt(21, 40, cfg.VocabSize), N: 6, Params: SamplingParams{Temperature: 1, MaxTokens: 9, Seed: 1}},
		{ID: "short", Prompt: prompt(22, 3, cfg.VocabSize), N: 2, Params: SamplingParams{Temperature: 1, MaxTokens: 12, Seed: 2}},
		{ID: "mid", Prompt: prompt(23, 17, cfg.VocabSize), N: 3, Params: SamplingParams{Temperature: 0.5, MaxTokens: 5, Seed: 3}},
	}
	run := func(opts ModelOptions) [][]Sample {
		return generateAll(t, startEngine(t, newRandomModel(t, cfg, opts, 13), EngineConfig{}), reqs)
	}
	tight := testOptions()
	tight.MaxTokens, tight.MaxLogitRows, tight.MaxSeqs = 16, 7, 8
	want, got := run(testOptions()), run(tight)
	for i := range reqs {
		if err := sameSamples(want[i], got[i]); err != nil {
			t.Fatalf("request %s, 16-token steps vs roomy steps: %v", reqs[i].ID, err)
		}
	}
}

// TestGraphsAcrossWeightCommit: after new weights are written in place and
// requantized at a step boundary, the graphs captured before replay them:
// the samples equal those of an eager engine loaded with the new weights,
// and nothing is recaptured.
func TestGraphsAcrossWeightCommit(t *testing.T) {
	for _, recipe := range []moe.Recipe{moe.RecipePerToken, moe.RecipePerTensor, moe.RecipeUnitScale} {
		t.Run(string(recipe), func(t *testing.T) { testGraphsAcrossWeightCommit(t, recipe) })
	}
}

func testGraphsAcrossWeightCommit(t *testing.T, recipe moe.Recipe) {
	cfg := testConfig()
	opts := testOptions()
	opts.Recipe = recipe
	m := newRandomModel(t, cfg, opts, 14)
	g, err := NewGraphs(m, DefaultBuckets(opts.MaxSeqs), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	e := startEngine(t, m, EngineConfig{Graphs: g})
	req := Request{ID: "w", Prompt: prompt(31, 9, cfg.VocabSize), N: 4, Params: SamplingParams{Temperature: 1, MaxTokens: 16, Seed: 9}}
	generate(t, e, req) // captures the buckets it needs
	before := g.Stats()

	next := newRandomModel(t, cfg, opts, 15) // the new weights
	targets, err := next.Tensors()
	if err != nil {
		t.Fatal(err)
	}
	if err := e.AtBoundary(context.Background(), func() error {
		for _, tg := range targets {
			raw := make([]byte, tg.Size())
			if err := next.be.Download(raw, tg.Buffer, tg.Offset); err != nil {
				return err
			}
			live, err := m.Resolve(tg.Name)
			if err != nil {
				return err
			}
			if err := m.be.Upload(live.Buffer, live.Offset, raw); err != nil {
				return err
			}
		}
		return m.Requantize()
	}); err != nil {
		t.Fatal(err)
	}
	got := generate(t, e, req)
	want := generate(t, startEngine(t, next, EngineConfig{}), req)
	if err := sameSamples(want, got); err != nil {
		t.Fatalf("graphs after the commit vs an eager engine with the new weights: %v", err)
	}
	if st := g.Stats(); st.Recaptures != 0 || st.Captures != before.Captures || st.Replays <= before.Replays {
		t.Fatalf("graph stats %+v after the commit, %+v before", st, before)
	}
}

// TestNumericFailureFailsOnlyItsRequest: a request whose logits turn
// non-finite (here a NaN embedding row for one of its prompt tokens) ends
// with one FinishError sample and the rest aborted, while the requests
// beside it in the same steps, including one at the smallest positive
// temperature, run as they would alone, and the engine goes on.
func TestNumericFailureFailsOnlyItsRequest(t *testing.T) {
	cfg := testConfig()
	m := newRandomModel(t, cfg, testOptions(), 1)
	const poisoned = 5
	emb, err := m.Resolve("model.embed_tokens.weight")
	if err != nil {
		t.Fatal(err)
	}
	nan := make([]byte, 2*cfg.Hidden)
	for i := 0; i < len(nan); i += 2 {
		binary.LittleEndian.PutUint16(nan[i:], 0x7fc0)
	}
	if err := m.Backend().Upload(emb.Buffer, emb.Offset+poisoned*len(nan), nan); err != nil {
		t.Fatal(err)
	}
	clean := func(seed uint64) []int32 {
		p := prompt(seed, 9, cfg.VocabSize)
		for i := range p {
			if p[i] == poisoned {
				p[i]++
			}
		}
		return p
	}
	good := Request{ID: "good", Prompt: clean(1), N: 3, Params: SamplingParams{Temperature: 0.9, TopP: 0.95, MaxTokens: 12, Seed: 7}}
	cold := Request{ID: "cold", Prompt: clean(2), N: 2, Params: SamplingParams{Temperature: math.SmallestNonzeroFloat32, TopP: 1, MaxTokens: 12, Seed: 8}}
	greedy := cold
	greedy.ID, greedy.Params.Temperature = "greedy", 0
	bad := Request{ID: "bad", Prompt: append(clean(3), poisoned, 1, 2), N: 4, Params: SamplingParams{Temperature: 1, TopP: 1, MaxTokens: 12, Seed: 9}}

	e := startEngine(t, m, EngineConfig{})
	alone := generate(t, e, good)
	greedyOut := generate(t, e, greedy)
	together := generateAll(t, e, []Request{good, bad, cold})
	if err := sameSamples(alone, together[0]); err != nil {
		t.Fatalf("a request beside a failing one: %v", err)
	}
	failed := 0
	for _, s := range together[1] {
		switch s.Finish {
		case FinishError:
			failed++
			if !strings.Contains(s.Err, "not finite") || len(s.Tokens) != 0 {
				t.Errorf("failed sample %d: %d tokens, error %q", s.Index, len(s.Tokens), s.Err)
			}
		case FinishAbort:
		default:
			t.Errorf("poisoned request's sample %d finished %s, want error or abort", s.Index, s.Finish)
		}
	}
	if failed == 0 || len(together[1]) != bad.N {
		t.Fatalf("poisoned request: %d samples, %d failed; want %d samples and at least one failure", len(together[1]), failed, bad.N)
	}
	for i, s := range together[2] {
		if s.Finish != FinishLength || !slices.Equal(s.Tokens, greedyOut[i].Tokens) {
			t.Fatalf("temperature %v sample %d: %v (%s), want the greedy tokens %v", cold.Params.Temperature, i, s.Tokens, s.Finish, greedyOut[i].Tokens)
		}
		for j, lp := range s.LogProbs {
			if lp != 0 {
				t.Fatalf("temperature %v sample %d token %d: logprob %v, want 0 (all the probability on the argmax)", cold.Params.Temperature, i, j, lp)
			}
		}
	}
	if err := sameSamples(alone, generate(t, e, good)); err != nil {
		t.Fatalf("after the failure: %v", err)
	}
	if st := e.Stats(); st.Failed != uint64(failed) {
		t.Fatalf("Stats().Failed = %d, want %d", st.Failed, failed)
	}
}

// markRecorder is a kernels.Marker that records the groups it is given.
type markRecorder struct{ groups []string }

func (r *markRecorder) Mark(group string) error { r.groups = append(r.groups, group); return nil }

// TestForwardMarksGroups: with a marker set, a forward pass marks its
// groups of ops in order, every layer's MoE marks its router and experts,
// and the last mark ends the last group; without one, nothing is marked.
func TestForwardMarksGroups(t *testing.T) {
	cfg := testConfig()
	m := newRandomModel(t, cfg, testOptions(), 1)
	in := StepInput{Tokens: []int32{3, 4}, Positions: []int32{0, 1}, Slots: []int32{0, 1}, SeqLens: []int32{2},
		QueryStart: []int32{0, 2}, PageTable: [][]int32{{0}}, LogitRows: []int32{1}, Sampling: []SampleRow{{Temperature: 1, TopP: 1}}}
	sh, err := m.Stage(in)
	if err != nil {
		t.Fatal(err)
	}
	rec := &markRecorder{}
	m.SetMarker(rec)
	if err := m.Forward(sh, true); err != nil {
		t.Fatal(err)
	}
	m.SetMarker(nil)
	g := rec.groups
	if len(g) == 0 || g[0] != "embed" || g[len(g)-1] != "" || g[len(g)-2] != "sampling" || g[len(g)-3] != "lm_head" {
		t.Fatalf("marks %q: want embed first, then lm_head, sampling and the end mark", g)
	}
	count := map[string]int{}
	for _, x := range g {
		count[x]++
	}
	if count["router"] != cfg.Layers || count["experts"] != cfg.Layers || count["attention"] != cfg.Layers || count["projections"] != 2*cfg.Layers {
		t.Fatalf("marks per group %v: want router, experts and attention once and projections twice per layer (%d layers)", count, cfg.Layers)
	}
	before := len(rec.groups)
	if err := m.Forward(sh, true); err != nil {
		t.Fatal(err)
	}
	if len(rec.groups) != before {
		t.Fatal("marks recorded after SetMarker(nil)")
	}
}
