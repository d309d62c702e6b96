package rollout

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

var testLimits = Limits{MaxPromptTokens: 64, MaxTokens: 100, MaxN: 8, MaxQueue: 4, MaxScoreSequences: 4}

func fixedID() string   { return "generated-id" }
func fixedSeed() uint64 { return 99 }
func parse(body string) (generateParams, *Error) {
	return parseGenerate([]byte(body), testLimits, 512, 1024, fixedID, fixedSeed)
}

// TestGenerateRequestWire checks what the Go client sends is what the
// service reads, defaults included.
func TestGenerateRequestWire(t *testing.T) {
	req := GenerateRequest{Schema: Schema, ID: "a", Prompt: []int32{1, 2, 3}, N: 3, Temperature: 0, TopP: 0.9, TopK: 5,
		MaxTokens: 7, Stop: []int32{1}, Seed: seed(0), ReturnLogprobs: true, ReturnRoutedExperts: true, MinPolicyVersion: 4, MaxWaitMS: 250}
	p, e := parse(string(mustJSON(t, req)))
	if e != nil {
		t.Fatal(e)
	}
	r := p.req
	if r.ID != "a" || !slices.Equal(r.Prompt, req.Prompt) || r.N != 3 || r.Params.Temperature != 0 || r.Params.TopP != 0.9 ||
		r.Params.TopK != 5 || r.Params.MaxTokens != 7 || !slices.Equal(r.Params.Stop, req.Stop) || r.Params.Seed != 0 ||
		!r.Params.RoutedExperts || !p.logprobs || !p.routed || p.minVersion != 4 || p.maxWait != 250*time.Millisecond {
		t.Errorf("parsed %+v", p)
	}
	// Omitted fields: n 1, temperature 1, top_p 1, a chosen seed, an id.
	p, e = parse(`{"schema":"rollout.v1","prompt":[5],"max_tokens":2}`)
	if e != nil {
		t.Fatal(e)
	}
	if r := p.req; r.ID != "generated-id" || r.N != 1 || r.Params.Temperature != 1 || r.Params.TopP != 1 || r.Params.Seed != 99 || p.logprobs {
		t.Errorf("defaults %+v", p)
	}
	// A Go request with zero N and TopP sends neither: defaults, not errors.
	p, e = parse(string(mustJSON(t, GenerateRequest{Schema: Schema, Prompt: []int32{5}, MaxTokens: 2})))
	if e != nil || p.req.N != 1 || p.req.Params.TopP != 1 || p.req.Params.Temperature != 0 {
		t.Errorf("zero-valued Go request: %+v, %v", p, e)
	}
	// The context bound, when known.
	if _, e := parse(`{"schema":"rollout.v1","prompt":[5,6,7],"max_tokens":100,"n":1}`); e != nil {
		t.Errorf("within the context: %v", e)
	}
	if _, e := parseGenerate([]byte(`{"schema":"rollout.v1","prompt":[5,6,7],"max_tokens":100}`), testLimits, 512, 64, fixedID, fixedSeed); e == nil ||
		!strings.Contains(e.Msg, "context of 64") {
		t.Errorf("past the context: %v", e)
	}
}

func TestLogProbsJSON(t *testing.T) {
	in := LogProbs{-0.5, float32(math.NaN()), float32(math.Inf(-1)), -1e-8, 0}
	b, err := json.Marshal(struct {
		L LogProbs `json:"l"`
	}{in})
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `{"l":[-0.5,null,null,-1e-8,0]}` {
		t.Errorf("encoded %s", b)
	}
	var out struct {
		L LogProbs `json:"l"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	if len(out.L) != 5 || out.L[0] != -0.5 || !math.IsNaN(float64(out.L[1])) || !math.IsNaN(float64(out.L[2])) || out.L[3] != -1e-8 {
		t.Errorf("decoded %v", out.L)
	}
	// Every float32 survives the trip.
	for _, v := range []float32{-math.SmallestNonzeroFloat32, -math.MaxFloat32, -0.1234567, -87.33654} {
		b, _ := json.Marshal(LogProbs{v})
		var back LogProbs
		if err := json.Unmarshal(b, &back); err != nil || back[0] != v {
			t.Errorf("%v -> %s -> %v, %v", v, b, back, err)
		}
	}
}

func TestErrorIs(t *testing.T) {
	e := error(&Error{Op: "generate", ID: "x", Code: 503, Reason: ReasonDraining, Msg: "worker draining"})
	if !errors.Is(e, ErrDraining) || errors.Is(e, ErrOverloaded) || errors.Is(e, ErrBadRequest) {
		t.Errorf("%v: Is", e)
	}
	if s := e.Error(); s != `rollout: generate "x": 503 draining: worker draining` {
		t.Errorf("message %q", s)
	}
	if errors.Is(ErrDraining, e) {
		t.Error("a sentinel matched a specific error")
	}
}

// FuzzParseGenerate: any body is refused with a 400 or parsed into a
// request within the limits, never a panic.
func FuzzParseGenerate(f *testing.F) {
	for _, s := range []string{
		`{"schema":"rollout.v1","prompt":[1,2,3],"n":2,"max_tokens":5,"temperature":0.7,"top_p":0.9,"top_k":4,"seed":3}`,
		`{"schema":"rollout.v1","prompt":[],"max_tokens":5}`, `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"top_p":null}`,
		`null`, `[]`, `{"schema":1}`, `{"schema":"rollout.v1","prompt":[1],"max_tokens":1e3}`, "\x00",
		`{"schema":"rollout.v1","Prompt":[1],"max_tokens":1}`, `{"schema":"rollout.v1","prompt":[1],"MAX_TOKENS":1}`,
		`{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"max_tokens":2}`, `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"stop":[1,1,2,2]}`,
		`{"schema":"rollout.v1","pr\u006fmpt":[1],"max_tokens":1}`, `{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"ſeed":1}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		p, e := parseGenerate(body, testLimits, 512, 1024, fixedID, fixedSeed)
		if e != nil {
			if e.Code != 400 || e.Reason != ReasonBadRequest || e.Msg == "" {
				t.Fatalf("error %+v", e)
			}
			return
		}
		r := p.req
		if len(r.Prompt) == 0 || len(r.Prompt) > testLimits.MaxPromptTokens || r.N < 1 || r.N > testLimits.MaxN ||
			r.Params.MaxTokens < 1 || r.Params.MaxTokens > testLimits.MaxTokens || !(r.Params.TopP > 0 && r.Params.TopP <= 1) ||
			!(r.Params.Temperature >= 0) || r.Params.TopK < 0 || r.ID == "" || len(r.Params.Stop) > MaxStop ||
			len(r.Prompt)+r.Params.MaxTokens > 1024 {
			t.Fatalf("accepted %s as %+v", body, p)
		}
		checkExactKeys(t, body, generateWire{})
	})
}

// checkExactKeys fails t unless every key of the JSON object body is
// exactly the json name of a field of the struct v.
func checkExactKeys(t *testing.T, body []byte, v any) {
	t.Helper()
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(body, &keys); err != nil {
		return
	}
	rt := reflect.TypeOf(v)
	for k := range keys {
		ok := false
		for i := range rt.NumField() {
			if name, _, _ := strings.Cut(rt.Field(i).Tag.Get("json"), ","); name == k {
				ok = true
			}
		}
		if !ok {
			t.Fatalf("accepted %s with the field %q", body, k)
		}
	}
}

// FuzzParseScore: any body is refused with a 400 or parsed into sequences
// within the limits.
func FuzzParseScore(f *testing.F) {
	for _, s := range []string{
		`{"schema":"rollout.v1","id":"s","sequences":[[1,2,3],[4]]}`, `{"schema":"rollout.v1","sequences":[]}`,
		`{"schema":"rollout.v1","Sequences":[[1]]}`, `{"SCHEMA":"rollout.v1","sequences":[[1]]}`, `null`, `{}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		id, seqs, e := parseScore(body, testLimits, 512, 1024, fixedID)
		if e != nil {
			if e.Code != 400 || e.Reason != ReasonBadRequest || e.Msg == "" {
				t.Fatalf("error %+v", e)
			}
			return
		}
		if id == "" || len(seqs) == 0 || len(seqs) > testLimits.MaxScoreSequences {
			t.Fatalf("accepted %s as %q %v", body, id, seqs)
		}
		for _, s := range seqs {
			if len(s) == 0 || len(s) > 1024 || slices.ContainsFunc(s, func(t int32) bool { return t < 0 || t >= 512 }) {
				t.Fatalf("accepted %s: sequence %v", body, s)
			}
		}
		checkExactKeys(t, body, ScoreRequest{})
	})
}

// FuzzParseCancel: any body is refused with a 400 or names an id and an
// inbox.
func FuzzParseCancel(f *testing.F) {
	for _, s := range []string{
		`{"schema":"rollout.v1","id":"a","inbox":"_INBOX.x"}`, `{"schema":"rollout.v1","id":"a"}`,
		`{"schema":"rollout.v1","ID":"a","inbox":"_INBOX.x"}`, `{"schema":"rollout.v1","id":"a","Inbox":"_INBOX.x"}`,
		`{"schema":"rollout.v1","id":"a","inbox":"_INBOX.*"}`, `null`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		id, inbox, e := parseCancel(body)
		if e != nil {
			if e.Code != 400 || e.Reason != ReasonBadRequest || e.Msg == "" {
				t.Fatalf("error %+v", e)
			}
			return
		}
		if id == "" || len(id) > maxIDLen || inbox == "" || strings.ContainsAny(inbox, " *>") {
			t.Fatalf("accepted %s as %q %q", body, id, inbox)
		}
		checkExactKeys(t, body, CancelRequest{})
	})
}

// FuzzParseStatus: a status body is empty, or an object with the schema.
func FuzzParseStatus(f *testing.F) {
	for _, s := range []string{``, `{"schema":"rollout.v1"}`, `{}`, `{"Schema":"rollout.v1"}`, `{"schema":"x"}`, `null`, `[]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if e := parseStatus(body); e != nil {
			if e.Code != 400 || e.Reason != ReasonBadRequest || e.Msg == "" {
				t.Fatalf("error %+v", e)
			}
			return
		}
		checkExactKeys(t, body, StatusRequest{})
	})
}

// TestFieldNamesExact: every request type refuses a field name that
// differs from the schema's only by case (encoding/json would accept it).
func TestFieldNamesExact(t *testing.T) {
	const gen = `"schema":"rollout.v1","prompt":[1],"max_tokens":1`
	for _, tc := range []struct {
		name, body, want string
		parse            func([]byte) *Error
	}{
		{"generate Prompt", `{"schema":"rollout.v1","Prompt":[1],"max_tokens":1}`, `Prompt: unknown field`, parseGen},
		{"generate MAX_TOKENS", `{"schema":"rollout.v1","prompt":[1],"MAX_TOKENS":1}`, `MAX_TOKENS: unknown field`, parseGen},
		{"generate Schema", `{"Schema":"rollout.v1","prompt":[1],"max_tokens":1}`, `Schema: unknown field`, parseGen},
		{"generate N", `{` + gen + `,"N":2}`, `"n"`, parseGen},
		{"generate Top_P", `{` + gen + `,"Top_P":0.5}`, `"top_p"`, parseGen},
		{"generate Seed", `{` + gen + `,"Seed":5}`, `"seed"`, parseGen},
		{"generate after the exact field", `{` + gen + `,"Max_Tokens":2}`, `Max_Tokens`, parseGen},
		{"generate long s", `{` + gen + `,"ſeed":5}`, `unknown field`, parseGen},
		{"score Sequences", `{"schema":"rollout.v1","Sequences":[[1]]}`, `Sequences: unknown field`, func(b []byte) *Error {
			_, _, e := parseScore(b, testLimits, 512, 1024, fixedID)
			return e
		}},
		{"score ID", `{"schema":"rollout.v1","ID":"x","sequences":[[1]]}`, `ID: unknown field`, func(b []byte) *Error {
			_, _, e := parseScore(b, testLimits, 512, 1024, fixedID)
			return e
		}},
		{"status SCHEMA", `{"SCHEMA":"rollout.v1"}`, `SCHEMA: unknown field`, parseStatus},
		{"cancel Id", `{"schema":"rollout.v1","Id":"x","inbox":"_INBOX.y"}`, `Id: unknown field`, func(b []byte) *Error {
			_, _, e := parseCancel(b)
			return e
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := tc.parse([]byte(tc.body))
			if e == nil || e.Code != 400 || !strings.Contains(e.Msg, tc.want) {
				t.Errorf("%s: %v, want a 400 naming %s", tc.body, e, tc.want)
			}
		})
	}
	// The exact names, escaped or not, still work.
	if _, e := parse(`{"schema":"rollout.v1","pr\u006fmpt":[1],"max_tokens":1,"n":2,"top_p":0.5}`); e != nil {
		t.Errorf("exact names: %v", e)
	}
}

func parseGen(b []byte) *Error {
	_, e := parseGenerate(b, testLimits, 512, 1024, fixedID, fixedSeed)
	return e
}

// TestStopList: a stop list holds at most MaxStop distinct ids (400
// beyond, naming stop); duplicates do not count and reach the engine once.
func TestStopList(t *testing.T) {
	ids := func(n, copies int) []int32 {
		var out []int32
		for range copies {
			for i := range n {
				out = append(out, int32(i%512))
			}
		}
		return out
	}
	lim := testLimits
	for _, tc := range []struct {
		name     string
		stop     []int32
		want     int    // distinct ids passed on
		errorHas string // else
	}{
		{"none", nil, 0, ""},
		{"one", []int32{7}, 1, ""},
		{"duplicates", []int32{7, 7, 3, 7, 3}, 2, ""},
		{"the whole vocabulary, many times", ids(512, 600), 512, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := mustJSON(t, GenerateRequest{Schema: Schema, Prompt: []int32{1}, MaxTokens: 1, Stop: tc.stop})
			p, e := parseGenerate(body, lim, 512, 1024, fixedID, fixedSeed)
			if e != nil || len(p.req.Params.Stop) != tc.want {
				t.Fatalf("stop of %d ids: %v, %d passed on; want %d", len(tc.stop), e, len(p.req.Params.Stop), tc.want)
			}
		})
	}
	// Beyond MaxStop distinct ids (a vocabulary larger than MaxStop).
	for _, n := range []int{MaxStop, MaxStop + 1, 300000} {
		stop := make([]int32, n)
		for i := range stop {
			stop[i] = int32(i)
		}
		body := mustJSON(t, GenerateRequest{Schema: Schema, Prompt: []int32{1}, MaxTokens: 1, Stop: stop})
		_, e := parseGenerate(body, lim, 1<<20, 1024, fixedID, fixedSeed)
		switch {
		case n <= MaxStop && e != nil:
			t.Errorf("%d distinct stop ids: %v", n, e)
		case n > MaxStop && (e == nil || !strings.HasPrefix(e.Msg, "stop:") || !strings.Contains(e.Msg, fmt.Sprint(MaxStop))):
			t.Errorf("%d distinct stop ids: %v, want a 400 naming stop and the limit", n, e)
		}
	}
}

// TestContextErrors: a prompt that leaves no room in the model's context
// is refused naming prompt; a max_tokens that does not fit after the
// prompt names max_tokens and says how many would.
func TestContextErrors(t *testing.T) {
	lim := Limits{MaxPromptTokens: 4096, MaxTokens: 4096, MaxN: 8, MaxQueue: 4, MaxScoreSequences: 4}
	for _, tc := range []struct {
		name              string
		promptLen, maxTok int
		want              string // prefix of the error; "" accepted
	}{
		{"fits", 1000, 24, ""},
		{"prompt as long as the context", 1024, 1, "prompt: 1024 tokens, the model's context of 1024"},
		{"prompt longer than the context", 2000, 1, "prompt: 2000 tokens"},
		{"max_tokens past the context", 1000, 100, "max_tokens: 100, at most 24 with a prompt of 1000 tokens"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := mustJSON(t, GenerateRequest{Schema: Schema, Prompt: make([]int32, tc.promptLen), MaxTokens: tc.maxTok})
			_, e := parseGenerate(body, lim, 512, 1024, fixedID, fixedSeed)
			switch {
			case tc.want == "" && e != nil:
				t.Errorf("refused: %v", e)
			case tc.want != "" && (e == nil || !strings.HasPrefix(e.Msg, tc.want)):
				t.Errorf("got %v, want an error starting %q", e, tc.want)
			}
		})
	}
}

// TestSchemaDocumented: SCHEMA.md documents every field of the requests,
// the limits and the status, the cancel subject, the stop bound and the
// seed range every JSON parser reads exactly.
func TestSchemaDocumented(t *testing.T) {
	doc, err := os.ReadFile("SCHEMA.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	for _, v := range []any{generateWire{}, ScoreRequest{}, CancelRequest{}, CancelReply{}, Limits{}, StatusReply{}} {
		rt := reflect.TypeOf(v)
		for i := range rt.NumField() {
			name, _, _ := strings.Cut(rt.Field(i).Tag.Get("json"), ",")
			if !regexp.MustCompile("[`\"]" + regexp.QuoteMeta(name) + "[`\"]").MatchString(text) {
				t.Errorf("SCHEMA.md: %s field %q undocumented", rt.Name(), name)
			}
		}
	}
	for _, want := range []string{"rollout.<model>.cancel", fmt.Sprint(MaxStop), fmt.Sprint(MaxSafeSeed), "max_waiting_version"} {
		if !strings.Contains(text, want) {
			t.Errorf("SCHEMA.md does not mention %s", want)
		}
	}
}

// TestSeedsAboveSafeRange: seeds past 2^53-1 (which JavaScript rounds, so
// SCHEMA.md advises against them) are still read exactly as uint64 by the
// worker, up to 2^64-1; one past that is refused.
func TestSeedsAboveSafeRange(t *testing.T) {
	for _, seed := range []uint64{MaxSafeSeed, MaxSafeSeed + 1, MaxSafeSeed + 2, 1<<63 + 12345, math.MaxUint64} {
		p, e := parse(fmt.Sprintf(`{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"seed":%d}`, seed))
		if e != nil {
			t.Fatalf("seed %d: %v", seed, e)
		}
		if p.req.Params.Seed != seed {
			t.Errorf("seed %d read as %d", seed, p.req.Params.Seed)
		}
	}
	if _, e := parse(`{"schema":"rollout.v1","prompt":[1],"max_tokens":1,"seed":18446744073709551616}`); e == nil || !strings.Contains(e.Error(), "seed") {
		t.Errorf("seed 2^64: %v, want an error naming seed", e)
	}
}
