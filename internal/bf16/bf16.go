// Package bf16 converts between bfloat16 bit patterns and float32.
//
// A BF16 value is carried as its uint16 bit pattern: the upper half of an
// IEEE-754 binary32. Widening is exact; narrowing rounds to nearest-even.
// Everything here is a pure function and safe for concurrent use.
package bf16

import (
	"encoding/binary"
	"math"
)

// ToFloat32 widens a BF16 bit pattern to float32. The conversion is exact.
func ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// FromFloat32 narrows f to BF16 with round-to-nearest-even. NaN stays NaN
// (quiet, sign kept); infinities and signed zeros are kept.
func FromFloat32(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep it a NaN whatever the payload
		return uint16(b>>16) | 0x0040
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// Round returns f rounded to the nearest BF16 value, as a float32.
func Round(f float32) float32 { return ToFloat32(FromFloat32(f)) }

// IsFinite reports whether the BF16 value h is neither NaN nor infinite.
func IsFinite(h uint16) bool { return h&0x7f80 != 0x7f80 }

// FirstNonFinite returns the index of the first NaN or Inf among the
// little-endian BF16 values of data (a trailing odd byte is not a value),
// or -1. It tests four values per 8-byte word and four words at a time:
// a value is NaN or Inf exactly when its exponent bits (0x7f80) are all
// set, that is when adding 0x0080 to them carries into bit 15 (no other
// exponent does, and no lane carries into the next). Only a block with
// such a value is looked at value by value.
func FirstNonFinite(data []byte) int {
	const (
		exp  = 0x7f80_7f80_7f80_7f80
		unit = 0x0080_0080_0080_0080
		high = 0x8000_8000_8000_8000
	)
	le := binary.LittleEndian
	i := 0
	for ; i+32 <= len(data); i += 32 {
		b := data[i : i+32 : i+32]
		t := (le.Uint64(b)&exp + unit) | (le.Uint64(b[8:])&exp + unit) | (le.Uint64(b[16:])&exp + unit) | (le.Uint64(b[24:])&exp + unit)
		if t&high != 0 {
			break
		}
	}
	for ; i+1 < len(data); i += 2 {
		if !IsFinite(le.Uint16(data[i:])) {
			return i / 2
		}
	}
	return -1
}

// Decode widens little-endian BF16 bytes into dst (len(dst) values).
func Decode(dst []float32, src []byte) {
	for i := range dst {
		dst[i] = ToFloat32(binary.LittleEndian.Uint16(src[2*i:]))
	}
}

// Encode narrows src into little-endian BF16 bytes in dst (2*len(src) bytes).
func Encode(dst []byte, src []float32) {
	for i, f := range src {
		binary.LittleEndian.PutUint16(dst[2*i:], FromFloat32(f))
	}
}
