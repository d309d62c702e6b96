package main

import (
	"bytes"
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
)

// TestCalibrate calibrates the reference checkpoint over its sequences,
// reads the scales back through score --recipe per_tensor and checks that
// per_tensor scores the sequences about as well as per_token does, against
// transformers' float32 logprobs.
func TestCalibrate(t *testing.T) {
	ref := loadReference(t)
	scales := filepath.Join(t.TempDir(), "scales.safetensors")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"calibrate", "--model", ref.dir, "--tokens", ref.tokens, "--out", scales}, &stdout, &stderr); code != 0 {
		t.Fatalf("calibrate: exit %d: %s", code, stderr.String())
	}
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
	if code := run(context.Background(), []string{"calibrate", "--model", ref.dir, "--tokens", ref.tokens}, &stdout, &e); code != 2 || !strings.Contains(e.String(), "--out are required") {
		t.Fatalf("calibrate without --out: exit %d, %s", code, e.String())
	}
}
