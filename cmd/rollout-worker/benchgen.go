package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/policy/genbench"
)

const benchGenerateUsage = `Usage: rollout-worker bench generate [--preset NAME | --model DIR] [flags]

Generate rollouts with the engine (continuous batching, decode steps
replayed from captured graphs) and report generated tokens/s and
rollouts/s. Without --model, the preset's seeded random weights (the ones
init-model writes) are initialised in memory, with no checkpoint on disk.

Flags:
`

func runBenchGenerate(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	fs := flag.NewFlagSet("bench generate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), benchGenerateUsage)
		fs.PrintDefaults()
	}
	preset := fs.String("preset", "tiny", "random model preset, initialised in memory (ignored with --model): "+strings.Join(policy.PresetNames(), ", "))
	layers := fs.Int("layers", 0, "cut the preset to its first `N` decoder layers (0: all)")
	dir := fs.String("model", "", "model `directory` to load instead of a preset")
	recipeName := fs.String("recipe", "bf16", "MoE recipe: bf16 or nvfp4")
	device := fs.String("device", "auto", "compute device: auto, cpu or cuda")
	requests := fs.Int("requests", 16, "requests submitted at once")
	n := fs.Int("n", 4, "samples per request")
	promptLen := fs.Int("prompt-len", 32, "prompt tokens per request")
	maxTokens := fs.Int("max-tokens", 64, "tokens generated per sample")
	temperature := fs.Float64("temperature", 1, "sampling temperature")
	graphs := fs.Bool("graphs", true, "replay decode steps from captured graphs")
	seed := fs.Uint64("seed", 1, "seed of the random model and prompts")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	recipe, err := recipeFlag(*recipeName)
	if err != nil {
		return err
	}
	be, closeBackend, err := newBackend(*device, nil)
	if err != nil {
		return err
	}
	defer closeBackend()
	const pageSize = 16
	seqs := *requests * *n
	perRequest := (*promptLen)/pageSize + *n*((*promptLen%pageSize+*maxTokens+pageSize-1)/pageSize)
	opts := policy.ModelOptions{Recipe: recipe, MaxSeqs: min(seqs, 256), MaxTokens: max(256, min(seqs, 256)),
		PageSize: pageSize, KVPages: *requests * perRequest}
	opts.MaxLogitRows = opts.MaxTokens
	var m *policy.Model
	if *dir == "" {
		cfg, err := policy.PresetLayers(*preset, *layers)
		if err != nil {
			return usageErrorf("--preset: %v", err)
		}
		m, err = policy.NewRandomModel(ctx, be, cfg, opts, *seed)
	} else {
		if *layers != 0 {
			return usageErrorf("--layers cuts a preset; it does not apply to --model")
		}
		m, err = policy.LoadModel(be, *dir, opts)
	}
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, m.Close()) }()
	var ecfg policy.EngineConfig
	if *graphs {
		g, err := policy.NewGraphs(m, policy.DefaultBuckets(opts.MaxSeqs), nil)
		if err != nil {
			return err
		}
		defer func() { err = errors.Join(err, g.Close()) }()
		ecfg.Graphs = g
	}
	c := m.Config()
	fmt.Fprintf(stderr, "bench generate: %s, %d layers, hidden %d, %d experts top-%d, vocab %d, recipe %s, %s backend\n",
		c.Architecture, c.Layers, c.Hidden, c.Experts, c.TopK, c.VocabSize, recipe, be.Name())
	res, err := genbench.Run(ctx, m, ecfg, genbench.Config{Requests: *requests, N: *n, PromptLen: *promptLen, MaxTokens: *maxTokens,
		Params: policy.SamplingParams{Temperature: float32(*temperature)}, Seed: *seed})
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "rollouts %d, generated tokens %d, wall %.2fs: %.1f tokens/s, %.2f rollouts/s (%d steps, %d from graphs)\n",
		res.Samples, res.Tokens, res.Wall.Seconds(), res.TokensPerSecond(), res.SamplesPerSecond(), res.Engine.Steps, res.Engine.GraphSteps)
	return nil
}
