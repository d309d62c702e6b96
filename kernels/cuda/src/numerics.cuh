// BF16 and NVFP4 numerics shared by every compile unit: BF16 conversions,
// the E2M1 and E4M3 codecs and the NVFP4 scale math. Every arithmetic step
// of the NVFP4 codec is one IEEE binary32 operation rounded to nearest-even
// (__fmul_rn, __fdiv_rn), so it matches internal/nvfp4 bit for bit;
// nothing here may use fast math.
#ifndef RW_NUMERICS_CUH
#define RW_NUMERICS_CUH

#include <cuda_bf16.h>

namespace rw {

typedef unsigned short bf16_t; // BF16 bit pattern, as stored in buffers

// inf_f32 is +Inf (NVRTC has no math.h).
__device__ __forceinline__ float inf_f32() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float bf2f(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }

// f2bf rounds to nearest-even; NaN stays NaN (cuda_bf16's conversion, which
// matches internal/bf16 bit for bit, checked in internal/cuda's tests).
__device__ __forceinline__ bf16_t f2bf(float f) {
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    return *reinterpret_cast<bf16_t *>(&b);
}

// bfround is bf2f(f2bf(x)).
__device__ __forceinline__ float bfround(float x) { return bf2f(f2bf(x)); }

// ---- NVFP4 (docs/NVFP4.md) ----

constexpr float NVFP4_G = 2688.0f;
constexpr float NVFP4_INV6 = 0x1.555556p-3f; // RN(1/6): bits 0x3E2AAAAB
constexpr float FLT_MAX_F = 0x1.fffffep+127f; // bits 0x7F7FFFFF

// min32 keeps a when a is NaN (like internal/nvfp4's min32).
__device__ __forceinline__ float min32(float a, float b) { return b < a ? b : a; }

__device__ __forceinline__ float e2m1_decode(unsigned c) {
    const float v[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    float m = v[c & 7];
    return (c & 8) ? -m : m;
}

// e4m3_decode returns the value of a float8_e4m3fn byte (0x7F/0xFF: NaN).
__device__ __forceinline__ float e4m3_decode(unsigned b) {
    unsigned e = (b >> 3) & 0xf, m = b & 7;
    float v;
    if ((b & 0x7f) == 0x7f) return __uint_as_float(0x7fc00000u);
    if (e == 0) v = (float)m * (1.0f / 512.0f);
    else v = __uint_as_float(((e + 120u) << 23) | (m << 20)); // (1 + m/8) * 2^(e-7)
    return (b & 0x80) ? -v : v;
}

// e4m3_satfinite converts to E4M3 by the sm_89+ conversion instruction (the
// one NVFP4.md names: RNE, saturating at +-448, NaN 0x7F), as
// internal/nvfp4 does in software.
__device__ __forceinline__ unsigned e4m3_satfinite(float x) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return r & 0xffu;
}

// e4m3_value is e4m3_decode by conversion: E4M3 to FP16 is exact, and so
// is FP16 to FP32.
__device__ __forceinline__ float e4m3_value(unsigned b) {
    unsigned h;
    float f;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)b));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(h & 0xffffu)));
    return f;
}

// encode_scale: S_enc = amax == 0 ? 1 : min(RN(G/amax), FLT_MAX), 1 if that
// is 0; S_dec = RN(1/S_enc).
__device__ __forceinline__ void encode_scale(float amax, float *senc, float *sdec) {
    float s = 1.0f;
    if (amax != 0.0f) {
        s = min32(__fdiv_rn(NVFP4_G, amax), FLT_MAX_F);
        if (s == 0.0f) s = 1.0f;
    }
    *senc = s;
    *sdec = __fdiv_rn(1.0f, s);
}

// input_scale: a tensor quantized with a given global decode scale (the
// per_tensor recipe): S_enc = min(RN(1/S_dec), FLT_MAX), S_dec unchanged.
__device__ __forceinline__ void input_scale(float given, float *senc, float *sdec) {
    *senc = min32(__fdiv_rn(1.0f, given), FLT_MAX_F);
    *sdec = given;
}

// prmt is PTX prmt.b32 in its default mode: byte n of the result is byte
// (s_n & 7) of the pair {b, a} (a holds bytes 0-3), where s_n is nibble n
// of s; with bit 3 of s_n set, that byte's sign bit fills the whole byte.
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned s) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

// e2m1_pack8 returns the E2M1 codes of the 8 BF16 values in w[0..3]
// (element 2i in the low half of w[i]) times enc, packed as NVFP4 stores
// them (element e in nibble e). Per element: with a = min(|x|, 6) and
// t = max(exponent(a), 0) (t = 0 below 2), the E2M1 grid step near a is
// 2^(t-1), so adding M = 1.5 * 2^(22+t) (whose ulp is that step) rounds a
// to the grid, ties to even, and the integer bits above M count steps;
// code = steps + 2t. M and M - 2t are both linear in max(exponent field,
// 127). That is folded into the packing: code magnitude e is bits(a + M) - n (n linear in the
// exponent field) and lies in 0..7, so the sum of the
// differences shifted by 4e is exact modulo 2^32 and each term can be
// added as it comes (two multiply-adds an element, the constant parts of
// n once a word). The signs are those of the inputs (enc > 0, so the
// products have them): the high byte of each BF16 value, sign-replicated
// and gathered by four byte permutes, masked into bits 3 and 7 of each
// byte. keep is all ones, or zero when enc is NaN (then every product is
// the device's positive NaN and the codes are unsigned).
__device__ __forceinline__ unsigned e2m1_pack8(const unsigned w[4], float enc, unsigned keep) {
    unsigned acc = 0;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const unsigned word = w[e / 2];
        const float x = __uint_as_float(e % 2 ? word & 0xffff0000u : word << 16);
        const float a = fminf(fabsf(__fmul_rn(x, enc)), 6.0f); // min.f32 returns 6 for NaN
        const unsigned ex = max(__float_as_uint(a) >> 23, 127u);
        const unsigned bits = __float_as_uint(__fadd_rn(a, __uint_as_float(ex * (1u << 23) + 0x0B400000u)));
        acc += (bits << (4 * e)) - ex * (((1u << 23) - 2u) << (4 * e));
    }
    acc -= 0x0B4000FEu * 0x11111111u; // the constant part of n in every nibble
    // Sign bytes: t0 = [s0 s2 s1 s3], t1 = [s4 s6 s5 s7] (sk: element k's
    // sign over a whole byte), then the even and the odd ones in order.
    const unsigned t0 = prmt(w[0], w[1], 0xFBD9u), t1 = prmt(w[2], w[3], 0xFBD9u);
    return acc | (prmt(t0, t1, 0x5410u) & (keep & 0x08080808u)) | (prmt(t0, t1, 0x7632u) & (keep & 0x80808080u));
}

// block_amax returns the largest BF16 magnitude (as bits) of 16 values
// given as 8 words of two.
__device__ __forceinline__ unsigned block_amax(const unsigned w[8]) {
    unsigned m[4];
#pragma unroll
    for (int i = 0; i < 4; i++) m[i] = __vmaxu2(w[2 * i] & 0x7fff7fffu, w[2 * i + 1] & 0x7fff7fffu);
    const unsigned v = __vmaxu2(__vmaxu2(m[0], m[1]), __vmaxu2(m[2], m[3]));
    return max(v & 0xffffu, v >> 16);
}

// block_sf returns the E4M3 scale byte of a block whose largest magnitude
// is vm, given RN(S_enc * INV6): RN(min(vm * sencinv6, FLT_MAX)) in E4M3.
// It is below 0x80: the product is not negative, and NaN gives 0x7F.
__device__ __forceinline__ unsigned block_sf(unsigned vm, float sencinv6) {
    return e4m3_satfinite(min32(__fmul_rn(bf2f((bf16_t)vm), sencinv6), FLT_MAX_F));
}

// block_enc returns a block's element scale enc = min(RN(1 / RN(E4M3(sf)
// * S_dec)), FLT_MAX); sf = 0 gives 1/0 = Inf, so FLT_MAX.
__device__ __forceinline__ float block_enc(unsigned sf, float sdec) {
    return min32(__fdiv_rn(1.0f, __fmul_rn(e4m3_value(sf), sdec)), FLT_MAX_F);
}

// quant_elems writes the 16 codes of the block in w (scaled by enc) as two
// 32-bit words of packed bytes.
__device__ __forceinline__ void quant_elems(const unsigned w[8], float enc, unsigned *lo, unsigned *hi) {
    const unsigned keep = enc == enc ? ~0u : 0u;
    *lo = e2m1_pack8(w, enc, keep);
    *hi = e2m1_pack8(w + 4, enc, keep);
}

// quant_block quantizes 16 BF16 values, given as 8 words of two (element
// 2i in the low half of w[i]; zero-padded by the caller), with
// RN(S_enc*INV6) = sencinv6 and S_dec: it returns the scale byte and writes
// 8 packed bytes as two 32-bit words.
__device__ __forceinline__ unsigned quant_block(const unsigned w[8], float sencinv6, float sdec, unsigned *lo, unsigned *hi) {
    const unsigned sf = block_sf(block_amax(w), sencinv6);
    quant_elems(w, block_enc(sf, sdec), lo, hi);
    return sf;
}

} // namespace rw

#endif // RW_NUMERICS_CUH
