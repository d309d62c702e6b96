// Package moebench measures the MoE layer: every recipe on the same random
// weights and the same rotating inputs, side by side in one run, with each
// NVFP4 recipe's accuracy against the BF16 recipe.
//
// Run builds its layers on the backend it is given and frees them before it
// returns; it must be called from the goroutine that owns the backend.
package moebench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

// Config is one benchmark run.
type Config struct {
	Layer   moe.Config   // shape, activation, scoring; Recipe and MaxTokens are set per case
	Tokens  []int        // batch sizes
	Recipes []moe.Recipe // the first is the reference for accuracy; must include bf16
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
func Run(ctx context.Context, be kernels.Backend, cfg Config, progress io.Writer) ([]Result, error) {
	if len(cfg.Tokens) == 0 || len(cfg.Recipes) == 0 || cfg.Iters < 1 || cfg.Inputs < 1 {
		return nil, fmt.Errorf("moebench: need tokens, recipes, iters >= 1 and inputs >= 1")
	}
	if !slices.Contains(cfg.Recipes, moe.RecipeBF16) {
		return nil, fmt.Errorf("moebench: recipes %v must include %q, the accuracy reference", cfg.Recipes, moe.RecipeBF16)
	}
	maxT := slices.Max(cfg.Tokens)
	r := rand.New(rand.NewPCG(cfg.Seed, 2)) // inputs; weights use cfg.Seed
	w := moetest.RandomWeights(cfg.Layer, cfg.Seed)

	layers := make(map[moe.Recipe]*moe.Layer)
	defer func() {
		for _, l := range layers {
			l.Close()
		}
	}()
	for _, rc := range cfg.Recipes {
		lc := cfg.Layer
		lc.Recipe, lc.MaxTokens = rc, maxT
		l, err := moe.New(be, lc)
		if err != nil {
			return nil, err
		}
		layers[rc] = l
		if err := moetest.Load(be, l, w); err != nil {
			return nil, err
		}
	}

	H := cfg.Layer.Hidden
	var results []Result
	for _, T := range cfg.Tokens {
		if T < 1 {
			return nil, fmt.Errorf("moebench: batch of %d tokens", T)
		}
		ins, outs := make([]*kernels.Buffer, cfg.Inputs), make([]*kernels.Buffer, cfg.Inputs)
		for i := range ins {
			var err error
			if ins[i], err = be.Alloc(kernels.BF16, T, H); err != nil {
				return nil, err
			}
			defer be.Free(ins[i])
			if outs[i], err = be.Alloc(kernels.BF16, T, H); err != nil {
				return nil, err
			}
			defer be.Free(outs[i])
			if err := be.Upload(ins[i], 0, moetest.RandomBF16(r, T*H, 1)); err != nil {
				return nil, err
			}
		}
		ref := map[moe.Recipe][]float64{}
		for _, rc := range cfg.Recipes {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			l := layers[rc]
			// Accuracy on input 0, then timing over the rotation.
			if err := l.Forward(outs[0], ins[0]); err != nil {
				return nil, err
			}
			got, err := readBF16(be, outs[0])
			if err != nil {
				return nil, err
			}
			ref[rc] = got
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
			results = append(results, res)
			if progress != nil {
				fmt.Fprintf(progress, "  tokens %5d  %-11s %v\n", T, rc, res.Mean)
			}
		}
		for i := range results {
			res := &results[i]
			if res.Tokens != T {
				continue
			}
			res.CosMean, res.CosMin = moetest.Cosines(ref[res.Recipe], ref[moe.RecipeBF16], H)
		}
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
	return moetest.Floats(raw), nil
}
