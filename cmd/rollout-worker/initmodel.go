package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

const initModelUsage = `Usage: rollout-worker init-model --out DIR [--preset NAME] [--layers N] [--seed N]
       [--activation swiglu|relu2] [--force]

Write a model directory with seeded random BF16 weights, in the format the
worker loads real checkpoints from (docs/POLICY.md, "Model files"):

  DIR/config.json        Hugging Face config, transformers 5.x spelling
  DIR/model.safetensors  per-expert tensors under Hugging Face names

The same preset, activation and seed always write the same bytes. DIR is
created; an existing non-empty DIR is refused unless --force, which replaces
config.json and model.safetensors there and leaves other files alone.

Flags:
`

// initModelConfig is a validated init-model invocation.
type initModelConfig struct {
	out    string
	preset string
	seed   uint64
	act    moe.Activation
	force  bool
}

func runInitModel(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	flags := flag.NewFlagSet("init-model", flag.ContinueOnError)
	flags.SetOutput(stderr)
	flags.Usage = func() {
		fmt.Fprint(flags.Output(), initModelUsage)
		flags.PrintDefaults()
	}
	out := flags.String("out", "", "model `directory` to write (required)")
	preset := flags.String("preset", "tiny", "architecture preset: "+strings.Join(policy.PresetNames(), ", "))
	layers := flags.Int("layers", 0, "cut the preset to its first `N` decoder layers (0: all)")
	seed := flags.Uint64("seed", 1, "seed of the random weights")
	act := flags.String("activation", string(moe.SwiGLU), "expert activation: swiglu (gated) or relu2 (non-gated squared ReLU)")
	force := flags.Bool("force", false, "write into a non-empty existing directory")
	if err := parseFlags(flags, args); err != nil {
		return err
	}

	cfg := initModelConfig{out: *out, preset: *preset, seed: *seed, act: moe.Activation(*act), force: *force}
	switch {
	case cfg.out == "":
		return usageErrorf("--out is required")
	case cfg.act != moe.SwiGLU && cfg.act != moe.ReLU2:
		return usageErrorf("--activation must be %s or %s, not %q", moe.SwiGLU, moe.ReLU2, *act)
	}
	model, err := policy.PresetLayers(cfg.preset, *layers)
	if err != nil {
		return usageErrorf("--preset: %v", err)
	}
	model.Activation = cfg.act
	if err := checkOutDir(cfg.out, cfg.force); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := policy.WriteRandomModel(cfg.out, model, cfg.seed); err != nil {
		return err
	}
	var size int64
	if fi, err := os.Stat(filepath.Join(cfg.out, policy.SingleFileName)); err == nil {
		size = fi.Size()
	}
	fmt.Fprintf(stderr, "init-model: wrote %s: preset %s (%s, %d layers, %d experts top-%d, %s experts), seed %d, %d bytes of weights\n",
		cfg.out, cfg.preset, model.Architecture, model.Layers, model.Experts, model.TopK, model.Activation, cfg.seed, size)
	return nil
}

// checkOutDir refuses to write into an existing non-empty directory (or
// over a file) unless force is set.
func checkOutDir(dir string, force bool) error {
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return err
	case !fi.IsDir():
		return fmt.Errorf("--out %s exists and is not a directory", dir)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(entries) > 0 && !force {
		return usageErrorf("--out %s is not empty (%d entries); use --force to write into it", dir, len(entries))
	}
	return nil
}
