package policy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strconv"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/moe"
)

// InputScales are one MoE layer's per_tensor activation scales: the S_dec
// of FC1's input and of FC2's input.
type InputScales struct{ FC1, FC2 float32 }

// Calibrate runs the token sequences through the model (prefill, in chunks
// of at most MaxTokens, each sequence from position 0 on the first KV
// pages), every MoE layer folding the largest |value| of its expert inputs
// into running maxima, then sets each layer's per_tensor input scales from
// them and returns them by layer. It sets all layers' scales or, on an
// error (ctx's included, checked between chunks), none. The model's recipe
// must be moe.RecipePerTensor; it must not be serving (Calibrate uses the
// KV cache and the workspaces).
func (m *Model) Calibrate(ctx context.Context, seqs [][]int32) (_ []InputScales, err error) {
	if m.closed {
		return nil, fmt.Errorf("policy: calibrate: model is closed")
	}
	if m.opts.Recipe != moe.RecipePerTensor {
		return nil, fmt.Errorf("policy: calibrate: recipe %s takes no input scales (only %s does)", m.opts.Recipe, moe.RecipePerTensor)
	}
	if len(seqs) == 0 {
		return nil, fmt.Errorf("policy: calibrate: no sequences")
	}
	c, o := m.cfg, m.opts
	for i, s := range seqs {
		switch {
		case len(s) == 0:
			return nil, fmt.Errorf("policy: calibrate: sequence %d is empty", i)
		case len(s) > c.MaxPositions:
			return nil, fmt.Errorf("policy: calibrate: sequence %d has %d tokens, the context is %d", i, len(s), c.MaxPositions)
		case ceilDiv(len(s), o.PageSize) > o.KVPages:
			return nil, fmt.Errorf("policy: calibrate: sequence %d needs %d KV pages, the cache has %d: %w", i, ceilDiv(len(s), o.PageSize), o.KVPages, ErrTooLarge)
		}
		for j, t := range s {
			if t < 0 || int(t) >= c.VocabSize {
				return nil, fmt.Errorf("policy: calibrate: sequence %d token %d is %d, outside the vocabulary of %d", i, j, t, c.VocabSize)
			}
		}
	}
	m.calibrating = true
	defer func() {
		m.calibrating = false
		for _, l := range m.layers { // the next calibration starts afresh, whatever happened
			l.moe.ResetCalibration()
		}
	}()
	for _, l := range m.layers {
		l.moe.ResetCalibration()
	}
	ps := o.PageSize
	for _, s := range seqs {
		pages := make([]int32, ceilDiv(len(s), ps))
		for p := range pages {
			pages[p] = int32(p)
		}
		for c0 := 0; c0 < len(s); c0 += o.MaxTokens {
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("policy: calibrate: %w", err)
			}
			c1 := min(c0+o.MaxTokens, len(s))
			in := StepInput{SeqLens: []int32{int32(c1)}, QueryStart: []int32{0, int32(c1 - c0)}, PageTable: [][]int32{pages}}
			for p := c0; p < c1; p++ {
				in.Tokens = append(in.Tokens, s[p])
				in.Positions = append(in.Positions, int32(p))
				in.Slots = append(in.Slots, pages[p/ps]*int32(ps)+int32(p%ps))
			}
			sh, err := m.Stage(in)
			if err != nil {
				return nil, fmt.Errorf("policy: calibrate: %w", err)
			}
			if err := m.Forward(sh, false); err != nil {
				return nil, fmt.Errorf("policy: calibrate: %w", err)
			}
		}
	}
	out := make([]InputScales, len(m.layers))
	for i, l := range m.layers {
		fc1, fc2, err := l.moe.CalibratedScales()
		if err != nil {
			return nil, fmt.Errorf("policy: calibrate: layer %d: %w", i, err)
		}
		out[i] = InputScales{fc1, fc2}
	}
	if err := m.SetInputScales(out); err != nil {
		return nil, fmt.Errorf("policy: calibrate: %w", err)
	}
	return out, nil
}

// SetInputScales sets every MoE layer's per_tensor input scales (one entry
// a layer), as a calibration or a checkpoint gives them.
func (m *Model) SetInputScales(scales []InputScales) error {
	if len(scales) != len(m.layers) {
		return fmt.Errorf("policy: input scales: %d layers' worth, the model has %d", len(scales), len(m.layers))
	}
	for i, l := range m.layers {
		if err := l.moe.SetInputScales(scales[i].FC1, scales[i].FC2); err != nil {
			return fmt.Errorf("policy: input scales: layer %d: %w", i, err)
		}
	}
	return nil
}

// ErrNoInputScales is UseInputScales's error for a per_tensor model left
// without input scales.
var ErrNoInputScales = errors.New("policy: recipe per_tensor has no input scales: give a scales file (rollout-worker calibrate writes one) or a checkpoint with the experts' input_scale tensors")

// UseInputScales settles a loaded model's per_tensor input scales: those
// of the scales file at path (ReadInputScales) when path is not empty,
// over any the checkpoint gave; then a per_tensor model must have them
// (ErrNoInputScales). Other recipes take no file.
func (m *Model) UseInputScales(path string) error {
	per := m.opts.Recipe == moe.RecipePerTensor
	if path != "" {
		if !per {
			return fmt.Errorf("policy: input scales %s with recipe %s: only %s takes them", path, m.opts.Recipe, moe.RecipePerTensor)
		}
		scales, err := ReadInputScales(path, m.cfg.Layers, m.cfg.Experts)
		if err != nil {
			return err
		}
		if err := m.SetInputScales(scales); err != nil {
			return err
		}
	}
	if _, ok := m.InputScales(); per && !ok {
		return ErrNoInputScales
	}
	return nil
}

// InputScales returns every MoE layer's per_tensor input scales, and
// whether all of them are set (false for recipes that take none).
func (m *Model) InputScales() ([]InputScales, bool) {
	out := make([]InputScales, len(m.layers))
	for i, l := range m.layers {
		fc1, fc2, ok := l.moe.InputScales()
		if !ok {
			return nil, false
		}
		out[i] = InputScales{fc1, fc2}
	}
	return out, true
}

// The per_tensor input scales in a safetensors file, as a ModelOpt NVFP4
// checkpoint names them: one FP32 scalar a projection and expert,
// model.layers.L.mlp.experts.E.{gate_proj,up_proj}.input_scale (FC1's
// input) and ...down_proj.input_scale (FC2's), or Mixtral's
// block_sparse_moe.experts.E.{w1,w3} and w2 (both prefixes and both sets of
// projection names are read for either architecture, as the checkpoint
// loader reads weights). The layer's scale is the largest of its experts'
// (a checkpoint calibrated expert by expert); WriteInputScales writes the
// layer's value for every expert, in the model's own names.
var inputScaleName = regexp.MustCompile(`^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.input_scale$`)

// ReadInputScales reads the per_tensor input scales of a model of the given
// layer and expert counts from a safetensors file. Every layer needs at
// least one FC1 and one FC2 value; every value must be a positive finite
// FP32 scalar, and every name of that form must fall in the model.
func ReadInputScales(path string, layers, experts int) ([]InputScales, error) {
	f, err := stfile.Open(path)
	if err != nil {
		return nil, fmt.Errorf("policy: input scales: %w", err)
	}
	defer f.Close()
	out := make([]InputScales, layers)
	for _, name := range f.Names() {
		if !inputScaleName.MatchString(name) {
			continue
		}
		t, err := f.Tensor(name)
		if err != nil {
			return nil, fmt.Errorf("policy: input scales: %w", err)
		}
		if err := foldInputScale(out, t, experts); err != nil {
			return nil, fmt.Errorf("policy: input scales: %s: %w", path, err)
		}
	}
	if err := inputScalesComplete(out); err != nil {
		return nil, fmt.Errorf("policy: input scales: %s: %w", path, err)
	}
	return out, nil
}

// foldInputScale folds an expert's input_scale tensor t (named as
// inputScaleName matches) into its layer's entry of out: the largest value
// of the layer's FC1 (gate, up) or FC2 (down) inputs.
func foldInputScale(out []InputScales, t stfile.Tensor, experts int) error {
	m := inputScaleName.FindStringSubmatch(t.Name)
	l, errL := strconv.Atoi(m[1])
	e, errE := strconv.Atoi(m[2])
	if errL != nil || errE != nil || l >= len(out) || e >= experts {
		return fmt.Errorf("%s: the model has %d layers of %d experts", t.Name, len(out), experts)
	}
	if t.DType != stfile.F32 || len(t.Data) != 4 {
		return fmt.Errorf("%s is %s %v, want an F32 scalar", t.Name, t.DType, t.Shape)
	}
	v := math.Float32frombits(binary.LittleEndian.Uint32(t.Data))
	if !(v > 0) || math.IsInf(float64(v), 0) {
		return fmt.Errorf("%s is %v, want a positive finite scale", t.Name, v)
	}
	s := &out[l].FC1
	if m[3] == "down_proj" || m[3] == "w2" {
		s = &out[l].FC2
	}
	*s = max(*s, v)
	return nil
}

// inputScalesComplete checks that every layer has both scales.
func inputScalesComplete(out []InputScales) error {
	for l, s := range out {
		switch {
		case s.FC1 == 0:
			return fmt.Errorf("layer %d has no gate_proj, up_proj, w1 or w3 input_scale", l)
		case s.FC2 == 0:
			return fmt.Errorf("layer %d has no down_proj or w2 input_scale", l)
		}
	}
	return nil
}

// WriteInputScales writes scales (one entry a layer of the model cfg
// describes) to a safetensors file as ReadInputScales reads them, the
// layer's value for each of its experts' three projections, named as the
// architecture names its expert weights.
func WriteInputScales(path string, cfg Config, scales []InputScales, metadata map[string]string) error {
	if len(scales) != cfg.Layers {
		return fmt.Errorf("policy: input scales: %d layers' worth for a model of %d", len(scales), cfg.Layers)
	}
	prefix, projs := "mlp", [3]string{"gate_proj", "up_proj", "down_proj"}
	if cfg.Architecture == ArchMixtral {
		prefix, projs = "block_sparse_moe", [3]string{"w1", "w3", "w2"}
	}
	var ts []stfile.Tensor
	for l, s := range scales {
		for e := range cfg.Experts {
			for i, v := range []float32{s.FC1, s.FC1, s.FC2} {
				data := make([]byte, 4)
				binary.LittleEndian.PutUint32(data, math.Float32bits(v))
				ts = append(ts, stfile.Tensor{Name: fmt.Sprintf("model.layers.%d.%s.experts.%d.%s.input_scale", l, prefix, e, projs[i]),
					DType: stfile.F32, Shape: []uint64{}, Data: data})
			}
		}
	}
	if err := stfile.Write(path, ts, metadata); err != nil {
		return fmt.Errorf("policy: input scales: %w", err)
	}
	return nil
}
