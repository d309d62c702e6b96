package policy

import (
	"bytes"
	"encoding/binary"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy/policytest"
)

// ckptInputScale is the input_scale the NVFP4 fixture gives an expert
// module: distinct per layer, expert and projection, so that a layer's
// scale is the maximum over its experts.
func ckptInputScale(module string) float32 {
	if !strings.Contains(module, ".experts.") {
		return 0
	}
	var h uint32 = 2166136261
	for _, c := range []byte(module) {
		h = (h ^ uint32(c)) * 16777619
	}
	return float32(1+h%1000) / 4096
}

// ckptNVFP4 rewrites the checkpoint in dir as a ModelOpt NVFP4 export of
// the weights pick selects, global scales 1.5 times this worker's recipe's
// (so the codes and scales are not what a requantization of the
// dequantized weights gives), experts with input scales.
func ckptNVFP4(t *testing.T, dir string, pick func(name string) bool) {
	t.Helper()
	if err := policytest.ExportNVFP4(dir, policytest.NVFP4Export{Pick: pick, Headroom: 1.5, InputScale: ckptInputScale}); err != nil {
		t.Fatal(err)
	}
}

func ckptScalar(name string, v float32) stfile.Tensor { return policytest.Scalar(name, v) }

// ckptPickExperts selects every expert weight and one attention projection.
func ckptPickExperts(name string) bool {
	return strings.Contains(name, ".experts.") || name == "model.layers.1.self_attn.o_proj.weight"
}

// TestLoadNVFP4Checkpoint loads ModelOpt NVFP4 exports of random models:
// each quantized module's BF16 place holds its dequantization, rounded to
// BF16; the experts' NVFP4 copies hold the checkpoint's codes, block scales
// and global scales byte for byte (not a requantization, which the test
// shows differs); the other tensors load as written; and under per_tensor
// the experts' input scales set the layers' (their maximum per layer). It
// runs on the engine tests' backend (the GPU in TestGPUEngine).
func TestLoadNVFP4Checkpoint(t *testing.T) {
	tests := []struct {
		name   string
		preset string
		act    moe.Activation
		recipe moe.Recipe
	}{
		{"qwen3 swiglu nvfp4", "tiny", moe.SwiGLU, moe.RecipePerToken},
		{"qwen3 swiglu per_tensor", "tiny", moe.SwiGLU, moe.RecipePerTensor},
		{"qwen3 relu2 nvfp4", "tiny", moe.ReLU2, moe.RecipePerToken},
		{"qwen3 swiglu bf16", "tiny", moe.SwiGLU, moe.RecipeBF16},
		{"mixtral swiglu unit_scale", "tiny-mixtral", moe.SwiGLU, moe.RecipeUnitScale},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ckptPreset(t, tc.preset, tc.act)
			dir := ckptWrite(t, cfg, 7, randomLayout{})
			ckptNVFP4(t, dir, ckptPickExperts)
			m, err := LoadModel(testBackend(t), dir, ckptOptions(tc.recipe))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := m.Close(); err != nil {
					t.Error(err)
				}
			})

			f, err := stfile.Open(dir + "/" + SingleFileName)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			tensor := func(name string) stfile.Tensor {
				t.Helper()
				x, err := f.Tensor(name)
				if err != nil {
					t.Fatal(err)
				}
				return x
			}
			scalar := func(name string) float32 {
				return math.Float32frombits(binary.LittleEndian.Uint32(tensor(name).Data))
			}
			wantScales := make([]InputScales, cfg.Layers)
			copies := 0
			for _, name := range f.Names() {
				mod, ok := strings.CutSuffix(name, ".weight_scale_2")
				if !ok {
					if !quantPart.MatchString(name) && !strings.HasSuffix(name, ".weight_scale") {
						if x := tensor(name); x.DType == stfile.BF16 {
							tg, err := m.Resolve(name)
							if err != nil {
								t.Fatal(err)
							}
							if !bytes.Equal(ckptDownload(t, m, tg), x.Data) {
								t.Errorf("%s: the model does not hold the written bytes", name)
							}
						}
					}
					continue
				}
				codes, sf, sdec := tensor(mod+".weight"), tensor(mod+".weight_scale"), scalar(name)
				tg, err := m.Resolve(mod + ".weight")
				if err != nil {
					t.Fatal(err)
				}
				N, K := tg.Shape[0], tg.Shape[1]
				want := make([]byte, 0, 2*N*K)
				for r := range N {
					for i := range K {
						c := codes.Data[r*K/2+i/2] >> (4 * (i & 1))
						v := nvfp4.E2M1Decode(c&15) * nvfp4.E4M3Decode(sf.Data[r*K/16+i/16]) * sdec
						want = binary.LittleEndian.AppendUint16(want, bf16.FromFloat32(v))
					}
				}
				if !bytes.Equal(ckptDownload(t, m, tg), want) {
					t.Errorf("%s: the BF16 weights are not the dequantized codes", mod)
				}
				if !tg.IsExpert() {
					continue
				}
				if s := inputScaleName.FindStringSubmatch(mod + ".input_scale"); s != nil {
					v := scalar(mod + ".input_scale")
					if s[3] == "down_proj" || s[3] == "w2" {
						wantScales[tg.Layer].FC2 = max(wantScales[tg.Layer].FC2, v)
					} else {
						wantScales[tg.Layer].FC1 = max(wantScales[tg.Layer].FC1, v)
					}
				}
				l := m.layers[tg.Layer].moe
				fc1, fc2 := l.Quantized()
				q := fc2
				if tg.Buffer == l.FC1() {
					q = fc1
				}
				if q.Packed == nil {
					continue
				}
				r0 := tg.Offset / (2 * K)
				gotCodes, gotSF, gotS := make([]byte, len(codes.Data)), make([]byte, len(sf.Data)), make([]byte, 4)
				be := m.Backend()
				if err := be.Download(gotCodes, q.Packed, r0*K/2); err != nil {
					t.Fatal(err)
				}
				if err := be.Download(gotSF, q.Scales, r0*K/16); err != nil {
					t.Fatal(err)
				}
				if err := be.Download(gotS, q.Scale, 4*tg.Experts[0]); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(gotCodes, codes.Data) || !bytes.Equal(gotSF, sf.Data) || math.Float32frombits(binary.LittleEndian.Uint32(gotS)) != sdec {
					t.Errorf("%s: the NVFP4 copy is not the checkpoint's codes and scales", mod)
				}
				copies++
			}
			quantized := tc.recipe != moe.RecipeBF16
			if wantCopies := cfg.Layers * cfg.Experts * map[bool]int{true: 3, false: 2}[tc.act == moe.SwiGLU]; quantized && copies != wantCopies {
				t.Errorf("compared %d NVFP4 copies, want %d", copies, wantCopies)
			}

			got, ok := m.InputScales()
			switch {
			case tc.recipe == moe.RecipePerTensor && (!ok || !slices.Equal(got, wantScales)):
				t.Errorf("input scales %v (set %v), want the checkpoint's %v", got, ok, wantScales)
			case tc.recipe == moe.RecipePerToken && ok:
				t.Errorf("per_token holds input scales %v", got)
			}

			if !quantized {
				return
			}
			// A requantization (a refit's) rebuilds the copies from the BF16
			// stacks with this worker's recipe: other bytes than the
			// checkpoint's, which the loader therefore did not produce that way.
			q, _ := m.layers[0].moe.Quantized()
			copyBytes := func() []byte {
				var out []byte
				for _, b := range []*kernels.Buffer{q.Packed, q.Scales, q.Scale} {
					x := make([]byte, b.Size())
					if err := m.Backend().Download(x, b, 0); err != nil {
						t.Fatal(err)
					}
					out = append(out, x...)
				}
				return out
			}
			b0 := copyBytes()
			if err := m.Requantize(); err != nil {
				t.Fatal(err)
			}
			b1 := copyBytes()
			if bytes.Equal(b0, b1) {
				t.Error("requantizing the loaded BF16 stacks gives the checkpoint's copy: the test cannot tell them apart")
			}
		})
	}
}
