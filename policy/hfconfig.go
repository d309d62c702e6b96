package policy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/rollout-worker/rollout-worker/moe"
)

// Supported architectures, as named in config.json's "architectures".
const (
	ArchQwen3MoE = "Qwen3MoeForCausalLM"
	ArchMixtral  = "MixtralForCausalLM"
)

// ExpertActivationKey is the config.json key that selects the expert
// activation. It is this project's extension, not a transformers field:
//
//   - absent, or "swiglu": gated experts, silu(gate) * up, as transformers
//     runs them; "hidden_act" must then be "silu".
//   - "relu2": non-gated experts, relu(up)^2, with tensors up_proj and
//     down_proj only (no gate_proj, no Mixtral w1/w3). "hidden_act" must be
//     absent or "relu2".
//
// "hidden_act": "relu2" alone is rejected: to transformers it means the gated
// relu2(gate) * up, which this worker does not run, and reading it as
// non-gated would silently change the model.
const ExpertActivationKey = "expert_activation"

// archInfo is what differs between the supported architectures: the
// model_type that goes with the name, and the transformers defaults of the
// optional fields (applied when config.json omits them, as transformers
// does).
type archInfo struct {
	modelType    string
	ropeTheta    float64
	rmsNormEps   float32
	qkNorm       bool
	expertsKey   string // the 4.x spelling of the expert count
	expertSizeKy string // the expert width: moe_intermediate_size or intermediate_size
}

var archs = map[string]archInfo{
	ArchQwen3MoE: {modelType: "qwen3_moe", ropeTheta: 10000, rmsNormEps: 1e-6, qkNorm: true,
		expertsKey: "num_experts", expertSizeKy: "moe_intermediate_size"},
	ArchMixtral: {modelType: "mixtral", ropeTheta: 1e6, rmsNormEps: 1e-5, qkNorm: false,
		expertsKey: "num_local_experts", expertSizeKy: "intermediate_size"},
}

// SupportedArchitectures lists the architectures ParseConfig accepts.
func SupportedArchitectures() []string {
	names := make([]string, 0, len(archs))
	for n := range archs {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// LoadConfig reads and parses dir/config.json.
func LoadConfig(dir string) (Config, error) {
	path := filepath.Join(dir, "config.json")
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("policy: config: %w", err)
	}
	cfg, err := ParseConfig(data)
	if err != nil {
		return Config{}, fmt.Errorf("%w (in %s)", err, path)
	}
	return cfg, nil
}

// ParseConfig parses a Hugging Face config.json of a supported architecture
// (Qwen3MoeForCausalLM or MixtralForCausalLM), as written by transformers
// 4.x or 5.x, plus the expert-activation extension (ExpertActivationKey).
//
// Fields that define tensor shapes are required (vocab_size, hidden_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads,
// max_position_embeddings, the expert count and width, num_experts_per_tok);
// behaviour flags that transformers always serializes but that may be
// omitted by hand-written files take transformers' defaults for the
// architecture. Settings this worker does not implement (sliding windows,
// RoPE scaling, attention biases, dense layers between MoE layers,
// quantizations other than ModelOpt NVFP4, non-bfloat16 dtypes, ...) are errors, never
// approximations. Unknown fields are ignored: transformers writes many
// training-only ones (router_aux_loss_coef, output_router_logits, ...).
func ParseConfig(data []byte) (Config, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		return Config{}, fmt.Errorf("policy: config: not a JSON object: %w", err)
	}
	r := &cfgReader{m: raw}
	cfg := r.parse()
	if len(r.errs) > 0 {
		return Config{}, fmt.Errorf("policy: config: %s", strings.Join(r.errs, "; "))
	}
	if err := cfg.Validate(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// cfgReader reads typed fields from a config.json object and collects every
// problem, so one error reports all of them.
type cfgReader struct {
	m    map[string]json.RawMessage
	errs []string
}

func (r *cfgReader) errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

// has reports whether key is present with a non-null value.
func (r *cfgReader) has(key string) bool {
	v, ok := r.m[key]
	return ok && !bytes.Equal(bytes.TrimSpace(v), []byte("null"))
}

// get decodes key into dst and reports whether it was present (not null).
func (r *cfgReader) get(key string, dst any, want string) bool {
	if !r.has(key) {
		return false
	}
	if err := json.Unmarshal(r.m[key], dst); err != nil {
		r.errorf("%s = %s: want %s", key, r.m[key], want)
		return false
	}
	return true
}

func (r *cfgReader) int(key string) (int, bool) {
	var v int
	ok := r.get(key, &v, "an integer")
	return v, ok
}

func (r *cfgReader) float(key string) (float64, bool) {
	var v float64
	ok := r.get(key, &v, "a number")
	return v, ok
}

func (r *cfgReader) bool(key string, def bool) bool {
	v := def
	r.get(key, &v, "true or false")
	return v
}

func (r *cfgReader) str(key string) (string, bool) {
	var v string
	ok := r.get(key, &v, "a string")
	return v, ok
}

// requiredInt reads a shape-defining integer that must be present.
func (r *cfgReader) requiredInt(key string) int {
	v, ok := r.int(key)
	if !ok && !r.has(key) {
		r.errorf("%s is missing", key)
	}
	return v
}

// aliasedInt reads an integer spelled under any of keys (a field renamed
// between transformers versions); when several are present they must agree.
func (r *cfgReader) aliasedInt(keys ...string) int {
	var v, n int
	var first string
	for _, k := range keys {
		if !r.has(k) {
			continue
		}
		n++ // present, even if malformed: int records that error
		x, ok := r.int(k)
		if !ok {
			continue
		}
		if first != "" && x != v {
			r.errorf("%s = %d and %s = %d disagree", first, v, k, x)
		}
		if first == "" {
			v, first = x, k
		}
	}
	if n == 0 {
		r.errorf("%s is missing", strings.Join(keys, " / "))
	}
	return v
}

func (r *cfgReader) architecture() (string, archInfo, bool) {
	var names []string
	r.get("architectures", &names, "a list of strings")
	modelType, _ := r.str("model_type")
	var name string
	switch {
	case len(names) > 1:
		r.errorf("architectures %q: want exactly one", names)
		return "", archInfo{}, false
	case len(names) == 1:
		name = names[0]
	case modelType != "":
		for n, a := range archs {
			if a.modelType == modelType {
				name = n
			}
		}
		if name == "" {
			r.errorf("model_type %q is not supported (supported: %s)", modelType, strings.Join(SupportedArchitectures(), ", "))
			return "", archInfo{}, false
		}
	default:
		r.errorf("neither architectures nor model_type is given (supported: %s)", strings.Join(SupportedArchitectures(), ", "))
		return "", archInfo{}, false
	}
	a, ok := archs[name]
	if !ok {
		r.errorf("architecture %q is not supported (supported: %s)", name, strings.Join(SupportedArchitectures(), ", "))
		return "", archInfo{}, false
	}
	if modelType != "" && modelType != a.modelType {
		r.errorf("model_type %q does not match architecture %s (want %q)", modelType, name, a.modelType)
	}
	return name, a, true
}

func (r *cfgReader) parse() Config {
	name, a, ok := r.architecture()
	if !ok {
		return Config{}
	}
	c := Config{
		Architecture: name,
		VocabSize:    r.requiredInt("vocab_size"),
		Hidden:       r.requiredInt("hidden_size"),
		Layers:       r.requiredInt("num_hidden_layers"),
		Heads:        r.requiredInt("num_attention_heads"),
		MaxPositions: r.requiredInt("max_position_embeddings"),
		// transformers 5.x maps num_experts to num_local_experts for both
		// architectures (attribute_map), so either spelling may appear.
		Experts:         r.aliasedInt("num_experts", "num_local_experts"),
		TopK:            r.requiredInt("num_experts_per_tok"),
		MoEIntermediate: r.requiredInt(a.expertSizeKy),
		RMSNormEps:      a.rmsNormEps,
		RopeTheta:       a.ropeTheta,
		QKNorm:          a.qkNorm,
		TieEmbeddings:   r.bool("tie_word_embeddings", false),
	}
	// num_key_value_heads null means no grouping, as in transformers.
	if _, present := r.m["num_key_value_heads"]; present && !r.has("num_key_value_heads") {
		c.KVHeads = c.Heads
	} else {
		c.KVHeads = r.requiredInt("num_key_value_heads")
	}
	if v, ok := r.float("rms_norm_eps"); ok {
		c.RMSNormEps = float32(v)
	}
	// head_dim may be absent (or null in Mixtral files): transformers then
	// uses hidden_size / num_attention_heads.
	if v, ok := r.int("head_dim"); ok {
		c.HeadDim = v
	} else if c.Heads > 0 {
		c.HeadDim = c.Hidden / c.Heads
	}
	switch name {
	case ArchQwen3MoE:
		c.NormTopK = r.bool("norm_topk_prob", false)
		if v, ok := r.int("decoder_sparse_step"); ok && v != 1 {
			r.errorf("decoder_sparse_step %d: only every-layer MoE (1) is supported", v)
		}
		var dense []int
		if r.get("mlp_only_layers", &dense, "a list of layer indices") && len(dense) > 0 {
			r.errorf("mlp_only_layers %v: dense MLP layers are not supported", dense)
		}
		if r.bool("use_sliding_window", false) {
			r.errorf("use_sliding_window true: sliding-window attention is not supported")
		}
	case ArchMixtral:
		// Mixtral takes the softmax over the top-k logits, which equals the
		// renormalised top-k of the full softmax.
		c.NormTopK = true
		if w, ok := r.int("sliding_window"); ok && w < c.MaxPositions {
			r.errorf("sliding_window %d < max_position_embeddings %d: sliding-window attention is not supported", w, c.MaxPositions)
		}
	}
	if r.bool("attention_bias", false) {
		r.errorf("attention_bias true: attention projection biases are not supported")
	}
	if r.bool("mlp_bias", false) {
		r.errorf("mlp_bias true: MLP biases are not supported")
	}
	if v, ok := r.int("shared_expert_intermediate_size"); ok && v != 0 {
		r.errorf("shared_expert_intermediate_size %d: shared experts are not supported", v)
	}
	r.quantization()
	if v, ok := r.float("partial_rotary_factor"); ok && v != 1 {
		r.errorf("partial_rotary_factor %v: only full-head RoPE is supported", v)
	}
	var layerTypes []string
	if r.get("layer_types", &layerTypes, "a list of strings") {
		for i, t := range layerTypes {
			if t != "full_attention" {
				r.errorf("layer_types[%d] = %q: only full_attention is supported", i, t)
				break
			}
		}
	}
	for _, key := range []string{"torch_dtype", "dtype"} { // 4.x and 5.x spellings
		if v, ok := r.str(key); ok && v != "bfloat16" {
			r.errorf("%s %q: only bfloat16 checkpoints are supported", key, v)
		}
	}
	r.rope(&c)
	r.activation(&c)
	r.eos(&c)
	return c
}

// quantization accepts a ModelOpt NVFP4 export's quantization_config
// (quant_method "modelopt", quant_algo "NVFP4", blocks of 16 where a group
// size is given), whose tensors LoadCheckpoint reads; every other
// quantization is refused.
func (r *cfgReader) quantization() {
	if !r.has("quantization_config") {
		return
	}
	type algo struct {
		Algo      string `json:"quant_algo"`
		GroupSize *int   `json:"group_size"`
	}
	var q struct {
		Method string `json:"quant_method"`
		algo
		Nested *algo `json:"quantization"` // hf_quant_config.json's layout, embedded
	}
	if !r.get("quantization_config", &q, "an object") {
		return
	}
	if q.Nested != nil && q.Algo == "" {
		q.algo = *q.Nested
	}
	switch {
	case q.Method != "modelopt" && q.Method != "modelopt_fp4" || !strings.EqualFold(q.Algo, "NVFP4"):
		r.errorf("quantization_config %s: only ModelOpt NVFP4 checkpoints (quant_method \"modelopt\", quant_algo \"NVFP4\") are supported besides bfloat16", r.m["quantization_config"])
	case q.GroupSize != nil && *q.GroupSize != 16:
		r.errorf("quantization_config group_size %d: NVFP4 blocks are 16 elements", *q.GroupSize)
	}
}

// rope reads the RoPE base from rope_theta (4.x) or rope_parameters (5.x)
// and rejects every RoPE variant but the default one.
func (r *cfgReader) rope(c *Config) {
	theta, haveTop := r.float("rope_theta")
	if haveTop {
		c.RopeTheta = theta
	}
	if r.has("rope_scaling") {
		r.errorf("rope_scaling %s: only default RoPE is supported", r.m["rope_scaling"])
	}
	var params map[string]json.RawMessage
	if !r.get("rope_parameters", &params, "an object") {
		return
	}
	p := &cfgReader{m: params}
	if t, ok := p.str("rope_type"); ok && t != "default" {
		r.errorf("rope_parameters.rope_type %q: only default RoPE is supported", t)
	}
	if v, ok := p.float("rope_theta"); ok {
		if haveTop && v != theta {
			r.errorf("rope_theta %v and rope_parameters.rope_theta %v disagree", theta, v)
		}
		c.RopeTheta = v
	}
	for _, e := range p.errs {
		r.errorf("rope_parameters.%s", e)
	}
	for _, k := range slices.Sorted(maps.Keys(params)) {
		if k != "rope_type" && k != "rope_theta" {
			r.errorf("rope_parameters.%s: only rope_type and rope_theta are supported", k)
		}
	}
}

// activation applies the expert-activation convention (ExpertActivationKey).
func (r *cfgReader) activation(c *Config) {
	act, haveAct := r.str("hidden_act")
	ea, haveEA := r.str(ExpertActivationKey)
	switch {
	case haveEA && ea == string(moe.ReLU2):
		if haveAct && act != "relu2" {
			r.errorf("%s %q with hidden_act %q: non-gated relu2 experts need hidden_act relu2 (or none)", ExpertActivationKey, ea, act)
		}
		c.Activation = moe.ReLU2
	case haveEA && ea != string(moe.SwiGLU):
		r.errorf("%s %q: want %q or %q", ExpertActivationKey, ea, moe.SwiGLU, moe.ReLU2)
	case haveAct && act == "relu2":
		r.errorf("hidden_act relu2 without %s: transformers would run gated relu2(gate)*up experts, which are not supported; "+
			"for non-gated squared-ReLU experts set %q: %q", ExpertActivationKey, ExpertActivationKey, moe.ReLU2)
	case haveAct && act != "silu":
		r.errorf("hidden_act %q: gated experts support silu only", act)
	default:
		c.Activation = moe.SwiGLU
	}
}

// eos reads eos_token_id: an integer, a list of integers, or null.
func (r *cfgReader) eos(c *Config) {
	if !r.has("eos_token_id") {
		return
	}
	var one int32
	if json.Unmarshal(r.m["eos_token_id"], &one) == nil {
		c.EOSTokenIDs = []int32{one}
		return
	}
	var many []int32
	if err := json.Unmarshal(r.m["eos_token_id"], &many); err != nil {
		r.errorf("eos_token_id = %s: want an integer or a list of integers", r.m["eos_token_id"])
		return
	}
	c.EOSTokenIDs = many
}

// configJSON renders cfg as a transformers 5.x config.json (rope_parameters,
// dtype, num_local_experts), with the expert-activation extension for relu2
// experts. It is what WriteRandomModel writes.
func configJSON(cfg Config) ([]byte, error) {
	a, ok := archs[cfg.Architecture]
	if !ok {
		return nil, fmt.Errorf("policy: config: architecture %q is not supported (supported: %s)",
			cfg.Architecture, strings.Join(SupportedArchitectures(), ", "))
	}
	m := map[string]any{
		"architectures":           []string{cfg.Architecture},
		"model_type":              a.modelType,
		"vocab_size":              cfg.VocabSize,
		"hidden_size":             cfg.Hidden,
		"num_hidden_layers":       cfg.Layers,
		"num_attention_heads":     cfg.Heads,
		"num_key_value_heads":     cfg.KVHeads,
		"head_dim":                cfg.HeadDim,
		"max_position_embeddings": cfg.MaxPositions,
		"num_local_experts":       cfg.Experts,
		"num_experts_per_tok":     cfg.TopK,
		a.expertSizeKy:            cfg.MoEIntermediate,
		"rms_norm_eps":            pyFloat(float64(cfg.RMSNormEps), 32),
		"rope_parameters":         map[string]any{"rope_theta": pyFloat(cfg.RopeTheta, 64), "rope_type": "default"},
		"tie_word_embeddings":     cfg.TieEmbeddings,
		"attention_bias":          false,
		"hidden_act":              "silu",
		"dtype":                   "bfloat16",
		"transformers_version":    "5.0.0",
	}
	switch cfg.Architecture {
	case ArchQwen3MoE:
		if !cfg.QKNorm {
			return nil, errors.New("policy: config: Qwen3MoeForCausalLM always has q/k norm")
		}
		m["norm_topk_prob"] = cfg.NormTopK
		m["decoder_sparse_step"] = 1
		m["mlp_only_layers"] = []int{}
		m["use_sliding_window"] = false
	case ArchMixtral:
		if cfg.QKNorm || !cfg.NormTopK {
			return nil, errors.New("policy: config: MixtralForCausalLM has no q/k norm and always renormalises the top-k weights")
		}
		m["sliding_window"] = nil
	}
	if cfg.Activation == moe.ReLU2 {
		m["hidden_act"] = "relu2"
		m[ExpertActivationKey] = string(moe.ReLU2)
	}
	switch len(cfg.EOSTokenIDs) {
	case 0:
	case 1:
		m["eos_token_id"] = cfg.EOSTokenIDs[0]
	default:
		m["eos_token_id"] = cfg.EOSTokenIDs
	}
	out, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("policy: config: %w", err)
	}
	return append(out, '\n'), nil
}

// pyFloat spells a float as Python's json module does (1e-06, 1000000.0),
// so a written config.json reads as floats, not integers, in Python too.
func pyFloat(v float64, bits int) json.Number {
	if a := math.Abs(v); v != 0 && (a < 1e-4 || a >= 1e16) {
		return json.Number(strconv.FormatFloat(v, 'e', -1, bits))
	}
	s := strconv.FormatFloat(v, 'f', -1, bits)
	if !strings.Contains(s, ".") {
		s += ".0"
	}
	return json.Number(s)
}
