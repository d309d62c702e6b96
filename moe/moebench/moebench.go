// Package moebench measures the MoE layer: every recipe on the same random
// weights and the same rotating inputs, side by side in one run, with each
// NVFP4 recipe's accuracy against the BF16 recipe and its time against the
// floor of docs/PERF.md; and the refit requantization of one layer
// against its floor, checked bit for bit. It also holds the seeded weights,
// inputs and cosine similarity that the layer's tests use.
//
// Run and RunRefit build their layers on the backend they are given and
// free them before they return; they must be called from the goroutine that
// owns the backend. The other functions are pure.
package moebench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
)

// Config is one benchmark run.
type Config struct {
	Layer   moe.Config   // shape, activation, scoring; Recipe and MaxTokens are set per case
	Tokens  []int        // batch sizes
	Recipes []moe.Recipe // distinct; must include bf16, the accuracy reference
	Iters   int          // timed forwards (graph replays) per case; the mean is reported
	Warmup  int          // untimed forwards per case, after one per input for accuracy
	// Inputs is the number of distinct input batches rotated through: with
	// 4 or more, consecutive forwards route to different experts, so the
	// weights they read are not still in L2 from the previous one.
	Inputs int
	Seed   uint64
	// Eager issues the layer's ops one by one even when the backend can
	// capture graphs. By default the forward of each input is captured once
	// and the graphs are replayed round-robin: the launch overhead of a
	// dozen ops is what graphs remove in serving, so it is not timed.
	Eager bool
	// CompareFinalize also times every recipe with the atomic finalize
	// (moe.Config.AtomicFinalize) in the same run, right after the
	// deterministic one, on the same inputs: Result.AtomicMean. Layer's
	// own AtomicFinalize then must be false.
	CompareFinalize bool
}

// Result is one (tokens, recipe) measurement.
type Result struct {
	Tokens  int
	Recipe  moe.Recipe
	Mean    time.Duration // per forward
	CosMean float64       // per-token cosine to the BF16 recipe over every input (1 for bf16)
	CosMin  float64
	Floor   Floor  // the NVFP4 floor at this batch size, the same for every recipe
	Timing  string // how Mean was measured: "graphs" or "eager", then "events" or "wall"
	// AtomicMean is the same forward with the atomic finalize, with
	// Config.CompareFinalize; else 0.
	AtomicMean time.Duration
}

// eventTimer is implemented by backends that time enqueued work on the
// device (the CUDA backend, with events): fn is called n times and the
// device time per call comes back, without the host's launch gaps.
type eventTimer interface {
	Time(n int, fn func() error) (time.Duration, error)
}

// measure returns the mean time of n calls of fn, with the backend's event
// timer when it has one, else by the wall clock between two Syncs, and
// which of the two it used.
func measure(be kernels.Backend, n int, fn func() error) (time.Duration, string, error) {
	if t, ok := be.(eventTimer); ok {
		d, err := t.Time(n, fn)
		if err == nil {
			err = be.Sync() // execution errors of the timed work surface here
		}
		return d, "events", err
	}
	if err := be.Sync(); err != nil {
		return 0, "", err
	}
	start := time.Now()
	for range n {
		if err := fn(); err != nil {
			return 0, "", err
		}
	}
	if err := be.Sync(); err != nil {
		return 0, "", err
	}
	return time.Since(start) / time.Duration(n), "wall", nil
}

// Run measures every recipe at every batch size.
func Run(ctx context.Context, be kernels.Backend, cfg Config, progress io.Writer) (results []Result, err error) {
	if len(cfg.Tokens) == 0 || len(cfg.Recipes) == 0 || cfg.Iters < 1 || cfg.Inputs < 1 || cfg.Warmup < 0 {
		return nil, fmt.Errorf("moebench: need tokens, recipes, iters >= 1, warmup >= 0 and inputs >= 1")
	}
	if !slices.Contains(cfg.Recipes, moe.RecipeBF16) {
		return nil, fmt.Errorf("moebench: recipes %v must include %q, the accuracy reference", cfg.Recipes, moe.RecipeBF16)
	}
	for i, rc := range cfg.Recipes {
		if slices.Contains(cfg.Recipes[:i], rc) {
			return nil, fmt.Errorf("moebench: recipe %q listed twice", rc)
		}
	}
	for _, T := range cfg.Tokens {
		if T < 1 {
			return nil, fmt.Errorf("moebench: batch of %d tokens", T)
		}
	}
	if cfg.CompareFinalize && cfg.Layer.AtomicFinalize {
		return nil, fmt.Errorf("moebench: compare finalize: the layer config asks for the atomic finalize already")
	}
	// layers[0]: the configured finalize; layers[1]: the atomic one, with
	// CompareFinalize.
	layers := [2]map[moe.Recipe]*moe.Layer{{}, {}}
	defer func() {
		for _, m := range layers {
			for _, l := range m {
				err = errors.Join(err, l.Close())
			}
		}
	}()
	w := RandomWeightsFast(cfg.Layer, cfg.Seed)
	for _, rc := range cfg.Recipes {
		for v := range 2 {
			if v == 1 && !cfg.CompareFinalize {
				break
			}
			lc := cfg.Layer
			lc.Recipe, lc.MaxTokens = rc, slices.Max(cfg.Tokens)
			lc.AtomicFinalize = lc.AtomicFinalize || v == 1
			l, err := moe.New(be, lc)
			if err != nil {
				return nil, fmt.Errorf("moebench: %s layer: %w", rc, err)
			}
			layers[v][rc] = l
			if err := Load(be, l, w); err != nil {
				return nil, fmt.Errorf("moebench: load %s layer: %w", rc, err)
			}
			if rc == moe.RecipePerTensor {
				if err := calibrate(be, l, cfg.Seed); err != nil {
					return nil, fmt.Errorf("moebench: calibrate %s layer: %w", rc, err)
				}
			}
		}
	}
	w = Weights{}                                // 15 GB of host memory at DeepSeek-V3's shapes
	inputs := rand.New(rand.NewPCG(cfg.Seed, 2)) // weights use cfg.Seed alone
	for _, T := range cfg.Tokens {
		res, err := runTokens(ctx, be, cfg, layers, inputs, T, progress)
		if err != nil {
			return nil, fmt.Errorf("moebench: %d tokens: %w", T, err)
		}
		results = append(results, res...)
	}
	return results, nil
}

// calibrate sets a per_tensor layer's input scales from one batch of
// MaxTokens tokens drawn as the benchmark's inputs are (N(0, 1)), from a
// stream of its own.
func calibrate(be kernels.Backend, l *moe.Layer, seed uint64) (err error) {
	c := l.Config()
	in, err := be.Alloc(kernels.BF16, c.MaxTokens, c.Hidden)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, be.Free(in)) }()
	out, err := be.Alloc(kernels.BF16, c.MaxTokens, c.Hidden)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, be.Free(out)) }()
	if err := be.Upload(in, 0, RandomBF16(rand.New(rand.NewPCG(seed, 3)), c.MaxTokens*c.Hidden, 1)); err != nil {
		return err
	}
	if err := l.Calibrate(out, in); err != nil {
		return err
	}
	_, _, err = l.EndCalibration()
	return err
}

// runTokens measures every recipe at one batch size.
func runTokens(ctx context.Context, be kernels.Backend, cfg Config, layers [2]map[moe.Recipe]*moe.Layer, r *rand.Rand, T int, progress io.Writer) (results []Result, err error) {
	H := cfg.Layer.Hidden
	var bufs []*kernels.Buffer
	defer func() {
		for _, b := range bufs {
			err = errors.Join(err, be.Free(b))
		}
	}()
	ins, outs := make([]*kernels.Buffer, cfg.Inputs), make([]*kernels.Buffer, cfg.Inputs)
	for i := range ins {
		for _, p := range []**kernels.Buffer{&ins[i], &outs[i]} {
			if *p, err = be.Alloc(kernels.BF16, T, H); err != nil {
				return nil, err
			}
			bufs = append(bufs, *p)
		}
		if err := be.Upload(ins[i], 0, RandomBF16(r, T*H, 1)); err != nil {
			return nil, err
		}
	}
	floor := ForwardFloor(cfg.Layer, T)
	outputs := map[moe.Recipe][]byte{}
	for _, rc := range cfg.Recipes {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		res, out, err := runRecipe(be, cfg, layers[0][rc], ins, outs)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", rc, err)
		}
		res.Tokens, res.Recipe, res.Floor = T, rc, floor
		outputs[rc] = out
		if progress != nil {
			fmt.Fprintf(progress, "  tokens %5d  %-11s %10.1f us  (%s)\n", T, RecipeName(rc), us(res.Mean), res.Timing)
		}
		if l := layers[1][rc]; l != nil {
			ares, _, err := runRecipe(be, cfg, l, ins, outs)
			if err != nil {
				return nil, fmt.Errorf("%s, atomic finalize: %w", rc, err)
			}
			res.AtomicMean = ares.Mean
			if progress != nil {
				fmt.Fprintf(progress, "  tokens %5d  %-11s %10.1f us  (%s, atomic finalize)\n", T, RecipeName(rc), us(ares.Mean), ares.Timing)
			}
		}
		results = append(results, res)
	}
	for i := range results {
		var s cosineStats
		s.add(outputs[results[i].Recipe], outputs[moe.RecipeBF16], H)
		results[i].CosMean, results[i].CosMin = s.result()
	}
	return results, nil
}

// runRecipe times one layer over the rotating inputs and returns its
// outputs for every input, concatenated (the accuracy comparison).
func runRecipe(be kernels.Backend, cfg Config, l *moe.Layer, ins, outs []*kernels.Buffer) (res Result, out []byte, err error) {
	step, cleanup, mode, err := forwards(be, l, ins, outs, cfg.Eager)
	if err != nil {
		return res, nil, err
	}
	defer func() { err = errors.Join(err, cleanup()) }()
	// One forward per input, checked on the host: the graphs compute what
	// they are timed computing.
	for i := range ins {
		if err := step(i); err != nil {
			return res, nil, err
		}
	}
	if err := be.Sync(); err != nil {
		return res, nil, err
	}
	for _, o := range outs {
		b := make([]byte, o.Size())
		if err := be.Download(b, o, 0); err != nil {
			return res, nil, err
		}
		out = append(out, b...)
	}
	for i := range cfg.Warmup {
		if err := step(i % len(ins)); err != nil {
			return res, nil, err
		}
	}
	next := 0
	mean, timer, err := measure(be, cfg.Iters, func() error {
		err := step(next % len(ins))
		next++
		return err
	})
	if err != nil {
		return res, nil, err
	}
	return Result{Mean: mean, Timing: mode + "+" + timer}, out, nil
}

// forwards returns step(i), which runs the layer on input i into output i:
// by replaying a graph captured once per input when the backend is a
// kernels.Capturer (and eager is false), else by calling Forward. cleanup
// destroys the graphs.
func forwards(be kernels.Backend, l *moe.Layer, ins, outs []*kernels.Buffer, eager bool) (step func(int) error, cleanup func() error, mode string, err error) {
	capt, ok := be.(kernels.Capturer)
	if !ok || eager {
		return func(i int) error { return l.Forward(outs[i], ins[i]) }, func() error { return nil }, "eager", nil
	}
	var graphs []kernels.Graph
	cleanup = func() error {
		var errs []error
		for _, g := range graphs {
			errs = append(errs, g.Destroy())
		}
		return errors.Join(errs...)
	}
	for i := range ins {
		if err := capt.BeginCapture(); err != nil {
			return nil, nil, "", errors.Join(fmt.Errorf("capture input %d: %w", i, err), cleanup())
		}
		// EndCapture runs even when Forward failed: it ends the capture
		// and reports the error of the op that poisoned it.
		ferr := l.Forward(outs[i], ins[i])
		g, err := capt.EndCapture()
		if err = errors.Join(ferr, err); err != nil {
			if g != nil {
				err = errors.Join(err, g.Destroy())
			}
			return nil, nil, "", errors.Join(fmt.Errorf("capture input %d: %w", i, err), cleanup())
		}
		graphs = append(graphs, g)
	}
	return func(i int) error { return graphs[i].Launch() }, cleanup, "graphs", nil
}

// RecipeName is the name a recipe goes by in the benchmark's output and on
// its command line: the per-token NVFP4 recipe is "nvfp4", the one that
// the performance targets (docs/PERF.md) mean by NVFP4.
func RecipeName(r moe.Recipe) string {
	if r == moe.RecipePerToken {
		return "nvfp4"
	}
	return string(r)
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
