package policy

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// errNoPages makes a scoring job wait for a later step boundary.
var errNoPages = errors.New("policy: score: waiting for kv pages")

// Score returns, for each sequence, log p(token_i | tokens before i) for
// i = 1 .. len-1 (teacher forcing at temperature 1), computed by the engine
// loop between generation steps with KV pages of its own.
func (e *Engine) Score(ctx context.Context, seqs [][]int32) ([][]float32, error) {
	c := e.m.cfg
	for i, s := range seqs {
		if len(s) == 0 {
			return nil, fmt.Errorf("policy: score: sequence %d is empty", i)
		}
		if len(s) > c.MaxPositions {
			return nil, fmt.Errorf("policy: score: sequence %d has %d tokens, the context is %d", i, len(s), c.MaxPositions)
		}
		if need := ceilDiv(len(s), e.m.opts.PageSize); need > e.m.opts.KVPages {
			return nil, fmt.Errorf("policy: score: sequence %d needs %d KV pages, the cache has %d: %w", i, need, e.m.opts.KVPages, ErrTooLarge)
		}
		for j, t := range s {
			if t < 0 || int(t) >= c.VocabSize {
				return nil, fmt.Errorf("policy: score: sequence %d token %d is %d, outside the vocabulary of %d", i, j, t, c.VocabSize)
			}
		}
	}
	out := make([][]float32, len(seqs))
	for i, s := range seqs {
		for {
			err := e.AtBoundary(ctx, func() error {
				var err error
				out[i], err = e.score(s)
				return err
			})
			if !errors.Is(err, errNoPages) {
				if err != nil {
					return nil, err
				}
				break
			}
			select { // generation holds the pages: let it run a little
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(time.Millisecond):
			}
		}
	}
	return out, nil
}

// score runs one sequence on the loop goroutine.
func (e *Engine) score(s []int32) ([]float32, error) {
	o := e.m.opts
	ps := o.PageSize
	n := len(s)
	need := ceilDiv(n, ps)
	if !e.pages.Reserve(need) {
		e.sched.HoldBack(need)
		return nil, errNoPages
	}
	e.sched.HoldBack(0)
	pages := make([]int32, 0, need)
	defer func() {
		for _, p := range pages {
			e.pages.Release(int(p))
		}
		e.pages.Unreserve(need - len(pages))
	}()
	for range need {
		p, err := e.pages.Take()
		if err != nil {
			return nil, err
		}
		pages = append(pages, int32(p))
	}
	// The final token predicts nothing: positions 0 .. n-2 are run, each
	// scoring the token after it.
	lps := make([]float32, 0, n-1)
	chunk := min(o.MaxTokens, o.MaxLogitRows)
	for c0 := 0; c0 < n-1; c0 += chunk {
		c1 := min(c0+chunk, n-1)
		in := StepInput{SeqLens: []int32{int32(c1)}, QueryStart: []int32{0, int32(c1 - c0)}, PageTable: [][]int32{pages}}
		for p := c0; p < c1; p++ {
			in.Tokens = append(in.Tokens, s[p])
			in.Positions = append(in.Positions, int32(p))
			in.Slots = append(in.Slots, pages[p/ps]*int32(ps)+int32(p%ps))
			in.LogitRows = append(in.LogitRows, int32(p-c0))
		}
		sh, err := e.m.Stage(in)
		if err != nil {
			return nil, err
		}
		if err := e.m.Forward(sh, false); err != nil {
			return nil, err
		}
		got, err := e.m.ScoreRows(s[c0+1 : c1+1])
		if err != nil {
			return nil, err
		}
		lps = append(lps, got...)
	}
	return lps, nil
}
