package policy

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
)

// Checkpoint file names, as transformers writes them.
const (
	SingleFileName = "model.safetensors"
	IndexFileName  = "model.safetensors.index.json"
)

// maxListed is how many entries of one kind a CheckpointError prints; the
// rest are counted. A wrong layer count alone can make thousands.
const maxListed = 20

// CheckpointError is every problem LoadCheckpoint found in a checkpoint,
// by kind. Each entry names the tensor (or file) it is about.
type CheckpointError struct {
	Dir        string
	Files      []string // unreadable shards, index entries that disagree with the shards
	Unexpected []string // tensors the model has no place for
	DType      []string // tensors that are not BF16
	Misshapen  []string // tensors whose shape is not the model's
	NonFinite  []string // tensors holding NaN or Inf
	Duplicate  []string // tensors written by more than one checkpoint tensor
	Missing    []string // canonical tensors (Model.Tensors) no checkpoint tensor covers
	Scales     []string // NVFP4 modules whose scales the model cannot take as given
}

// Count returns the number of problems.
func (e *CheckpointError) Count() int {
	n := 0
	for _, k := range e.kinds() {
		n += len(k.list)
	}
	return n
}

type problemKind struct {
	name string
	list []string
}

func (e *CheckpointError) kinds() []problemKind {
	return []problemKind{{"file", e.Files}, {"unexpected", e.Unexpected}, {"wrong dtype", e.DType},
		{"misshapen", e.Misshapen}, {"non-finite", e.NonFinite}, {"duplicate", e.Duplicate}, {"missing", e.Missing}, {"scales", e.Scales}}
}

func (e *CheckpointError) Error() string {
	var b strings.Builder
	n := e.Count()
	fmt.Fprintf(&b, "policy: load %s: %d problem", e.Dir, n)
	if n != 1 {
		b.WriteString("s")
	}
	for _, k := range e.kinds() {
		if len(k.list) == 0 {
			continue
		}
		fmt.Fprintf(&b, "\n  %s (%d):", k.name, len(k.list))
		for _, s := range k.list[:min(len(k.list), maxListed)] {
			b.WriteString("\n    ")
			b.WriteString(s)
		}
		if len(k.list) > maxListed {
			fmt.Fprintf(&b, "\n    ... and %d more", len(k.list)-maxListed)
		}
	}
	return b.String()
}

// LoadModel builds a model from a Hugging Face model directory: it parses
// dir/config.json, allocates the model on be and loads the checkpoint. On
// error nothing stays allocated.
func LoadModel(be kernels.Backend, dir string, opts ModelOptions) (*Model, error) {
	cfg, err := LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	m, err := NewModel(be, cfg, opts)
	if err != nil {
		return nil, err
	}
	if err := LoadCheckpoint(m, dir); err != nil {
		return nil, errors.Join(err, m.Close())
	}
	return m, nil
}

// ckptEntry is one tensor of the checkpoint and where it goes.
type ckptEntry struct {
	t      stfile.Tensor // Data aliases the file's mapping
	file   string        // base name, for messages
	target Target
	ok     bool // resolves, BF16, right shape: will be uploaded
}

// LoadCheckpoint loads the weights of m from the safetensors checkpoint in
// dir: model.safetensors, or else the shards that model.safetensors.index.json
// names in its "weight_map" (config.json is not read; see LoadModel).
//
// Every tensor must be BF16, resolve (Model.Resolve) and have the shape the
// model expects; every canonical tensor (Model.Tensors) must be covered
// exactly once, by its per-expert name or by a fused per-layer expert
// tensor; no value may be NaN or Inf. A linear layer may instead come
// quantized to NVFP4 in ModelOpt's layout (nvfp4ckpt.go): its BF16 weights
// are then its dequantization, and an expert's NVFP4 copies take its codes
// and scales as they are. All problems are collected and returned as one
// *CheckpointError, and then m's weights are left as they were: nothing is
// uploaded until the whole checkpoint has been checked (only a failing
// Backend.Upload can leave a partial load).
//
// Files are memory-mapped; BF16 tensor bytes go from the mapping straight
// to Backend.Upload, with no copy in between. After the upload the NVFP4
// expert copies of the experts that came as BF16 are rebuilt
// (Model.Requantize). Under the per_tensor recipe, the experts'
// input_scale tensors, when the checkpoint has them for every layer, set
// the layers' input scales (as ReadInputScales reads them).
func LoadCheckpoint(m *Model, dir string) error {
	src, perr, err := openCheckpoint(dir)
	defer src.close()
	if err != nil {
		return fmt.Errorf("policy: load %s: %w", dir, err)
	}
	mods, entries := nvfp4Parts(src.entries)

	canon, err := m.Tensors()
	if err != nil {
		return fmt.Errorf("policy: load %s: %w", dir, err)
	}
	cov := newCoverage(canon)
	var bf16Targets []Target
	for i := range entries {
		e := &entries[i]
		tg, err := m.Resolve(e.t.Name)
		if err != nil {
			perr.Unexpected = append(perr.Unexpected, fmt.Sprintf("%s (in %s): %s", e.t.Name, e.file, strings.TrimPrefix(err.Error(), "policy: ")))
			continue
		}
		e.target = tg
		cov.add(tg)
		bf16Targets = append(bf16Targets, tg)
		e.ok = true
		if e.t.DType != stfile.BF16 {
			perr.DType = append(perr.DType, fmt.Sprintf("%s (in %s): %s, want BF16 (or an NVFP4 module: U8 weight, F8_E4M3 weight_scale, F32 weight_scale_2)", e.t.Name, e.file, e.t.DType))
			e.ok = false
		}
		if !sameShape(e.t.Shape, tg.Shape) {
			perr.Misshapen = append(perr.Misshapen, fmt.Sprintf("%s (in %s): shape %v, want %v", e.t.Name, e.file, e.t.Shape, tg.Shape))
			e.ok = false
		}
	}
	qmods := m.checkNVFP4(mods, perr, cov)
	quantExperts := m.checkExperts(qmods, bf16Targets, perr)
	scales, hasScales := m.checkpointInputScales(mods, perr)
	perr.Duplicate = cov.duplicates()
	perr.Missing = append(perr.Missing, cov.missing()...)
	perr.NonFinite = append(perr.NonFinite, checkFinite(entries)...)
	if perr.Count() > 0 {
		return perr
	}

	be := m.Backend()
	for _, e := range entries {
		if err := be.Upload(e.target.Buffer, e.target.Offset, e.t.Data); err != nil {
			return fmt.Errorf("policy: load %s: upload %s: %w", dir, e.t.Name, err)
		}
	}
	if err := m.uploadNVFP4(qmods); err != nil {
		return fmt.Errorf("policy: load %s: %w", dir, err)
	}
	if err := m.setQuantizedExperts(quantExperts); err != nil {
		return fmt.Errorf("policy: load %s: %w", dir, err)
	}
	for i, l := range m.layers {
		var requant []int
		for e := range m.cfg.Experts {
			if _, ok := quantExperts[expertKey{i, e}]; !ok {
				requant = append(requant, e)
			}
		}
		if len(requant) == 0 {
			continue
		}
		if len(requant) == m.cfg.Experts {
			requant = nil // all of them, in one pass
		}
		if err := l.moe.Requantize(requant...); err != nil {
			return fmt.Errorf("policy: load %s: layer %d: %w", dir, i, err)
		}
	}
	if hasScales && m.opts.Recipe == moe.RecipePerTensor {
		if err := m.SetInputScales(scales); err != nil {
			return fmt.Errorf("policy: load %s: %w", dir, err)
		}
	}
	// The files are unmapped on return: a device backend must have finished
	// reading them.
	if err := be.Sync(); err != nil {
		return fmt.Errorf("policy: load %s: %w", dir, err)
	}
	return nil
}

func sameShape(got []uint64, want []int) bool {
	if len(got) != len(want) {
		return false
	}
	for i := range got {
		if got[i] != uint64(want[i]) {
			return false
		}
	}
	return true
}

// ckptSource is the open files of a checkpoint and the tensors they hold.
type ckptSource struct {
	files   []*stfile.File
	entries []ckptEntry
}

func (s *ckptSource) close() {
	for _, f := range s.files {
		f.Close() // read-only mappings: nothing to lose
	}
}

// openCheckpoint opens dir's checkpoint. It returns an error when there is
// no checkpoint to check at all; problems with some of its files go into
// the *CheckpointError, with those of the tensors. The source must be closed
// in every case. Like transformers, a single model.safetensors takes
// precedence over an index.
func openCheckpoint(dir string) (*ckptSource, *CheckpointError, error) {
	s := &ckptSource{}
	perr := &CheckpointError{Dir: dir}
	single := filepath.Join(dir, SingleFileName)
	if _, err := os.Stat(single); err == nil {
		f, err := stfile.Open(single)
		if err != nil {
			return s, nil, err
		}
		s.files = append(s.files, f)
		for _, name := range f.Names() {
			t, _ := f.Tensor(name) // listed by Names: cannot fail
			s.entries = append(s.entries, ckptEntry{t: t, file: SingleFileName})
		}
		return s, perr, nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return s, nil, err
	}

	data, err := os.ReadFile(filepath.Join(dir, IndexFileName))
	if errors.Is(err, fs.ErrNotExist) {
		return s, nil, fmt.Errorf("no %s or %s", SingleFileName, IndexFileName)
	} else if err != nil {
		return s, nil, err
	}
	var index struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(data, &index); err != nil {
		return s, nil, fmt.Errorf("%s: %w", IndexFileName, err)
	}
	if len(index.WeightMap) == 0 {
		return s, nil, fmt.Errorf("%s: empty or missing weight_map", IndexFileName)
	}
	byFile := map[string][]string{}
	for name, file := range index.WeightMap {
		byFile[file] = append(byFile[file], name)
	}
	for _, file := range slices.Sorted(maps.Keys(byFile)) {
		names := byFile[file]
		slices.Sort(names)
		// Shards live next to the index: a path out of dir is not a shard.
		if !filepath.IsLocal(file) {
			perr.Files = append(perr.Files, fmt.Sprintf("%s: shard %q (for %d tensors) is not a file in the model directory", IndexFileName, file, len(names)))
			continue
		}
		f, err := stfile.Open(filepath.Join(dir, file))
		if err != nil {
			perr.Files = append(perr.Files, fmt.Sprintf("shard %s (for %d tensors, first %s): %v", file, len(names), names[0], err))
			continue
		}
		s.files = append(s.files, f)
		for _, name := range names {
			t, err := f.Tensor(name)
			if err != nil {
				perr.Files = append(perr.Files, fmt.Sprintf("%s puts %s in %s, which does not hold it", IndexFileName, name, file))
				continue
			}
			s.entries = append(s.entries, ckptEntry{t: t, file: file})
		}
		// transformers reads only what the index lists; a shard tensor the
		// index places elsewhere (or nowhere) means the two disagree.
		for _, name := range f.Names() {
			if other := index.WeightMap[name]; other != file {
				where := "does not list it"
				if other != "" {
					where = "puts it in " + other
				}
				perr.Files = append(perr.Files, fmt.Sprintf("%s holds %s, but %s %s", file, name, IndexFileName, where))
			}
		}
	}
	return s, perr, nil
}

// coverage counts how often each canonical tensor is written. A checkpoint
// tensor covers the canonical tensors lying inside its byte range of the
// same buffer: one for a per-expert or dense tensor, a layer's worth of
// experts for a fused one.
type coverage struct {
	canon []Target
	byBuf map[*kernels.Buffer][]int // indices into canon, by offset
	by    [][]string                // checkpoint tensors covering each canonical one
	size  map[string]int            // canonical tensors each checkpoint tensor covers
}

func newCoverage(canon []Target) *coverage {
	c := &coverage{canon: canon, byBuf: map[*kernels.Buffer][]int{}, by: make([][]string, len(canon)),
		size: map[string]int{}}
	for i, t := range canon {
		c.byBuf[t.Buffer] = append(c.byBuf[t.Buffer], i)
	}
	for _, idx := range c.byBuf {
		sort.SliceStable(idx, func(a, b int) bool { return canon[idx[a]].Offset < canon[idx[b]].Offset })
	}
	return c
}

func (c *coverage) add(t Target) {
	idx := c.byBuf[t.Buffer]
	lo, hi := t.Offset, t.Offset+t.Size()
	for k := sort.Search(len(idx), func(k int) bool { return c.canon[idx[k]].Offset >= lo }); k < len(idx); k++ {
		ct := c.canon[idx[k]]
		if ct.Offset+ct.Size() > hi {
			break
		}
		c.by[idx[k]] = append(c.by[idx[k]], t.Name)
		c.size[t.Name]++
	}
}

func (c *coverage) missing() []string {
	var out []string
	for i, by := range c.by {
		if len(by) == 0 {
			out = append(out, c.canon[i].Name)
		}
	}
	return out
}

// duplicates reports the checkpoint tensors that write the same place,
// grouped under the one covering the most (a fused tensor next to
// per-expert ones is one entry, not one per expert).
func (c *coverage) duplicates() []string {
	type group struct {
		others []string // the other writers
		canon  []string // the canonical tensors written more than once
	}
	var keys []string
	groups := map[string]*group{}
	for i, by := range c.by {
		if len(by) < 2 {
			continue
		}
		key := by[0]
		for _, w := range by[1:] {
			if c.size[w] > c.size[key] || c.size[w] == c.size[key] && w < key {
				key = w
			}
		}
		g := groups[key]
		if g == nil {
			g = &group{}
			groups[key] = g
			keys = append(keys, key)
		}
		g.canon = append(g.canon, c.canon[i].Name)
		for _, w := range by {
			if w != key && !slices.Contains(g.others, w) {
				g.others = append(g.others, w)
			}
		}
	}
	out := make([]string, 0, len(keys))
	for _, key := range keys {
		g := groups[key]
		if len(g.canon) == 1 {
			out = append(out, fmt.Sprintf("%s: written by %s and %s", g.canon[0], key, strings.Join(g.others, " and ")))
			continue
		}
		others := strings.Join(g.others[:min(len(g.others), 3)], ", ")
		if len(g.others) > 3 {
			others += fmt.Sprintf(" and %d more", len(g.others)-3)
		}
		out = append(out, fmt.Sprintf("%s overlaps %s: %d tensors written more than once", key, others, len(g.canon)))
	}
	return out
}

// checkFinite scans the BF16 tensors of the entries that would be uploaded
// for NaN and Inf, in parallel, and reports the first bad element of each.
func checkFinite(entries []ckptEntry) []string {
	bad := make([]string, len(entries))
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(entries)) {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= len(entries) {
					return
				}
				if e := entries[i]; e.ok {
					if j := bf16.FirstNonFinite(e.t.Data); j >= 0 {
						h := binary.LittleEndian.Uint16(e.t.Data[2*j:])
						bad[i] = fmt.Sprintf("%s (in %s): %v at element %v", e.t.Name, e.file, bf16.ToFloat32(h), unflatten(j, e.t.Shape))
					}
				}
			}
		})
	}
	wg.Wait()
	var out []string
	for _, s := range bad {
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}

// unflatten turns a row-major element index into a multi-index.
func unflatten(i int, shape []uint64) []int {
	idx := make([]int, len(shape))
	for d := len(shape) - 1; d >= 0; d-- {
		if shape[d] > 0 {
			idx[d] = i % int(shape[d])
			i /= int(shape[d])
		}
	}
	return idx
}
