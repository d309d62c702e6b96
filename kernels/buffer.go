package kernels

import (
	"fmt"
	"math"
	"slices"
)

// DType is the element type of a Buffer.
type DType uint8

// Element types the op set uses.
const (
	BF16 DType = iota + 1 // bfloat16, little-endian bit patterns
	F32                   // IEEE-754 binary32
	U8                    // bytes: packed E2M1 pairs, E4M3 block scales
	I32                   // indices, expert ids, offsets
)

// Size returns the size of one element in bytes.
func (d DType) Size() int {
	switch d {
	case BF16:
		return 2
	case F32, I32:
		return 4
	case U8:
		return 1
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case BF16:
		return "bf16"
	case F32:
		return "f32"
	case U8:
		return "u8"
	case I32:
		return "i32"
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// Buffer is a typed, shaped region of backend memory at a fixed address.
//
// A Buffer made by a backend's Alloc owns its memory until Free; views made by
// Rows and Index alias it. Buffer values are immutable: views are new Buffers.
type Buffer struct {
	dtype DType
	shape []int
	addr  uintptr // device address, or the address of host[0]
	host  []byte  // the storage, for host-memory backends; nil on devices
	owner any     // the backend that allocated the root buffer
}

// NewHostBuffer wraps host memory as a Buffer owned by owner. It is for
// backends that keep buffers in host memory; mem must be exactly the size of
// the shape and must not move (Go's heap does not move objects).
func NewHostBuffer(owner any, dt DType, shape []int, mem []byte, addr uintptr) (*Buffer, error) {
	n, err := elems(dt, shape)
	if err != nil {
		return nil, err
	}
	if len(mem) != n*dt.Size() {
		return nil, fmt.Errorf("kernels: %s%v needs %d bytes, got %d", dt, shape, n*dt.Size(), len(mem))
	}
	return &Buffer{dtype: dt, shape: slices.Clone(shape), addr: addr, host: mem, owner: owner}, nil
}

// NewDeviceBuffer describes device memory at addr as a Buffer owned by owner.
func NewDeviceBuffer(owner any, dt DType, shape []int, addr uintptr) (*Buffer, error) {
	if _, err := elems(dt, shape); err != nil {
		return nil, err
	}
	return &Buffer{dtype: dt, shape: slices.Clone(shape), addr: addr, owner: owner}, nil
}

func elems(dt DType, shape []int) (int, error) {
	if dt.Size() == 0 {
		return 0, fmt.Errorf("kernels: unknown %s", dt)
	}
	n := 1
	for _, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("kernels: negative dimension in %s%v", dt, shape)
		}
		if d > 0 && n > math.MaxInt/8/d {
			return 0, fmt.Errorf("kernels: %s%v is too large", dt, shape)
		}
		n *= d
	}
	return n, nil
}

// SizeOf returns the size in bytes of a buffer of dtype dt and the given
// shape, or an error for an unknown dtype, a negative dimension or a size
// that does not fit an int.
func SizeOf(dt DType, shape []int) (int, error) {
	n, err := elems(dt, shape)
	return n * dt.Size(), err
}

// DType returns the element type.
func (b *Buffer) DType() DType { return b.dtype }

// Shape returns a copy of the shape.
func (b *Buffer) Shape() []int { return slices.Clone(b.shape) }

// Rank returns the number of dimensions.
func (b *Buffer) Rank() int { return len(b.shape) }

// Dim returns dimension i; negative i counts from the end.
func (b *Buffer) Dim(i int) int {
	if i < 0 {
		i += len(b.shape)
	}
	return b.shape[i]
}

// Len returns the number of elements.
func (b *Buffer) Len() int {
	n := 1
	for _, d := range b.shape {
		n *= d
	}
	return n
}

// Size returns the size in bytes.
func (b *Buffer) Size() int { return b.Len() * b.dtype.Size() }

// Addr returns the buffer's address: the device pointer, or the address of
// the first host byte. It never changes while the buffer lives.
func (b *Buffer) Addr() uintptr { return b.addr }

// Host returns the host storage of a host-memory buffer, or nil for device
// memory. Only backends use it.
func (b *Buffer) Host() []byte { return b.host }

// Owner returns the backend that allocated the buffer.
func (b *Buffer) Owner() any { return b.owner }

func (b *Buffer) String() string { return fmt.Sprintf("%s%v@%#x", b.dtype, b.shape, b.addr) }

// Rows returns a view of the first n entries along dimension 0, at the same
// address. Workspaces are allocated for the largest batch and used through
// such views for smaller ones.
func (b *Buffer) Rows(n int) (*Buffer, error) { return b.Slice(0, n) }

// Slice returns a view of entries lo..hi-1 along dimension 0.
func (b *Buffer) Slice(lo, hi int) (*Buffer, error) {
	if len(b.shape) == 0 || lo < 0 || hi < lo || hi > b.shape[0] {
		return nil, fmt.Errorf("kernels: slice [%d:%d] of %s", lo, hi, b)
	}
	shape := slices.Clone(b.shape)
	shape[0] = hi - lo
	return b.view(lo*b.stride(), shape), nil
}

// ByteRange returns a U8 view of n bytes at byte offset off: a tensor that
// is a contiguous part of a larger buffer (one expert's gate rows, say).
func (b *Buffer) ByteRange(off, n int) (*Buffer, error) {
	if off < 0 || n < 0 || off+n > b.Size() {
		return nil, fmt.Errorf("kernels: bytes [%d:%d] of %s (%d bytes)", off, off+n, b, b.Size())
	}
	v := &Buffer{dtype: U8, shape: []int{n}, addr: b.addr + uintptr(off), owner: b.owner}
	if b.host != nil {
		v.host = b.host[off : off+n : off+n]
	}
	return v, nil
}

// stride is the size in bytes of one entry along dimension 0.
func (b *Buffer) stride() int {
	s := b.dtype.Size()
	for _, d := range b.shape[1:] {
		s *= d
	}
	return s
}

// View returns a view of b's bytes from byte offset off as a buffer of
// dtype dt and the given shape: the same memory under another type, like a
// cast. It lets one allocation hold several small inputs of different
// types, so they are uploaded in one copy. off must be a multiple of dt's
// size.
func (b *Buffer) View(off int, dt DType, shape ...int) (*Buffer, error) {
	n, err := elems(dt, shape)
	if err != nil {
		return nil, err
	}
	size := n * dt.Size()
	if off < 0 || off%dt.Size() != 0 || off+size > b.Size() {
		return nil, fmt.Errorf("kernels: view %s%v at byte %d of %s (%d bytes)", dt, shape, off, b, b.Size())
	}
	v := &Buffer{dtype: dt, shape: slices.Clone(shape), addr: b.addr + uintptr(off), owner: b.owner}
	if b.host != nil {
		v.host = b.host[off : off+size : off+size]
	}
	return v, nil
}

// Index returns the view b[i]: dimension 0 fixed at i.
func (b *Buffer) Index(i int) (*Buffer, error) {
	if len(b.shape) == 0 || i < 0 || i >= b.shape[0] {
		return nil, fmt.Errorf("kernels: index %d of %s", i, b)
	}
	return b.view(i*b.stride(), slices.Clone(b.shape[1:])), nil
}

// Reshape returns a view with the same bytes and a new shape of equal size.
func (b *Buffer) Reshape(shape ...int) (*Buffer, error) {
	n, err := elems(b.dtype, shape)
	if err != nil {
		return nil, err
	}
	if n != b.Len() {
		return nil, fmt.Errorf("kernels: reshape %s to %v", b, shape)
	}
	return b.view(0, slices.Clone(shape)), nil
}

func (b *Buffer) view(off int, shape []int) *Buffer {
	v := &Buffer{dtype: b.dtype, shape: shape, addr: b.addr + uintptr(off), owner: b.owner}
	if b.host != nil {
		n := 1
		for _, d := range shape {
			n *= d
		}
		v.host = b.host[off : off+n*b.dtype.Size() : off+n*b.dtype.Size()]
	}
	return v
}
