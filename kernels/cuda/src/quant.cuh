// The NVFP4 quantizers' device code: amax spans, block loads, per-row and
// per-matrix block quantization. quantize.cu's kernels and dispatch.cu's
// fused dispatch (which quantizes activation rows as quant_rows does) share
// it.
#ifndef RW_QUANT_CUH
#define RW_QUANT_CUH

#include "numerics.cuh"
#include "reduce.cuh"

namespace rw {

// amax_span returns the largest BF16 magnitude (as bits) of n values at m
// that a thread takes from index i0 in steps of stride: with vec (n % 8 ==
// 0, 16-byte aligned) eight values a load, four loads in flight, and the
// two halves of a packed maximum folded once at the end.
__device__ __forceinline__ unsigned amax_span(const bf16_t *m, long long n, long long i0, long long stride, int vec) {
    unsigned v = 0;
    long long i = i0;
    if (vec) {
        const uint4 *p = reinterpret_cast<const uint4 *>(m);
        const long long n8 = n / 8;
        auto fold = [&](uint4 q) {
            v = __vmaxu2(v, __vmaxu2(__vmaxu2(q.x & 0x7fff7fffu, q.y & 0x7fff7fffu), __vmaxu2(q.z & 0x7fff7fffu, q.w & 0x7fff7fffu)));
        };
        for (; i + 3 * stride < n8; i += 4 * stride) {
            uint4 q[4];
#pragma unroll
            for (int u = 0; u < 4; u++) q[u] = p[i + u * stride];
#pragma unroll
            for (int u = 0; u < 4; u++) fold(q[u]);
        }
        for (; i < n8; i += stride) fold(p[i]);
        return max(v & 0xffffu, v >> 16);
    }
    for (; i < n; i += stride) v = max(v, (unsigned)(m[i] & 0x7fff));
    return v;
}

// load_block reads the 16 BF16 values of block b of a row of k values as
// 8 words of two, zero past k.
__device__ __forceinline__ void load_block(unsigned w[8], const bf16_t *row, int b, int k, int vec) {
    int lo = b * 16;
    if (vec && lo + 16 <= k) {
        uint4 p0 = *reinterpret_cast<const uint4 *>(row + lo);
        uint4 p1 = *reinterpret_cast<const uint4 *>(row + lo + 8);
        w[0] = p0.x, w[1] = p0.y, w[2] = p0.z, w[3] = p0.w;
        w[4] = p1.x, w[5] = p1.y, w[6] = p1.z, w[7] = p1.w;
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const unsigned a = lo + 2 * i < k ? row[lo + 2 * i] : 0u, c = lo + 2 * i + 1 < k ? row[lo + 2 * i + 1] : 0u;
        w[i] = a | c << 16;
    }
}

// quant_store quantizes block b of row `row` (k values, padded to kp) and
// stores its 8 packed bytes and its scale byte.
__device__ __forceinline__ void quant_store(const bf16_t *src, unsigned char *packed, unsigned char *scales, long long row, int b,
                                            int k, int kp, int vec, float sencinv6, float sdec) {
    unsigned w[8];
    load_block(w, src + row * k, b, k, vec);
    unsigned lo, hi;
    unsigned sf = quant_block(w, sencinv6, sdec, &lo, &hi);
    *reinterpret_cast<uint2 *>(packed + row * (kp / 2) + b * 8) = make_uint2(lo, hi);
    scales[row * (kp / 16) + b] = (unsigned char)sf;
}

// Per-matrix quantization (one global scale for a whole matrix) takes a
// block's element scale from a table: with S_dec fixed, enc depends on the
// scale byte alone, so the block-wide threads fill its 128 entries once a
// matrix (the IEEE division then runs 128 times, not once a block).
constexpr int ENC_TABLE = 128;
__device__ __forceinline__ void fill_enc_table(float *tab, float sdec) {
    for (int i = threadIdx.x; i < ENC_TABLE; i += blockDim.x) tab[i] = block_enc(i, sdec);
}

// quant_matrix_blocks quantizes 16-element blocks j0, j0 + step, ... (below
// blocksPer) of the matrix at src (rows of k values, padded to kp), with
// the matrix's RN(S_enc * INV6) and enc table. A matrix without padding
// (k == kp, vec) is one flat run of blocks: block j is 32 bytes at 32j, its
// codes 8 bytes at 8j and its scale byte at j, no row arithmetic.
__device__ __forceinline__ void quant_matrix_blocks(const bf16_t *src, unsigned char *packed, unsigned char *scales, unsigned j0,
                                                    unsigned step, unsigned blocksPer, int k, int kp, int vec, float sencinv6,
                                                    const float *tab) {
    const unsigned nb = (unsigned)kp / 16;
    const bool flat = vec && k == kp;
    for (unsigned j = j0; j < blocksPer; j += step) {
        unsigned w[8];
        unsigned char *pk, *sc;
        if (flat) {
            const uint4 p0 = reinterpret_cast<const uint4 *>(src)[2 * j], p1 = reinterpret_cast<const uint4 *>(src)[2 * j + 1];
            w[0] = p0.x, w[1] = p0.y, w[2] = p0.z, w[3] = p0.w;
            w[4] = p1.x, w[5] = p1.y, w[6] = p1.z, w[7] = p1.w;
            pk = packed + 8ull * j;
            sc = scales + j;
        } else {
            const unsigned r = j / nb, b = j - r * nb;
            load_block(w, src + (long long)r * k, (int)b, k, vec);
            pk = packed + (long long)r * (kp / 2) + 8 * b;
            sc = scales + (long long)r * nb + b;
        }
        const unsigned sf = block_sf(block_amax(w), sencinv6);
        unsigned lo, hi;
        quant_elems(w, tab[sf & (ENC_TABLE - 1)], &lo, &hi);
        *reinterpret_cast<uint2 *>(pk) = make_uint2(lo, hi);
        *sc = (unsigned char)sf;
    }
}

// quant_row_block quantizes one row per block (quant_rows, dispatch_r),
// with the row's own global scale (per_token). The block takes the row's amax (an order-free max), then
// quantizes blocks t, t+blockDim, ... in thread t, and writes the row's
// S_dec. A block per row keeps decode (a handful of rows) from running on
// a single warp. With given (the per_tensor recipe: the tensor's S_dec in
// device memory) the row takes that scale instead of its amax's.
__device__ __forceinline__ void quant_row_block(const bf16_t *src, unsigned char *packed, unsigned char *scales, float *scale, int row,
                                                int k, int kp, int vec, const float *given) {
    float senc, sdec;
    if (given != nullptr) {
        input_scale(*given, &senc, &sdec);
    } else {
        __shared__ unsigned red[32];
        const bf16_t *r = src + (long long)row * k;
        const unsigned m = block_reduce(amax_span(r, k, threadIdx.x, blockDim.x, vec), red, OpMax());
        encode_scale(__uint_as_float(m << 16), &senc, &sdec);
    }
    const float sencinv6 = __fmul_rn(senc, NVFP4_INV6);
    for (int b = threadIdx.x; b < kp / 16; b += blockDim.x) quant_store(src, packed, scales, row, b, k, kp, vec, sencinv6, sdec);
    if (threadIdx.x == 0) scale[row] = sdec;
}

} // namespace rw

#endif // RW_QUANT_CUH
