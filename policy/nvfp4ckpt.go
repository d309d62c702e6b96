package policy

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"maps"
	"math"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/moe"
)

// An NVFP4 checkpoint in ModelOpt's layout stores a quantized linear layer
// X as four tensors beside each other:
//
//	X.weight          U8 [N, Kp/2]       E2M1 codes, element 2j in the low nibble
//	X.weight_scale    F8_E4M3 [N, Kp/16] one scale per 16 elements of a row
//	X.weight_scale_2  F32 scalar         the matrix's global decode scale (S_dec)
//	X.input_scale     F32 scalar         the calibrated S_dec of X's input (optional)
//
// which is this worker's NVFP4 layout (docs/NVFP4.md) byte for byte. The
// loader materialises X's BF16 weights by dequantization, x = bf16(RN(RN(
// e2m1(q) * SF) * S_dec)); an expert's codes, block scales and S_dec also
// go as they are into the layer's NVFP4 copies, so the experts serve the
// checkpoint's quantization and not a requantization of the rounded BF16
// values. A refit still arrives as BF16 and is requantized as always.
var (
	quantPart = regexp.MustCompile(`^(.+)\.(weight_scale_2|weight_scale|input_scale)$`)
	// kvScale names the FP8 KV-cache scales a ModelOpt export may carry;
	// the cache here stays BF16, so they are read past.
	kvScale = regexp.MustCompile(`^model\.layers\.\d+\.self_attn\.(?:[kv]_proj\.)?[kv]_scale$`)
)

// quantModule is one NVFP4 linear layer of a checkpoint.
type quantModule struct {
	name                          string // X
	weight, scale, scale2, inputS *ckptEntry
	target                        Target // of X.weight
	sdec                          float32
	kp                            int
}

// nvfp4Parts takes the NVFP4 modules out of a checkpoint's entries: the
// scale tensors and the U8 weights whose module has a weight_scale. It
// returns the modules by name, in name order, and the entries left for the
// BF16 path. KV-cache scales are dropped.
func nvfp4Parts(entries []ckptEntry) ([]*quantModule, []ckptEntry) {
	mods := map[string]*quantModule{}
	get := func(name string) *quantModule {
		q := mods[name]
		if q == nil {
			q = &quantModule{name: name}
			mods[name] = q
		}
		return q
	}
	part := make([]bool, len(entries)) // a scale tensor of a module
	for i := range entries {
		e := &entries[i]
		if m := quantPart.FindStringSubmatch(e.t.Name); m != nil {
			part[i] = true
			q := get(m[1])
			switch m[2] {
			case "weight_scale":
				q.scale = e
			case "weight_scale_2":
				q.scale2 = e
			default:
				q.inputS = e
			}
		}
	}
	var rest []ckptEntry
	for i := range entries {
		e := &entries[i]
		switch {
		case part[i], kvScale.MatchString(e.t.Name):
			continue
		case strings.HasSuffix(e.t.Name, ".weight") && e.t.DType == stfile.U8:
			if q := mods[strings.TrimSuffix(e.t.Name, ".weight")]; q != nil {
				q.weight = e
				continue
			}
		}
		rest = append(rest, *e)
	}
	out := make([]*quantModule, 0, len(mods))
	for _, name := range slices.Sorted(maps.Keys(mods)) {
		out = append(out, mods[name])
	}
	return out, rest
}

// checkNVFP4 resolves and checks every module, recording problems in perr
// and covering each module's BF16 place in cov. It returns the checked
// modules.
func (m *Model) checkNVFP4(mods []*quantModule, perr *CheckpointError, cov *coverage) []*quantModule {
	var ok []*quantModule
	for _, q := range mods {
		if q.weight == nil {
			if q.scale != nil || q.scale2 != nil {
				perr.Missing = append(perr.Missing, fmt.Sprintf("%s.weight as U8 codes: %s has NVFP4 scales", q.name, q.name))
			}
			// A lone input_scale (for a BF16 or unquantized module) is the
			// per_tensor recipe's calibration and is read, not loaded.
			continue
		}
		tg, err := m.Resolve(q.name + ".weight")
		if err != nil {
			perr.Unexpected = append(perr.Unexpected, fmt.Sprintf("%s (in %s): %s", q.weight.t.Name, q.weight.file, strings.TrimPrefix(err.Error(), "policy: ")))
			continue
		}
		q.target = tg
		cov.add(tg)
		if bad := q.check(perr); bad {
			continue
		}
		ok = append(ok, q)
	}
	return ok
}

// check checks the module's weight tensors against its BF16 place and
// reports whether it found a problem. (Its input_scale is the per_tensor
// recipe's, checked by checkpointInputScales.)
func (q *quantModule) check(perr *CheckpointError) bool {
	n0 := perr.Count()
	if len(q.target.Shape) != 2 {
		perr.Misshapen = append(perr.Misshapen, fmt.Sprintf("%s: an NVFP4 module for a %d-D tensor; only matrices are quantized", q.name, len(q.target.Shape)))
		return true
	}
	N, K := q.target.Shape[0], q.target.Shape[1]
	q.kp = nvfp4.PaddedK(K)
	want := func(e *ckptEntry, part string, dt stfile.DType, shape ...int) {
		switch {
		case e == nil:
			perr.Missing = append(perr.Missing, fmt.Sprintf("%s.%s: NVFP4 module %s has its codes but no %s", q.name, part, q.name, part))
		case e.t.DType != dt:
			perr.DType = append(perr.DType, fmt.Sprintf("%s (in %s): %s, want %s", e.t.Name, e.file, e.t.DType, dt))
		case !sameShape(e.t.Shape, shape):
			perr.Misshapen = append(perr.Misshapen, fmt.Sprintf("%s (in %s): shape %v, want %v", e.t.Name, e.file, e.t.Shape, shape))
		}
	}
	want(q.weight, "weight", stfile.U8, N, q.kp/2)
	want(q.scale, "weight_scale", stfile.F8E4M3, N, q.kp/16)
	want(q.scale2, "weight_scale_2", stfile.F32)
	if perr.Count() > n0 {
		return true
	}
	q.sdec = math.Float32frombits(binary.LittleEndian.Uint32(q.scale2.t.Data))
	if !(q.sdec >= 0) || math.IsInf(float64(q.sdec), 0) {
		perr.NonFinite = append(perr.NonFinite, fmt.Sprintf("%s (in %s): %v, want a finite scale >= 0", q.scale2.t.Name, q.scale2.file, q.sdec))
	}
	if j := slices.IndexFunc(q.scale.t.Data, func(b byte) bool { return b&0x7f == 0x7f }); j >= 0 {
		perr.NonFinite = append(perr.NonFinite, fmt.Sprintf("%s (in %s): NaN (0x%02x) at element %v", q.scale.t.Name, q.scale.file, q.scale.t.Data[j], unflatten(j, q.scale.t.Shape)))
	}
	return perr.Count() > n0
}

// expertKey names one expert of one layer.
type expertKey struct{ layer, expert int }

// sortedExperts returns the keys of by in layer, then expert order.
func sortedExperts[V any](by map[expertKey]V) []expertKey {
	return slices.SortedFunc(maps.Keys(by), func(a, b expertKey) int {
		return cmp.Or(cmp.Compare(a.layer, b.layer), cmp.Compare(a.expert, b.expert))
	})
}

// checkExperts checks what the NVFP4 copies need of the expert modules:
// an expert's projections all quantized or none (its copies are either the
// checkpoint's or requantized whole), and a SwiGLU expert's gate and up
// projections with one global scale (they are one FC1 matrix with one
// alpha). It returns the quantized experts' modules.
func (m *Model) checkExperts(mods []*quantModule, bf16Targets []Target, perr *CheckpointError) map[expertKey][]*quantModule {
	quant := map[expertKey][]*quantModule{}
	for _, q := range mods {
		if q.target.IsExpert() {
			k := expertKey{q.target.Layer, q.target.Experts[0]}
			quant[k] = append(quant[k], q)
		}
	}
	for _, t := range bf16Targets {
		if !t.IsExpert() {
			continue
		}
		for e := t.Experts[0]; e < t.Experts[1]; e++ {
			if qs := quant[expertKey{t.Layer, e}]; len(qs) > 0 {
				perr.Scales = append(perr.Scales, fmt.Sprintf("layer %d expert %d: %s is NVFP4 but %s is BF16: an expert's projections are quantized all or none", t.Layer, e, qs[0].name, t.Name))
			}
		}
	}
	gated := m.cfg.Activation == moe.SwiGLU
	for _, k := range sortedExperts(quant) { // in order, so that the problems are listed in order
		qs := quant[k]
		if !gated {
			continue
		}
		var fc1 []*quantModule
		for _, q := range qs {
			if q.target.Buffer == m.layers[k.layer].moe.FC1() {
				fc1 = append(fc1, q)
			}
		}
		for _, q := range fc1[min(1, len(fc1)):] {
			if math.Float32bits(q.sdec) != math.Float32bits(fc1[0].sdec) {
				perr.Scales = append(perr.Scales, fmt.Sprintf("layer %d expert %d: %s.weight_scale_2 is %v but %s.weight_scale_2 is %v: gate and up are one FC1 matrix with one global scale (export them with tied scales)",
					k.layer, k.expert, fc1[0].name, fc1[0].sdec, q.name, q.sdec))
			}
		}
	}
	return quant
}

// dequantTable maps a block scale byte and a code (sf<<4 | code) to the
// BF16 value bf16(RN(RN(e2m1(code) * f32(sf)) * sdec)): a matrix's
// dequantization is then one lookup an element.
func dequantTable(sdec float32) *[256 * 16]uint16 {
	var t [256 * 16]uint16
	for sf := range 256 {
		s := nvfp4.E4M3Decode(uint8(sf))
		for c := range 16 {
			t[sf<<4|c] = bf16.FromFloat32(nvfp4.E2M1Decode(uint8(c)) * s * sdec)
		}
	}
	return &t
}

// dequantize writes the module's BF16 weights (row-major [N, K]) into out.
func (q *quantModule) dequantize(out []byte) {
	N, K := q.target.Shape[0], q.target.Shape[1]
	t := dequantTable(q.sdec)
	codes, sfs := q.weight.t.Data, q.scale.t.Data
	for r := range N {
		row, sf := codes[r*q.kp/2:], sfs[r*q.kp/16:]
		o := out[2*r*K : 2*(r+1)*K]
		for i := 0; i < K; i += 2 {
			b := row[i/2]
			hi := uint16(sf[i/16]) << 4
			binary.LittleEndian.PutUint16(o[2*i:], t[hi|uint16(b&15)])
			if i+1 < K {
				binary.LittleEndian.PutUint16(o[2*i+2:], t[hi|uint16(b>>4)])
			}
		}
	}
}

// uploadNVFP4 writes the checked modules: each one's dequantized BF16
// weights into its place and, for an expert under an NVFP4 recipe, its
// codes, block scales and global scale into the layer's NVFP4 copies.
// Modules go a batch at a time: one goroutine a core dequantizes a module
// each, then the batch is uploaded here, in order.
func (m *Model) uploadNVFP4(mods []*quantModule) error {
	P := runtime.GOMAXPROCS(0)
	outs := make([][]byte, P)
	for b0 := 0; b0 < len(mods); b0 += P {
		batch := mods[b0:min(b0+P, len(mods))]
		var wg sync.WaitGroup
		for i, q := range batch {
			n := 2 * q.target.Shape[0] * q.target.Shape[1]
			if cap(outs[i]) < n {
				outs[i] = make([]byte, n)
			}
			outs[i] = outs[i][:n]
			wg.Go(func() { q.dequantize(outs[i]) })
		}
		wg.Wait()
		for i, q := range batch {
			if err := m.uploadModule(q, outs[i]); err != nil {
				return err
			}
		}
	}
	return nil
}

// uploadModule uploads one module's dequantized weights.
func (m *Model) uploadModule(q *quantModule, out []byte) error {
	if err := m.be.Upload(q.target.Buffer, q.target.Offset, out); err != nil {
		return fmt.Errorf("upload %s.weight: %w", q.name, err)
	}
	return nil
}

// setQuantizedExperts writes each quantized expert's codes, block scales
// and global scales into its layer's NVFP4 copies as they are (moe's
// SetQuantized): FC1 from its gate rows, then its up rows (one global
// scale, checked), FC2 from down. Recipes without copies take none.
func (m *Model) setQuantizedExperts(quant map[expertKey][]*quantModule) error {
	for _, k := range sortedExperts(quant) {
		l := m.layers[k.layer].moe
		if fc1, _ := l.Quantized(); fc1.Packed == nil {
			return nil // the BF16 recipe
		}
		qs := slices.SortedFunc(slices.Values(quant[k]), func(a, b *quantModule) int { return cmp.Compare(a.target.Offset, b.target.Offset) })
		var fc1, fc2 moe.QuantizedMatrix
		for _, q := range qs {
			dst := &fc2
			if q.target.Buffer == l.FC1() {
				dst = &fc1
			}
			dst.Packed = append(dst.Packed, q.weight.t.Data...)
			dst.Scales = append(dst.Scales, q.scale.t.Data...)
			dst.Scale = q.sdec
		}
		if err := l.SetQuantized(k.expert, fc1, fc2); err != nil {
			return fmt.Errorf("layer %d: %w", k.layer, err)
		}
	}
	return nil
}

// checkpointInputScales gathers the experts' input_scale tensors into
// per-layer scales, as ReadInputScales reads a scales file. It reports
// whether the checkpoint has any; a checkpoint with some must have both
// scales of every layer. Input scales of other modules (attention, whose
// inputs stay BF16) are read past.
func (m *Model) checkpointInputScales(mods []*quantModule, perr *CheckpointError) ([]InputScales, bool) {
	out := make([]InputScales, m.cfg.Layers)
	found := false
	for _, q := range mods {
		if q.inputS == nil || !inputScaleName.MatchString(q.inputS.t.Name) {
			continue
		}
		found = true
		if err := foldInputScale(out, q.inputS.t, m.cfg.Experts); err != nil {
			perr.Scales = append(perr.Scales, fmt.Sprintf("%s (in %s)", err, q.inputS.file))
		}
	}
	if !found {
		return nil, false
	}
	if err := inputScalesComplete(out); err != nil {
		perr.Scales = append(perr.Scales, fmt.Sprintf("input_scale: %v (a checkpoint with input scales has them for every layer)", err))
	}
	return out, true
}
