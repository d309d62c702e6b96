// ---- Grouped GEMM, weights streamed into MMA fragments ----
//
// The expert GEMMs of both recipes: NVFP4 x NVFP4 (per_token) up to 24
// rows per expert (the tiled kernels of gemm_tile.cu and gemm_ws.cu take
// more) and BF16 x BF16 (bf16) at every batch size. A block of 8 warps
// computes BM = 16*MI sorted rows of one expert by 128 output columns (64
// for SwiGLU, whose warps also take the matching "up" rows). The activations
// are the MMA's A operand: each 128-wide K chunk of the block's rows is
// staged once in shared memory (dequantized to BF16 for NVFP4), laid out
// so that one LDS.128 gives a lane its whole A fragment, double buffered,
// every thread taking an equal share. The weights never touch shared
// memory: lane (g, t4) of a warp loads the contiguous quarter t4 of the
// chunk of weight row g of each of its two n8 tiles (16 code bytes and two
// block scales for NVFP4, 64 bytes for BF16), D chunks ahead, straight
// into B fragments (dequantized in registers for NVFP4). A quad reads the
// row's chunk once, contiguously.
//
// K order: inside a chunk, k16 slice s takes from lane t4 four of its 32
// elements (NVFP4: 8w + {2h, 2h + 4, 2h + 1, 2h + 5}, w = s/2, h = s%2;
// BF16: 4s .. 4s + 3), the same for both operands. The slices run in
// order and each output element is one MMA lane's sum over them, so its
// bits depend on K alone, never on MI, the tile or the batch (batch
// invariance by construction).
//
// Compile unit: the streamed grouped GEMM (gemm_stream, gemm_stream_ks2).
#include "numerics.cuh"
#include "ptx.cuh"
#include "errors.cuh"
#include "invariance.cuh"

namespace rw {

// Weight chunks in flight per warp: g5_depth. The codes go to a per-warp ring
// in shared memory by cp.async (16 B per lane and tile for NVFP4, 64 B for
// BF16), and so do the NVFP4 block scales (a word per lane pair and tile).
// NVFP4 16-row tiles keep 5 chunks, so that four blocks fit in an SM's
// shared memory (kernels/cuda/registry.go streamSmem) and registers (g5_minb):
// at 8-128 tokens 1-2% faster than three blocks of 7 chunks. The 32-row
// kernels with four n8 tiles a warp (_j4) keep 4, the bytes in flight of
// two tiles and 8 chunks, so that two blocks fit an SM.
// The 8-row kernels (M8, below) keep 4, so that three blocks fit an SM with
// the whole K range of activations staged (2 KB a chunk, up to 18 chunks:
// streamM8Chunks in kernels/cuda/registry.go).
__host__ __device__ constexpr int g5_depth(bool FP4, int MI, int J, bool M8 = false) {
    return M8 ? 4 : FP4 ? (MI == 1 ? 5 : J == 4 ? 4 : 8) : 4;
}
// g5_minb: blocks an SM the registers must allow.
__host__ __device__ constexpr int g5_minb(bool FP4, int MI, int J, bool M8 = false) {
    return M8 ? 3 : FP4 && MI == 1 ? 4 : FP4 && J == 4 ? 2 : 1;
}
// g5_m8units: the activation region of an 8-row kernel, in 16-byte units:
// nchb chunks of 128 units (8 rows x 128 K of BF16), at least the 8 KB the
// K split's sums take (ks2_add).
__host__ __device__ constexpr int g5_m8units(int nchb) { return nchb * 128 > 2 * 256 ? nchb * 128 : 2 * 256; }
constexpr int G5_NW = 8; // warps per block
__host__ __device__ constexpr int g5_wb(bool FP4) { return FP4 ? 16 : 64; } // bytes per lane, tile and chunk
constexpr int G5_ROWCH = 32; // chunks of a one-row tile's K range staged at once: 256 B each in the 2 x 4 KB of a 16-row tile's buffers

// g5_wissue starts the copy of chunk c of a lane's weight share into its
// slot (dst: the lane's first 16 bytes; BF16 shares are 4 units 512 bytes
// apart, so each LDS.128 of a warp is contiguous). p points at the lane's
// quarter of chunk c, sp (NVFP4) at its lane pair's block scales of chunk
// c; the zero-filled copies read from the row's chunk 0 instead (a valid
// address), derived from them only on that path, so that no row start
// stays in a register. Only the last chunk can be partial: K is a
// multiple of 16 (NVFP4) or 8 (BF16, checked by the host); what lies past
// K is zero-filled. V16: rows of whole 16-byte units from 16-byte aligned
// addresses and (NVFP4) K a multiple of 64 with 4-byte aligned block
// scales; then the lanes of even t4 also copy the 4 block-scale bytes of
// their lane pair (blocks 2t4 .. 2t4+3 of chunk c, from sp) to sdst.
// Without V16 the scales are read where they are used (g5_wscale).
template <bool V16>
__device__ __forceinline__ void g5_wissue(uint4 *dst, unsigned *sdst, const unsigned char *p, const unsigned char *sp, int c,
                                          int nfull, int K, int t4) {
    if (V16 && c < nfull) {
        cp_async(dst, p, 16, true);
        cp_async4_if(sdst, sp, !(t4 & 1));
        return;
    }
    const unsigned char *row = p - 16 * t4 - c * (G5_KC / 2), *srow = sp - c * (G5_KC / 16);
    const int nb = K / 16, b0 = c * (G5_KC / 16) + 2 * t4;
    const bool in0 = c < nfull || b0 < nb, in1 = c < nfull || b0 + 1 < nb;
    cp_async(dst, in0 ? p : row, 8, in0);
    cp_async(reinterpret_cast<unsigned char *>(dst) + 8, in1 ? p + 8 : row, 8, in1);
    if (V16 && !(t4 & 1)) {
        const int n = min(4, max(0, nb - b0)); // the chunk's scale bytes left from block b0
        cp_async4(sdst, n > 0 ? sp : srow, n);
    }
}

// g5_wscale returns a lane's block-scale pair of chunk c (block 2t4 in
// byte 0, 2t4+1 in byte 1): V16 from the pair's word its even lane copied
// (ss), otherwise from global memory (srow: the lane's scales of chunk 0).
template <bool V16>
__device__ __forceinline__ unsigned g5_wscale(const unsigned *ss, const unsigned char *srow, int c, int K, int lane) {
    if (V16) return (*ss >> (16 * (lane & 1))) & 0xffffu;
    const int nb = K / 16, b0 = c * (G5_KC / 16) + 2 * (lane & 3);
    const unsigned char *sp = srow + c * (G5_KC / 16);
    return (b0 < nb ? (unsigned)__ldg(sp) : 0u) | (b0 + 1 < nb ? (unsigned)__ldg(sp + 1) << 8 : 0u);
}

template <bool V16>
__device__ __forceinline__ void g5_wissue(uint4 *dst, unsigned *, const bf16_t *p, const unsigned char *, int c, int nfull, int K,
                                          int t4) {
    if (c < nfull) {
#pragma unroll
        for (int v = 0; v < 4; v++) cp_async(dst + 32 * v, p + 8 * v, 16, true);
        return;
    }
    const bf16_t *row = p - 32 * t4 - c * G5_KC;
#pragma unroll
    for (int v = 0; v < 4; v++) {
        const bool in = c * G5_KC + 32 * t4 + 8 * v < K;
        cp_async(dst + 32 * v, in ? p + 8 * v : row, 16, in);
    }
}

// The activation chunk in shared memory: item (i, s, lane) is 4 words, the
// A fragment of m16 tile i, slice s for that lane: rows 16i+g and 16i+g+8,
// low then high pair. A thread stages items tid, tid+256, ...: for each it
// loads, of both rows, one code word and one block scale (NVFP4) or two
// words (BF16). Offsets are 32-bit (the host checks that the operand
// fits); -1 marks a missing row.
// H = 1 stages only rows 0-7 of each m16 tile (a tile of at most 8 rows:
// rows 8-15 are zeros, as missing rows always are, without their loads and
// conversions), one item a thread with warp w staging row w (g5_item), so
// that the warps of missing rows skip the staging: their items are zeroed
// once (g5_tail).
template <int MI, int NT, int H = 2>
struct G5AStage {
    static constexpr int M = (MI * 256 + NT - 1) / NT; // items per thread
    static_assert(H == 2 || (MI == 1 && NT == 256), "H = 1: one 16-row tile, one item a thread");
    uint2 q[M][H];
    unsigned sc[M][H];
    int off[M][H];  // element offset of the row's slice s in chunk 0
    int soff[M][H]; // NVFP4: offset of its block scale in chunk 0
};

// g5_item is thread tid's m-th item: tid + NT*m, or for H = 1 the item of
// row g = warp, slice s = lane / 4, t4 = lane % 4 (item s*32 + 4g + t4).
template <int NT, int H>
__device__ __forceinline__ int g5_item(int tid, int m) {
    if constexpr (H == 1) return ((tid & 31) >> 2) * 32 + (tid >> 5) * 4 + (tid & 3);
    return tid + NT * m;
}

template <int MI, int NT, bool FP4, int H>
__device__ __forceinline__ void g5_asetup(G5AStage<MI, NT, H> &st, const int *src, int K, int tid) {
#pragma unroll
    for (int m = 0; m < st.M; m++) {
        const int item = g5_item<NT, H>(tid, m), i = item >> 8, s = (item >> 5) & 7, L = item & 31;
#pragma unroll
        for (int h = 0; h < H; h++) {
            const int a = item < MI * 256 ? src[16 * i + (L >> 2) + 8 * h] : -1;
            st.off[m][h] = a < 0 ? -1 : a * K + 32 * (L & 3) + (FP4 ? 8 * (s >> 1) : 4 * s);
            st.soff[m][h] = a * (K / 16) + 2 * (L & 3) + (s >> 2);
        }
    }
}

template <int MI, int NT, bool FP4, int H>
__device__ __forceinline__ void g5_aload(G5AStage<MI, NT, H> &st, const void *A, const unsigned char *aSF, int K, int c, int tid) {
#pragma unroll
    for (int m = 0; m < st.M; m++) {
        const int item = g5_item<NT, H>(tid, m), s = (item >> 5) & 7, L = item & 31;
        const bool in = c * G5_KC + 32 * (L & 3) + (FP4 ? 16 * (s >> 2) : 4 * s) < K;
#pragma unroll
        for (int h = 0; h < H; h++) {
            st.q[m][h] = make_uint2(0, 0);
            st.sc[m][h] = 0;
            if (st.off[m][h] >= 0 && in) {
                const int e = st.off[m][h] + c * G5_KC;
                if constexpr (FP4) {
                    st.q[m][h].x = __ldg(reinterpret_cast<const unsigned *>(static_cast<const unsigned char *>(A) + e / 2));
                    st.sc[m][h] = __ldg(aSF + st.soff[m][h] + c * (G5_KC / 16));
                } else {
                    st.q[m][h] = __ldg(reinterpret_cast<const uint2 *>(static_cast<const bf16_t *>(A) + e));
                }
            }
        }
    }
}

template <int MI, int NT, bool FP4, int H>
__device__ __forceinline__ void g5_astore(uint4 *buf, const G5AStage<MI, NT, H> &st, const unsigned *lut, int tid) {
#pragma unroll
    for (int m = 0; m < st.M; m++) {
        const int item = g5_item<NT, H>(tid, m), s = (item >> 5) & 7;
        if (item >= MI * 256) break;
        if constexpr (FP4) {
            unsigned lo0, hi0, lo1 = 0, hi1 = 0; // +0, as g5_slice4 gives for a missing row
            g5_slice4(st.q[m][0].x, lut[st.sc[m][0]], s, lo0, hi0);
            if constexpr (H == 2) g5_slice4(st.q[m][1].x, lut[st.sc[m][1]], s, lo1, hi1);
            buf[item] = make_uint4(lo0, lo1, hi0, hi1);
        } else if constexpr (H == 2) {
            buf[item] = make_uint4(st.q[m][0].x, st.q[m][1].x, st.q[m][0].y, st.q[m][1].y);
        } else {
            buf[item] = make_uint4(st.q[m][0].x, 0u, st.q[m][0].y, 0u);
        }
    }
}

// g5_rowstage fills aq with the A fragments of a tile of ROWS rows (1 or
// 8; src: their A rows, -1 for a missing one) for chunks cbeg .. cend - 1,
// all at once: aq[(cc * 4 + k) * 4 * ROWS + 4 * r + q4] holds, for the
// lanes (g = r, t4 = q4), row r's words of slices 2k and 2k + 1 of chunk
// cc as {lo(2k), lo(2k + 1), hi(2k), hi(2k + 1)}: the words g5_astore
// gives row r (zeros past K or for a missing row). So a warp's LDS.128 of
// slice pair k reads 64 contiguous bytes (ROWS 1: every group the same) or 512
// (ROWS 8). Both slices come from the same code word and block scale, so a
// thread converts them together. g5_tail's ROW paths pass each 16-byte
// word to slice 2k's MMA as it is and to slice 2k + 1's with its odd words
// in the even places (below).
template <int ROWS>
__device__ __forceinline__ void g5_rowstage(uint4 *aq, const void *A, const unsigned char *aSF, int K, const int *src, int cbeg,
                                            int cend, const unsigned *lut, int tid, int nt) {
    static_assert(ROWS == 1 || ROWS == 8, "a row or a tile of 8");
    // ROWS 8 issues the loads of U items before it converts any, so that a
    // thread waits on one round of loads per U items, not one per item.
    constexpr int U = ROWS == 8 ? 4 : 1;
    const int n = (cend - cbeg) * 16 * ROWS;
#pragma unroll 2
    for (int it0 = tid; it0 < n; it0 += U * nt) {
        unsigned q[U], sb[U];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int it = it0 + u * nt, c = cbeg + it / (16 * ROWS), k = (it / (4 * ROWS)) & 3, q4 = it & 3;
            const int a = it < n ? src[(it >> 2) & (ROWS - 1)] : -1;
            ok[u] = a >= 0 && c * G5_KC + 32 * q4 + 16 * (k >> 1) < K;
            q[u] = sb[u] = 0;
            if (ok[u]) {
                const int e = a * K + c * G5_KC + 32 * q4 + 8 * k;
                q[u] = __ldg(reinterpret_cast<const unsigned *>(static_cast<const unsigned char *>(A) + e / 2));
                sb[u] = __ldg(aSF + a * (K / 16) + c * (G5_KC / 16) + 2 * q4 + (k >> 1));
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int it = it0 + u * nt, k = (it / (4 * ROWS)) & 3;
            if (it >= n) break;
            unsigned lo0 = 0, hi0 = 0, lo1 = 0, hi1 = 0;
            if (ok[u]) {
                const unsigned sc = lut[sb[u]];
                g5_slice4(q[u], sc, 2 * k, lo0, hi0);
                g5_slice4(q[u], sc, 2 * k + 1, lo1, hi1);
            }
            aq[it] = make_uint4(lo0, lo1, hi0, hi1);
        }
    }
}

// g5_tail runs a block's tile once its rows are known (g5_gemm): MA of
// the launch's MI m16 row tiles hold rows, and only those are staged and
// multiplied. The shared memory keeps the launch's layout (MI). A row's
// MMAs, K order and bits are the same whatever MA is.
// ROW 1 (a tile of one row) and 8 (a tile of at most 8 rows, the M8
// kernels') stage the block's whole K range of activations at once
// (g5_rowstage) instead of chunk by chunk; ROW 0 stages by chunk.
template <int MA, int H, int MI, int J, bool SWIGLU, bool FP4, bool V16, int KS, int ROW = 0>
__device__ __forceinline__ void g5_tail(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K,
                                        const void *W, const unsigned char *wSF, const float *wScale, int N, int act, bf16_t *out,
                                        int outN, float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk,
                                        int expert, int row0, int row1, const int *s_src, const unsigned *lut) {
    constexpr int NW = G5_NW, D = g5_depth(FP4, MI, J, ROW == 8), WU = g5_wb(FP4) / 16; // WU: 16-byte units per lane, tile, chunk
    static_assert(J == 2 || J == 4 || (J == 1 && !SWIGLU), "SwiGLU pairs gate tiles with their up tiles");
    static_assert(ROW == 0 || ROW == 1 || ROW == 8, "ROW: by chunk, one row, or up to 8 rows");
    static_assert(ROW != 1 || (MA == 1 && MI == 1 && FP4 && G5_ROWCH * 32 * 8 <= 2 * MI * 256 * 16),
                  "ROW 1: an NVFP4 16-row tile, its K range in the activation buffers");
    static_assert(ROW != 8 || (MA == 1 && MI == 1 && H == 1 && FP4), "ROW 8: an NVFP4 tile of up to 8 rows");
    // A: 2 x MI x 256 items, or (ROW 8) g5_m8units of the block's chunks; W: per warp D x J x WU x 32 units; NVFP4 scales: per warp D x J x 16 words
    extern __shared__ __align__(16) uint4 g5_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;

    // This warp's J n8 tiles of W rows: 8 J columns, or for SwiGLU 8 JC
    // gate columns (tiles j < JC) and their up rows (tiles JC + j).
    // Columns past outN read the last row and are never written.
    constexpr int JC = SWIGLU ? J / 2 : J; // n8 tiles of output columns a warp
    const int cw = blockIdx.y * (8 * JC * NW) + warp * (8 * JC);
    const int nch = (K + G5_KC - 1) / G5_KC, nfull = K / G5_KC, half = KS == 2 ? (nch + 1) / 2 : nch;
    const int rank = KS == 2 ? (int)blockIdx.z : 0;
    const int cbeg = rank * half, cend = min(nch, cbeg + half);
    const int au = ROW == 8 ? g5_m8units(half) : 2 * MI * 256; // 16-byte units of activations
    using WT = typename G5Cond<FP4, unsigned char, bf16_t>::type;
    constexpr int WSTEP = FP4 ? G5_KC / 2 : G5_KC; // W elements per row and chunk
    // wrow is the W row of the lane's tile j; srow its block scales of chunk
    // 0 (NVFP4). Only the pointers that move (wp: the lane's share of the
    // next chunk to issue; sp: its block scales) stay in registers.
    auto wrow = [&](int j) -> long long {
        const int col = min(cw + 8 * (j % JC) + g, outN - 1);
        return (long long)expert * N + (SWIGLU && j >= JC ? outN + col : col);
    };
    auto srow = [&](int j) -> const unsigned char * { return FP4 ? wSF + wrow(j) * (K / 16) + 2 * t4 : nullptr; };
    const WT *wp[J];
    const unsigned char *sp[J] = {};
#pragma unroll
    for (int j = 0; j < J; j++) {
        if constexpr (FP4) {
            wp[j] = static_cast<const unsigned char *>(W) + wrow(j) * (K / 2) + 16 * t4 + cbeg * WSTEP;
            sp[j] = srow(j) + cbeg * (G5_KC / 16);
        } else {
            wp[j] = static_cast<const bf16_t *>(W) + wrow(j) * K + 32 * t4 + cbeg * WSTEP;
        }
    }

    // This lane's units: slot u, tile j, unit v at wsm[((u * J + j) * WU + v) * 32];
    // NVFP4 block scales: the lane pair's word of slot u, tile j at ssm[(u * J + j) * 16].
    uint4 *wsm = g5_smem + au + warp * (D * J * WU * 32) + lane;
    unsigned *ssm = reinterpret_cast<unsigned *>(g5_smem + au + NW * (D * J * WU * 32)) + warp * (D * J * 16) + (lane >> 1);
    // issue starts the copies of chunk c into ring slot u and moves the
    // weight pointers on to the next chunk.
    auto issue = [&](int u, int c) {
#pragma unroll
        for (int j = 0; j < J; j++) {
            g5_wissue<V16>(wsm + (u * J + j) * WU * 32, ssm + (u * J + j) * 16, wp[j], sp[j], c, nfull, K, t4);
            wp[j] += WSTEP;
            if (FP4) sp[j] += G5_KC / 16;
        }
    };
#pragma unroll 1
    for (int u = 0; u < D; u++) {
        if (cbeg + u < cend) issue(u, cbeg + u);
        cp_async_commit(); // one group per chunk, empty past the end: the wait below counts groups
    }
    constexpr int NT = 32 * NW;
    G5AStage<MA, NT, H> ast;
    g5_asetup<MA, NT, FP4>(ast, s_src, K, tid);
    // H = 1: a warp whose row is missing (the same for its lanes) zeroes its
    // items of both buffers once and skips the staging; the others stage
    // every chunk, zeros included past K.
    // ROW 1 and 8 (g5_gemm): the whole K range is staged here, once, and
    // the chunk loop below meets no block barrier.
    const bool stage = !ROW && (H == 2 || ast.off[0][0] >= 0);
    // ROW: a lane's two slices 2k, 2k + 1 of a chunk are one 16-byte word
    // (g5_rowstage's layout): 4 LDS.128 a chunk, each one wavefront (ROW
    // 1: the four lanes of a group read 64 contiguous bytes, every group
    // the same) or four (ROW 8: the warp reads 512 contiguous bytes).
    const uint4 *aq = g5_smem + (ROW == 8 ? lane : t4);
    if constexpr (ROW != 0) {
        g5_rowstage<ROW>(g5_smem, A, aSF, K, s_src, cbeg, cend, lut, tid, NT);
    } else {
        if (!stage) {
            const int item = g5_item<NT, H>(tid, 0);
            g5_smem[item] = g5_smem[MI * 256 + item] = make_uint4(0, 0, 0, 0);
        }
        if (stage && cbeg < cend) {
            g5_aload<MA, NT, FP4>(ast, A, aSF, K, cbeg, tid);
            g5_astore<MA, NT, FP4>(g5_smem, ast, lut, tid);
        }
    }
    __syncthreads();

    float acc[MA][J][4];
#pragma unroll
    for (int i = 0; i < MA; i++)
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.f;

    // chunk runs chunk c from ring slot u. The activations of chunk c + 1
    // are loaded into registers first and dequantized into the other half of
    // the double-buffered shared chunk at the end. (Loaded two chunks ahead,
    // in two register sets, they measured no faster.)
    auto chunk = [&](int c, int u) {
        if (stage && c + 1 < cend) g5_aload<MA, NT, FP4>(ast, A, aSF, K, c + 1, tid);
        const uint4 *As = g5_smem + ((c - cbeg) & 1) * MI * 256 + lane;
        cp_async_wait<D - 1>(); // this lane's copies of chunk c have landed
        if (FP4 && V16) __syncwarp(); // and its even neighbour's scale word
        uint4 ar[ROW ? 4 : 1];
        if constexpr (ROW != 0) {
#pragma unroll
            for (int k = 0; k < 4; k++) ar[k] = aq[((c - cbeg) * 4 + k) * 4 * ROW];
        }
        uint4 wv[J][WU];
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int v = 0; v < WU; v++) wv[j][v] = wsm[((u * J + j) * WU + v) * 32];
        unsigned sc[J][2];
        // (Braces: an unbraced `if` before `#pragma unroll` swallowed the
        // next loop into its body in NVRTC and nvcc alike.)
        if constexpr (FP4) {
#pragma unroll
            for (int j = 0; j < J; j++) {
                const unsigned w = g5_wscale<V16>(ssm + (u * J + j) * 16, V16 ? nullptr : srow(j), c, K, lane);
                sc[j][0] = lut[w & 0xff];
                sc[j][1] = lut[w >> 8];
            }
        }
#pragma unroll
        for (int s = 0; s < 8; s++) {
            uint4 a[MA];
            if constexpr (ROW != 0) {
                // Rows 0-7 of the m16 tile (a[i].x, .z) get the staged
                // words (ROW 1: row 0's in every group; ROW 8: row g's);
                // rows 8-15 (.y, .w) get whatever is at hand: each output
                // row's MMA reads only its own A row, so the staged rows'
                // bits are those of a zero-padded tile, and the others
                // are never written (ROW 1: row1 = row0 + 1; ROW 8: row1 <=
                // row0 + 8). Slice 2k takes the staged word as it is; slice
                // 2k + 1 repeats its odd words, so the MMA's aligned
                // register quad takes two moves at most.
                const uint4 &r = ar[s >> 1];
                a[0] = s & 1 ? make_uint4(r.y, r.y, r.w, r.w) : r;
            } else {
#pragma unroll
                for (int i = 0; i < MA; i++) a[i] = As[(i * 8 + s) * 32];
            }
#pragma unroll
            for (int j = 0; j < J; j++) {
                unsigned b0, b1;
                if constexpr (FP4) {
                    const uint4 &w = wv[j][0];
                    const unsigned q = s < 2 ? w.x : s < 4 ? w.y : s < 6 ? w.z : w.w;
                    g5_slice4(q, sc[j][s >> 2], s, b0, b1);
                } else {
                    const uint4 &w = wv[j][s >> 1];
                    b0 = s & 1 ? w.z : w.x;
                    b1 = s & 1 ? w.w : w.y;
                }
#pragma unroll
                for (int i = 0; i < MA; i++) {
                    const unsigned af[4] = {a[i].x, a[i].y, a[i].z, a[i].w};
                    mma16816(acc[i][j], af, b0, b1);
                }
            }
        }
        if (FP4 && V16) __syncwarp(); // every lane has read slot u's scale word
        if (c + D < cend) issue(u, c + D);
        cp_async_commit();
        if constexpr (!ROW) {
            if (stage && c + 1 < cend) g5_astore<MA, NT, FP4>(g5_smem + ((c + 1 - cbeg) & 1) * MI * 256, ast, lut, tid);
            __syncthreads();
        }
    };
    if constexpr (FP4) {
        // Not unrolled over the ring: unrolled, the NVFP4 loop outgrew the
        // instruction cache (ncu: a sixth of the stall samples were "no
        // instruction"), and the register ring of block scales it needed
        // waited on later loads (scoreboards are shared).
#pragma unroll 1
        for (int c = cbeg, u = 0; c < cend; c++, u = u + 1 == D ? 0 : u + 1) chunk(c, u);
    } else {
        for (int c0 = cbeg; c0 < cend; c0 += D) {
#pragma unroll
            for (int u = 0; u < D; u++) {
                const int c = c0 + u;
                if (c >= cend) break;
                chunk(c, u);
            }
        }
    }

    // The operands are read: the next kernel (quantize h, finalize) may
    // launch its blocks while this one's epilogue runs.
    pdl_trigger();

    // The K split: block 1 leaves its sums in its activation buffers (free
    // now: every copy has landed and the last barrier has passed), block 0
    // adds them to its own, block 1 waits until they are read.
    if constexpr (KS == 2) {
        cp_async_wait<0>();
        __syncthreads();
        if (!ks2_add<MA * J, NT>(&acc[0][0], g5_smem, rank, tid)) return;
    }

    g5_epilogue<MA, J, SWIGLU, FP4>(err, acc, 0, cw, s_src, row0, row1, FP4 ? wScale[expert] : 1.f, aScale, act, out, outN, sacc,
                                    stok, swt, sslots, sT, sk, g, t4);
}

// g5_gemm: A and W are packed codes (NVFP4, with aSF/wSF block scales and
// aScale/wScale global ones) or BF16 matrices (the scale pointers unused).
// K is the padded reduction length for NVFP4, the row length for BF16.
// Launched as clusters of two along z (the K split above); V16 as in
// g5_wissue, decided once per launch. A warp multiplies J n8 tiles of
// columns: 2, or 1 (the _j1 kernels, not SwiGLU) so that a launch of few
// tiles has twice the blocks: a column's MMAs, K order and bits are the
// same whatever J is.
// M8 (NVFP4, MI = 1): tiles of at most 8 rows, whose whole K range of
// activations the block stages at once (g5_tail's ROW 8 path; the host
// sizes the shared memory by K, g5_m8units): no block barrier between
// chunks, so each warp runs through its own weight ring. For the few rows
// an expert takes at decode batch sizes.
template <int MI, int J, bool SWIGLU, bool FP4, bool V16, int KS, bool M8 = false>
__device__ __forceinline__ void g5_gemm(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K,
                                        const int *gather, int Ta, const void *W, const unsigned char *wSF, const float *wScale,
                                        int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN, float *sacc,
                                        const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    static_assert(!M8 || (FP4 && MI == 1), "M8: NVFP4 tiles of 8 rows");
    constexpr int BM = M8 ? 8 : 16 * MI;
    __shared__ int s_expert, s_row0, s_row1;
    __shared__ int s_src[GG_BM];
    __shared__ unsigned lut[256];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    if (FP4)
        for (int b = tid; b < 256; b += blockDim.x) {
            const unsigned h = f2bf(__fmul_rn(e4m3_decode(b), __uint_as_float(0x7A800000u))); // * 2^118
            lut[b] = h | (h << 16);
        }
    // Before the wait only the scale table, which reads no global memory:
    // the block starts while the kernel before it (quantize h, dispatch)
    // ends.
    pdl_wait();
    if (warp == 0) gg_schedule(err, offsets, E, R, lane, BM, &s_expert, &s_row0, &s_row1);
    __syncthreads();
    const int expert = s_expert, row0 = s_row0, row1 = s_row1;
    if (expert < 0) return; // both blocks of the pair: they share the tile
    gg_sources(err, s_src, gather, row0, row1, Ta);
    __syncthreads();

    if constexpr (M8) {
        g5_tail<1, 1, MI, J, SWIGLU, FP4, V16, KS, 8>(err, A, aSF, aScale, K, W, wSF, wScale, N, act, out, outN, sacc, stok, swt, sslots,
                                                      sT, sk, expert, row0, row1, s_src, lut);
    } else {
        // A partial tile runs with only its m16 tiles that hold rows.
        const int ma = (row1 - row0 + 15) / 16;
        if constexpr (MI == 1) {
            // An NVFP4 tile of one row in the _j1 kernels (a token per expert:
            // the one-token layer) whose block's K range fits the 8 KB of
            // activation buffers as 256-byte chunks (G5_ROWCH): the ROW path of
            // g5_tail. Not in the J = 2 kernels: with a ROW path ptxas spilled
            // 48-64 bytes in each of them (64 registers for four blocks an SM)
            // and they ran 0.7-8% slower at 8-128 tokens (measured on the H200).
            if constexpr (FP4 && J == 1) {
                const int nch = (K + G5_KC - 1) / G5_KC;
                if (row1 - row0 == 1 && (KS == 2 ? (nch + 1) / 2 : nch) <= G5_ROWCH) {
                    g5_tail<1, 1, MI, J, SWIGLU, FP4, V16, KS, 1>(err, A, aSF, aScale, K, W, wSF, wScale, N, act, out, outN, sacc, stok, swt,
                                                              sslots, sT, sk, expert, row0, row1, s_src, lut);
                    return;
                }
            }
            // A 16-row tile of at most 8 rows stages only rows 0-7 (G5AStage).
            if (row1 - row0 <= 8) {
                g5_tail<1, 1, MI, J, SWIGLU, FP4, V16, KS, 0>(err, A, aSF, aScale, K, W, wSF, wScale, N, act, out, outN, sacc, stok, swt,
                                                              sslots, sT, sk, expert, row0, row1, s_src, lut);
                return;
            }
        }
        if constexpr (MI >= 2) {
            if (ma <= 1) {
                g5_tail<1, 2, MI, J, SWIGLU, FP4, V16, KS, 0>(err, A, aSF, aScale, K, W, wSF, wScale, N, act, out, outN, sacc, stok, swt,
                                                              sslots, sT, sk, expert, row0, row1, s_src, lut);
                return;
            }
        }
        if constexpr (MI >= 4) {
            if (ma <= 2) {
                g5_tail<2, 2, MI, J, SWIGLU, FP4, V16, KS, 0>(err, A, aSF, aScale, K, W, wSF, wScale, N, act, out, outN, sacc, stok, swt,
                                                              sslots, sT, sk, expert, row0, row1, s_src, lut);
                return;
            }
        }
        g5_tail<MI, 2, MI, J, SWIGLU, FP4, V16, KS, 0>(err, A, aSF, aScale, K, W, wSF, wScale, N, act, out, outN, sacc, stok, swt,
                                                              sslots, sT, sk, expert, row0, row1, s_src, lut);
    }
}


// The grouped GEMMs' kernel parameters, the same for every family
// (streamed, tiled, warp-specialised): the host's launch arguments.
// StreamTile is the streamed kernel's variant: MI m16 row tiles (16, 32 or
// 64 rows), J n8 tiles a warp, SwiGLU pairing, NVFP4 or BF16 operands;
// M8: NVFP4 tiles of 8 rows, MI = 1 (g5_gemm).
template <int MI_, int J_, bool SWIGLU_, bool FP4_, bool M8_ = false>
struct StreamTile {
    static constexpr int MI = MI_, J = J_;
    static constexpr bool SWIGLU = SWIGLU_, FP4 = FP4_, M8 = M8_;
    static constexpr int THREADS = 32 * G5_NW;
    static constexpr int MINB = g5_minb(FP4, MI, J, M8);
};

// stream_body picks V16 at run time: whole 16-byte units per row (K % 64
// == 0 for NVFP4, so that the block scales of a lane pair are one aligned
// word; K % 8 == 0 for BF16), 16-byte aligned W and (NVFP4) 4-byte aligned
// block scales.
template <class T, int KS>
__device__ __forceinline__ void stream_body(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,
    const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,
    float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    const bool v16 = (T::FP4 ? K % 64 == 0 && (reinterpret_cast<unsigned long long>(wSF) & 3) == 0 : K % 8 == 0) &&
                     (reinterpret_cast<unsigned long long>(W) & 15) == 0;
    if (v16)
        g5_gemm<T::MI, T::J, T::SWIGLU, T::FP4, true, KS, T::M8>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
    else
        g5_gemm<T::MI, T::J, T::SWIGLU, T::FP4, false, KS, T::M8>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
}

// gemm_stream<T> and gemm_stream_ks2<T> (K split over a cluster of two
// blocks along z, grid z = 2; NVFP4 only). The host's registry names the
// variants it launches (kernels/cuda/registry.go): the NVFP4 32-row tiles
// run only with four n8 tiles a warp, since with two each A fragment feeds
// two MMAs and the kernels are bound by shared memory (ncu on the H200 at
// 512 tokens).
template <class T>
__global__ void __launch_bounds__(T::THREADS, T::MINB) gemm_stream(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,
    const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,
    float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    stream_body<T, 1>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
}
template <class T>
__global__ void __launch_bounds__(T::THREADS, T::MINB) __cluster_dims__(1, 1, 2) gemm_stream_ks2(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,
    const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,
    float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    static_assert(T::FP4, "only the NVFP4 kernels split K");
    stream_body<T, 2>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, stok, swt, sslots, sT, sk);
}

} // namespace rw
