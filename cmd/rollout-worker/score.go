package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

const scoreUsage = `Usage: rollout-worker score --model DIR --tokens FILE [--recipe bf16|nvfp4|unit_scale|per_tensor --input-scales FILE] [--device auto|cpu|cuda]

Score token sequences by teacher forcing: for each sequence of FILE
({"sequences": [[id, ...], ...]}) print log p(token_i | tokens before i) at
temperature 1, as JSON {"logprobs": [[null, lp1, lp2, ...], ...]}.

Flags:
`

// recipeFlag maps the command line's recipe names to the MoE recipes:
// bf16, nvfp4 (per_token), per_tensor (whose input scales the command
// takes from --input-scales, or measures) and unit_scale.
func recipeFlag(name string) (moe.Recipe, error) {
	switch name {
	case "bf16":
		return moe.RecipeBF16, nil
	case "nvfp4", "per_token":
		return moe.RecipePerToken, nil
	case "per_tensor":
		return moe.RecipePerTensor, nil
	case "unit_scale":
		return moe.RecipeUnitScale, nil
	}
	return "", usageErrorf("--recipe %q: want bf16, nvfp4, per_tensor or unit_scale", name)
}

// inputScalesFlag checks that --input-scales is given only with the
// per_tensor recipe (which may also take its scales from the checkpoint).
func inputScalesFlag(recipe moe.Recipe, path string) error {
	if path != "" && recipe != moe.RecipePerTensor {
		return usageErrorf("--input-scales goes with --recipe per_tensor, and only there")
	}
	return nil
}

// loadScoringModel loads the model in dir for one sequence at a time, in
// chunks of up to 512 tokens, with KV pages for the longest of seqs.
func loadScoringModel(be kernels.Backend, dir string, recipe moe.Recipe, seqs [][]int32) (*policy.Model, error) {
	cfg, err := policy.LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	longest := 0
	for _, s := range seqs {
		longest = max(longest, len(s))
	}
	const pageSize = 16
	chunk := min(512, cfg.MaxPositions)
	return policy.LoadModel(be, dir, policy.ModelOptions{Recipe: recipe, MaxTokens: chunk, MaxSeqs: 1, MaxLogitRows: chunk,
		PageSize: pageSize, KVPages: max(1, (min(longest, cfg.MaxPositions)+pageSize-1)/pageSize)})
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
	recipeName := fs.String("recipe", "bf16", "MoE recipe: bf16, nvfp4, per_tensor or unit_scale")
	scalesPath := fs.String("input-scales", "", "safetensors `file` of per_tensor input scales (rollout-worker calibrate writes one; --recipe per_tensor needs it unless the checkpoint has input_scale tensors)")
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
	if err := inputScalesFlag(recipe, *scalesPath); err != nil {
		return err
	}
	seqs, err := readSequences(*tokensPath)
	if err != nil {
		return err
	}
	be, closeBackend, err := newBackend(*device, nil)
	if err != nil {
		return err
	}
	defer closeBackend()
	m, err := loadScoringModel(be, *dir, recipe, seqs)
	if err != nil {
		return err
	}
	defer m.Close()
	if err := m.UseInputScales(*scalesPath); errors.Is(err, policy.ErrNoInputScales) {
		return usageErrorf("--recipe per_tensor needs --input-scales, or a checkpoint with the experts' input_scale tensors")
	} else if err != nil {
		return err
	}
	e := policy.NewEngine(m, policy.EngineConfig{})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- e.Run(runCtx) }()
	scores, err := e.Score(ctx, seqs)
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
