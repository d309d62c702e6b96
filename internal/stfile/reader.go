package stfile

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"slices"
)

// maxHeaderBytes bounds the JSON header a Reader reads, as the safetensors
// library bounds it.
const maxHeaderBytes = 100_000_000

// TensorInfo describes a tensor of a file opened with OpenReader: where its
// bytes lie in the file, not the bytes themselves.
type TensorInfo struct {
	Name   string
	DType  DType
	Shape  []uint64
	Offset int64 // of its first byte in the file
	Size   int64 // bytes
}

// Reader is a safetensors file opened for reads with ReadAt (pread) rather
// than mapped: only its header is held in memory, and no page of the file
// counts in the process's resident memory, so a process that streams
// checkpoints larger than its memory (the refit publisher) stays within a
// bound. Its checks are Open's: every tensor's range inside the file, the
// ranges tiling the data section exactly.
//
// ReadAt may be called concurrently with itself and the other methods but
// Close. Another process truncating the file makes later reads fail (not
// fault, as a mapping would).
type Reader struct {
	path     string
	f        *os.File
	size     int64
	tensors  map[string]TensorInfo
	names    []string
	metadata map[string]string
}

// OpenReader opens the safetensors file at path and reads and checks its
// header.
func OpenReader(path string) (*Reader, error) {
	fd, size, err := openRegular(path)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return nil, fmt.Errorf("stfile: open %s: %w", path, err)
	}
	r, err := readHeader(path, fd, int64(size))
	if err != nil {
		fd.Close()
		return nil, err
	}
	return r, nil
}

// readHeader reads the header of the file fd of size bytes.
func readHeader(path string, fd *os.File, size int64) (*Reader, error) {
	bad := func(format string, args ...any) (*Reader, error) {
		return nil, fmt.Errorf("stfile: %s: malformed safetensors file (%d bytes): %s", path, size, fmt.Sprintf(format, args...))
	}
	var lenBuf [8]byte
	if size < 8 {
		return bad("header too small")
	}
	if _, err := fd.ReadAt(lenBuf[:], 0); err != nil {
		return nil, fmt.Errorf("stfile: read %s: %w", path, err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	switch {
	case n > maxHeaderBytes:
		return bad("header too large: max %d, actual %d", maxHeaderBytes, n)
	case int64(n) > size-8:
		return bad("invalid header length %d", n)
	}
	head := make([]byte, n)
	if _, err := fd.ReadAt(head, 8); err != nil && !(errors.Is(err, io.EOF) && n == 0) {
		return nil, fmt.Errorf("stfile: read %s: %w", path, err)
	}
	h, err := parseHeader(head, uint64(size-8-int64(n)))
	if err != nil {
		return bad("%v", err)
	}
	r := &Reader{path: path, f: fd, size: size, tensors: make(map[string]TensorInfo, len(h.entries)), names: h.names, metadata: h.metadata}
	dataStart := 8 + int64(n)
	for name, e := range h.entries {
		r.tensors[name] = TensorInfo{Name: name, DType: e.dtype, Shape: e.shape, Offset: dataStart + int64(e.lo), Size: int64(e.hi - e.lo)}
	}
	return r, nil
}

// Path returns the path the file was opened with.
func (r *Reader) Path() string { return r.path }

// Size returns the size of the file in bytes.
func (r *Reader) Size() int64 { return r.size }

// Names returns the tensor names in sorted order. The slice is a copy.
func (r *Reader) Names() []string { return slices.Clone(r.names) }

// Metadata returns a copy of the file's __metadata__ strings (never nil).
func (r *Reader) Metadata() map[string]string { return maps.Clone(r.metadata) }

// Tensor describes the named tensor; its Shape is a copy.
func (r *Reader) Tensor(name string) (TensorInfo, error) {
	t, ok := r.tensors[name]
	if !ok {
		return TensorInfo{}, fmt.Errorf("stfile: %s: no tensor %q", r.path, name)
	}
	t.Shape = slices.Clone(t.Shape)
	return t, nil
}

// ReadAt reads file bytes at off (io.ReaderAt).
func (r *Reader) ReadAt(p []byte, off int64) (int, error) {
	n, err := r.f.ReadAt(p, off)
	if err != nil && !(errors.Is(err, io.EOF) && n == len(p)) {
		if errors.Is(err, io.EOF) {
			return n, err
		}
		return n, fmt.Errorf("stfile: read %s: %w", r.path, err)
	}
	return n, nil
}

// Close closes the file. It is idempotent.
func (r *Reader) Close() error {
	if r.f == nil {
		return nil
	}
	f := r.f
	r.f = nil
	if err := f.Close(); err != nil {
		return fmt.Errorf("stfile: close %s: %w", r.path, err)
	}
	return nil
}
