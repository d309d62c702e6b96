package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/policy/policytest"
)

// calibrate runs rollout-worker calibrate over the reference's sequences
// and returns the scales file and what it printed.
func (r reference) calibrate(t *testing.T) (path string, stdout *bytes.Buffer) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "scales.safetensors")
	var out, stderr bytes.Buffer
	if code := run(context.Background(), []string{"calibrate", "--model", r.dir, "--tokens", r.tokens, "--out", path}, &out, &stderr); code != 0 {
		t.Fatalf("calibrate: exit %d: %s", code, stderr.String())
	}
	return path, &out
}

// TestCalibrate calibrates the reference checkpoint over its sequences,
// reads the scales back through score --recipe per_tensor and checks that
// per_tensor scores the sequences about as well as per_token does, against
// transformers' float32 logprobs.
func TestCalibrate(t *testing.T) {
	ref := loadReference(t)
	scales, stdout := ref.calibrate(t)
	var cal struct {
		Layers []struct {
			FC1 float64 `json:"fc1_input_scale"`
			FC2 float64 `json:"fc2_input_scale"`
		} `json:"layers"`
		Tokens int `json:"tokens"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &cal); err != nil {
		t.Fatalf("%v: %s", err, stdout.String())
	}
	if len(cal.Layers) == 0 || cal.Tokens == 0 {
		t.Fatalf("calibration output %s", stdout.String())
	}
	for i, l := range cal.Layers {
		if !(l.FC1 > 0 && l.FC2 > 0) {
			t.Fatalf("layer %d: scales %+v", i, l)
		}
	}
	pt, ps := ref.scoreError(t, "--recipe", "nvfp4"), ref.scoreError(t, "--recipe", "per_tensor", "--input-scales", scales)
	t.Logf("mean |logprob - transformers fp32|: per_token %.4f, per_tensor %.4f", pt, ps)
	if ps > 1.5*pt+0.02 {
		t.Fatalf("per_tensor mean error %.4f, per_token %.4f: calibrated scales should do about as well", ps, pt)
	}
	var e bytes.Buffer
	if code := run(context.Background(), []string{"calibrate", "--model", ref.dir, "--tokens", ref.tokens}, io.Discard, &e); code != 2 || !strings.Contains(e.String(), "--out are required") {
		t.Fatalf("calibrate without --out: exit %d, %s", code, e.String())
	}
}

// TestScoreNVFP4Checkpoint serves the reference model from a ModelOpt
// NVFP4 export of it: its experts quantized with this worker's recipe and
// the input scales calibrate measured, stored as input_scale tensors.
// score --recipe per_tensor then needs no --input-scales (the checkpoint's
// are taken) and scores as the BF16 checkpoint with the scales file does;
// per_token runs on the export too.
func TestScoreNVFP4Checkpoint(t *testing.T) {
	ref := loadReference(t)
	scales, _ := ref.calibrate(t)
	cfg, err := policy.LoadConfig(ref.dir)
	if err != nil {
		t.Fatal(err)
	}
	layerScales, err := policy.ReadInputScales(scales, cfg.Layers, cfg.Experts)
	if err != nil {
		t.Fatal(err)
	}
	export := ref
	export.dir = filepath.Join(t.TempDir(), "nvfp4")
	if err := os.CopyFS(export.dir, os.DirFS(ref.dir)); err != nil {
		t.Fatal(err)
	}
	module := regexp.MustCompile(`^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate|up|down)_proj$`)
	err = policytest.ExportNVFP4(export.dir, policytest.NVFP4Export{
		Pick:     func(name string) bool { return strings.Contains(name, ".experts.") },
		Headroom: 1,
		InputScale: func(mod string) float32 {
			m := module.FindStringSubmatch(mod)
			if m == nil {
				t.Fatalf("an expert module named %s", mod)
			}
			l, _ := strconv.Atoi(m[1])
			if m[2] == "down" {
				return layerScales[l].FC2
			}
			return layerScales[l].FC1
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	fromFile := ref.scoreError(t, "--recipe", "per_tensor", "--input-scales", scales)
	fromCheckpoint := export.scoreError(t, "--recipe", "per_tensor")
	perToken := export.scoreError(t, "--recipe", "nvfp4")
	t.Logf("mean |logprob - transformers fp32|: per_tensor from the BF16 checkpoint and a scales file %.4f, from the NVFP4 export alone %.4f; per_token on the export %.4f",
		fromFile, fromCheckpoint, perToken)
	// The export's codes are this worker's quantization of the same
	// weights (its scales' last bit aside), so both runs score alike.
	if math.Abs(fromCheckpoint-fromFile) > 0.1*fromFile+0.005 {
		t.Fatalf("per_tensor from the export %.4f, from the BF16 checkpoint and its scales %.4f", fromCheckpoint, fromFile)
	}
	if perToken > 0.25 {
		t.Fatalf("per_token on the export: mean error %.4f", perToken)
	}
}
