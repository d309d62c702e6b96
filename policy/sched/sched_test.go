package sched

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
)

// recorder is a Sink that records deliveries as text and aborts the
// requests named in abort.
type recorder struct {
	t     *testing.T
	out   []string
	abort map[string]bool
	left  map[string]int // samples each request has yet to deliver
}

func (k *recorder) Deliver(r *Req, s Sample, last bool) {
	k.left[r.ID]--
	if last != (k.left[r.ID] == 0) {
		k.t.Errorf("%s/%d delivered with last=%v, %d samples left", r.ID, s.Index, last, k.left[r.ID])
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s/%d %s", r.ID, s.Index, s.Finish)
	for i, tok := range s.Tokens {
		fmt.Fprintf(&b, " %d", tok)
		if s.LogProbs[i] != fakeLogProb(tok) {
			k.t.Errorf("%s/%d token %d: logprob %v, want %v", r.ID, s.Index, i, s.LogProbs[i], fakeLogProb(tok))
		}
	}
	if s.Finish == FinishError && !strings.Contains(s.Err, fmt.Sprintf("sample %d, token %d", s.Index, len(s.Tokens))) {
		k.t.Errorf("%s/%d: error %q", r.ID, s.Index, s.Err)
	}
	k.out = append(k.out, b.String())
}

func (k *recorder) Aborted(r *Req) bool { return k.abort[r.ID] }

func fakeLogProb(tok int32) float32 { return -float32(tok) / 8 }

// render writes a plan as one line: tokens (^r: fed from the previous
// step's logit row r), positions, slots, sequences as length[pages], logit
// rows, owners (id/i: a decoding sample, id>i: a request's sample forked
// from this row, @ the position drawn), page copies dst<-src, and whether
// it is decode-only. It checks each sampling row against its owner.
func render(t *testing.T, p *Plan, ps int) string {
	t.Helper()
	var b strings.Builder
	list := func(name string, n int, f func(i int) string) {
		fmt.Fprintf(&b, "%s", name)
		if n == 0 {
			b.WriteString(" -")
		}
		for i := range n {
			b.WriteString(" " + f(i))
		}
	}
	list("tok", len(p.Tokens), func(i int) string {
		if p.Feed[i] >= 0 {
			if p.Tokens[i] != -1 {
				t.Errorf("token %d is fed but has host value %d", i, p.Tokens[i])
			}
			return fmt.Sprintf("^%d", p.Feed[i])
		}
		return fmt.Sprint(p.Tokens[i])
	})
	list(" | pos", len(p.Positions), func(i int) string { return fmt.Sprint(p.Positions[i]) })
	list(" | slot", len(p.Slots), func(i int) string { return fmt.Sprint(p.Slots[i]) })
	list(" | seq", len(p.SeqLens), func(s int) string {
		if q0, q1 := p.QueryStart[s], p.QueryStart[s+1]; q1 <= q0 {
			t.Errorf("sequence %d has query rows %d..%d", s, q0, q1)
		}
		return fmt.Sprintf("%d%v", p.SeqLens[s], p.PageRow(s, ps))
	})
	list(" | rows", len(p.LogitRows), func(i int) string { return fmt.Sprint(p.LogitRows[i]) })
	list(" | own", len(p.Owners), func(i int) string {
		ow, sr := p.Owners[i], p.Sampling[i]
		r, sep, idx := ow.Req, ">", ow.Sample
		if ow.Seq != nil {
			r, sep, idx = ow.Seq.Req(), "/", ow.Seq.Index()
		}
		want := r.row(idx, int(sr.Position))
		if sr != want {
			t.Errorf("row %d: sampling %+v, want %+v", i, sr, want)
		}
		return fmt.Sprintf("%s%s%d@%d", r.ID, sep, idx, sr.Position)
	})
	if len(p.Copies) > 0 {
		list(" | copy", len(p.Copies), func(i int) string { return fmt.Sprintf("%d<-%d", p.Copies[i].Dst, p.Copies[i].Src) })
	}
	if p.DecodeOnly {
		b.WriteString(" | decode")
	}
	if len(p.QueryStart) != len(p.SeqLens)+1 || p.QueryStart[0] != 0 || int(p.QueryStart[len(p.SeqLens)]) != len(p.Tokens) {
		t.Errorf("query starts %v for %d sequences of %d tokens", p.QueryStart, len(p.SeqLens), len(p.Tokens))
	}
	return b.String()
}

// Kinds of script lines.
const (
	runStep = iota // reap, admit, plan, then commit it
	plan           // reap, admit, plan: the step stays in flight
	commit         // commit the oldest step in flight
)

// line is one line of a script: requests to submit and abort, then a
// step planned and/or committed with fake sampled tokens.
type line struct {
	kind    int
	version uint64 // when set, SetVersion(version) first
	add     []Request
	abort   []string
	plan    string  // the plan, rendered ("" when nothing runs)
	tokens  []int32 // the sampled token of each logit row (Unsampled: none)
	out     []string
	inUse   int // pages in use afterwards
}

type script struct {
	name  string
	cfg   Config
	lines []line
}

func cfg(mod func(*Config)) Config {
	c := Config{PageSize: 4, KVPages: 16, MaxPagesPerSeq: 8, MaxTokens: 8, MaxSeqs: 4, MaxLogitRows: 8, TopK: 2}
	if mod != nil {
		mod(&c)
	}
	return c
}

func req(id string, prompt []int32, n, maxTokens int, stop ...int32) Request {
	return Request{ID: id, Prompt: prompt, N: n, Params: SamplingParams{Temperature: 1, TopP: 1, MaxTokens: maxTokens, Seed: 5, Stop: stop}}
}

// runScript plays a script against a fresh scheduler.
func runScript(t *testing.T, sc script) *Scheduler {
	k := &recorder{t: t, abort: map[string]bool{}, left: map[string]int{}}
	s := New(sc.cfg, k)
	var inFlight []*Plan
	tokens := map[*Plan][]int32{}
	for i, l := range sc.lines {
		where := fmt.Sprintf("line %d", i+1)
		k.out = nil
		for _, r := range l.add {
			k.left[r.ID] = r.N
			s.Add(s.NewReq(r, nil))
		}
		for _, id := range l.abort {
			k.abort[id] = true
		}
		if l.version != 0 {
			s.SetVersion(l.version)
		}
		if l.kind != commit {
			s.Reap()
			s.Admit()
			p, err := s.Plan()
			if err != nil {
				t.Fatalf("%s: plan: %v", where, err)
			}
			got := ""
			if p != nil {
				p.Version = 100 + p.Step
				got = render(t, p, sc.cfg.PageSize)
				inFlight = append(inFlight, p)
				tokens[p] = l.tokens
			}
			if got != l.plan {
				t.Fatalf("%s: plan\n  %s\nwant\n  %s", where, got, l.plan)
			}
		}
		if l.kind != plan && len(inFlight) > 0 {
			p := inFlight[0]
			inFlight = inFlight[1:]
			res := fakeResults(tokens[p])
			if len(res.Tokens) != len(p.LogitRows) {
				t.Fatalf("%s: %d fake tokens for %d logit rows", where, len(res.Tokens), len(p.LogitRows))
			}
			if err := s.Commit(p, res); err != nil {
				t.Fatalf("%s: commit: %v", where, err)
			}
		}
		if strings.Join(k.out, "; ") != strings.Join(l.out, "; ") {
			t.Fatalf("%s: delivered\n  %q\nwant\n  %q", where, k.out, l.out)
		}
		if got := s.Pages().InUse(); got != l.inUse {
			t.Fatalf("%s: %d pages in use, want %d", where, got, l.inUse)
		}
	}
	return s
}

func fakeResults(tokens []int32) *Results {
	res := &Results{Tokens: tokens, LogProbs: make([]float32, len(tokens))}
	for i, tok := range tokens {
		res.LogProbs[i] = fakeLogProb(tok)
	}
	return res
}

func seq(lo, n int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = lo + int32(i)
	}
	return out
}

// scripts are the synchronous engine's behaviour: every step is committed
// before the next is planned.
var scripts = []script{
	{"one sample", cfg(nil), []line{
		{add: []Request{req("a", []int32{11, 12, 13}, 1, 3)},
			plan:   "tok 11 12 13 | pos 0 1 2 | slot 0 1 2 | seq 3[0] | rows 2 | own a>0@3",
			tokens: []int32{21}, inUse: 1},
		{plan: "tok 21 | pos 3 | slot 3 | seq 4[0] | rows 0 | own a/0@4 | decode", tokens: []int32{22}, inUse: 1},
		{plan: "tok 22 | pos 4 | slot 4 | seq 5[0 1] | rows 0 | own a/0@5 | decode", tokens: []int32{23},
			out: []string{"a/0 length 21 22 23"}},
		{plan: ""},
	}},
	{"fork shares the full pages and copies the partial one", cfg(nil), []line{
		{add: []Request{req("a", seq(1, 6), 3, 2)},
			plan:   "tok 1 2 3 4 5 6 | pos 0 1 2 3 4 5 | slot 0 1 2 3 4 5 | seq 6[0 1] | rows 5 5 5 | own a>0@6 a>1@6 a>2@6",
			tokens: []int32{7, 8, 9}, inUse: 4},
		{plan: "tok 7 8 9 | pos 6 6 6 | slot 6 10 14 | seq 7[0 1] 7[0 2] 7[0 3] | rows 0 1 2 | own a/0@7 a/1@7 a/2@7 | copy 2<-1 3<-1 | decode",
			tokens: []int32{10, 11, 12}, out: []string{"a/0 length 7 10", "a/1 length 8 11", "a/2 length 9 12"}},
	}},
	{"a sample that ends at its first token drops its page copy", cfg(nil), []line{
		{add: []Request{req("a", seq(1, 6), 2, 1)},
			plan:   "tok 1 2 3 4 5 6 | pos 0 1 2 3 4 5 | slot 0 1 2 3 4 5 | seq 6[0 1] | rows 5 5 | own a>0@6 a>1@6",
			tokens: []int32{7, 8}, out: []string{"a/0 length 7", "a/1 length 8"}},
		// Page 2, a/1's copy, is b's now: the copy must not happen.
		{add: []Request{req("b", []int32{1, 2}, 1, 1)},
			plan: "tok 1 2 | pos 0 1 | slot 8 9 | seq 2[2] | rows 1 | own b>0@2", tokens: []int32{3}, out: []string{"b/0 length 3"}},
	}},
	{"prompts are chunked under the token budget", cfg(nil), []line{
		{add: []Request{req("a", seq(1, 10), 1, 2), req("b", []int32{21, 22}, 2, 1)},
			plan: "tok 1 2 3 4 5 6 7 8 | pos 0 1 2 3 4 5 6 7 | slot 0 1 2 3 4 5 6 7 | seq 8[0 1] | rows - | own -", inUse: 2},
		{plan: "tok 9 10 21 22 | pos 8 9 0 1 | slot 8 9 12 13 | seq 10[0 1 2] 2[3] | rows 1 3 3 | own a>0@10 b>0@2 b>1@2",
			tokens: []int32{30, 31, 32}, out: []string{"b/0 length 31", "b/1 length 32"}, inUse: 3},
		{plan: "tok 30 | pos 10 | slot 10 | seq 11[0 1 2] | rows 0 | own a/0@11 | decode", tokens: []int32{33},
			out: []string{"a/0 length 30 33"}},
	}},
	{"a prompt's sampling rows wait for a step they fit", cfg(func(c *Config) { c.MaxLogitRows = 2 }), []line{
		{add: []Request{req("a", []int32{1, 2, 3}, 2, 1), req("b", []int32{5}, 2, 1), req("c", []int32{7, 8}, 1, 1)},
			plan:   "tok 1 2 3 7 | pos 0 1 2 0 | slot 0 1 2 4 | seq 3[0] 1[1] | rows 2 2 | own a>0@3 a>1@3",
			tokens: []int32{10, 11}, out: []string{"a/0 length 10", "a/1 length 11"}, inUse: 1},
		{plan: "tok 5 | pos 0 | slot 8 | seq 1[2] | rows 0 0 | own b>0@1 b>1@1", tokens: []int32{12, 13},
			out: []string{"b/0 length 12", "b/1 length 13"}, inUse: 1},
		{plan: "tok 8 | pos 1 | slot 5 | seq 2[1] | rows 0 | own c>0@2", tokens: []int32{14}, out: []string{"c/0 length 14"}},
	}},
	{"admission waits for pages", cfg(func(c *Config) { c.KVPages = 4 }), []line{
		{add: []Request{req("a", []int32{1, 2, 3, 4}, 1, 4, 50), req("b", seq(1, 5), 1, 8, 60)},
			plan: "tok 1 2 3 4 | pos 0 1 2 3 | slot 0 1 2 3 | seq 4[0] | rows 3 | own a>0@4", tokens: []int32{9}, inUse: 1},
		{plan: "tok 9 | pos 4 | slot 4 | seq 5[0 1] | rows 0 | own a/0@5 | decode", tokens: []int32{50},
			out: []string{"a/0 stop 9 50"}},
		{plan: "tok 1 2 3 4 5 | pos 0 1 2 3 4 | slot 4 5 6 7 0 | seq 5[1 0] | rows 4 | own b>0@5", tokens: []int32{60},
			out: []string{"b/0 stop 60"}},
	}},
	{"samples that do not fit a step go first in the next", cfg(func(c *Config) { c.MaxSeqs = 2 }), []line{
		{add: []Request{req("a", []int32{1}, 2, 3), req("b", []int32{2}, 2, 2)},
			plan:   "tok 1 2 | pos 0 0 | slot 0 4 | seq 1[0] 1[1] | rows 0 0 1 1 | own a>0@1 a>1@1 b>0@1 b>1@1",
			tokens: []int32{10, 11, 20, 21}, inUse: 4},
		{plan: "tok 10 11 | pos 1 1 | slot 1 9 | seq 2[0] 2[2] | rows 0 1 | own a/0@2 a/1@2 | copy 2<-0 3<-1 | decode",
			tokens: []int32{12, 13}, inUse: 4},
		{plan: "tok 20 21 | pos 1 1 | slot 5 13 | seq 2[1] 2[3] | rows 0 1 | own b/0@2 b/1@2 | decode",
			tokens: []int32{22, 23}, out: []string{"b/0 length 20 22", "b/1 length 21 23"}, inUse: 2},
		{plan: "tok 12 13 | pos 2 2 | slot 2 10 | seq 3[0] 3[2] | rows 0 1 | own a/0@3 a/1@3 | decode",
			tokens: []int32{14, 15}, out: []string{"a/0 length 10 12 14", "a/1 length 11 13 15"}},
	}},
	{"a failed draw fails its sample and aborts the others", cfg(nil), []line{
		{add: []Request{req("a", []int32{1, 2}, 3, 5)},
			plan:   "tok 1 2 | pos 0 1 | slot 0 1 | seq 2[0] | rows 1 1 1 | own a>0@2 a>1@2 a>2@2",
			tokens: []int32{10, Unsampled, 12}, out: []string{"a/1 error"}, inUse: 2},
		{add: []Request{req("b", []int32{5}, 1, 1)},
			plan: "tok 5 | pos 0 | slot 8 | seq 1[2] | rows 0 | own b>0@1", tokens: []int32{30},
			out: []string{"a/0 abort 10", "a/2 abort 12", "b/0 length 30"}},
	}},
	{"aborts end waiting, prefilling and running requests", cfg(func(c *Config) { c.KVPages, c.MaxTokens = 6, 4 }), []line{
		{add: []Request{req("c", []int32{1}, 1, 8), req("b", seq(21, 6), 1, 1), req("a", []int32{3}, 1, 4)},
			plan: "tok 1 21 22 23 | pos 0 0 1 2 | slot 0 4 5 6 | seq 1[0] 3[1] | rows 0 | own c>0@1", tokens: []int32{40}, inUse: 2},
		{abort: []string{"a", "b", "c"}, plan: "", out: []string{"c/0 abort 40", "a/0 abort", "b/0 abort"}},
	}},
	// Pages on demand: a and b reserve one page each beyond their prompts
	// and grow into free pages; when both need a fifth page, b (the
	// younger) is preempted, its pages go to a, and b is recomputed from
	// its prompt and its six tokens once a is done, then decodes on.
	{"on demand: the youngest sample is preempted and recomputed", cfg(func(c *Config) { c.KVPages, c.OnDemand = 4, true }), []line{
		{add: []Request{req("a", []int32{1, 2, 3}, 1, 9), req("b", []int32{5, 6, 7}, 1, 8)},
			plan:   "tok 1 2 3 5 6 7 | pos 0 1 2 0 1 2 | slot 0 1 2 4 5 6 | seq 3[0] 3[1] | rows 2 5 | own a>0@3 b>0@3",
			tokens: []int32{10, 11}, inUse: 2},
		{plan: "tok 10 11 | pos 3 3 | slot 3 7 | seq 4[0] 4[1] | rows 0 1 | own a/0@4 b/0@4 | decode", tokens: []int32{12, 13}, inUse: 2},
		{plan: "tok 12 13 | pos 4 4 | slot 8 12 | seq 5[0 2] 5[1 3] | rows 0 1 | own a/0@5 b/0@5 | decode", tokens: []int32{14, 15}, inUse: 4},
		{plan: "tok 14 15 | pos 5 5 | slot 9 13 | seq 6[0 2] 6[1 3] | rows 0 1 | own a/0@6 b/0@6 | decode", tokens: []int32{16, 17}, inUse: 4},
		{plan: "tok 16 17 | pos 6 6 | slot 10 14 | seq 7[0 2] 7[1 3] | rows 0 1 | own a/0@7 b/0@7 | decode", tokens: []int32{18, 19}, inUse: 4},
		{plan: "tok 18 19 | pos 7 7 | slot 11 15 | seq 8[0 2] 8[1 3] | rows 0 1 | own a/0@8 b/0@8 | decode", tokens: []int32{20, 21}, inUse: 4},
		{plan: "tok 20 | pos 8 | slot 12 | seq 9[0 2 3] | rows 0 | own a/0@9 | decode", tokens: []int32{22}, inUse: 3},
		{plan: "tok 22 | pos 9 | slot 13 | seq 10[0 2 3] | rows 0 | own a/0@10 | decode", tokens: []int32{23}, inUse: 3},
		{plan: "tok 23 | pos 10 | slot 14 | seq 11[0 2 3] | rows 0 | own a/0@11 | decode", tokens: []int32{24},
			out: []string{"a/0 length 10 12 14 16 18 20 22 23 24"}},
		{plan: "tok 5 6 7 11 13 15 17 19 | pos 0 1 2 3 4 5 6 7 | slot 12 13 14 15 8 9 10 11 | seq 8[3 2] | rows - | own -", inUse: 2},
		{plan: "tok 21 | pos 8 | slot 0 | seq 9[3 2 0] | rows 0 | own b/0@9", tokens: []int32{25}, inUse: 3},
		{plan: "tok 25 | pos 9 | slot 1 | seq 10[3 2 0] | rows 0 | own b/0@10 | decode", tokens: []int32{26},
			out: []string{"b/0 length 11 13 15 17 19 21 25 26"}},
	}},
	// The same with step N+1 planned while N runs: b is preempted while its
	// row of the step in flight draws its sixth token, which is discarded;
	// a waits one step for b's pages, which come free when that step is
	// committed; b's recomputation ends in the row that draws its sixth
	// token again.
	{"on demand, overlapped: a preempted sample's row in flight is discarded", cfg(func(c *Config) { c.KVPages, c.OnDemand = 4, true }), []line{
		{kind: plan, add: []Request{req("a", []int32{1, 2, 3}, 1, 9), req("b", []int32{5, 6, 7}, 1, 8)},
			plan:   "tok 1 2 3 5 6 7 | pos 0 1 2 0 1 2 | slot 0 1 2 4 5 6 | seq 3[0] 3[1] | rows 2 5 | own a>0@3 b>0@3",
			tokens: []int32{10, 11}, inUse: 2},
		{plan: "", inUse: 2},
		{kind: plan, plan: "tok 10 11 | pos 3 3 | slot 3 7 | seq 4[0] 4[1] | rows 0 1 | own a/0@4 b/0@4 | decode", tokens: []int32{12, 13}, inUse: 2},
		{plan: "tok ^0 ^1 | pos 4 4 | slot 8 12 | seq 5[0 2] 5[1 3] | rows 0 1 | own a/0@5 b/0@5 | decode", tokens: []int32{14, 15}, inUse: 4},
		{plan: "tok ^0 ^1 | pos 5 5 | slot 9 13 | seq 6[0 2] 6[1 3] | rows 0 1 | own a/0@6 b/0@6 | decode", tokens: []int32{16, 17}, inUse: 4},
		{plan: "tok ^0 ^1 | pos 6 6 | slot 10 14 | seq 7[0 2] 7[1 3] | rows 0 1 | own a/0@7 b/0@7 | decode", tokens: []int32{18, 19}, inUse: 4},
		{plan: "tok ^0 ^1 | pos 7 7 | slot 11 15 | seq 8[0 2] 8[1 3] | rows 0 1 | own a/0@8 b/0@8 | decode", tokens: []int32{20, 21}, inUse: 4},
		{plan: "", inUse: 2},
		{kind: plan, plan: "tok 20 | pos 8 | slot 12 | seq 9[0 2 3] | rows 0 | own a/0@9 | decode", tokens: []int32{22}, inUse: 3},
		{plan: "tok ^0 | pos 9 | slot 13 | seq 10[0 2 3] | rows 0 | own a/0@10 | decode", tokens: []int32{23}, inUse: 3},
		{plan: "tok ^0 | pos 10 | slot 14 | seq 11[0 2 3] | rows 0 | own a/0@11 | decode", tokens: []int32{24}, inUse: 3},
		{plan: "", out: []string{"a/0 length 10 12 14 16 18 20 22 23 24"}},
		{kind: plan, plan: "tok 5 6 7 11 13 15 17 19 | pos 0 1 2 3 4 5 6 7 | slot 12 13 14 15 8 9 10 11 | seq 8[3 2] | rows 7 | own b/0@8",
			tokens: []int32{21}, inUse: 2},
		{plan: "", inUse: 2},
		{kind: plan, plan: "tok 21 | pos 8 | slot 0 | seq 9[3 2 0] | rows 0 | own b/0@9 | decode", tokens: []int32{25}, inUse: 3},
		{plan: "tok ^0 | pos 9 | slot 1 | seq 10[3 2 0] | rows 0 | own b/0@10 | decode", tokens: []int32{26}, inUse: 3},
		{plan: "", out: []string{"b/0 length 11 13 15 17 19 21 25 26"}},
	}},
	// A prompt being prefilled is younger than a running sample: it is
	// preempted (its pages freed, its request back at the head of the
	// queue) and prefilled again once a is done.
	{"on demand: a prompt being prefilled is preempted and prefilled again", cfg(func(c *Config) { c.KVPages, c.OnDemand = 5, true }), []line{
		{add: []Request{req("a", []int32{1, 2, 3}, 1, 6), req("b", seq(31, 13), 1, 2)},
			plan:   "tok 1 2 3 31 32 33 34 35 | pos 0 1 2 0 1 2 3 4 | slot 0 1 2 4 5 6 7 8 | seq 3[0] 5[1 2] | rows 2 | own a>0@3",
			tokens: []int32{10}, inUse: 3},
		{plan: "tok 10 36 37 38 39 40 41 42 | pos 3 5 6 7 8 9 10 11 | slot 3 9 10 11 12 13 14 15 | seq 4[0] 12[1 2 3] | rows 0 | own a/0@4",
			tokens: []int32{11}, inUse: 4},
		{plan: "tok 11 | pos 4 | slot 12 | seq 5[0 3] | rows 0 | own a/0@5 | decode", tokens: []int32{12}, inUse: 2},
		{plan: "tok 12 | pos 5 | slot 13 | seq 6[0 3] | rows 0 | own a/0@6 | decode", tokens: []int32{13}, inUse: 2},
		{plan: "tok 13 | pos 6 | slot 14 | seq 7[0 3] | rows 0 | own a/0@7 | decode", tokens: []int32{14}, inUse: 2},
		{plan: "tok 14 | pos 7 | slot 15 | seq 8[0 3] | rows 0 | own a/0@8 | decode", tokens: []int32{15},
			out: []string{"a/0 length 10 11 12 13 14 15"}},
		{plan: "tok 31 32 33 34 35 36 37 38 | pos 0 1 2 3 4 5 6 7 | slot 12 13 14 15 0 1 2 3 | seq 8[3 0] | rows - | own -", inUse: 2},
		{plan: "tok 39 40 41 42 43 | pos 8 9 10 11 12 | slot 8 9 10 11 4 | seq 13[3 0 2 1] | rows 4 | own b>0@13", tokens: []int32{16}, inUse: 4},
		{plan: "tok 16 | pos 13 | slot 5 | seq 14[3 0 2 1] | rows 0 | own b/0@14 | decode", tokens: []int32{17},
			out: []string{"b/0 length 16 17"}},
	}},
	{"on demand: an aborted preempted sample ends with the tokens it had", cfg(func(c *Config) { c.KVPages, c.OnDemand = 4, true }), []line{
		{add: []Request{req("a", []int32{1, 2, 3}, 1, 7), req("b", []int32{5, 6, 7}, 1, 8)},
			plan:   "tok 1 2 3 5 6 7 | pos 0 1 2 0 1 2 | slot 0 1 2 4 5 6 | seq 3[0] 3[1] | rows 2 5 | own a>0@3 b>0@3",
			tokens: []int32{10, 11}, inUse: 2},
		{plan: "tok 10 11 | pos 3 3 | slot 3 7 | seq 4[0] 4[1] | rows 0 1 | own a/0@4 b/0@4 | decode", tokens: []int32{12, 13}, inUse: 2},
		{plan: "tok 12 13 | pos 4 4 | slot 8 12 | seq 5[0 2] 5[1 3] | rows 0 1 | own a/0@5 b/0@5 | decode", tokens: []int32{14, 15}, inUse: 4},
		{plan: "tok 14 15 | pos 5 5 | slot 9 13 | seq 6[0 2] 6[1 3] | rows 0 1 | own a/0@6 b/0@6 | decode", tokens: []int32{16, 17}, inUse: 4},
		{plan: "tok 16 17 | pos 6 6 | slot 10 14 | seq 7[0 2] 7[1 3] | rows 0 1 | own a/0@7 b/0@7 | decode", tokens: []int32{18, 19}, inUse: 4},
		{plan: "tok 18 19 | pos 7 7 | slot 11 15 | seq 8[0 2] 8[1 3] | rows 0 1 | own a/0@8 b/0@8 | decode", tokens: []int32{20, 21}, inUse: 4},
		{plan: "tok 20 | pos 8 | slot 12 | seq 9[0 2 3] | rows 0 | own a/0@9 | decode", tokens: []int32{22},
			out: []string{"a/0 length 10 12 14 16 18 20 22"}},
		{abort: []string{"b"}, plan: "", out: []string{"b/0 abort 11 13 15 17 19 21"}},
	}},
	// The prefix cache: a's full prompt pages stay cached after it ends; b,
	// whose prompt starts with them, shares them and prefills only its
	// last four tokens, and its own full pages join the cache; after a
	// version change nothing is cached and c, b's prompt again, is
	// prefilled whole.
	{"prefix cache: a prompt shares the cached pages of its prefix, under one version only", cfg(func(c *Config) { c.PrefixCache = true }), []line{
		{version: 1, add: []Request{req("a", seq(1, 9), 1, 1)},
			plan: "tok 1 2 3 4 5 6 7 8 | pos 0 1 2 3 4 5 6 7 | slot 0 1 2 3 4 5 6 7 | seq 8[0 1] | rows - | own -", inUse: 2},
		{plan: "tok 9 | pos 8 | slot 8 | seq 9[0 1 2] | rows 0 | own a>0@9", tokens: []int32{30},
			out: []string{"a/0 length 30"}, inUse: 2},
		{add: []Request{req("b", append(seq(1, 9), 20, 21, 22), 1, 1)},
			plan: "tok 9 20 21 22 | pos 8 9 10 11 | slot 8 9 10 11 | seq 12[0 1 2] | rows 3 | own b>0@12", tokens: []int32{31},
			out: []string{"b/0 length 31"}, inUse: 3},
		{version: 2, add: []Request{req("c", append(seq(1, 9), 20, 21, 22), 1, 1)},
			plan: "tok 1 2 3 4 5 6 7 8 | pos 0 1 2 3 4 5 6 7 | slot 0 1 2 3 4 5 6 7 | seq 8[0 1] | rows - | own -", inUse: 2},
		{plan: "tok 9 20 21 22 | pos 8 9 10 11 | slot 8 9 10 11 | seq 12[0 1 2] | rows 3 | own c>0@12", tokens: []int32{32},
			out: []string{"c/0 length 32"}, inUse: 3},
	}},
}

func TestScripts(t *testing.T) {
	for _, sc := range scripts {
		t.Run(sc.name, func(t *testing.T) {
			s := runScript(t, sc)
			if s.Busy() || s.Preempted() != 0 || s.Pages().InUse() != s.CachedPages() || s.Pages().Reserved() != 0 {
				t.Fatalf("at the end: busy %v, %d preempted, %d pages in use (%d cached), %d reserved", s.Busy(), s.Preempted(), s.Pages().InUse(), s.CachedPages(), s.Pages().Reserved())
			}
		})
	}
}

type nopSink struct{}

func (nopSink) Deliver(*Req, Sample, bool) {}
func (nopSink) Aborted(*Req) bool          { return false }

// TestDecodeStepAllocatesNothing: with a fixed set of running samples,
// planning and committing a decode step allocates nothing, whether each
// step is committed before the next is planned or the next is planned
// while it is in flight, with pages reserved or taken on demand.
func TestDecodeStepAllocatesNothing(t *testing.T) {
	for _, mode := range []struct{ overlapped, onDemand bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
		overlapped := mode.overlapped
		t.Run(fmt.Sprintf("overlapped=%v,on_demand=%v", overlapped, mode.onDemand), func(t *testing.T) {
			c := Config{PageSize: 16, KVPages: 2048, MaxPagesPerSeq: 64, MaxTokens: 256, MaxSeqs: 64, MaxLogitRows: 256, TopK: 2, OnDemand: mode.onDemand}
			s := New(c, nopSink{})
			for i := range 8 {
				s.Add(s.NewReq(req(fmt.Sprint("r", i), seq(1, 20+int32(i)), 4, 900), nil))
			}
			s.Admit()
			res := &Results{Tokens: make([]int32, c.MaxLogitRows), LogProbs: make([]float32, c.MaxLogitRows)}
			for i := range res.Tokens {
				res.Tokens[i] = 7
			}
			commitStep := func(p *Plan) {
				r := *res
				r.Tokens, r.LogProbs = res.Tokens[:len(p.LogitRows)], res.LogProbs[:len(p.LogitRows)]
				if err := s.Commit(p, &r); err != nil {
					t.Fatal(err)
				}
			}
			var inFlight *Plan
			step := func() {
				p, err := s.Plan()
				if err != nil || (p == nil && !overlapped) {
					t.Fatalf("plan: %v, %v", p, err)
				}
				if !overlapped {
					commitStep(p)
					return
				}
				if inFlight != nil {
					commitStep(inFlight)
				}
				inFlight = p
			}
			for s.Running() < 32 { // the prefill steps, then the first decode steps
				step()
			}
			step()
			if allocs := testing.AllocsPerRun(200, step); allocs != 0 {
				t.Fatalf("%v allocations per decode step", allocs)
			}
			// AllocsPerRun rounds the mean down: count them all.
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for range 200 {
				step()
			}
			runtime.ReadMemStats(&after)
			if n := after.Mallocs - before.Mallocs; n != 0 {
				t.Fatalf("%d allocations in 200 decode steps", n)
			}
			if s.Running() != 32 {
				t.Fatalf("%d samples running, want 32", s.Running())
			}
		})
	}
}
