package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/moe/moebench"
)

const benchUsage = `Usage: rollout-worker bench moe [flags]

Time the MoE layer forward for every recipe on the same random weights and
the same rotating inputs, side by side in one run, and report each NVFP4
recipe's speed-up over the BF16 recipe and its per-token cosine similarity
to it. Runs on the CPU backend.

Flags:
`

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help") {
		fmt.Fprint(stdout, benchUsage, "\n", benchGenerateUsage)
		return flag.ErrHelp
	}
	if len(args) > 0 && args[0] == "generate" {
		return runBenchGenerate(ctx, args[1:], stdout, stderr)
	}
	if len(args) == 0 || args[0] != "moe" {
		return usageErrorf("bench: want a benchmark name: moe or generate")
	}
	fs := flag.NewFlagSet("bench moe", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), benchUsage)
		fs.PrintDefaults()
	}
	tokens := fs.String("tokens", "1,8,32,128", "comma-separated batch sizes")
	hidden := fs.Int("hidden", 1024, "hidden size")
	inter := fs.Int("intermediate", 512, "expert intermediate size")
	experts := fs.Int("experts", 16, "number of experts")
	topK := fs.Int("topk", 4, "experts per token")
	act := fs.String("activation", string(moe.ReLU2), "expert activation: relu2 or swiglu")
	scoring := fs.String("scoring", string(moe.Softmax), "router scoring: softmax or sigmoid")
	recipes := fs.String("recipes", "bf16,per_token", "comma-separated recipes: bf16, per_token, weight_only")
	iters := fs.Int("iters", 10, "timed forwards per case (the mean is reported)")
	seed := fs.Uint64("seed", 1, "seed of the random weights and inputs")
	csvPath := fs.String("csv", "", "also write the results as CSV to this `file`")
	if err := parseFlags(fs, args[1:]); err != nil {
		return err
	}
	cfg := moebench.Config{
		Layer: moe.Config{Hidden: *hidden, Intermediate: *inter, Experts: *experts, TopK: *topK,
			Activation: moe.Activation(*act), Scoring: moe.Scoring(*scoring), Renormalize: true},
		Iters: *iters, Warmup: 2, Inputs: 4, Seed: *seed,
	}
	for _, f := range strings.Split(*tokens, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return usageErrorf("--tokens: %q is not a positive batch size", f)
		}
		cfg.Tokens = append(cfg.Tokens, n)
	}
	for _, f := range strings.Split(*recipes, ",") {
		cfg.Recipes = append(cfg.Recipes, moe.Recipe(strings.TrimSpace(f)))
	}
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "bench moe: cpu backend, hidden %d, intermediate %d, %d experts, top-%d, %s, %s\n",
		*hidden, *inter, *experts, *topK, *act, *scoring)
	results, err := moebench.Run(ctx, be, cfg, stderr)
	if err != nil {
		return err
	}
	if err := moebench.Table(stdout, results); err != nil {
		return err
	}
	if *csvPath != "" {
		f, err := os.Create(*csvPath)
		if err != nil {
			return err
		}
		if err := moebench.CSV(f, results); err != nil {
			f.Close()
			return err
		}
		return f.Close()
	}
	return nil
}
