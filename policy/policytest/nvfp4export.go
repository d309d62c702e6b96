// Package policytest holds fixtures for tests of the policy package and of
// its users: checkpoints in the layouts the loader reads.
package policytest

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
)

// fc1Module maps a gate or up projection's module name to its expert's
// FC1, whose two projections share one global scale.
var fc1Module = regexp.MustCompile(`\.(gate_proj|up_proj|w1|w3)$`)

// NVFP4Export describes how ExportNVFP4 quantizes.
type NVFP4Export struct {
	// Pick selects the 2-D BF16 weights (by tensor name) to quantize.
	Pick func(name string) bool
	// Headroom multiplies each matrix's global decode scale as this
	// worker's recipe derives it from the amax (a calibration with
	// headroom); 1.5 makes codes and scales that a requantization of the
	// dequantized weights does not give back.
	Headroom float32
	// InputScale, when set, gives each quantized expert module (X of
	// X.weight) its input_scale tensor; modules for which it returns 0 get
	// none.
	InputScale func(module string) float32
}

// ExportNVFP4 rewrites the single-file checkpoint (model.safetensors) of
// the model directory dir as a ModelOpt NVFP4 export: each picked weight X
// becomes X.weight (U8 codes), X.weight_scale (F8_E4M3 block scales),
// X.weight_scale_2 (F32 global decode scale) and, where given,
// X.input_scale; a gate and an up projection of one expert share one
// global scale. config.json gains ModelOpt's quantization_config.
func ExportNVFP4(dir string, e NVFP4Export) error {
	path := filepath.Join(dir, "model.safetensors")
	if err := Rewrite(path, func(ts []stfile.Tensor) ([]stfile.Tensor, error) { return exportNVFP4(ts, e) }); err != nil {
		return err
	}
	return addQuantizationConfig(filepath.Join(dir, "config.json"))
}

// Rewrite replaces the safetensors file at path with edit applied to its
// tensors (their data copied out of the file first).
func Rewrite(path string, edit func([]stfile.Tensor) ([]stfile.Tensor, error)) error {
	f, err := stfile.Open(path)
	if err != nil {
		return err
	}
	var ts []stfile.Tensor
	for _, name := range f.Names() {
		t, _ := f.Tensor(name)        // listed by Names: cannot fail
		t.Data = slices.Clone(t.Data) // outlive the mapping
		ts = append(ts, t)
	}
	f.Close()
	ts, err = edit(ts)
	if err != nil {
		return err
	}
	return stfile.Write(path, ts, nil)
}

// exportNVFP4 is ExportNVFP4's rewrite of the tensors.
func exportNVFP4(ts []stfile.Tensor, e NVFP4Export) ([]stfile.Tensor, error) {
	group := func(mod string) string { return fc1Module.ReplaceAllString(mod, ".fc1") }
	values := func(t stfile.Tensor) []uint16 {
		v := make([]uint16, len(t.Data)/2)
		for i := range v {
			v[i] = binary.LittleEndian.Uint16(t.Data[2*i:])
		}
		return v
	}
	amax := map[string]float32{} // by module, or by FC1 for gate and up
	for _, t := range ts {
		if e.Pick(t.Name) {
			if t.DType != stfile.BF16 || len(t.Shape) != 2 {
				return nil, fmt.Errorf("policytest: %s is %s %v: only BF16 matrices are quantized", t.Name, t.DType, t.Shape)
			}
			g := group(strings.TrimSuffix(t.Name, ".weight"))
			amax[g] = max(amax[g], nvfp4.AmaxBF16(values(t)))
		}
	}
	var out []stfile.Tensor
	for _, t := range ts {
		if !e.Pick(t.Name) {
			out = append(out, t)
			continue
		}
		mod := strings.TrimSuffix(t.Name, ".weight")
		N, K := int(t.Shape[0]), int(t.Shape[1])
		kp := nvfp4.PaddedK(K)
		_, sdec := nvfp4.EncodeScale(amax[group(mod)])
		sdec *= e.Headroom
		senc, _ := nvfp4.InputScale(sdec)
		packed, scales := make([]byte, N*kp/2), make([]byte, N*kp/16)
		v := values(t)
		for r := range N {
			if err := nvfp4.QuantizeRow(packed[r*kp/2:(r+1)*kp/2], scales[r*kp/16:(r+1)*kp/16], v[r*K:(r+1)*K], senc, sdec); err != nil {
				return nil, err
			}
		}
		out = append(out,
			stfile.Tensor{Name: mod + ".weight", DType: stfile.U8, Shape: []uint64{uint64(N), uint64(kp / 2)}, Data: packed},
			stfile.Tensor{Name: mod + ".weight_scale", DType: stfile.F8E4M3, Shape: []uint64{uint64(N), uint64(kp / 16)}, Data: scales},
			Scalar(mod+".weight_scale_2", sdec))
		if e.InputScale != nil {
			if s := e.InputScale(mod); s != 0 {
				out = append(out, Scalar(mod+".input_scale", s))
			}
		}
	}
	return out, nil
}

// addQuantizationConfig adds ModelOpt's NVFP4 quantization_config to a
// config.json.
func addQuantizationConfig(path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var cfg map[string]any
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return fmt.Errorf("policytest: %s: %w", path, err)
	}
	cfg["quantization_config"] = map[string]any{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
		"producer": map[string]any{"name": "modelopt"}}
	raw, err = json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, raw, 0o644)
}

// Scalar is an F32 scalar tensor.
func Scalar(name string, v float32) stfile.Tensor {
	return stfile.Tensor{Name: name, DType: stfile.F32, Shape: []uint64{}, Data: binary.LittleEndian.AppendUint32(nil, math.Float32bits(v))}
}
