// Package philox is the counter-based Philox4x32-10 generator of Random123
// (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011),
// and the one uniform draw the sampler makes from it.
//
// A counter-based generator has no state: the output is a pure function of
// a 128-bit counter and a 64-bit key. That is what lets a sample's draws
// depend only on (seed, sample, position), never on the other rows of a
// batch or on how the batch was scheduled, and it is why the CUDA sampler can
// reproduce the CPU's draws bit for bit. Everything here is pure and safe for
// concurrent use.
//
// The CUDA kernel must compute exactly what Uniform documents.
package philox

import "math/bits"

// Philox4x32 constants from Random123 (philox.h): the round multipliers and
// the Weyl increments (golden ratio and sqrt(3)-1, as 32-bit fractions) that
// bump the key between rounds.
const (
	M0 = 0xD2511F53
	M1 = 0xCD9E8D57
	W0 = 0x9E3779B9
	W1 = 0xBB67AE85

	// Rounds is the round count of Philox4x32-10.
	Rounds = 10
)

// Block returns Philox4x32-10 of counter ctr under key key. Each of the ten
// rounds is
//
//	hi0, lo0 = mulhilo(M0, c0)
//	hi1, lo1 = mulhilo(M1, c2)
//	c = {hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0}
//
// and the key is bumped (k0 += W0, k1 += W1, mod 2^32) between rounds.
func Block(ctr [4]uint32, key [2]uint32) [4]uint32 {
	c, k := ctr, key
	for r := range Rounds {
		if r > 0 {
			k[0] += W0
			k[1] += W1
		}
		hi0, lo0 := bits.Mul32(M0, c[0])
		hi1, lo1 := bits.Mul32(M1, c[2])
		c = [4]uint32{hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0}
	}
	return c
}

// Uniform returns the sampler's uniform draw in [0, 1) for one token:
//
//	x = Block({position, sampleID, 0, 0}, {uint32(seed), uint32(seed >> 32)})
//	u = float64((uint64(x[0]) << 32 | uint64(x[1])) >> 11) * 2^-53
//
// that is, the top 53 bits of the 64-bit word with x[0] high and x[1] low,
// scaled by 2^-53. Both steps are exact in binary64, so u is a multiple of
// 2^-53 in [0, 1 - 2^-53] and every implementation gets the same bits.
func Uniform(seed uint64, sampleID, position uint32) float64 {
	x := Block([4]uint32{position, sampleID, 0, 0}, [2]uint32{uint32(seed), uint32(seed >> 32)})
	return float64((uint64(x[0])<<32|uint64(x[1]))>>11) * 0x1p-53
}
