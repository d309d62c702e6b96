package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/policy/genbench"
)

const benchGenerateUsage = `Usage: rollout-worker bench generate [--preset NAME [--layers N] | --model DIR] [flags]

--mode steps (the default): decode steps at every batch size of --batches
and context of --contexts, for each recipe of --recipes in the same run,
each step as the engine runs it (stage the inputs, replay the step's
captured graph with sampling, download the tokens). For each point: the
step time, its floor (the weight and KV-cache bytes the step must read at
the H200's 4.3 TB/s) and the ratio, tokens/s, the device time of the
graph alone and the fraction of the step the device sits idle, and the
NVFP4 speedup over BF16. The KV cache holds the context already (its
contents do not change the work, so no prefill runs). --csv and --plot
write the points.

--mode prefill: --prompts prompts of --prompt-len tokens (default 4096)
prefilled in forward passes of at most --chunk tokens, prompts packed in
order, each pass staged and run eagerly as the engine runs prefill chunks,
a prompt's last pass sampling its first token; for each recipe of
--recipes: the time of the whole prefill (mean of --runs after one
untimed), tokens/s against the compute floor (2 FLOPs per active weight
a token and the causal attention scores at the H200's 790 TFLOP/s), and
the device time by group of ops.

--mode rollouts: whole rollouts through the engine (continuous batching,
prefill, decode through graphs): --requests requests of --n samples
submitted at once; generated tokens/s and rollouts/s. --stop-prob gives
the responses long-tailed lengths (stop ids that end a sample with about
that probability per token, up to --max-tokens); --kv-pages sizes the KV
cache (0: enough to reserve every request whole) and --kv-modes runs the
same requests on the same cache with pages reserved up front and/or taken
on demand (preempting and recomputing), one after the other: tokens/s,
lengths, KV pages in use (mean, peak), samples decoding (mean),
preemptions and recomputed tokens, side by side.

Without --model, the preset's seeded random weights (the ones init-model
writes) are initialised in memory, with no checkpoint on disk.

Flags:
`

func runBenchGenerate(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	fs := flag.NewFlagSet("bench generate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), benchGenerateUsage)
		fs.PrintDefaults()
	}
	mode := fs.String("mode", "steps", "steps (decode-step sweep), prefill (prompts prefilled in chunks) or rollouts (whole rollouts through the engine)")
	preset := fs.String("preset", "tiny", "random model preset, initialised in memory (ignored with --model): "+strings.Join(policy.PresetNames(), ", "))
	layers := fs.Int("layers", 0, "cut the preset to its first `N` decoder layers (0: all)")
	dir := fs.String("model", "", "model `directory` to load instead of a preset")
	device := fs.String("device", "auto", "compute device: auto, cpu or cuda")
	seed := fs.Uint64("seed", 1, "seed of the random model and the tokens")
	// steps
	recipes := fs.String("recipes", "nvfp4,bf16", "steps, prefill: MoE recipes, measured one after the other in the same run")
	batches := fs.String("batches", "1,8,64,256", "steps: comma-separated sequences per step")
	contexts := fs.String("contexts", "128,1024", "steps: comma-separated tokens already in each sequence's KV cache")
	steps := fs.Int("steps", 32, "steps: timed steps per point")
	warmup := fs.Int("warmup", 4, "steps: untimed steps before each point")
	csvPath := fs.String("csv", "", "steps: also write the points as CSV to this `file`")
	plotPath := fs.String("plot", "", "steps: also write an SVG chart of step time against batch size to this `file`")
	// rollouts
	recipeName := fs.String("recipe", "bf16", "rollouts: MoE recipe: bf16, nvfp4, per_tensor (calibrated on random prompts) or unit_scale")
	requests := fs.Int("requests", 16, "rollouts: requests submitted at once")
	n := fs.Int("n", 4, "rollouts: samples per request")
	promptLen := fs.Int("prompt-len", 32, "rollouts: prompt tokens per request; prefill: tokens per prompt (default 4096 there)")
	// prefill
	prompts := fs.Int("prompts", 16, "prefill: prompts")
	chunk := fs.Int("chunk", 8192, "prefill: most tokens a forward pass carries")
	runs := fs.Int("runs", 2, "prefill: timed prefills of every prompt, after one untimed")
	maxTokens := fs.Int("max-tokens", 64, "rollouts: tokens generated per sample")
	temperature := fs.Float64("temperature", 1, "rollouts: sampling temperature")
	graphs := fs.Bool("graphs", true, "rollouts: replay decode steps from captured graphs (steps always do)")
	stopProb := fs.Float64("stop-prob", 0, "rollouts: per-token probability, roughly, that a sample stops (long-tailed lengths; 0: every sample runs to --max-tokens)")
	kvPages := fs.Int("kv-pages", 0, "rollouts: KV-cache pages of 16 tokens (0: enough to reserve every request whole)")
	kvModes := fs.String("kv-modes", "reserve", "rollouts: comma-separated KV page modes run one after the other on the same cache: reserve, on-demand")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	only := map[string][]string{ // flag -> the modes it applies to
		"recipes": {"steps", "prefill"}, "batches": {"steps"}, "contexts": {"steps"}, "steps": {"steps"}, "warmup": {"steps"},
		"csv": {"steps"}, "plot": {"steps"},
		"prompts": {"prefill"}, "chunk": {"prefill"}, "runs": {"prefill"}, "prompt-len": {"rollouts", "prefill"},
		"recipe": {"rollouts"}, "requests": {"rollouts"}, "n": {"rollouts"}, "max-tokens": {"rollouts"}, "temperature": {"rollouts"},
		"graphs": {"rollouts"}, "stop-prob": {"rollouts"}, "kv-pages": {"rollouts"}, "kv-modes": {"rollouts"},
	}
	set := setFlags(fs)
	for name, modes := range only {
		if set[name] && !slices.Contains(modes, *mode) {
			return usageErrorf("--%s applies to --mode %s, not %s", name, strings.Join(modes, " and "), *mode)
		}
	}
	if *dir != "" && *layers != 0 {
		return usageErrorf("--layers cuts a preset; it does not apply to --model")
	}
	var cfg policy.Config
	if *dir == "" {
		if cfg, err = policy.PresetLayers(*preset, *layers); err != nil {
			return usageErrorf("--preset: %v", err)
		}
	} else if cfg, err = policy.LoadConfig(*dir); err != nil {
		return err
	}
	load := func(be kernels.Backend, opts policy.ModelOptions) (*policy.Model, error) {
		var m *policy.Model
		var err error
		if *dir == "" {
			m, err = policy.NewRandomModel(ctx, be, cfg, opts, *seed)
		} else {
			m, err = policy.LoadModel(be, *dir, opts)
		}
		if err != nil || opts.Recipe != moe.RecipePerTensor {
			return m, err
		}
		// per_tensor: input scales from random prompts, drawn as the
		// benchmark's are, as long as the KV cache allows.
		seqs := make([][]int32, 4)
		r := rand.New(rand.NewPCG(*seed, 5))
		o := m.Options()
		for i := range seqs {
			seqs[i] = make([]int32, min(128, cfg.MaxPositions, o.KVPages*o.PageSize))
			for j := range seqs[i] {
				seqs[i][j] = int32(r.IntN(cfg.VocabSize))
			}
		}
		if _, err := m.Calibrate(ctx, seqs); err != nil {
			return nil, errors.Join(fmt.Errorf("calibrate: %w", err), m.Close())
		}
		return m, nil
	}

	switch *mode {
	case "rollouts":
		recipe, err := recipeFlag(*recipeName)
		if err != nil {
			return err
		}
		var onDemand []bool
		for _, m := range strings.Split(*kvModes, ",") {
			switch strings.TrimSpace(m) {
			case "reserve":
				onDemand = append(onDemand, false)
			case "on-demand":
				onDemand = append(onDemand, true)
			default:
				return usageErrorf("--kv-modes: %q: want reserve or on-demand", m)
			}
		}
		if *kvPages < 0 || *stopProb < 0 || *stopProb >= 1 {
			return usageErrorf("--kv-pages must be >= 0 and --stop-prob in [0, 1)")
		}
		return benchRollouts(ctx, stdout, stderr, *device, load, cfg, recipe, genbench.Config{Requests: *requests, N: *n,
			PromptLen: *promptLen, MaxTokens: *maxTokens, Params: policy.SamplingParams{Temperature: float32(*temperature)}, Seed: *seed,
			StopProb: *stopProb}, *graphs, *kvPages, onDemand)
	case "prefill":
		pl := *promptLen
		if !set["prompt-len"] {
			pl = 4096
		}
		rcs, err := recipeList(*recipes)
		if err != nil {
			return err
		}
		if *prompts < 1 || pl < 1 || *chunk < 1 || *runs < 1 {
			return usageErrorf("--prompts, --prompt-len, --chunk and --runs must be positive")
		}
		return benchPrefill(ctx, stdout, stderr, *device, load, cfg, rcs,
			genbench.PrefillConfig{Prompts: *prompts, PromptLen: pl, Chunk: *chunk, Runs: *runs, Seed: *seed})
	case "steps":
	default:
		return usageErrorf("--mode %q: want steps, prefill or rollouts", *mode)
	}
	rcs, err := recipeList(*recipes)
	if err != nil {
		return err
	}
	dc := genbench.DecodeConfig{Steps: *steps, Warmup: *warmup, Seed: *seed}
	if dc.Batches, err = intList("batches", *batches); err != nil {
		return err
	}
	if dc.Contexts, err = intList("contexts", *contexts); err != nil {
		return err
	}
	if *steps < 1 || *warmup < 0 {
		return usageErrorf("--steps must be positive and --warmup not negative")
	}
	be, closeBackend, err := newBackend(*device, nil)
	if err != nil {
		return err
	}
	defer closeBackend()
	fmt.Fprintf(stderr, "bench generate: %s, %d layers, hidden %d, %d experts top-%d (%s), vocab %d, %s backend\n",
		cfg.Architecture, cfg.Layers, cfg.Hidden, cfg.Experts, cfg.TopK, cfg.Activation, cfg.VocabSize, be.Name())
	var points []genbench.DecodePoint
	for _, rc := range rcs {
		pts, err := benchDecode(ctx, be, load, rc, dc)
		if err != nil {
			return err
		}
		points = append(points, pts...)
	}
	if err := genbench.DecodeTable(stdout, points); err != nil {
		return err
	}
	if slices.ContainsFunc(points, func(p genbench.DecodePoint) bool { return p.Groups != nil }) {
		fmt.Fprintln(stdout, "\nWhere a step's device time goes (a copy of its graph with an event at each group):")
		if err := genbench.BreakdownTable(stdout, points); err != nil {
			return err
		}
	}
	if *csvPath != "" {
		if err := writeFile(*csvPath, func(w io.Writer) error { return genbench.DecodeCSV(w, points) }); err != nil {
			return err
		}
	}
	if *plotPath != "" {
		title := fmt.Sprintf("Decode step, %d layers, %s backend", cfg.Layers, be.Name())
		if err := writeFile(*plotPath, genbench.DecodeChart(title, points).SVG); err != nil {
			return err
		}
	}
	return nil
}

// benchDecode loads the model under one recipe, sized for the sweep, and
// measures it; the model is freed before the next recipe loads.
func benchDecode(ctx context.Context, be kernels.Backend, load func(kernels.Backend, policy.ModelOptions) (*policy.Model, error),
	rc moe.Recipe, dc genbench.DecodeConfig) (_ []genbench.DecodePoint, err error) {
	const pageSize = 16
	maxB := 0
	for _, b := range dc.Batches {
		maxB = max(maxB, b)
	}
	opts := policy.ModelOptions{Recipe: rc, MaxSeqs: maxB, MaxTokens: maxB, MaxLogitRows: maxB,
		PageSize: pageSize, KVPages: genbench.DecodeKVPages(dc, pageSize)}
	m, err := load(be, opts)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, m.Close()) }()
	g, err := policy.NewGraphs(m, policy.DefaultBuckets(maxB), nil)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, g.Close()) }()
	return genbench.Decode(ctx, m, g, dc)
}

// benchPrefill prefills pc's prompts under each recipe, one model loaded
// at a time, and writes the table and the breakdown.
func benchPrefill(ctx context.Context, stdout, stderr io.Writer, device string, load func(kernels.Backend, policy.ModelOptions) (*policy.Model, error),
	cfg policy.Config, rcs []moe.Recipe, pc genbench.PrefillConfig) (err error) {
	be, closeBackend, err := newBackend(device, nil)
	if err != nil {
		return err
	}
	defer closeBackend()
	const pageSize = 16
	fmt.Fprintf(stderr, "bench generate: %s, %d layers, hidden %d, %d experts top-%d (%s), vocab %d, %s backend\n",
		cfg.Architecture, cfg.Layers, cfg.Hidden, cfg.Experts, cfg.TopK, cfg.Activation, cfg.VocabSize, be.Name())
	var results []genbench.PrefillResult
	for _, rc := range rcs {
		seqs := genbench.PrefillSeqs(pc)
		opts := policy.ModelOptions{Recipe: rc, MaxSeqs: seqs, MaxTokens: pc.Chunk, MaxLogitRows: seqs,
			PageSize: pageSize, KVPages: genbench.PrefillKVPages(pc, pageSize)}
		r, err := func() (_ genbench.PrefillResult, err error) {
			m, err := load(be, opts)
			if err != nil {
				return genbench.PrefillResult{}, err
			}
			defer func() { err = errors.Join(err, m.Close()) }()
			return genbench.Prefill(ctx, m, pc)
		}()
		if err != nil {
			return fmt.Errorf("%s: %w", rc, err)
		}
		results = append(results, r)
	}
	if err := genbench.PrefillTable(stdout, results); err != nil {
		return err
	}
	if slices.ContainsFunc(results, func(r genbench.PrefillResult) bool { return r.Groups != nil }) {
		fmt.Fprintln(stdout, "\nWhere a prefill's device time goes (ms, summed over its passes, an event at each group):")
		return genbench.PrefillBreakdown(stdout, results)
	}
	return nil
}

// benchRollouts runs whole rollouts through the engine.
func benchRollouts(ctx context.Context, stdout, stderr io.Writer, device string, load func(kernels.Backend, policy.ModelOptions) (*policy.Model, error),
	cfg policy.Config, recipe moe.Recipe, gc genbench.Config, graphs bool, kvPages int, onDemand []bool) (err error) {
	be, closeBackend, err := newBackend(device, nil)
	if err != nil {
		return err
	}
	defer closeBackend()
	const pageSize = 16
	seqs := gc.Requests * gc.N
	perRequest := gc.PromptLen/pageSize + gc.N*((gc.PromptLen%pageSize+gc.MaxTokens+pageSize-1)/pageSize)
	if kvPages == 0 {
		kvPages = gc.Requests * perRequest
	}
	opts := policy.ModelOptions{Recipe: recipe, MaxSeqs: min(seqs, 256), MaxTokens: max(256, min(seqs, 256)),
		PageSize: pageSize, KVPages: kvPages}
	opts.MaxLogitRows = opts.MaxTokens
	m, err := load(be, opts)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, m.Close()) }()
	var ecfg policy.EngineConfig
	if graphs {
		g, err := policy.NewGraphs(m, policy.DefaultBuckets(opts.MaxSeqs), nil)
		if err != nil {
			return err
		}
		defer func() { err = errors.Join(err, g.Close()) }()
		ecfg.Graphs = g
	}
	fmt.Fprintf(stderr, "bench generate: %s, %d layers, hidden %d, %d experts top-%d, vocab %d, recipe %s, %s backend, %d KV pages of %d tokens\n",
		cfg.Architecture, cfg.Layers, cfg.Hidden, cfg.Experts, cfg.TopK, cfg.VocabSize, recipe, be.Name(), kvPages, pageSize)
	if len(onDemand) == 1 && !onDemand[0] {
		res, err := genbench.Run(ctx, m, ecfg, gc)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "rollouts %d, generated tokens %d, wall %.2fs: %.1f tokens/s, %.2f rollouts/s (%d steps, %d from graphs)\n",
			res.Samples, res.Tokens, res.Wall.Seconds(), res.TokensPerSecond(), res.SamplesPerSecond(), res.Engine.Steps, res.Engine.GraphSteps)
		return nil
	}
	fmt.Fprintln(stdout, "| KV pages | rollouts | tokens | mean / longest | stopped | wall (s) | tokens/s | vs first | KV pages in use, mean / peak | samples decoding, mean | preemptions | recomputed tokens |")
	fmt.Fprintln(stdout, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	var first float64
	for _, od := range onDemand {
		ecfg.KVOnDemand = od
		res, err := genbench.Run(ctx, m, ecfg, gc)
		if err != nil {
			return fmt.Errorf("kv pages on demand %v: %w", od, err)
		}
		mode := "reserved"
		if od {
			mode = "on demand"
		}
		if first == 0 {
			first = res.TokensPerSecond()
		}
		fmt.Fprintf(stdout, "| %s | %d | %d | %.0f / %d | %d | %.2f | %.1f | %.2fx | %.0f / %d of %d | %.1f | %d | %d |\n",
			mode, res.Samples, res.Tokens, res.MeanLength(), res.Longest, res.Stopped, res.Wall.Seconds(), res.TokensPerSecond(),
			res.TokensPerSecond()/first, res.MeanPages, res.PeakPages, kvPages, res.MeanRunning, res.Engine.Preemptions, res.Engine.Recomputed)
	}
	return nil
}

// intList parses a comma-separated list of positive integers for --name.
func intList(name, s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, usageErrorf("--%s: %q is not a positive integer", name, f)
		}
		out = append(out, n)
	}
	return out, nil
}
