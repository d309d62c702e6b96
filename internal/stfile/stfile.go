package stfile

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"slices"

	"github.com/nlpodyssey/safetensors"
)

// DType is a safetensors element type.
type DType = safetensors.DType

// Element types, re-exported from github.com/nlpodyssey/safetensors.
const (
	BOOL = safetensors.BOOL
	U8   = safetensors.U8
	I8   = safetensors.I8
	I16  = safetensors.I16
	U16  = safetensors.U16
	F16  = safetensors.F16
	BF16 = safetensors.BF16
	I32  = safetensors.I32
	U32  = safetensors.U32
	F32  = safetensors.F32
	F64  = safetensors.F64
	I64  = safetensors.I64
	U64  = safetensors.U64
)

// lastDType is the largest valid DType value.
const lastDType = U64

// metadataKey is the reserved header key holding the file's string metadata.
const metadataKey = "__metadata__"

// Tensor is one named tensor: its element type, shape (row-major, empty for a
// scalar) and raw little-endian data bytes.
type Tensor struct {
	Name  string
	DType DType
	Shape []uint64
	Data  []byte
}

// NumElements returns the product of the shape (1 for a scalar) and whether it
// fits in an int without overflow.
func (t Tensor) NumElements() (int, bool) {
	return numElements(t.Shape)
}

func numElements(shape []uint64) (int, bool) {
	n := uint64(1)
	for _, d := range shape {
		if d != 0 && n > uint64(maxInt)/d {
			return 0, false
		}
		n *= d
	}
	return int(n), true
}

const maxInt = int(^uint(0) >> 1)

// check reports whether t is well-formed: a valid dtype and exactly
// NumElements*DType.Size data bytes.
func (t Tensor) check() error { return t.checkLen(len(t.Data)) }

// checkLen is check for a tensor of size data bytes.
func (t Tensor) checkLen(size int) error {
	if t.DType > lastDType {
		return fmt.Errorf("invalid dtype %d", uint8(t.DType))
	}
	n, ok := t.NumElements()
	if !ok || uint64(n) > uint64(maxInt)/t.DType.Size() {
		return fmt.Errorf("shape %v is too large", t.Shape)
	}
	if want := n * int(t.DType.Size()); size != want {
		return fmt.Errorf("%s shape %v needs %d data bytes, have %d", t.DType, t.Shape, want, size)
	}
	return nil
}

// File is an open, parsed safetensors file. See the package documentation
// for the ownership rules of the data it hands out.
type File struct {
	path     string
	buf      []byte       // whole file: mapped, or read into memory
	release  func() error // unmaps buf; nil once closed
	tensors  map[string]Tensor
	names    []string
	metadata map[string]string
}

// Open maps the safetensors file at path and parses its header.
func Open(path string) (*File, error) {
	buf, release, err := load(path)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err // the path is named once, below
		}
		return nil, fmt.Errorf("stfile: open %s: %w", path, err)
	}
	f, err := parse(path, buf)
	if err != nil {
		err = errors.Join(err, release())
		return nil, err
	}
	f.release = release
	return f, nil
}

// parse validates buf as a complete safetensors file. The tensors' Data
// slices alias buf.
func parse(path string, buf []byte) (*File, error) {
	n, meta, err := safetensors.ReadMetadata(buf)
	if err != nil {
		return nil, fmt.Errorf("stfile: %s: malformed safetensors file (%d bytes): %w", path, len(buf), err)
	}
	// ReadMetadata checked n+8 <= len(buf) and that the tensors tile the data
	// exactly; bound every tensor again so that no header can make a slice
	// expression below panic, whatever the library's checks miss.
	data := buf[8+n:]
	infos := meta.Tensors()
	f := &File{
		path:     path,
		buf:      buf,
		tensors:  make(map[string]Tensor, len(infos)),
		names:    slices.Sorted(maps.Keys(infos)),
		metadata: meta.Metadata(),
	}
	for name, info := range infos {
		lo, hi := info.DataOffsets[0], info.DataOffsets[1]
		if lo > hi || hi > uint64(len(data)) {
			return nil, fmt.Errorf("stfile: %s: tensor %q: data offsets [%d, %d) outside the %d data bytes", path, name, lo, hi, len(data))
		}
		t := Tensor{Name: name, DType: info.DType, Shape: info.Shape, Data: data[lo:hi:hi]}
		if t.Shape == nil {
			t.Shape = []uint64{}
		}
		if err := t.check(); err != nil {
			return nil, fmt.Errorf("stfile: %s: tensor %q: %w", path, name, err)
		}
		f.tensors[name] = t
	}
	return f, nil
}

// Path returns the path the file was opened with.
func (f *File) Path() string { return f.path }

// Size returns the size of the file in bytes (0 after Close).
func (f *File) Size() int64 { return int64(len(f.buf)) }

// Names returns the tensor names in sorted order. The slice is a copy.
func (f *File) Names() []string { return slices.Clone(f.names) }

// Metadata returns a copy of the file's __metadata__ strings (never nil).
func (f *File) Metadata() map[string]string {
	m := make(map[string]string, len(f.metadata))
	maps.Copy(m, f.metadata)
	return m
}

// Tensor returns the named tensor. Its Data aliases the mapping and is valid
// until Close; its Shape is a copy the caller may keep.
func (f *File) Tensor(name string) (Tensor, error) {
	if f.release == nil {
		return Tensor{}, fmt.Errorf("stfile: %s: tensor %q: file is closed", f.path, name)
	}
	t, ok := f.tensors[name]
	if !ok {
		return Tensor{}, fmt.Errorf("stfile: %s: no tensor %q", f.path, name)
	}
	t.Shape = slices.Clone(t.Shape)
	return t, nil
}

// Close unmaps the file. Data slices from Tensor must not be used afterwards.
// Calling Close again does nothing and returns nil.
func (f *File) Close() error {
	if f.release == nil {
		return nil
	}
	release := f.release
	f.release, f.buf, f.tensors = nil, nil, nil
	if err := release(); err != nil {
		return fmt.Errorf("stfile: close %s: %w", f.path, err)
	}
	return nil
}

// openRegular opens path and checks it is a regular file whose size fits in
// memory; it returns the size.
func openRegular(path string) (*os.File, int, error) {
	fd, err := os.Open(path)
	if err != nil {
		return nil, 0, err
	}
	st, err := fd.Stat()
	if err != nil {
		fd.Close()
		return nil, 0, err
	}
	if st.IsDir() {
		fd.Close()
		return nil, 0, errors.New("is a directory, not a safetensors file")
	}
	if !st.Mode().IsRegular() {
		fd.Close()
		return nil, 0, errors.New("not a regular file")
	}
	if st.Size() > int64(maxInt) {
		fd.Close()
		return nil, 0, fmt.Errorf("file of %d bytes does not fit in memory", st.Size())
	}
	return fd, int(st.Size()), nil
}
