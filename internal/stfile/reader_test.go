package stfile

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// sameAsOpen checks that OpenReader and Open agree on the file at path:
// both refuse it, or both describe the same tensors and the Reader reads
// the bytes the mapping holds.
func sameAsOpen(t *testing.T, path string) {
	t.Helper()
	f, ferr := Open(path)
	r, rerr := OpenReader(path)
	if (ferr == nil) != (rerr == nil) {
		t.Fatalf("Open: %v; OpenReader: %v", ferr, rerr)
	}
	if ferr != nil {
		if !strings.Contains(rerr.Error(), path) {
			t.Errorf("error %q does not name the file", rerr)
		}
		return
	}
	defer f.Close()
	defer r.Close()
	if !slices.Equal(f.Names(), r.Names()) || !reflect.DeepEqual(f.Metadata(), r.Metadata()) || f.Size() != r.Size() {
		t.Fatalf("names %q / %q, metadata %v / %v", f.Names(), r.Names(), f.Metadata(), r.Metadata())
	}
	for _, name := range f.Names() {
		want, err := f.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		got, err := r.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		if got.DType != want.DType || !slices.Equal(got.Shape, want.Shape) || got.Size != int64(len(want.Data)) {
			t.Fatalf("tensor %q: %s%v of %d bytes, Open says %s%v of %d", name, got.DType, got.Shape, got.Size, want.DType, want.Shape, len(want.Data))
		}
		b := make([]byte, got.Size)
		if n, err := r.ReadAt(b, got.Offset); n != len(b) || err != nil || !bytes.Equal(b, want.Data) {
			t.Fatalf("tensor %q: read %d bytes (%v), or other bytes", name, n, err)
		}
	}
}

// TestReader: OpenReader describes every file Open accepts the same way and
// reads the same bytes, and refuses what Open refuses, naming the file.
func TestReader(t *testing.T) {
	good := validFile(t)
	files := map[string][]byte{
		"valid":           good,
		"empty tensors":   header(`{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`, nil),
		"scalar":          header(`{"a":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}`, []byte{7}),
		"8-bit floats":    header(`{"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"F8_E5M2","shape":[1],"data_offsets":[2,3]}}`, []byte{0x38, 0x7e, 0x3c}),
		"no tensors":      header(`{}`, nil),
		"empty":           {},
		"short":           {1, 2, 3},
		"truncated data":  good[:len(good)-1],
		"truncated head":  good[:20],
		"extra byte":      append(slices.Clone(good), 0),
		"length past end": binary.LittleEndian.AppendUint64(nil, 1000),
		"length huge":     binary.LittleEndian.AppendUint64(nil, 1<<62),
		"not json":        header(`{"a":`, nil),
		"offset mismatch": header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`, make([]byte, 4)),
		"gap":             header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, make([]byte, 2)),
		"huge shape":      header(`{"a":{"dtype":"U64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}`, nil),
	}
	for name, data := range files {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "in.safetensors")
			if err := os.WriteFile(path, data, 0o644); err != nil {
				t.Fatal(err)
			}
			sameAsOpen(t, path)
		})
	}
	if _, err := OpenReader(t.TempDir()); err == nil || !strings.Contains(err.Error(), "is a directory") {
		t.Errorf("a directory: %v", err)
	}
	path := filepath.Join(t.TempDir(), "in.safetensors")
	if err := os.WriteFile(path, good, 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := OpenReader(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Tensor("nope"); err == nil {
		t.Error("a missing tensor described")
	}
	if n, err := r.ReadAt(make([]byte, 10), r.Size()-4); n != 4 || err == nil {
		t.Errorf("a read past the end: %d bytes, %v", n, err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
}

// FuzzOpenReader feeds arbitrary bytes to OpenReader as a file: it agrees
// with Open (which checks the same file through a mapping) and never
// panics.
func FuzzOpenReader(f *testing.F) {
	addFileSeeds(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		path := filepath.Join(t.TempDir(), "fuzz.safetensors")
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		sameAsOpen(t, path)
	})
}
