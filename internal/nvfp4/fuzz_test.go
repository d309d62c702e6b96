package nvfp4

import (
	"encoding/binary"
	"fmt"
	"math"
	"testing"
)

// bf16Bytes encodes BF16 bit patterns little-endian, the fuzz input format.
func bf16Bytes(hs ...uint16) []byte {
	out := make([]byte, 2*len(hs))
	for i, h := range hs {
		binary.LittleEndian.PutUint16(out[2*i:], h)
	}
	return out
}

// FuzzQuantizeRow feeds raw bytes, read as little-endian BF16 values, into
// QuantizeMatrix and QuantizePerRow (which run QuantizeRow on every row) as
// a matrix of 1 + rows%8 rows; bit 3 of rows adds a padding block (kp =
// PaddedK(k) + 16). Nothing may panic. For finite inputs, both results must
// equal the reference quantizer bit for bit and dequantize within the bound
// of checkDequantRow; NaN and Inf inputs only have to be survived.
func FuzzQuantizeRow(f *testing.F) {
	t := testing.TB(f)
	f.Add(bf16Bytes(toBF16(t, exampleBlock)...), uint8(0))
	f.Add(bf16Bytes(toBF16(t, tiesBlock)...), uint8(0))
	f.Add(bf16Bytes(append(toBF16(t, exampleBlock), toBF16(t, []float32{10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})...)...), uint8(1))
	f.Add(bf16Bytes(append(toBF16(t, tiesBlock), toBF16(t, []float32{2688, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})...)...), uint8(9))
	f.Add(bf16Bytes(0, 0x8000, 0, 0x8000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), uint8(0))               // zeros, -0
	f.Add(bf16Bytes(0x0001, 0x807f, 0x0040, 0x0002, 0x8001), uint8(0))                                    // subnormal amax
	f.Add(bf16Bytes(0x4120, 0x0001, 0x3a00, 0x2000, 0xa000, 0x1000, 0x0080, 0x8080), uint8(0))            // underflowing small values
	f.Add(bf16Bytes(0x7f7f, 0xff7f, 0x0001, 0x3f80, 0x0080, 0x7f00, 0, 0x8000, 0x4000, 0x4040), uint8(1)) // extremes
	f.Add(bf16Bytes(0x0100, 0x0180, 0x00ff, 0x0101), uint8(0))                                            // tiny normal amax (S_enc clamps)
	f.Add(bf16Bytes(0x7f80, 0x3f80, 0xff80, 0x4000), uint8(0))                                            // +-Inf
	f.Add(bf16Bytes(0x7fc0, 0x3f80, 0xffc1, 0x7f81), uint8(1))                                            // NaNs
	f.Add(bf16Bytes(0x3f80, 0x7fc0), uint8(7))                                                            // more rows than values
	f.Add([]byte{0x80}, uint8(0))                                                                         // odd byte count
	f.Add(bf16Bytes(make([]uint16, 37)...), uint8(2))

	f.Fuzz(func(t *testing.T, raw []byte, rowsByte uint8) {
		rows := 1 + int(rowsByte%8)
		n := len(raw) / 2
		k := n / rows
		if k == 0 || k > 4096 {
			return
		}
		src := make([]uint16, rows*k)
		finite := true
		for i := range src {
			src[i] = binary.LittleEndian.Uint16(raw[2*i:])
			if src[i]&0x7f80 == 0x7f80 {
				finite = false
			}
		}
		kp := PaddedK(k)
		if rowsByte&8 != 0 {
			kp += BlockSize
		}
		global, perRow := quantizeBoth(t, src, rows, k, kp)
		// QuantizeRow directly on the first row, with its own scale.
		sEnc, sDec := EncodeScale(AmaxBF16(src[:k]))
		p, s := make([]byte, kp/2), make([]byte, kp/16)
		if err := QuantizeRow(p, s, src[:k], sEnc, sDec); err != nil {
			t.Fatal(err)
		}
		xhat := make([]float32, kp)
		DequantizeRow(xhat, p, s, sDec)
		if !finite {
			return // only "no panic" is required
		}
		checkBytes(t, "QuantizeRow packed vs QuantizePerRow", p, perRow.packed[:kp/2])
		checkBytes(t, "QuantizeRow SF vs QuantizePerRow", s, perRow.scales[:kp/16])

		wantG := refQuantize(src, rows, k, kp, false)
		wantR := refQuantize(src, rows, k, kp, true)
		compareQuantized(t, "global", global, wantG, kp)
		compareQuantized(t, "per-row", perRow, wantR, kp)
		var st boundStats
		dequantizeRows(t, "global", src, global, rows, k, kp, false, &st)
		dequantizeRows(t, "per-row", src, perRow, rows, k, kp, true, &st)
		if t.Failed() {
			t.Logf("input %dx%d kp %d: %s", rows, k, kp, fmtBF16(src))
		}
	})
}

// fmtBF16 prints BF16 patterns with their values, for failure reports.
func fmtBF16(src []uint16) string {
	s := ""
	for i, h := range src {
		if i == 64 {
			return s + " ..."
		}
		s += fmt.Sprintf(" %04x(%g)", h, math.Float32frombits(uint32(h)<<16))
	}
	return s
}
