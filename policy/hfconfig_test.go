package policy

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/moe"
)

// hfcFixture returns testdata/configs/name.
func hfcFixture(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", "configs", name))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// hfcDelete, as a patch value, removes the key.
type hfcDelete struct{}

// hfcPatch returns the fixture with keys replaced (or removed).
func hfcPatch(t *testing.T, name string, patch map[string]any) []byte {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(hfcFixture(t, name), &m); err != nil {
		t.Fatal(err)
	}
	for k, v := range patch {
		if _, del := v.(hfcDelete); del {
			delete(m, k)
		} else {
			m[k] = v
		}
	}
	out, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestParseConfig(t *testing.T) {
	qwen := Config{Architecture: ArchQwen3MoE, VocabSize: 151936, Hidden: 2048, Layers: 48, Heads: 32, KVHeads: 4, HeadDim: 128,
		MaxPositions: 40960, Experts: 128, TopK: 8, MoEIntermediate: 768, NormTopK: true, Activation: moe.SwiGLU,
		RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true, EOSTokenIDs: []int32{151645}}
	qwen5 := qwen
	qwen5.EOSTokenIDs = []int32{151645, 151643}
	mixtral := Config{Architecture: ArchMixtral, VocabSize: 32000, Hidden: 4096, Layers: 32, Heads: 32, KVHeads: 8, HeadDim: 128,
		MaxPositions: 32768, Experts: 8, TopK: 2, MoEIntermediate: 14336, NormTopK: true, Activation: moe.SwiGLU,
		RMSNormEps: 1e-5, RopeTheta: 1e6, EOSTokenIDs: []int32{2}}
	relu2 := Config{Architecture: ArchQwen3MoE, VocabSize: 512, Hidden: 64, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
		MaxPositions: 1024, Experts: 8, TopK: 2, MoEIntermediate: 32, NormTopK: true, Activation: moe.ReLU2,
		RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true, TieEmbeddings: true, EOSTokenIDs: []int32{1}}

	with := func(c Config, f func(*Config)) Config { f(&c); return c }
	tests := []struct {
		name  string
		data  []byte
		want  Config
		error []string // substrings; empty: must parse
	}{
		{name: "qwen3 4.x", data: hfcFixture(t, "qwen3_moe_4x.json"), want: qwen},
		{name: "qwen3 5.x", data: hfcFixture(t, "qwen3_moe_5x.json"), want: qwen5},
		{name: "mixtral 4.x", data: hfcFixture(t, "mixtral_4x.json"), want: mixtral},
		{name: "mixtral 5.x", data: hfcFixture(t, "mixtral_5x.json"), want: mixtral},
		{name: "relu2", data: hfcFixture(t, "qwen3_moe_relu2.json"), want: relu2},
		{name: "relu2 without hidden_act", data: hfcPatch(t, "qwen3_moe_relu2.json", map[string]any{"hidden_act": hfcDelete{}}), want: relu2},
		{name: "explicit swiglu", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"expert_activation": "swiglu"}), want: qwen},
		{name: "qwen3 without head_dim", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"head_dim": hfcDelete{}}),
			want: with(qwen, func(c *Config) { c.HeadDim = 64 })},
		{name: "qwen3 defaults", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"norm_topk_prob": hfcDelete{},
			"rope_theta": hfcDelete{}, "rms_norm_eps": hfcDelete{}, "eos_token_id": hfcDelete{}, "tie_word_embeddings": hfcDelete{}}),
			want: with(qwen, func(c *Config) { c.NormTopK, c.RopeTheta, c.EOSTokenIDs = false, 10000, nil })},
		{name: "qwen3 both spellings agree", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"num_local_experts": 128,
			"rope_parameters": map[string]any{"rope_theta": 1e6, "rope_type": "default"}}), want: qwen},
		{name: "model_type only", data: hfcPatch(t, "mixtral_4x.json", map[string]any{"architectures": hfcDelete{}}), want: mixtral},
		{name: "mixtral sliding window covering all positions",
			data: hfcPatch(t, "mixtral_4x.json", map[string]any{"sliding_window": 32768}), want: mixtral},
		{name: "mixtral num_key_value_heads == heads", data: hfcPatch(t, "mixtral_5x.json", map[string]any{"num_key_value_heads": 32}),
			want: with(mixtral, func(c *Config) { c.KVHeads = 32 })},
		{name: "null num_key_value_heads", data: hfcPatch(t, "mixtral_5x.json", map[string]any{"num_key_value_heads": nil}),
			want: with(mixtral, func(c *Config) { c.KVHeads = 32 })},
		{name: "tied embeddings", data: hfcPatch(t, "mixtral_4x.json", map[string]any{"tie_word_embeddings": true}),
			want: with(mixtral, func(c *Config) { c.TieEmbeddings = true })},
		{name: "modelopt nvfp4", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"quantization_config": map[string]any{
			"quant_method": "modelopt", "quant_algo": "NVFP4", "producer": map[string]any{"name": "modelopt"},
			"config_groups": map[string]any{"group_0": map[string]any{"weights": map[string]any{"num_bits": 4, "group_size": 16}}},
			"ignore":        []string{"lm_head", "model.layers.*.mlp.gate"}}}), want: qwen},

		// Rejections.
		{name: "not json", data: []byte("{"), error: []string{"not a JSON object"}},
		{name: "unknown architecture", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"architectures": []string{"LlamaForCausalLM"}}),
			error: []string{`"LlamaForCausalLM" is not supported`, ArchMixtral, ArchQwen3MoE}},
		{name: "unknown model_type", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"architectures": hfcDelete{}, "model_type": "deepseek_v3"}),
			error: []string{`model_type "deepseek_v3" is not supported`}},
		{name: "no architecture", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"architectures": hfcDelete{}, "model_type": hfcDelete{}}),
			error: []string{"neither architectures nor model_type"}},
		{name: "two architectures", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"architectures": []string{ArchQwen3MoE, ArchMixtral}}),
			error: []string{"want exactly one"}},
		{name: "model_type mismatch", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"model_type": "mixtral"}),
			error: []string{`model_type "mixtral" does not match`}},
		{name: "missing fields", data: hfcPatch(t, "qwen3_moe_5x.json", map[string]any{"hidden_size": hfcDelete{}, "num_local_experts": hfcDelete{},
			"num_key_value_heads": hfcDelete{}}),
			error: []string{"hidden_size is missing", "num_experts / num_local_experts is missing", "num_key_value_heads is missing"}},
		{name: "wrong type", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"num_hidden_layers": "48"}),
			error: []string{`num_hidden_layers = "48": want an integer`}},
		{name: "expert counts disagree", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"num_local_experts": 64}),
			error: []string{"num_experts = 128 and num_local_experts = 64 disagree"}},
		{name: "decoder_sparse_step", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"decoder_sparse_step": 2}),
			error: []string{"decoder_sparse_step 2"}},
		{name: "mlp_only_layers", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"mlp_only_layers": []int{0, 47}}),
			error: []string{"mlp_only_layers [0 47]"}},
		{name: "use_sliding_window", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"use_sliding_window": true, "sliding_window": 4096}),
			error: []string{"use_sliding_window true"}},
		{name: "attention_bias", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"attention_bias": true}),
			error: []string{"attention_bias true"}},
		{name: "rope_scaling", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"rope_scaling": map[string]any{"rope_type": "yarn", "factor": 4}}),
			error: []string{"rope_scaling", "only default RoPE"}},
		{name: "rope_parameters yarn", data: hfcPatch(t, "qwen3_moe_5x.json", map[string]any{"rope_parameters": map[string]any{
			"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}),
			error: []string{`rope_parameters.rope_type "yarn"`, "rope_parameters.factor"}},
		{name: "rope thetas disagree", data: hfcPatch(t, "qwen3_moe_5x.json", map[string]any{"rope_theta": 10000}),
			error: []string{"rope_theta 10000 and rope_parameters.rope_theta 1e+06 disagree"}},
		{name: "hidden_act gelu", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"hidden_act": "gelu"}),
			error: []string{`hidden_act "gelu"`}},
		{name: "hidden_act relu2 alone is gated", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"hidden_act": "relu2"}),
			error: []string{"hidden_act relu2 without expert_activation", "gated"}},
		{name: "relu2 with silu", data: hfcPatch(t, "qwen3_moe_relu2.json", map[string]any{"hidden_act": "silu"}),
			error: []string{`expert_activation "relu2" with hidden_act "silu"`}},
		{name: "unknown expert_activation", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"expert_activation": "geglu"}),
			error: []string{`expert_activation "geglu"`}},
		{name: "mixtral sliding window", data: hfcPatch(t, "mixtral_4x.json", map[string]any{"sliding_window": 4096}),
			error: []string{"sliding_window 4096 < max_position_embeddings 32768"}},
		{name: "float16 checkpoint", data: hfcPatch(t, "mixtral_4x.json", map[string]any{"torch_dtype": "float16"}),
			error: []string{`torch_dtype "float16"`, "bfloat16"}},
		{name: "float32 dtype 5.x", data: hfcPatch(t, "mixtral_5x.json", map[string]any{"dtype": "float32"}),
			error: []string{`dtype "float32"`}},
		{name: "quantized fp8", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"quantization_config": map[string]any{"quant_method": "fp8"}}),
			error: []string{"quantization_config", "only ModelOpt NVFP4 checkpoints"}},
		{name: "modelopt fp8", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"quantization_config": map[string]any{"quant_method": "modelopt", "quant_algo": "FP8"}}),
			error: []string{"only ModelOpt NVFP4 checkpoints"}},
		{name: "compressed-tensors nvfp4", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"quantization_config": map[string]any{"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}}),
			error: []string{"only ModelOpt NVFP4 checkpoints"}},
		{name: "nvfp4 group of 32", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"quantization_config": map[string]any{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}}),
			error: []string{"group_size 32: NVFP4 blocks are 16 elements"}},
		{name: "eos string", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"eos_token_id": "</s>"}),
			error: []string{"eos_token_id"}},
		{name: "validate", data: hfcPatch(t, "qwen3_moe_4x.json", map[string]any{"num_key_value_heads": 5}),
			error: []string{"32 query heads do not group over 5 kv heads"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseConfig(tc.data)
			if len(tc.error) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				if !reflect.DeepEqual(got, tc.want) {
					t.Errorf("got  %+v\nwant %+v", got, tc.want)
				}
				return
			}
			if err == nil {
				t.Fatalf("parsed as %+v, want an error", got)
			}
			if !strings.HasPrefix(err.Error(), "policy: config: ") {
				t.Errorf("error %q lacks the operation prefix", err)
			}
			for _, s := range tc.error {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q lacks %q", err, s)
				}
			}
		})
	}
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	if _, err := LoadConfig(dir); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Errorf("LoadConfig of an empty directory: %v, want an error naming config.json", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), hfcPatch(t, "mixtral_4x.json", map[string]any{"hidden_act": "gelu"}), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(dir); err == nil || !strings.Contains(err.Error(), filepath.Join(dir, "config.json")) {
		t.Errorf("LoadConfig of a bad config: %v, want an error naming the file", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), hfcFixture(t, "mixtral_5x.json"), 0o644); err != nil {
		t.Fatal(err)
	}
	if c, err := LoadConfig(dir); err != nil || c.Architecture != ArchMixtral {
		t.Errorf("LoadConfig: %+v, %v", c, err)
	}
}

// TestConfigJSONRoundTrip checks that every preset, in both activations,
// survives config.json.
func TestConfigJSONRoundTrip(t *testing.T) {
	for _, name := range PresetNames() {
		for _, act := range []moe.Activation{moe.SwiGLU, moe.ReLU2} {
			t.Run(name+"/"+string(act), func(t *testing.T) {
				cfg, err := Preset(name)
				if err != nil {
					t.Fatal(err)
				}
				cfg.Activation = act
				js, err := checkedConfigJSON(cfg)
				if err != nil {
					t.Fatal(err)
				}
				var m map[string]any
				if err := json.Unmarshal(js, &m); err != nil {
					t.Fatal(err)
				}
				// The transformers 5.x spellings.
				for _, k := range []string{"rope_parameters", "dtype", "num_local_experts"} {
					if _, ok := m[k]; !ok {
						t.Errorf("config.json lacks %q", k)
					}
				}
				if act == moe.ReLU2 && m[ExpertActivationKey] != "relu2" {
					t.Errorf("relu2 config.json has %s = %v", ExpertActivationKey, m[ExpertActivationKey])
				}
			})
		}
	}
	cfg, _ := Preset("tiny")
	cfg.QKNorm = false
	if _, err := checkedConfigJSON(cfg); err == nil {
		t.Error("Qwen3-MoE without q/k norm was written; it cannot be read back as such")
	}
	cfg.Architecture = "LlamaForCausalLM"
	if _, err := checkedConfigJSON(cfg); err == nil || !strings.Contains(err.Error(), "not supported") {
		t.Errorf("unsupported architecture: %v", err)
	}
}
