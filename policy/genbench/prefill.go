package genbench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"text/tabwriter"
	"time"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

// H200BF16FLOPs is the dense BF16 matrix-product rate measured on an H200,
// the ceiling the prefill floor is computed against.
const H200BF16FLOPs = 790e12

// PrefillConfig is a prefill measurement: Prompts prompts of PromptLen
// tokens fed in forward passes of at most Chunk tokens (the engine's
// MaxTokens), prompts packed into a pass in order, a prompt's last pass
// sampling its first token.
type PrefillConfig struct {
	Prompts, PromptLen, Chunk int
	Runs                      int // timed prefills of every prompt, after one untimed
	Seed                      uint64
}

// PrefillResult is one recipe's prefill of a PrefillConfig.
type PrefillResult struct {
	Recipe                    moe.Recipe
	Prompts, PromptLen, Chunk int
	Passes                    int // forward passes a prefill of every prompt takes
	// Time is the mean wall-clock time to prefill every prompt: each pass
	// staged and run eagerly, as the engine runs prefill chunks, and one
	// device synchronisation at the end.
	Time time.Duration
	// FLOPs and Floor: what the prefill must compute, at the H200's BF16
	// rate (PrefillFloor).
	FLOPs float64
	Floor time.Duration
	// Groups is the device time of each group of ops summed over one
	// prefill's passes (nil where the backend cannot profile).
	Groups map[string]time.Duration
}

// Tokens is the prompt tokens a prefill processes.
func (r PrefillResult) Tokens() int { return r.Prompts * r.PromptLen }

// TokensPerSecond is the prompt tokens prefilled per second.
func (r PrefillResult) TokensPerSecond() float64 { return float64(r.Tokens()) / r.Time.Seconds() }

// OfFloor is the fraction of the floor's rate the prefill reaches.
func (r PrefillResult) OfFloor() float64 { return r.Floor.Seconds() / r.Time.Seconds() }

// PrefillFloor is the compute floor of prefilling prompts prompts of
// promptLen tokens on a model of cfg: 2 FLOPs per active weight per token
// (q/k/v/o, the router, top-k experts), the attention scores and their
// product with V (4 x heads x head dim FLOPs per position a token sees,
// causal: position p sees p + 1), and the LM head once per prompt, at the
// H200's BF16 rate.
func PrefillFloor(cfg policy.Config, prompts, promptLen int) (flops float64, floor time.Duration) {
	H, D := float64(cfg.Hidden), float64(cfg.HeadDim)
	attn := H*float64(cfg.Heads)*D*2 + 2*H*float64(cfg.KVHeads)*D
	router := float64(cfg.Experts) * H
	i1 := float64(cfg.MoEIntermediate)
	if cfg.Activation == moe.SwiGLU {
		i1 *= 2
	}
	experts := float64(cfg.TopK) * (i1*H + H*float64(cfg.MoEIntermediate))
	L, P := float64(promptLen), float64(prompts)
	perPrompt := float64(cfg.Layers)*(2*L*(attn+router+experts)+4*float64(cfg.Heads)*D*L*(L+1)/2) + 2*H*float64(cfg.VocabSize)
	flops = P * perPrompt
	return flops, time.Duration(flops / H200BF16FLOPs * 1e9)
}

// PrefillKVPages is the KV pages a prefill of cfg needs.
func PrefillKVPages(cfg PrefillConfig, pageSize int) int {
	return cfg.Prompts * ((cfg.PromptLen + pageSize - 1) / pageSize)
}

// PrefillSeqs is the most sequences one pass of cfg carries.
func PrefillSeqs(cfg PrefillConfig) int {
	return min(cfg.Prompts, (cfg.Chunk+cfg.PromptLen-2)/cfg.PromptLen+1)
}

// prefillPasses splits the prompts into passes of at most chunk tokens:
// each pass's inputs, prompts in order, each prompt's own pages.
func prefillPasses(c policy.Config, cfg PrefillConfig, pageSize int) []policy.StepInput {
	r := rand.New(rand.NewPCG(cfg.Seed, uint64(cfg.PromptLen)))
	pages := (cfg.PromptLen + pageSize - 1) / pageSize
	table := func(p int) []int32 {
		t := make([]int32, pages)
		for j := range t {
			t[j] = int32(p*pages + j)
		}
		return t
	}
	var passes []policy.StepInput
	p, pos := 0, 0 // the next token: prompt p, position pos
	for p < cfg.Prompts {
		var in policy.StepInput
		in.QueryStart = append(in.QueryStart, 0)
		for len(in.Tokens) < cfg.Chunk && p < cfg.Prompts {
			n := min(cfg.Chunk-len(in.Tokens), cfg.PromptLen-pos)
			t := table(p)
			for i := range n {
				q := pos + i
				in.Tokens = append(in.Tokens, int32(r.IntN(c.VocabSize)))
				in.Positions = append(in.Positions, int32(q))
				in.Slots = append(in.Slots, t[q/pageSize]*int32(pageSize)+int32(q%pageSize))
			}
			pos += n
			in.SeqLens = append(in.SeqLens, int32(pos))
			in.QueryStart = append(in.QueryStart, int32(len(in.Tokens)))
			in.PageTable = append(in.PageTable, t)
			if pos == cfg.PromptLen {
				in.LogitRows = append(in.LogitRows, int32(len(in.Tokens)-1))
				in.Sampling = append(in.Sampling, policy.SampleRow{Temperature: 1, TopP: 1, Seed: cfg.Seed, SampleID: int32(p), Position: int32(pos)})
				p, pos = p+1, 0
			}
		}
		passes = append(passes, in)
	}
	return passes
}

// Prefill measures prefilling cfg's prompts on m, eagerly, pass after pass.
// m must carry cfg.Chunk tokens and PrefillSeqs(cfg) sequences a pass and
// hold PrefillKVPages(cfg) pages.
func Prefill(ctx context.Context, m *policy.Model, cfg PrefillConfig) (PrefillResult, error) {
	o := m.Options()
	switch {
	case cfg.Prompts < 1 || cfg.PromptLen < 1 || cfg.Chunk < 1 || cfg.Runs < 1:
		return PrefillResult{}, errors.New("genbench: prefill: want prompts, a prompt length, a chunk and runs of at least 1")
	case cfg.Chunk > o.MaxTokens || PrefillSeqs(cfg) > o.MaxSeqs:
		return PrefillResult{}, fmt.Errorf("genbench: prefill: passes of %d tokens and %d sequences, the model takes %d and %d",
			cfg.Chunk, PrefillSeqs(cfg), o.MaxTokens, o.MaxSeqs)
	case cfg.PromptLen > m.Config().MaxPositions:
		return PrefillResult{}, fmt.Errorf("genbench: prefill: prompts of %d tokens, the model takes %d positions", cfg.PromptLen, m.Config().MaxPositions)
	case PrefillKVPages(cfg, o.PageSize) > o.KVPages:
		return PrefillResult{}, fmt.Errorf("genbench: prefill: %d KV pages needed, the cache has %d", PrefillKVPages(cfg, o.PageSize), o.KVPages)
	}
	passes := prefillPasses(m.Config(), cfg, o.PageSize)
	be := m.Backend()
	prefill := func() error {
		for _, in := range passes {
			if err := ctx.Err(); err != nil {
				return err
			}
			sh, err := m.Stage(in)
			if err != nil {
				return err
			}
			if err := m.Forward(sh, true); err != nil {
				return err
			}
		}
		return be.Sync()
	}
	if err := prefill(); err != nil { // untimed: first touches, compiled code paths
		return PrefillResult{}, fmt.Errorf("genbench: prefill: %w", err)
	}
	start := time.Now()
	for range cfg.Runs {
		if err := prefill(); err != nil {
			return PrefillResult{}, fmt.Errorf("genbench: prefill: %w", err)
		}
	}
	res := PrefillResult{Recipe: o.Recipe, Prompts: cfg.Prompts, PromptLen: cfg.PromptLen, Chunk: cfg.Chunk, Passes: len(passes),
		Time: time.Since(start) / time.Duration(cfg.Runs)}
	res.FLOPs, res.Floor = PrefillFloor(m.Config(), cfg.Prompts, cfg.PromptLen)
	if pr, ok := be.(kernels.Profiler); ok {
		groups, err := profilePrefill(m, pr, prefill)
		if err != nil {
			return res, fmt.Errorf("genbench: prefill: profile: %w", err)
		}
		res.Groups = groups
	}
	return res, nil
}

// profilePrefill runs prefill once more with a mark at every group of ops
// and returns each group's device time summed over the passes.
func profilePrefill(m *policy.Model, pr kernels.Profiler, prefill func() error) (_ map[string]time.Duration, err error) {
	prof, err := pr.NewProfile()
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, prof.Close()) }()
	m.SetMarker(prof)
	err = prefill()
	m.SetMarker(nil)
	if err != nil {
		return nil, err
	}
	groups, err := prof.Groups()
	if err != nil {
		return nil, err
	}
	delete(groups, "") // from a pass's end to the next pass's first group: the host staging it
	return groups, nil
}

// PrefillTable writes one row per result: time, tokens/s, the floor's
// tokens/s and the fraction of it reached, each recipe against the first.
func PrefillTable(w io.Writer, results []PrefillResult) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "recipe\tprompts\tprompt len\tchunk\tpasses\ttime ms\ttokens/s\tfloor tokens/s\tof floor\tvs first\t")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%.1f\t%.0f\t%.0f\t%.1f%%\t%.2fx\t\n", r.Recipe, r.Prompts, r.PromptLen, r.Chunk, r.Passes,
			float64(r.Time)/1e6, r.TokensPerSecond(), float64(r.Tokens())/r.Floor.Seconds(), 100*r.OfFloor(),
			r.TokensPerSecond()/results[0].TokensPerSecond())
	}
	return tw.Flush()
}

// PrefillBreakdown writes each result's device time by group (ms, summed
// over one prefill's passes).
func PrefillBreakdown(w io.Writer, results []PrefillResult) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "recipe\t")
	for _, g := range GroupOrder() {
		fmt.Fprintf(tw, "%s\t", g)
	}
	fmt.Fprintln(tw, "sum ms\t")
	for _, r := range results {
		if r.Groups == nil {
			continue
		}
		fmt.Fprintf(tw, "%s\t", r.Recipe)
		writeGroups(tw, r.Groups, 1)
	}
	return tw.Flush()
}
