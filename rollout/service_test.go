package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

func TestGenerateRoundTrip(t *testing.T) {
	w, c := setup(t, Config{})
	ctx := testCtx(t)
	cfg := w.m.Config()

	// No seed: the worker picks one and echoes it everywhere.
	req := GenerateRequest{Prompt: prompt(10), N: 4, Temperature: 1, MaxTokens: 12, ReturnLogprobs: true, ReturnRoutedExperts: true}
	st, err := c.Generate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	got, sum := checkStream(t, ctx, st, 4)
	if sum.Worker != "w1" || sum.Aborted != 0 || sum.Error != "" || sum.TotalMS <= 0 || sum.QueueMS < 0 || sum.QueueMS > sum.TotalMS {
		t.Errorf("summary %+v", sum)
	}
	tokens := 0
	for _, r := range got {
		tokens += len(r.Tokens)
		if r.Type != TypeSample || r.ID != st.ID() || r.Seed != sum.Seed || r.TimeMS <= 0 {
			t.Errorf("sample %d: type %q id %q seed %d time %v (summary seed %d)", r.Index, r.Type, r.ID, r.Seed, r.TimeMS, sum.Seed)
		}
		if r.FinishReason != FinishLength && r.FinishReason != FinishStop {
			t.Errorf("sample %d: finish %q", r.Index, r.FinishReason)
		}
		if len(r.Tokens) == 0 || len(r.Tokens) > 12 || len(r.LogProbs) != len(r.Tokens) || len(r.Versions) != len(r.Tokens) ||
			len(r.RoutedExperts) != len(r.Tokens) {
			t.Errorf("sample %d: %d tokens, %d logprobs, %d versions, %d routed", r.Index, len(r.Tokens), len(r.LogProbs), len(r.Versions), len(r.RoutedExperts))
		}
		for i, lp := range r.LogProbs {
			if !(lp <= 0) || math.IsInf(float64(lp), 0) {
				t.Errorf("sample %d token %d: logprob %v", r.Index, i, lp)
			}
		}
		for _, v := range r.Versions {
			if v != 1 {
				t.Errorf("sample %d: versions %v, want 1", r.Index, r.Versions)
				break
			}
		}
		for _, ids := range r.RoutedExperts {
			if len(ids) != cfg.Layers*cfg.TopK {
				t.Errorf("sample %d: %d routed experts per token, want %d", r.Index, len(ids), cfg.Layers*cfg.TopK)
				break
			}
		}
	}
	if sum.GeneratedTokens != tokens {
		t.Errorf("summary: %d tokens, samples hold %d", sum.GeneratedTokens, tokens)
	}
	if sum.Seed >= 1<<53 {
		t.Errorf("chosen seed %d does not fit a JSON double", sum.Seed)
	}

	// The echoed seed reproduces the rollout; a fixed seed gives the same
	// tokens twice; another seed gives other tokens.
	req.Seed = seed(sum.Seed)
	again, _, err := c.GenerateAll(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	for i := range got {
		if !slices.Equal(got[i].Tokens, again[i].Tokens) || !slices.Equal(got[i].LogProbs, again[i].LogProbs) {
			t.Errorf("sample %d with the echoed seed: %v, first time %v", i, again[i].Tokens, got[i].Tokens)
		}
	}
	req.Seed, req.ReturnRoutedExperts = seed(12345), false
	a, _, err := c.GenerateAll(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	b, sb, err := c.GenerateAll(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if sb.Seed != 12345 {
		t.Errorf("seed echoed as %d, want 12345", sb.Seed)
	}
	differ := false
	for i := range a {
		if !slices.Equal(a[i].Tokens, b[i].Tokens) {
			t.Errorf("sample %d, same seed: %v then %v", i, a[i].Tokens, b[i].Tokens)
		}
		if a[i].RoutedExperts != nil {
			t.Errorf("sample %d: routed experts sent without being asked", i)
		}
		differ = differ || !slices.Equal(a[i].Tokens, got[i].Tokens)
	}
	if !differ {
		t.Error("seed 12345 gave the same tokens as the chosen seed")
	}

	// Greedy without logprobs: identical samples, no logprobs field.
	g, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(5), N: 2, Temperature: 0, MaxTokens: 6})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(g[0].Tokens, g[1].Tokens) || g[0].LogProbs != nil {
		t.Errorf("greedy samples %v / %v, logprobs %v", g[0].Tokens, g[1].Tokens, g[0].LogProbs)
	}

	if n := w.counter(t, w.svc.met.requests.WithLabelValues("generate", resultOK)); n != 5 {
		t.Errorf("requests_total{generate,ok} = %v, want 5", n)
	}
	waitFor(t, func() bool { return w.counter(t, w.svc.met.queue) == 0 })
}

// TestGenerateStopToken checks a stop id ends a sample with "stop" and the
// stop token included.
func TestGenerateStopToken(t *testing.T) {
	_, c := setup(t, Config{})
	ctx := testCtx(t)
	g, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(5), Temperature: 0, MaxTokens: 6})
	if err != nil {
		t.Fatal(err)
	}
	stop := g[0].Tokens[2]
	s, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(5), Temperature: 0, MaxTokens: 6, Stop: []int32{stop}})
	if err != nil {
		t.Fatal(err)
	}
	i := slices.Index(g[0].Tokens, stop)
	if s[0].FinishReason != FinishStop || !slices.Equal(s[0].Tokens, g[0].Tokens[:i+1]) {
		t.Errorf("stop at %d: %v (%s), unstopped %v", stop, s[0].Tokens, s[0].FinishReason, g[0].Tokens)
	}
}

func TestBadRequests(t *testing.T) {
	w, c := setup(t, Config{Limits: Limits{MaxPromptTokens: 64, MaxTokens: 100, MaxN: 8}})
	ctx := testCtx(t)

	// A good request streams while the bad ones are refused.
	good, err := c.Generate(ctx, GenerateRequest{Prompt: prompt(8), N: 8, Temperature: 1, MaxTokens: 100, Seed: seed(1)})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		checkStream(t, ctx, good, 8)
	}()

	cases := []struct {
		name, body string
		want       []string // substrings of the error
	}{
		{"malformed", `{"schema":"rollout.v1","prompt":[1,2`, []string{"malformed JSON"}},
		{"not json", `hello`, []string{"malformed JSON"}},
		{"empty body", ``, []string{"malformed JSON"}},
		{"trailing", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1} {}`, []string{"data after"}},
		{"no schema", `{"prompt":[1],"max_tokens":1}`, []string{"schema", "missing"}},
		{"wrong schema", `{"schema":"rollout.v0","prompt":[1],"max_tokens":1}`, []string{"schema", "rollout.v0"}},
		{"unknown field", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"max_new_tokens":3}`, []string{"max_new_tokens"}},
		{"field name case", `{"schema":"rollout.v1","Prompt":[1],"max_tokens":1}`, []string{"Prompt", "unknown field"}},
		{"field name upper case", `{"schema":"rollout.v1","prompt":[1],"MAX_TOKENS":1}`, []string{"MAX_TOKENS", "unknown field"}},
		{"prompt past the context", fmt.Sprintf(`{"schema":"rollout.v1","prompt":%s,"max_tokens":1}`, mustJSON(t, prompt(1024))), []string{"prompt:", "1024 tokens"}},
		{"prompt type", `{"schema":"rollout.v1","prompt":"hello","max_tokens":1}`, []string{"prompt"}},
		{"token overflow", `{"schema":"rollout.v1","prompt":[1,4294967296],"max_tokens":1}`, []string{"prompt"}},
		{"empty prompt", `{"schema":"rollout.v1","prompt":[],"max_tokens":1}`, []string{"prompt", "empty"}},
		{"no prompt", `{"schema":"rollout.v1","max_tokens":1}`, []string{"prompt", "empty"}},
		{"long prompt", fmt.Sprintf(`{"schema":"rollout.v1","prompt":%s,"max_tokens":1}`, mustJSON(t, prompt(65))), []string{"prompt", "65 tokens", "64"}},
		{"token out of vocab", `{"schema":"rollout.v1","prompt":[1,512],"max_tokens":1}`, []string{"prompt[1]", "512", "vocabulary"}},
		{"negative token", `{"schema":"rollout.v1","prompt":[-1],"max_tokens":1}`, []string{"prompt[0]", "-1"}},
		{"n zero", `{"schema":"rollout.v1","prompt":[1],"n":0,"max_tokens":1}`, []string{"n: 0", "1..8"}},
		{"n too large", `{"schema":"rollout.v1","prompt":[1],"n":9,"max_tokens":1}`, []string{"n: 9"}},
		{"no max_tokens", `{"schema":"rollout.v1","prompt":[1]}`, []string{"max_tokens", "missing"}},
		{"max_tokens zero", `{"schema":"rollout.v1","prompt":[1],"max_tokens":0}`, []string{"max_tokens: 0"}},
		{"max_tokens over limit", `{"schema":"rollout.v1","prompt":[1],"max_tokens":101}`, []string{"max_tokens: 101", "1..100"}},
		{"negative temperature", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"temperature":-0.5}`, []string{"temperature", "-0.5"}},
		{"top_p zero", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"top_p":0}`, []string{"top_p", "(0, 1]"}},
		{"top_p above one", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"top_p":1.5}`, []string{"top_p: 1.5"}},
		{"negative top_k", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"top_k":-1}`, []string{"top_k: -1"}},
		{"temperature above 1e6", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"temperature":2e6}`, []string{"temperature", "1e6"}},
		{"top_k above the vocabulary", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"top_k":513}`, []string{"top_k: 513"}},
		{"id too long", fmt.Sprintf(`{"schema":"rollout.v1","id":%q,"prompt":[1],"max_tokens":1}`, strings.Repeat("x", 257)), []string{"id: 257 bytes", "256"}},
		{"stop out of vocab", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"stop":[9999]}`, []string{"stop[0]", "9999"}},
		{"negative seed", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"seed":-1}`, []string{"seed"}},
		{"negative wait", `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"min_policy_version":2,"max_wait_ms":-1}`, []string{"max_wait_ms"}},
	}
	for _, tc := range cases {
		msg := rawRequest(t, w.nc, "generate", []byte(tc.body))
		var body ErrorReply
		if err := json.Unmarshal(msg.Data, &body); err != nil {
			t.Errorf("%s: reply %q: %v", tc.name, msg.Data, err)
			continue
		}
		hdr := msg.Header.Get(micro.ErrorHeader)
		if msg.Header.Get(micro.ErrorCodeHeader) != "400" || body.Type != TypeError || body.Code != 400 || body.Reason != ReasonBadRequest ||
			hdr != body.Error || !contains(body.Error, tc.want...) {
			t.Errorf("%s: headers %v, body %+v: want a 400 naming %q", tc.name, msg.Header, body, tc.want)
		}
	}
	// The id of a refused request comes back.
	msg := rawRequest(t, w.nc, "generate", []byte(`{"schema":"rollout.v1","id":"r-7","prompt":[1],"max_tokens":1,"top_p":2}`))
	var body ErrorReply
	if err := json.Unmarshal(msg.Data, &body); err != nil || body.ID != "r-7" {
		t.Errorf("error reply %s: want id r-7", msg.Data)
	}
	// Through the client: an *Error that errors.Is the sentinel.
	_, _, err = c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(4), MaxTokens: 4, TopP: 1.5})
	var e *Error
	if !errors.Is(err, ErrBadRequest) || errors.Is(err, ErrOverloaded) || !errors.As(err, &e) || e.Code != 400 || !strings.Contains(e.Msg, "top_p") {
		t.Errorf("client error %v: want a 400 naming top_p", err)
	}
	// Score and status refuse bad input the same way.
	for _, tc := range []struct{ endpoint, body, want string }{
		{"score", `{"schema":"rollout.v1","sequences":[]}`, "sequences: empty"},
		{"score", `{"schema":"rollout.v1","sequences":[[1,2],[]]}`, "sequences[1]: empty"},
		{"score", `{"schema":"rollout.v1","sequences":[[1,600]]}`, "sequences[0][1]"},
		{"score", `{"sequences":[[1,2]]}`, "schema"},
		{"status", `{"schema":"x"}`, "schema"},
	} {
		msg := rawRequest(t, w.nc, tc.endpoint, []byte(tc.body))
		if msg.Header.Get(micro.ErrorCodeHeader) != "400" || !strings.Contains(msg.Header.Get(micro.ErrorHeader), tc.want) {
			t.Errorf("%s %s: headers %v: want a 400 naming %q", tc.endpoint, tc.body, msg.Header, tc.want)
		}
	}
	<-done
	if n := w.counter(t, w.svc.met.requests.WithLabelValues("generate", ReasonBadRequest)); n != float64(len(cases)+2) {
		t.Errorf("requests_total{generate,bad_request} = %v, want %d", n, len(cases)+2)
	}
}

// TestTruthfulLimits: limits configured beyond what the model can do (a
// context of 1024, 64 sequences a step) are lowered to it in status, which
// reports the context; a request past the context is refused naming the
// field that does not fit.
func TestTruthfulLimits(t *testing.T) {
	w, c := setup(t, Config{Limits: Limits{MaxPromptTokens: 4096, MaxTokens: 4096, MaxN: 100, MaxQueue: 8, MaxWaitingVersion: 100}})
	ctx := testCtx(t)
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := Limits{MaxPromptTokens: 1023, MaxTokens: 1023, MaxN: 64, MaxQueue: 8, MaxScoreSequences: 64, MaxWaitingVersion: 8}
	if st.Context != 1024 || st.Limits != want {
		t.Errorf("status context %d, limits %+v: want 1024, %+v", st.Context, st.Limits, want)
	}
	if w.svc.Config().Limits != want {
		t.Errorf("config limits %+v", w.svc.Config().Limits)
	}
	for _, tc := range []struct {
		name string
		req  GenerateRequest
		want string // prefix of the error
	}{
		{"prompt fills the context", GenerateRequest{Prompt: prompt(1023), MaxTokens: 2}, "max_tokens: 2, at most 1 with a prompt of 1023 tokens"},
		{"prompt past the limit", GenerateRequest{Prompt: prompt(1100), MaxTokens: 1}, "prompt: 1100 tokens, limit 1023"},
		{"max_tokens past the context", GenerateRequest{Prompt: prompt(1000), MaxTokens: 100}, "max_tokens: 100, at most 24"},
		{"n past a step", GenerateRequest{Prompt: prompt(4), N: 65, MaxTokens: 1}, "n: 65, want 1..64"},
	} {
		_, _, err := c.GenerateAll(ctx, tc.req)
		var e *Error
		if !errors.As(err, &e) || e.Code != 400 || !strings.HasPrefix(e.Msg, tc.want) {
			t.Errorf("%s: %v, want a 400 starting %q", tc.name, err, tc.want)
		}
	}
	if _, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(1000), MaxTokens: 24}); err != nil {
		t.Errorf("a request that fills the context exactly: %v", err)
	}
}

// TestOverloaded fills the admission queue with a request waiting for a
// policy version, checks the next one is refused at once, then publishes the
// version and checks the waiting request runs under it.
func TestOverloaded(t *testing.T) {
	w, c := setup(t, Config{Limits: Limits{MaxQueue: 1}})
	ctx := testCtx(t)
	waiting, err := c.Generate(ctx, GenerateRequest{Prompt: prompt(6), N: 2, Temperature: 1, MaxTokens: 5, MinPolicyVersion: 2})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return w.svc.Status().WaitingVersion == 1 })
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.QueueDepth != 1 || st.WaitingVersion != 1 || st.Running != 0 || st.MaxQueue != 1 {
		t.Errorf("status %+v: want one request waiting for its version", st)
	}
	start := time.Now()
	_, _, err = c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(6), MaxTokens: 5})
	if !errors.Is(err, ErrOverloaded) {
		t.Fatalf("second request: %v, want overloaded", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("overloaded reply after %v", d)
	}
	var e *Error
	if errors.As(err, &e); e.Code != 503 || !strings.Contains(e.Msg, "overloaded") {
		t.Errorf("overloaded error %+v", e)
	}
	w.setVersion(t, 2)
	got, _ := checkStream(t, ctx, waiting, 2)
	for _, r := range got {
		for _, v := range r.Versions {
			if v < 2 {
				t.Errorf("sample %d: versions %v, want >= 2", r.Index, r.Versions)
				break
			}
		}
	}
	// The place is free again.
	if _, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(6), MaxTokens: 5}); err != nil {
		t.Errorf("after the queue emptied: %v", err)
	}
	if n := w.counter(t, w.svc.met.requests.WithLabelValues("generate", ReasonOverloaded)); n != 1 {
		t.Errorf("requests_total{generate,overloaded} = %v", n)
	}
}

// TestMinPolicyVersionNotReached checks the bounded wait ends in an error
// reply, and that heartbeats keep the stream alive past the client's idle
// timeout meanwhile.
func TestMinPolicyVersionNotReached(t *testing.T) {
	_, c := setup(t, Config{MaxWaitVersion: 400 * time.Millisecond, Heartbeat: 40 * time.Millisecond})
	ctx := testCtx(t)
	c.IdleTimeout = 150 * time.Millisecond
	start := time.Now()
	_, _, err := c.GenerateAll(ctx, GenerateRequest{ID: "wait-5", Prompt: prompt(4), MaxTokens: 4, MinPolicyVersion: 5})
	var e *Error
	if !errors.Is(err, ErrVersionNotReached) || !errors.As(err, &e) || e.Code != 503 || e.ID != "wait-5" ||
		!strings.Contains(e.Msg, "policy version 5 not reached") {
		t.Fatalf("got %v: want 503 policy version 5 not reached", err)
	}
	if d := time.Since(start); d < 350*time.Millisecond || d > 5*time.Second {
		t.Errorf("error after %v, want after the 400 ms wait", d)
	}
	// The request's own, shorter bound.
	start = time.Now()
	_, _, err = c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(4), MaxTokens: 4, MinPolicyVersion: 5, MaxWaitMS: 100})
	if d := time.Since(start); !errors.Is(err, ErrVersionNotReached) || d < 80*time.Millisecond || d > 350*time.Millisecond {
		t.Errorf("max_wait_ms 100: %v after %v", err, d)
	}
}

// TestMinPolicyVersionCurrentVersion waits through Config.CurrentVersion
// (as serve wires refit.Receiver.CurrentVersion).
func TestMinPolicyVersionCurrentVersion(t *testing.T) {
	var cur atomicVersion
	cur.set(1)
	w, c := setup(t, Config{CurrentVersion: cur.get})
	ctx := testCtx(t)
	st, err := c.Generate(ctx, GenerateRequest{Prompt: prompt(4), MaxTokens: 4, MinPolicyVersion: 3})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return w.svc.snapshot().waiting == 1 })
	time.Sleep(50 * time.Millisecond)
	w.setVersion(t, 3)
	cur.set(3)
	got, _ := checkStream(t, ctx, st, 1)
	if len(got) == 1 && (len(got[0].Versions) == 0 || got[0].Versions[0] != 3) {
		t.Errorf("versions %v, want 3", got[0].Versions)
	}
	if s, err := c.Status(ctx); err != nil || s.Version == nil || *s.Version != 3 {
		t.Errorf("status %+v, %v", s, err)
	}
}

type atomicVersion struct {
	mu sync.Mutex
	v  uint64
}

func (a *atomicVersion) set(v uint64) { a.mu.Lock(); a.v = v; a.mu.Unlock() }
func (a *atomicVersion) get() uint64  { a.mu.Lock(); defer a.mu.Unlock(); return a.v }

func TestScoreAndStatus(t *testing.T) {
	w, c := setup(t, Config{Worker: "worker-a"})
	ctx := testCtx(t)
	seqs := [][]int32{prompt(9), {5}, prompt(40)}
	got, err := c.Score(ctx, seqs)
	if err != nil {
		t.Fatal(err)
	}
	want, err := w.eng.Score(ctx, seqs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range seqs {
		if len(got[i]) != len(seqs[i]) || !math.IsNaN(float64(got[i][0])) || !slices.Equal(got[i][1:], want[i]) {
			t.Errorf("sequence %d: scored %v, engine %v", i, got[i], want[i])
		}
	}
	// null on the wire for the first token.
	msg := rawRequest(t, w.nc, "score", []byte(`{"schema":"rollout.v1","id":"s1","sequences":[[3,4,5]]}`))
	if !strings.HasPrefix(string(msg.Data), `{"type":"score","id":"s1","worker":"worker-a","logprobs":[[null,`) {
		t.Errorf("score reply %s", msg.Data)
	}
	waitFor(t, func() bool { return w.svc.snapshot().depth == 0 }) // a job ends just after its reply

	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Model != testModel || st.Worker != "worker-a" || st.Version == nil || *st.Version != 1 || st.KVPages != 1024 ||
		st.Recipe != "bf16" || st.QueueDepth != 0 || st.Running != 0 || st.Schema != Schema || st.Release != Release ||
		st.Limits.MaxN != 64 || st.Limits.MaxTokens != 1023 || st.MaxQueue != 256 || st.Draining {
		t.Errorf("status %+v", st)
	}
	w.setVersion(t, 9)
	if st, err := c.Status(ctx); err != nil || st.Version == nil || *st.Version != 9 {
		t.Errorf("status after version 9: %+v, %v", st, err)
	}
	// An empty status request is fine too.
	if msg := rawRequest(t, w.nc, "status", nil); msg.Header.Get(micro.ErrorCodeHeader) != "" {
		t.Errorf("empty status request: %v", msg.Header)
	}
}

// TestDiscovery checks the micro control subjects: PING, INFO, STATS.
func TestDiscovery(t *testing.T) {
	w, c := setup(t, Config{Worker: "disc"})
	ctx := testCtx(t)
	if _, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(4), MaxTokens: 3}); err != nil {
		t.Fatal(err)
	}
	_, _, _ = c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(4), MaxTokens: 0}) // a 400
	waitFor(t, func() bool { return w.svc.snapshot().depth == 0 })

	ask := func(verb micro.Verb, id string, out any) {
		t.Helper()
		subj, err := micro.ControlSubject(verb, ServiceName, id)
		if err != nil {
			t.Fatal(err)
		}
		msg, err := w.nc.Request(subj, nil, 5*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", subj, err)
		}
		if err := json.Unmarshal(msg.Data, out); err != nil {
			t.Fatalf("%s: %s: %v", subj, msg.Data, err)
		}
	}
	var ping micro.Ping
	ask(micro.PingVerb, "", &ping)
	if ping.Name != ServiceName || ping.Version != Release || ping.ID == "" || ping.Type != micro.PingResponseType {
		t.Errorf("ping %+v", ping)
	}
	var info micro.Info
	ask(micro.InfoVerb, ping.ID, &info)
	if info.Name != ServiceName || info.Version != Release || info.Metadata["model"] != testModel || info.Metadata["worker"] != "disc" {
		t.Errorf("info %+v", info)
	}
	subjects := map[string]string{}
	for _, e := range info.Endpoints {
		subjects[e.Name] = e.Subject
		want := "rollout"
		if e.Name == "cancel" {
			want = "" // every worker sees a cancel
		}
		if e.QueueGroup != want {
			t.Errorf("endpoint %s: queue group %q, want %q", e.Name, e.QueueGroup, want)
		}
	}
	for _, ep := range []string{"generate", "score", "status", "cancel"} {
		if subjects[ep] != "rollout.tiny."+ep {
			t.Errorf("endpoints %v: want %s on rollout.tiny.%s", subjects, ep, ep)
		}
	}
	// The micro library counts a request once its handler returns, which
	// may be just after the client has its reply: wait for both.
	var stats micro.Stats
	waitFor(t, func() bool {
		stats = micro.Stats{}
		ask(micro.StatsVerb, "", &stats)
		for _, e := range stats.Endpoints {
			if e.Name == "generate" {
				return e.NumRequests == 2
			}
		}
		return false
	})
	if stats.Name != ServiceName || stats.Version != Release || len(stats.Endpoints) != 4 {
		t.Fatalf("stats %+v", stats)
	}
	for _, e := range stats.Endpoints {
		if e.Name != "generate" {
			continue
		}
		var data map[string]any
		if err := json.Unmarshal(e.Data, &data); err != nil {
			t.Errorf("generate stats data %s: %v", e.Data, err)
		}
		if e.NumRequests != 2 || e.NumErrors != 1 || !strings.Contains(e.LastError, "max_tokens") || data["queue_depth"] != 0.0 {
			t.Errorf("generate stats %+v, data %v", e, data)
		}
	}
}

// TestDrainUnderLoad drains a worker with streams in flight and a short
// deadline: every admitted request ends with its summary, each sample
// arrives once, and what did not finish is aborted.
func TestDrainUnderLoad(t *testing.T) {
	w, c := setup(t, Config{Heartbeat: 50 * time.Millisecond})
	ctx := testCtx(t)
	const clients, n = 6, 4
	var wg sync.WaitGroup
	sums := make([]Summary, clients+1)
	samples := make([][]SampleReply, clients+1)
	streams := make([]*Stream, clients+1)
	for i := range clients {
		st, err := c.Generate(ctx, GenerateRequest{ID: fmt.Sprintf("load-%d", i), Prompt: prompt(8 + i), N: n, Temperature: 1, MaxTokens: 900, ReturnLogprobs: true})
		if err != nil {
			t.Fatal(err)
		}
		streams[i] = st
	}
	// And one waiting for a version that never comes.
	st, err := c.Generate(ctx, GenerateRequest{ID: "load-wait", Prompt: prompt(8), N: n, MaxTokens: 10, MinPolicyVersion: 7})
	if err != nil {
		t.Fatal(err)
	}
	streams[clients] = st
	for i, st := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			samples[i], sums[i] = checkStream(t, ctx, st, n)
		}()
	}
	waitFor(t, func() bool {
		s := w.svc.Status()
		return s.Running == clients && s.WaitingVersion == 1 && s.Generated > 0
	})

	dctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := w.svc.Drain(dctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("drain took %v", time.Since(start))
	wg.Wait()
	aborted := 0
	for i, s := range sums {
		aborted += s.Aborted
		if s.Aborted > 0 && !strings.Contains(s.Error, "draining") {
			t.Errorf("stream %d: %d aborted, summary error %q", i, s.Aborted, s.Error)
		}
		for _, r := range samples[i] {
			if r.FinishReason == FinishAbort && len(r.LogProbs) != len(r.Tokens) {
				t.Errorf("stream %d sample %d aborted with %d tokens, %d logprobs", i, r.Index, len(r.Tokens), len(r.LogProbs))
			}
		}
	}
	if sums[clients].Aborted != n {
		t.Errorf("request waiting for its version: summary %+v, want %d aborted samples", sums[clients], n)
	}
	if aborted <= n {
		t.Errorf("%d samples aborted: the deadline should have cut the long ones", aborted)
	}
	if got := w.counter(t, w.svc.met.samples.WithLabelValues(FinishAbort)); got != float64(aborted) {
		t.Errorf("samples_total{abort} = %v, summaries count %d", got, aborted)
	}
	// After the drain: nothing admitted, no responder left.
	_, _, err = c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(4), MaxTokens: 3})
	if !errors.Is(err, nats.ErrNoResponders) && !errors.Is(err, ErrDraining) {
		t.Errorf("generate after drain: %v", err)
	}
	if err := w.svc.Stop(); err != nil {
		t.Errorf("stop after drain: %v", err)
	}
}

// TestDrainRefusesNewWork checks requests arriving during a drain get 503
// "draining" while the in-flight one finishes normally.
func TestDrainRefusesNewWork(t *testing.T) {
	w, c := setup(t, Config{})
	ctx := testCtx(t)
	st, err := c.Generate(ctx, GenerateRequest{Prompt: prompt(8), N: 2, MaxTokens: 5, MinPolicyVersion: 2})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return w.svc.Status().WaitingVersion == 1 })
	drained := make(chan error, 1)
	go func() { drained <- w.svc.Drain(ctx) }()
	waitFor(t, func() bool { return w.svc.Status().Draining })
	_, _, err = c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(4), MaxTokens: 3})
	if !errors.Is(err, ErrDraining) {
		t.Errorf("generate while draining: %v", err)
	}
	if _, err := c.Score(ctx, [][]int32{{1, 2}}); !errors.Is(err, ErrDraining) {
		t.Errorf("score while draining: %v", err)
	}
	if s, err := c.Status(ctx); err != nil || !s.Draining {
		t.Errorf("status while draining: %+v, %v", s, err)
	}
	w.setVersion(t, 2)
	_, sum := checkStream(t, ctx, st, 2)
	if sum.Aborted != 0 {
		t.Errorf("in-flight request during a patient drain: %+v", sum)
	}
	if err := <-drained; err != nil {
		t.Fatal(err)
	}
}

// TestQueueGroup runs two workers (two engines, two connections) in the
// same queue group: requests spread across both.
func TestQueueGroup(t *testing.T) {
	srv := refittest.StartServer(t)
	dir := tinyModelDir(t)
	startWorker(t, srv.URL(), dir, Config{Worker: "wa"})
	startWorker(t, srv.URL(), dir, Config{Worker: "wb"})
	c := NewClient(refittest.Connect(t, srv.URL()), testModel)
	ctx := testCtx(t)
	const requests = 16
	workers := map[string]int{}
	var tokens [][]int32
	for i := range requests {
		got, sum, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(6), MaxTokens: 4, Temperature: 1, Seed: seed(42)})
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		workers[sum.Worker]++
		tokens = append(tokens, got[0].Tokens)
	}
	if workers["wa"] == 0 || workers["wb"] == 0 || workers["wa"]+workers["wb"] != requests {
		t.Errorf("requests per worker %v: want both used", workers)
	}
	// Same checkpoint, same seed: any worker gives the same rollout.
	for i := range tokens {
		if !slices.Equal(tokens[i], tokens[0]) {
			t.Errorf("request %d: %v, request 0: %v", i, tokens[i], tokens[0])
		}
	}
}

func TestNoResponders(t *testing.T) {
	srv := refittest.StartServer(t)
	c := NewClient(refittest.Connect(t, srv.URL()), "nobody")
	ctx := testCtx(t)
	start := time.Now()
	if _, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(4), MaxTokens: 3}); !errors.Is(err, nats.ErrNoResponders) {
		t.Errorf("generate: %v", err)
	}
	if _, err := c.Status(ctx); !errors.Is(err, nats.ErrNoResponders) {
		t.Errorf("status: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("no-responder errors took %v", d)
	}
}

// TestClientIdleTimeout checks a stream whose worker goes silent fails
// with ErrTimeout (here: a subject nobody answers on, but with a listener
// that swallows requests).
func TestClientIdleTimeout(t *testing.T) {
	srv := refittest.StartServer(t)
	nc := refittest.Connect(t, srv.URL())
	if _, err := nc.Subscribe(Subject("mute", "generate"), func(*nats.Msg) {}); err != nil {
		t.Fatal(err)
	}
	c := NewClient(nc, "mute")
	c.IdleTimeout = 100 * time.Millisecond
	_, _, err := c.GenerateAll(testCtx(t), GenerateRequest{Prompt: prompt(4), MaxTokens: 3})
	if !errors.Is(err, ErrTimeout) {
		t.Errorf("got %v, want ErrTimeout", err)
	}
}

// TestStopIdempotent checks Stop aborts in-flight work, ends every stream
// with a summary and may be called again.
func TestStopIdempotent(t *testing.T) {
	w, c := setup(t, Config{})
	ctx := testCtx(t)
	st, err := c.Generate(ctx, GenerateRequest{Prompt: prompt(8), N: 3, Temperature: 1, MaxTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return w.svc.Status().Running == 1 })
	var wg sync.WaitGroup
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.svc.Stop(); err != nil {
				t.Errorf("stop: %v", err)
			}
		}()
	}
	wg.Wait()
	_, sum := checkStream(t, ctx, st, 3)
	if sum.Aborted == 0 {
		t.Errorf("summary %+v: want aborted samples", sum)
	}
	if err := w.svc.Drain(ctx); err != nil {
		t.Errorf("drain after stop: %v", err)
	}
}

// TestForcedSummaries checks the last resort: a job the engine never ends
// (its loop is stuck) still gets its summary after the abort grace.
func TestForcedSummaries(t *testing.T) {
	w, c := setup(t, Config{AbortGrace: 100 * time.Millisecond})
	ctx := testCtx(t)
	block := make(chan struct{})
	// Hold the loop inside a boundary: nothing is stepped or aborted.
	go func() { _ = w.eng.AtBoundary(context.Background(), func() error { <-block; return nil }) }()
	defer close(block)
	time.Sleep(20 * time.Millisecond)
	st, err := c.Generate(ctx, GenerateRequest{Prompt: prompt(8), N: 2, MaxTokens: 5})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return w.svc.snapshot().running == 1 })
	if err := w.svc.Stop(); err != nil {
		t.Fatal(err)
	}
	got, sum := checkStream(t, ctx, st, 2)
	if sum.Aborted != 2 || !strings.Contains(sum.Error, "not returned by the engine") || len(got) != 2 || len(got[0].Tokens) != 0 {
		t.Errorf("summary %+v, samples %+v", sum, got)
	}
}

// waitFor polls cond for up to 10 s.
func waitFor(t testing.TB, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 10 s")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestEngineRefusal checks a request the limits let through but the engine
// refuses (more KV pages than the cache has: 64 x 63 pages of 1024) is a
// 400 too.
func TestEngineRefusal(t *testing.T) {
	_, c := setup(t, Config{})
	_, _, err := c.GenerateAll(testCtx(t), GenerateRequest{Prompt: prompt(4), N: 64, MaxTokens: 1000})
	var e *Error
	if !errors.As(err, &e) || e.Code != 400 || !strings.Contains(e.Msg, "KV pages") {
		t.Errorf("got %v: want a 400 from the engine", err)
	}
}

// TestNumericFailureFailsOnlyItsRequest: every temperature the schema
// accepts generates (down to the smallest positive FP32), and a request
// whose logits turn non-finite gets a sample with finish_reason "error"
// and a summary saying why, while the worker keeps serving.
func TestNumericFailureFailsOnlyItsRequest(t *testing.T) {
	w, c := setup(t, Config{})
	ctx := testCtx(t)
	cfg := w.m.Config()
	const poisoned = 3
	emb, err := w.m.Resolve("model.embed_tokens.weight")
	if err != nil {
		t.Fatal(err)
	}
	nan := make([]byte, 2*cfg.Hidden)
	for i := 1; i < len(nan); i += 2 {
		nan[i-1], nan[i] = 0xc0, 0x7f // BF16 NaN, little endian
	}
	if err := w.m.Backend().Upload(emb.Buffer, emb.Offset+poisoned*len(nan), nan); err != nil {
		t.Fatal(err)
	}

	for _, temp := range []float32{math.SmallestNonzeroFloat32, 1e-38, 1e-6, 1e6} {
		got, sum, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(6), N: 2, Temperature: temp, MaxTokens: 5, Seed: seed(1)})
		if err != nil {
			t.Fatalf("temperature %v: %v", temp, err)
		}
		if len(got) != 2 || sum.Error != "" {
			t.Fatalf("temperature %v: %d samples, summary %+v", temp, len(got), sum)
		}
		for _, r := range got {
			if r.FinishReason != FinishLength || len(r.Tokens) != 5 {
				t.Fatalf("temperature %v sample %d: %d tokens, finish %s", temp, r.Index, len(r.Tokens), r.FinishReason)
			}
		}
	}

	st, err := c.Generate(ctx, GenerateRequest{Prompt: append(prompt(4), poisoned), N: 3, Temperature: 1, MaxTokens: 5, Seed: seed(2)})
	if err != nil {
		t.Fatal(err)
	}
	got, sum := checkStream(t, ctx, st, 3)
	failed := 0
	for _, r := range got {
		if r.FinishReason == FinishError {
			failed++
			if !strings.Contains(r.Error, "not finite") {
				t.Errorf("failed sample %d: error %q, want it to say the logits are not finite", r.Index, r.Error)
			}
		} else if r.FinishReason != FinishAbort {
			t.Errorf("sample %d of the failing request finished %s", r.Index, r.FinishReason)
		}
	}
	if failed == 0 || !strings.Contains(sum.Error, "not finite") {
		t.Fatalf("%d failed samples, summary error %q: want a failure that says why", failed, sum.Error)
	}
	if n := w.counter(t, w.svc.met.requests.WithLabelValues("generate", resultFailed)); n != 1 {
		t.Fatalf("requests{result=failed} = %v, want 1", n)
	}

	got, sum, err = c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(6), N: 2, Temperature: 1, MaxTokens: 5, Seed: seed(3)})
	if err != nil || len(got) != 2 || sum.Error != "" {
		t.Fatalf("after the failure: %d samples, summary %+v, error %v", len(got), sum, err)
	}
}
