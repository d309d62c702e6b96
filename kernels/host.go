package kernels

import (
	"encoding/binary"
	"math"
)

// Host-side encodings of buffer contents: little-endian bytes, as Upload
// takes and Download returns them.

// Int32Bytes encodes v for an I32 buffer.
func Int32Bytes(v []int32) []byte {
	out := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(out[4*i:], uint32(x))
	}
	return out
}

// Float32Bytes encodes v for an F32 buffer.
func Float32Bytes(v []float32) []byte {
	out := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(x))
	}
	return out
}

// Uint16Bytes encodes BF16 bit patterns for a BF16 buffer.
func Uint16Bytes(v []uint16) []byte {
	out := make([]byte, 2*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint16(out[2*i:], x)
	}
	return out
}

// BytesInt32 decodes the contents of an I32 buffer.
func BytesInt32(b []byte) []int32 {
	out := make([]int32, len(b)/4)
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

// BytesFloat32 decodes the contents of an F32 buffer.
func BytesFloat32(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

// BytesUint16 decodes the contents of a BF16 buffer into bit patterns.
func BytesUint16(b []byte) []uint16 {
	out := make([]uint16, len(b)/2)
	for i := range out {
		out[i] = binary.LittleEndian.Uint16(b[2*i:])
	}
	return out
}

// Views makes views of buffers and keeps the first error, so code that
// needs many views of fixed workspaces checks once.
type Views struct{ Err error }

// Rows is b.Rows(n), or nil after an error.
func (v *Views) Rows(b *Buffer, n int) *Buffer {
	if v.Err != nil {
		return nil
	}
	r, err := b.Rows(n)
	v.Err = err
	return r
}

// Reshape is b.Reshape(shape...), or nil after an error.
func (v *Views) Reshape(b *Buffer, shape ...int) *Buffer {
	if v.Err != nil {
		return nil
	}
	r, err := b.Reshape(shape...)
	v.Err = err
	return r
}

// View is b.View(off, dt, shape...), or nil after an error.
func (v *Views) View(b *Buffer, off int, dt DType, shape ...int) *Buffer {
	if v.Err != nil {
		return nil
	}
	r, err := b.View(off, dt, shape...)
	v.Err = err
	return r
}

// NVFP4Rows is the view of the first n rows of a per-row quantized buffer.
func (v *Views) NVFP4Rows(q NVFP4, n int) NVFP4 {
	return NVFP4{Packed: v.Rows(q.Packed, n), Scales: v.Rows(q.Scales, n), Scale: v.Rows(q.Scale, n)}
}
