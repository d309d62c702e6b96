// MMA fragments of the NVFP4 grouped GEMMs (streamed, tiled and
// warp-specialised): how a 128-K chunk's codes and block scales become BF16
// fragment registers, slice by slice. See invariance.cuh for why every
// kernel must take its fragments from here.
#ifndef RW_FRAGMENTS_CUH
#define RW_FRAGMENTS_CUH

#include "numerics.cuh"

namespace rw {

// NVFP4 dequantization is exact and needs no table for the codes: g5_pair
// places E2M1 nibbles i and i+4 of a word as BF16 code * 2^-126 (code 0.5
// is subnormal, which BF16 arithmetic keeps), and one packed BF16 multiply
// by bf16(E4M3 * 2^118) (a 256-entry table in shared memory) gives
// value * 2^-8: e2m1 * E4M3 has at most 6 significant bits and stays in
// BF16's normal range. The products in the MMA are then 2^-16 times the
// true ones, so the FP32 accumulator times 2^16 is exact too.
// TestConformance/GroupedGemmExact checks all of it bit for bit.
constexpr int G5_KC = 128; // K per chunk

// g5_pair returns nibbles i and i + 4 of q as a BF16 pair of code * 2^-126:
// sign to bit 15, exponent and mantissa bits to 8..6. One multiply puts two
// copies of the masked nibble 6 bits apart (x * (2^a + 2^(a+6)) = x << a |
// x << (a+6): the copies do not overlap, so no carry), the mask keeps the
// sign of one copy and the magnitude of the other.
__device__ __forceinline__ unsigned g5_pair(unsigned q, int i) {
    const unsigned x = (i < 2 ? q : q >> 8) & (i & 1 ? 0x00F000F0u : 0x000F000Fu);
    return (x * (i & 1 ? 0x104u : 0x1040u)) & 0x81C081C0u;
}

// g5_scale is x * s for BF16 pairs, exactly (the -0 addend keeps the sign
// of a zero product).
__device__ __forceinline__ unsigned g5_scale(unsigned x, unsigned s) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(s), "r"(0x80008000u));
    return d;
}

// g5_slice4 returns slice s's two fragment words of a lane's NVFP4 share:
// q is the share's word s/2, sc its block's scale pair.
__device__ __forceinline__ void g5_slice4(unsigned q, unsigned sc, int s, unsigned &lo, unsigned &hi) {
    lo = g5_scale(g5_pair(q, 2 * (s & 1)), sc);
    hi = g5_scale(g5_pair(q, 2 * (s & 1) + 1), sc);
}

// quarter_halves reads a row's quarter of chunk c by its 8-byte halves,
// each only if its block lies inside K (nb blocks; b0 the half's first):
// codes from src into q (zeros left where not), the two block scales from
// ssrc into sf (block b0 in bits 0-7). The path for a chunk that is not
// whole, or for rows not of whole 16-byte units.
__device__ __forceinline__ void quarter_halves(uint4 &q, unsigned &sf, const unsigned char *src, const unsigned char *ssrc, int c,
                                               int nfull, int nb, int b0) {
    if (c < nfull || b0 < nb) {
        const uint2 v = __ldg(reinterpret_cast<const uint2 *>(src));
        q.x = v.x;
        q.y = v.y;
        sf = __ldg(ssrc);
    }
    if (c < nfull || b0 + 1 < nb) {
        const uint2 v = __ldg(reinterpret_cast<const uint2 *>(src + 8));
        q.z = v.x;
        q.w = v.y;
        sf |= (unsigned)__ldg(ssrc + 1) << 8;
    }
}

} // namespace rw

#endif // RW_FRAGMENTS_CUH
