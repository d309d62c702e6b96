package moe

import (
	"fmt"
	"math"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// Recipe names how the expert GEMMs are computed. New recipes are new
// values of recipeSpec, not new code paths.
type Recipe string

// Recipes.
const (
	// RecipeBF16 runs the experts on the BF16 stacks: the baseline.
	RecipeBF16 Recipe = "bf16"
	// RecipePerToken is NVFP4 x NVFP4 with one FP32 scale per token for
	// the activations (no calibration) and one per expert for the weights.
	RecipePerToken Recipe = "per_token"
	// RecipeWeightOnly is BF16 activations x NVFP4 weights (W4A16).
	RecipeWeightOnly Recipe = "weight_only"
	// RecipePerTensor is NVFP4 x NVFP4 with one calibrated FP32 scale per
	// layer for each expert GEMM's input (FC1's, and FC2's after the
	// activation), the same for every token: Layer.SetInputScales (a
	// checkpoint's input_scale values) or a calibration (Layer.Calibrate,
	// Layer.EndCalibration) sets them, and Forward refuses to run before.
	RecipePerTensor Recipe = "per_tensor"
	// RecipeUnitScale is RecipePerTensor with both input scales fixed at
	// one (the activation encoding of cuDNN's grouped NVFP4 GEMM): no
	// calibration; a block's largest magnitude is resolved from 6 * 2^-6
	// (the smallest normal E4M3 block scale) to 2688 (the largest), with
	// fewer bits down to 6 * 2^-9, blocks of at most 6 * 2^-10 becoming
	// zero, and larger values saturating at 2688 (docs/MOE.md).
	RecipeUnitScale Recipe = "unit_scale"
)

// recipeSpec is what a recipe changes: whether the weights have NVFP4
// copies, and how activations enter each expert GEMM.
type recipeSpec struct {
	quantWeights bool
	quantActs    bool // NVFP4 activations before FC1 and FC2: a global scale per row
	tensorActs   bool // ... with the layer's calibrated scale in every row
	unitScale    bool // ... fixed at one
}

func (r Recipe) spec() (recipeSpec, error) {
	switch r {
	case RecipeBF16:
		return recipeSpec{}, nil
	case RecipePerToken:
		return recipeSpec{quantWeights: true, quantActs: true}, nil
	case RecipePerTensor:
		return recipeSpec{quantWeights: true, quantActs: true, tensorActs: true}, nil
	case RecipeUnitScale:
		return recipeSpec{quantWeights: true, quantActs: true, tensorActs: true, unitScale: true}, nil
	case RecipeWeightOnly:
		return recipeSpec{quantWeights: true}, nil
	}
	return recipeSpec{}, fmt.Errorf("moe: unknown recipe %q (want %q, %q, %q, %q or %q)", r, RecipeBF16, RecipePerToken, RecipePerTensor,
		RecipeUnitScale, RecipeWeightOnly)
}

// Activation is the expert activation.
type Activation string

// Expert activations.
const (
	// SwiGLU experts: FC1 is [gate; up] (2I rows), out = silu(gate) * up.
	SwiGLU Activation = "swiglu"
	// ReLU2 experts are non-gated: FC1 has I rows, out = relu(h)^2.
	ReLU2 Activation = "relu2"
)

func (a Activation) kernel() (kernels.Activation, error) {
	switch a {
	case SwiGLU:
		return kernels.SwiGLU, nil
	case ReLU2:
		return kernels.ReLU2, nil
	}
	return 0, fmt.Errorf("moe: unknown activation %q (want %q or %q)", a, SwiGLU, ReLU2)
}

// Scoring is the router's score function.
type Scoring string

// Router score functions.
const (
	Softmax Scoring = "softmax"
	Sigmoid Scoring = "sigmoid"
)

func (s Scoring) kernel() (kernels.Scoring, error) {
	switch s {
	case Softmax:
		return kernels.Softmax, nil
	case Sigmoid:
		return kernels.Sigmoid, nil
	}
	return 0, fmt.Errorf("moe: unknown scoring %q (want %q or %q)", s, Softmax, Sigmoid)
}

// Config describes one MoE layer.
type Config struct {
	Hidden       int // model width H
	Intermediate int // expert width I (FC1 has 2I rows for SwiGLU)
	Experts      int // E, all local
	TopK         int // experts per token
	Activation   Activation
	Scoring      Scoring
	// Renormalize divides the top-k weights by their sum.
	Renormalize bool
	// RoutedScaling multiplies the final routing weights; 0 means 1.
	RoutedScaling float32
	Recipe        Recipe
	// MaxTokens is the largest batch Forward accepts; workspaces are sized
	// for it once, in New.
	MaxTokens int
	// AtomicFinalize fuses the finalize into FC2's epilogue with atomic
	// FP32 additions (kernels.Scatter): no expert rows are written, but a
	// token's sum is taken in no fixed order, so outputs may change in
	// their last bits from run to run and with the batch. The default, the
	// deterministic finalize, is batch invariant; this option exists to
	// measure what that costs.
	AtomicFinalize bool
}

// fc1Rows is the number of FC1 rows per expert.
func (c Config) fc1Rows() int {
	if c.Activation == SwiGLU {
		return 2 * c.Intermediate
	}
	return c.Intermediate
}

// validate checks the config and fills defaults.
func (c *Config) validate() error {
	switch {
	case c.Hidden <= 0 || c.Intermediate <= 0:
		return fmt.Errorf("moe: hidden %d and intermediate %d must be positive", c.Hidden, c.Intermediate)
	case c.Experts <= 0 || c.TopK <= 0 || c.TopK > c.Experts:
		return fmt.Errorf("moe: top-%d of %d experts", c.TopK, c.Experts)
	case c.MaxTokens <= 0:
		return fmt.Errorf("moe: max tokens %d must be positive", c.MaxTokens)
	case c.RoutedScaling < 0 || math.IsNaN(float64(c.RoutedScaling)) || math.IsInf(float64(c.RoutedScaling), 0):
		return fmt.Errorf("moe: routed scaling %v must be a positive finite factor", c.RoutedScaling)
	}
	if c.RoutedScaling == 0 {
		c.RoutedScaling = 1
	}
	if _, err := c.Recipe.spec(); err != nil {
		return err
	}
	if _, err := c.Activation.kernel(); err != nil {
		return err
	}
	_, err := c.Scoring.kernel()
	return err
}
