package philox

import (
	"math"
	"testing"
)

// Known answers from Random123's kat_vectors (philox4x32, 10 rounds).
func TestKnownAnswers(t *testing.T) {
	for _, tc := range []struct {
		ctr  [4]uint32
		key  [2]uint32
		want [4]uint32
	}{
		{[4]uint32{0, 0, 0, 0}, [2]uint32{0, 0},
			[4]uint32{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
		{[4]uint32{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, [2]uint32{0xffffffff, 0xffffffff},
			[4]uint32{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
		{[4]uint32{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, [2]uint32{0xa4093822, 0x299f31d0},
			[4]uint32{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
	} {
		if got := Block(tc.ctr, tc.key); got != tc.want {
			t.Errorf("Block(%#x, %#x) = %#x, want %#x", tc.ctr, tc.key, got, tc.want)
		}
	}
}

// Uniform is exactly the documented formula, and the seed's halves, the
// sample id and the position land in the documented words.
func TestUniformLayout(t *testing.T) {
	const seed = 0x0123456789abcdef
	x := Block([4]uint32{7, 3, 0, 0}, [2]uint32{0x89abcdef, 0x01234567})
	want := float64(uint64(x[0])<<21|uint64(x[1])>>11) / (1 << 53)
	if got := Uniform(seed, 3, 7); got != want {
		t.Fatalf("Uniform = %v, want %v", got, want)
	}
	if Uniform(seed, 3, 7) == Uniform(seed, 7, 3) || Uniform(seed, 3, 7) == Uniform(seed^1<<32, 3, 7) {
		t.Fatal("sample id, position and seed high word are not independent inputs")
	}
}

// The draws are in [0, 1) with the moments of a uniform distribution.
func TestUniformMoments(t *testing.T) {
	const n = 1 << 15
	var sum, sq float64
	for i := range uint32(n) {
		u := Uniform(42, i%17, i)
		if u < 0 || u >= 1 {
			t.Fatalf("draw %d = %v is outside [0, 1)", i, u)
		}
		sum += u
		sq += u * u
	}
	mean, v := sum/n, sq/n-(sum/n)*(sum/n)
	// Standard errors: 1/sqrt(12n) for the mean, about 1/sqrt(180n) for the
	// variance; allow 6 of each.
	if math.Abs(mean-0.5) > 6/math.Sqrt(12*n) || math.Abs(v-1.0/12) > 6/math.Sqrt(180*n) {
		t.Fatalf("mean %v, variance %v; want 0.5 and 1/12", mean, v)
	}
}

func BenchmarkUniform(b *testing.B) {
	var s float64
	for i := range b.N {
		s += Uniform(1, 2, uint32(i))
	}
	_ = s
}
