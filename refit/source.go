package refit

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/policy"
)

// Source is the safetensors byte stream of a version, assembled from the
// selected tensors of a checkpoint without copying them: a new header,
// then each tensor's bytes read from the checkpoint's files into the
// caller's buffer (pread: stfile.Reader), only when asked for. It is an
// io.ReaderAt for Publisher.Publish. Memory stays bounded by the header
// (and the caller's buffers) whatever the checkpoint's size: no page of
// the checkpoint is mapped, so none counts in the process's resident
// memory. The checkpoint's files must not change until Close.
type Source struct {
	path    string
	files   []*stfile.Reader
	head    []byte      // the stream's length and JSON header
	tensors []srcTensor // in stream order
	size    int64
	names   []string // in stream order
	full    bool
	closed  bool
}

// srcTensor is one tensor of a Source: its bytes are those at off in file
// r, and at stream in the stream.
type srcTensor struct {
	name   string
	shape  []uint64
	r      io.ReaderAt
	off    int64
	size   int64
	stream int64
}

// readTensor reads tensor i's bytes from off into p.
func (s *Source) readTensor(i int, p []byte, off int64) error {
	_, err := s.tensorBytes(i, p, off, false)
	return err
}

// viewTensor returns the len(p) bytes of tensor i at off: the checkpoint's
// own memory where its reader lends it (a viewer; not to be written), else
// p, read into.
func (s *Source) viewTensor(i int, p []byte, off int64) ([]byte, error) {
	return s.tensorBytes(i, p, off, true)
}

// viewer is a tensor reader that can lend its bytes in place: viewAt
// returns the n bytes at off without copying them, or false when it
// cannot (the caller then reads them).
type viewer interface {
	viewAt(n, off int64) ([]byte, bool)
}

// tensorBytes is readTensor, or viewTensor where view is set.
func (s *Source) tensorBytes(i int, p []byte, off int64, view bool) ([]byte, error) {
	if s.closed {
		return nil, fmt.Errorf("refit: source %s: read after close", s.path)
	}
	t := s.tensors[i]
	if off < 0 || off > t.size-int64(len(p)) {
		return nil, fmt.Errorf("refit: source %s: tensor %s: %d bytes at %d of %d", s.path, t.name, len(p), off, t.size)
	}
	if len(p) == 0 {
		return p, nil
	}
	if v, ok := t.r.(viewer); ok && view {
		if b, ok := v.viewAt(int64(len(p)), t.off+off); ok {
			return b, nil
		}
	}
	if _, err := t.r.ReadAt(p, t.off+off); err != nil {
		return nil, fmt.Errorf("refit: source %s: tensor %s: %w", s.path, t.name, err)
	}
	return p, nil
}

// checkpointTensor is a tensor of a checkpoint file, and the file.
type checkpointTensor struct {
	stfile.TensorInfo
	r io.ReaderAt
}

// OpenSource opens the checkpoint at path and assembles the stream of its
// tensors whose names match only (every tensor if only is nil). path is a
// safetensors file, or a model directory holding model.safetensors or else
// the shards that model.safetensors.index.json lists, or a synthetic
// checkpoint (SyntheticPrefix).
//
// Every selected tensor must be BF16 (the error names those that are not),
// and at least one must be selected. Tensors are laid out in natural name
// order (layer 2 before layer 10), so a version streams layer by layer.
//
// Full reports whether every tensor of the checkpoint was selected: always
// without only, and with only when it happens to match them all. The
// checkpoint is trusted to hold the whole model: a file or directory
// holding only some tensors is published as full unless only excludes some
// (workers reject a "full" version that does not cover their model).
func OpenSource(path string, only *regexp.Regexp) (*Source, error) {
	if strings.HasPrefix(path, SyntheticPrefix) {
		spec, err := ParseSyntheticSpec(path)
		if err != nil {
			return nil, err
		}
		return OpenSynthetic(spec, only)
	}
	s := &Source{path: path}
	tensors, err := s.open()
	if err != nil {
		return nil, errors.Join(fmt.Errorf("refit: source %s: %w", path, err), s.Close())
	}
	total := len(tensors)
	if only != nil {
		tensors = slices.DeleteFunc(tensors, func(t checkpointTensor) bool { return !only.MatchString(t.Name) })
	}
	s.full = len(tensors) == total
	if err := s.assemble(tensors, only, total); err != nil {
		return nil, errors.Join(fmt.Errorf("refit: source %s: %w", path, err), s.Close())
	}
	return s, nil
}

// open opens the checkpoint's files and returns all its tensors.
func (s *Source) open() ([]checkpointTensor, error) {
	fi, err := os.Stat(s.path)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return s.openFile(s.path, nil)
	}
	single := filepath.Join(s.path, policy.SingleFileName)
	if _, err := os.Stat(single); err == nil {
		return s.openFile(single, nil)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	data, err := os.ReadFile(filepath.Join(s.path, policy.IndexFileName))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("no %s or %s in the directory", policy.SingleFileName, policy.IndexFileName)
	} else if err != nil {
		return nil, err
	}
	var index struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(data, &index); err != nil {
		return nil, fmt.Errorf("%s: %w", policy.IndexFileName, err)
	}
	if len(index.WeightMap) == 0 {
		return nil, fmt.Errorf("%s: empty or missing weight_map", policy.IndexFileName)
	}
	byFile := map[string][]string{}
	for name, file := range index.WeightMap {
		byFile[file] = append(byFile[file], name)
	}
	var all []checkpointTensor
	for _, file := range slices.Sorted(maps.Keys(byFile)) {
		if !filepath.IsLocal(file) {
			return nil, fmt.Errorf("%s: shard %q is not a file in the model directory", policy.IndexFileName, file)
		}
		ts, err := s.openFile(filepath.Join(s.path, file), byFile[file])
		if err != nil {
			return nil, err
		}
		all = append(all, ts...)
	}
	return all, nil
}

// openFile opens one safetensors file (its header read, none of its data)
// and returns the named tensors (all if names is nil).
func (s *Source) openFile(path string, names []string) ([]checkpointTensor, error) {
	f, err := stfile.OpenReader(path)
	if err != nil {
		return nil, err
	}
	s.files = append(s.files, f)
	if names == nil {
		names = f.Names()
	}
	out := make([]checkpointTensor, 0, len(names))
	for _, name := range names {
		t, err := f.Tensor(name)
		if err != nil {
			return nil, fmt.Errorf("%s lists %s in %s: %w", policy.IndexFileName, name, filepath.Base(path), err)
		}
		out = append(out, checkpointTensor{t, f})
	}
	return out, nil
}

// assemble checks the selected tensors and lays out the stream.
func (s *Source) assemble(tensors []checkpointTensor, only *regexp.Regexp, total int) error {
	if len(tensors) == 0 {
		if only != nil {
			return fmt.Errorf("no tensor name matches %q (of %d tensors)", only, total)
		}
		return errors.New("no tensors")
	}
	if len(tensors) > MaxTensors {
		return fmt.Errorf("%d tensors selected, at most %d go in a version", len(tensors), MaxTensors)
	}
	var bad []string
	for _, t := range tensors {
		if t.DType != stfile.BF16 {
			bad = append(bad, fmt.Sprintf("%s (%s)", t.Name, t.DType))
		}
	}
	if len(bad) > 0 {
		slices.SortFunc(bad, naturalCompare)
		return fmt.Errorf("%d selected tensors are not BF16 (a version holds BF16 tensors only): %s", len(bad), listSome(bad, 10))
	}
	slices.SortFunc(tensors, func(a, b checkpointTensor) int { return naturalCompare(a.Name, b.Name) })
	entries := make([]headerOut, len(tensors))
	for i, t := range tensors {
		entries[i] = headerOut{name: t.Name, dtype: "BF16", shape: t.Shape, size: t.Size}
	}
	head, err := versionHeader(entries)
	if err != nil {
		return err
	}
	s.head = head
	s.size = int64(len(head))
	for _, t := range tensors {
		s.names = append(s.names, t.Name)
		s.tensors = append(s.tensors, srcTensor{name: t.Name, shape: t.Shape, r: t.r, off: t.Offset, size: t.Size, stream: s.size})
		s.size += t.Size
	}
	if s.size > MaxStreamBytes {
		return fmt.Errorf("a stream of %d bytes: at most %d go in a version", s.size, MaxStreamBytes)
	}
	return nil
}

// headerOut is one tensor entry of a header the publisher writes.
type headerOut struct {
	name  string
	dtype string
	shape []uint64
	size  int64 // bytes of its data
}

// versionHeader returns the first bytes of a version stream of the
// tensors, in this order: the 8-byte length and the JSON header
// {"name":{"dtype":"BF16","shape":[...],"data_offsets":[b,e]},...}, padded
// with spaces to a multiple of 8 bytes.
func versionHeader(entries []headerOut) ([]byte, error) {
	var js strings.Builder
	js.WriteByte('{')
	var at int64
	for i, t := range entries {
		if i > 0 {
			js.WriteByte(',')
		}
		name, _ := json.Marshal(t.name) // a string always encodes
		js.Write(name)
		fmt.Fprintf(&js, `:{"dtype":%q,"shape":[`, t.dtype)
		for j, d := range t.shape {
			if j > 0 {
				js.WriteByte(',')
			}
			js.WriteString(strconv.FormatUint(d, 10))
		}
		end := at + t.size
		fmt.Fprintf(&js, `],"data_offsets":[%d,%d]}`, at, end)
		at = end
	}
	js.WriteByte('}')
	for (8+js.Len())%8 != 0 {
		js.WriteByte(' ')
	}
	if js.Len() > MaxHeaderBytes {
		return nil, fmt.Errorf("a header of %d bytes for %d tensors: at most %d", js.Len(), len(entries), MaxHeaderBytes)
	}
	head := make([]byte, 8+js.Len())
	binary.LittleEndian.PutUint64(head, uint64(js.Len()))
	copy(head[8:], js.String())
	return head, nil
}

// Size is the stream's length in bytes.
func (s *Source) Size() int64 { return s.size }

// Names returns the selected tensors' names in stream order.
func (s *Source) Names() []string { return slices.Clone(s.names) }

// Full reports whether every tensor of the checkpoint is in the stream.
func (s *Source) Full() bool { return s.full }

// ReadAt reads stream bytes at off (io.ReaderAt): the header from memory,
// tensor bytes from the checkpoint's files straight into p. It may be
// called concurrently, until Close.
func (s *Source) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("refit: source %s: read at negative offset %d", s.path, off)
	}
	if s.closed {
		return 0, fmt.Errorf("refit: source %s: read after close", s.path)
	}
	n := 0
	if off < int64(len(s.head)) {
		n = copy(p, s.head[off:])
	}
	// The first tensor ending after the next byte wanted.
	i := sort.Search(len(s.tensors), func(i int) bool { return s.tensors[i].stream+s.tensors[i].size > off+int64(n) })
	for ; i < len(s.tensors) && n < len(p); i++ {
		t := s.tensors[i]
		at := off + int64(n) - t.stream
		m := int(min(int64(len(p)-n), t.size-at))
		if err := s.readTensor(i, p[n:n+m], at); err != nil {
			return n, err
		}
		n += m
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// Close closes the checkpoint's files. It is idempotent.
func (s *Source) Close() error {
	var errs []error
	for _, f := range s.files {
		errs = append(errs, f.Close())
	}
	s.files, s.closed = nil, true
	return errors.Join(errs...)
}

// naturalCompare orders strings with their runs of digits compared as
// numbers: "layers.2" < "layers.10".
func naturalCompare(a, b string) int {
	for a != "" && b != "" {
		da, db := digitRun(a), digitRun(b)
		if da > 0 && db > 0 {
			na, nb := strings.TrimLeft(a[:da], "0"), strings.TrimLeft(b[:db], "0")
			if c := len(na) - len(nb); c != 0 {
				return c
			}
			if c := strings.Compare(na, nb); c != 0 {
				return c
			}
			if c := da - db; c != 0 { // "01" after "1"
				return c
			}
			a, b = a[da:], b[db:]
			continue
		}
		if a[0] != b[0] {
			return int(a[0]) - int(b[0])
		}
		a, b = a[1:], b[1:]
	}
	return len(a) - len(b)
}

// digitRun is the length of the run of ASCII digits at the start of s.
func digitRun(s string) int {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return i
}
