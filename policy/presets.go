package policy

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/moe"
)

// presets are small architectures for demos and tests, with the shapes of
// the real families (GQA, q/k norm, fine-grained top-k experts) at a size a
// CPU runs in milliseconds. Every width is a multiple of 16, the NVFP4
// block, so both MoE recipes run on them.
var presets = map[string]Config{
	// tiny: Qwen3-MoE, 2 layers, 8 experts top-2; 0.19 M parameters.
	"tiny": {Architecture: ArchQwen3MoE, VocabSize: 512, Hidden: 64, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
		MaxPositions: 1024, Experts: 8, TopK: 2, MoEIntermediate: 32, NormTopK: true, Activation: moe.SwiGLU,
		RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true, EOSTokenIDs: []int32{1}},
	// tiny-mixtral: the tiny shapes as MixtralForCausalLM (no q/k norm,
	// w1/w3/w2 expert names).
	"tiny-mixtral": {Architecture: ArchMixtral, VocabSize: 512, Hidden: 64, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
		MaxPositions: 1024, Experts: 8, TopK: 2, MoEIntermediate: 32, NormTopK: true, Activation: moe.SwiGLU,
		RMSNormEps: 1e-5, RopeTheta: 1e6, EOSTokenIDs: []int32{1}},
	// small: Qwen3-MoE, 4 layers, 16 experts top-4; 9.1 M parameters.
	"small": {Architecture: ArchQwen3MoE, VocabSize: 4096, Hidden: 256, Layers: 4, Heads: 8, KVHeads: 2, HeadDim: 32,
		MaxPositions: 2048, Experts: 16, TopK: 4, MoEIntermediate: 128, NormTopK: true, Activation: moe.SwiGLU,
		RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true, EOSTokenIDs: []int32{1}},
	// qwen3-30b-a3b: the shapes of Qwen3-30B-A3B (48 layers, hidden 2048,
	// 128 experts top-8 of intermediate 768, 32 query / 4 KV heads of 128,
	// vocabulary 151936); 30.5 B parameters, 61 GB in BF16. Cut its depth
	// with PresetLayers; qwen3-30b-a3b-relu2 has squared-ReLU experts
	// (non-gated) at the same shapes.
	"qwen3-30b-a3b":       qwen3_30bA3B(moe.SwiGLU),
	"qwen3-30b-a3b-relu2": qwen3_30bA3B(moe.ReLU2),
}

func qwen3_30bA3B(act moe.Activation) Config {
	return Config{Architecture: ArchQwen3MoE, VocabSize: 151936, Hidden: 2048, Layers: 48, Heads: 32, KVHeads: 4, HeadDim: 128,
		MaxPositions: 40960, Experts: 128, TopK: 8, MoEIntermediate: 768, NormTopK: true, Activation: act,
		RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true, EOSTokenIDs: []int32{151645}}
}

// PresetLayers returns the named preset cut to its first layers decoder
// layers (0: all of them), for benchmarks of a real model's shapes at a
// depth that fits a time or memory budget.
func PresetLayers(name string, layers int) (Config, error) {
	c, err := Preset(name)
	if err != nil {
		return Config{}, err
	}
	switch {
	case layers < 0 || layers > c.Layers:
		return Config{}, fmt.Errorf("policy: preset %s: %d layers, want 1 to %d (0: all)", name, layers, c.Layers)
	case layers > 0:
		c.Layers = layers
	}
	return c, nil
}

// PresetNames lists the preset names, sorted.
func PresetNames() []string {
	names := make([]string, 0, len(presets))
	for n := range presets {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// Preset returns the named preset configuration (SwiGLU experts; set
// Activation to moe.ReLU2 for the squared-ReLU variant).
func Preset(name string) (Config, error) {
	c, ok := presets[name]
	if !ok {
		return Config{}, fmt.Errorf("policy: unknown preset %q (have %s)", name, strings.Join(PresetNames(), ", "))
	}
	c.EOSTokenIDs = slices.Clone(c.EOSTokenIDs)
	return c, nil
}

// randomLayout is how writeRandomModel lays the checkpoint out. The values
// do not depend on it: every tensor is drawn from (seed, canonical name).
type randomLayout struct {
	fused  bool // experts as fused per-layer tensors rather than per expert
	shards int  // > 1: that many shards plus model.safetensors.index.json
}

// WriteRandomModel writes a model directory for cfg with seeded random
// weights, in the format LoadModel reads: config.json in the transformers
// 5.x spelling (with "expert_activation": "relu2" for squared-ReLU experts)
// and model.safetensors with per-expert BF16 tensors under the
// architecture's Hugging Face names (Mixtral: block_sparse_moe.*, w1/w3/w2).
//
// Values are deterministic in (seed, tensor name): matrices are N(0,
// 1/fan_in), so every projection keeps activations O(1); embeddings are
// N(0, 1); norm weights are 1. config.json is written last, so a directory
// with one holds a complete checkpoint. Existing files are replaced.
func WriteRandomModel(dir string, cfg Config, seed uint64) error {
	return writeRandomModel(dir, cfg, seed, randomLayout{})
}

func writeRandomModel(dir string, cfg Config, seed uint64, layout randomLayout) error {
	js, err := checkedConfigJSON(cfg)
	if err != nil {
		return fmt.Errorf("policy: write model %s: %w", dir, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("policy: write model: %w", err)
	}
	tensors := randomTensors(cfg, seed, layout.fused)
	if layout.shards <= 1 {
		err = stfile.Write(filepath.Join(dir, SingleFileName), tensors, map[string]string{"format": "pt"})
	} else {
		err = writeShards(dir, tensors, layout.shards)
	}
	if err != nil {
		return fmt.Errorf("policy: write model %s: %w", dir, err)
	}
	if err := writeFileAtomic(filepath.Join(dir, "config.json"), js); err != nil {
		return fmt.Errorf("policy: write model %s: %w", dir, err)
	}
	return nil
}

// checkedConfigJSON renders cfg and checks that ParseConfig reads back the
// same Config, so a written model always loads as the model that was meant.
func checkedConfigJSON(cfg Config) ([]byte, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	js, err := configJSON(cfg)
	if err != nil {
		return nil, err
	}
	back, err := ParseConfig(js)
	if err != nil {
		return nil, err
	}
	norm := func(c Config) Config {
		if len(c.EOSTokenIDs) == 0 {
			c.EOSTokenIDs = nil
		}
		return c
	}
	if !reflect.DeepEqual(norm(back), norm(cfg)) {
		return nil, fmt.Errorf("config %+v cannot be expressed in config.json (it reads back as %+v)", cfg, back)
	}
	return js, nil
}

// randomSpec is one tensor of a random model.
type randomSpec struct {
	name  string
	shape []int
	std   float64 // 0: all ones (norm weights)
}

// randomSpecs lists a model's tensors under the architecture's per-expert
// Hugging Face names.
func randomSpecs(cfg Config) []randomSpec {
	H, D, I := cfg.Hidden, cfg.HeadDim, cfg.MoEIntermediate
	inv := func(fanIn int) float64 { return 1 / math.Sqrt(float64(fanIn)) }
	moePrefix, gate, up, down := "mlp", "gate_proj", "up_proj", "down_proj"
	if cfg.Architecture == ArchMixtral {
		moePrefix = "block_sparse_moe"
		if cfg.Activation == moe.SwiGLU {
			gate, up, down = "w1", "w3", "w2"
		}
	}
	specs := []randomSpec{{"model.embed_tokens.weight", []int{cfg.VocabSize, H}, 1}}
	for l := range cfg.Layers {
		p := "model.layers." + strconv.Itoa(l) + "."
		specs = append(specs,
			randomSpec{p + "input_layernorm.weight", []int{H}, 0},
			randomSpec{p + "self_attn.q_proj.weight", []int{cfg.Heads * D, H}, inv(H)},
			randomSpec{p + "self_attn.k_proj.weight", []int{cfg.KVHeads * D, H}, inv(H)},
			randomSpec{p + "self_attn.v_proj.weight", []int{cfg.KVHeads * D, H}, inv(H)},
			randomSpec{p + "self_attn.o_proj.weight", []int{H, cfg.Heads * D}, inv(cfg.Heads * D)})
		if cfg.QKNorm {
			specs = append(specs, randomSpec{p + "self_attn.q_norm.weight", []int{D}, 0},
				randomSpec{p + "self_attn.k_norm.weight", []int{D}, 0})
		}
		specs = append(specs, randomSpec{p + "post_attention_layernorm.weight", []int{H}, 0},
			randomSpec{p + moePrefix + ".gate.weight", []int{cfg.Experts, H}, inv(H)})
		for e := range cfg.Experts {
			q := p + moePrefix + ".experts." + strconv.Itoa(e) + "."
			if cfg.Activation == moe.SwiGLU {
				specs = append(specs, randomSpec{q + gate + ".weight", []int{I, H}, inv(H)})
			}
			specs = append(specs, randomSpec{q + up + ".weight", []int{I, H}, inv(H)},
				randomSpec{q + down + ".weight", []int{H, I}, inv(I)})
		}
	}
	specs = append(specs, randomSpec{"model.norm.weight", []int{H}, 0})
	if !cfg.TieEmbeddings {
		specs = append(specs, randomSpec{"lm_head.weight", []int{cfg.VocabSize, H}, inv(H)})
	}
	return specs
}

// TensorShape is one tensor of a model's checkpoint: its Hugging Face name
// and shape.
type TensorShape struct {
	Name  string
	Shape []int
}

// CheckpointTensors lists the BF16 tensors of a checkpoint of cfg under the
// per-expert Hugging Face names, in the order init-model writes them.
func CheckpointTensors(cfg Config) []TensorShape {
	specs := randomSpecs(cfg)
	out := make([]TensorShape, len(specs))
	for i, s := range specs {
		out[i] = TensorShape{Name: s.name, Shape: slices.Clone(s.shape)}
	}
	return out
}

// randomData draws a tensor's BF16 bytes from (seed, name): for std > 0
// normal values of that deviation, each the standard normal quantile of a
// 16-bit draw (normQuantiles) times std, four to a 64-bit draw of a PCG
// keyed by the seed and the tensor's name; for std = 0 ones. A 61 GB model
// draws in about 1.5 ns an element, on all cores in a few seconds.
func randomData(seed uint64, s randomSpec) []byte {
	n := 1
	for _, d := range s.shape {
		n *= d
	}
	out := make([]byte, 2*n)
	le := binary.LittleEndian
	if s.std == 0 {
		for i := 0; i < n; i++ {
			le.PutUint16(out[2*i:], 0x3f80) // 1.0
		}
		return out
	}
	h := fnv.New64a()
	h.Write([]byte(s.name))
	r := rand.NewPCG(seed, h.Sum64())
	q, std := normQuantiles(), float32(s.std)
	val := func(u uint64) uint64 { return uint64(bf16.FromFloat32(q[u&0xffff] * std)) }
	i := 0
	for ; i+4 <= n; i += 4 {
		u := r.Uint64()
		le.PutUint64(out[2*i:], val(u)|val(u>>16)<<16|val(u>>32)<<32|val(u>>48)<<48)
	}
	for u := r.Uint64(); i < n; i, u = i+1, u>>16 {
		le.PutUint16(out[2*i:], uint16(val(u)))
	}
	return out
}

// normQuantiles is the table randomData draws from: entry u is the
// standard normal quantile at (u + 0.5) / 65536, so entries are symmetric
// and the tails end at about 4.3.
var normQuantiles = sync.OnceValue(func() *[1 << 16]float32 {
	var t [1 << 16]float32
	for u := range t {
		t[u] = float32(math.Sqrt2 * math.Erfinv(2*(float64(u)+0.5)/(1<<16)-1))
	}
	return &t
})

// splitExpertName splits a per-expert tensor name into the layer's experts
// prefix, the expert and the projection, to regroup it into fused tensors.
func splitExpertName(name string) (layerPrefix string, expert int, proj string, ok bool) {
	i := strings.Index(name, ".experts.")
	if i < 0 {
		return "", 0, "", false
	}
	rest := strings.TrimSuffix(name[i+len(".experts."):], ".weight")
	num, proj, found := strings.Cut(rest, ".")
	if !found {
		return "", 0, "", false
	}
	e, err := strconv.Atoi(num)
	if err != nil {
		return "", 0, "", false
	}
	return name[:i+len(".experts.")], e, proj, true
}

// randomTensors returns the model's tensors in spec order; with fused, each
// layer's expert tensors become gate_up_proj [E, 2I, H] (gate rows, then up
// rows, per expert) and down_proj [E, H, I], or up_proj [E, I, H] and
// down_proj for relu2 experts, the transformers 5.x layout.
func randomTensors(cfg Config, seed uint64, fused bool) []stfile.Tensor {
	var out []stfile.Tensor
	fusedAt := map[string]int{} // fused tensor name -> index in out
	for _, s := range randomSpecs(cfg) {
		data := randomData(seed, s)
		name := s.name
		if fused {
			// The transformers 5.x runtime layout: Mixtral's MoE block
			// (router included) lives under mlp. there.
			name = strings.Replace(name, ".block_sparse_moe.", ".mlp.", 1)
		}
		prefix, _, proj, isExpert := splitExpertName(name)
		if !fused || !isExpert {
			out = append(out, stfile.Tensor{Name: name, DType: stfile.BF16, Shape: u64(s.shape), Data: data})
			continue
		}
		// Experts come in order, and gate before up within one, so
		// appending builds the [E, 2I, H] stacks row-block by row-block.
		var fname string
		var shape []int
		switch proj {
		case "gate_proj", "w1", "up_proj", "w3":
			if cfg.Activation == moe.SwiGLU {
				fname, shape = prefix+"gate_up_proj", []int{cfg.Experts, 2 * cfg.MoEIntermediate, cfg.Hidden}
			} else {
				fname, shape = prefix+"up_proj", []int{cfg.Experts, cfg.MoEIntermediate, cfg.Hidden}
			}
		default:
			fname, shape = prefix+"down_proj", []int{cfg.Experts, cfg.Hidden, cfg.MoEIntermediate}
		}
		i, seen := fusedAt[fname]
		if !seen {
			i = len(out)
			fusedAt[fname] = i
			out = append(out, stfile.Tensor{Name: fname, DType: stfile.BF16, Shape: u64(shape)})
		}
		out[i].Data = append(out[i].Data, data...)
	}
	return out
}

func u64(shape []int) []uint64 {
	out := make([]uint64, len(shape))
	for i, d := range shape {
		out[i] = uint64(d)
	}
	return out
}

// writeShards splits tensors over n shard files, named as transformers
// names them, and writes model.safetensors.index.json.
func writeShards(dir string, tensors []stfile.Tensor, n int) error {
	n = min(n, len(tensors))
	weightMap := map[string]string{}
	total := 0
	for k := range n {
		name := fmt.Sprintf("model-%05d-of-%05d.safetensors", k+1, n)
		part := tensors[k*len(tensors)/n : (k+1)*len(tensors)/n]
		for _, t := range part {
			weightMap[t.Name] = name
			total += len(t.Data)
		}
		if err := stfile.Write(filepath.Join(dir, name), part, map[string]string{"format": "pt"}); err != nil {
			return err
		}
	}
	index, err := json.MarshalIndent(map[string]any{
		"metadata":   map[string]any{"total_size": total},
		"weight_map": weightMap,
	}, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(dir, IndexFileName), append(index, '\n'))
}

// writeFileAtomic writes data to path through a synced temporary file in
// the same directory, renamed over path.
func writeFileAtomic(path string, data []byte) (err error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err = tmp.Write(data); err != nil {
		return err
	}
	if err = tmp.Chmod(0o644); err != nil {
		return err
	}
	if err = tmp.Sync(); err != nil {
		return err
	}
	if err = tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
