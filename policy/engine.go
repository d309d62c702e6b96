package policy

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// FinishReason says why a sample ended.
type FinishReason string

// Finish reasons.
const (
	FinishStop   FinishReason = "stop"   // a stop token was produced (it is included)
	FinishLength FinishReason = "length" // max_tokens was reached
	FinishAbort  FinishReason = "abort"  // the request was aborted or the engine stopped
	// FinishError: the model's logits for this sample could not be sampled
	// (NaN or +Inf, or all -Inf); Sample.Err says where. The request's other
	// samples are aborted; the engine and other requests go on.
	FinishError FinishReason = "error"
)

// Sentinel errors.
var (
	ErrStopped  = errors.New("policy: engine stopped")
	ErrTooLarge = errors.New("policy: request can never fit the KV cache")
)

// SamplingParams are a request's sampling settings.
type SamplingParams struct {
	Temperature float32 // 0: greedy
	TopP        float32 // (0, 1]; 0 means 1
	TopK        int     // 0: all
	MaxTokens   int     // >= 1
	Stop        []int32 // stop token ids
	Seed        uint64
	// RoutedExperts asks for the expert ids each generated token's forward
	// pass routed to, per layer.
	RoutedExperts bool
}

// Request is one prompt with N samples.
type Request struct {
	ID     string
	Prompt []int32
	N      int
	Params SamplingParams
}

// Sample is one finished sample of a request.
type Sample struct {
	Index    int
	Tokens   []int32   // generated tokens
	LogProbs []float32 // of each token under softmax(logits / T)
	Versions []uint64  // the policy version each token was produced under
	Finish   FinishReason
	// Routed[i][layer*k + j]: the experts of the forward pass that produced
	// token i (RoutedExperts only).
	Routed [][]int32
	// Err says why a sample ended with FinishError.
	Err string
}

// Handle is a submitted request's result stream.
type Handle struct {
	id      string
	samples chan Sample
	abort   chan struct{}
	once    sync.Once
}

// Samples delivers each sample as it finishes; it is closed after the last.
func (h *Handle) Samples() <-chan Sample { return h.samples }

// Abort ends the request's unfinished samples with FinishAbort. It is
// idempotent and safe from any goroutine.
func (h *Handle) Abort() { h.once.Do(func() { close(h.abort) }) }

// EngineConfig sizes the engine. The KV cache is the model's
// (ModelOptions.KVPages x PageSize).
type EngineConfig struct {
	// Graphs, when set, runs decode-only steps through it (captured per
	// batch-size bucket); nil runs every step eagerly.
	Graphs StepRunner
	// Version is the policy version of the loaded weights.
	Version uint64
	// Metrics, when set, receives the loop's metrics.
	Metrics *EngineMetrics
}

// StepRunner runs a decode-only step of n sequences: it may pad to a
// bucket and replay a captured graph of Model.Forward. Pad reports the
// padded size for n, so the engine can stage padding rows.
type StepRunner interface {
	Pad(n int) (int, error)
	Run(padded int) error
}

// Engine is the continuous-batching generation loop over one Model.
//
// Submit, Score and AtBoundary may be called from any goroutine; Run is the
// loop and owns the model (and its backend) while it runs. Everything below
// the mutex-protected inbox is touched by the loop goroutine only.
type Engine struct {
	m      *Model
	cfg    EngineConfig
	mu     sync.Mutex
	inbox  []any // *request, *boundary
	wake   chan struct{}
	closed bool

	stats engineStats

	version atomic.Uint64 // the policy version tokens are produced under

	// Loop state.
	pages    pageAlloc
	waiting  []*request
	prefill  []*request
	running  []*seq
	maxPages int
	// scoreNeed holds back admission while a scoring job waits for this
	// many pages, so steady generation load cannot starve it.
	scoreNeed int
}

// EngineStats are counters of the loop's work since it started.
type EngineStats struct {
	Steps       uint64 // forward passes
	GraphSteps  uint64 // of which replayed from a captured graph
	Tokens      uint64 // tokens forwarded (prompt and decode)
	Generated   uint64 // tokens sampled
	Failed      uint64 // samples ended with FinishError
	KVPagesUsed int64  // pages held by sequences after the last step
	Waiting     int64  // requests waiting for admission after the last step
	Running     int64  // samples decoding after the last step
}

type engineStats struct {
	steps, graphSteps, tokens, generated, failed atomic.Uint64
	pages, waiting, running                      atomic.Int64
}

// Stats returns the loop's counters; safe from any goroutine.
func (e *Engine) Stats() EngineStats {
	return EngineStats{Steps: e.stats.steps.Load(), GraphSteps: e.stats.graphSteps.Load(), Tokens: e.stats.tokens.Load(),
		Generated: e.stats.generated.Load(), Failed: e.stats.failed.Load(), KVPagesUsed: e.stats.pages.Load(), Waiting: e.stats.waiting.Load(), Running: e.stats.running.Load()}
}

type request struct {
	Request
	h        *Handle
	reserved int   // pages reserved for the whole request
	prompt   []int // pages holding the prompt
	done     int   // prompt tokens prefilled
	left     int   // samples not yet delivered
	// stop is Params.Stop as a set: emit checks every token against it.
	stop map[int32]struct{}
}

type seq struct {
	r      *request
	index  int
	pages  []int
	length int // tokens in the cache
	last   int32
	out    Sample
}

type boundary struct {
	fn    func() error
	err   chan error
	state atomic.Int32 // boundaryPending, then running or cancelled
}

const (
	boundaryPending int32 = iota
	boundaryRunning
	boundaryCancelled
)

// run runs the function unless its caller gave up first.
func (b *boundary) run() {
	if b.state.CompareAndSwap(boundaryPending, boundaryRunning) {
		b.err <- b.fn()
	}
}

// NewEngine makes an engine over m. The model must not be used by anything
// else while the engine runs.
func NewEngine(m *Model, cfg EngineConfig) *Engine {
	o := m.opts
	e := &Engine{m: m, cfg: cfg, wake: make(chan struct{}, 1), pages: newPageAlloc(o.KVPages), maxPages: o.maxPagesPerSeq(m.cfg)}
	e.version.Store(cfg.Version)
	return e
}

// Version returns the policy version tokens are being produced under; safe
// from any goroutine.
func (e *Engine) Version() uint64 { return e.version.Load() }

// SetVersion sets the policy version. Call it inside AtBoundary, together
// with the weight change it names, so no step sees one without the other.
func (e *Engine) SetVersion(v uint64) { e.version.Store(v) }

// Submit validates and queues a request.
func (e *Engine) Submit(req Request) (*Handle, error) {
	// The engine keeps the request: it must not share the caller's slices.
	req.Prompt, req.Params.Stop = slices.Clone(req.Prompt), slices.Clone(req.Params.Stop)
	if err := e.validate(&req); err != nil {
		return nil, err
	}
	r := &request{Request: req, left: req.N, stop: stopSet(req.Params.Stop),
		h: &Handle{id: req.ID, samples: make(chan Sample, req.N), abort: make(chan struct{})}}
	r.reserved = e.reservation(r)
	if r.reserved > e.m.opts.KVPages {
		return nil, fmt.Errorf("policy: request %q needs %d KV pages, the cache has %d: %w", req.ID, r.reserved, e.m.opts.KVPages, ErrTooLarge)
	}
	if err := e.post(r); err != nil {
		return nil, err
	}
	return r.h, nil
}

func (e *Engine) validate(r *Request) error {
	c, p := e.m.cfg, &r.Params
	if p.TopP == 0 {
		p.TopP = 1
	}
	switch {
	case len(r.Prompt) == 0:
		return fmt.Errorf("policy: request %q: empty prompt", r.ID)
	case r.N < 1:
		return fmt.Errorf("policy: request %q: n = %d, want >= 1", r.ID, r.N)
	case p.MaxTokens < 1:
		return fmt.Errorf("policy: request %q: max_tokens = %d, want >= 1", r.ID, p.MaxTokens)
	case len(r.Prompt)+p.MaxTokens > c.MaxPositions:
		return fmt.Errorf("policy: request %q: prompt of %d tokens + max_tokens %d exceeds the context of %d", r.ID, len(r.Prompt), p.MaxTokens, c.MaxPositions)
	case !(p.Temperature >= 0) || p.Temperature > 1e6:
		return fmt.Errorf("policy: request %q: temperature %v, want 0 (greedy) up to 1e6", r.ID, p.Temperature)
	case !(p.TopP > 0 && p.TopP <= 1):
		return fmt.Errorf("policy: request %q: top_p %v, want (0, 1]", r.ID, p.TopP)
	case p.TopK < 0 || p.TopK > c.VocabSize:
		return fmt.Errorf("policy: request %q: top_k %d, want 0..%d", r.ID, p.TopK, c.VocabSize)
	case r.N > e.m.opts.MaxSeqs || r.N > e.m.opts.MaxLogitRows:
		return fmt.Errorf("policy: request %q: n = %d exceeds the %d sequences a step carries", r.ID, r.N, min(e.m.opts.MaxSeqs, e.m.opts.MaxLogitRows))
	}
	for i, t := range r.Prompt {
		if t < 0 || int(t) >= c.VocabSize {
			return fmt.Errorf("policy: request %q: prompt token %d is %d, outside the vocabulary of %d", r.ID, i, t, c.VocabSize)
		}
	}
	return nil
}

// reservation is the most pages a request can ever hold: the prompt's full
// pages, shared, plus for each sample the pages from the prompt's partial
// last page to its last token.
func (e *Engine) reservation(r *request) int {
	ps := e.m.opts.PageSize
	P := len(r.Prompt)
	return P/ps + r.N*ceilDiv(P%ps+r.Params.MaxTokens, ps)
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

func (e *Engine) post(item any) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrStopped
	}
	e.inbox = append(e.inbox, item)
	select {
	case e.wake <- struct{}{}:
	default:
	}
	return nil
}

// AtBoundary runs fn on the loop goroutine between two steps (a weight
// commit) and returns its error. Generation pauses only while fn runs. If
// ctx ends before fn starts, fn never runs and ctx's error is returned; once
// fn has started, AtBoundary waits for it. fn must not call AtBoundary.
func (e *Engine) AtBoundary(ctx context.Context, fn func() error) error {
	b := &boundary{fn: fn, err: make(chan error, 1)}
	if err := e.post(b); err != nil {
		return err
	}
	select {
	case err := <-b.err:
		return err
	case <-ctx.Done():
		if b.state.CompareAndSwap(boundaryPending, boundaryCancelled) {
			return ctx.Err()
		}
		return <-b.err // it is running: its effects happen, so report them
	}
}

// Run is the loop. It returns when ctx is done, after ending every
// unfinished sample with FinishAbort; it must not be called twice.
func (e *Engine) Run(ctx context.Context) error {
	defer e.shutdown()
	for {
		e.drainInbox()
		e.reapAborted()
		e.admit()
		if len(e.prefill) == 0 && len(e.running) == 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-e.wake:
			}
			continue
		}
		if err := ctx.Err(); err != nil {
			return nil
		}
		if err := e.step(); err != nil {
			return fmt.Errorf("engine step: %w", err)
		}
	}
}

// takeInbox empties the inbox; with closing, Submit and AtBoundary refuse
// anything new from then on.
func (e *Engine) takeInbox(closing bool) []any {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = e.closed || closing
	inbox := e.inbox
	e.inbox = nil
	return inbox
}

func (e *Engine) shutdown() {
	for _, it := range e.takeInbox(true) {
		switch it := it.(type) {
		case *request:
			e.waiting = append(e.waiting, it)
		case *boundary:
			if it.state.CompareAndSwap(boundaryPending, boundaryCancelled) {
				it.err <- ErrStopped
			}
		}
	}
	for _, s := range e.running {
		e.finish(s, FinishAbort)
	}
	e.running = nil
	for _, r := range append(e.waiting, e.prefill...) {
		e.abortRequest(r)
	}
	e.waiting, e.prefill = nil, nil
}

func (e *Engine) drainInbox() {
	for _, it := range e.takeInbox(false) {
		switch it := it.(type) {
		case *request:
			e.waiting = append(e.waiting, it)
		case *boundary:
			it.run()
		}
	}
}

func aborted(r *request) bool {
	select {
	case <-r.h.abort:
		return true
	default:
		return false
	}
}

// reapAborted ends aborted requests wherever they are.
func (e *Engine) reapAborted() {
	keep := e.running[:0]
	for _, s := range e.running {
		if aborted(s.r) {
			e.finish(s, FinishAbort)
			continue
		}
		keep = append(keep, s)
	}
	e.running = keep
	drop := func(list []*request, admitted bool) []*request {
		out := list[:0]
		for _, r := range list {
			if !aborted(r) {
				out = append(out, r)
				continue
			}
			if admitted { // waiting requests hold no pages yet
				for _, p := range r.prompt {
					e.pages.release(p)
				}
				e.pages.unreserve(r.reserved - len(r.prompt))
			}
			e.abortRequest(r)
		}
		return out
	}
	e.waiting, e.prefill = drop(e.waiting, false), drop(e.prefill, true)
}

// admit moves waiting requests, in order, into prefill while their page
// reservation fits.
func (e *Engine) admit() {
	for len(e.waiting) > 0 {
		r := e.waiting[0]
		if !e.pages.reserve(r.reserved + e.scoreNeed) {
			return
		}
		e.pages.unreserve(e.scoreNeed)
		e.waiting = e.waiting[1:]
		e.prefill = append(e.prefill, r)
	}
}

// step runs one forward pass: one decode token for every running sample,
// then prefill chunks while the token budget lasts.
func (e *Engine) step() error {
	o := e.m.opts
	ps := o.PageSize
	var in StepInput
	type logitOwner struct {
		s *seq     // a decoding sample
		r *request // or a request whose prefill ends here (n rows)
	}
	var owners []logitOwner
	decodeOnly := true
	addSeq := func(pages []int, length, n int) {
		in.SeqLens = append(in.SeqLens, int32(length))
		row := make([]int32, len(pages))
		for i, p := range pages {
			row[i] = int32(p)
		}
		in.PageTable = append(in.PageTable, row)
		in.QueryStart = append(in.QueryStart, in.QueryStart[len(in.QueryStart)-1]+int32(n))
	}
	in.QueryStart = []int32{0}
	stepped := 0 // running samples in this step: a prefix of e.running
	for _, s := range e.running {
		if len(in.SeqLens) == o.MaxSeqs || len(in.Tokens) == o.MaxTokens || len(in.LogitRows) == o.MaxLogitRows {
			break
		}
		stepped++
		pos := s.length
		if pos/ps >= len(s.pages) {
			p, err := e.pages.take()
			if err != nil {
				return err
			}
			s.pages = append(s.pages, p)
		}
		in.Tokens = append(in.Tokens, s.last)
		in.Positions = append(in.Positions, int32(pos))
		in.Slots = append(in.Slots, int32(s.pages[pos/ps]*ps+pos%ps))
		in.LogitRows = append(in.LogitRows, int32(len(in.Tokens)-1))
		in.Sampling = append(in.Sampling, s.r.row(s.index, pos+1))
		s.length++
		addSeq(s.pages, s.length, 1)
		owners = append(owners, logitOwner{s: s})
	}
	for _, r := range e.prefill {
		budget := o.MaxTokens - len(in.Tokens)
		if budget <= 0 || len(in.SeqLens) == o.MaxSeqs {
			break
		}
		P := len(r.Prompt)
		n := min(budget, P-r.done)
		last := r.done+n == P
		if last && len(in.LogitRows)+r.N > o.MaxLogitRows {
			if n == 1 {
				continue // its sampling rows do not fit this step; others may
			}
			n--
			last = false
		}
		decodeOnly = false
		for i := range n {
			pos := r.done + i
			for pos/ps >= len(r.prompt) {
				p, err := e.pages.take()
				if err != nil {
					return err
				}
				r.prompt = append(r.prompt, p)
			}
			in.Tokens = append(in.Tokens, r.Prompt[pos])
			in.Positions = append(in.Positions, int32(pos))
			in.Slots = append(in.Slots, int32(r.prompt[pos/ps]*ps+pos%ps))
		}
		r.done += n
		addSeq(r.prompt, r.done, n)
		if last {
			for i := range r.N {
				in.LogitRows = append(in.LogitRows, int32(len(in.Tokens)-1))
				in.Sampling = append(in.Sampling, r.row(i, P))
			}
			owners = append(owners, logitOwner{r: r})
		}
	}
	if len(in.Tokens) == 0 {
		return nil
	}
	n := len(in.LogitRows)
	stepStart := time.Now()
	graphsBefore := e.stats.graphSteps.Load()
	err := e.forward(&in, decodeOnly)
	if err != nil {
		return err
	}
	e.stats.steps.Add(1)
	e.stats.tokens.Add(uint64(len(in.Tokens)))
	e.stats.generated.Add(uint64(n))
	defer func() {
		if m := e.cfg.Metrics; m != nil {
			kind := "eager"
			if e.stats.graphSteps.Load() > graphsBefore {
				kind = "graph"
			}
			m.steps.WithLabelValues(kind).Inc()
			m.stepTime.Observe(time.Since(stepStart).Seconds())
			m.batchToks.Observe(float64(len(in.Tokens)))
			m.batchSeqs.Observe(float64(len(in.SeqLens)))
			m.tokens.WithLabelValues("forwarded").Add(float64(len(in.Tokens)))
			m.tokens.WithLabelValues("generated").Add(float64(n))
			m.pagesInUse.Set(float64(e.pages.inUse()))
			m.pagesTotal.Set(float64(e.m.opts.KVPages))
			m.waiting.Set(float64(len(e.waiting)))
			m.running.Set(float64(len(e.running)))
		}
	}()
	var tokens []int32
	var lps []float32
	if n > 0 {
		if tokens, lps, err = e.m.Samples(n); err != nil {
			return err
		}
	}
	var routing [][]int32
	if slices.ContainsFunc(owners, func(o logitOwner) bool {
		return (o.s != nil && o.s.r.Params.RoutedExperts) || (o.r != nil && o.r.Params.RoutedExperts)
	}) {
		if routing, err = e.m.Routing(len(in.Tokens)); err != nil {
			return err
		}
	}
	row := 0
	var next []*seq
	for _, ow := range owners {
		if ow.s != nil {
			if e.emit(ow.s, tokens[row], lps[row], routing, int(in.LogitRows[row])) {
				next = append(next, ow.s)
			}
			row++
			continue
		}
		r := ow.r
		e.prefill = slices.DeleteFunc(e.prefill, func(x *request) bool { return x == r })
		seqs, err := e.fork(r)
		if err != nil {
			e.abortRequest(r)
			return err
		}
		for _, s := range seqs {
			if e.emit(s, tokens[row], lps[row], routing, int(in.LogitRows[row])) {
				next = append(next, s)
			}
			row++
		}
	}
	// Samples that did not fit this step go first next time.
	var skipped []*seq
	for _, s := range e.running[stepped:] {
		skipped = append(skipped, s)
	}
	e.running = append(skipped, next...)
	e.stats.pages.Store(int64(e.pages.inUse()))
	e.stats.waiting.Store(int64(len(e.waiting)))
	e.stats.running.Store(int64(len(e.running)))
	return nil
}

// forward stages and runs one pass, through the graph runner when the step
// is decode-only.
func (e *Engine) forward(in *StepInput, decodeOnly bool) error {
	if decodeOnly && e.cfg.Graphs != nil {
		n := len(in.Tokens)
		padded, err := e.cfg.Graphs.Pad(n)
		if err != nil { // larger than the largest bucket: run it eagerly
			return e.eager(in)
		}
		in.Pad(padded)
		if _, err := e.m.Stage(*in); err != nil {
			return err
		}
		e.stats.graphSteps.Add(1)
		return e.cfg.Graphs.Run(padded)
	}
	return e.eager(in)
}

func (e *Engine) eager(in *StepInput) error {
	sh, err := e.m.Stage(*in)
	if err != nil {
		return err
	}
	return e.m.Forward(sh, true)
}

// abortRequest ends every undelivered sample of a request that has no
// running samples (waiting, in prefill, or failing to fork).
func (e *Engine) abortRequest(r *request) {
	for i := range r.left {
		r.h.samples <- Sample{Index: r.N - r.left + i, Finish: FinishAbort}
	}
	r.left = 0
	close(r.h.samples)
}

// row is the sampling row of sample i drawing the token at position pos.
func (r *request) row(i, pos int) SampleRow {
	p := r.Params
	return SampleRow{Temperature: p.Temperature, TopK: int32(p.TopK), TopP: p.TopP, Seed: p.Seed, SampleID: int32(i), Position: int32(pos)}
}

// fork turns a request whose prompt is prefilled into its N samples. They
// share the prompt's full pages; the partial last page is copied for every
// sample but the first, which takes the original.
func (e *Engine) fork(r *request) ([]*seq, error) {
	ps := e.m.opts.PageSize
	P := len(r.Prompt)
	full := P / ps
	seqs := make([]*seq, r.N)
	for i := range seqs {
		s := &seq{r: r, index: i, length: P, out: Sample{Index: i}}
		s.pages = append(s.pages, r.prompt[:full]...) // shared: one reference each
		if P%ps != 0 {
			if i == 0 {
				s.pages = append(s.pages, r.prompt[full])
			} else {
				p, err := e.pages.take()
				if err != nil {
					return nil, err
				}
				if err := e.m.CopyPage(p, r.prompt[full]); err != nil {
					return nil, err
				}
				s.pages = append(s.pages, p)
			}
		}
		seqs[i] = s
	}
	for _, p := range r.prompt[:full] {
		e.pages.share(p, r.N-1)
	}
	// The request's reservation moves to its samples: the shared full pages
	// are accounted once, in the prompt pages already taken.
	r.prompt = nil
	return seqs, nil
}

// emit appends a drawn token to s and reports whether s goes on. A row the
// sampler could not draw from ends s with FinishError and aborts the rest
// of its request: a numeric failure fails that request only.
func (e *Engine) emit(s *seq, tok int32, lp float32, routing [][]int32, row int) bool {
	p := s.r.Params
	if tok == kernels.UnsampledToken {
		s.out.Err = fmt.Sprintf("sample %d, token %d: the model's logits are not finite (NaN or +Inf, or all -Inf): nothing to sample from", s.index, len(s.out.Tokens))
		s.r.h.Abort()
		e.stats.failed.Add(1)
		e.finish(s, FinishError)
		return false
	}
	s.out.Tokens = append(s.out.Tokens, tok)
	s.out.LogProbs = append(s.out.LogProbs, lp)
	s.out.Versions = append(s.out.Versions, e.version.Load())
	if p.RoutedExperts && routing != nil {
		k := e.m.cfg.TopK
		ids := make([]int32, 0, len(routing)*k)
		for _, layer := range routing {
			ids = append(ids, layer[row*k:(row+1)*k]...)
		}
		s.out.Routed = append(s.out.Routed, ids)
	}
	s.last = tok
	switch {
	case s.r.isStop(tok):
		e.finish(s, FinishStop)
	case len(s.out.Tokens) >= p.MaxTokens:
		e.finish(s, FinishLength)
	default:
		return true
	}
	return false
}

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

// isStop reports whether tok is one of the request's stop ids, in O(1)
// whatever the length of the list.
func (r *request) isStop(tok int32) bool {
	_, ok := r.stop[tok]
	return ok
}

// finish delivers s and releases its pages, once.
func (e *Engine) finish(s *seq, why FinishReason) {
	if s.out.Finish != "" {
		return
	}
	s.out.Finish = why
	for _, p := range s.pages {
		e.pages.release(p)
	}
	ps := e.m.opts.PageSize
	// Return the part of the reservation this sample never used.
	want := ceilDiv(len(s.r.Prompt)%ps+s.r.Params.MaxTokens, ps)
	own := len(s.pages) - len(s.r.Prompt)/ps
	e.pages.unreserve(want - own)
	s.pages = nil
	s.r.h.samples <- s.out
	s.r.left--
	if s.r.left == 0 {
		close(s.r.h.samples)
	}
}
