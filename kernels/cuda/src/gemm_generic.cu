// Compile unit: the generic grouped GEMM (grouped_gemm: BF16 or NVFP4
// operands, the dense GEMMs wider than gemm_narrow and unaligned operands)
// and the staged NVFP4 x NVFP4 one (gemm_staged: for A past the streamed
// kernels' 32-bit offsets).
#include "numerics.cuh"
#include "ptx.cuh"
#include "errors.cuh"
#include "schedule.cuh"

namespace rw {

// ---- Grouped GEMM ----
//
// One kernel for the dense GEMM (no offsets: one group of r rows) and the
// grouped expert GEMMs. A block computes BM sorted rows of one expert by
// BN output columns (for SwiGLU also the BN matching "up" rows of W), with
// 4 warps of 32x32 and BF16 mma.sync m16n8k16 (FP32 accumulation). NVFP4
// operands are dequantized to BF16 exactly while they are staged in shared
// memory. Each output's reduction runs over K in the same order whatever
// the batch: BK-wide steps, and within a step the MMA's k16 slices in order.

constexpr int GG_BN = 64;
constexpr int GG_BK = 32;
constexpr int GG_LD = (GG_BK + 8); // padded row of a shared tile, in BF16 elements

__device__ __forceinline__ unsigned pack_bf2(bf16_t lo, bf16_t hi) { return (unsigned)lo | ((unsigned)hi << 16); }

// stage16 writes 16 BF16 values of one operand row (k0 .. k0+15 of the
// reduction) into dst: from BF16 with bounds, or dequantized NVFP4.
__device__ __forceinline__ void stage16(bf16_t *dst, int fmt, const bf16_t *bf, const unsigned char *packed,
                                        const unsigned char *sf, long long row, int rowK, int k0, int vec, bool valid) {
    unsigned w[8];
    if (!valid || k0 >= rowK) {
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = 0;
    } else if (fmt == 1) {
        // NVFP4: k0 is a block boundary (16-aligned) and rowK a multiple of 16.
        uint2 p = *reinterpret_cast<const uint2 *>(packed + row * (rowK / 2) + k0 / 2);
        float s = e4m3_decode(sf[row * (rowK / 16) + k0 / 16]);
        unsigned q[2] = {p.x, p.y};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            unsigned byte = (q[i / 4] >> (8 * (i % 4))) & 0xff;
            // e2m1 * E4M3 has at most 5 significant bits: exact in BF16.
            w[i] = pack_bf2(f2bf(e2m1_decode(byte & 15) * s), f2bf(e2m1_decode(byte >> 4) * s));
        }
    } else {
        const bf16_t *r = bf + row * rowK;
        if (vec && k0 + 16 <= rowK) {
            uint4 a = *reinterpret_cast<const uint4 *>(r + k0);
            uint4 b = *reinterpret_cast<const uint4 *>(r + k0 + 8);
            w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
            w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int k = k0 + 2 * i;
                w[i] = pack_bf2(k < rowK ? r[k] : (bf16_t)0, k + 1 < rowK ? r[k + 1] : (bf16_t)0);
            }
        }
    }
    uint4 *d = reinterpret_cast<uint4 *>(dst);
    d[0] = make_uint4(w[0], w[1], w[2], w[3]);
    d[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// gg_mma runs a warp's MI m16 x NJ n8 tiles (and, for SwiGLU, the matching
// "up" tiles GG_BN rows further down W) over NK k16 slices of staged BF16
// tiles with row stride LD, in k order. Every output element is its own
// MMA lane accumulating the same k16 slices in the same order whatever the
// tile shape, so tile shapes may change with the batch without changing a
// bit.
template <int NK, int LD, int MI, int NJ, bool SWIGLU>
__device__ __forceinline__ void gg_mma_t(const bf16_t *As, const bf16_t *Ws, float acc[][4][4], float accU[][4][4], int wm, int wn,
                                         int g, int t4) {
#pragma unroll
    for (int ks = 0; ks < NK * 16; ks += 16) {
        unsigned af[MI][4];
#pragma unroll
        for (int i = 0; i < MI; i++) {
            const bf16_t *p = &As[(wm + i * 16 + g) * LD + ks + 2 * t4];
            af[i][0] = *reinterpret_cast<const unsigned *>(p);
            af[i][1] = *reinterpret_cast<const unsigned *>(p + 8 * LD);
            af[i][2] = *reinterpret_cast<const unsigned *>(p + 8);
            af[i][3] = *reinterpret_cast<const unsigned *>(p + 8 * LD + 8);
        }
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const bf16_t *p = &Ws[(wn + j * 8 + g) * LD + ks + 2 * t4];
            unsigned b0 = *reinterpret_cast<const unsigned *>(p), b1 = *reinterpret_cast<const unsigned *>(p + 8);
#pragma unroll
            for (int i = 0; i < MI; i++) mma16816(acc[i][j], af[i], b0, b1);
            if (SWIGLU) {
                const bf16_t *u = p + GG_BN * LD;
                unsigned u0 = *reinterpret_cast<const unsigned *>(u), u1 = *reinterpret_cast<const unsigned *>(u + 8);
#pragma unroll
                for (int i = 0; i < MI; i++) mma16816(accU[i][j], af[i], u0, u1);
            }
        }
    }
}

// gg_epilogue: global scales in FP32 (acc * per-row scale * alpha), the
// activation, one rounding to the output type.
template <int MI, int NJ>
__device__ __forceinline__ void gg_epilogue_t(float acc[][4][4], float accU[][4][4], const int *src, int row0, int row1, int c0,
                                            int aFmt, const float *aScale, int wFmt, float alpha, int act, void *out, int outN,
                                            int outFmt, int wm, int wn, int g, int t4) {
    const bool swiglu = act == 3;
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int rr = wm + i * 16 + g + 8 * h;
            int r = row0 + rr, a = src[rr];
            if (r >= row1 || a < 0) continue;
            float as = aFmt == 1 ? aScale[a] : 1.f;
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    int c = c0 + wn + j * 8 + 2 * t4 + q;
                    if (c >= outN) continue;
                    float v = acc[i][j][2 * h + q];
                    if (aFmt == 1) v = __fmul_rn(v, as);
                    if (wFmt == 1) v = __fmul_rn(v, alpha);
                    if (act == 2) { // squared ReLU
                        v = fmaxf(v, 0.f);
                        v = __fmul_rn(v, v);
                    } else if (swiglu) {
                        float u = accU[i][j][2 * h + q];
                        if (aFmt == 1) u = __fmul_rn(u, as);
                        if (wFmt == 1) u = __fmul_rn(u, alpha);
                        v = __fmul_rn(__fdiv_rn(v, __fadd_rn(1.f, expf(-v))), u);
                    }
                    long long o = (long long)r * outN + c;
                    if (outFmt == 1) reinterpret_cast<float *>(out)[o] = v;
                    else reinterpret_cast<bf16_t *>(out)[o] = f2bf(v);
                }
        }
}

__global__ void __launch_bounds__(128)
grouped_gemm(int *err, int aFmt, const bf16_t *A, const unsigned char *aPacked, const unsigned char *aSF,
             const float *aScale, int aK, int aVec, const int *gather, int Ta, int wFmt, const bf16_t *W,
             const unsigned char *wPacked, const unsigned char *wSF, const float *wScale, int wK, int wVec, int N,
             const int *offsets, int E, int R, int Kp, int act, void *out, int outN, int outFmt) {
    __shared__ __align__(16) bf16_t As[GG_BM * GG_LD];
    __shared__ __align__(16) bf16_t Ws[2 * GG_BN * GG_LD];
    __shared__ int s_expert, s_row0, s_row1;
    __shared__ int s_src[GG_BM];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool swiglu = act == 3;

    if (warp == 0) gg_schedule(err, offsets, E, R, lane, GG_BM, &s_expert, &s_row0, &s_row1);
    __syncthreads();
    const int expert = s_expert, row0 = s_row0, row1 = s_row1;
    if (expert < 0) return;
    gg_sources(err, s_src, gather, row0, row1, Ta);
    __syncthreads();

    const int c0 = blockIdx.y * GG_BN;
    const int wRows = swiglu ? 2 * GG_BN : GG_BN;
    const long long wBase = (long long)expert * N;
    float acc[2][4][4], accU[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) { acc[i][j][q] = 0.f; accU[i][j][q] = 0.f; }

    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32, g = lane >> 2, t4 = lane & 3;
    for (int k0 = 0; k0 < Kp; k0 += GG_BK) {
        // Stage A: 64 rows x 32 = 128 pieces of 16.
        {
            int r = tid >> 1, kk = k0 + (tid & 1) * 16;
            int src = s_src[r];
            stage16(&As[r * GG_LD + (tid & 1) * 16], aFmt, A, aPacked, aSF, src, aK, kk, aVec, src >= 0);
        }
        // Stage W: wRows rows x 32.
        for (int p = tid; p < wRows * 2; p += blockDim.x) {
            int r = p >> 1, kk = k0 + (p & 1) * 16;
            int n = r < GG_BN ? c0 + r : outN + c0 + (r - GG_BN); // up rows follow the gate rows
            bool ok = (r < GG_BN ? c0 + r : c0 + r - GG_BN) < outN;
            stage16(&Ws[r * GG_LD + (p & 1) * 16], wFmt, W, wPacked, wSF, wBase + n, wK, kk, wVec, ok);
        }
        __syncthreads();
        if (swiglu) gg_mma_t<GG_BK / 16, GG_LD, 2, 4, true>(As, Ws, acc, accU, wm, wn, g, t4);
        else gg_mma_t<GG_BK / 16, GG_LD, 2, 4, false>(As, Ws, acc, accU, wm, wn, g, t4);
        __syncthreads();
    }
    gg_epilogue_t<2, 4>(acc, accU, s_src, row0, row1, c0, aFmt, aScale, wFmt, wFmt == 1 ? wScale[expert] : 1.f, act, out, outN, outFmt,
                wm, wn, g, t4);
}

// ---- Grouped GEMM, NVFP4 x NVFP4, pipelined ----
//
// The per-token recipe's path: both operands NVFP4. Same tiles, the same
// MMA sequence over k16 slices in k order (so the same bits per output as
// grouped_gemm, whatever the batch), but K advances 128 at a time and the
// next step's raw NVFP4 bytes are loaded into registers while the current
// step computes, so every block keeps its next 12-24 KB in flight. The raw
// bytes are dequantized into the shared BF16 tiles through a 256-entry
// table of E2M1 pairs and one packed BF16 multiply by the block scale:
// e2m1 * E4M3 has at most 5 significant bits, so the product is exact.
constexpr int G4_BK = 128;
constexpr int G4_LD = (G4_BK + 8);

// A piece is 64 elements of one row: 32 packed bytes and 4 block scales.
struct G4Piece {
    uint2 q[4];
    unsigned sf; // the 4 scale bytes, block j in byte j
};

__device__ __forceinline__ void g4_load(G4Piece &p, const unsigned char *packed, const unsigned char *sf, long long row, int rowK,
                                        int k0, bool valid) {
    const unsigned char *pr = packed + row * (rowK / 2);
    const unsigned char *sr = sf + row * (rowK / 16);
    p.sf = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int k = k0 + 16 * j;
        if (valid && k < rowK) {
            p.q[j] = *reinterpret_cast<const uint2 *>(pr + k / 2);
            p.sf |= (unsigned)sr[k / 16] << (8 * j);
        } else {
            p.q[j] = make_uint2(0, 0);
        }
    }
}

// g4_store dequantizes a piece into 64 BF16 values at dst.
__device__ __forceinline__ void g4_store(bf16_t *dst, const G4Piece &p, const __nv_bfloat162 *lut) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float s = e4m3_decode((p.sf >> (8 * j)) & 0xff);
        const __nv_bfloat162 s2 = __float2bfloat162_rn(s); // exact: E4M3 has 4 significant bits
        unsigned w[8];
        const unsigned q[2] = {p.q[j].x, p.q[j].y};
#pragma unroll
        for (int b = 0; b < 8; b++) {
            __nv_bfloat162 v = __hmul2(lut[(q[b / 4] >> (8 * (b % 4))) & 0xff], s2);
            w[b] = *reinterpret_cast<unsigned *>(&v);
        }
        uint4 *d = reinterpret_cast<uint4 *>(dst + 16 * j);
        d[0] = make_uint4(w[0], w[1], w[2], w[3]);
        d[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
}

// g4_gemm is the kernel body for a BM-row tile (64, or 16 for experts with
// few rows each): 4 warps as 2x2 of 32x32, or 1x4 of 16x16.
template <int BM, bool SWIGLU>
__device__ __forceinline__ void g4_gemm(int *err, const unsigned char *aPacked, const unsigned char *aSF, const float *aScale, int Kp,
                                        const int *gather, int Ta, const unsigned char *wPacked, const unsigned char *wSF,
                                        const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out,
                                        int outN) {
    constexpr int MI = BM == 64 ? 2 : 1, NJ = BM == 64 ? 4 : 2;
    extern __shared__ __align__(16) unsigned char g4_smem[];
    __shared__ int s_expert, s_row0, s_row1;
    __shared__ int s_src[GG_BM];
    __shared__ __nv_bfloat162 lut[256];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    bf16_t *As = reinterpret_cast<bf16_t *>(g4_smem);
    bf16_t *Ws = As + BM * G4_LD;

    for (int b = tid; b < 256; b += blockDim.x) lut[b] = __floats2bfloat162_rn(e2m1_decode(b & 15), e2m1_decode(b >> 4));
    if (warp == 0) gg_schedule(err, offsets, E, R, lane, BM, &s_expert, &s_row0, &s_row1);
    __syncthreads();
    const int expert = s_expert, row0 = s_row0, row1 = s_row1;
    if (expert < 0) return;
    gg_sources(err, s_src, gather, row0, row1, Ta);
    __syncthreads();

    const int c0 = blockIdx.y * GG_BN;
    const long long wBase = (long long)expert * N;
    // This thread's pieces: A row tid/2 (first 2*BM threads), half tid%2;
    // W rows (p/2) for p = tid and, with SwiGLU, tid + 128 (the up rows).
    const int ar = tid >> 1, ah = (tid & 1) * 64;
    const bool aMine = ar < BM;
    const int asrc = aMine ? s_src[ar] : -1;
    long long wrow[2];
    bool wok[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = (tid + 128 * i) >> 1;
        const int col = r < GG_BN ? c0 + r : c0 + r - GG_BN;
        wok[i] = col < outN && (i == 0 || SWIGLU);
        wrow[i] = wBase + (r < GG_BN ? col : outN + col);
    }
    G4Piece pa, pw[2];
    g4_load(pa, aPacked, aSF, asrc, Kp, ah, asrc >= 0);
#pragma unroll
    for (int i = 0; i < 2; i++) g4_load(pw[i], wPacked, wSF, wrow[i], Kp, ah, wok[i]);

    float acc[MI][4][4], accU[MI][4][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) { acc[i][j][q] = 0.f; accU[i][j][q] = 0.f; }
    const int wm = BM == 64 ? (warp >> 1) * 32 : 0, wn = BM == 64 ? (warp & 1) * 32 : warp * 16;
    const int g = lane >> 2, t4 = lane & 3;
    for (int k0 = 0; k0 < Kp; k0 += G4_BK) {
        __syncthreads(); // the previous step's tiles are consumed
        if (aMine) g4_store(&As[ar * G4_LD + ah], pa, lut);
#pragma unroll
        for (int i = 0; i < 2; i++)
            if (i == 0 || SWIGLU) g4_store(&Ws[((tid + 128 * i) >> 1) * G4_LD + ah], pw[i], lut);
        __syncthreads();
        if (k0 + G4_BK < Kp) { // the next step's bytes fly while this one computes
            if (aMine) g4_load(pa, aPacked, aSF, asrc, Kp, k0 + G4_BK + ah, asrc >= 0);
#pragma unroll
            for (int i = 0; i < 2; i++)
                if (i == 0 || SWIGLU) g4_load(pw[i], wPacked, wSF, wrow[i], Kp, k0 + G4_BK + ah, wok[i]);
        }
        gg_mma_t<G4_BK / 16, G4_LD, MI, NJ, SWIGLU>(As, Ws, acc, accU, wm, wn, g, t4);
    }
    gg_epilogue_t<MI, NJ>(acc, accU, s_src, row0, row1, c0, 1, aScale, 1, wScale[expert], act, out, outN, 0, wm, wn, g, t4);
}

// gemm_staged<BM, SWIGLU>: g4_gemm's kernels (the host's
// grouped_gemm_fp4_m16, _m64 and their _swiglu variants).
template <int BM, bool SWIGLU>
__global__ void __launch_bounds__(128)
    gemm_staged(int *err, const unsigned char *aPacked, const unsigned char *aSF, const float *aScale, int Kp, const int *gather,
                int Ta, const unsigned char *wPacked, const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E,
                int R, int act, bf16_t *out, int outN) {
    g4_gemm<BM, SWIGLU>(err, aPacked, aSF, aScale, Kp, gather, Ta, wPacked, wSF, wScale, N, offsets, E, R, act, out, outN);
}

} // namespace rw
