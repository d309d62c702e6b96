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
	// OnDemand takes KV pages as samples grow instead of reserving a
	// request's whole max_tokens on admission. When the cache runs out,
	// the youngest work is preempted (its pages freed) and recomputed
	// later from its prompt and the tokens it had drawn; with batch-
	// invariant kernels and draws keyed by (seed, sample, position) its
	// tokens and logprobs are bitwise those it would have produced
	// unpreempted.
	OnDemand bool
	// PrefixCache keeps the KV pages of prompts' full pages after their
	// prefill, keyed by the tokens and the policy version (SetVersion): a
	// request whose prompt starts with a cached prefix shares those pages
	// and prefills only the rest. Cached pages nobody uses are evicted,
	// least recently used first, when pages run short.
	PrefixCache bool
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

	reserved  int    // pages reserved on admission
	perSample int    // of them, the pages each sample reserves beyond the prompt's full pages
	order     uint64 // admission order, from 1 (0: never admitted): smaller is older
	prompt    []int  // pages holding the prompt
	done      int    // prompt tokens planned for prefill
	left      int    // samples not yet delivered
	stop      map[int32]struct{}
	failed    bool   // a sample could not be drawn: the others end at the next Reap
	gone      bool   // every sample has been delivered
	seqs      []*Seq // the samples, once forked
	lastStep  uint64 // the last step with a prefill chunk of the request
	// kvVersion is the policy version its prompt's KV is computed under;
	// mixed: a chunk ran under another (its pages are not cached).
	kvVersion uint64
	mixed     bool
}

// Reserved returns the KV pages the request reserves on admission.
func (r *Req) Reserved() int { return r.reserved }

// Needs returns the most KV pages the request needs at once to make
// progress: its reservation, and with pages on demand also the pages of
// one sample grown to its max_tokens (a recomputed sample holds all of its
// pages alone). A request that needs more than the cache can never run.
func (r *Req) Needs(cfg Config) int {
	if !cfg.OnDemand {
		return r.reserved
	}
	return max(r.reserved, ceilDiv(len(r.Prompt)+r.Params.MaxTokens, cfg.PageSize))
}

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

	reserve int      // pages reserved for the sample and not yet taken
	state   seqState // running, preempted or resuming
	done    int      // resuming: tokens of its sequence planned for recompute
	stale   uint64   // rows of steps up to this one are discarded (preempted)
}

// seqState is where a sample is.
type seqState uint8

const (
	seqRunning   seqState = iota // decoding (in Scheduler.running)
	seqPreempted                 // holds no pages; waits to be recomputed (Scheduler.preempted)
	seqResuming                  // its prompt and tokens are being recomputed (Scheduler.resume)
)

// seqLen is the length of the sequence a preempted sample recomputes: its
// prompt and the tokens it has emitted.
func (q *Seq) seqLen() int { return len(q.r.Prompt) + len(q.out.Tokens) }

// tokenAt is token pos of that sequence.
func (q *Seq) tokenAt(pos int) int32 {
	if P := len(q.r.Prompt); pos >= P {
		return q.out.Tokens[pos-P]
	}
	return q.r.Prompt[pos]
}

// older orders work by age: the request admitted first, then the lower
// sample index (-1: a request not yet forked).
func older(ra *Req, ia int, rb *Req, ib int) bool {
	if ra.order != rb.order {
		return ra.order < rb.order
	}
	return ia < ib
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
	// With pages on demand: preempted samples waiting to be recomputed,
	// oldest first, and those being recomputed.
	preempted []*Seq
	resume    []*Seq
	admitted  uint64 // requests admitted so far (Req.order)
	stats     Stats
	cache     *prefixCache // nil without Config.PrefixCache
	version   uint64       // the policy version steps run under (SetVersion)
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
	if cfg.PrefixCache {
		s.cache = newPrefixCache(cfg.PageSize, s.pages)
		s.pages.cache = s.cache
	}
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

// Config returns the scheduler's configuration.
func (s *Scheduler) Config() Config { return s.cfg }

// Pages returns the page allocator (scoring takes pages of its own from it
// between steps).
func (s *Scheduler) Pages() *Pages { return s.pages }

// HoldBack keeps n pages out of admission (0: none).
func (s *Scheduler) HoldBack(n int) { s.holdBack = n }

// Waiting returns the requests waiting for admission.
func (s *Scheduler) Waiting() int { return len(s.waiting) }

// Running returns the samples decoding.
func (s *Scheduler) Running() int { return len(s.running) }

// Busy reports whether a step has work: a prompt to prefill, a sample to
// recompute or to decode.
func (s *Scheduler) Busy() bool { return len(s.prefill) > 0 || len(s.running) > 0 || len(s.resume) > 0 }

// Stats counts the scheduler's preemptions.
type Stats struct {
	// Preemptions: samples and prompts whose pages were taken back.
	Preemptions uint64
	// Recomputed: tokens prefilled again after a preemption.
	Recomputed uint64
	// PromptTokens: prompt tokens of the requests admitted; PrefixHits:
	// those of them whose KV came from the prefix cache.
	PromptTokens, PrefixHits uint64
	// Evicted: cached prefix pages evicted because pages ran short.
	Evicted uint64
}

// SetVersion sets the policy version the next steps run under; a change
// drops the prefix cache. Call it before Admit.
func (s *Scheduler) SetVersion(v uint64) {
	s.version = v
	if s.cache != nil {
		s.cache.setVersion(v)
	}
}

// CachedPages returns the pages the prefix cache holds.
func (s *Scheduler) CachedPages() int {
	if s.cache == nil {
		return 0
	}
	return s.cache.size()
}

// lookup shares the cached pages of the longest prefix of the sequence
// tok(0) .. tok(n-1) (full pages only, and never the page of its last
// token, which is prefilled to draw from) and returns them.
func (s *Scheduler) lookup(tok func(i int) int32, n int) []int {
	if s.cache == nil {
		return nil
	}
	hit := s.cache.match(tok, (n-1)/s.cfg.PageSize)
	if len(hit) == 0 {
		return nil
	}
	pages := make([]int, len(hit))
	for i, e := range hit {
		pages[i] = e.page
		s.pages.Share(e.page, 1)
	}
	return pages
}

// unshare drops the references lookup took.
func (s *Scheduler) unshare(pages []int) {
	for _, pg := range pages {
		s.pages.Release(pg)
	}
}

// Stats returns the counts so far.
func (s *Scheduler) Stats() Stats {
	st := s.stats
	if s.cache != nil {
		st.Evicted = s.cache.evicted
	}
	return st
}

// Preempted returns the samples waiting to be recomputed.
func (s *Scheduler) Preempted() int { return len(s.preempted) }

// InFlight returns the steps planned and not yet committed.
func (s *Scheduler) InFlight() int { return int(s.planned - s.committed) }

// NewReq makes the scheduler's request for req, with its page reservation;
// it reads only the configuration, so any goroutine may call it.
func (s *Scheduler) NewReq(req Request, owner any) *Req {
	r := &Req{Request: req, Owner: owner, left: req.N, stop: stopSet(req.Params.Stop)}
	ps := s.cfg.PageSize
	P := len(r.Prompt)
	// Reserved: the prompt's full pages, shared, plus for each sample the
	// pages from the prompt's partial last page to its last token, or with
	// pages on demand only to its first token.
	r.perSample = ceilDiv(P%ps+r.Params.MaxTokens, ps)
	if s.cfg.OnDemand {
		r.perSample = ceilDiv(P%ps+1, ps)
	}
	r.reserved = P/ps + r.N*r.perSample
	return r
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
	s.preempted, s.resume = s.reapSeqs(s.preempted), s.reapSeqs(s.resume)
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

// reapSeqs ends the samples of list whose request was aborted.
func (s *Scheduler) reapSeqs(list []*Seq) []*Seq {
	keep := list[:0]
	for _, q := range list {
		if s.aborted(q.r) {
			s.finish(q, FinishAbort)
			continue
		}
		keep = append(keep, q)
	}
	clear(list[len(keep):])
	return keep
}

// Admit moves waiting requests, in order, into prefill while their page
// reservation fits. With pages on demand, preempted samples come first,
// oldest first, and new requests wait while any does; admission then
// also leaves a page free for every running sample (its next page).
func (s *Scheduler) Admit() {
	margin := s.holdBack
	if s.cfg.OnDemand {
		margin += len(s.running)
		for len(s.preempted) > 0 {
			q := s.preempted[0]
			need := ceilDiv(q.seqLen()+1, s.cfg.PageSize)
			hit := s.lookup(q.tokenAt, q.seqLen())
			if !s.pages.Reserve(need - len(hit) + margin) {
				s.unshare(hit)
				return
			}
			s.pages.Unreserve(margin)
			q.reserve, q.state, q.done = need-len(hit), seqResuming, len(hit)*s.cfg.PageSize
			q.pages = append(q.pages[:0], hit...)
			s.preempted[0] = nil
			s.preempted = s.preempted[1:]
			s.resume = append(s.resume, q)
		}
	}
	for len(s.waiting) > 0 {
		r := s.waiting[0]
		hit := s.lookup(r.promptAt, len(r.Prompt))
		if !s.pages.Reserve(r.reserved - len(hit) + margin) {
			s.unshare(hit)
			return
		}
		s.pages.Unreserve(margin)
		if r.order == 0 {
			s.admitted++
			r.order = s.admitted
		}
		r.prompt, r.done = hit, len(hit)*s.cfg.PageSize
		r.kvVersion, r.mixed = s.version, false
		s.stats.PromptTokens += uint64(len(r.Prompt))
		s.stats.PrefixHits += uint64(r.done)
		s.waiting[0] = nil
		s.waiting = s.waiting[1:]
		s.prefill = append(s.prefill, r)
	}
}

// Shutdown ends every sample of every request with FinishAbort (the engine
// stops). Nothing may be in flight.
func (s *Scheduler) Shutdown() {
	for _, list := range [][]*Seq{s.running, s.resume, s.preempted} {
		for _, q := range list {
			s.finish(q, FinishAbort)
		}
	}
	s.running, s.resume, s.preempted = nil, nil, nil
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
	// chunk sizes the next prefill chunk of a sequence with rest tokens
	// to go under the step's budget; a last chunk needs rows sampling rows,
	// and when they do not fit it stops one token short (ok false: nothing
	// of it fits this step).
	chunk := func(budget, rest, rows int) (n int, last, ok bool) {
		n = min(budget, rest)
		last = n == rest
		if last && len(p.LogitRows)+rows > c.MaxLogitRows {
			if n == 1 {
				return 0, false, false
			}
			n, last = n-1, false
		}
		return n, last, true
	}
	if c.OnDemand {
		s.makeRoom(inFlight, prev)
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
			pg, ok, err := s.pageFor(q)
			if err != nil {
				return nil, err
			}
			if !ok {
				continue // no page this step (pages still held by the step in flight): it waits
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
	// Recomputations of preempted samples, oldest first: their prompt and
	// emitted tokens prefilled again into pages of their own; the last
	// chunk's row draws the token they were about to draw.
	for _, q := range s.resume {
		budget := c.MaxTokens - len(p.Tokens)
		if budget <= 0 || len(p.SeqLens) == c.MaxSeqs {
			break
		}
		L := q.seqLen()
		if q.done == L {
			continue // its last chunk is in flight: it runs again when that step is committed
		}
		n, last, ok := chunk(budget, L-q.done, 1)
		if !ok {
			continue
		}
		q.reserve -= ceilDiv(q.done+n, ps) - len(q.pages) // the pages the chunk takes come from its reservation
		if err := s.prefillChunk(p, &q.pages, q.tokenAt, q.done, n); err != nil {
			return nil, err
		}
		q.done += n
		q.lastStep = step
		s.stats.Recomputed += uint64(n)
		if err := addSeq(q.pages, q.done, n); err != nil {
			return nil, err
		}
		if last {
			q.length = L
			q.row = int32(len(p.LogitRows))
			p.LogitRows = append(p.LogitRows, int32(len(p.Tokens)-1))
			p.Sampling = append(p.Sampling, q.r.row(q.index, L))
			p.Owners = append(p.Owners, Owner{Seq: q})
			p.Routing = p.Routing || q.r.Params.RoutedExperts
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
		n, last, ok := chunk(budget, P-r.done, r.N)
		if !ok {
			continue // its sampling rows do not fit this step; others may
		}
		r.mixed = r.mixed || r.kvVersion != s.version
		if err := s.prefillChunk(p, &r.prompt, r.promptAt, r.done, n); err != nil {
			return nil, err
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
		if !q.finished() && q.copyDst >= 0 { // a preempted sample dropped its copy
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
		if q.finished() || p.Step <= q.stale {
			continue // it ended, or was preempted, after this row was planned: the row is discarded
		}
		if q.state == seqResuming {
			s.resume = slices.DeleteFunc(s.resume, func(x *Seq) bool { return x == q })
			q.state = seqRunning
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
		q := &Seq{r: r, index: i, length: P, copyDst: -1, lastStep: r.lastStep, reserve: r.perSample, out: Sample{Index: i,
			Tokens: make([]int32, 0, r.Params.MaxTokens), LogProbs: make([]float32, 0, r.Params.MaxTokens),
			Versions: make([]uint64, 0, r.Params.MaxTokens)}}
		if r.Params.RoutedExperts {
			q.out.Routed = make([][]int32, 0, r.Params.MaxTokens)
		}
		q.pages = make([]int, 0, full+want)
		q.pages = append(q.pages, r.prompt[:full]...) // shared: one reference each
		if P%ps != 0 {
			q.reserve-- // its copy of the partial page, or the page itself
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
	if s.cache != nil && !r.mixed && r.kvVersion == s.version {
		s.cache.insert(r.Prompt, r.prompt[:full])
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
	// Return the part of the reservation this sample never used.
	s.pages.Unreserve(q.reserve)
	q.reserve = 0
	q.pages = nil
	q.routed = nil
	r := q.r
	r.left--
	if r.left == 0 {
		r.gone = true
	}
	s.sink.Deliver(r, q.out, r.left == 0)
}

// promptAt is token i of the request's prompt.
func (r *Req) promptAt(i int) int32 { return r.Prompt[i] }

// prefillChunk adds tokens from .. from+n-1 of a sequence (tok) to the
// plan, taking reserved pages into *pages as positions reach them.
func (s *Scheduler) prefillChunk(p *Plan, pages *[]int, tok func(int) int32, from, n int) error {
	ps := s.cfg.PageSize
	p.DecodeOnly = false
	for pos := from; pos < from+n; pos++ {
		for pos/ps >= len(*pages) {
			pg, err := s.pages.Take()
			if err != nil {
				return err
			}
			*pages = append(*pages, pg)
		}
		p.Tokens = append(p.Tokens, tok(pos))
		p.Feed = append(p.Feed, -1)
		p.Positions = append(p.Positions, int32(pos))
		p.Slots = append(p.Slots, int32((*pages)[pos/ps]*ps+pos%ps))
	}
	return nil
}

// pageFor takes the page sample q grows into: from its reservation, or
// with pages on demand a page nobody reserved (ok false when there is
// none).
func (s *Scheduler) pageFor(q *Seq) (pg int, ok bool, err error) {
	if q.reserve > 0 || !s.cfg.OnDemand {
		q.reserve--
		pg, err := s.pages.Take()
		return pg, err == nil, err
	}
	pg, ok = s.pages.Grow()
	return pg, ok, nil
}

// growsNext reports whether running sample q takes a page beyond its
// reservation if the next step is planned now (the decode loop of Plan).
func (s *Scheduler) growsNext(q *Seq, inFlight bool, prev uint64) bool {
	if inFlight && q.lastStep == prev && len(q.out.Tokens)+1 >= q.r.Params.MaxTokens {
		return false
	}
	return q.reserve == 0 && q.length/s.cfg.PageSize >= len(q.pages)
}

// pendingFree counts the pages that come free when the step in flight is
// committed (at least: a page shared by several deferred releases is not
// counted).
func (s *Scheduler) pendingFree() int {
	n := 0
	for _, d := range s.deferred {
		if s.pages.Refs(d.page) == 1 {
			n++
		}
	}
	return n
}

// makeRoom preempts the youngest work, one piece at a time, until every
// running sample that grows into a new page this step can have one
// (pages the step in flight still holds count as coming back). The oldest
// piece of work is never preempted, so something always progresses; a
// sample left without a page waits for the next step.
func (s *Scheduler) makeRoom(inFlight bool, prev uint64) {
	for {
		need := 0
		for _, q := range s.running {
			if s.growsNext(q, inFlight, prev) {
				need++
			}
		}
		if need <= s.pages.Reclaimable()+s.pendingFree() || !s.preemptYoungest() {
			return
		}
	}
}

// preemptYoungest preempts the youngest of: running samples, samples
// being recomputed and prompts being prefilled whose last chunk is not in
// flight, unless it is the only one. It reports whether it preempted.
func (s *Scheduler) preemptYoungest() bool {
	var (
		vq         *Seq
		vr         *Req
		candidates int
	)
	consider := func(r *Req, i int, q *Seq) {
		candidates++
		if vq == nil && vr == nil {
			vq, vr = q, r
			return
		}
		yr, yi := vr, -1
		if vq != nil {
			yr, yi = vq.r, vq.index
		}
		if older(yr, yi, r, i) {
			vq, vr = q, r
		}
	}
	for _, q := range s.running {
		consider(q.r, q.index, q)
	}
	for _, q := range s.resume {
		if q.done < q.seqLen() {
			consider(q.r, q.index, q)
		}
	}
	for _, r := range s.prefill {
		if r.done < len(r.Prompt) {
			consider(r, -1, nil)
		}
	}
	if candidates < 2 {
		return false
	}
	s.stats.Preemptions++
	if vq == nil {
		s.preemptPrompt(vr)
		return true
	}
	if vq.state == seqResuming {
		s.resume = slices.DeleteFunc(s.resume, func(x *Seq) bool { return x == vq })
	} else {
		s.running = slices.DeleteFunc(s.running, func(x *Seq) bool { return x == vq })
	}
	s.preemptSeq(vq)
	return true
}

// preemptSeq frees the pages of a running or resuming sample (once the
// step in flight that may write them is committed) and queues it to be
// recomputed. Its rows in steps planned so far are discarded at commit.
func (s *Scheduler) preemptSeq(q *Seq) {
	for _, pg := range q.pages {
		s.release(pg, q.lastStep)
	}
	s.pages.Unreserve(q.reserve)
	q.reserve, q.done, q.copyDst = 0, 0, -1
	q.pages = q.pages[:0]
	q.stale = s.planned
	q.state = seqPreempted
	i, _ := slices.BinarySearchFunc(s.preempted, q, func(x, q *Seq) int {
		if older(x.r, x.index, q.r, q.index) {
			return -1
		}
		return 1
	})
	s.preempted = slices.Insert(s.preempted, i, q)
}

// preemptPrompt frees the pages of a prompt being prefilled and puts its
// request back at the head of the queue (ahead of every request younger
// than it), to be prefilled again from its first token.
func (s *Scheduler) preemptPrompt(r *Req) {
	for _, pg := range r.prompt {
		s.release(pg, r.lastStep)
	}
	s.pages.Unreserve(r.reserved - len(r.prompt))
	r.prompt, r.done = nil, 0
	s.prefill = slices.DeleteFunc(s.prefill, func(x *Req) bool { return x == r })
	i := 0
	for i < len(s.waiting) && s.waiting[i].order != 0 && s.waiting[i].order < r.order {
		i++
	}
	s.waiting = slices.Insert(s.waiting, i, r)
}
