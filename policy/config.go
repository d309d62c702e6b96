package policy

import (
	"fmt"

	"github.com/rollout-worker/rollout-worker/moe"
)

// Config is the model architecture, as read from a Hugging Face
// config.json (see ParseConfig) or a preset.
type Config struct {
	Architecture string // "Qwen3MoeForCausalLM" or "MixtralForCausalLM"

	VocabSize    int
	Hidden       int
	Layers       int
	Heads        int // query heads
	KVHeads      int
	HeadDim      int
	MaxPositions int

	Experts         int
	TopK            int
	MoEIntermediate int
	NormTopK        bool           // renormalise the top-k routing weights
	Activation      moe.Activation // swiglu (gate/up/down) or relu2 (up/down, non-gated)

	RMSNormEps    float32
	RopeTheta     float64
	QKNorm        bool // per-head RMSNorm of q and k before RoPE (Qwen3)
	TieEmbeddings bool // the LM head is the embedding matrix

	EOSTokenIDs []int32 // from config.json, informational (requests carry their own stop ids)
}

// Validate checks internal consistency.
func (c Config) Validate() error {
	switch {
	case c.VocabSize <= 0 || c.Hidden <= 0 || c.Layers <= 0:
		return fmt.Errorf("policy: config: vocab %d, hidden %d, layers %d must be positive", c.VocabSize, c.Hidden, c.Layers)
	case c.Heads <= 0 || c.KVHeads <= 0 || c.Heads%c.KVHeads != 0:
		return fmt.Errorf("policy: config: %d query heads do not group over %d kv heads", c.Heads, c.KVHeads)
	case c.HeadDim <= 0 || c.HeadDim%2 != 0:
		return fmt.Errorf("policy: config: head dim %d must be positive and even", c.HeadDim)
	case c.Experts <= 0 || c.TopK <= 0 || c.TopK > c.Experts:
		return fmt.Errorf("policy: config: top-%d of %d experts", c.TopK, c.Experts)
	case c.MoEIntermediate <= 0:
		return fmt.Errorf("policy: config: moe intermediate size %d must be positive", c.MoEIntermediate)
	case c.Activation != moe.SwiGLU && c.Activation != moe.ReLU2:
		return fmt.Errorf("policy: config: expert activation %q: want %q or %q", c.Activation, moe.SwiGLU, moe.ReLU2)
	case !(c.RMSNormEps > 0):
		return fmt.Errorf("policy: config: rms_norm_eps %v must be positive", c.RMSNormEps)
	case !(c.RopeTheta > 0):
		return fmt.Errorf("policy: config: rope theta %v must be positive", c.RopeTheta)
	case c.MaxPositions <= 0:
		return fmt.Errorf("policy: config: max positions %d must be positive", c.MaxPositions)
	}
	return nil
}

// WeightBytes returns the size of the model's BF16 weights: the expert
// stacks, and everything else (embeddings, LM head, attention, norms,
// routers). A refit stages the tensors it cannot write in place, so a
// worker keeps that much device memory out of the KV cache.
func (c Config) WeightBytes() (experts, other int64) {
	H, D := int64(c.Hidden), int64(c.HeadDim)
	i1 := int64(c.MoEIntermediate)
	if c.Activation == moe.SwiGLU {
		i1 *= 2
	}
	other = int64(c.VocabSize)*H + H // embeddings, final norm
	if !c.TieEmbeddings {
		other += int64(c.VocabSize) * H
	}
	perLayer := 2*H + // input and post-attention norms
		int64(c.Heads)*D*H + 2*int64(c.KVHeads)*D*H + H*int64(c.Heads)*D + // q, k, v, o
		int64(c.Experts)*H // router
	if c.QKNorm {
		perLayer += 2 * D
	}
	other += int64(c.Layers) * perLayer
	experts = int64(c.Layers) * int64(c.Experts) * (i1*H + H*int64(c.MoEIntermediate))
	return 2 * experts, 2 * other
}
