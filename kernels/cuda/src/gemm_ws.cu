// ---- Grouped GEMM, NVFP4 x NVFP4, many rows per expert: warp-specialised wgmma ----
//
// gt_gemm (gemm_tile.cu) is latency-bound at one block of 8 warps an SM:
// every warp dequantizes its share of a chunk, waits at the block barrier,
// then reads its fragments and issues its MMAs, so the tensor cores idle
// while the dequantization runs and the other way round (ncu on the H200:
// no eligible warp 68.6% of the cycles, tensor pipe 32% active). gw_gemm
// computes a 64 MT x 128 tile (MT = 2: the same 128 x 128 tile) with the
// work split by role:
//  - warps 0-7 (producers) copy each 128-K chunk's raw NVFP4 codes and
//    block scales gw_raw(MT) chunks ahead into their own slots of shared
//    memory with cp.async, and dequantize them into a ring of GW_STAGES
//    stages (warp w: rows 8w .. 8w + 7 of every 64-row band of the
//    activations and of the weights, a quarter of K of one row of each
//    band a thread, so a tile with few activation rows keeps the warps
//    even).
//    Loads into registers two chunks ahead were waited for at their first
//    use all the same (ncu: the producers' largest stall, long scoreboard
//    on the scale bytes), so only shapes cp.async cannot copy whole (K not
//    a multiple of 128, unaligned operands) still load into registers;
//  - the MT consumer warpgroups after them (64 rows each) multiply each
//    stage with Hopper's asynchronous warpgroup MMA (wgmma m64n128k16) from
//    shared memory, one chunk's MMAs in flight while the next stage is
//    awaited.
// A stage passes between them through two mbarriers: full (256 producer
// arrivals, each after its stores and a proxy fence, since wgmma reads
// through the async proxy) and empty (one arrival a consumer warp, once
// the MMAs that read the stage have completed). No block barrier in the
// loop, so no warp waits on the slowest one; each side waits only when the
// ring is empty or full.
//
// Shared memory holds both operands K-major with the 128-byte swizzle:
// each half of a chunk's K (64 values) is a run of 128-byte rows, and the
// 16-byte unit j of row r sits at unit j ^ (r % 8). A k16 step's 16 K
// slots hold the values g5_slice4 gives the mma.sync fragments of the same
// slice (slot 2q + h: quarter q's lo pair, 8 + 2q + h: its hi pair), and
// wgmma adds a k16 step's products as mma.sync m16n8k16 does
// (TestGroupedGemmInvariance checks it bit for bit), so
// with the same slices in order, the same K split (ks2_add) and the same
// epilogue every output has gt_gemm's and g5_gemm's bits.
// MT is the tile's rows in 64-row bands, one consumer warpgroup each: 2
// (128 rows) or 3 (192 rows: at 4096 tokens an expert's 128 +- 11 rows
// then take one tile, not a full one and one of about 10 rows that
// dequantizes every weight row all the same).
//
// Compile unit: the warp-specialised NVFP4 grouped GEMM (gemm_ws,
// gemm_ws_ks2); sm_90a only.
#include "numerics.cuh"
#include "ptx.cuh"
#include "errors.cuh"
#include "invariance.cuh"
#include "wgmma.cuh"

namespace rw {

constexpr int GW_STAGES = 2; // dequantized stages
constexpr int GW_HALFB = 16384; // bytes of half a chunk's K of the 128 weight rows, BF16
__host__ __device__ constexpr int gw_raw(int MT) { return MT == 2 ? 4 : 2; } // raw chunks in flight a producer thread (what shared memory leaves room for)
// The dynamic shared memory: the stages (64 MT + 128 rows of 256 bytes),
// the raw slots (256 producer threads x MT + 2 rows x 20 bytes a chunk)
// and 1024 bytes to align the stages (the host's wsSmem, wsSmem192).

// GWShare is one thread's raw share of a chunk: quarter t4 (16 code bytes,
// block scales 2t4 and 2t4 + 1) of NR rows.
template <int NR>
struct GWShare {
    uint4 q[NR];
    unsigned sf[NR]; // row i's scale pair (block 2t4 in bits 0-7)
};

// gw_load reads chunk c of the share's rows into registers (the path for
// shapes cp.async cannot copy whole): codes at p + off[i], scales at sp +
// off[i] / 8 (off < 0: no row, zeros), each 8-byte half if its block lies
// inside K. Each row's scale pair has a register of its own, so that
// nothing reads a load before gw_store.
template <int NR>
__device__ __forceinline__ void gw_load(GWShare<NR> &sh, const unsigned char *p, const unsigned char *sp, const int (&off)[NR], int c,
                                        int nfull, int K, int t4) {
    const int nb = K / 16, b0 = c * (G5_KC / 16) + 2 * t4;
#pragma unroll
    for (int i = 0; i < NR; i++) {
        sh.q[i] = make_uint4(0, 0, 0, 0);
        sh.sf[i] = 0;
        if (off[i] < 0) continue;
        quarter_halves(sh.q[i], sh.sf[i], p + off[i] + c * (G5_KC / 2) + 16 * t4, sp + off[i] / 8 + b0, c, nfull, nb, b0);
    }
}

__device__ __forceinline__ unsigned gw_word(const uint4 &v, int w) { return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w; }

// gw_store dequantizes a share into an operand's stage op (1024-byte
// aligned; its K halves half bytes apart), rows rbase + 64i + g: slice s's
// lo pair of quarter t4 is word t4 of the row's K unit 2s, its hi pair
// word t4 of unit 2s + 1, the units swizzled (rbase is a multiple of 8, so
// the row's x is g). A warp's 4-byte stores of one slice fill 8 rows'
// units, all banks once.
template <int NR>
__device__ __forceinline__ void gw_store(unsigned char *op, int half, int rbase, const GWShare<NR> &sh, const int (&off)[NR],
                                         const unsigned *lut, int g, int t4) {
#pragma unroll
    for (int i = 0; i < NR; i++) {
        if (off[i] < 0) continue;
        unsigned char *row = op + (rbase + 64 * i + g) * 128 + 4 * t4;
        const unsigned pair = sh.sf[i];
        const unsigned sc0 = lut[pair & 0xff], sc1 = lut[(pair >> 8) & 0xff];
#pragma unroll
        for (int s = 0; s < 8; s++) {
            unsigned lo, hi;
            g5_slice4(gw_word(sh.q[i], s >> 1), s < 4 ? sc0 : sc1, s, lo, hi);
            const int j = 2 * (s & 3);
            *reinterpret_cast<unsigned *>(row + (s >> 2) * half + ((j ^ g) << 4)) = lo;
            *reinterpret_cast<unsigned *>(row + (s >> 2) * half + (((j + 1) ^ g) << 4)) = hi;
        }
    }
}

template <bool SWIGLU, bool CA, int KS, int MT>
__device__ __forceinline__ void gw_gemm(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K,
                                        const int *gather, int Ta, const void *W, const unsigned char *wSF, const float *wScale,
                                        int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN, float *sacc,
                                        const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    // Threads: the first NP produce, the NC after them consume. A stage is
    // the tile's BM activation rows (OPA bytes, K halves HALFA apart) and
    // then the 128 weight rows.
    constexpr int BM = 64 * MT, NP = 256, NC = 128 * MT, NT = NP + NC, NR = MT + 2;
    constexpr int HALFA = BM * 128, OPA = 2 * HALFA, STAGE = OPA + 2 * GW_HALFB, RAW = gw_raw(MT);
    extern __shared__ __align__(1024) unsigned char gw_dyn[]; // the ring, from the first 1024-byte boundary
    __shared__ int s_expert, s_row0, s_row1;
    __shared__ int s_src[BM];
    __shared__ unsigned lut[256];
    __shared__ __align__(8) unsigned long long s_bar[2 * GW_STAGES]; // full[s], then empty[s]
    // warp from lane 0, so that ptxas knows the role branches are
    // warp-uniform (wgmma in a divergent path is serialized).
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), g = lane >> 2, t4 = lane & 3;
    const unsigned dyn = static_cast<unsigned>(__cvta_generic_to_shared(gw_dyn)), sbase = (dyn + 1023) & ~1023u;
    unsigned char *const ring = gw_dyn + (sbase - dyn);
    const unsigned full = static_cast<unsigned>(__cvta_generic_to_shared(s_bar)), empty = full + 8 * GW_STAGES;

    for (int b = tid; b < 256; b += NT) {
        const unsigned h = f2bf(__fmul_rn(e4m3_decode(b), __uint_as_float(0x7A800000u))); // * 2^118
        lut[b] = h | (h << 16);
    }
    if (warp == 0) gg_schedule(err, offsets, E, R, lane, BM, &s_expert, &s_row0, &s_row1);
    if (tid == 32) {
#pragma unroll
        for (int s = 0; s < GW_STAGES; s++) {
            mb_init(full + 8 * s, NP);
            mb_init(empty + 8 * s, NC / 32);
        }
    }
    __syncthreads();
    const int expert = s_expert, row0 = s_row0, row1 = s_row1, nrows = row1 - row0;
    if (expert < 0) return; // both blocks of a pair: they share the tile
    gg_sources(err, s_src, gather, row0, row1, Ta, BM);
    __syncthreads();

    const int c0 = blockIdx.y * (SWIGLU ? 64 : 128);
    const int nch = (K + G5_KC - 1) / G5_KC, nfull = K / G5_KC, half = KS == 2 ? (nch + 1) / 2 : nch;
    const int rank = KS == 2 ? (int)blockIdx.z : 0;
    const int cbeg = rank * half, cend = min(nch, cbeg + half);

    if (warp < NP / 32) {
        // Producer warp w takes A rows n = 64i + 8w + g, i < MT, and B rows
        // n = 64i + 8w + g, i < 2: each 64-row band spread over all eight
        // warps, so a tile with few activation rows still keeps them even.
        // A rows past the tile's, or without a source, are left as they
        // are: their outputs are never written. B row n is (relu2) column
        // c0 + n, or (SwiGLU) gate column c0 + n for n < 64 and the up row
        // of column c0 + n - 64 after them, so the consumers' n8 tile j < 8
        // is a gate and j + 8 its up (g5_epilogue). Columns past outN read
        // the last row and are never written. Offsets are 32-bit: A's
        // within Ta * K / 2, B's within an expert's N * K / 2 (the host
        // checks both).
        const int rbase = 8 * warp;
        const unsigned char *pa = static_cast<const unsigned char *>(A);
        const unsigned char *pb = static_cast<const unsigned char *>(W) + (long long)expert * N * (K / 2);
        const unsigned char *sb = wSF + (long long)expert * N * (K / 16);
        int offa[MT], offb[2];
#pragma unroll
        for (int i = 0; i < MT; i++) {
            const int n = 64 * i + rbase + g;
            const int a = s_src[n];
            offa[i] = n < nrows && a >= 0 ? a * (K / 2) : -1;
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int n = 64 * i + rbase + g;
            const bool up = SWIGLU && n >= 64;
            const int col = min(SWIGLU ? c0 + (n & 63) : c0 + n, outN - 1);
            offb[i] = (up ? outN + col : col) * (K / 2);
        }
        int st = 0;
        unsigned ph = 0;
        // dequant stores a chunk's shares into stage st once the consumers
        // have freed it, and hands the stage over.
        auto dequant = [&](const GWShare<MT> &ra, const GWShare<2> &rb) {
            mb_wait(empty + 8 * st, ph ^ 1);
            gw_store(ring + st * STAGE, HALFA, rbase, ra, offa, lut, g, t4);
            gw_store(ring + st * STAGE + OPA, GW_HALFB, rbase, rb, offb, lut, g, t4);
            gw_proxy();
            mb_arrive(full + 8 * st);
            if (++st == GW_STAGES) {
                st = 0;
                ph ^= 1;
            }
        };
        if constexpr (CA) {
            // Raw slots after the stages: slot r holds, for row i < NR (A
            // rows, then B rows) and producer thread tid, 16 code bytes at
            // rq[(NR r + i) * NP + tid] and the aligned scale word holding
            // its pair at rs[...] (so every warp's copy and read is
            // contiguous). Each thread reads back only what it copied, so
            // cp.async.wait_group is all the synchronisation they need.
            uint4 *const rq = reinterpret_cast<uint4 *>(ring + GW_STAGES * STAGE);
            unsigned *const rs = reinterpret_cast<unsigned *>(rq + RAW * NR * NP);
            const unsigned char *src[NR], *ssrc[NR];
            bool has[NR];
#pragma unroll
            for (int i = 0; i < NR; i++) {
                const int off = i < MT ? offa[i] : offb[i - MT];
                has[i] = off >= 0;
                src[i] = (i < MT ? pa : pb) + max(off, 0) + 16 * t4;
                ssrc[i] = (i < MT ? aSF : sb) + max(off, 0) / 8 + 4 * (t4 >> 1);
            }
            auto issue = [&](int c, int r) { // chunk c into slot r; a group even past the end, so the waits count chunks
                if (c < cend) {
#pragma unroll
                    for (int i = 0; i < NR; i++) {
                        if (!has[i]) continue;
                        cp_async(&rq[(NR * r + i) * NP + tid], src[i] + c * (G5_KC / 2), 16, true);
                        cp_async4(&rs[(NR * r + i) * NP + tid], ssrc[i] + c * (G5_KC / 16), 4);
                    }
                }
                cp_async_commit();
            };
#pragma unroll
            for (int r = 0; r < RAW; r++) issue(cbeg + r, r);
            int r = 0;
            for (int c = cbeg; c < cend; c++) {
                cp_async_wait<RAW - 1>(); // this thread's copies of chunk c have landed
                GWShare<MT> ra;
                GWShare<2> rb;
                const int sh = 16 * (t4 & 1); // this lane's pair in the scale word
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    ra.q[i] = rq[(NR * r + i) * NP + tid];
                    ra.sf[i] = (rs[(NR * r + i) * NP + tid] >> sh) & 0xffffu;
                }
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    rb.q[i] = rq[(NR * r + MT + i) * NP + tid];
                    rb.sf[i] = (rs[(NR * r + MT + i) * NP + tid] >> sh) & 0xffffu;
                }
                dequant(ra, rb);
                issue(c + RAW, r); // after dequant has read slot r
                if (++r == RAW) r = 0;
            }
        } else {
            // Chunks c and c + 1 in two register sets, loaded two chunks ahead.
            GWShare<MT> ra0, ra1;
            GWShare<2> rb0, rb1;
            auto load = [&](GWShare<MT> &ra, GWShare<2> &rb, int c) {
                gw_load(ra, pa, aSF, offa, c, nfull, K, t4);
                gw_load(rb, pb, sb, offb, c, nfull, K, t4);
            };
            if (cbeg < cend) load(ra0, rb0, cbeg);
            if (cbeg + 1 < cend) load(ra1, rb1, cbeg + 1);
            for (int c = cbeg; c < cend; c += 2) {
                dequant(ra0, rb0);
                if (c + 2 < cend) load(ra0, rb0, c + 2);
                if (c + 1 < cend) {
                    dequant(ra1, rb1);
                    if (c + 3 < cend) load(ra1, rb1, c + 3);
                }
            }
        }
        return; // the cluster barriers of ks2_add count only threads that have not exited
    }

    // Consumer warpgroup wm takes rows 64wm .. 64wm + 63 and all 128 B rows.
    const int cwarp = warp - NP / 32, wm = cwarp >> 2;
    float acc[1][16][4];
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[0][j][q] = 0.f;
    const bool mine = __shfl_sync(0xffffffffu, 64 * wm < nrows, 0); // this warpgroup has rows (warp-uniform, as above)
    const unsigned long long da0 = gw_desc(sbase + wm * 64 * 128), db0 = gw_desc(sbase + OPA);
    int st = 0, prev = -1;
    unsigned ph = 0;
    for (int c = cbeg; c < cend; c++) {
        mb_wait(full + 8 * st, ph);
        gw_fence();
        if (mine) {
#pragma unroll
            for (int s = 0; s < 8; s++) { // step s: K half s / 4, bytes 32 (s % 4) of its rows
                const unsigned long long oa = (unsigned long long)(st * STAGE + (s >> 2) * HALFA + (s & 3) * 32) >> 4;
                const unsigned long long ob = (unsigned long long)(st * STAGE + (s >> 2) * GW_HALFB + (s & 3) * 32) >> 4;
                gw_mma(acc[0], da0 + oa, db0 + ob);
            }
        }
        gw_commit();
        gw_wait<1>(acc[0]); // the previous chunk's MMAs are done: its stage is free
        if (prev >= 0 && lane == 0) mb_arrive(empty + 8 * prev);
        prev = st;
        if (++st == GW_STAGES) {
            st = 0;
            ph ^= 1;
        }
    }
    gw_wait<0>(acc[0]);

    if constexpr (KS == 2) {
        // ks2_add reuses the ring: every consumer warpgroup's MMAs must be done.
        asm volatile("bar.sync 1, %0;\n" ::"n"(NC) : "memory");
        if (!ks2_add<16, NC>(&acc[0][0], reinterpret_cast<uint4 *>(ring), rank, tid - NP)) return;
    }
    g5_epilogue<1, 16, SWIGLU, true>(err, acc, 64 * wm + 16 * (cwarp & 3), c0, s_src, row0, row1, wScale[expert], aScale, act, out, outN,
                                     sacc, stok, swt, sslots, sT, sk, g, t4);
}

// WsTile is the warp-specialised kernel's variant: MT 64-row bands (2:
// 128 rows, 3: 192), SwiGLU pairing; 256 producer threads and MT consumer
// warpgroups.
template <int MT_, bool SWIGLU_>
struct WsTile {
    static constexpr int MT = MT_, THREADS = 256 + 128 * MT_;
    static constexpr bool SWIGLU = SWIGLU_;
};

// CA for gw_gemm: whole chunks (K % 128 == 0) from 16-byte aligned A and
// W, block scales 4-byte aligned (rows of K / 16 scale bytes then are too).
template <class T, int KS>
__device__ __forceinline__ void ws_body(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,
    const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,
    float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    const bool ca = K % 128 == 0 && ((reinterpret_cast<unsigned long long>(W) | reinterpret_cast<unsigned long long>(A)) & 15) == 0 &&
                    ((reinterpret_cast<unsigned long long>(wSF) | reinterpret_cast<unsigned long long>(aSF)) & 3) == 0;
    if (ca)
        gw_gemm<T::SWIGLU, true, KS, T::MT>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
    else
        gw_gemm<T::SWIGLU, false, KS, T::MT>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
}

// gemm_ws<T> and gemm_ws_ks2<T> (K split over a cluster of two).
template <class T>
__global__ void __launch_bounds__(T::THREADS, 1) gemm_ws(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,
    const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,
    float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    ws_body<T, 1>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
}
template <class T>
__global__ void __launch_bounds__(T::THREADS, 1) __cluster_dims__(1, 1, 2) gemm_ws_ks2(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,
    const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,
    float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    ws_body<T, 2>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
}

} // namespace rw
