package policy

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"strconv"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
)

// ModelOptions are the run-time choices a Model is built with.
type ModelOptions struct {
	// Recipe is the MoE recipe: moe.RecipeBF16, moe.RecipePerToken
	// ("nvfp4" on the command line), moe.RecipePerTensor (whose input
	// scales Calibrate or SetInputScales set before the first forward) or
	// moe.RecipeUnitScale.
	Recipe moe.Recipe
	// MaxTokens is the most tokens one forward pass carries (prefill chunks
	// and decode rows together); workspaces are sized for it.
	MaxTokens int
	// MaxSeqs is the most sequences one forward pass carries.
	MaxSeqs int
	// MaxLogitRows is the most rows of logits one forward pass produces
	// (sampled rows, or scored positions); 0 means MaxTokens.
	MaxLogitRows int
	// KVPages pages of PageSize token slots make each layer's KV cache.
	KVPages, PageSize int
	// KVMemoryFraction sizes the KV cache when KVPages is 0: that fraction
	// of the device memory still free once the weights and workspaces are
	// allocated, on a backend that reports its free memory (the CUDA one).
	// The model's Options then hold the page count it chose.
	KVMemoryFraction float64
	// KVReserveBytes is device memory kept out of that fraction for what
	// is allocated after the model: refit staging buffers, graphs.
	KVReserveBytes int64
}

// memInfo is implemented by backends that know their free memory.
type memInfo interface {
	MemInfo() (free, total int64, err error)
}

// MaxPagesPerSeq is the page-table width: enough pages for MaxPositions.
func (o ModelOptions) maxPagesPerSeq(c Config) int {
	return (c.MaxPositions + o.PageSize - 1) / o.PageSize
}

// Target is where a Hugging Face tensor lives in a Model: a contiguous byte
// range of one buffer, in the tensor's own row-major layout.
type Target struct {
	Name   string
	Buffer *kernels.Buffer
	Offset int   // bytes
	Shape  []int // as Hugging Face stores it
	Layer  int   // decoder layer, or -1 (embeddings, final norm, LM head)
	// Experts is the expert range [lo, hi) an expert tensor covers (both 0
	// for other tensors). Expert tensors go straight into the resident BF16
	// stacks; their NVFP4 copies must be requantized after they change.
	Experts [2]int
}

// Size returns the tensor's size in bytes (BF16).
func (t Target) Size() int {
	n := 2
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// IsExpert reports whether the tensor is (part of) an expert stack.
func (t Target) IsExpert() bool { return t.Experts[1] > t.Experts[0] }

// layer is one decoder layer's resident weights.
type layer struct {
	inNorm, postNorm *kernels.Buffer // BF16 [H]
	q, k, v          *kernels.Buffer // BF16 [Hq*D, H], [Hkv*D, H], [Hkv*D, H]
	o                *kernels.Buffer // BF16 [H, Hq*D]
	qNorm, kNorm     *kernels.Buffer // BF16 [D] (QKNorm only)
	moe              *moe.Layer
	kv               kernels.KVCache // [KVPages, PageSize, Hkv, D]
}

// Model is a policy resident on one backend.
type Model struct {
	cfg  Config
	opts ModelOptions
	be   kernels.Backend

	embed, lmHead, norm *kernels.Buffer // lmHead == embed when tied
	layers              []layer
	cos, sin            *kernels.Buffer // BF16 [MaxPositions, D/2]

	ws     workspace
	owned  []*kernels.Buffer
	closed bool
	marker kernels.Marker
	// calibrating: forwards run the MoE layers' Calibrate (Model.Calibrate).
	calibrating bool
}

// SetMarker makes Forward mark its groups of ops on mk, for a per-group
// device-time breakdown: "embed", "norms" (RMSNorm, residual adds),
// "projections" (the q/k/v/o GEMMs), "attention" (RoPE, KV write,
// attention), the MoE layer's "router" and "experts", "lm_head" (final
// norm, row gather, LM head GEMM) and "sampling". nil stops it.
func (m *Model) SetMarker(mk kernels.Marker) {
	m.marker = mk
	for _, l := range m.layers {
		l.moe.SetMarker(mk)
	}
}

// mark starts a group of ops when a marker is set.
func (m *Model) mark(group string) error {
	if m.marker == nil {
		return nil
	}
	return m.marker.Mark(group)
}

// NewModel allocates a model with zero weights on be. Load weights through
// Resolve (LoadCheckpoint does), then call Requantize.
func NewModel(be kernels.Backend, cfg Config, opts ModelOptions) (*Model, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	autoKV := opts.KVPages == 0 && opts.KVMemoryFraction > 0 && opts.KVMemoryFraction <= 1
	if opts.MaxTokens <= 0 || opts.MaxSeqs <= 0 || (opts.KVPages <= 0 && !autoKV) || opts.PageSize <= 0 || opts.MaxLogitRows < 0 {
		return nil, fmt.Errorf("policy: model: max tokens %d, max sequences %d, kv pages %d (or 0 with a kv memory fraction in (0, 1], got %v) and page size %d must be positive",
			opts.MaxTokens, opts.MaxSeqs, opts.KVPages, opts.KVMemoryFraction, opts.PageSize)
	}
	if opts.MaxLogitRows == 0 {
		opts.MaxLogitRows = opts.MaxTokens
	}
	m := &Model{cfg: cfg, opts: opts, be: be}
	if err := m.alloc(); err != nil {
		return nil, errors.Join(err, m.Close())
	}
	return m, nil
}

func (m *Model) alloc() error {
	c := m.cfg
	H, D := c.Hidden, c.HeadDim
	var err error
	buf := func(dt kernels.DType, shape ...int) *kernels.Buffer {
		if err != nil {
			return nil
		}
		var b *kernels.Buffer
		if b, err = m.be.Alloc(dt, shape...); err != nil {
			err = fmt.Errorf("policy: alloc %s%v: %w", dt, shape, err)
			return nil
		}
		m.owned = append(m.owned, b)
		return b
	}
	m.embed = buf(kernels.BF16, c.VocabSize, H)
	m.lmHead = m.embed
	if !c.TieEmbeddings {
		m.lmHead = buf(kernels.BF16, c.VocabSize, H)
	}
	m.norm = buf(kernels.BF16, H)
	m.cos, m.sin = buf(kernels.BF16, c.MaxPositions, D/2), buf(kernels.BF16, c.MaxPositions, D/2)
	m.layers = make([]layer, c.Layers)
	for i := range m.layers {
		l := &m.layers[i]
		l.inNorm, l.postNorm = buf(kernels.BF16, H), buf(kernels.BF16, H)
		l.q = buf(kernels.BF16, c.Heads*D, H)
		l.k, l.v = buf(kernels.BF16, c.KVHeads*D, H), buf(kernels.BF16, c.KVHeads*D, H)
		l.o = buf(kernels.BF16, H, c.Heads*D)
		if c.QKNorm {
			l.qNorm, l.kNorm = buf(kernels.BF16, D), buf(kernels.BF16, D)
		}
		if err != nil {
			return err
		}
		l.moe, err = moe.New(m.be, moe.Config{Hidden: H, Intermediate: c.MoEIntermediate, Experts: c.Experts, TopK: c.TopK,
			Activation: c.Activation, Scoring: moe.Softmax, Renormalize: c.NormTopK, Recipe: m.opts.Recipe, MaxTokens: m.opts.MaxTokens})
		if err != nil {
			return fmt.Errorf("policy: layer %d: %w", i, err)
		}
	}
	m.ws = newWorkspace(m, buf)
	if err == nil && m.opts.KVPages == 0 {
		m.opts.KVPages, err = m.kvPagesFromMemory()
	}
	for i := range m.layers {
		m.layers[i].kv = kernels.KVCache{K: buf(kernels.BF16, m.opts.KVPages, m.opts.PageSize, c.KVHeads, D),
			V: buf(kernels.BF16, m.opts.KVPages, m.opts.PageSize, c.KVHeads, D)}
	}
	if err != nil {
		return err
	}
	if err := m.be.Upload(m.cos, 0, m.ropeTable(math.Cos)); err != nil {
		return err
	}
	return m.be.Upload(m.sin, 0, m.ropeTable(math.Sin))
}

// kvPagesFromMemory returns how many KV pages KVMemoryFraction of the
// backend's free memory holds, for every layer's K and V.
func (m *Model) kvPagesFromMemory() (int, error) {
	mi, ok := m.be.(memInfo)
	if !ok {
		return 0, fmt.Errorf("policy: model: kv pages 0 (a fraction of free memory) needs a backend that reports its memory; %s does not", m.be.Name())
	}
	free, _, err := mi.MemInfo()
	if err != nil {
		return 0, fmt.Errorf("policy: model: free memory: %w", err)
	}
	c := m.cfg
	perPage := int64(2*c.Layers) * int64(m.opts.PageSize*c.KVHeads*c.HeadDim) * 2 // K and V, BF16
	pages := int64(float64(free-m.opts.KVReserveBytes)*m.opts.KVMemoryFraction) / perPage
	if pages < 1 {
		return 0, fmt.Errorf("policy: model: %.2f of %d free bytes, less %d reserved, holds no KV page of %d bytes",
			m.opts.KVMemoryFraction, free, m.opts.KVReserveBytes, perPage)
	}
	// Slots are int32 page*PageSize+offset.
	return int(min(pages, math.MaxInt32/int64(m.opts.PageSize))), nil
}

// ropeTable returns f(position * inv_freq[i]) for every position and
// i < D/2, as BF16 bytes, computed the way transformers does: inv_freq =
// 1 / theta^(2i/D) in FP32, the angle as an FP32 product, f in FP32, then
// rounded to BF16 (the activation dtype).
func (m *Model) ropeTable(f func(float64) float64) []byte {
	c := m.cfg
	half := c.HeadDim / 2
	inv := make([]float32, half)
	for i := range inv {
		inv[i] = float32(1 / math.Pow(c.RopeTheta, float64(float32(2*i)/float32(c.HeadDim))))
	}
	out := make([]byte, 2*c.MaxPositions*half)
	vals := make([]float32, half)
	for p := range c.MaxPositions {
		for i := range vals {
			vals[i] = float32(f(float64(float32(p) * inv[i])))
		}
		bf16.Encode(out[2*p*half:], vals)
	}
	return out
}

// Config returns the model's architecture.
func (m *Model) Config() Config { return m.cfg }

// Options returns the options the model was built with.
func (m *Model) Options() ModelOptions { return m.opts }

// Backend returns the backend the model lives on.
func (m *Model) Backend() kernels.Backend { return m.be }

// MoE returns decoder layer i's MoE layer.
func (m *Model) MoE(i int) *moe.Layer { return m.layers[i].moe }

// Requantize rebuilds every layer's NVFP4 expert copies from the BF16
// stacks (a no-op for the bf16 recipe).
func (m *Model) Requantize() error {
	for i, l := range m.layers {
		if err := l.moe.Requantize(); err != nil {
			return fmt.Errorf("policy: layer %d: %w", i, err)
		}
	}
	return nil
}

// Close frees every buffer of the model. It is idempotent.
func (m *Model) Close() error {
	if m.closed {
		return nil
	}
	m.closed = true
	var errs []error
	for _, l := range m.layers {
		if l.moe != nil {
			errs = append(errs, l.moe.Close())
		}
	}
	for _, b := range m.owned {
		errs = append(errs, m.be.Free(b))
	}
	m.owned = nil
	return errors.Join(errs...)
}

// Tensor names. Expert tensors come per expert (mlp.experts.N.gate_proj,
// Mixtral's block_sparse_moe.experts.N.w1) or fused per layer
// (mlp.experts.gate_up_proj); both MoE prefixes are accepted for both
// architectures.
var (
	layerName  = regexp.MustCompile(`^model\.layers\.(\d+)\.(.+)$`)
	expertName = regexp.MustCompile(`^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$`)
	fusedName  = regexp.MustCompile(`^(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|up_proj|down_proj)$`)
)

// Resolve maps a Hugging Face tensor name to its place in the model, or
// returns an error naming the tensor when the model has no such tensor.
func (m *Model) Resolve(name string) (Target, error) {
	c := m.cfg
	H := c.Hidden
	whole := func(b *kernels.Buffer, layer int) (Target, error) {
		return Target{Name: name, Buffer: b, Shape: b.Shape(), Layer: layer}, nil
	}
	switch name {
	case "model.embed_tokens.weight":
		return whole(m.embed, -1)
	case "model.norm.weight":
		return whole(m.norm, -1)
	case "lm_head.weight":
		if !c.TieEmbeddings {
			return whole(m.lmHead, -1)
		}
	}
	sub := layerName.FindStringSubmatch(name)
	if sub == nil {
		return Target{}, fmt.Errorf("policy: unknown tensor %q", name)
	}
	li, err := strconv.Atoi(sub[1])
	if err != nil || li >= c.Layers || sub[1] != strconv.Itoa(li) {
		return Target{}, fmt.Errorf("policy: tensor %q: no layer %s (the model has %d)", name, sub[1], c.Layers)
	}
	l := &m.layers[li]
	rest := sub[2]
	switch rest {
	case "input_layernorm.weight":
		return whole(l.inNorm, li)
	case "post_attention_layernorm.weight":
		return whole(l.postNorm, li)
	case "self_attn.q_proj.weight":
		return whole(l.q, li)
	case "self_attn.k_proj.weight":
		return whole(l.k, li)
	case "self_attn.v_proj.weight":
		return whole(l.v, li)
	case "self_attn.o_proj.weight":
		return whole(l.o, li)
	case "self_attn.q_norm.weight", "self_attn.k_norm.weight":
		if c.QKNorm {
			if rest == "self_attn.q_norm.weight" {
				return whole(l.qNorm, li)
			}
			return whole(l.kNorm, li)
		}
	case "mlp.gate.weight", "block_sparse_moe.gate.weight":
		return whole(l.moe.Router(), li)
	}
	I := c.MoEIntermediate
	gated := c.Activation == moe.SwiGLU
	if e := expertName.FindStringSubmatch(rest); e != nil {
		ei, err := strconv.Atoi(e[1])
		if err != nil || ei >= c.Experts || e[1] != strconv.Itoa(ei) {
			return Target{}, fmt.Errorf("policy: tensor %q: no expert %s (the model has %d)", name, e[1], c.Experts)
		}
		fc1Rows := I
		if gated {
			fc1Rows = 2 * I
		}
		t := Target{Name: name, Layer: li, Experts: [2]int{ei, ei + 1}}
		switch {
		case (e[2] == "gate_proj" || e[2] == "w1") && gated:
			t.Buffer, t.Offset, t.Shape = l.moe.FC1(), ei*fc1Rows*H*2, []int{I, H}
		case (e[2] == "up_proj" || e[2] == "w3") && gated:
			t.Buffer, t.Offset, t.Shape = l.moe.FC1(), (ei*fc1Rows+I)*H*2, []int{I, H}
		case e[2] == "up_proj" && !gated:
			t.Buffer, t.Offset, t.Shape = l.moe.FC1(), ei*fc1Rows*H*2, []int{I, H}
		case e[2] == "down_proj" || e[2] == "w2":
			t.Buffer, t.Offset, t.Shape = l.moe.FC2(), ei*H*I*2, []int{H, I}
		default:
			return Target{}, fmt.Errorf("policy: tensor %q: %s experts have no %s", name, c.Activation, e[2])
		}
		return t, nil
	}
	if f := fusedName.FindStringSubmatch(rest); f != nil {
		t := Target{Name: name, Layer: li, Experts: [2]int{0, c.Experts}}
		switch {
		case f[1] == "gate_up_proj" && gated, f[1] == "up_proj" && !gated:
			t.Buffer, t.Shape = l.moe.FC1(), l.moe.FC1().Shape()
		case f[1] == "down_proj":
			t.Buffer, t.Shape = l.moe.FC2(), l.moe.FC2().Shape()
		default:
			return Target{}, fmt.Errorf("policy: tensor %q: %s experts have no fused %s", name, c.Activation, f[1])
		}
		return t, nil
	}
	return Target{}, fmt.Errorf("policy: unknown tensor %q", name)
}

// Tensors lists every weight of the model under its canonical Hugging Face
// name (experts one by one: gate_proj/up_proj/down_proj), in a fixed order.
// A checkpoint must cover each of them exactly once, by these names or by
// the fused per-layer expert tensors.
func (m *Model) Tensors() ([]Target, error) {
	c := m.cfg
	names := []string{"model.embed_tokens.weight"}
	for i := range c.Layers {
		p := fmt.Sprintf("model.layers.%d.", i)
		names = append(names, p+"input_layernorm.weight", p+"self_attn.q_proj.weight", p+"self_attn.k_proj.weight",
			p+"self_attn.v_proj.weight", p+"self_attn.o_proj.weight")
		if c.QKNorm {
			names = append(names, p+"self_attn.q_norm.weight", p+"self_attn.k_norm.weight")
		}
		names = append(names, p+"post_attention_layernorm.weight", p+"mlp.gate.weight")
		for e := range c.Experts {
			q := fmt.Sprintf("%smlp.experts.%d.", p, e)
			if c.Activation == moe.SwiGLU {
				names = append(names, q+"gate_proj.weight")
			}
			names = append(names, q+"up_proj.weight", q+"down_proj.weight")
		}
	}
	names = append(names, "model.norm.weight")
	if !c.TieEmbeddings {
		names = append(names, "lm_head.weight")
	}
	out := make([]Target, len(names))
	for i, n := range names {
		t, err := m.Resolve(n)
		if err != nil {
			return nil, err // cannot happen: canonical names resolve by construction
		}
		out[i] = t
	}
	return out, nil
}
