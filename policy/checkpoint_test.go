package policy

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy/policytest"
)

// ckptOptions are the smallest run-time sizes a model can be built with:
// loading does not depend on them.
func ckptOptions(recipe moe.Recipe) ModelOptions {
	return ModelOptions{Recipe: recipe, MaxTokens: 16, MaxSeqs: 2, KVPages: 4, PageSize: 16}
}

// countingBackend counts live allocations, to check that failed loads free
// everything.
type countingBackend struct {
	kernels.Backend
	live int
}

func (b *countingBackend) Alloc(dt kernels.DType, shape ...int) (*kernels.Buffer, error) {
	buf, err := b.Backend.Alloc(dt, shape...)
	if err == nil {
		b.live++
	}
	return buf, err
}

func (b *countingBackend) Free(buf *kernels.Buffer) error {
	b.live--
	return b.Backend.Free(buf)
}

func ckptBackend(t *testing.T) *countingBackend {
	t.Helper()
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &countingBackend{Backend: be}
}

// ckptPreset returns a preset with the given activation.
func ckptPreset(t *testing.T, name string, act moe.Activation) Config {
	t.Helper()
	cfg, err := Preset(name)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Activation = act
	return cfg
}

// ckptWrite writes a random model directory and returns it.
func ckptWrite(t *testing.T, cfg Config, seed uint64, layout randomLayout) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	if err := writeRandomModel(dir, cfg, seed, layout); err != nil {
		t.Fatal(err)
	}
	return dir
}

// ckptLoad loads dir and closes the model when the test ends.
func ckptLoad(t *testing.T, dir string, recipe moe.Recipe) *Model {
	t.Helper()
	m, err := LoadModel(ckptBackend(t), dir, ckptOptions(recipe))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Error(err)
		}
	})
	return m
}

// download returns the bytes of a target.
func ckptDownload(t *testing.T, m *Model, tg Target) []byte {
	t.Helper()
	out := make([]byte, tg.Size())
	if err := m.Backend().Download(out, tg.Buffer, tg.Offset); err != nil {
		t.Fatal(err)
	}
	return out
}

// checkFiles checks that every tensor of the checkpoint's files is in m,
// byte for byte, and returns how many tensors it compared.
func ckptCheckFiles(t *testing.T, m *Model, dir string) int {
	t.Helper()
	paths, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
	n := 0
	for _, p := range paths {
		f, err := stfile.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range f.Names() {
			tensor, _ := f.Tensor(name)
			tg, err := m.Resolve(name)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(ckptDownload(t, m, tg), tensor.Data) {
				t.Errorf("%s: the model does not hold the written bytes", name)
			}
			n++
		}
		f.Close()
	}
	return n
}

func TestLoadRandomModel(t *testing.T) {
	tests := []struct {
		name    string
		preset  string
		act     moe.Activation
		layout  randomLayout
		recipe  moe.Recipe
		tie     bool
		tensors int // in the files
	}{
		{name: "qwen3 swiglu", preset: "tiny", act: moe.SwiGLU, recipe: moe.RecipeBF16, tensors: 1 + 2*(9+3*8) + 2},
		{name: "qwen3 swiglu nvfp4", preset: "tiny", act: moe.SwiGLU, recipe: moe.RecipePerToken, tensors: 1 + 2*(9+3*8) + 2},
		{name: "qwen3 relu2 tied", preset: "tiny", act: moe.ReLU2, recipe: moe.RecipeBF16, tie: true, tensors: 1 + 2*(9+2*8) + 1},
		{name: "qwen3 fused", preset: "tiny", act: moe.SwiGLU, layout: randomLayout{fused: true}, recipe: moe.RecipeBF16, tensors: 1 + 2*(9+2) + 2},
		{name: "qwen3 relu2 fused", preset: "tiny", act: moe.ReLU2, layout: randomLayout{fused: true}, recipe: moe.RecipeBF16, tensors: 1 + 2*(9+2) + 2},
		{name: "qwen3 sharded", preset: "tiny", act: moe.SwiGLU, layout: randomLayout{shards: 2}, recipe: moe.RecipeBF16, tensors: 1 + 2*(9+3*8) + 2},
		{name: "mixtral swiglu", preset: "tiny-mixtral", act: moe.SwiGLU, recipe: moe.RecipeBF16, tensors: 1 + 2*(7+3*8) + 2},
		{name: "mixtral relu2", preset: "tiny-mixtral", act: moe.ReLU2, recipe: moe.RecipeBF16, tensors: 1 + 2*(7+2*8) + 2},
		{name: "mixtral fused sharded", preset: "tiny-mixtral", act: moe.SwiGLU, layout: randomLayout{fused: true, shards: 3},
			recipe: moe.RecipeBF16, tensors: 1 + 2*(7+2) + 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ckptPreset(t, tc.preset, tc.act)
			cfg.TieEmbeddings = tc.tie
			dir := ckptWrite(t, cfg, 42, tc.layout)
			m := ckptLoad(t, dir, tc.recipe)
			if got := m.Config(); !slices.Equal(got.EOSTokenIDs, cfg.EOSTokenIDs) || got.Architecture != cfg.Architecture ||
				got.Activation != cfg.Activation || got.TieEmbeddings != cfg.TieEmbeddings {
				t.Errorf("loaded config %+v, wrote %+v", got, cfg)
			}
			if n := ckptCheckFiles(t, m, dir); n != tc.tensors {
				t.Errorf("compared %d tensors, want %d", n, tc.tensors)
			}
			if tc.layout == (randomLayout{}) {
				return
			}
			// Values depend on (seed, name) only: the plain per-expert
			// layout must load into the same weights.
			ref := ckptLoad(t, ckptWrite(t, cfg, 42, randomLayout{}), tc.recipe)
			targets, err := m.Tensors()
			if err != nil {
				t.Fatal(err)
			}
			refTargets, _ := ref.Tensors()
			for i, tg := range targets {
				if !bytes.Equal(ckptDownload(t, m, tg), ckptDownload(t, ref, refTargets[i])) {
					t.Errorf("%s differs from the per-expert layout", tg.Name)
				}
			}
		})
	}
}

// TestFusedLayout checks the fused expert layout byte by byte: gate_up_proj
// [E, 2I, H] is each expert's gate rows, then its up rows.
func TestFusedLayout(t *testing.T) {
	cfg := ckptPreset(t, "tiny", moe.SwiGLU)
	fused := randomTensors(cfg, 7, true)
	per := randomTensors(cfg, 7, false)
	byName := map[string][]byte{}
	for _, tensor := range per {
		byName[tensor.Name] = tensor.Data
	}
	I, H := cfg.MoEIntermediate, cfg.Hidden
	for _, tensor := range fused {
		if tensor.Name != "model.layers.1.mlp.experts.gate_up_proj" {
			continue
		}
		if want := []uint64{8, 64, 64}; !slices.Equal(tensor.Shape, want) {
			t.Fatalf("shape %v, want %v", tensor.Shape, want)
		}
		for e := range cfg.Experts {
			block := tensor.Data[e*2*I*H*2 : (e+1)*2*I*H*2]
			p := "model.layers.1.mlp.experts." + strconv.Itoa(e) + "."
			if !bytes.Equal(block[:I*H*2], byName[p+"gate_proj.weight"]) || !bytes.Equal(block[I*H*2:], byName[p+"up_proj.weight"]) {
				t.Errorf("expert %d: block is not [gate; up]", e)
			}
		}
		return
	}
	t.Fatal("no fused gate_up_proj for layer 1")
}

func TestWriteRandomModelDeterministic(t *testing.T) {
	cfg := ckptPreset(t, "tiny", moe.SwiGLU)
	read := func(dir string) []byte {
		data, err := os.ReadFile(filepath.Join(dir, SingleFileName))
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	a, b, c := ckptWrite(t, cfg, 1, randomLayout{}), ckptWrite(t, cfg, 1, randomLayout{}), ckptWrite(t, cfg, 2, randomLayout{})
	if !bytes.Equal(read(a), read(b)) {
		t.Error("the same seed wrote different checkpoints")
	}
	if bytes.Equal(read(a), read(c)) {
		t.Error("different seeds wrote the same checkpoint")
	}
	// Weights keep activations O(1): matrices have std 1/sqrt(fan_in).
	for _, tensor := range randomTensors(cfg, 1, false) {
		if tensor.Name != "model.layers.0.mlp.experts.0.down_proj.weight" {
			continue
		}
		vals := make([]float32, len(tensor.Data)/2)
		bf16.Decode(vals, tensor.Data)
		var ss float64
		for _, v := range vals {
			ss += float64(v) * float64(v)
		}
		if std, want := math.Sqrt(ss/float64(len(vals))), 1/math.Sqrt(32); math.Abs(std-want) > 0.1*want {
			t.Errorf("down_proj std %.4f, want about %.4f", std, want)
		}
	}
}

// rewrite replaces model.safetensors in dir with edit applied to its tensors.
func ckptRewrite(t *testing.T, dir string, edit func([]stfile.Tensor) []stfile.Tensor) {
	t.Helper()
	err := policytest.Rewrite(filepath.Join(dir, SingleFileName), func(ts []stfile.Tensor) ([]stfile.Tensor, error) { return edit(ts), nil })
	if err != nil {
		t.Fatal(err)
	}
}

func ckptWithout(names ...string) func([]stfile.Tensor) []stfile.Tensor {
	return func(ts []stfile.Tensor) []stfile.Tensor {
		return slices.DeleteFunc(ts, func(x stfile.Tensor) bool { return slices.Contains(names, x.Name) })
	}
}

func ckptWith(extra ...stfile.Tensor) func([]stfile.Tensor) []stfile.Tensor {
	return func(ts []stfile.Tensor) []stfile.Tensor { return append(ts, extra...) }
}

func ckptReplace(name string, f func(stfile.Tensor) stfile.Tensor) func([]stfile.Tensor) []stfile.Tensor {
	return func(ts []stfile.Tensor) []stfile.Tensor {
		for i := range ts {
			if ts[i].Name == name {
				ts[i] = f(ts[i])
			}
		}
		return ts
	}
}

func ckptZeros(name string, shape ...uint64) stfile.Tensor {
	n := uint64(2)
	for _, d := range shape {
		n *= d
	}
	return stfile.Tensor{Name: name, DType: stfile.BF16, Shape: shape, Data: make([]byte, n)}
}

func ckptSetElement(i int, v float32) func(stfile.Tensor) stfile.Tensor {
	return func(x stfile.Tensor) stfile.Tensor {
		binary.LittleEndian.PutUint16(x.Data[2*i:], bf16.FromFloat32(v))
		return x
	}
}

func TestLoadCheckpointErrors(t *testing.T) {
	const (
		q     = "model.layers.0.self_attn.q_proj.weight"
		up3   = "model.layers.1.mlp.experts.3.up_proj.weight"
		down5 = "model.layers.0.mlp.experts.5.down_proj.weight"
		oProj = "model.layers.1.self_attn.o_proj"
	)
	tests := []struct {
		name  string
		edit  func(dir string) // changes the written tiny model
		kinds map[string][]string
	}{
		{name: "missing tensor", edit: func(dir string) { ckptRewrite(t, dir, ckptWithout(up3, "model.norm.weight")) },
			kinds: map[string][]string{"Missing": {up3, "model.norm.weight"}}},
		{name: "missing layer is capped", edit: func(dir string) {
			ckptRewrite(t, dir, func(ts []stfile.Tensor) []stfile.Tensor {
				return slices.DeleteFunc(ts, func(x stfile.Tensor) bool { return strings.HasPrefix(x.Name, "model.layers.1.") })
			})
		}, kinds: map[string][]string{"Missing": {"missing (33):", "... and 13 more"}}},
		{name: "unexpected tensors", edit: func(dir string) {
			ckptRewrite(t, dir, ckptWith(ckptZeros("model.layers.2.self_attn.q_proj.weight", 64, 64), ckptZeros("model.rotary.inv_freq", 8),
				ckptZeros("model.layers.0.mlp.experts.8.up_proj.weight", 32, 64)))
		}, kinds: map[string][]string{"Unexpected": {"model.layers.2.self_attn.q_proj.weight", "no layer 2 (the model has 2)",
			"model.rotary.inv_freq", "no expert 8"}}},
		{name: "misshapen", edit: func(dir string) {
			ckptRewrite(t, dir, ckptReplace(q, func(stfile.Tensor) stfile.Tensor { return ckptZeros(q, 32, 64) }))
		}, kinds: map[string][]string{"Misshapen": {q, "shape [32 64], want [64 64]"}}},
		{name: "f32 dtype", edit: func(dir string) {
			ckptRewrite(t, dir, ckptReplace("model.norm.weight", func(x stfile.Tensor) stfile.Tensor {
				return stfile.Tensor{Name: x.Name, DType: stfile.F32, Shape: x.Shape, Data: make([]byte, 4*64)}
			}))
		}, kinds: map[string][]string{"DType": {"model.norm.weight", "F32, want BF16"}}},
		{name: "nan and inf", edit: func(dir string) {
			ckptRewrite(t, dir, func(ts []stfile.Tensor) []stfile.Tensor {
				ts = ckptReplace(down5, ckptSetElement(32*3+7, float32(math.NaN())))(ts)
				return ckptReplace(q, ckptSetElement(64*64-1, float32(math.Inf(-1))))(ts)
			})
		}, kinds: map[string][]string{"NonFinite": {down5, "NaN at element [3 7]", q, "-Inf at element [63 63]"}}},
		{name: "per-expert and fused", edit: func(dir string) {
			ckptRewrite(t, dir, ckptWith(ckptZeros("model.layers.0.mlp.experts.gate_up_proj", 8, 64, 64)))
		}, kinds: map[string][]string{"Duplicate": {"model.layers.0.mlp.experts.gate_up_proj overlaps model.layers.0.mlp.experts.0.gate_proj.weight, ",
			"and 13 more: 16 tensors written more than once"}}},
		{name: "both router names", edit: func(dir string) {
			ckptRewrite(t, dir, ckptWith(ckptZeros("model.layers.1.block_sparse_moe.gate.weight", 8, 64)))
		}, kinds: map[string][]string{"Duplicate": {"model.layers.1.mlp.gate.weight: written by " +
			"model.layers.1.block_sparse_moe.gate.weight and model.layers.1.mlp.gate.weight"}}},
		{name: "many kinds at once", edit: func(dir string) {
			ckptRewrite(t, dir, func(ts []stfile.Tensor) []stfile.Tensor {
				ts = ckptWithout(up3)(ts)
				ts = ckptWith(ckptZeros("extra", 1))(ts)
				return ckptReplace(q, func(stfile.Tensor) stfile.Tensor { return ckptZeros(q, 64, 63) })(ts)
			})
		}, kinds: map[string][]string{"Missing": {up3}, "Unexpected": {"extra"}, "Misshapen": {q}}},
		{name: "nvfp4: gate and up scales differ", edit: func(dir string) {
			ckptNVFP4(t, dir, ckptPickExperts)
			ckptRewrite(t, dir, ckptReplace("model.layers.1.mlp.experts.2.up_proj.weight_scale_2", func(x stfile.Tensor) stfile.Tensor {
				return ckptScalar(x.Name, 0.125)
			}))
		}, kinds: map[string][]string{"Scales": {"layer 1 expert 2: model.layers.1.mlp.experts.2.gate_proj.weight_scale_2 is",
			"but model.layers.1.mlp.experts.2.up_proj.weight_scale_2 is 0.125", "one FC1 matrix with one global scale"}}},
		{name: "nvfp4: an expert half quantized", edit: func(dir string) {
			ckptNVFP4(t, dir, func(name string) bool { return name == up3 })
		}, kinds: map[string][]string{"Scales": {"layer 1 expert 3: model.layers.1.mlp.experts.3.up_proj is NVFP4 but model.layers.1.mlp.experts.3.gate_proj.weight is BF16",
			"input_scale: layer 0 has no gate_proj, up_proj, w1 or w3 input_scale (a checkpoint with input scales has them for every layer)"}}},
		{name: "nvfp4: broken parts", edit: func(dir string) {
			ckptNVFP4(t, dir, ckptPickExperts)
			ckptRewrite(t, dir, func(ts []stfile.Tensor) []stfile.Tensor {
				ts = ckptWithout("model.layers.0.mlp.experts.1.down_proj.weight_scale_2")(ts)
				ts = ckptReplace("model.layers.0.mlp.experts.4.down_proj.weight_scale", func(x stfile.Tensor) stfile.Tensor {
					x.Data[5] = 0x7f
					return x
				})(ts)
				ts = ckptReplace(oProj+".weight_scale", func(x stfile.Tensor) stfile.Tensor { x.DType = stfile.U8; return x })(ts)
				ts = ckptReplace("model.layers.0.mlp.experts.6.gate_proj.weight", func(x stfile.Tensor) stfile.Tensor {
					x.Shape, x.Data = []uint64{32, 16}, x.Data[:32*16]
					return x
				})(ts)
				ts = ckptReplace("model.layers.0.mlp.experts.7.gate_proj.input_scale", func(x stfile.Tensor) stfile.Tensor { return ckptScalar(x.Name, -1) })(ts)
				return ckptWith(ckptScalar("model.layers.0.self_attn.q_proj.weight_scale_2", 1))(ts)
			})
		}, kinds: map[string][]string{
			"Missing":   {"model.layers.0.mlp.experts.1.down_proj.weight_scale_2: NVFP4 module", "model.layers.0.self_attn.q_proj.weight as U8 codes"},
			"NonFinite": {"model.layers.0.mlp.experts.4.down_proj.weight_scale (in model.safetensors): NaN (0x7f) at element [2 1]"},
			"DType":     {oProj + ".weight_scale (in model.safetensors): U8, want F8_E4M3"},
			"Misshapen": {"model.layers.0.mlp.experts.6.gate_proj.weight (in model.safetensors): shape [32 16], want [32 32]"},
			"Scales":    {"model.layers.0.mlp.experts.7.gate_proj.input_scale is -1, want a positive finite scale (in model.safetensors)"}}},
		{name: "sharded: missing shard", edit: func(dir string) {
			if err := os.Remove(filepath.Join(dir, "model-00002-of-00002.safetensors")); err != nil {
				t.Fatal(err)
			}
		}, kinds: map[string][]string{"Files": {"shard model-00002-of-00002.safetensors", "no such file"}, "Missing": {"lm_head.weight"}}},
		{name: "sharded: index disagrees", edit: func(dir string) {
			path := filepath.Join(dir, IndexFileName)
			data, _ := os.ReadFile(path)
			var index map[string]map[string]any
			if err := json.Unmarshal(data, &index); err != nil {
				t.Fatal(err)
			}
			index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
			index["weight_map"]["model.ghost.weight"] = "model-00002-of-00002.safetensors"
			data, _ = json.Marshal(index)
			if err := os.WriteFile(path, data, 0o644); err != nil {
				t.Fatal(err)
			}
		}, kinds: map[string][]string{"Files": {
			"puts model.norm.weight in model-00001-of-00002.safetensors, which does not hold it",
			"model-00002-of-00002.safetensors holds model.norm.weight, but " + IndexFileName + " puts it in model-00001-of-00002.safetensors",
			"puts model.ghost.weight in model-00002-of-00002.safetensors"}, "Missing": {"model.norm.weight"}}},
		{name: "sharded: shard outside the directory", edit: func(dir string) {
			data := []byte(`{"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}`)
			if err := os.WriteFile(filepath.Join(dir, IndexFileName), data, 0o644); err != nil {
				t.Fatal(err)
			}
		}, kinds: map[string][]string{"Files": {`"../elsewhere.safetensors"`, "not a file in the model directory"},
			"Missing": {"model.embed_tokens.weight"}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			layout := randomLayout{}
			if strings.HasPrefix(tc.name, "sharded") {
				layout.shards = 2
			}
			cfg := ckptPreset(t, "tiny", moe.SwiGLU)
			dir := ckptWrite(t, cfg, 3, layout)
			tc.edit(dir)

			be := ckptBackend(t)
			m, err := NewModel(be, cfg, ckptOptions(moe.RecipeBF16))
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			err = LoadCheckpoint(m, dir)
			var ce *CheckpointError
			if !errors.As(err, &ce) {
				t.Fatalf("LoadCheckpoint: %v, want a *CheckpointError", err)
			}
			msg := err.Error()
			if !strings.HasPrefix(msg, "policy: load "+dir+": ") {
				t.Errorf("error lacks the operation: %s", msg)
			}
			lists := map[string][]string{"Files": ce.Files, "Unexpected": ce.Unexpected, "DType": ce.DType,
				"Misshapen": ce.Misshapen, "NonFinite": ce.NonFinite, "Duplicate": ce.Duplicate, "Missing": ce.Missing, "Scales": ce.Scales}
			for kind, list := range lists {
				if _, want := tc.kinds[kind]; !want && len(list) > 0 {
					t.Errorf("unexpected %s problems: %q", kind, list)
				}
				if _, want := tc.kinds[kind]; want && len(list) == 0 {
					t.Errorf("no %s problems", kind)
				}
			}
			for _, subs := range tc.kinds {
				for _, s := range subs {
					if !strings.Contains(msg, s) {
						t.Errorf("error lacks %q:\n%s", s, msg)
					}
				}
			}
			// Nothing was uploaded: the weights are still zero.
			targets, _ := m.Tensors()
			if got := ckptDownload(t, m, targets[0]); !bytes.Equal(got, make([]byte, len(got))) {
				t.Error("a failed load changed the model's weights")
			}

			// LoadModel reports the same and frees everything.
			be2 := ckptBackend(t)
			if _, err := LoadModel(be2, dir, ckptOptions(moe.RecipeBF16)); !errors.As(err, &ce) {
				t.Errorf("LoadModel: %v, want a *CheckpointError", err)
			}
			if be2.live != 0 {
				t.Errorf("LoadModel left %d buffers allocated", be2.live)
			}
		})
	}
}

func TestLoadCheckpointNoFiles(t *testing.T) {
	cfg := ckptPreset(t, "tiny", moe.SwiGLU)
	tests := []struct {
		name  string
		setup func(dir string)
		want  string
	}{
		{name: "no checkpoint", setup: func(string) {}, want: "no model.safetensors or model.safetensors.index.json"},
		{name: "bad index", setup: func(dir string) {
			os.WriteFile(filepath.Join(dir, IndexFileName), []byte("[]"), 0o644)
		}, want: IndexFileName},
		{name: "empty weight map", setup: func(dir string) {
			os.WriteFile(filepath.Join(dir, IndexFileName), []byte(`{"metadata": {}}`), 0o644)
		}, want: "empty or missing weight_map"},
		{name: "truncated file", setup: func(dir string) {
			os.WriteFile(filepath.Join(dir, SingleFileName), []byte{1, 2, 3}, 0o644)
		}, want: "malformed safetensors"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			tc.setup(dir)
			m, err := NewModel(ckptBackend(t), cfg, ckptOptions(moe.RecipeBF16))
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			err = LoadCheckpoint(m, dir)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "policy: load ") {
				t.Errorf("LoadCheckpoint: %v, want an error with %q", err, tc.want)
			}
		})
	}
	be := ckptBackend(t)
	if _, err := LoadModel(be, t.TempDir(), ckptOptions(moe.RecipeBF16)); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Errorf("LoadModel without config.json: %v", err)
	}
}

func TestPreset(t *testing.T) {
	for _, name := range PresetNames() {
		cfg, err := Preset(name)
		if err != nil {
			t.Fatal(err)
		}
		if err := cfg.Validate(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		if cfg.Hidden%16 != 0 || cfg.MoEIntermediate%16 != 0 {
			t.Errorf("%s: widths %d, %d are not NVFP4 blocks", name, cfg.Hidden, cfg.MoEIntermediate)
		}
	}
	if _, err := Preset("huge"); err == nil || !strings.Contains(err.Error(), "tiny") {
		t.Errorf("unknown preset: %v", err)
	}
	a, _ := Preset("tiny")
	a.EOSTokenIDs[0] = 99
	if b, _ := Preset("tiny"); b.EOSTokenIDs[0] == 99 {
		t.Error("Preset shares its slices")
	}
}
