package rollout

import (
	"encoding/json"
	"errors"
	"math"
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
			!(r.Params.Temperature >= 0) || r.Params.TopK < 0 || r.ID == "" {
			t.Fatalf("accepted %s as %+v", body, p)
		}
	})
}
