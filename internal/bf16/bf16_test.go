package bf16

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"
)

// refValue is the value of a non-NaN BF16 pattern from its bit definition:
// sign, 8-bit exponent (bias 127), 7-bit mantissa.
func refValue(h uint16) float64 {
	e, m := int(h>>7)&0xff, float64(h&0x7f)
	var v float64
	switch e {
	case 0:
		v = math.Ldexp(m, -133) // 0.m * 2^-126
	case 0xff:
		v = math.Inf(1)
	default:
		v = math.Ldexp(1+m/128, e-127)
	}
	if h&0x8000 != 0 {
		v = math.Copysign(v, -1)
	}
	return v
}

// refFromFloat32 rounds a non-NaN float32 to BF16, nearest with ties to even,
// by comparing exact float64 distances to the two neighbours. The neighbour
// above the largest finite BF16 is 2^128 (overflow to Inf follows the IEEE
// rule: at or beyond max + half an ulp).
func refFromFloat32(f float32) uint16 {
	b := math.Float32bits(f)
	lo := uint16(b >> 16) // truncation: toward zero
	if b&0xffff == 0 {
		return lo
	}
	hi := lo + 1 // next magnitude away from zero (same sign)
	x := math.Abs(float64(f))
	vlo := math.Abs(refValue(lo))
	vhi := math.Abs(refValue(hi))
	if hi&0x7fff == 0x7f80 {
		vhi = 0x1p128
	}
	dlo, dhi := x-vlo, vhi-x // exact: 24-bit operands a binade apart at most
	switch {
	case dlo < dhi:
		return lo
	case dhi < dlo:
		return hi
	case lo&1 == 0:
		return lo
	default:
		return hi
	}
}

// TestToFloat32 checks every BF16 pattern: the widening is the exact upper
// half, and equals the value of the bit definition.
func TestToFloat32(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		f := ToFloat32(h)
		if got := math.Float32bits(f); got != uint32(h)<<16 {
			t.Fatalf("ToFloat32(0x%04x) bits 0x%08x, want 0x%08x", h, got, uint32(h)<<16)
		}
		isNaN := h&0x7f80 == 0x7f80 && h&0x7f != 0
		if isNaN {
			if !math.IsNaN(float64(f)) {
				t.Errorf("ToFloat32(0x%04x) = %v, want NaN", h, f)
			}
		} else if v := refValue(h); float64(f) != v || math.Signbit(float64(f)) != math.Signbit(v) {
			t.Errorf("ToFloat32(0x%04x) = %v, want %v", h, f, v)
		}
		if IsFinite(h) != (!isNaN && !math.IsInf(float64(f), 0)) {
			t.Errorf("IsFinite(0x%04x) = %v", h, IsFinite(h))
		}
		// Every BF16 value converts back to itself (NaN to a quiet NaN).
		back := FromFloat32(f)
		if isNaN {
			if back&0x7f80 != 0x7f80 || back&0x7f == 0 || back&0x8000 != h&0x8000 {
				t.Errorf("FromFloat32(NaN 0x%04x) = 0x%04x, want a NaN of the same sign", h, back)
			}
		} else if back != h {
			t.Errorf("FromFloat32(ToFloat32(0x%04x)) = 0x%04x", h, back)
		}
	}
}

// checkFrom compares FromFloat32 and Round with the reference for f.
func checkFrom(t *testing.T, f float32) bool {
	t.Helper()
	got, want := FromFloat32(f), refFromFloat32(f)
	if got != want {
		t.Errorf("FromFloat32(%g = 0x%08x) = 0x%04x, want 0x%04x", f, math.Float32bits(f), got, want)
		return false
	}
	if r := Round(f); math.Float32bits(r) != uint32(want)<<16 {
		t.Errorf("Round(%g) = %g, want 0x%04x", f, r, want)
		return false
	}
	return true
}

// TestFromFloat32 compares the narrowing with the float64 reference on
// random float32 patterns, on ties of both parities and their neighbours, on
// a strided sweep of all patterns, and on the special values.
func TestFromFloat32(t *testing.T) {
	rng := rand.New(rand.NewPCG(16, 32))
	fails := 0
	for i := 0; i < 1<<21 && fails < 5; i++ {
		b := rng.Uint32()
		if b&0x7fffffff > 0x7f800000 {
			continue // NaN: below
		}
		if !checkFrom(t, math.Float32frombits(b)) {
			fails++
		}
	}
	// Ties (low half 0x8000) of both parities, and the patterns around them.
	for i := 0; i < 1<<16 && fails < 5; i++ {
		hi := uint32(i) << 16
		if hi&0x7fffffff >= 0x7f800000 {
			continue // Inf/NaN upper half: no finite ties there
		}
		for _, low := range []uint32{0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff} {
			if !checkFrom(t, math.Float32frombits(hi|low)) {
				fails++
			}
		}
	}
	for b := uint64(0); b < 1<<32 && fails < 5; b += 4099 {
		if uint32(b)&0x7fffffff > 0x7f800000 {
			continue
		}
		if !checkFrom(t, math.Float32frombits(uint32(b))) {
			fails++
		}
	}

	specials := []struct {
		name string
		f    float32
		want uint16
	}{
		{"+0", 0, 0x0000},
		{"-0", float32(math.Copysign(0, -1)), 0x8000},
		{"+Inf", float32(math.Inf(1)), 0x7f80},
		{"-Inf", float32(math.Inf(-1)), 0xff80},
		{"1", 1, 0x3f80},
		{"1 + half ulp: tie to even (down)", math.Float32frombits(0x3f808000), 0x3f80},
		{"1 + 3 half ulps: tie to even (up)", math.Float32frombits(0x3f818000), 0x3f82},
		{"FLT_MAX overflows to Inf", math.MaxFloat32, 0x7f80},
		{"-FLT_MAX overflows to -Inf", -math.MaxFloat32, 0xff80},
		{"largest BF16", math.Float32frombits(0x7f7f0000), 0x7f7f},
		{"just below overflow tie", math.Float32frombits(0x7f7f7fff), 0x7f7f},
		{"overflow tie", math.Float32frombits(0x7f7f8000), 0x7f80},
		{"smallest float32 subnormal", math.Float32frombits(1), 0x0000},
		{"subnormal tie to even (up)", math.Float32frombits(0x00018000), 0x0002},
		{"largest float32 subnormal", math.Float32frombits(0x007fffff), 0x0080},
	}
	for _, c := range specials {
		if got := FromFloat32(c.f); got != c.want {
			t.Errorf("%s: FromFloat32(0x%08x) = 0x%04x, want 0x%04x", c.name, math.Float32bits(c.f), got, c.want)
		}
	}

	// NaN stays NaN with its sign, whatever the payload (including payloads
	// only in the low half, which truncation would turn into Inf).
	nans := []uint32{0x7fc00000, 0x7f800001, 0x7f80ffff, 0x7fffffff, 0x7f810000, 0xffc00000, 0xff800001, 0xffffffff}
	for i := 0; i < 10000; i++ {
		nans = append(nans, 0x7f800000|rng.Uint32N(0x7fffff)+1|rng.Uint32N(2)<<31)
	}
	for _, b := range nans {
		h := FromFloat32(math.Float32frombits(b))
		if h&0x7f80 != 0x7f80 || h&0x7f == 0 || uint32(h>>15) != b>>31 {
			t.Fatalf("FromFloat32(NaN 0x%08x) = 0x%04x, want a NaN with sign %d", b, h, b>>31)
		}
		if !math.IsNaN(float64(ToFloat32(h))) {
			t.Fatalf("ToFloat32(FromFloat32(NaN 0x%08x)) is not NaN", b)
		}
	}
}

// TestEncodeDecode: little-endian byte layout and round trip.
func TestEncodeDecode(t *testing.T) {
	src := []float32{1, -2, 0.5, float32(math.Inf(1)), 3.14159}
	buf := make([]byte, 2*len(src))
	Encode(buf, src)
	want := []byte{0x80, 0x3f, 0x00, 0xc0, 0x00, 0x3f, 0x80, 0x7f, 0x49, 0x40}
	if !bytes.Equal(buf, want) {
		t.Errorf("Encode = % x, want % x", buf, want)
	}
	dst := make([]float32, len(src))
	Decode(dst, buf)
	for i, f := range dst {
		if r := Round(src[i]); math.Float32bits(f) != math.Float32bits(r) {
			t.Errorf("Decode[%d] = %v, want %v", i, f, r)
		}
	}
	// Decode reads only len(dst) values.
	short := make([]float32, 2)
	Decode(short, buf)
	if short[0] != 1 || short[1] != -2 {
		t.Errorf("Decode short = %v", short)
	}
}

func TestFirstNonFinite(t *testing.T) {
	for n := range 41 { // past two 32-byte blocks and a tail
		for bad := -1; bad < n; bad++ {
			data := make([]byte, 2*n)
			for i := range n {
				binary.LittleEndian.PutUint16(data[2*i:], FromFloat32(float32(i)-6.5))
			}
			if bad >= 0 {
				binary.LittleEndian.PutUint16(data[2*bad:], 0xff80) // -Inf
				if bad+2 < n {
					binary.LittleEndian.PutUint16(data[2*(bad+2):], 0x7fc1) // NaN after it
				}
			}
			if got := FirstNonFinite(data); got != bad {
				t.Errorf("n=%d: first non-finite at %d, want %d", n, got, bad)
			}
		}
	}
	// Every 16-bit pattern, at every place of a block and of the tail.
	data := make([]byte, 2*19)
	for h := range 1 << 16 {
		at := h % 19
		clear(data)
		binary.LittleEndian.PutUint16(data[2*at:], uint16(h))
		want := -1
		if !IsFinite(uint16(h)) {
			want = at
		}
		if got := FirstNonFinite(data); got != want {
			t.Fatalf("value %#04x at %d: first non-finite at %d, want %d", h, at, got, want)
		}
	}
	// Largest finite values, with every exponent bit but one set, are finite.
	data = make([]byte, 64)
	for i := range 32 {
		binary.LittleEndian.PutUint16(data[2*i:], 0x7f7f|uint16(i%2)<<15)
	}
	if got := FirstNonFinite(data); got != -1 {
		t.Errorf("max finite values: got %d", got)
	}
}
