// Compile unit: the model's dense GEMMs (q/k/v/o, the router, the LM head):
// gemm_narrow, gemm_narrow8, gemm_narrow8_short and gemm_narrow_wide stream
// the weights for few rows; gemm_dense_tile stages tiles in shared memory for
// many. All of them add the products of an output in one order, decided by K
// alone.
#include "numerics.cuh"
#include "ptx.cuh"

namespace rw {

// ---- Dense GEMM, streamed: few rows ----
//
// dst[M, N] = a[M, K] * w[N, K]^T for N <= 1024, where the tiled kernel
// would run only a handful of blocks down a long K. A block computes 16*MI
// rows by 8*NJ columns; its 16 warps take the k16 slices s = w, w+16, ...
// straight from global memory into MMA fragments (no staging, several
// slices in flight per warp), each warp from zero, and the block adds the
// sixteen partials in warp order. That order depends on K alone, so an
// output's bits never depend on M, on the other rows or on the block's
// tile: gemm_narrow (16 x 8, one token: the router's 256 x 7168 weights
// are read by 32 blocks) and gemm_narrow_wide (32 x 32, for many rows,
// where 16 x 8 blocks read the activations 32 times over and the weights
// once per 16 rows) agree bit for bit. K is even (the caller checks), so
// BF16 pairs are read 4 bytes at a time; pairs past K read as zeros.
constexpr int GN_WARPS = 16;

// DenseSegs: the outputs of up to three GEMMs that share their input (a
// layer's q, k and v projections) side by side as one launch's columns:
// segment i is n[i] columns of o[i], computed with w[i] (n[i] = 0 for an
// unused one). Every kernel here takes one; the host puts the segment
// boundaries on multiples of every block's width, so a block's columns lie
// in one segment, and a column's bits are those of its GEMM alone.
struct DenseSegs {
    const bf16_t *w[3];
    void *o[3];
    int n[3];
};

// dense_seg finds the segment of launch column c: its weights, output and
// width, and the launch column of its first.
__device__ __forceinline__ void dense_seg(const DenseSegs &s, int c, const bf16_t *&w, void *&o, int &n, int &first) {
    int i = 0;
    first = 0;
    if (c >= s.n[0]) {
        first = s.n[0];
        i = c >= s.n[0] + s.n[1] ? 2 : 1;
        if (i == 2) first += s.n[1];
    }
    w = s.w[i];
    o = s.o[i];
    n = s.n[i];
}
__device__ __forceinline__ unsigned gn_ld(const bf16_t *row, int k, int K, bool ok) {
    return ok && k < K ? __ldg(reinterpret_cast<const unsigned *>(row + k)) : 0u;
}

// gn_ld8 returns row[k .. k+8) (k a multiple of 8) as four words, zeros
// past K or for a missing row: one 16-byte load where vec (K a multiple of
// 8 and 16-byte aligned rows, so the 8 values are all in or all out), else
// four 4-byte ones (K even: each pair is in or out).
__device__ __forceinline__ uint4 gn_ld8(const bf16_t *row, int k, int K, bool ok, bool vec) {
    if (!ok || k >= K) return make_uint4(0, 0, 0, 0);
    if (vec) return __ldg(reinterpret_cast<const uint4 *>(row + k));
    return make_uint4(gn_ld(row, k, K, true), gn_ld(row, k + 2, K, true), gn_ld(row, k + 4, K, true), gn_ld(row, k + 6, K, true));
}

// part: GN_WARPS x 16*MI x (8*NJ + 1) floats of shared memory. H is the
// halves of a row tile that may hold rows: 1 where M <= 8 (rows 8-15 of
// the tile are missing, zeros, as they would read with H = 2), which
// frees the registers of their loads for more slices in flight.
template <int MI, int NJ, int UNROLL, int H = 2>
__device__ __forceinline__ void gn_gemm(const bf16_t *A, const DenseSegs &segs, int M, int K, int outFmt, float *part) {
    constexpr int RM = 16 * MI, CN = 8 * NJ, LDP = CN + 1;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const bf16_t *W;
    void *out;
    int N, first;
    dense_seg(segs, blockIdx.y * CN, W, out, N, first);
    const int r0 = blockIdx.x * RM, c0 = blockIdx.y * CN - first;
    const bf16_t *ar[MI][2], *wr[NJ];
    bool rok[MI][2], wok[NJ];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = r0 + 16 * i + g + 8 * h;
            rok[i][h] = r < M;
            ar[i][h] = A + (long long)min(r, M - 1) * K;
        }
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const int c = c0 + 8 * j + g;
        wok[j] = c < N;
        wr[j] = W + (long long)min(c, N - 1) * K;
    }
    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.f;
    // A warp takes 32-k double slices, warp*32 + m*32*GN_WARPS; lane t4
    // loads elements 8*t4 .. 8*t4+7 of each (16 bytes), whose first and
    // second word pairs are its fragments of the double slice's two MMAs.
    // Each MMA then sums k slots {0-3, 8-11, 16-19, 24-27} (or the other
    // half) of the 32, the same way in gemm_narrow and gemm_narrow_wide.
    const bool vec = K % 8 == 0 && (reinterpret_cast<unsigned long long>(A) & 15) == 0 &&
                     (reinterpret_cast<unsigned long long>(W) & 15) == 0;
    // The weights of the first round are loaded before the kernel waits
    // for the one before it (pdl_wait): no kernel of a step writes them, so
    // they are in flight while that kernel finishes. The activations, its
    // output, come after the wait, and so does every store.
    constexpr int DU = UNROLL / 2 > 0 ? UNROLL / 2 : 1; // double slices per iteration
    bool waited = false;
    for (int k = warp * 32; k < K; k += 32 * GN_WARPS * DU) {
        uint4 af[DU][MI][2], bf[DU][NJ];
#pragma unroll
        for (int u = 0; u < DU; u++) { // all loads first: they fly together
            const int kk = k + u * 32 * GN_WARPS + 8 * t4;
#pragma unroll
            for (int j = 0; j < NJ; j++) bf[u][j] = gn_ld8(wr[j], kk, K, wok[j], vec);
        }
        if (!waited) {
            pdl_enter();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < DU; u++) {
            const int kk = k + u * 32 * GN_WARPS + 8 * t4;
#pragma unroll
            for (int i = 0; i < MI; i++) {
                af[u][i][0] = gn_ld8(ar[i][0], kk, K, rok[i][0], vec);
                af[u][i][1] = H == 2 ? gn_ld8(ar[i][1], kk, K, rok[i][1], vec) : make_uint4(0, 0, 0, 0);
            }
        }
        // Then the double slices in k order; only those starting inside K,
        // so the chain is the same whatever UNROLL is.
#pragma unroll
        for (int u = 0; u < DU; u++)
            if (k + u * 32 * GN_WARPS < K)
#pragma unroll
                for (int i = 0; i < MI; i++)
#pragma unroll
                    for (int j = 0; j < NJ; j++) {
                        const uint4 &a0 = af[u][i][0], &a1 = af[u][i][1];
                        const unsigned lo[4] = {a0.x, a1.x, a0.y, a1.y}, hi[4] = {a0.z, a1.z, a0.w, a1.w};
                        mma16816(acc[i][j], lo, bf[u][j].x, bf[u][j].y);
                        mma16816(acc[i][j], hi, bf[u][j].z, bf[u][j].w);
                    }
    }
    if (!waited) pdl_enter(); // a warp with no slice (K < 32 * GN_WARPS)
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) part[(warp * RM + 16 * i + g + 8 * (q >> 1)) * LDP + 8 * j + 2 * t4 + (q & 1)] = acc[i][j][q];
    __syncthreads();
    for (int o = tid; o < RM * CN; o += blockDim.x) {
        const int r = o / CN, c = o % CN;
        if (r0 + r < M && c0 + c < N) {
            float v = part[r * LDP + c];
#pragma unroll
            for (int w = 1; w < GN_WARPS; w++) v = __fadd_rn(v, part[(w * RM + r) * LDP + c]);
            const long long d = (long long)(r0 + r) * N + c0 + c;
            if (outFmt == 1) reinterpret_cast<float *>(out)[d] = v;
            else reinterpret_cast<bf16_t *>(out)[d] = f2bf(v);
        }
    }
}

__global__ void __launch_bounds__(32 * GN_WARPS) gemm_narrow(const bf16_t *A, DenseSegs segs, int M, int K, int outFmt) {
    __shared__ float part[GN_WARPS * 16 * 9];
    gn_gemm<1, 1, 8>(A, segs, M, K, outFmt, part);
}

// gemm_narrow8: gemm_narrow for M <= 8 (one row tile, its first half):
// a warp's 14 double slices of a 7168-long K (the router at one token) in
// flight at once, one round of loads instead of 4. The same bits. ptxas
// gives it 24 bytes of spills at 128 registers; measured on the H200 it
// is still 0.7 us faster at one token than 7 slices in flight without
// spills.
__global__ void __launch_bounds__(32 * GN_WARPS) gemm_narrow8(const bf16_t *A, DenseSegs segs, int M, int K, int outFmt) {
    __shared__ float part[GN_WARPS * 16 * 9];
    gn_gemm<1, 1, 28, 1>(A, segs, M, K, outFmt, part);
}

// gemm_narrow8_short: gemm_narrow8 for K <= 2048 (q, k, v, the router and
// the LM head of Qwen3-30B-A3B), where a warp has at most 4 double slices:
// all of them in flight at once within 64 registers, so that two blocks
// share a multiprocessor (gemm_narrow8 takes 128, one block). The same
// bits. Measured on an H100 (TestDenseGemmPaths), with the weights loaded
// before the wait: q (4096 x 2048) at one row 8.0 us, 13.2 before; the
// 151936-row LM head 197 us, against 226 us for the tiled kernel.
__global__ void __launch_bounds__(32 * GN_WARPS, 2) gemm_narrow8_short(const bf16_t *A, DenseSegs segs, int M, int K, int outFmt) {
    __shared__ float part[GN_WARPS * 16 * 9];
    gn_gemm<1, 1, 8, 1>(A, segs, M, K, outFmt, part);
}

// gemm_narrow_wide: dynamic shared memory GN_WARPS x 32 x 33 floats.
__global__ void __launch_bounds__(32 * GN_WARPS) gemm_narrow_wide(const bf16_t *A, DenseSegs segs, int M, int K, int outFmt) {
    extern __shared__ float gn_part[];
    gn_gemm<2, 4, 2>(A, segs, M, K, outFmt, gn_part);
}

// ---- Dense GEMM, tiled: many rows ----
//
// gemm_dense_tile computes a BM x BN tile of dst = a * w^T with the bits
// gn_gemm gives: each output is the sum of GN_WARPS partials, partial w
// taking the 32-k double slices k = 32 w + 512 m in m order, each through
// the same two MMAs with the same fragments, from zero; the partials added
// in w order, the first copied, the others by __fadd_rn (a partial of no
// slice, K < 512, is +0 and added too). gn_gemm runs the partials side by
// side in 16 warps and adds them through shared memory; here one warp
// walks them one after the other for a 32 x 64 (or 32 x 32) piece of the
// tile, with two accumulators: the partial and the running sum. A block
// stages the tile's A rows and w rows SPS double slices (32 k, 64 bytes a
// row, each) at a time through a STAGES-deep cp.async ring, in that same
// order, so each staged byte feeds 2 x BN (BM) MMAs where gn_gemm reads it
// from global memory for one 16 x 8 (32 x 32) tile. A lane reads its 16 bytes
// of a row (elements 8 t4 .. 8 t4 + 7, as gn_ld8) straight from shared
// memory: 8 rows of 64 bytes are 512 contiguous bytes, no bank conflict.
// K is a multiple of 32 and a and w 16-byte aligned (the host checks).
template <int BM_, int BN_, int WM_, int WN_, int STAGES_, int SPS_>
struct DenseTile {
    static constexpr int BM = BM_, BN = BN_, STAGES = STAGES_, SPS = SPS_;
    static constexpr int WARPS = WM_ * WN_, THREADS = 32 * WARPS;
    static constexpr int TM = BM / WM_, TN = BN / WN_; // a warp's piece
    static constexpr int MI = TM / 16, NJ = TN / 8;
    static constexpr int ROW_BYTES = 64; // one double slice of a row
    static constexpr int SLAB_BYTES = (BM + BN) * ROW_BYTES;
    static constexpr int STAGE_BYTES = SPS * SLAB_BYTES;
    static constexpr int SMEM = STAGES * STAGE_BYTES;
    static constexpr int LOADS = (BM + BN) * 4 / THREADS; // 16-byte copies a thread and double slice
    static_assert((BM + BN) * 4 % THREADS == 0, "a stage's copies must divide among the threads");
    static_assert(TM % 16 == 0 && TN % 8 == 0 && BM % WM_ == 0 && BN % WN_ == 0, "warp pieces of whole MMA tiles");
};

// gd_slabs is how many double slices partial w takes of a K (a multiple
// of 32): those at k = 32 w + 512 m < K.
__device__ __forceinline__ int gd_slabs(int K, int w) { return 32 * w < K ? (K - 32 * w + 511) / 512 : 0; }

template <class T>
__global__ void __launch_bounds__(T::THREADS) gemm_dense_tile(const bf16_t *A, DenseSegs segs, int M, int K, int outFmt) {
    extern __shared__ __align__(16) unsigned char gd_smem[];
    pdl_enter();
    constexpr int MI = T::MI, NJ = T::NJ;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const bf16_t *W;
    void *out;
    int N, first;
    dense_seg(segs, blockIdx.y * T::BN, W, out, N, first);
    const int r0 = blockIdx.x * T::BM, c0 = blockIdx.y * T::BN - first;
    const int wm0 = warp / (T::BN / T::TN) * T::TM, wn0 = warp % (T::BN / T::TN) * T::TN;
    // This thread's copies: the same rows and 16-byte columns every stage.
    const bf16_t *src[T::LOADS];
    bool ok[T::LOADS];
    int dst[T::LOADS];
#pragma unroll
    for (int l = 0; l < T::LOADS; l++) {
        const int idx = tid + l * T::THREADS, row = idx >> 2, ch = idx & 3;
        if (row < T::BM) {
            const int r = r0 + row;
            ok[l] = r < M;
            src[l] = A + (long long)min(r, M - 1) * K + 8 * ch;
        } else {
            const int c = c0 + row - T::BM;
            ok[l] = c < N;
            src[l] = W + (long long)min(c, N - 1) * K + 8 * ch;
        }
        dst[l] = row * T::ROW_BYTES + 16 * ch;
    }
    const int S = K / 32, NS = (S + T::SPS - 1) / T::SPS; // double slices, stages' worth of them
    int ps = 0, pw = 0, pm = 0, pn = gd_slabs(K, 0); // the next slice to stage: the ps-th, partial pw's pm-th
    auto stage = [&](int st) {
#pragma unroll
        for (int u = 0; u < T::SPS; u++) {
            if (ps == S) break;
            unsigned char *base = gd_smem + st * T::STAGE_BYTES + u * T::SLAB_BYTES;
            const int k0 = 32 * pw + 512 * pm;
#pragma unroll
            for (int l = 0; l < T::LOADS; l++) cp_async(base + dst[l], src[l] + k0, 16, ok[l]);
            ps++;
            if (++pm == pn) {
                pw++;
                pm = 0;
                pn = gd_slabs(K, pw);
            }
        }
    };
#pragma unroll
    for (int st = 0; st < T::STAGES - 1; st++) {
        if (st < NS) stage(st);
        cp_async_commit();
    }
    float part[MI][NJ][4], sum[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) part[i][j][q] = sum[i][j][q] = 0.f;
    // fold ends partial w: the sum takes it (the first by copy), and the
    // partial starts again from zero.
    auto fold = [&](int w) {
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    sum[i][j][q] = w == 0 ? part[i][j][q] : __fadd_rn(sum[i][j][q], part[i][j][q]);
                    part[i][j][q] = 0.f;
                }
    };
    int cw = 0, cm = 0, cn = gd_slabs(K, 0); // the slice being added: partial cw's cm-th of cn
    for (int it = 0; it < NS; it++) {
        cp_async_wait<T::STAGES - 2>();
        __syncthreads(); // stage it is in; every warp is done with stage it - 1
        if (it + T::STAGES - 1 < NS) stage((it + T::STAGES - 1) % T::STAGES);
        cp_async_commit();
#pragma unroll
        for (int u = 0; u < T::SPS; u++) {
            if (it * T::SPS + u == S) break;
            const unsigned char *base = gd_smem + (it % T::STAGES) * T::STAGE_BYTES + u * T::SLAB_BYTES;
            uint4 af[MI][2], bfr[NJ];
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    af[i][h] = *reinterpret_cast<const uint4 *>(base + (wm0 + 16 * i + g + 8 * h) * T::ROW_BYTES + 16 * t4);
#pragma unroll
            for (int j = 0; j < NJ; j++)
                bfr[j] = *reinterpret_cast<const uint4 *>(base + (T::BM + wn0 + 8 * j + g) * T::ROW_BYTES + 16 * t4);
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    const uint4 &a0 = af[i][0], &a1 = af[i][1];
                    const unsigned lo[4] = {a0.x, a1.x, a0.y, a1.y}, hi[4] = {a0.z, a1.z, a0.w, a1.w};
                    mma16816(part[i][j], lo, bfr[j].x, bfr[j].y);
                    mma16816(part[i][j], hi, bfr[j].z, bfr[j].w);
                }
            if (++cm == cn) {
                fold(cw);
                cw++;
                cm = 0;
                cn = gd_slabs(K, cw);
            }
        }
    }
    for (; cw < GN_WARPS; cw++) fold(cw); // partials of no slice: +0 each
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = r0 + wm0 + 16 * i + g + 8 * h;
            if (r >= M) continue;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int c = c0 + wn0 + 8 * j + 2 * t4;
                const float v0 = sum[i][j][2 * h], v1 = sum[i][j][2 * h + 1];
                const long long d = (long long)r * N + c;
                if (outFmt == 1) {
                    float *o = reinterpret_cast<float *>(out);
                    if (c + 1 < N && (N & 1) == 0) *reinterpret_cast<float2 *>(o + d) = make_float2(v0, v1);
                    else {
                        if (c < N) o[d] = v0;
                        if (c + 1 < N) o[d + 1] = v1;
                    }
                } else {
                    bf16_t *o = reinterpret_cast<bf16_t *>(out);
                    if (c + 1 < N && (N & 1) == 0) {
                        *reinterpret_cast<unsigned *>(o + d) = (unsigned)f2bf(v0) | (unsigned)f2bf(v1) << 16;
                    } else {
                        if (c < N) o[d] = f2bf(v0);
                        if (c + 1 < N) o[d + 1] = f2bf(v1);
                    }
                }
            }
        }
}

} // namespace rw
