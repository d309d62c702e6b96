package nvfp4

import (
	"math"
	"testing"
)

// raceEnabled is set by race_test.go when built with -race.
var raceEnabled = false

// exhaustiveStride is 1 (every pattern) normally and a prime under -short
// or -race.
func exhaustiveStride() uint32 {
	if testing.Short() || raceEnabled {
		return 101
	}
	return 1
}

// TestE4M3EncodeExhaustive compares E4M3Encode with the reference on every
// float32 in [2^-11, 512) (every rounding decision of E4M3 lies in this range,
// plus the saturation band [448, 512)). Each goroutine walks its ascending
// range with a cursor into the sorted reference table, so the reference
// stays "nearest by exact distance, ties to even" at O(1) per input.
func TestE4M3EncodeExhaustive(t *testing.T) {
	lo, hi := math.Float32bits(0x1p-11), math.Float32bits(512)
	n := parallelBits(t, "E4M3Encode", lo, hi, exhaustiveStride(), func(first uint32, n int, stride uint32, log *failLog) {
		tab := refE4M3Table
		i := 0 // invariant: tab[i].v <= x and (i is last or x < tab[i+1].v)
		b := first
		for range n {
			x := math.Float32frombits(b)
			xv := float64(x)
			for i+1 < len(tab) && tab[i+1].v <= xv {
				i++
			}
			want := tab[i].code
			if i+1 < len(tab) {
				want = refPick(xv, tab[i], tab[i+1])
			}
			if xv <= 0x1p-10 && want != 0 {
				log.add("reference gives 0x%02X for %s <= 2^-10", want, fbits(x))
			}
			if got := E4M3Encode(x); got != want {
				log.add("E4M3Encode(%s) = 0x%02X, want 0x%02X", fbits(x), got, want)
			}
			b += stride
		}
	})
	t.Logf("checked %d float32 patterns", n)
}

// TestE4M3EncodeOutsideRange covers the rest of the float32 line on strided
// samples: tiny values, saturation, NaN, and the sign.
func TestE4M3EncodeOutsideRange(t *testing.T) {
	var log failLog
	// Below 2^-11 (including +0 and subnormals): zero.
	for b := uint32(0); b < math.Float32bits(0x1p-11); b += 9973 {
		if got := E4M3Encode(math.Float32frombits(b)); got != 0 {
			log.add("E4M3Encode(%s) = 0x%02X, want 0x00", fbits(math.Float32frombits(b)), got)
		}
	}
	// [512, +Inf]: saturate to 448.
	for b := math.Float32bits(512); b <= 0x7f800000; b += 7919 {
		if got := E4M3Encode(math.Float32frombits(b)); got != 0x7E {
			log.add("E4M3Encode(%s) = 0x%02X, want 0x7E", fbits(math.Float32frombits(b)), got)
		}
	}
	log.report(t, "strided")

	cases := []struct {
		name string
		bits uint32
		want uint8
	}{
		{"+0", 0x00000000, 0x00},
		{"-0", 0x80000000, 0x80},
		{"smallest subnormal", 0x00000001, 0x00},
		{"2^-10 tie to zero", math.Float32bits(0x1p-10), 0x00},
		{"just above 2^-10", math.Float32bits(0x1p-10) + 1, 0x01},
		{"1.5*2^-9 tie to even 2", math.Float32bits(1.5 * 0x1p-9), 0x02},
		{"448", math.Float32bits(448), 0x7E},
		{"just below 448", math.Float32bits(448) - 1, 0x7E},
		{"464 (would round to 480)", math.Float32bits(464), 0x7E},
		{"512", math.Float32bits(512), 0x7E},
		{"FLT_MAX", math.Float32bits(math.MaxFloat32), 0x7E},
		{"-FLT_MAX", math.Float32bits(-math.MaxFloat32), 0xFE},
		{"+Inf", 0x7f800000, 0x7E},
		{"-Inf", 0xff800000, 0xFE},
		{"+qNaN", 0x7fc00000, 0x7F},
		{"+sNaN", 0x7f800001, 0x7F},
		{"+NaN all ones", 0x7fffffff, 0x7F},
		{"-qNaN", 0xffc00000, 0xFF},
		{"-sNaN", 0xff800001, 0xFF},
	}
	for _, c := range cases {
		if got := E4M3Encode(math.Float32frombits(c.bits)); got != c.want {
			t.Errorf("%s: E4M3Encode(0x%08X) = 0x%02X, want 0x%02X", c.name, c.bits, got, c.want)
		}
	}

	// Negative inputs: the sign bit OR the positive code, and the reference
	// agrees over the whole non-NaN line.
	log = failLog{}
	for b := uint32(0); b <= 0x7f800000; b += 4093 {
		x := math.Float32frombits(b)
		pos, neg := E4M3Encode(x), E4M3Encode(-x)
		if neg != 0x80|pos {
			log.add("E4M3Encode(-%s) = 0x%02X, want 0x80|0x%02X", fbits(x), neg, pos)
		}
		if want := refE4M3Encode(x); pos != want {
			log.add("E4M3Encode(%s) = 0x%02X, reference 0x%02X", fbits(x), pos, want)
		}
	}
	log.report(t, "sign")
}

// TestE4M3Decode checks all 256 bytes against the table built from the bit
// definition.
func TestE4M3Decode(t *testing.T) {
	for b := range 256 {
		got := E4M3Decode(uint8(b))
		if b&0x7f == 0x7f {
			if !math.IsNaN(float64(got)) {
				t.Errorf("E4M3Decode(0x%02X) = %v, want NaN", b, got)
			}
			continue
		}
		v := refE4M3Values[b&0x7f]
		if b&0x80 != 0 {
			v = math.Copysign(v, -1) // also gives -0 for 0x80
		}
		if math.Float32bits(got) != math.Float32bits(float32(v)) {
			t.Errorf("E4M3Decode(0x%02X) = %s, want %s", b, fbits(got), fbits(float32(v)))
		}
		// Every finite code round-trips through the encoder.
		if enc := E4M3Encode(got); enc != uint8(b) {
			t.Errorf("E4M3Encode(E4M3Decode(0x%02X)) = 0x%02X", b, enc)
		}
	}
}

// TestE2M1EncodeExhaustive compares E2M1Encode with the reference on every
// float32 in [2^-4, 16), which holds every decision point and saturation.
func TestE2M1EncodeExhaustive(t *testing.T) {
	lo, hi := math.Float32bits(0x1p-4), math.Float32bits(16)
	n := parallelBits(t, "E2M1Encode", lo, hi, exhaustiveStride(), func(first uint32, n int, stride uint32, log *failLog) {
		tab := refE2M1Table
		b := first
		for range n {
			x := math.Float32frombits(b)
			xv := float64(x)
			// Brute force over all eight values: nearest, ties to even code.
			best := tab[0]
			for _, c := range tab[1:] {
				db, dc := math.Abs(xv-best.v), math.Abs(xv-c.v)
				if dc < db || (dc == db && c.code&1 == 0) {
					best = c
				}
			}
			if got := E2M1Encode(x); got != best.code {
				log.add("E2M1Encode(%s) = %d, want %d", fbits(x), got, best.code)
			}
			b += stride
		}
	})
	t.Logf("checked %d float32 patterns", n)
}

// TestE2M1EncodeOutsideRange: below 2^-4 everything is 0, the sign is kept
// (negative zero-ish values are code 8), and infinities saturate.
func TestE2M1EncodeOutsideRange(t *testing.T) {
	var log failLog
	for b := uint32(0); b < math.Float32bits(0x1p-4); b += 7919 {
		x := math.Float32frombits(b)
		if got := E2M1Encode(x); got != 0 {
			log.add("E2M1Encode(%s) = %d, want 0", fbits(x), got)
		}
		if got := E2M1Encode(-x); got != 8 {
			log.add("E2M1Encode(-%s) = %d, want 8", fbits(x), got)
		}
	}
	for b := math.Float32bits(16); b <= 0x7f800000; b += 7919 {
		if got := E2M1Encode(math.Float32frombits(b)); got != 7 {
			log.add("E2M1Encode(%s) = %d, want 7", fbits(math.Float32frombits(b)), got)
		}
	}
	for b := uint32(0); b <= 0x7f800000; b += 4093 {
		x := math.Float32frombits(b)
		pos, neg := E2M1Encode(x), E2M1Encode(-x)
		if neg != pos|8 {
			log.add("E2M1Encode(-%s) = %d, want %d|8", fbits(x), neg, pos)
		}
		if want := refE2M1Encode(x); pos != want {
			log.add("E2M1Encode(%s) = %d, reference %d", fbits(x), pos, want)
		}
	}
	log.report(t, "strided")

	cases := []struct {
		name string
		x    float32
		want uint8
	}{
		{"+0", 0, 0},
		{"-0", float32(math.Copysign(0, -1)), 8},
		{"-smallest subnormal", -math.Float32frombits(1), 8},
		{"-0.25 tie to -0", -0.25, 8},
		{"-0.1", -0.1, 8},
		{"0.75 tie to 1", 0.75, 2},
		{"-1.75 tie to -2", -1.75, 12},
		{"3.5 tie to 4", 3.5, 6},
		{"5 tie to 4", 5, 6},
		{"6", 6, 7},
		{"-6", -6, 15},
		{"+Inf", float32(math.Inf(1)), 7},
		{"-Inf", float32(math.Inf(-1)), 15},
		{"FLT_MAX", math.MaxFloat32, 7},
	}
	for _, c := range cases {
		if got := E2M1Encode(c.x); got != c.want {
			t.Errorf("%s: E2M1Encode(%v) = %d, want %d", c.name, c.x, got, c.want)
		}
	}
}

// TestE2M1Decode checks all 16 codes, and that only the low nibble is read.
func TestE2M1Decode(t *testing.T) {
	for c := range 256 {
		v := refE2M1Table[c&7].v
		if c&8 != 0 {
			v = math.Copysign(v, -1) // code 8 is -0
		}
		got := E2M1Decode(uint8(c))
		if math.Float32bits(got) != math.Float32bits(float32(v)) {
			t.Errorf("E2M1Decode(0x%02X) = %s, want %s", c, fbits(got), fbits(float32(v)))
		}
		if c < 16 {
			if enc := E2M1Encode(got); enc != uint8(c) {
				t.Errorf("E2M1Encode(E2M1Decode(%d)) = %d", c, enc)
			}
		}
	}
}
