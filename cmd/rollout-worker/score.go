package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

const scoreUsage = `Usage: rollout-worker score --model DIR --tokens FILE [--recipe bf16|nvfp4] [--device auto|cpu|cuda]

Score token sequences by teacher forcing: for each sequence of FILE
({"sequences": [[id, ...], ...]}) print log p(token_i | tokens before i) at
temperature 1, as JSON {"logprobs": [[null, lp1, lp2, ...], ...]}.

Flags:
`

// recipeFlag maps the command line's recipe names to the MoE recipes.
func recipeFlag(name string) (moe.Recipe, error) {
	switch name {
	case "bf16":
		return moe.RecipeBF16, nil
	case "nvfp4", "per_token":
		return moe.RecipePerToken, nil
	}
	return "", usageErrorf("--recipe %q: want bf16 or nvfp4", name)
}

func runScore(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("score", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), scoreUsage)
		fs.PrintDefaults()
	}
	dir := fs.String("model", "", "model `directory` (config.json and safetensors; required)")
	tokensPath := fs.String("tokens", "", "JSON `file` with the sequences (required)")
	recipeName := fs.String("recipe", "bf16", "MoE recipe: bf16 or nvfp4")
	device := fs.String("device", "auto", "compute device: auto, cpu or cuda")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *dir == "" || *tokensPath == "" {
		return usageErrorf("--model and --tokens are required")
	}
	recipe, err := recipeFlag(*recipeName)
	if err != nil {
		return err
	}
	raw, err := os.ReadFile(*tokensPath)
	if err != nil {
		return err
	}
	var in struct {
		Sequences [][]int32 `json:"sequences"`
	}
	if err := json.Unmarshal(raw, &in); err != nil {
		return fmt.Errorf("%s: %w", *tokensPath, err)
	}
	if len(in.Sequences) == 0 {
		return fmt.Errorf("%s: no sequences", *tokensPath)
	}
	be, closeBackend, err := newBackend(*device, nil)
	if err != nil {
		return err
	}
	defer closeBackend()
	cfg, err := policy.LoadConfig(*dir)
	if err != nil {
		return err
	}
	longest := 0
	for _, s := range in.Sequences {
		longest = max(longest, len(s))
	}
	const pageSize = 16
	chunk := min(512, cfg.MaxPositions)
	m, err := policy.LoadModel(be, *dir, policy.ModelOptions{Recipe: recipe, MaxTokens: chunk, MaxSeqs: 1, MaxLogitRows: chunk,
		PageSize: pageSize, KVPages: max(1, (min(longest, cfg.MaxPositions)+pageSize-1)/pageSize)})
	if err != nil {
		return err
	}
	defer m.Close()
	e := policy.NewEngine(m, policy.EngineConfig{})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- e.Run(runCtx) }()
	scores, err := e.Score(ctx, in.Sequences)
	stop()
	err = errors.Join(err, <-done)
	if err != nil {
		return err
	}
	out := struct {
		LogProbs [][]*float64 `json:"logprobs"`
	}{LogProbs: make([][]*float64, len(scores))}
	for i, s := range scores {
		row := make([]*float64, 1, len(s)+1) // position 0 has no logprob
		for _, lp := range s {
			v := float64(lp)
			if math.IsNaN(v) || math.IsInf(v, 0) {
				return fmt.Errorf("sequence %d: non-finite logprob %v", i, v)
			}
			row = append(row, &v)
		}
		out.LogProbs[i] = row
	}
	enc := json.NewEncoder(stdout)
	return enc.Encode(out)
}
