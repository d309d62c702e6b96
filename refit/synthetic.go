package refit

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/policy"
)

// SyntheticPrefix marks a synthetic checkpoint where a checkpoint path is
// expected (OpenSource, OpenDelta, `publish --from` and `--base`):
//
//	synthetic:PRESET[?layers=N][&seed=S][&steps=F1,F2,...]
//
// It holds every BF16 tensor of the preset's checkpoint (its Hugging Face
// names and shapes, the depth cut to N layers), with values generated as
// they are read, so a version of a 61 GB model is published from a few
// megabytes of memory and no file. The values are those of a training run
// seen at a step: a random block of finite BF16 values drawn from the seed,
// then, for each training step i, a fraction Fi of its elements changed (by
// one unit in the last place, at positions drawn from the seed and i). Each
// tensor reads the block from its own rotation, repeated to its length. So
// the delta between `steps=F1` and `steps=F1,F2` changes a fraction F2 of
// every tensor's elements, spread at random within each 8 MiB: what a
// sparse delta of an RL step looks like to the transport. It is a load
// generator for the refit path, not a model: the values mean nothing.
const SyntheticPrefix = "synthetic:"

// syntheticBlockBytes is the repeating block of a synthetic checkpoint.
const syntheticBlockBytes = 8 << 20

// SyntheticSpec is a parsed synthetic checkpoint spec.
type SyntheticSpec struct {
	Preset string
	Layers int       // 0: all of the preset's layers
	Seed   uint64    // default 1
	Steps  []float64 // fraction of elements each training step changes, in order
}

// String is the spec in the form ParseSyntheticSpec reads.
func (s SyntheticSpec) String() string {
	q := url.Values{}
	if s.Layers != 0 {
		q.Set("layers", strconv.Itoa(s.Layers))
	}
	q.Set("seed", strconv.FormatUint(s.Seed, 10))
	if len(s.Steps) > 0 {
		f := make([]string, len(s.Steps))
		for i, x := range s.Steps {
			f[i] = strconv.FormatFloat(x, 'g', -1, 64)
		}
		q.Set("steps", strings.Join(f, ","))
	}
	return SyntheticPrefix + s.Preset + "?" + q.Encode()
}

// ParseSyntheticSpec parses "synthetic:PRESET?layers=N&seed=S&steps=F1,F2".
func ParseSyntheticSpec(spec string) (SyntheticSpec, error) {
	rest, ok := strings.CutPrefix(spec, SyntheticPrefix)
	if !ok {
		return SyntheticSpec{}, fmt.Errorf("refit: synthetic checkpoint %q: want the prefix %q", spec, SyntheticPrefix)
	}
	preset, query, _ := strings.Cut(rest, "?")
	s := SyntheticSpec{Preset: preset, Seed: 1}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("refit: synthetic checkpoint %q: %s", spec, fmt.Sprintf(format, a...))
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return s, bad("%v", err)
	}
	for k, v := range q {
		if len(v) != 1 {
			return s, bad("%s given %d times", k, len(v))
		}
		switch k {
		case "layers":
			if s.Layers, err = strconv.Atoi(v[0]); err != nil || s.Layers < 0 {
				return s, bad("layers %q: want a number >= 0", v[0])
			}
		case "seed":
			if s.Seed, err = strconv.ParseUint(v[0], 10, 64); err != nil {
				return s, bad("seed %q: want an unsigned number", v[0])
			}
		case "steps":
			for f := range strings.SplitSeq(v[0], ",") {
				x, err := strconv.ParseFloat(f, 64)
				if err != nil || !(x >= 0 && x <= 1) {
					return s, bad("steps: %q is not a fraction in [0, 1]", f)
				}
				s.Steps = append(s.Steps, x)
			}
		default:
			return s, bad("unknown parameter %q (have layers, seed, steps)", k)
		}
	}
	if _, err := policy.PresetLayers(s.Preset, s.Layers); err != nil {
		return s, bad("%v", err)
	}
	return s, nil
}

// OpenSynthetic assembles the stream of the synthetic checkpoint's tensors
// whose names match only (all if nil), as OpenSource does for a file.
func OpenSynthetic(spec SyntheticSpec, only *regexp.Regexp) (*Source, error) {
	cfg, err := policy.PresetLayers(spec.Preset, spec.Layers)
	if err != nil {
		return nil, fmt.Errorf("refit: source %s: %w", spec, err)
	}
	block := syntheticBlock(spec)
	all := policy.CheckpointTensors(cfg)
	tensors := make([]checkpointTensor, 0, len(all))
	for _, t := range all {
		shape := make([]uint64, len(t.Shape))
		n := uint64(2)
		for i, d := range t.Shape {
			shape[i] = uint64(d)
			n *= uint64(d)
		}
		h := fnv.New64a()
		h.Write([]byte(t.Name))
		salt := int64(h.Sum64()%(syntheticBlockBytes/2)) * 2 // element-aligned
		ct := checkpointTensor{r: &blockReader{block: block, salt: salt}}
		ct.Name, ct.DType, ct.Shape, ct.Size = t.Name, stfile.BF16, shape, int64(n)
		tensors = append(tensors, ct)
	}
	s := &Source{path: spec.String()}
	total := len(tensors)
	if only != nil {
		tensors = slices.DeleteFunc(tensors, func(t checkpointTensor) bool { return !only.MatchString(t.Name) })
	}
	s.full = len(tensors) == total
	if err := s.assemble(tensors, only, total); err != nil {
		return nil, fmt.Errorf("refit: source %s: %w", s.path, err)
	}
	return s, nil
}

// syntheticBlock draws the block of a spec: N(0, 0.02) values in BF16, then
// each step's changes.
func syntheticBlock(spec SyntheticSpec) []byte {
	const n = syntheticBlockBytes / 2
	r := rand.New(rand.NewPCG(spec.Seed, 0x73796e74))
	vals := make([]float32, n)
	for i := range vals {
		vals[i] = float32(r.NormFloat64() * 0.02)
	}
	block := make([]byte, syntheticBlockBytes)
	bf16.Encode(block, vals)
	for i, f := range spec.Steps {
		// Element j changes when its draw falls under f. Flipping the last
		// mantissa bit keeps a finite value finite and always changes it.
		all, limit := f >= 1, uint64(math.Ldexp(f, 64))
		sr := rand.New(rand.NewPCG(spec.Seed, uint64(i)+1))
		for j := 0; j < n; j++ {
			if sr.Uint64() < limit || all {
				v := binary.LittleEndian.Uint16(block[2*j:])
				binary.LittleEndian.PutUint16(block[2*j:], v^1)
			}
		}
	}
	return block
}

// blockReader reads a tensor of a synthetic checkpoint: the block from
// byte salt on, repeated.
type blockReader struct {
	block []byte
	salt  int64
}

// viewAt lends the block's bytes where the n at off do not wrap around
// its end.
func (b *blockReader) viewAt(n, off int64) ([]byte, bool) {
	if off < 0 || n > int64(len(b.block)) {
		return nil, false
	}
	at := (b.salt + off) % int64(len(b.block))
	if at+n > int64(len(b.block)) {
		return nil, false
	}
	return b.block[at : at+n : at+n], true
}

func (b *blockReader) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, errors.New("refit: synthetic tensor: negative offset")
	}
	n := 0
	at := (b.salt + off) % int64(len(b.block))
	for n < len(p) {
		c := copy(p[n:], b.block[at:])
		n += c
		at = 0
	}
	return n, nil
}
