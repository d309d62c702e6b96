package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/moe/moebench"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
)

const benchUsage = `Usage: rollout-worker bench moe|refit|generate [flags]

  moe       time the MoE layer forward, NVFP4 against BF16 and the floor
  refit     time one layer's requantization against its floor
  generate  generated tokens/s of the engine

`

const benchMoEUsage = `Usage: rollout-worker bench moe [flags]

Time the whole MoE layer forward (router, quantize, permutation, both
grouped GEMMs, finalize) for every recipe on the same random weights and
the same 4 rotating inputs, side by side in one run. Where the backend can
capture graphs (cuda, cpu) each input's forward is captured once and the
graphs are replayed round-robin; the mean over --iters replays is timed
with CUDA events on cuda, by the wall clock between syncs elsewhere.

The table has one row per batch size: experts touched (expected, uniform
routing: E*(1-(1-k/E)^T)), the NVFP4 floor (max of bytes / 4.3 TB/s and
FLOPs / 790 TFLOP/s, docs/PERF.md) and what bounds it, each
recipe's mean time, and for NVFP4: "vs floor" = time / floor (target
<= 1.25x), "vs bf16" = BF16 time / NVFP4 time (the speed-up, target >= 3x),
and the per-token cosine similarity to BF16 (mean and min over the inputs).

The finalize: by default the deterministic, batch-invariant one (expert
rows written, then each token's k rows summed in a fixed order).
--batch-invariant=false runs the atomic one instead (FP32 atomic additions
fused into FC2's epilogue, no rows written; not batch invariant).
--compare-finalize times both in the same run and adds, per recipe, the
atomic time and "det/atomic" = deterministic time / atomic time (the cost
of batch invariance, target <= 1.10x).

Defaults depend on the backend: on cuda the DeepSeek-V3 MoE layer (tokens
1,8,32,128,512,4096, hidden 7168, intermediate 2048, 256 experts, top-8,
50 iterations); on cpu small ones (tokens 1,8,32,128, hidden 1024,
intermediate 512, 16 experts, top-4, 10 iterations), where the DeepSeek-V3
shapes would take hours.

Flags:
`

const benchRefitUsage = `Usage: rollout-worker bench refit [--mode requantize|transfer] [flags]

--mode transfer times refits end to end at a model's size: a worker
(rollout-worker serve --preset, in a process of its own) and a publisher
(rollout-worker publish --from synthetic:..., one process a version) on one
NATS server (an embedded one unless --nats-url), a full version of the
preset's synthetic checkpoint and then a delta for each --deltas fraction
of changed elements. For each version: seconds from the announcement to
the worker's status (its commit), GB/s against core NATS measured over the
same server in the same run, the generation pause (the commit), the
publisher's peak RSS; then the worker's peak RSS and the full version's
per-layer table. Flags other than those below are ignored in this mode:
--preset, --layers, --device, --recipe, --seed, --nats-url, --storage,
--stream-max-bytes, --deltas, --core-bytes, --parts, --timeout, --logs,
--profile-seconds.

--mode requantize (the default): build one NVFP4 layer with random weights and time Layer.Requantize (the
whole layer's FC1 and FC2 copies rebuilt in place) against its floor: BF16
bytes read + NVFP4 bytes written at 4.3 TB/s (docs/PERF.md). Timed with CUDA events on cuda, by the wall clock between syncs
elsewhere. Then checks that the copies stayed at their addresses and equal
internal/nvfp4.QuantizeStack of the weights on the host, bit for bit; a
failed check fails the command. --iters defaults to 20 on cuda, 3 on cpu.

Flags:
`

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help") {
		fmt.Fprint(stdout, benchUsage, benchMoEUsage, "\n", benchRefitUsage, "\n", benchGenerateUsage)
		return flag.ErrHelp
	}
	if len(args) > 0 {
		switch args[0] {
		case "moe":
			return runBenchMoE(ctx, args[1:], stdout, stderr)
		case "refit":
			return runBenchRefit(ctx, args[1:], stdout, stderr)
		case "generate":
			return runBenchGenerate(ctx, args[1:], stdout, stderr)
		}
	}
	return usageErrorf("bench: want a benchmark name: moe, refit or generate")
}

// moeDefaults are bench moe's shape defaults on one backend.
type moeDefaults struct {
	tokens                       []int
	hidden, inter, experts, topK int
	iters                        int
}

// benchMoEDefaults picks the defaults by backend: the DeepSeek-V3 MoE layer
// (hidden 7168, intermediate 2048, 256 experts, top-8) on the GPU, and shapes that finish in seconds on the CPU.
func benchMoEDefaults(backend string) moeDefaults {
	if backend == "cuda" {
		return moeDefaults{tokens: []int{1, 8, 32, 128, 512, 4096}, hidden: 7168, inter: 2048, experts: 256, topK: 8, iters: 50}
	}
	return moeDefaults{tokens: []int{1, 8, 32, 128}, hidden: 1024, inter: 512, experts: 16, topK: 4, iters: 10}
}

// recipeList parses --recipes: bf16, nvfp4 (= per_token), per_tensor
// (calibrated on a batch drawn as the inputs are), unit_scale and
// weight_only.
func recipeList(s string) ([]moe.Recipe, error) {
	var out []moe.Recipe
	for _, f := range strings.Split(s, ",") {
		var rc moe.Recipe
		switch name := strings.TrimSpace(f); name {
		case "bf16":
			rc = moe.RecipeBF16
		case "nvfp4", "per_token":
			rc = moe.RecipePerToken
		case "weight_only":
			rc = moe.RecipeWeightOnly
		case "per_tensor":
			rc = moe.RecipePerTensor
		case "unit_scale":
			rc = moe.RecipeUnitScale
		default:
			return nil, usageErrorf("--recipes: unknown recipe %q (want nvfp4, bf16, per_token, per_tensor, unit_scale or weight_only)", name)
		}
		for _, prev := range out {
			if prev == rc {
				return nil, usageErrorf("--recipes: %s listed twice (nvfp4 and per_token are one recipe)", moebench.RecipeName(rc))
			}
		}
		out = append(out, rc)
	}
	return out, nil
}

func tokenList(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, usageErrorf("--tokens: %q is not a positive batch size", f)
		}
		out = append(out, n)
	}
	return out, nil
}

func activationFlag(s string) (moe.Activation, error) {
	switch a := moe.Activation(s); a {
	case moe.ReLU2, moe.SwiGLU:
		return a, nil
	}
	return "", usageErrorf("--activation %q: want relu2 or swiglu", s)
}

// setFlags returns the names of the flags given on the command line.
func setFlags(fs *flag.FlagSet) map[string]bool {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	return set
}

func runBenchMoE(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench moe", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), benchMoEUsage)
		fs.PrintDefaults()
	}
	// Shape flags default to 0, "the backend's default", filled in once
	// the backend is open.
	device := fs.String("device", "auto", "compute device: auto, cpu or cuda")
	tokens := fs.String("tokens", "", "comma-separated batch sizes (default 1,8,32,128,512,4096 on cuda, 1,8,32,128 on cpu)")
	hidden := fs.Int("hidden", 0, "hidden size (default 7168 on cuda, 1024 on cpu)")
	inter := fs.Int("intermediate", 0, "expert intermediate size (default 2048 on cuda, 512 on cpu)")
	experts := fs.Int("experts", 0, "number of experts (default 256 on cuda, 16 on cpu)")
	var topK int
	fs.IntVar(&topK, "top-k", 0, "experts per token (default 8 on cuda, 4 on cpu)")
	fs.IntVar(&topK, "topk", 0, "same as --top-k")
	act := fs.String("activation", string(moe.ReLU2), "expert activation: relu2 or swiglu")
	scoring := fs.String("scoring", string(moe.Softmax), "router scoring: softmax or sigmoid")
	recipes := fs.String("recipes", "nvfp4,bf16", "comma-separated recipes: nvfp4 (also per_token), bf16, weight_only, per_tensor (calibrated on inputs drawn as the benchmark's), unit_scale; bf16 is required (the accuracy reference)")
	batchInv := fs.Bool("batch-invariant", true, "use the deterministic, batch-invariant finalize (false: the atomic one)")
	compareFin := fs.Bool("compare-finalize", false, "also time every recipe with the atomic finalize, side by side")
	iters := fs.Int("iters", 0, "timed forwards (graph replays) per case, the mean is reported (default 50 on cuda, 10 on cpu)")
	warmup := fs.Int("warmup", 3, "untimed forwards per case before timing")
	graphs := fs.Bool("graphs", true, "replay captured graphs where the backend can capture them (false: issue every op)")
	seed := fs.Uint64("seed", 1, "seed of the random weights and inputs")
	csvPath := fs.String("csv", "", "also write the table's rows as CSV to this `file`")
	plotPath := fs.String("plot", "", "also write an SVG chart of latency against tokens (log-log) to this `file`")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	set := setFlags(fs)
	activation, err := activationFlag(*act)
	if err != nil {
		return err
	}
	if s := moe.Scoring(*scoring); s != moe.Softmax && s != moe.Sigmoid {
		return usageErrorf("--scoring %q: want softmax or sigmoid", *scoring)
	}
	rcs, err := recipeList(*recipes)
	if err != nil {
		return err
	}
	var toks []int
	if set["tokens"] {
		if toks, err = tokenList(*tokens); err != nil {
			return err
		}
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"hidden", *hidden}, {"intermediate", *inter}, {"experts", *experts}, {"top-k", topK}, {"iters", *iters}} {
		if (set[f.name] || f.name == "top-k" && set["topk"]) && f.v < 1 {
			return usageErrorf("--%s %d: want a positive number", f.name, f.v)
		}
	}
	if *warmup < 0 {
		return usageErrorf("--warmup %d: want 0 or more", *warmup)
	}

	be, closeBackend, err := newBackend(*device, nil)
	if err != nil {
		return err
	}
	defer closeBackend()
	if !*batchInv && *compareFin {
		return usageErrorf("--compare-finalize times the atomic finalize beside the deterministic one: leave --batch-invariant at true")
	}
	def := benchMoEDefaults(be.Name())
	pick := func(v, d int) int {
		if v == 0 {
			return d
		}
		return v
	}
	if toks == nil {
		toks = def.tokens
	}
	cfg := moebench.Config{
		Layer: moe.Config{Hidden: pick(*hidden, def.hidden), Intermediate: pick(*inter, def.inter), Experts: pick(*experts, def.experts),
			TopK: pick(topK, def.topK), Activation: activation, Scoring: moe.Scoring(*scoring), Renormalize: true,
			AtomicFinalize: !*batchInv},
		Tokens: toks, Recipes: rcs, Iters: pick(*iters, def.iters), Warmup: *warmup, Inputs: 4, Seed: *seed, Eager: !*graphs,
		CompareFinalize: *compareFin,
	}
	lc := cfg.Layer
	shape := fmt.Sprintf("hidden %d, intermediate %d, %d experts, top-%d, %s, %s", lc.Hidden, lc.Intermediate, lc.Experts, lc.TopK, lc.Activation, lc.Scoring)
	fin := "batch-invariant finalize"
	switch {
	case *compareFin:
		fin = "batch-invariant and atomic finalize side by side"
	case !*batchInv:
		fin = "atomic finalize (not batch invariant)"
	}
	fmt.Fprintf(stderr, "bench moe: %s backend, %s; %d rotating inputs, mean of %d, %s\n", be.Name(), shape, cfg.Inputs, cfg.Iters, fin)
	results, err := moebench.Run(ctx, be, cfg, stderr)
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "timing: %s\n", results[0].Timing)
	if err := moebench.Table(stdout, results); err != nil {
		return err
	}
	if *csvPath != "" {
		if err := writeFile(*csvPath, func(w io.Writer) error { return moebench.CSV(w, results) }); err != nil {
			return err
		}
	}
	if *plotPath != "" {
		title := fmt.Sprintf("MoE forward on %s: %s", be.Name(), shape)
		if err := writeFile(*plotPath, func(w io.Writer) error { return moebench.SVG(w, title, results) }); err != nil {
			return err
		}
	}
	return nil
}

func runBenchRefit(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench refit", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), benchRefitUsage)
		fs.PrintDefaults()
	}
	device := fs.String("device", "auto", "compute device: auto, cpu or cuda")
	hidden := fs.Int("hidden", 2688, "hidden size")
	inter := fs.Int("intermediate", 1856, "expert intermediate size")
	experts := fs.Int("experts", 32, "number of experts in the layer")
	act := fs.String("activation", string(moe.ReLU2), "expert activation: relu2 or swiglu (FC1 has 2x intermediate rows)")
	iters := fs.Int("iters", 0, "requantizations timed, the mean is reported (default 20 on cuda, 3 on cpu)")
	seed := fs.Uint64("seed", 1, "seed of the random weights")
	mode := fs.String("mode", "requantize", "requantize (one layer's requantization) or transfer (refits end to end)")
	preset := fs.String("preset", "qwen3-30b-a3b", "transfer: model preset: "+strings.Join(policy.PresetNames(), ", "))
	layers := fs.Int("layers", 0, "transfer: cut the preset to its first `N` decoder layers (0: all)")
	recipe := fs.String("recipe", "nvfp4", "transfer: the worker's MoE recipe: bf16 or nvfp4")
	natsURL := fs.String("nats-url", "", "transfer: NATS server `URL` (empty: start an embedded one)")
	storage := fs.String("storage", "file", "transfer: JetStream storage of the refit stream: file or memory")
	streamMax := fs.Int64("stream-max-bytes", 0, "transfer: cap the refit stream at this many bytes (publish --stream-max-bytes)")
	deltas := fs.String("deltas", "0.01,0.05,0.2", "transfer: comma-separated fractions of changed elements, one delta version each, after the full one (empty: none)")
	coreBytes := fs.Int64("core-bytes", 0, "transfer: bytes sent over core NATS for the comparison (0: a full version's, at most 4 GiB)")
	timeout := fs.Duration("timeout", 10*time.Minute, "transfer: how long the worker may take to start, and each version to apply")
	parts := fs.Int("parts", 1, "transfer: parts a version is published in, each over its own connection (publish --parts)")
	servers := fs.Int("servers", 0, "transfer: NATS servers, each a process of its own (rollout-worker nats): part 0 and the announcements on the first, parts 1 and on spread over the others (publish --part-servers); 0: one server embedded in this process")
	liveParts := fs.Int("live-parts", -1, "transfer: parts the worker follows live (serve --refit-live-parts; -1: all of them, 0: every part from its stream, the catch-up path)")
	profile := fs.Int("profile-seconds", 0, "transfer: write a CPU profile of the worker over this many seconds from the first version's start into --logs (0: none)")
	logDir := fs.String("logs", "", "transfer: keep the worker's and publishers' output in this `directory`")
	inProcess := fs.Bool("servers-in-process", false, "transfer: run the --servers servers embedded in this process, not as processes of their own")
	liveFirst := fs.Bool("live-first", false, "transfer: publish versions of parts live first (publish --live-first)")
	profilePub := fs.Bool("profile-publishers", false, "transfer: write a CPU profile of each publish process into --logs (publish --cpu-profile)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	switch *mode {
	case "requantize":
	case "transfer":
		c := transferConfig{preset: *preset, layers: *layers, device: *device, recipe: *recipe, natsURL: *natsURL,
			storage: *storage, streamMax: *streamMax, coreBytes: *coreBytes, timeout: *timeout, seed: *seed, logDir: *logDir, parts: *parts, servers: *servers, liveParts: *liveParts, profileSeconds: *profile, profilePublishers: *profilePub, serversInProcess: *inProcess, liveFirst: *liveFirst}
		if c.liveParts < 0 {
			c.liveParts = max(c.parts, 1)
		}
		if *deltas != "" {
			for f := range strings.SplitSeq(*deltas, ",") {
				x, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
				if err != nil || !(x > 0 && x <= 1) {
					return usageErrorf("--deltas: %q is not a fraction in (0, 1]", f)
				}
				c.deltas = append(c.deltas, x)
			}
		}
		switch {
		case *storage != "file" && *storage != "memory":
			return usageErrorf("--storage %q: want file or memory", *storage)
		case *timeout <= 0:
			return usageErrorf("--timeout must be positive, not %v", *timeout)
		case *coreBytes < 0:
			return usageErrorf("--core-bytes must not be negative, not %d", *coreBytes)
		case *profilePub && *logDir == "":
			return usageErrorf("--profile-publishers needs --logs")
		case *profile < 0 || (*profile > 0 && *logDir == ""):
			return usageErrorf("--profile-seconds %d: want 0, or a positive number with --logs", *profile)
		case *parts < 1 || *parts > refit.MaxParts:
			return usageErrorf("--parts %d: want 1 to %d", *parts, refit.MaxParts)
		case *servers < 0 || *servers > *parts:
			return usageErrorf("--servers %d: want 0 to --parts (%d): a server carries one part or more", *servers, *parts)
		case *inProcess && *servers == 0:
			return usageErrorf("--servers-in-process without --servers")
		case *servers > 0 && *natsURL != "":
			return usageErrorf("--servers %d with --nats-url: the bench starts its servers", *servers)
		case *liveParts > refit.MaxParts:
			return usageErrorf("--live-parts %d: want at most %d", *liveParts, refit.MaxParts)
		case *recipe != "bf16" && *recipe != "nvfp4":
			return usageErrorf("--recipe %q: want bf16 or nvfp4", *recipe)
		}
		if _, err := policy.PresetLayers(*preset, *layers); err != nil {
			return usageErrorf("--preset, --layers: %v", err)
		}
		return runTransferBench(ctx, c, stdout)
	default:
		return usageErrorf("--mode %q: want requantize or transfer", *mode)
	}
	activation, err := activationFlag(*act)
	if err != nil {
		return err
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"hidden", *hidden}, {"intermediate", *inter}, {"experts", *experts}} {
		if f.v < 1 {
			return usageErrorf("--%s %d: want a positive number", f.name, f.v)
		}
	}
	if setFlags(fs)["iters"] && *iters < 1 {
		return usageErrorf("--iters %d: want a positive number", *iters)
	}
	be, closeBackend, err := newBackend(*device, nil)
	if err != nil {
		return err
	}
	defer closeBackend()
	if *iters == 0 {
		*iters = 3
		if be.Name() == "cuda" {
			*iters = 20
		}
	}
	cfg := moebench.RefitConfig{
		Layer: moe.Config{Hidden: *hidden, Intermediate: *inter, Experts: *experts, Activation: activation},
		Iters: *iters, Seed: *seed,
	}
	res, err := moebench.RunRefit(ctx, be, cfg)
	if err != nil {
		return err
	}
	if err := res.Report(stdout, be.Name()); err != nil {
		return err
	}
	if !res.BitExact || !res.SameAddresses {
		return fmt.Errorf("requantized copies are wrong: %s", res.Mismatch)
	}
	return nil
}

// writeFile creates path and fills it with write, reporting either's error
// with the path.
func writeFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		return errors.Join(fmt.Errorf("write %s: %w", path, err), f.Close())
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
