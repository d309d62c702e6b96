package stfile

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"

	"github.com/nlpodyssey/safetensors"
)

// view adapts a Tensor to safetensors.View. Unlike safetensors.TensorView it
// accepts scalars (shape [], one element).
type view struct{ t Tensor }

func (v view) DType() safetensors.DType { return safetensors.DType(v.t.DType) }
func (v view) Shape() []uint64          { return v.t.Shape }
func (v view) Data() []byte             { return v.t.Data }
func (v view) DataLen() uint64          { return uint64(len(v.t.Data)) }

// Write writes tensors and metadata to path as a safetensors file,
// atomically: the bytes go to a temporary file in the same directory, which
// is synced and then renamed over path. On error nothing is left behind and
// an existing file at path is untouched. Names must be unique, non-empty and
// not "__metadata__"; each tensor's Data must hold exactly
// NumElements*DType.Size bytes (a scalar has shape [] and one element).
// Files of github.com/nlpodyssey/safetensors's types are serialized by it;
// a file holding F8E4M3 or F8E5M2 tensors, which it lacks, by
// serializeOwn in the same layout.
func Write(path string, tensors []Tensor, metadata map[string]string) (err error) {
	views := make(map[string]view, len(tensors))
	for _, t := range tensors {
		switch _, dup := views[t.Name]; {
		case t.Name == "":
			return fmt.Errorf("stfile: write %s: tensor with an empty name", path)
		case t.Name == metadataKey:
			return fmt.Errorf("stfile: write %s: tensor name %q is reserved", path, t.Name)
		case dup:
			return fmt.Errorf("stfile: write %s: tensor %q given twice", path, t.Name)
		}
		if err := t.check(); err != nil {
			return fmt.Errorf("stfile: write %s: tensor %q: %w", path, t.Name, err)
		}
		if t.Shape == nil {
			t.Shape = []uint64{} // JSON [] rather than null
		}
		views[t.Name] = view{t}
	}

	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	tmp, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return fmt.Errorf("stfile: write %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	w := bufio.NewWriterSize(tmp, 1<<20)
	serialize := safetensors.SerializeToWriter[view]
	for _, t := range tensors {
		if t.DType > lastLibDType {
			serialize = serializeOwn
		}
	}
	if err := serialize(views, metadata, w); err != nil {
		return fmt.Errorf("stfile: write %s: %w", path, err)
	}
	if err := errors.Join(w.Flush(), tmp.Chmod(0o644), tmp.Sync()); err != nil {
		return fmt.Errorf("stfile: write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("stfile: write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("stfile: write %s: %w", path, err)
	}
	syncDir(dir)
	return nil
}

// syncDir makes a rename in dir durable where the system supports it; a
// failure only weakens durability after a crash, so it is ignored.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
}

// serializeOwn writes a safetensors file as the library does: the 8-byte
// header length, the JSON header (its keys sorted, the metadata's among them) padded
// with spaces to a multiple of 8 bytes, then the tensors' bytes ordered by
// element size, largest first, then by name, so that every tensor stays
// aligned to its element size.
func serializeOwn(views map[string]view, metadata map[string]string, w io.Writer) error {
	names := slices.Sorted(maps.Keys(views))
	sort.SliceStable(names, func(i, j int) bool { return views[names[i]].t.DType.Size() > views[names[j]].t.DType.Size() })
	type info struct {
		DType       string    `json:"dtype"`
		Shape       []uint64  `json:"shape"`
		DataOffsets [2]uint64 `json:"data_offsets"`
	}
	entries := make(map[string]any, len(names)+1) // json.Marshal sorts the keys, as the library's header has them
	if metadata != nil {
		entries[metadataKey] = metadata
	}
	var off uint64
	for _, name := range names {
		t := views[name].t
		n := uint64(len(t.Data))
		entries[name] = info{t.DType.String(), t.Shape, [2]uint64{off, off + n}}
		off += n
	}
	js, err := json.Marshal(entries)
	if err != nil {
		return err
	}
	head := bytes.NewBuffer(js)
	for head.Len()%8 != 0 {
		head.WriteByte(' ')
	}
	if err := binary.Write(w, binary.LittleEndian, uint64(head.Len())); err != nil {
		return err
	}
	if _, err := w.Write(head.Bytes()); err != nil {
		return err
	}
	for _, name := range names {
		if _, err := w.Write(views[name].t.Data); err != nil {
			return err
		}
	}
	return nil
}
