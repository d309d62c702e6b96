// Package genbench measures rollout generation: a batch of requests pushed
// through the engine at once, timed from submission to the last sample.
//
// Run owns the model it is given for its duration (it runs the engine loop
// on it) and must not share it.
package genbench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/rollout-worker/rollout-worker/policy"
)

// Config is one run.
type Config struct {
	Requests  int // submitted at once
	N         int // samples per request
	PromptLen int
	MaxTokens int
	Params    policy.SamplingParams // MaxTokens, Seed and Stop are set per request
	Seed      uint64
	// StopProb, when positive, gives the responses a long-tailed length:
	// round(StopProb x vocabulary) token ids, drawn once, stop every
	// sample, so that a sample whose tokens spread over the vocabulary
	// stops with about that probability per token (geometric lengths of
	// mean about 1/StopProb, cut at MaxTokens). What the model draws
	// decides the real lengths: Result reports them.
	StopProb float64
}

// Result is what a run measured.
type Result struct {
	Samples int
	Tokens  int // generated
	Longest int // tokens of the longest sample
	Stopped int // samples ended by a stop token (the rest reached MaxTokens)
	Wall    time.Duration
	Engine  policy.EngineStats
	// KV use over the run, from the engine's counters read every
	// millisecond: pages in use (mean and peak) and samples decoding (mean).
	MeanPages, MeanRunning float64
	PeakPages              int64
}

// MeanLength is the mean tokens of a sample.
func (r Result) MeanLength() float64 { return float64(r.Tokens) / float64(max(r.Samples, 1)) }

// TokensPerSecond is generated tokens per wall-clock second.
func (r Result) TokensPerSecond() float64 { return float64(r.Tokens) / r.Wall.Seconds() }

// SamplesPerSecond is finished samples (rollouts) per wall-clock second.
func (r Result) SamplesPerSecond() float64 { return float64(r.Samples) / r.Wall.Seconds() }

// Run submits every request, waits for every sample and reports the rate.
func Run(ctx context.Context, m *policy.Model, ecfg policy.EngineConfig, cfg Config) (Result, error) {
	if cfg.Requests < 1 || cfg.N < 1 || cfg.PromptLen < 1 || cfg.MaxTokens < 1 {
		return Result{}, fmt.Errorf("genbench: requests, n, prompt length and max tokens must be positive")
	}
	if cfg.StopProb < 0 || cfg.StopProb >= 1 {
		return Result{}, fmt.Errorf("genbench: stop probability %v, want [0, 1)", cfg.StopProb)
	}
	e := policy.NewEngine(m, ecfg)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- e.Run(runCtx) }()
	use := make(chan kvUse, 1)
	go func() { use <- sampleKV(runCtx, e) }()
	res, err := submitAll(ctx, e, m.Config().VocabSize, cfg)
	stop()
	if err := errors.Join(err, <-done); err != nil {
		<-use
		return Result{}, err
	}
	u := <-use
	res.Engine = e.Stats()
	if u.n > 0 {
		res.MeanPages, res.MeanRunning, res.PeakPages = u.pages/float64(u.n), u.running/float64(u.n), u.peak
	}
	return res, nil
}

// kvUse sums the engine's KV pages in use and running samples over
// samples taken every millisecond.
type kvUse struct {
	n              int
	pages, running float64
	peak           int64
}

// sampleKV reads the engine's counters every millisecond until ctx ends.
func sampleKV(ctx context.Context, e *policy.Engine) kvUse {
	var u kvUse
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return u
		case <-t.C:
		}
		st := e.Stats()
		u.n++
		u.pages += float64(st.KVPagesUsed)
		u.running += float64(st.Running)
		u.peak = max(u.peak, st.KVPagesUsed)
	}
}

// stopIDs draws round(p x vocab) distinct token ids.
func stopIDs(r *rand.Rand, p float64, vocab int) []int32 {
	if p <= 0 {
		return nil // and the prompts' tokens stay those of a run without stops
	}
	k := min(max(int(p*float64(vocab)+0.5), 1), vocab)
	ids := make([]int32, 0, k)
	for _, i := range r.Perm(vocab)[:k] {
		ids = append(ids, int32(i))
	}
	return ids
}

func submitAll(ctx context.Context, e *policy.Engine, vocab int, cfg Config) (Result, error) {
	r := rand.New(rand.NewPCG(cfg.Seed, 3))
	stops := stopIDs(r, cfg.StopProb, vocab)
	start := time.Now()
	handles := make([]*policy.Handle, cfg.Requests)
	for i := range handles {
		p := make([]int32, cfg.PromptLen)
		for j := range p {
			p[j] = int32(r.IntN(vocab))
		}
		params := cfg.Params
		params.MaxTokens, params.Seed, params.Stop = cfg.MaxTokens, cfg.Seed+uint64(i), stops
		var err error
		if handles[i], err = e.Submit(policy.Request{ID: fmt.Sprint("bench-", i), Prompt: p, N: cfg.N, Params: params}); err != nil {
			return Result{}, err
		}
	}
	var res Result
	for _, h := range handles {
		if err := drain(ctx, h, &res); err != nil {
			return Result{}, err
		}
	}
	res.Wall = time.Since(start)
	return res, nil
}

// drain counts a request's samples until its stream closes.
func drain(ctx context.Context, h *policy.Handle, res *Result) error {
	for {
		select {
		case s, ok := <-h.Samples():
			if !ok {
				return nil
			}
			if s.Finish == policy.FinishAbort {
				return fmt.Errorf("genbench: a sample was aborted")
			}
			res.Samples++
			res.Tokens += len(s.Tokens)
			res.Longest = max(res.Longest, len(s.Tokens))
			if s.Finish == policy.FinishStop {
				res.Stopped++
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
