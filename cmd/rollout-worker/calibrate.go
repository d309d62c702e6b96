package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

const calibrateUsage = `Usage: rollout-worker calibrate --model DIR --tokens FILE --out FILE [flags]

Run token sequences (JSON {"sequences": [[id, ...], ...]}) through a model
and write the per_tensor recipe's activation scales: for every MoE layer the
S_dec of its experts' FC1 input and FC2 input, from the largest magnitudes
the sequences produced there, as FP32 scalars named the way a ModelOpt NVFP4
checkpoint names them (model.layers.L.mlp.experts.E.{gate_proj,up_proj,
down_proj}.input_scale) in a safetensors file. score --recipe per_tensor
--input-scales FILE reads it. Prints each layer's two scales as JSON.

Flags:
`

func runCalibrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("calibrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), calibrateUsage)
		fs.PrintDefaults()
	}
	dir := fs.String("model", "", "model `directory` (config.json and safetensors; required)")
	tokensPath := fs.String("tokens", "", "JSON `file` with the sequences (required)")
	outPath := fs.String("out", "", "safetensors `file` to write the scales to (required)")
	device := fs.String("device", "auto", "compute device: auto, cpu or cuda")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *dir == "" || *tokensPath == "" || *outPath == "" {
		return usageErrorf("--model, --tokens and --out are required")
	}
	seqs, err := readSequences(*tokensPath)
	if err != nil {
		return err
	}
	be, closeBackend, err := newBackend(*device, nil)
	if err != nil {
		return err
	}
	defer closeBackend()
	m, err := loadScoringModel(be, *dir, moe.RecipePerTensor, seqs)
	if err != nil {
		return err
	}
	defer m.Close()
	scales, err := m.Calibrate(ctx, seqs)
	if err != nil {
		return err
	}
	tokens := 0
	for _, s := range seqs {
		tokens += len(s)
	}
	meta := map[string]string{"producer": "rollout-worker calibrate", "sequences": strconv.Itoa(len(seqs)), "tokens": strconv.Itoa(tokens)}
	if err := policy.WriteInputScales(*outPath, m.Config(), scales, meta); err != nil {
		return err
	}
	type layer struct {
		FC1 float32 `json:"fc1_input_scale"`
		FC2 float32 `json:"fc2_input_scale"`
	}
	out := struct {
		Layers []layer `json:"layers"`
		Tokens int     `json:"tokens"`
	}{Tokens: tokens}
	for _, s := range scales {
		out.Layers = append(out.Layers, layer{s.FC1, s.FC2})
	}
	return json.NewEncoder(stdout).Encode(out)
}

// readSequences reads a JSON file {"sequences": [[id, ...], ...]} of at
// least one sequence.
func readSequences(path string) ([][]int32, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var in struct {
		Sequences [][]int32 `json:"sequences"`
	}
	if err := json.Unmarshal(raw, &in); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(in.Sequences) == 0 {
		return nil, fmt.Errorf("%s: no sequences", path)
	}
	return in.Sequences, nil
}
