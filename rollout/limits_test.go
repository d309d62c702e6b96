package rollout

import (
	"errors"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// TestScoreLimits: score requests beyond the limits, beyond what the KV
// cache can ever hold, or whose reply would not fit the server's max
// payload are refused with a 400 that says which, and the worker goes on
// scoring.
func TestScoreLimits(t *testing.T) {
	const maxPayload = 4096
	srv := refittest.StartServer(t, refittest.WithMaxPayload(maxPayload))
	opts := testModelOptions
	opts.KVPages = 4 // 64 positions
	w := startWorkerWith(t, srv.URL(), tinyModelDir(t), Config{Limits: Limits{MaxScoreSequences: 8}}, opts)
	c := NewClient(refittest.Connect(t, srv.URL()), testModel)
	ctx := testCtx(t)

	for _, tc := range []struct {
		name string
		seqs [][]int32
		want []string
	}{
		{"too many sequences", make([][]int32, 9), []string{"sequences: 9, limit 8"}},
		{"sequence past the context", [][]int32{prompt(3), prompt(1025)}, []string{"sequences[1]: 1025 tokens, limit 1024"}},
		{"sequence the KV cache can never hold", [][]int32{prompt(65)}, []string{"sequence 0 needs 5 KV pages, the cache has 4", "can never fit the KV cache"}},
		{"reply over the max payload", [][]int32{prompt(60), prompt(60), prompt(60), prompt(60), prompt(60), prompt(60), prompt(60), prompt(60)}, []string{"the reply of", "exceeds the server's max payload of 4096"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Score(ctx, tc.seqs)
			var e *Error
			if !errors.As(err, &e) || e.Code != 400 || e.Reason != ReasonBadRequest || !contains(e.Msg, tc.want...) {
				t.Fatalf("score: %v: want a 400 saying %q", err, tc.want)
			}
			if !errors.Is(err, ErrBadRequest) {
				t.Errorf("score: %v does not match ErrBadRequest", err)
			}
		})
	}
	// The worker scores what fits, and the refusals left nothing queued.
	got, err := c.Score(ctx, [][]int32{prompt(20)})
	if err != nil || len(got) != 1 || len(got[0]) != 20 {
		t.Fatalf("score after the refusals: %d rows, %v", len(got), err)
	}
	waitFor(t, func() bool { return w.svc.snapshot().depth == 0 })
}

// TestNoReplySubject: a request published without a reply subject can be
// answered by nothing; it is dropped before it reaches the engine and
// counted, and the endpoints go on serving.
func TestNoReplySubject(t *testing.T) {
	w, c := setup(t, Config{})
	ctx := testCtx(t)
	bodies := map[string][]byte{
		"generate": mustJSON(t, GenerateRequest{Schema: Schema, Prompt: prompt(4), MaxTokens: 400, N: 8, Seed: seed(1)}),
		"score":    mustJSON(t, ScoreRequest{Schema: Schema, Sequences: [][]int32{prompt(8)}}),
		"status":   nil,
	}
	for op, body := range bodies {
		if err := w.nc.Publish(Subject(testModel, op), body); err != nil {
			t.Fatal(err)
		}
	}
	for op := range bodies {
		waitFor(t, func() bool { return w.counter(t, w.svc.met.requests.WithLabelValues(op, resultNoReply)) == 1 })
	}
	if st, err := c.Status(ctx); err != nil || st.Running != 0 || st.QueueDepth != 0 {
		t.Fatalf("status after requests without a reply subject: %+v, %v: want nothing running or queued", st, err)
	}
	if _, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(4), N: 2, MaxTokens: 3, Seed: seed(2)}); err != nil {
		t.Fatalf("generate after them: %v", err)
	}
}

// TestSampleOverMaxPayload: a sample whose message would exceed the
// server's max payload loses its routed experts, then its logprobs, then
// its tokens, in that order and only as far as needed, and says so in its
// warning; the summary still counts every sample and token.
func TestSampleOverMaxPayload(t *testing.T) {
	const maxPayload = 2048
	srv := refittest.StartServer(t, refittest.WithMaxPayload(maxPayload))
	startWorker(t, srv.URL(), tinyModelDir(t), Config{})
	c := NewClient(refittest.Connect(t, srv.URL()), testModel)
	ctx := testCtx(t)

	const omitted = "omitted: the message of"
	for _, tc := range []struct {
		name              string
		maxTokens         int
		logprobs, routed  bool
		wantOmitted       []string // in this order
		tokens, lps, rout bool     // what the sample still carries
	}{
		{"fits", 20, true, true, nil, true, true, true},
		{"routed experts dropped", 100, false, true, []string{"routed_experts"}, true, false, false},
		{"logprobs dropped", 100, true, false, []string{"logprobs"}, true, false, false},
		{"both dropped", 100, true, true, []string{"routed_experts", "logprobs"}, true, false, false},
		{"tokens dropped too", 400, true, true, []string{"routed_experts", "logprobs", "tokens and versions"}, false, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, sum, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(4), N: 2, Temperature: 1, MaxTokens: tc.maxTokens,
				Stop: []int32{}, Seed: seed(5), ReturnLogprobs: tc.logprobs, ReturnRoutedExperts: tc.routed})
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != 2 || sum.Samples != 2 || sum.GeneratedTokens != 2*tc.maxTokens {
				t.Fatalf("%d samples, summary %+v: want 2 samples of %d tokens counted", len(got), sum, tc.maxTokens)
			}
			for _, r := range got {
				if r.FinishReason != FinishLength {
					t.Errorf("sample %d finished %s", r.Index, r.FinishReason)
				}
				// Each omission is named, in order, with the size that forced it.
				rest := r.Warning
				for _, what := range tc.wantOmitted {
					i := strings.Index(rest, what+" "+omitted)
					if i < 0 {
						t.Fatalf("sample %d warning %q: want %q omitted, in order %q", r.Index, r.Warning, what, tc.wantOmitted)
					}
					rest = rest[i+len(what):]
				}
				if strings.Count(r.Warning, omitted) != len(tc.wantOmitted) || (len(tc.wantOmitted) > 0 && !strings.Contains(r.Warning, "max payload of 2048")) {
					t.Errorf("sample %d warning %q: want exactly %q omitted", r.Index, r.Warning, tc.wantOmitted)
				}
				if has := len(r.Tokens) == tc.maxTokens && len(r.Versions) == tc.maxTokens; has != tc.tokens || (!tc.tokens && (len(r.Tokens) != 0 || len(r.Versions) != 0)) {
					t.Errorf("sample %d: %d tokens, %d versions: want tokens %v", r.Index, len(r.Tokens), len(r.Versions), tc.tokens)
				}
				if has := len(r.LogProbs) == tc.maxTokens; has != tc.lps || (!tc.lps && len(r.LogProbs) != 0) {
					t.Errorf("sample %d: %d logprobs: want them %v", r.Index, len(r.LogProbs), tc.lps)
				}
				if has := len(r.RoutedExperts) == tc.maxTokens; has != tc.rout || (!tc.rout && len(r.RoutedExperts) != 0) {
					t.Errorf("sample %d: %d routed rows: want them %v", r.Index, len(r.RoutedExperts), tc.rout)
				}
			}
		})
	}
}
