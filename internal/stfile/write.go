package stfile

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/nlpodyssey/safetensors"
)

// view adapts a Tensor to safetensors.View. Unlike safetensors.TensorView it
// accepts scalars (shape [], one element).
type view struct{ t Tensor }

func (v view) DType() safetensors.DType { return v.t.DType }
func (v view) Shape() []uint64          { return v.t.Shape }
func (v view) Data() []byte             { return v.t.Data }
func (v view) DataLen() uint64          { return uint64(len(v.t.Data)) }

// Write writes tensors and metadata to path as a safetensors file,
// atomically: the bytes go to a temporary file in the same directory, which
// is synced and then renamed over path. On error nothing is left behind and
// an existing file at path is untouched. Names must be unique, non-empty and
// not "__metadata__"; each tensor's Data must hold exactly
// NumElements*DType.Size bytes (a scalar has shape [] and one element).
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
	if err := safetensors.SerializeToWriter(views, metadata, w); err != nil {
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
