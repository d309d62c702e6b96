package nvfp4

import (
	"bytes"
	"fmt"
	"math"
	"testing"
)

// Worked examples of docs/NVFP4.md section 8.

var (
	// exampleBlock is the block of examples A and B.
	exampleBlock = []float32{0, .125, -.3125, .5, .875, -1, 1.375, 1.875, -2.5, 3, 3.5, -4.25, 5, 5.5, -6.5, 7}
	// exampleCodes are the E2M1 codes of examples A and B.
	exampleCodes = []uint8{0, 0, 9, 1, 1, 0xA, 2, 3, 0xC, 5, 5, 0xE, 6, 6, 0xF, 7}
	// examplePacked are the packed bytes of examples A and B.
	examplePacked = []byte{0x00, 0x19, 0xa1, 0x32, 0x5c, 0xe5, 0x66, 0x7f}
	// tiesBlock is the block of example C.
	tiesBlock = []float32{.25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, 6, 0}
	// tiesPacked are the packed bytes of example C.
	tiesPacked = []byte{0x20, 0x42, 0x64, 0x86, 0xaa, 0xcc, 0xee, 0x07}
)

// toBF16 converts float32 values that are exactly representable in BF16.
func toBF16(t testing.TB, xs []float32) []uint16 {
	t.Helper()
	out := make([]uint16, len(xs))
	for i, x := range xs {
		b := math.Float32bits(x)
		if b&0xffff != 0 {
			t.Fatalf("%v is not exactly representable in BF16", x)
		}
		out[i] = uint16(b >> 16)
	}
	return out
}

// unpack returns the 4-bit codes of packed bytes, low nibble first.
func unpack(packed []byte) []uint8 {
	codes := make([]uint8, 0, 2*len(packed))
	for _, b := range packed {
		codes = append(codes, b&0xf, b>>4)
	}
	return codes
}

// checkBits fails when got's bit pattern is not want.
func checkBits(t *testing.T, what string, got float32, want uint32) {
	t.Helper()
	if math.Float32bits(got) != want {
		t.Errorf("%s = %s, want 0x%08X (%g)", what, fbits(got), want, math.Float32frombits(want))
	}
}

// checkBytes fails when got != want.
func checkBytes(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if !bytes.Equal(got, want) {
		t.Errorf("%s = % x, want % x", what, got, want)
	}
}

// exampleEnc recomputes enc = min(RN(1/RN(f32(sf)*S_dec)), FLT_MAX).
func exampleEnc(sf uint8, sDec float32) float32 {
	var one float32 = 1
	return min(one/(E4M3Decode(sf)*sDec), math.MaxFloat32)
}

// TestWorkedExampleA: global scale from amax = 10.
func TestWorkedExampleA(t *testing.T) {
	sEnc, sDec := EncodeScale(10)
	checkBits(t, "S_enc", sEnc, 0x43866666)
	checkBits(t, "S_dec", sDec, 0x3B73CF3E)
	sEncInv6 := sEnc * Inv6
	checkBits(t, "S_enc*INV6", sEncInv6, 0x42333333)
	sdb := float32(7) * sEncInv6
	if s := fmt.Sprintf("%.7f", sdb); s != "313.6000061" {
		t.Errorf("sdb = %s, want 313.6000061", s)
	}
	sf := E4M3Encode(sdb)
	if sf != 0x7A || E4M3Decode(sf) != 320 {
		t.Errorf("SF = 0x%02X (%v), want 0x7A (320)", sf, E4M3Decode(sf))
	}
	enc := exampleEnc(sf, sDec)
	checkBits(t, "enc", enc, 0x3F570A3C)
	for i, x := range exampleBlock {
		if c := E2M1Encode(x * enc); c != exampleCodes[i] {
			t.Errorf("E2M1Encode(%v*enc) = %X, want %X", x, c, exampleCodes[i])
		}
	}

	// QuantizeRow with EncodeScale(10).
	packed, scales := make([]byte, 8), make([]byte, 1)
	if err := QuantizeRow(packed, scales, toBF16(t, exampleBlock), sEnc, sDec); err != nil {
		t.Fatal(err)
	}
	checkBytes(t, "QuantizeRow SF", scales, []byte{0x7A})
	checkBytes(t, "QuantizeRow packed", packed, examplePacked)
	checkBytes(t, "QuantizeRow codes", unpack(packed), exampleCodes)

	// The same through QuantizeMatrix: a second row carries the amax 10.
	row1 := make([]float32, 16)
	row1[3] = -10
	src := append(toBF16(t, exampleBlock), toBF16(t, row1)...)
	packed, scales = make([]byte, 16), make([]byte, 2)
	gotDec, err := QuantizeMatrix(packed, scales, src, 2, 16)
	if err != nil {
		t.Fatal(err)
	}
	checkBits(t, "QuantizeMatrix S_dec", gotDec, 0x3B73CF3E)
	checkBytes(t, "QuantizeMatrix row 0 SF", scales[:1], []byte{0x7A})
	checkBytes(t, "QuantizeMatrix row 0 packed", packed[:8], examplePacked)
	// Row 1: the block holds the amax, so sdb ~= 448 -> 0x7E, and -10
	// is -6 (code 0xF) in the 4th position (high nibble of byte 1).
	checkBytes(t, "QuantizeMatrix row 1 SF", scales[1:], []byte{0x7E})
	checkBytes(t, "QuantizeMatrix row 1 packed", packed[8:], []byte{0, 0xf0, 0, 0, 0, 0, 0, 0})
}

// TestWorkedExampleB: per-token, row amax 7 (the block's largest element).
func TestWorkedExampleB(t *testing.T) {
	src := toBF16(t, exampleBlock)
	if a := AmaxBF16(src); a != 7 {
		t.Fatalf("AmaxBF16 = %v, want 7", a)
	}
	sEnc, sDec := EncodeScale(7)
	checkBits(t, "S_enc", sEnc, math.Float32bits(384))
	checkBits(t, "per_token_scale", sDec, 0x3B2AAAAB)
	sdb := float32(7) * (sEnc * Inv6)
	checkBits(t, "sdb", sdb, math.Float32bits(448))
	sf := E4M3Encode(sdb)
	if sf != 0x7E {
		t.Errorf("SF = 0x%02X, want 0x7E", sf)
	}
	enc := exampleEnc(sf, sDec)
	checkBits(t, "enc", enc, 0x3F5B6DB6)
	y := float32(0.875) * enc
	checkBits(t, "0.875*enc", y, 0x3F3FFFFF)
	if c := E2M1Encode(y); c != 1 {
		t.Errorf("E2M1Encode(0.875*enc) = %d, want 1 (0.5)", c)
	}

	packed, scales, rowScales := make([]byte, 8), make([]byte, 1), make([]float32, 1)
	if err := QuantizePerRow(packed, scales, rowScales, src, 1, 16); err != nil {
		t.Fatal(err)
	}
	checkBits(t, "QuantizePerRow per_token_scale", rowScales[0], 0x3B2AAAAB)
	checkBytes(t, "QuantizePerRow SF", scales, []byte{0x7E})
	checkBytes(t, "QuantizePerRow packed", packed, examplePacked)
	checkBytes(t, "QuantizePerRow codes", unpack(packed), exampleCodes)
}

// TestWorkedExampleC: ties with S_enc = 1 (amax = 2688).
func TestWorkedExampleC(t *testing.T) {
	sEnc, sDec := EncodeScale(2688)
	checkBits(t, "S_enc", sEnc, math.Float32bits(1))
	checkBits(t, "S_dec", sDec, math.Float32bits(1))
	sf := E4M3Encode(float32(6) * (sEnc * Inv6))
	if sf != 0x38 {
		t.Errorf("SF = 0x%02X, want 0x38", sf)
	}
	checkBits(t, "enc", exampleEnc(sf, sDec), math.Float32bits(1))

	src := toBF16(t, tiesBlock)
	packed, scales := make([]byte, 8), make([]byte, 1)
	if err := QuantizeRow(packed, scales, src, sEnc, sDec); err != nil {
		t.Fatal(err)
	}
	checkBytes(t, "QuantizeRow SF", scales, []byte{0x38})
	checkBytes(t, "QuantizeRow packed", packed, tiesPacked)

	// Through QuantizeMatrix: a second row carries 2688, so S_enc = 1.
	row1 := make([]float32, 16)
	row1[15] = 2688
	src = append(src, toBF16(t, row1)...)
	packed, scales = make([]byte, 16), make([]byte, 2)
	gotDec, err := QuantizeMatrix(packed, scales, src, 2, 16)
	if err != nil {
		t.Fatal(err)
	}
	checkBits(t, "QuantizeMatrix S_dec", gotDec, math.Float32bits(1))
	checkBytes(t, "QuantizeMatrix row 0 SF", scales[:1], []byte{0x38})
	checkBytes(t, "QuantizeMatrix row 0 packed", packed[:8], tiesPacked)

	// The reference quantizer agrees on all three examples.
	p, s, _ := refQuantizeRow(toBF16(t, tiesBlock), 16, 1, 1)
	checkBytes(t, "reference C packed", p, tiesPacked)
	checkBytes(t, "reference C SF", s, []byte{0x38})
	sEnc, sDec = refEncodeScale(10)
	p, s, blk := refQuantizeRow(toBF16(t, exampleBlock), 16, sEnc, sDec)
	checkBytes(t, "reference A packed", p, examplePacked)
	checkBytes(t, "reference A SF", s, []byte{0x7A})
	checkBits(t, "reference A enc", blk[0].enc, 0x3F570A3C)
	sEnc, sDec = refEncodeScale(7)
	p, s, blk = refQuantizeRow(toBF16(t, exampleBlock), 16, sEnc, sDec)
	checkBytes(t, "reference B packed", p, examplePacked)
	checkBytes(t, "reference B SF", s, []byte{0x7E})
	checkBits(t, "reference B enc", blk[0].enc, 0x3F5B6DB6)
	checkBits(t, "reference B per_token_scale", sDec, 0x3B2AAAAB)
}

// TestEncodeScale covers the S_enc / S_dec edge cases against the reference.
func TestEncodeScale(t *testing.T) {
	cases := []struct {
		name           string
		amax           float32
		wantEnc, wantD uint32 // 0 means "use the reference only"
	}{
		{"zero", 0, 0x3F800000, 0x3F800000},
		{"+Inf", float32(math.Inf(1)), 0x3F800000, 0x3F800000},
		{"10", 10, 0x43866666, 0x3B73CF3E},
		{"7", 7, math.Float32bits(384), 0x3B2AAAAB},
		{"2688", 2688, 0x3F800000, 0x3F800000},
		{"BF16 max", refBF16(0x7f7f), 0, 0},
		{"smallest BF16 subnormal", refBF16(0x0001), 0x7F7FFFFF, 0},
		{"largest BF16 subnormal", refBF16(0x007f), 0x7F7FFFFF, 0},
		{"tiny normal 1e-37", 1e-37, 0x7F7FFFFF, 0},
		{"1", 1, 0, 0},
		{"3", 3, 0, 0},
	}
	for _, c := range cases {
		gotE, gotD := EncodeScale(c.amax)
		refE, refD := refEncodeScale(c.amax)
		if math.Float32bits(gotE) != math.Float32bits(refE) || math.Float32bits(gotD) != math.Float32bits(refD) {
			t.Errorf("%s: EncodeScale(%v) = (%s, %s), reference (%s, %s)", c.name, c.amax, fbits(gotE), fbits(gotD), fbits(refE), fbits(refD))
		}
		if c.wantEnc != 0 {
			checkBits(t, c.name+": S_enc", gotE, c.wantEnc)
		}
		if c.wantD != 0 {
			checkBits(t, c.name+": S_dec", gotD, c.wantD)
		}
	}
	// Every positive finite BF16 value as amax.
	for h := uint16(1); h < 0x7f80; h++ {
		a := refBF16(h)
		gotE, gotD := EncodeScale(a)
		refE, refD := refEncodeScale(a)
		if math.Float32bits(gotE) != math.Float32bits(refE) || math.Float32bits(gotD) != math.Float32bits(refD) {
			t.Fatalf("EncodeScale(%s) = (%s, %s), reference (%s, %s)", fbits(a), fbits(gotE), fbits(gotD), fbits(refE), fbits(refD))
		}
	}
}
