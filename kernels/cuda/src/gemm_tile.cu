// ---- Grouped GEMM, NVFP4 x NVFP4, for many rows per expert ----
//
// With 64 or more rows per expert the streamed kernel's weight chunks feed
// too few MMAs: each lane dequantizes its own weight share for 16-64 rows,
// and the layer becomes bound by issue slots (4096 tokens: about 130
// TFLOP/s). gt_gemm computes 128 rows by 128 output columns (SwiGLU: 64
// gate and the 64 matching up columns) per block of 16 warps of 32 x 32
// (or 8 of 64 x 32, faster at 128 rows per expert), so every dequantized
// weight feeds 8 m16 MMAs and every dequantized activation 16 n8 ones.
// Both operands' raw NVFP4 bytes of the next 128-K chunk are loaded into
// registers while the current chunk computes; then each 16-byte share (an
// activation row pair, or a weight row of two n8 tiles) is dequantized
// into shared memory in fragment order (so a lane reads its A fragment, or
// the B fragments of two n8 tiles, with one LDS.128), double buffered: one
// barrier per chunk. docs/MOE.md has the measurements.
//
// The fragments hold exactly the values and K order of g5_gemm (the same
// g5_slice4 per slice, the same slices in order, the same K split for long
// rows, the same epilogue), so every output has the streamed kernel's bits:
// the host may pick either kernel by batch size without breaking batch
// invariance (TestGroupedGemmInvariance). m16 tiles with no rows skip their
// MMAs, which keeps an expert's partial last tile cheap.
constexpr int GT_ITEMS = 8 * 8 * 32; // 16-byte items per operand and chunk: 8 tiles (m16, or n8 pairs) x 8 slices x 32 lanes
//
// Compile unit: the tiled NVFP4 grouped GEMM (gemm_tile, gemm_tile_ks2).
#include "numerics.cuh"
#include "ptx.cuh"
#include "errors.cuh"
#include "invariance.cuh"

namespace rw {

// GTShare is one thread's raw share of a chunk: 16 code bytes (quarter t4
// of the chunk) of two rows, and their block scales (2t4, 2t4 + 1).
struct GTShare {
    uint4 q[2];
    unsigned sf[2];
};

// gt_load reads chunk c's share of rows p[0], p[1] (nullptr: no row; row
// starts of packed codes and block scales). Rows of whole 16-byte units
// (V16) take one load a row for full chunks; otherwise, and in the last
// chunk, each 8-byte half is read if its block lies inside K.
template <bool V16>
__device__ __forceinline__ void gt_load(GTShare &sh, const unsigned char *const p[2], const unsigned char *const sp[2], int c, int nfull,
                                        int K, int t4) {
    const int nb = K / 16, b0 = c * (G5_KC / 16) + 2 * t4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        sh.q[r] = make_uint4(0, 0, 0, 0);
        sh.sf[r] = 0;
        if (p[r] == nullptr) continue;
        const unsigned char *src = p[r] + c * (G5_KC / 2) + 16 * t4, *ssrc = sp[r] + b0;
        if (V16 && c < nfull) {
            sh.q[r] = __ldg(reinterpret_cast<const uint4 *>(src));
            sh.sf[r] = __ldg(reinterpret_cast<const unsigned short *>(ssrc));
            continue;
        }
        quarter_halves(sh.q[r], sh.sf[r], src, ssrc, c, nfull, nb, b0);
    }
}

// gt_store dequantizes a share into its 8 items, one per slice: for A
// (rows g and g + 8 of an m16 tile) lo0, lo1, hi0, hi1; for B (row g of
// two n8 tiles) lo0, hi0, lo1, hi1 (b0 and b1 of each tile).
template <bool B>
__device__ __forceinline__ void gt_store(uint4 *dst, const GTShare &sh, const unsigned *lut) {
    const unsigned sc00 = lut[sh.sf[0] & 0xff], sc01 = lut[(sh.sf[0] >> 8) & 0xff];
    const unsigned sc10 = lut[sh.sf[1] & 0xff], sc11 = lut[(sh.sf[1] >> 8) & 0xff];
#pragma unroll
    for (int s = 0; s < 8; s++) {
        const int w = s >> 1;
        const unsigned q0 = w == 0 ? sh.q[0].x : w == 1 ? sh.q[0].y : w == 2 ? sh.q[0].z : sh.q[0].w;
        const unsigned q1 = w == 0 ? sh.q[1].x : w == 1 ? sh.q[1].y : w == 2 ? sh.q[1].z : sh.q[1].w;
        unsigned lo0, hi0, lo1, hi1;
        g5_slice4(q0, s < 4 ? sc00 : sc01, s, lo0, hi0);
        g5_slice4(q1, s < 4 ? sc10 : sc11, s, lo1, hi1);
        dst[s * 32] = B ? make_uint4(lo0, hi0, lo1, hi1) : make_uint4(lo0, lo1, hi0, hi1);
    }
}

template <int NW, bool SWIGLU, bool V16, int KS>
__device__ __forceinline__ void gt_gemm(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K,
                                        const int *gather, int Ta, const void *W, const unsigned char *wSF, const float *wScale,
                                        int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN, float *sacc,
                                        const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    // NW warps: 8 (2 x 4, each 64 rows by 32 columns, two staging shares
    // a thread) or 16 (4 x 4, each 32 x 32, one share a thread).
    constexpr int BM = 128, NT = 32 * NW, WMI = 32 / NW, NS = 16 / NW;
    extern __shared__ __align__(16) uint4 gt_smem[]; // 2 buffers of A items then B items
    __shared__ int s_expert, s_row0, s_row1;
    __shared__ int s_src[BM];
    __shared__ unsigned lut[256];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;

    for (int b = tid; b < 256; b += NT) {
        const unsigned h = f2bf(__fmul_rn(e4m3_decode(b), __uint_as_float(0x7A800000u))); // * 2^118
        lut[b] = h | (h << 16);
    }
    if (warp == 0) gg_schedule(err, offsets, E, R, lane, BM, &s_expert, &s_row0, &s_row1);
    __syncthreads();
    const int expert = s_expert, row0 = s_row0, row1 = s_row1, nrows = row1 - row0;
    if (expert < 0) return; // both blocks of a pair: they share the tile
    gg_sources(err, s_src, gather, row0, row1, Ta, BM);
    __syncthreads();

    // Staging: share u = warp + NW * k (k < NS) of a chunk is, for u < 8,
    // A rows 16u + g (+ 8) (m16 tile u); for u >= 8, row g of n8 tiles 2v
    // and 2v + 1 (v = u - 8), whose W rows are (relu2) columns c0 + 8j + g,
    // or (SwiGLU) warp n of the MMAs takes tiles 4n .. 4n+3: gate columns
    // c0 + 16n + g (+ 8), then their up rows. Columns past outN read the
    // last row and are never written. Share u's items start at u * 256.
    const int c0 = blockIdx.y * (SWIGLU ? 64 : 128);
    bool mine[NS]; // a B share, or an A share of an m16 tile with rows
    const unsigned char *sp[NS][2], *ssp[NS][2];
#pragma unroll
    for (int k = 0; k < NS; k++) {
        const int u = warp + NW * k;
        mine[k] = u >= 8 || 16 * u < nrows;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (u < 8) {
                const int a = s_src[16 * u + g + 8 * r];
                sp[k][r] = a < 0 ? nullptr : static_cast<const unsigned char *>(A) + (long long)a * (K / 2);
                ssp[k][r] = a < 0 ? nullptr : aSF + (long long)a * (K / 16);
            } else {
                const int j = 2 * (u - 8) + r;
                int col;
                bool up = false;
                if (SWIGLU) {
                    col = c0 + 16 * (j >> 2) + 8 * (j & 1) + g;
                    up = (j & 2) != 0;
                } else {
                    col = c0 + 8 * j + g;
                }
                col = min(col, outN - 1);
                const long long row = (long long)expert * N + (up ? outN + col : col);
                sp[k][r] = static_cast<const unsigned char *>(W) + row * (K / 2);
                ssp[k][r] = wSF + row * (K / 16);
            }
        }
    }

    const int nch = (K + G5_KC - 1) / G5_KC, nfull = K / G5_KC, half = KS == 2 ? (nch + 1) / 2 : nch;
    const int rank = KS == 2 ? (int)blockIdx.z : 0;
    const int cbeg = rank * half, cend = min(nch, cbeg + half);
    GTShare sh[NS];
    auto load = [&](int c) {
#pragma unroll
        for (int k = 0; k < NS; k++)
            if (mine[k]) gt_load<V16>(sh[k], sp[k], ssp[k], c, nfull, K, t4);
    };
    auto stage = [&](int buf) {
#pragma unroll
        for (int k = 0; k < NS; k++) {
            const int u = warp + NW * k;
            uint4 *base = gt_smem + buf * 2 * GT_ITEMS + u * 256 + lane;
            if (u >= 8) gt_store<true>(base, sh[k], lut);
            else if (mine[k]) gt_store<false>(base, sh[k], lut);
        }
    };
    if (cbeg < cend) {
        load(cbeg);
        stage(0);
    }
    __syncthreads();

    // MMAs: warp (wm, wn) = (warp / 4, warp % 4) takes the WMI m16 tiles
    // from WMI * wm and n8 tiles 4wn .. 4wn + 3 (B item pairs 2wn, 2wn + 1).
    const int wm = warp >> 2, wn = warp & 3;
    float acc[WMI][4][4];
#pragma unroll
    for (int i = 0; i < WMI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.f;
    const int mt = min(WMI, max(0, (nrows - 16 * WMI * wm + 15) / 16)); // this warp's m16 tiles with rows
    for (int c = cbeg; c < cend; c++) {
        const int buf = (c - cbeg) & 1;
        if (c + 1 < cend) load(c + 1); // in flight while this chunk computes
        const uint4 *As = gt_smem + buf * 2 * GT_ITEMS + (WMI * wm) * 256 + lane;
        const uint4 *Bs = gt_smem + buf * 2 * GT_ITEMS + GT_ITEMS + (2 * wn) * 256 + lane;
        if (mt > 0) {
#pragma unroll
            for (int s = 0; s < 8; s++) {
                const uint4 b0 = Bs[s * 32], b1 = Bs[256 + s * 32];
#pragma unroll
                for (int i = 0; i < WMI; i++) {
                    if (i < mt) {
                        const uint4 a = As[i * 256 + s * 32];
                        const unsigned af[4] = {a.x, a.y, a.z, a.w};
                        mma16816(acc[i][0], af, b0.x, b0.y);
                        mma16816(acc[i][1], af, b0.z, b0.w);
                        mma16816(acc[i][2], af, b1.x, b1.y);
                        mma16816(acc[i][3], af, b1.z, b1.w);
                    }
                }
            }
        }
        if (c + 1 < cend) stage(buf ^ 1);
        __syncthreads();
    }

    if constexpr (KS == 2) {
        if (!ks2_add<WMI * 4, NT>(&acc[0][0], gt_smem, rank, tid)) return;
    }
    const int cw = SWIGLU ? c0 + 16 * wn : c0 + 32 * wn;
    g5_epilogue<WMI, 4, SWIGLU, true>(err, acc, 16 * WMI * wm, cw, s_src, row0, row1, wScale[expert], aScale, act, out, outN, sacc, stok, swt,
                                    sslots, sT, sk, g, t4);
}

// TileShape is the tiled kernel's variant: NW warps (16 of 32 x 32, or 8
// of 64 x 32), SwiGLU pairing.
template <int NW_, bool SWIGLU_>
struct TileShape {
    static constexpr int NW = NW_, THREADS = 32 * NW_;
    static constexpr bool SWIGLU = SWIGLU_;
};

// V16 for gt_gemm: whole 16-byte units per row (K % 32 == 0) from 16-byte
// aligned A and W, block scales 2-byte aligned.
template <class T, int KS>
__device__ __forceinline__ void tile_body(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,
    const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,
    float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    const bool v16 = K % 32 == 0 && ((reinterpret_cast<unsigned long long>(W) | reinterpret_cast<unsigned long long>(A)) & 15) == 0 &&
                     ((reinterpret_cast<unsigned long long>(wSF) | reinterpret_cast<unsigned long long>(aSF)) & 1) == 0;
    if (v16)
        gt_gemm<T::NW, T::SWIGLU, true, KS>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
    else
        gt_gemm<T::NW, T::SWIGLU, false, KS>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
}

// gemm_tile<T> and gemm_tile_ks2<T> (K split over a cluster of two).
template <class T>
__global__ void __launch_bounds__(T::THREADS, 1) gemm_tile(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,
    const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,
    float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    tile_body<T, 1>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
}
template <class T>
__global__ void __launch_bounds__(T::THREADS, 1) __cluster_dims__(1, 1, 2) gemm_tile_ks2(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,
    const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,
    float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    tile_body<T, 2>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
}

} // namespace rw
