package nvfp4

import (
	"math"
)

// Recipe constants (docs/NVFP4.md section 2).
const (
	BlockSize = 16   // elements per block scale
	FP4Max    = 6    // largest E2M1 magnitude
	FP8Max    = 448  // largest finite E4M3 magnitude
	G         = 2688 // FP8Max * FP4Max, exact in binary32
)

// Inv6 is RN32(1/6) = 0x3E2AAAAB (the exact constant rounds once, to
// nearest, when it becomes a float32).
const Inv6 float32 = 1.0 / 6

// PerTokenGlobal is RN32(1/2688) = 0x39C30C31, the per-token recipe's fixed
// "global scale" constant as FlashInfer spells it.
const PerTokenGlobal float32 = 1.0 / G

// e2m1Values are the magnitudes of E2M1 codes 0..7.
var e2m1Values = [8]float32{0, 0.5, 1, 1.5, 2, 3, 4, 6}

// E2M1Decode returns the value of the 4-bit code c (only the low nibble is read).
func E2M1Decode(c uint8) float32 {
	v := e2m1Values[c&7]
	if c&8 != 0 {
		return -v
	}
	return v
}

// E2M1Encode rounds x to the nearest E2M1 value, ties to the even code, and
// saturates to +-6. The sign is kept, so a negative value that rounds to
// zero gives code 8 (-0). NaN gives +-6 (the largest code of its sign): NaN
// never reaches a quantizer in this project, the refit path rejects it first.
func E2M1Encode(x float32) uint8 {
	// The code of |x| is the number of rounding boundaries below it, each
	// boundary inclusive or not as ties to the even code want (0.25 -> 0,
	// 0.75 -> 2, ...). |x|'s bits compare as unsigned integers in the
	// order of the values, and NaN's bits lie above every boundary, so
	// NaN counts all seven. (t - a) >> 31 is 1 exactly when a > t (both
	// below 2^31): no branch, so random data mispredicts none.
	b := math.Float32bits(x)
	a := b & 0x7fffffff
	c := (0x3e800000-a)>>31 + (0x3f3fffff-a)>>31 + (0x3fa00000-a)>>31 + (0x3fdfffff-a)>>31 + // > 0.25, >= 0.75, > 1.25, >= 1.75
		(0x40200000-a)>>31 + (0x405fffff-a)>>31 + (0x40a00000-a)>>31 // > 2.5, >= 3.5, > 5
	return uint8(c) | uint8(b>>28)&8
}

// E4M3Decode returns the value of the float8_e4m3fn byte b. 0x7F and 0xFF are NaN.
func E4M3Decode(b uint8) float32 {
	exp, man := uint32(b>>3)&0xf, uint32(b&7)
	var v float32
	switch {
	case b&0x7f == 0x7f:
		return float32(math.NaN())
	case exp == 0:
		v = float32(man) * (1.0 / 512) // subnormal: k * 2^-9, exact
	default:
		// (1 + man/8) * 2^(exp-7): the float32 with exponent field
		// exp - 7 + 127 and man in its top mantissa bits.
		v = math.Float32frombits((exp+120)<<23 | man<<20)
	}
	if b&0x80 != 0 {
		return -v
	}
	return v
}

// E4M3Encode converts x to float8_e4m3fn with round-to-nearest-even,
// saturating finite values (and infinities) at +-448 like CUDA's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3). Magnitudes at or
// below 2^-10 become (signed) zero. NaN gives 0x7F with the input's sign.
func E4M3Encode(x float32) uint8 {
	bits := math.Float32bits(x)
	sign := uint8(bits>>24) & 0x80
	a := bits & 0x7fffffff
	if a > 0x7f800000 {
		return sign | 0x7f
	}
	f := math.Float32frombits(a)
	if f >= FP8Max {
		return sign | 0x7e
	}
	if f < 1.0/64 { // below the smallest normal 2^-6: multiples of 2^-9
		// f*512 is exact (a power-of-two scale of a value far from underflow
		// in float64), so RoundToEven sees the true value.
		return sign | uint8(math.RoundToEven(float64(f)*512))
	}
	e := int(a>>23) - 127 // -6..8
	m := a & 0x7fffff
	q := m >> 20
	rem, half := m&0xfffff, uint32(1)<<19
	if rem > half || (rem == half && q&1 == 1) {
		q++
	}
	if q == 8 {
		q = 0
		e++
	}
	code := uint8(e+7)<<3 | uint8(q)
	if code > 0x7e { // cannot happen below 448; kept as the saturation guard
		code = 0x7e
	}
	return sign | code
}

// EncodeScale returns the encode scale S_enc and decode scale S_dec for a
// matrix (or a row, in the per-token recipe) whose largest magnitude is amax:
// S_enc = amax == 0 ? 1 : min(RN(G/amax), FLT_MAX), and 1 when that is 0
// (amax = Inf); S_dec = RN(1/S_enc).
func EncodeScale(amax float32) (sEnc, sDec float32) {
	sEnc = 1
	if amax != 0 {
		sEnc = min32(float32(G)/amax, math.MaxFloat32)
		if sEnc == 0 {
			sEnc = 1
		}
	}
	return sEnc, 1 / sEnc
}

// InputScale returns the encode and decode scales of a tensor quantized
// with a given global decode scale (the per_tensor recipe's calibrated
// input_scale, S_dec): S_enc = min(RN(1/S_dec), FLT_MAX), S_dec unchanged.
// A zero, negative, infinite or NaN S_dec is the caller's to refuse.
func InputScale(sDec float32) (sEnc, dec float32) {
	return min32(1/sDec, math.MaxFloat32), sDec
}

// min32 is math.Min for float32 without the float64 round trip; it returns a
// when a is NaN, which keeps NaN visible instead of hiding it behind b.
func min32(a, b float32) float32 {
	if b < a {
		return b
	}
	return a
}
