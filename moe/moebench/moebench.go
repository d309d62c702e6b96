// Package moebench measures the MoE layer: every recipe on the same random
// weights and the same rotating inputs, side by side in one run, with each
// NVFP4 recipe's accuracy against the BF16 recipe. It also holds the seeded
// weights, inputs and cosine similarity that the layer's tests use.
//
// Run builds its layers on the backend it is given and frees them before it
// returns; it must be called from the goroutine that owns the backend. The
// other functions are pure.
package moebench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
)

// Config is one benchmark run.
type Config struct {
	Layer   moe.Config   // shape, activation, scoring; Recipe and MaxTokens are set per case
	Tokens  []int        // batch sizes
	Recipes []moe.Recipe // distinct; must include bf16, the accuracy reference
	Iters   int          // timed forwards per case (mean reported)
	Warmup  int          // untimed forwards per case
	Inputs  int          // distinct input batches rotated through
	Seed    uint64
}

// Result is one (tokens, recipe) measurement.
type Result struct {
	Tokens  int
	Recipe  moe.Recipe
	Mean    time.Duration // per forward
	CosMean float64       // per-token cosine to the BF16 recipe (1 for bf16)
	CosMin  float64
}

// Run measures every recipe at every batch size.
func Run(ctx context.Context, be kernels.Backend, cfg Config, progress io.Writer) (results []Result, err error) {
	if len(cfg.Tokens) == 0 || len(cfg.Recipes) == 0 || cfg.Iters < 1 || cfg.Inputs < 1 {
		return nil, fmt.Errorf("moebench: need tokens, recipes, iters >= 1 and inputs >= 1")
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
	w := RandomWeights(cfg.Layer, cfg.Seed)
	layers := make(map[moe.Recipe]*moe.Layer)
	defer func() {
		for _, l := range layers {
			err = errors.Join(err, l.Close())
		}
	}()
	for _, rc := range cfg.Recipes {
		lc := cfg.Layer
		lc.Recipe, lc.MaxTokens = rc, slices.Max(cfg.Tokens)
		l, err := moe.New(be, lc)
		if err != nil {
			return nil, fmt.Errorf("moebench: %s layer: %w", rc, err)
		}
		layers[rc] = l
		if err := Load(be, l, w); err != nil {
			return nil, fmt.Errorf("moebench: load %s layer: %w", rc, err)
		}
	}
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

// runTokens measures every recipe at one batch size.
func runTokens(ctx context.Context, be kernels.Backend, cfg Config, layers map[moe.Recipe]*moe.Layer, r *rand.Rand, T int, progress io.Writer) (results []Result, err error) {
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
	outputs := map[moe.Recipe][]float64{}
	for _, rc := range cfg.Recipes {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		l := layers[rc]
		// Accuracy on input 0, then timing over the rotation.
		if err := l.Forward(outs[0], ins[0]); err != nil {
			return nil, err
		}
		if outputs[rc], err = readBF16(be, outs[0]); err != nil {
			return nil, err
		}
		for i := range cfg.Warmup {
			if err := l.Forward(outs[i%cfg.Inputs], ins[i%cfg.Inputs]); err != nil {
				return nil, err
			}
		}
		if err := be.Sync(); err != nil {
			return nil, err
		}
		start := time.Now()
		for i := range cfg.Iters {
			if err := l.Forward(outs[i%cfg.Inputs], ins[i%cfg.Inputs]); err != nil {
				return nil, err
			}
		}
		if err := be.Sync(); err != nil {
			return nil, err
		}
		res := Result{Tokens: T, Recipe: rc, Mean: time.Since(start) / time.Duration(cfg.Iters)}
		res.CosMean, res.CosMin = 1, 1
		results = append(results, res)
		if progress != nil {
			fmt.Fprintf(progress, "  tokens %5d  %-11s %v\n", T, rc, res.Mean)
		}
	}
	for i := range results {
		results[i].CosMean, results[i].CosMin = Cosines(outputs[results[i].Recipe], outputs[moe.RecipeBF16], H)
	}
	return results, nil
}

// Table writes one row per batch size: each recipe's mean time and each
// NVFP4 recipe's speed-up over BF16 and accuracy.
func Table(w io.Writer, results []Result) error {
	var recipes []moe.Recipe
	var tokens []int
	byKey := map[[2]any]Result{}
	for _, r := range results {
		if !slices.Contains(recipes, r.Recipe) {
			recipes = append(recipes, r.Recipe)
		}
		if !slices.Contains(tokens, r.Tokens) {
			tokens = append(tokens, r.Tokens)
		}
		byKey[[2]any{r.Tokens, r.Recipe}] = r
	}
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "tokens\t")
	for _, rc := range recipes {
		fmt.Fprintf(tw, "%s (ms)\t", rc)
	}
	for _, rc := range recipes {
		if rc != moe.RecipeBF16 {
			fmt.Fprintf(tw, "bf16/%s\tcos mean\tcos min\t", rc)
		}
	}
	fmt.Fprintln(tw)
	for _, T := range tokens {
		fmt.Fprintf(tw, "%d\t", T)
		for _, rc := range recipes {
			fmt.Fprintf(tw, "%.3f\t", ms(byKey[[2]any{T, rc}].Mean))
		}
		base := byKey[[2]any{T, moe.RecipeBF16}].Mean
		for _, rc := range recipes {
			if rc == moe.RecipeBF16 {
				continue
			}
			r := byKey[[2]any{T, rc}]
			fmt.Fprintf(tw, "%.2fx\t%.4f\t%.4f\t", float64(base)/float64(r.Mean), r.CosMean, r.CosMin)
		}
		fmt.Fprintln(tw)
	}
	return tw.Flush()
}

// CSV writes the results as comma-separated values with a header.
func CSV(w io.Writer, results []Result) error {
	if _, err := fmt.Fprintln(w, "tokens,recipe,mean_us,cos_mean,cos_min"); err != nil {
		return err
	}
	for _, r := range results {
		if _, err := fmt.Fprintf(w, "%d,%s,%.3f,%.6f,%.6f\n", r.Tokens, r.Recipe, float64(r.Mean.Nanoseconds())/1e3, r.CosMean, r.CosMin); err != nil {
			return err
		}
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

func readBF16(be kernels.Backend, b *kernels.Buffer) ([]float64, error) {
	if err := be.Sync(); err != nil {
		return nil, err
	}
	raw := make([]byte, b.Size())
	if err := be.Download(raw, b, 0); err != nil {
		return nil, err
	}
	return Floats(raw), nil
}
