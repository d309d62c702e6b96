package stfile

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"slices"

	"github.com/nlpodyssey/safetensors"
)

// DType is a safetensors element type: the types of
// github.com/nlpodyssey/safetensors, with the same values, and the 8-bit
// floats it lacks, which NVFP4 and FP8 checkpoints store their scales in
// (F8_E4M3, F8_E5M2). Files holding those are read by stfile's own header
// parser and written by its own encoder (write.go).
type DType uint8

// Element types: the library's, then (below) the 8-bit floats.
const (
	BOOL = DType(safetensors.BOOL)
	U8   = DType(safetensors.U8)
	I8   = DType(safetensors.I8)
	I16  = DType(safetensors.I16)
	U16  = DType(safetensors.U16)
	F16  = DType(safetensors.F16)
	BF16 = DType(safetensors.BF16)
	I32  = DType(safetensors.I32)
	U32  = DType(safetensors.U32)
	F32  = DType(safetensors.F32)
	F64  = DType(safetensors.F64)
	I64  = DType(safetensors.I64)
	U64  = DType(safetensors.U64)
)

const (
	F8E4M3 = U64 + 1 + iota // "F8_E4M3": float8_e4m3fn
	F8E5M2                  // "F8_E5M2": float8_e5m2
)

// lastLibDType is the library's largest DType value; lastDType stfile's.
const (
	lastLibDType = U64
	lastDType    = F8E5M2
)

// String returns the type's name in safetensors headers.
func (d DType) String() string {
	switch {
	case d <= lastLibDType:
		return safetensors.DType(d).String()
	case d == F8E4M3:
		return "F8_E4M3"
	case d == F8E5M2:
		return "F8_E5M2"
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// Size returns the bytes of one element (0 for an invalid type).
func (d DType) Size() uint64 {
	switch {
	case d <= lastLibDType:
		return safetensors.DType(d).Size()
	case d <= lastDType:
		return 1
	}
	return 0
}

// ParseDType parses a header's dtype name.
func ParseDType(s string) (DType, error) {
	switch s {
	case "F8_E4M3":
		return F8E4M3, nil
	case "F8_E5M2":
		return F8E5M2, nil
	}
	d, err := safetensors.ParseDType(s)
	if err != nil {
		return 0, err
	}
	return DType(d), nil
}

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
	bad := func(format string, args ...any) (*File, error) {
		return nil, fmt.Errorf("stfile: %s: malformed safetensors file (%d bytes): %s", path, len(buf), fmt.Sprintf(format, args...))
	}
	if len(buf) < 8 {
		return bad("header too small")
	}
	n := binary.LittleEndian.Uint64(buf)
	switch {
	case n > maxHeaderBytes:
		return bad("header too large: max %d, actual %d", maxHeaderBytes, n)
	case n > uint64(len(buf)-8):
		return bad("invalid header length %d", n)
	}
	h, err := parseHeader(buf[8:8+n], uint64(len(buf))-8-n)
	if err != nil {
		return bad("%v", err)
	}
	data := buf[8+n:]
	f := &File{path: path, buf: buf, tensors: make(map[string]Tensor, len(h.entries)), names: h.names, metadata: h.metadata}
	for name, e := range h.entries {
		f.tensors[name] = Tensor{Name: name, DType: e.dtype, Shape: e.shape, Data: data[e.lo:e.hi:e.hi]}
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
