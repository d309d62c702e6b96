package sched

import (
	"errors"
	"fmt"
	"slices"
)

// Config sizes a Scheduler: the KV cache and the most a step carries (the
// model's maxima).
type Config struct {
	PageSize, KVPages int
	// MaxPagesPerSeq is the width of a page-table row.
	MaxPagesPerSeq int
	// MaxTokens, MaxSeqs and MaxLogitRows bound one step.
	MaxTokens, MaxSeqs, MaxLogitRows int
	// TopK is the experts each token routes to per layer (Routed).
	TopK int
}

// Sink receives what the scheduler delivers and tells it about aborts.
type Sink interface {
	// Deliver hands over a finished sample of r; last is set for the
	// request's last sample.
	Deliver(r *Req, s Sample, last bool)
	// Aborted reports whether r's owner has asked for it to be aborted.
	Aborted(r *Req) bool
}

// Req is a request in the scheduler.
type Req struct {
	Request
	// Owner is the engine's handle for the request.
	Owner any

	reserved int   // pages reserved for the whole request
	prompt   []int // pages holding the prompt
	done     int   // prompt tokens planned for prefill
	left     int   // samples not yet delivered
	stop     map[int32]struct{}
	failed   bool   // a sample could not be drawn: the others end at the next Reap
	gone     bool   // every sample has been delivered
	seqs     []*Seq // the samples, once forked
	lastStep uint64 // the last step with a prefill chunk of the request
}

// Reserved returns the most KV pages the request can ever hold.
func (r *Req) Reserved() int { return r.reserved }

// Seq is one running sample.
type Seq struct {
	r      *Req
	index  int
	pages  []int
	length int // tokens in the cache once the planned steps have run
	last   int32
	out    Sample

	lastStep uint64 // the last planned step with a row of this sample
	row      int32  // the sample's logit row in that step
	member   uint64 // the last committed step with a row of this sample
	copyDst  int    // a page copy the next plan must do first (-1: none)
	copySrc  int
	routed   []int32 // storage for Routed ids
}

// Req returns the sample's request.
func (q *Seq) Req() *Req { return q.r }

// Index returns the sample's index in its request.
func (q *Seq) Index() int { return q.index }

// Pages returns the pages the sample holds.
func (q *Seq) Pages() []int { return q.pages }

func (q *Seq) finished() bool { return q.out.Finish != "" }

type deferred struct {
	step uint64
	page int
}

// Scheduler owns requests, admission, pages and running samples.
type Scheduler struct {
	cfg   Config
	sink  Sink
	pages *Pages

	waiting []*Req
	prefill []*Req
	running []*Seq
	spare   []*Seq
	// holdBack keeps admission from taking this many pages (a scoring job
	// waiting for them).
	holdBack int

	plans     [2]Plan
	planned   uint64 // the last step planned
	committed uint64 // the last step committed
	copies    []*Seq // samples whose page copy the next plan carries
	deferred  []deferred
}

// New returns a scheduler delivering to sink.
func New(cfg Config, sink Sink) *Scheduler {
	s := &Scheduler{cfg: cfg, sink: sink, pages: NewPages(cfg.KVPages)}
	for i := range s.plans {
		p := &s.plans[i]
		p.Width = cfg.MaxPagesPerSeq
		p.table = make([]int32, cfg.MaxSeqs*cfg.MaxPagesPerSeq)
		p.Tokens, p.Positions = make([]int32, 0, cfg.MaxTokens), make([]int32, 0, cfg.MaxTokens)
		p.Slots, p.Feed = make([]int32, 0, cfg.MaxTokens), make([]int32, 0, cfg.MaxTokens)
		p.SeqLens, p.QueryStart = make([]int32, 0, cfg.MaxSeqs), make([]int32, 0, cfg.MaxSeqs+1)
		p.LogitRows, p.Sampling = make([]int32, 0, cfg.MaxLogitRows), make([]SampleRow, 0, cfg.MaxLogitRows)
		p.Owners = make([]Owner, 0, cfg.MaxLogitRows)
	}
	s.running, s.spare = make([]*Seq, 0, cfg.MaxSeqs), make([]*Seq, 0, cfg.MaxSeqs)
	return s
}

// Pages returns the page allocator (scoring takes pages of its own from it
// between steps).
func (s *Scheduler) Pages() *Pages { return s.pages }

// HoldBack keeps n pages out of admission (0: none).
func (s *Scheduler) HoldBack(n int) { s.holdBack = n }

// Waiting returns the requests waiting for admission.
func (s *Scheduler) Waiting() int { return len(s.waiting) }

// Running returns the samples decoding.
func (s *Scheduler) Running() int { return len(s.running) }

// Busy reports whether a step has work: a prompt to prefill or a sample to
// decode.
func (s *Scheduler) Busy() bool { return len(s.prefill) > 0 || len(s.running) > 0 }

// InFlight returns the steps planned and not yet committed.
func (s *Scheduler) InFlight() int { return int(s.planned - s.committed) }

// NewReq makes the scheduler's request for req, with its page reservation;
// it reads only the configuration, so any goroutine may call it.
func (s *Scheduler) NewReq(req Request, owner any) *Req {
	r := &Req{Request: req, Owner: owner, left: req.N, stop: stopSet(req.Params.Stop)}
	r.reserved = s.reservation(r)
	return r
}

// reservation is the most pages a request can ever hold: the prompt's full
// pages, shared, plus for each sample the pages from the prompt's partial
// last page to its last token.
func (s *Scheduler) reservation(r *Req) int {
	ps := s.cfg.PageSize
	P := len(r.Prompt)
	return P/ps + r.N*ceilDiv(P%ps+r.Params.MaxTokens, ps)
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// stopSet returns ids as a set (nil when empty).
func stopSet(ids []int32) map[int32]struct{} {
	if len(ids) == 0 {
		return nil
	}
	set := make(map[int32]struct{}, len(ids))
	for _, t := range ids {
		set[t] = struct{}{}
	}
	return set
}

func (r *Req) isStop(tok int32) bool {
	_, ok := r.stop[tok]
	return ok
}

// Add queues a request for admission.
func (s *Scheduler) Add(r *Req) { s.waiting = append(s.waiting, r) }

func (s *Scheduler) aborted(r *Req) bool { return r.failed || s.sink.Aborted(r) }

// Reap ends aborted requests wherever they are.
func (s *Scheduler) Reap() {
	keep := s.running[:0]
	for _, q := range s.running {
		if s.aborted(q.r) {
			s.finish(q, FinishAbort)
			continue
		}
		keep = append(keep, q)
	}
	clear(s.running[len(keep):])
	s.running = keep
	drop := func(list []*Req, admitted bool) []*Req {
		out := list[:0]
		for _, r := range list {
			if !s.aborted(r) {
				out = append(out, r)
				continue
			}
			if admitted { // waiting requests hold no pages yet
				for _, p := range r.prompt {
					s.release(p, r.lastStep)
				}
				s.pages.Unreserve(r.reserved - len(r.prompt))
				r.prompt = nil
			}
			s.abortRequest(r)
		}
		clear(list[len(out):])
		return out
	}
	s.waiting, s.prefill = drop(s.waiting, false), drop(s.prefill, true)
}

// Admit moves waiting requests, in order, into prefill while their page
// reservation fits.
func (s *Scheduler) Admit() {
	for len(s.waiting) > 0 {
		r := s.waiting[0]
		if !s.pages.Reserve(r.reserved + s.holdBack) {
			return
		}
		s.pages.Unreserve(s.holdBack)
		s.waiting[0] = nil
		s.waiting = s.waiting[1:]
		s.prefill = append(s.prefill, r)
	}
}

// Shutdown ends every sample of every request with FinishAbort (the engine
// stops). Nothing may be in flight.
func (s *Scheduler) Shutdown() {
	for _, q := range s.running {
		s.finish(q, FinishAbort)
	}
	s.running = nil
	for _, r := range append(s.waiting, s.prefill...) {
		s.abortRequest(r)
	}
	s.waiting, s.prefill = nil, nil
}

// abortRequest ends every undelivered sample of a request that has no
// running samples (waiting, in prefill, or failing to fork).
func (s *Scheduler) abortRequest(r *Req) {
	if r.gone {
		return
	}
	r.gone = true
	for i := range r.left {
		left := r.left - i - 1
		s.sink.Deliver(r, Sample{Index: r.N - r.left + i, Finish: FinishAbort}, left == 0)
	}
	r.left = 0
}

// release drops a reference to page p once step, which may still write it,
// has been committed.
func (s *Scheduler) release(p int, step uint64) {
	if step > s.committed {
		s.deferred = append(s.deferred, deferred{step, p})
		return
	}
	s.pages.Release(p)
}

// row is the sampling row of sample i drawing the token at position pos.
func (r *Req) row(i, pos int) SampleRow {
	p := r.Params
	return SampleRow{Temperature: p.Temperature, TopK: int32(p.TopK), TopP: p.TopP, Seed: p.Seed, SampleID: int32(i), Position: int32(pos)}
}

// Plan plans the next step: one decode token for every running sample,
// then prefill chunks while the token budget lasts. With a step in flight
// (planned, not committed) it plans as if every sample decoding in that
// step goes on: their inputs are fed from its sampled tokens on the device.
// It returns nil when there is nothing to run.
func (s *Scheduler) Plan() (*Plan, error) {
	if s.planned-s.committed >= 2 {
		return nil, errors.New("sched: two steps are already in flight")
	}
	c := s.cfg
	ps := c.PageSize
	step := s.planned + 1
	prev := s.planned
	inFlight := s.planned > s.committed
	p := &s.plans[step%2]
	p.reset()
	p.Step = step
	addSeq := func(pages []int, length, n int) error {
		if len(pages) > p.Width {
			return fmt.Errorf("sched: a sequence holds %d pages, a page-table row %d", len(pages), p.Width)
		}
		i := len(p.SeqLens)
		p.SeqLens = append(p.SeqLens, int32(length))
		row := p.table[i*p.Width : i*p.Width+len(pages)]
		for j, pg := range pages {
			row[j] = int32(pg)
		}
		p.QueryStart = append(p.QueryStart, p.QueryStart[len(p.QueryStart)-1]+int32(n))
		return nil
	}
	for _, q := range s.running {
		if len(p.SeqLens) == c.MaxSeqs || len(p.Tokens) == c.MaxTokens || len(p.LogitRows) == c.MaxLogitRows {
			break
		}
		fed := inFlight && q.lastStep == prev
		if fed && len(q.out.Tokens)+1 >= q.r.Params.MaxTokens {
			continue // its row in flight draws its last token
		}
		pos := q.length
		if pos/ps >= len(q.pages) {
			pg, err := s.pages.Take()
			if err != nil {
				return nil, err
			}
			q.pages = append(q.pages, pg)
		}
		tok, feed := q.last, int32(-1)
		if fed {
			tok, feed = -1, q.row
			p.Fed = true
		}
		p.Tokens = append(p.Tokens, tok)
		p.Feed = append(p.Feed, feed)
		p.Positions = append(p.Positions, int32(pos))
		p.Slots = append(p.Slots, int32(q.pages[pos/ps]*ps+pos%ps))
		q.row = int32(len(p.LogitRows))
		q.lastStep = step
		p.LogitRows = append(p.LogitRows, int32(len(p.Tokens)-1))
		p.Sampling = append(p.Sampling, q.r.row(q.index, pos+1))
		p.Owners = append(p.Owners, Owner{Seq: q})
		p.Routing = p.Routing || q.r.Params.RoutedExperts
		q.length++
		if err := addSeq(q.pages, q.length, 1); err != nil {
			return nil, err
		}
	}
	for _, r := range s.prefill {
		budget := c.MaxTokens - len(p.Tokens)
		if budget <= 0 || len(p.SeqLens) == c.MaxSeqs {
			break
		}
		P := len(r.Prompt)
		if r.done == P {
			continue // its last chunk is in flight: it forks when that step is committed
		}
		n := min(budget, P-r.done)
		last := r.done+n == P
		if last && len(p.LogitRows)+r.N > c.MaxLogitRows {
			if n == 1 {
				continue // its sampling rows do not fit this step; others may
			}
			n--
			last = false
		}
		p.DecodeOnly = false
		for i := range n {
			pos := r.done + i
			for pos/ps >= len(r.prompt) {
				pg, err := s.pages.Take()
				if err != nil {
					return nil, err
				}
				r.prompt = append(r.prompt, pg)
			}
			p.Tokens = append(p.Tokens, r.Prompt[pos])
			p.Feed = append(p.Feed, -1)
			p.Positions = append(p.Positions, int32(pos))
			p.Slots = append(p.Slots, int32(r.prompt[pos/ps]*ps+pos%ps))
		}
		r.done += n
		r.lastStep = step
		if err := addSeq(r.prompt, r.done, n); err != nil {
			return nil, err
		}
		if last {
			for i := range r.N {
				p.LogitRows = append(p.LogitRows, int32(len(p.Tokens)-1))
				p.Sampling = append(p.Sampling, r.row(i, P))
				p.Owners = append(p.Owners, Owner{Req: r, Sample: i})
			}
			p.Routing = p.Routing || r.Params.RoutedExperts
		}
	}
	if len(p.Tokens) == 0 {
		return nil, nil
	}
	p.PageTable = p.table[:len(p.SeqLens)*p.Width]
	for _, q := range s.copies {
		if !q.finished() {
			p.Copies = append(p.Copies, PageCopy{Dst: q.copyDst, Src: q.copySrc})
		}
		q.copyDst = -1
	}
	clear(s.copies)
	s.copies = s.copies[:0]
	s.planned = step
	return p, nil
}

// Commit takes the results of the oldest step in flight: it emits each
// row's token to its owner, forks the requests whose prefill ended, and
// ends the samples that stop. Rows of samples that ended meanwhile are
// discarded.
func (s *Scheduler) Commit(p *Plan, res *Results) error {
	if p.Step != s.committed+1 || p.Step > s.planned {
		return fmt.Errorf("sched: commit of step %d, want step %d", p.Step, s.committed+1)
	}
	if len(res.Tokens) < len(p.Owners) || len(res.LogProbs) < len(p.Owners) {
		return fmt.Errorf("sched: step %d: %d tokens and %d logprobs for %d rows", p.Step, len(res.Tokens), len(res.LogProbs), len(p.Owners))
	}
	s.committed = p.Step
	for row, ow := range p.Owners {
		q := ow.Seq
		if q == nil {
			r := ow.Req
			if r.gone {
				continue // aborted while its last chunk ran
			}
			if ow.Sample == 0 {
				s.prefill = slices.DeleteFunc(s.prefill, func(x *Req) bool { return x == r })
				if err := s.fork(r); err != nil {
					s.abortRequest(r)
					return err
				}
			}
			q = r.seqs[ow.Sample]
		}
		if q.finished() {
			continue // it ended after this row was planned: the row is discarded
		}
		q.member = p.Step
		s.emit(q, p, res, row)
	}
	// Samples that were not in this step go first next time.
	next := s.spare[:0]
	for _, q := range s.running {
		if q.member != p.Step && !q.finished() {
			next = append(next, q)
		}
	}
	for _, ow := range p.Owners {
		q := ow.Seq
		if q == nil {
			if ow.Req.seqs == nil {
				continue
			}
			q = ow.Req.seqs[ow.Sample]
		}
		if q.member == p.Step && !q.finished() {
			next = append(next, q)
		}
	}
	clear(s.running)
	s.running, s.spare = next, s.running[:0]
	keep := s.deferred[:0]
	for _, d := range s.deferred {
		if d.step <= s.committed {
			s.pages.Release(d.page)
			continue
		}
		keep = append(keep, d)
	}
	s.deferred = keep
	return nil
}

// fork turns a request whose prompt is prefilled into its N samples. They
// share the prompt's full pages; the partial last page is copied for every
// sample but the first, which takes the original (the copy is the first
// thing the next plan asks for).
func (s *Scheduler) fork(r *Req) error {
	ps := s.cfg.PageSize
	P := len(r.Prompt)
	full := P / ps
	want := ceilDiv(P%ps+r.Params.MaxTokens, ps) // pages of its own a sample may take
	r.seqs = make([]*Seq, r.N)
	for i := range r.seqs {
		q := &Seq{r: r, index: i, length: P, copyDst: -1, lastStep: r.lastStep, out: Sample{Index: i,
			Tokens: make([]int32, 0, r.Params.MaxTokens), LogProbs: make([]float32, 0, r.Params.MaxTokens),
			Versions: make([]uint64, 0, r.Params.MaxTokens)}}
		if r.Params.RoutedExperts {
			q.out.Routed = make([][]int32, 0, r.Params.MaxTokens)
		}
		q.pages = make([]int, 0, full+want)
		q.pages = append(q.pages, r.prompt[:full]...) // shared: one reference each
		if P%ps != 0 {
			if i == 0 {
				q.pages = append(q.pages, r.prompt[full])
			} else {
				pg, err := s.pages.Take()
				if err != nil {
					return err
				}
				q.pages = append(q.pages, pg)
				q.copyDst, q.copySrc = pg, r.prompt[full]
				s.copies = append(s.copies, q)
			}
		}
		r.seqs[i] = q
	}
	for _, pg := range r.prompt[:full] {
		s.pages.Share(pg, r.N-1)
	}
	// The request's reservation moves to its samples: the shared full pages
	// are accounted once, in the prompt pages already taken.
	r.prompt = nil
	return nil
}

// routedChunk is the tokens' worth of routed ids allocated at a time.
const routedChunk = 64

// emit appends the token drawn in row to q. A row the sampler could not
// draw from ends q with FinishError and aborts the rest of its request: a
// numeric failure fails that request only.
func (s *Scheduler) emit(q *Seq, p *Plan, res *Results, row int) {
	params := &q.r.Params
	tok := res.Tokens[row]
	if tok == Unsampled {
		q.out.Err = fmt.Sprintf("sample %d, token %d: the model's logits are not finite (NaN or +Inf, or all -Inf): nothing to sample from", q.index, len(q.out.Tokens))
		q.r.failed = true
		s.finish(q, FinishError)
		return
	}
	q.out.Tokens = append(q.out.Tokens, tok)
	q.out.LogProbs = append(q.out.LogProbs, res.LogProbs[row])
	q.out.Versions = append(q.out.Versions, p.Version)
	if params.RoutedExperts && res.Routing != nil {
		k := s.cfg.TopK
		width := len(res.Routing) * k
		if cap(q.routed)-len(q.routed) < width {
			q.routed = make([]int32, 0, width*min(routedChunk, params.MaxTokens-len(q.out.Tokens)+1))
		}
		at := len(q.routed)
		t := int(p.LogitRows[row])
		for _, layer := range res.Routing {
			q.routed = append(q.routed, layer[t*k:(t+1)*k]...)
		}
		q.out.Routed = append(q.out.Routed, q.routed[at:len(q.routed):len(q.routed)])
	}
	q.last = tok
	switch {
	case q.r.isStop(tok):
		s.finish(q, FinishStop)
	case len(q.out.Tokens) >= params.MaxTokens:
		s.finish(q, FinishLength)
	}
}

// finish delivers q and releases its pages (once the last step that may
// write them has been committed), once.
func (s *Scheduler) finish(q *Seq, why FinishReason) {
	if q.finished() {
		return
	}
	q.out.Finish = why
	for _, pg := range q.pages {
		s.release(pg, q.lastStep)
	}
	ps := s.cfg.PageSize
	// Return the part of the reservation this sample never used.
	want := ceilDiv(len(q.r.Prompt)%ps+q.r.Params.MaxTokens, ps)
	own := len(q.pages) - len(q.r.Prompt)/ps
	s.pages.Unreserve(want - own)
	q.pages = nil
	q.routed = nil
	r := q.r
	r.left--
	if r.left == 0 {
		r.gone = true
	}
	s.sink.Deliver(r, q.out, r.left == 0)
}
