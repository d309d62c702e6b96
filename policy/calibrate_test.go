package policy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/moe"
)

// TestCalibrate runs the per_tensor recipe's calibration through a model:
// every layer gets positive finite input scales, the same ones again from
// the same sequences, and then generation and scoring run on them, the
// same samples twice; other recipes and wrong inputs are refused.
func TestCalibrate(t *testing.T) {
	cfg, opts := testConfig(), testOptions()
	opts.Recipe = moe.RecipePerTensor
	m := newRandomModel(t, cfg, opts, 5)
	seqs := [][]int32{prompt(1, 150, cfg.VocabSize), prompt(2, 40, cfg.VocabSize)} // the first in two chunks
	scales, err := m.Calibrate(t.Context(), seqs)
	if err != nil {
		t.Fatal(err)
	}
	if len(scales) != cfg.Layers {
		t.Fatalf("%d layers' scales, want %d", len(scales), cfg.Layers)
	}
	for i, s := range scales {
		for _, v := range []float32{s.FC1, s.FC2} {
			if !(v > 0) || math.IsInf(float64(v), 0) {
				t.Fatalf("layer %d: scales %+v, want positive finite ones", i, s)
			}
		}
		if a, b, ok := m.MoE(i).InputScales(); !ok || a != s.FC1 || b != s.FC2 {
			t.Fatalf("layer %d holds %g, %g (%v), Calibrate returned %+v", i, a, b, ok, s)
		}
	}
	// The maxima run over every sequence of a calibration and start afresh
	// with the next: each sequence alone, then both in the other order,
	// give the scales of both (the scale grows with the amax, so the max of
	// the scales is the scale of the max).
	var alone [2][]InputScales
	for i := range seqs {
		if alone[i], err = m.Calibrate(t.Context(), seqs[i:i+1]); err != nil {
			t.Fatal(err)
		}
	}
	again, err := m.Calibrate(t.Context(), [][]int32{seqs[1], seqs[0]})
	if err != nil {
		t.Fatal(err)
	}
	for i := range scales {
		want := InputScales{max(alone[0][i].FC1, alone[1][i].FC1), max(alone[0][i].FC2, alone[1][i].FC2)}
		if again[i] != scales[i] || scales[i] != want {
			t.Fatalf("layer %d: both sequences gave %+v, again %+v; each alone %+v and %+v", i, scales[i], again[i], alone[0][i], alone[1][i])
		}
		if alone[0][i] == alone[1][i] {
			t.Fatalf("layer %d: both sequences alone give %+v: the check above cannot tell them apart", i, alone[0][i])
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := m.Calibrate(ctx, seqs); !errors.Is(err, context.Canceled) {
		t.Fatalf("a cancelled calibration: %v, want context.Canceled", err)
	}
	if a, b, _ := m.MoE(0).InputScales(); a != scales[0].FC1 || b != scales[0].FC2 {
		t.Fatalf("a cancelled calibration changed layer 0's scales to %g, %g", a, b)
	}

	e := startEngine(t, m, EngineConfig{})
	req := Request{ID: "p", Prompt: prompt(3, 12, cfg.VocabSize), N: 2, Params: SamplingParams{Temperature: 1, MaxTokens: 8, Seed: 9}}
	a, b := generate(t, e, req), generate(t, e, req)
	if err := sameSamples(a, b); err != nil {
		t.Fatalf("per_tensor generation twice: %v", err)
	}
	if _, err := e.Score(t.Context(), seqs[1:]); err != nil {
		t.Fatal(err)
	}

	if err := m.SetInputScales(scales[:1]); err == nil {
		t.Error("SetInputScales with one layer's worth: no error")
	}
	if _, err := m.Calibrate(t.Context(), nil); err == nil {
		t.Error("Calibrate of no sequences: no error")
	}
	if _, err := m.Calibrate(t.Context(), [][]int32{{int32(cfg.VocabSize)}}); err == nil {
		t.Error("Calibrate of a token outside the vocabulary: no error")
	}
	opts.Recipe = moe.RecipePerToken
	pt := newRandomModel(t, cfg, opts, 5)
	if _, err := pt.Calibrate(t.Context(), seqs); err == nil {
		t.Error("Calibrate on a per_token model: no error")
	}
}

// TestPerTensorNeedsScales: a per_tensor model's forward fails, naming the
// missing scales, until they are set.
func TestPerTensorNeedsScales(t *testing.T) {
	cfg, opts := testConfig(), testOptions()
	opts.Recipe = moe.RecipePerTensor
	m, err := NewModel(testBackend(t), cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	fillRandom(t, m, 5) // and no input scales, which newRandomModel sets
	sh, err := m.Stage(StepInput{Tokens: []int32{1, 2}, Positions: []int32{0, 1}, Slots: []int32{0, 1}, SeqLens: []int32{2},
		QueryStart: []int32{0, 2}, PageTable: [][]int32{{0}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Forward(sh, false); !errors.Is(err, moe.ErrNotCalibrated) {
		t.Fatalf("forward before calibration: %v, want ErrNotCalibrated", err)
	}
	if err := m.UseInputScales(""); !errors.Is(err, ErrNoInputScales) {
		t.Fatalf("UseInputScales without a file or checkpoint scales: %v, want ErrNoInputScales", err)
	}
	s := make([]InputScales, cfg.Layers)
	for i := range s {
		s[i] = InputScales{FC1: 1.0 / 1024, FC2: 1.0 / 2048}
	}
	path := filepath.Join(t.TempDir(), "scales.safetensors")
	if err := WriteInputScales(path, cfg, s, nil); err != nil {
		t.Fatal(err)
	}
	if err := m.UseInputScales(path); err != nil {
		t.Fatal(err)
	}
	if got, ok := m.InputScales(); !ok || !slices.Equal(got, s) {
		t.Fatalf("input scales %v (%v) after UseInputScales, want the file's %v", got, ok, s)
	}
	if err := m.Forward(sh, false); err != nil {
		t.Fatal(err)
	}
	other, err := NewModel(testBackend(t), cfg, testOptions())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	if err := other.UseInputScales(path); err == nil || !strings.Contains(err.Error(), "only per_tensor takes them") {
		t.Fatalf("a scales file under recipe %s: %v", testOptions().Recipe, err)
	}
}

// TestInputScalesFile writes a calibration's scales and reads them back,
// takes the largest of a layer's experts, and refuses files that do not
// fit the model or hold values that are not scales.
func TestInputScalesFile(t *testing.T) {
	dir := t.TempDir()
	want := []InputScales{{FC1: 1.0 / 512, FC2: 3.0 / 1024}, {FC1: 0x1p-20, FC2: 5}}
	for _, arch := range []string{ArchQwen3MoE, ArchMixtral} {
		cfg := Config{Architecture: arch, Layers: 2, Experts: 3}
		path := filepath.Join(dir, arch+".safetensors")
		if err := WriteInputScales(path, cfg, want, map[string]string{"source": "test"}); err != nil {
			t.Fatal(err)
		}
		got, err := ReadInputScales(path, 2, 3)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("%s: read %+v, wrote %+v", arch, got, want)
		}
		f, err := stfile.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		names := f.Names()
		f.Close()
		wantName := map[string]string{ArchQwen3MoE: "model.layers.1.mlp.experts.2.down_proj.input_scale",
			ArchMixtral: "model.layers.1.block_sparse_moe.experts.2.w2.input_scale"}[arch]
		if len(names) != 2*3*3 || !slices.Contains(names, wantName) {
			t.Fatalf("%s: %d names, want 18 with %s", arch, len(names), wantName)
		}
	}
	if err := WriteInputScales(filepath.Join(dir, "x.safetensors"), Config{Layers: 3, Experts: 3}, want, nil); err == nil {
		t.Error("scales of 2 layers written for a model of 3: no error")
	}
	scalar := func(name string, v float32) stfile.Tensor {
		data := make([]byte, 4)
		binary.LittleEndian.PutUint32(data, math.Float32bits(v))
		return stfile.Tensor{Name: name, DType: stfile.F32, Shape: []uint64{}, Data: data}
	}
	name := func(l, e int, proj string) string {
		return fmt.Sprintf("model.layers.%d.mlp.experts.%d.%s.input_scale", l, e, proj)
	}
	full := []stfile.Tensor{scalar(name(0, 0, "gate_proj"), 1), scalar(name(0, 1, "up_proj"), 4), scalar(name(0, 1, "down_proj"), 2),
		scalar("model.layers.0.mlp.gate.weight_scale", 7)} // not an input scale: ignored
	for _, tc := range []struct {
		name    string
		tensors []stfile.Tensor
		want    string // "" for success
	}{
		{"largest expert", full, ""},
		{"no down_proj", full[:2], "no down_proj"},
		{"no gate or up", full[2:], "no gate_proj, up_proj, w1 or w3"},
		{"mixtral names", []stfile.Tensor{scalar("model.layers.0.block_sparse_moe.experts.1.w3.input_scale", 4),
			scalar("model.layers.0.block_sparse_moe.experts.0.w2.input_scale", 2)}, ""},
		{"layer past the model", append(slices.Clone(full), scalar(name(1, 0, "gate_proj"), 1)), "the model has 1 layers"},
		{"expert past the model", append(slices.Clone(full), scalar(name(0, 2, "gate_proj"), 1)), "of 2 experts"},
		{"zero", append(slices.Clone(full), scalar(name(0, 0, "up_proj"), 0)), "positive finite"},
		{"nan", append(slices.Clone(full), scalar(name(0, 0, "up_proj"), float32(math.NaN()))), "positive finite"},
		{"bf16", append(slices.Clone(full), stfile.Tensor{Name: name(0, 0, "up_proj"), DType: stfile.BF16, Shape: []uint64{}, Data: []byte{0x80, 0x3f}}), "F32 scalar"},
		{"vector", append(slices.Clone(full), stfile.Tensor{Name: name(0, 0, "up_proj"), DType: stfile.F32, Shape: []uint64{2}, Data: make([]byte, 8)}), "F32 scalar"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_")+".safetensors")
			if err := stfile.Write(p, tc.tensors, nil); err != nil {
				t.Fatal(err)
			}
			got, err := ReadInputScales(p, 1, 2)
			switch {
			case tc.want == "" && err != nil:
				t.Fatal(err)
			case tc.want == "" && got[0] != (InputScales{FC1: 4, FC2: 2}):
				t.Fatalf("read %+v, want the largest of the experts: {4 2}", got[0])
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
	if _, err := ReadInputScales(filepath.Join(dir, "missing.safetensors"), 1, 1); err == nil {
		t.Error("a missing file: no error")
	}
}

// FuzzReadInputScales feeds arbitrary bytes as the scales file: an error
// or scales, never a panic.
func FuzzReadInputScales(f *testing.F) {
	dir := f.TempDir()
	seed := filepath.Join(dir, "seed.safetensors")
	if err := WriteInputScales(seed, Config{Layers: 1, Experts: 2}, []InputScales{{FC1: 1, FC2: 2}}, nil); err != nil {
		f.Fatal(err)
	}
	b, err := os.ReadFile(seed)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Add([]byte{8, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '})
	f.Fuzz(func(t *testing.T, data []byte) {
		p := filepath.Join(t.TempDir(), "f.safetensors")
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		if s, err := ReadInputScales(p, 1, 2); err == nil && (len(s) != 1 || !(s[0].FC1 > 0) || !(s[0].FC2 > 0)) {
			t.Fatalf("read %+v without an error", s)
		}
	})
}
