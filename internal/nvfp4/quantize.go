package nvfp4

import (
	"fmt"
	"math"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
)

// AmaxBF16 returns max |x| over the BF16 values in src, as a float32. It
// compares magnitudes as integers (monotonic for BF16), so it is exact and
// cheap; a NaN anywhere makes the result NaN.
func AmaxBF16(src []uint16) float32 {
	var m uint16
	for _, h := range src {
		if a := h & 0x7fff; a > m {
			m = a
		}
	}
	return bf16.ToFloat32(m)
}

// QuantizeRow quantizes one row of BF16 values with the encode scale sEnc
// and decode scale sDec (from EncodeScale). packed holds Kp/2 bytes and
// scales Kp/16 bytes, where Kp >= len(row) is a multiple of 16; elements
// past len(row) are zero padding.
func QuantizeRow(packed, scales []byte, row []uint16, sEnc, sDec float32) error {
	if kp := len(scales) * BlockSize; len(packed)*2 != kp || len(row) > kp {
		return fmt.Errorf("nvfp4: row of %d values into %d packed bytes and %d block scales", len(row), len(packed), len(scales))
	}
	quantizeRow(packed, scales, row, sEnc, sDec)
	return nil
}

// quantizeRow is QuantizeRow for callers that checked the geometry.
func quantizeRow(packed, scales []byte, row []uint16, sEnc, sDec float32) {
	sEncInv6 := sEnc * Inv6 // RN(S_enc * INV6), associated as the recipe says
	var blk [BlockSize]uint16
	for b := range scales {
		lo := b * BlockSize
		n := copy(blk[:], row[min(lo, len(row)):min(lo+BlockSize, len(row))])
		clear(blk[n:])
		var vm uint16
		for _, h := range blk {
			if a := h & 0x7fff; a > vm {
				vm = a
			}
		}
		sdb := min32(bf16.ToFloat32(vm)*sEncInv6, math.MaxFloat32)
		sf := E4M3Encode(sdb)
		// enc = min(RN(1 / RN(f32(sf) * S_dec)), FLT_MAX); sf == 0 gives 1/0 = +Inf.
		enc := min32(1/(E4M3Decode(sf)*sDec), math.MaxFloat32)
		scales[b] = sf
		out := packed[b*BlockSize/2 : (b+1)*BlockSize/2]
		for j := range out {
			lo := E2M1Encode(bf16.ToFloat32(blk[2*j]) * enc)
			hi := E2M1Encode(bf16.ToFloat32(blk[2*j+1]) * enc)
			out[j] = lo | hi<<4
		}
	}
}

// Dims checks a quantized matrix's geometry: rows x k real elements, packed
// into rows x kp/2 bytes with rows x kp/16 block scales.
func Dims(rows, k, packedLen, scalesLen int) (kp int, err error) {
	if rows <= 0 || k <= 0 {
		return 0, fmt.Errorf("nvfp4: empty matrix %dx%d", rows, k)
	}
	if packedLen%rows != 0 {
		return 0, fmt.Errorf("nvfp4: %d packed bytes do not split into %d rows", packedLen, rows)
	}
	kp = packedLen / rows * 2
	if kp%BlockSize != 0 || kp < k {
		return 0, fmt.Errorf("nvfp4: padded row length %d is not a multiple of %d covering %d", kp, BlockSize, k)
	}
	if scalesLen != rows*kp/BlockSize {
		return 0, fmt.Errorf("nvfp4: %d block scales, want %d for %dx%d", scalesLen, rows*kp/BlockSize, rows, kp)
	}
	return kp, nil
}

// QuantizeMatrix quantizes a row-major rows x k BF16 matrix with one global
// scale (its amax) and returns the decode scale S_dec (the GEMM's alpha).
// packed and scales are rows x kp/2 and rows x kp/16 with kp = PaddedK(k) or
// any larger multiple of 16.
func QuantizeMatrix(packed, scales []byte, src []uint16, rows, k int) (sDec float32, err error) {
	kp, err := Dims(rows, k, len(packed), len(scales))
	if err != nil {
		return 0, err
	}
	if len(src) != rows*k {
		return 0, fmt.Errorf("nvfp4: source has %d values, want %dx%d", len(src), rows, k)
	}
	sEnc, sDec := EncodeScale(AmaxBF16(src))
	for r := range rows {
		quantizeRow(packed[r*kp/2:(r+1)*kp/2], scales[r*kp/BlockSize:(r+1)*kp/BlockSize], src[r*k:(r+1)*k], sEnc, sDec)
	}
	return sDec, nil
}

// QuantizeStack quantizes mats row-major matrices of rows x k BF16 values
// (a weight stack [E, N, K]) with one global scale per matrix, writing each
// matrix's decode scale into alphas.
func QuantizeStack(packed, scales []byte, alphas []float32, src []uint16, mats, rows, k int) error {
	if mats <= 0 || len(alphas) != mats || len(packed)%mats != 0 || len(scales)%mats != 0 || len(src) != mats*rows*k {
		return fmt.Errorf("nvfp4: stack of %d matrices %dx%d: got %d values, %d packed bytes, %d block scales, %d alphas",
			mats, rows, k, len(src), len(packed), len(scales), len(alphas))
	}
	mp, ms, mv := len(packed)/mats, len(scales)/mats, rows*k
	for m := range mats {
		var err error
		if alphas[m], err = QuantizeMatrix(packed[m*mp:(m+1)*mp], scales[m*ms:(m+1)*ms], src[m*mv:(m+1)*mv], rows, k); err != nil {
			return fmt.Errorf("nvfp4: matrix %d: %w", m, err)
		}
	}
	return nil
}

// QuantizePerRow quantizes a row-major rows x k BF16 matrix with one global
// scale per row (the per-token recipe) and writes each row's decode scale
// (per_token_scale) into rowScales.
func QuantizePerRow(packed, scales []byte, rowScales []float32, src []uint16, rows, k int) error {
	kp, err := Dims(rows, k, len(packed), len(scales))
	if err != nil {
		return err
	}
	if len(src) != rows*k || len(rowScales) != rows {
		return fmt.Errorf("nvfp4: source has %d values and %d row scales, want %dx%d and %d", len(src), len(rowScales), rows, k, rows)
	}
	for r := range rows {
		row := src[r*k : (r+1)*k]
		sEnc, sDec := EncodeScale(AmaxBF16(row))
		quantizeRow(packed[r*kp/2:(r+1)*kp/2], scales[r*kp/BlockSize:(r+1)*kp/BlockSize], row, sEnc, sDec)
		rowScales[r] = sDec
	}
	return nil
}

// PaddedK returns k rounded up to a whole number of blocks.
func PaddedK(k int) int { return (k + BlockSize - 1) / BlockSize * BlockSize }

// DequantizeRow writes x_hat = (e2m1(q) * f32(SF)) * scale for the kp
// elements of one quantized row into dst (len(dst) <= kp; extra padding
// elements are not written).
func DequantizeRow(dst []float32, packed, scales []byte, scale float32) {
	for i := range dst {
		c := packed[i/2] >> (4 * (i & 1))
		dst[i] = E2M1Decode(c) * E4M3Decode(scales[i/BlockSize]) * scale
	}
}
