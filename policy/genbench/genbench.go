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
	Params    policy.SamplingParams // MaxTokens and Seed are set per request
	Seed      uint64
}

// Result is what a run measured.
type Result struct {
	Samples int
	Tokens  int // generated
	Wall    time.Duration
	Engine  policy.EngineStats
}

// TokensPerSecond is generated tokens per wall-clock second.
func (r Result) TokensPerSecond() float64 { return float64(r.Tokens) / r.Wall.Seconds() }

// SamplesPerSecond is finished samples (rollouts) per wall-clock second.
func (r Result) SamplesPerSecond() float64 { return float64(r.Samples) / r.Wall.Seconds() }

// Run submits every request, waits for every sample and reports the rate.
func Run(ctx context.Context, m *policy.Model, ecfg policy.EngineConfig, cfg Config) (Result, error) {
	if cfg.Requests < 1 || cfg.N < 1 || cfg.PromptLen < 1 || cfg.MaxTokens < 1 {
		return Result{}, fmt.Errorf("genbench: requests, n, prompt length and max tokens must be positive")
	}
	e := policy.NewEngine(m, ecfg)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- e.Run(runCtx) }()
	res, err := submitAll(ctx, e, m.Config().VocabSize, cfg)
	stop()
	if err := errors.Join(err, <-done); err != nil {
		return Result{}, err
	}
	res.Engine = e.Stats()
	return res, nil
}

func submitAll(ctx context.Context, e *policy.Engine, vocab int, cfg Config) (Result, error) {
	r := rand.New(rand.NewPCG(cfg.Seed, 3))
	start := time.Now()
	handles := make([]*policy.Handle, cfg.Requests)
	for i := range handles {
		p := make([]int32, cfg.PromptLen)
		for j := range p {
			p[j] = int32(r.IntN(vocab))
		}
		params := cfg.Params
		params.MaxTokens, params.Seed = cfg.MaxTokens, cfg.Seed+uint64(i)
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
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
