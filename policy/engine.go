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
	"github.com/rollout-worker/rollout-worker/policy/sched"
)

// The scheduler's unsampled token is the sampler's.
var _ = [1]struct{}{}[sched.Unsampled-kernels.UnsampledToken]

// FinishReason says why a sample ended.
type FinishReason = sched.FinishReason

// Finish reasons.
const (
	FinishStop   = sched.FinishStop   // a stop token was produced (it is included)
	FinishLength = sched.FinishLength // max_tokens was reached
	FinishAbort  = sched.FinishAbort  // the request was aborted or the engine stopped
	// FinishError: the model's logits for this sample could not be sampled
	// (NaN or +Inf, or all -Inf); Sample.Err says where. The request's other
	// samples are aborted; the engine and other requests go on.
	FinishError = sched.FinishError
)

// Sentinel errors.
var (
	ErrStopped  = errors.New("policy: engine stopped")
	ErrTooLarge = errors.New("policy: request can never fit the KV cache")
)

// SamplingParams are a request's sampling settings.
type SamplingParams = sched.SamplingParams

// Request is one prompt with N samples.
type Request = sched.Request

// Sample is one finished sample of a request.
type Sample = sched.Sample

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
	// KVOnDemand: samples take KV pages as they grow, instead of reserving
	// their whole max_tokens on admission; when the cache runs out the
	// youngest samples are preempted and recomputed later, bitwise as if
	// they had not been (sched.Config.OnDemand).
	KVOnDemand bool
	// PrefixCache: the KV pages of prompts' full pages are kept after
	// their prefill and shared by later requests whose prompts start with
	// the same tokens, under the same policy version only: a version
	// change drops them (sched.Config.PrefixCache).
	PrefixCache bool
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
// the mutex-protected inbox is touched by the loop goroutine only. The loop
// plans each step with a scheduler (package sched: requests, admission,
// pages, running samples) and runs it with an Executor.
type Engine struct {
	m      *Model
	cfg    EngineConfig
	mu     sync.Mutex
	inbox  []any // *sched.Req, *boundary
	wake   chan struct{}
	closed bool

	stats engineStats

	version atomic.Uint64 // the policy version tokens are produced under

	// Loop state.
	sched *sched.Scheduler
	pages *sched.Pages // the scheduler's: scoring takes pages of its own
	exec  Executor
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
	// Preemptions: samples and prompts whose KV pages were taken back
	// (KVOnDemand); Recomputed: tokens prefilled again because of them.
	Preemptions, Recomputed uint64
	Preempted               int64 // samples waiting to be recomputed after the last step
	// PromptTokens: prompt tokens of the requests admitted; PrefixHits:
	// those whose KV came from the prefix cache (PrefixCache).
	PromptTokens, PrefixHits uint64
	CachedPages              int64  // pages the prefix cache holds after the last step
	Evicted                  uint64 // cached pages evicted because pages ran short
}

type engineStats struct {
	steps, graphSteps, tokens, generated, failed atomic.Uint64
	preemptions, recomputed                      atomic.Uint64
	promptTokens, prefixHits, evicted            atomic.Uint64
	pages, waiting, running, preempted, cached   atomic.Int64
}

// Stats returns the loop's counters; safe from any goroutine.
func (e *Engine) Stats() EngineStats {
	return EngineStats{Steps: e.stats.steps.Load(), GraphSteps: e.stats.graphSteps.Load(), Tokens: e.stats.tokens.Load(),
		Generated: e.stats.generated.Load(), Failed: e.stats.failed.Load(), KVPagesUsed: e.stats.pages.Load(), Waiting: e.stats.waiting.Load(), Running: e.stats.running.Load(),
		Preemptions: e.stats.preemptions.Load(), Recomputed: e.stats.recomputed.Load(), Preempted: e.stats.preempted.Load(),
		PromptTokens: e.stats.promptTokens.Load(), PrefixHits: e.stats.prefixHits.Load(), CachedPages: e.stats.cached.Load(),
		Evicted: e.stats.evicted.Load()}
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
	e := &Engine{m: m, cfg: cfg, wake: make(chan struct{}, 1), exec: newModelExecutor(m, cfg.Graphs)}
	e.sched = sched.New(sched.Config{PageSize: o.PageSize, KVPages: o.KVPages, MaxPagesPerSeq: o.maxPagesPerSeq(m.cfg),
		MaxTokens: o.MaxTokens, MaxSeqs: o.MaxSeqs, MaxLogitRows: o.MaxLogitRows, TopK: m.cfg.TopK, OnDemand: cfg.KVOnDemand, PrefixCache: cfg.PrefixCache}, (*sink)(e))
	e.pages = e.sched.Pages()
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
	h := &Handle{id: req.ID, samples: make(chan Sample, req.N), abort: make(chan struct{})}
	r := e.sched.NewReq(req, h)
	if need := r.Needs(e.sched.Config()); need > e.m.opts.KVPages {
		return nil, fmt.Errorf("policy: request %q needs %d KV pages, the cache has %d: %w", req.ID, need, e.m.opts.KVPages, ErrTooLarge)
	}
	if err := e.post(r); err != nil {
		return nil, err
	}
	return h, nil
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
		e.sched.SetVersion(e.version.Load()) // a weight commit drops the prefix cache
		e.sched.Reap()
		e.sched.Admit()
		if !e.sched.Busy() {
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
		case *sched.Req:
			e.sched.Add(it)
		case *boundary:
			if it.state.CompareAndSwap(boundaryPending, boundaryCancelled) {
				it.err <- ErrStopped
			}
		}
	}
	e.sched.Shutdown()
}

func (e *Engine) drainInbox() {
	for _, it := range e.takeInbox(false) {
		switch it := it.(type) {
		case *sched.Req:
			e.sched.Add(it)
		case *boundary:
			it.run()
		}
	}
}

// sink is the engine as the scheduler's sink: samples go to their
// request's handle.
type sink Engine

func (k *sink) Deliver(r *sched.Req, s Sample, last bool) {
	h := r.Owner.(*Handle)
	if s.Finish == FinishError {
		k.stats.failed.Add(1)
	}
	h.samples <- s
	if last {
		close(h.samples)
	}
}

func (k *sink) Aborted(r *sched.Req) bool {
	select {
	case <-r.Owner.(*Handle).abort:
		return true
	default:
		return false
	}
}

// step plans one step, runs it and commits its results.
func (e *Engine) step() error {
	p, err := e.sched.Plan()
	if err != nil || p == nil {
		return err
	}
	p.Version = e.version.Load()
	start := time.Now()
	if err := e.exec.Launch(p); err != nil {
		return err
	}
	res, err := e.exec.Wait()
	if err != nil {
		return err
	}
	return e.commit(p, res, start)
}

// commit hands a step's results to the scheduler and records the step.
func (e *Engine) commit(p *sched.Plan, res *sched.Results, start time.Time) error {
	T, S, L := len(p.Tokens), len(p.SeqLens), len(p.LogitRows)
	e.stats.steps.Add(1)
	if res.Graph {
		e.stats.graphSteps.Add(1)
	}
	e.stats.tokens.Add(uint64(T))
	e.stats.generated.Add(uint64(L))
	err := e.sched.Commit(p, res)
	e.stats.pages.Store(int64(e.pages.InUse()))
	e.stats.waiting.Store(int64(e.sched.Waiting()))
	e.stats.running.Store(int64(e.sched.Running()))
	e.stats.preempted.Store(int64(e.sched.Preempted()))
	e.stats.cached.Store(int64(e.sched.CachedPages()))
	ss := e.sched.Stats()
	e.stats.evicted.Store(ss.Evicted)
	prevPre, prevRe := e.stats.preemptions.Swap(ss.Preemptions), e.stats.recomputed.Swap(ss.Recomputed)
	prevPrompt, prevHits := e.stats.promptTokens.Swap(ss.PromptTokens), e.stats.prefixHits.Swap(ss.PrefixHits)
	if m := e.cfg.Metrics; m != nil {
		m.preemptions.Add(float64(ss.Preemptions - prevPre))
		m.tokens.WithLabelValues("recomputed").Add(float64(ss.Recomputed - prevRe))
		m.prefix.WithLabelValues("hit").Add(float64(ss.PrefixHits - prevHits))
		m.prefix.WithLabelValues("miss").Add(float64((ss.PromptTokens - prevPrompt) - (ss.PrefixHits - prevHits)))
		m.cachedPages.Set(float64(e.sched.CachedPages()))
		kind := "eager"
		if res.Graph {
			kind = "graph"
		}
		m.steps.WithLabelValues(kind).Inc()
		m.stepTime.Observe(time.Since(start).Seconds())
		m.batchToks.Observe(float64(T))
		m.batchSeqs.Observe(float64(S))
		m.tokens.WithLabelValues("forwarded").Add(float64(T))
		m.tokens.WithLabelValues("generated").Add(float64(L))
		m.pagesInUse.Set(float64(e.pages.InUse()))
		m.pagesTotal.Set(float64(e.m.opts.KVPages))
		m.waiting.Set(float64(e.sched.Waiting()))
		m.running.Set(float64(e.sched.Running()))
		m.preempted.Set(float64(e.sched.Preempted()))
	}
	return err
}
