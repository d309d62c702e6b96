package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCalibrate calibrates the reference checkpoint over its sequences,
// reads the scales back through score --recipe per_tensor and checks that
// per_tensor scores the sequences about as well as per_token does, against
// transformers' float32 logprobs.
func TestCalibrate(t *testing.T) {
	dir := filepath.Join("..", "..", "policy", "testdata", "reference", "qwen3_moe")
	raw, err := os.ReadFile(filepath.Join(dir, "reference.json"))
	if err != nil {
		t.Fatal(err)
	}
	var ref struct {
		Sequences [][]int32    `json:"sequences"`
		FP32      [][]*float64 `json:"logprobs_fp32"`
	}
	if err := json.Unmarshal(raw, &ref); err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	tokens, scales := filepath.Join(tmp, "tokens.json"), filepath.Join(tmp, "scales.safetensors")
	in, _ := json.Marshal(map[string]any{"sequences": ref.Sequences})
	if err := os.WriteFile(tokens, in, 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"calibrate", "--model", dir, "--tokens", tokens, "--out", scales}, &stdout, &stderr); code != 0 {
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
	meanErr := func(args ...string) float64 {
		t.Helper()
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), append([]string{"score", "--model", dir, "--tokens", tokens}, args...), &stdout, &stderr); code != 0 {
			t.Fatalf("score %v: exit %d: %s", args, code, stderr.String())
		}
		var out struct {
			LogProbs [][]*float64 `json:"logprobs"`
		}
		if err := json.Unmarshal(stdout.Bytes(), &out); err != nil {
			t.Fatal(err)
		}
		var sum float64
		var n int
		for i, row := range out.LogProbs {
			for j := 1; j < len(row); j++ {
				sum += math.Abs(*row[j] - *ref.FP32[i][j])
				n++
			}
		}
		return sum / float64(n)
	}
	pt, ps := meanErr("--recipe", "nvfp4"), meanErr("--recipe", "per_tensor", "--input-scales", scales)
	t.Logf("mean |logprob - transformers fp32|: per_token %.4f, per_tensor %.4f", pt, ps)
	if ps > 1.5*pt+0.02 {
		t.Fatalf("per_tensor mean error %.4f, per_token %.4f: calibrated scales should do about as well", ps, pt)
	}
	var e bytes.Buffer
	if code := run(context.Background(), []string{"calibrate", "--model", dir, "--tokens", tokens}, &stdout, &e); code != 2 || !strings.Contains(e.String(), "--out are required") {
		t.Fatalf("calibrate without --out: exit %d, %s", code, e.String())
	}
}
