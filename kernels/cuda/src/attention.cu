// Causal grouped-query attention over the paged KV cache
// (kernels.AttentionArgs), two kernels:
//
//   - att_tc<D, GROUP, W>, on tensor cores, for head dims 16..128 and
//     groups of query heads per KV head that divide 16, in blocks of W
//     warps (4 or 1). Positions are split at fixed boundaries so that one
//     query row's positions spread over many warps and blocks
//     (flash-decoding), and every row is reduced by the same fixed tree
//     whatever the batch, whichever kernel geometry (and W) serves it, and
//     whether it is decoded alone or prefilled with other rows.
//   - att_generic, any geometry: one block per (query row, KV head),
//     positions in order.
//
// The host (model.go) picks one by the geometry alone, never by the batch.
//
// Compile unit: attention. Names start with att_.
#include "numerics.cuh"
#include "ptx.cuh"
#include "errors.cuh"

namespace rw {

constexpr unsigned ATT_FULL = 0xffffffffu;

// AttRow is the sequence of a block's query row (blockIdx.x).
struct AttRow {
    int seq, q0, nq, len;
};

// att_seq_of returns the sequence of query row row: the first k in
// [0, nseq] with queryStart[k] > row is one past it, so a row before
// queryStart[0] gives -1 and one from queryStart[nseq] on gives nseq
// (padding, left untouched). Block-uniform.
__device__ __forceinline__ int att_seq_of(const int *queryStart, int nseq, int row) {
    int lo = 0, hi = nseq + 1;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (queryStart[mid] > row) hi = mid;
        else lo = mid + 1;
    }
    return lo - 1;
}

// att_locate checks the launch's query starts, finds the sequence of the
// block's query row and checks the sequence (its length against its
// queries and its page-table row, and every page it reads). Every thread
// of the block calls it; it returns false, for the whole block, when the
// row is padding or something is wrong (reported through the error word:
// launch-wide errors by block (0, 0, 0), a sequence's by the blocks of its
// first query row).
__device__ bool att_locate(int *err, const int *pageTable, const int *seqLens, const int *queryStart, int tq, int pageSize,
                           int pages, int nseq, int maxPages, AttRow &r) {
    const int row = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x;
    const bool reporter = blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
    // QueryStart must lie in [0, tq] and not decrease. Every block checks
    // it (it is short) with loads that do not wait on each other; only
    // when something is wrong does block (0, 0, 0) walk it again to report.
    int bad = 0;
#pragma unroll 4
    for (int s = tid; s <= nseq; s += blockDim.x) {
        const int a = queryStart[s], b = s < nseq ? queryStart[s + 1] : tq;
        bad |= a < 0 || a > tq || b < a;
    }
    if (__syncthreads_or(bad)) {
        for (int s = tid; reporter && s <= nseq; s += blockDim.x) {
            const int a = queryStart[s];
            if (a < 0 || a > tq) report(err, E_ATT_QSTART, s, a, tq);
            else if (s < nseq && queryStart[s + 1] < a) report(err, E_ATT_DECREASE, s, a, queryStart[s + 1]);
        }
        return false;
    }

    const int seq = att_seq_of(queryStart, nseq, row);
    if (seq < 0 || seq >= nseq) return false;
    const int q0 = queryStart[seq], nq = queryStart[seq + 1] - q0;
    const int len = seqLens[seq];
    // Sequence errors are reported by the block of its first query row.
    const bool owner = row == q0 && kvh == 0 && blockIdx.z == 0;
    const bool first = owner && tid == 0;
    if (len < nq) {
        if (first) report(err, E_ATT_QUERIES, seq, nq, len);
        return false;
    }
    const long long room = (long long)maxPages * pageSize;
    if ((long long)len > room) {
        if (first) report(err, E_ATT_LEN, seq, len, (int)min(room, 2147483647LL));
        return false;
    }
    const int npages = (int)(((long long)len + pageSize - 1) / pageSize);
    const int *pt = pageTable + (size_t)seq * maxPages;
    bad = 0;
#pragma unroll 4
    for (int j = tid; j < npages; j += blockDim.x) {
        const int p = pt[j];
        bad |= p < 0 || p >= pages;
    }
    if (__syncthreads_or(bad)) {
        for (int j = tid; owner && j < npages; j += blockDim.x) {
            const int p = pt[j];
            if (p < 0 || p >= pages) report(err, E_ATT_PAGE, seq, j, p);
        }
        return false;
    }

    r.seq = seq;
    r.q0 = q0;
    r.nq = nq;
    r.len = len;
    return true;
}

// ---- att_generic: one block per (query row, KV head). ----
//
// The block handles the group of query heads that share the KV head, so
// each K/V row is read once for all of them. Positions 0..pos are walked in
// tiles of ATT_G_TILE: the tile's K and V rows are staged in shared
// memory (rows padded by 8 elements, so 16-byte reads of 8 different rows
// hit distinct banks), each (head, position) score is one thread's
// sequential FP32 dot product, and an online softmax per head (one warp per
// head, fixed shuffle trees) rescales the FP32 accumulators, each output
// element owned by one thread and summed in position order. Every order is
// fixed by the row's own length and the head geometry, so the result is
// bitwise the same alone or in any batch.
constexpr int ATT_G_TILE = 64;
constexpr int ATT_G_THREADS = 256;
__device__ __forceinline__ float att_bf_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float att_bf_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

__global__ void __launch_bounds__(ATT_G_THREADS)
att_generic(int *err, bf16_t *out, const bf16_t *q, const bf16_t *ck, const bf16_t *cv, const int *pageTable,
                const int *seqLens, const int *queryStart, int tq, int qHeads, int kvHeads, int d, int pageSize,
                int pages, int nseq, int maxPages, float scale) {
    extern __shared__ float4 att_g_smem[];
    const int row = blockIdx.x, kvh = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int group = qHeads / kvHeads;
    AttRow r;
    if (!att_locate(err, pageTable, seqLens, queryStart, tq, pageSize, pages, nseq, maxPages, r)) return;
    const int q0 = r.q0, nq = r.nq, len = r.len;
    const int *pt = pageTable + (size_t)r.seq * maxPages;

    const int count = len - nq + (row - q0) + 1; // this query sees positions 0 .. count-1

    // Shared memory (model.go's attentionShared computes the same size).
    const int ks = d + 8; // padded row stride of the K and V tiles, in elements
    bf16_t *kS = reinterpret_cast<bf16_t *>(att_g_smem);
    bf16_t *vS = kS + ATT_G_TILE * ks;
    long long *offS = reinterpret_cast<long long *>(vS + ATT_G_TILE * ks); // element offset of each tile row
    float *qS = reinterpret_cast<float *>(offS + ATT_G_TILE);              // [group][d]
    float *accS = qS + group * d;                                              // [group][d]
    float *sS = accS + group * d;                                              // [group][TILE] scores / weights
    float *mS = sS + group * ATT_G_TILE;                                   // running max per head
    float *lS = mS + group;                                                    // running sum per head
    float *aS = lS + group;                                                    // this tile's rescale per head

    const bf16_t *qrow = q + ((size_t)row * qHeads + (size_t)kvh * group) * d; // the group's heads are adjacent
    for (int k = tid; k < group * d; k += blockDim.x) {
        qS[k] = bf2f(qrow[k]);
        accS[k] = 0.0f;
    }
    for (int g = tid; g < group; g += blockDim.x) {
        mS[g] = -inf_f32();
        lS[g] = 0.0f;
    }
    const bool vec = (d & 7) == 0 && (((unsigned long long)ck | (unsigned long long)cv) & 15) == 0;

    for (int t0 = 0; t0 < count; t0 += ATT_G_TILE) {
        const int n = min(ATT_G_TILE, count - t0);
        __syncthreads(); // the previous tile is fully consumed (and the init above is visible)
        if (tid < n) {
            const int p = t0 + tid;
            const long long slot = (long long)pt[p / pageSize] * pageSize + p % pageSize;
            offS[tid] = (slot * kvHeads + kvh) * d;
        }
        __syncthreads();
        if (vec) {
            const int cpr = d >> 3; // 16-byte chunks per row
            for (int c = tid; c < n * cpr; c += blockDim.x) {
                const int j = c / cpr, cc = c - j * cpr;
                const long long off = offS[j] + cc * 8;
                *reinterpret_cast<uint4 *>(kS + j * ks + cc * 8) = *reinterpret_cast<const uint4 *>(ck + off);
                *reinterpret_cast<uint4 *>(vS + j * ks + cc * 8) = *reinterpret_cast<const uint4 *>(cv + off);
            }
        } else {
            for (int c = tid; c < n * d; c += blockDim.x) {
                const int j = c / d, i = c - j * d;
                kS[j * ks + i] = ck[offS[j] + i];
                vS[j * ks + i] = cv[offS[j] + i];
            }
        }
        __syncthreads();

        // Scores: item (g, j) -> one thread; the 32 lanes of a warp share g
        // (TILE is a multiple of 32), so q reads are broadcasts. Both paths
        // accumulate in element order with fmaf, so they agree bitwise.
        for (int it = tid; it < group * ATT_G_TILE; it += blockDim.x) {
            const int g = it / ATT_G_TILE, j = it - g * ATT_G_TILE;
            if (j >= n) continue;
            const float *qg = qS + g * d;
            const bf16_t *kr = kS + j * ks;
            float dot = 0.0f;
            if (vec) {
                for (int c = 0; c < d; c += 8) {
                    const uint4 u = *reinterpret_cast<const uint4 *>(kr + c);
                    dot = fmaf(qg[c + 0], att_bf_lo(u.x), dot);
                    dot = fmaf(qg[c + 1], att_bf_hi(u.x), dot);
                    dot = fmaf(qg[c + 2], att_bf_lo(u.y), dot);
                    dot = fmaf(qg[c + 3], att_bf_hi(u.y), dot);
                    dot = fmaf(qg[c + 4], att_bf_lo(u.z), dot);
                    dot = fmaf(qg[c + 5], att_bf_hi(u.z), dot);
                    dot = fmaf(qg[c + 6], att_bf_lo(u.w), dot);
                    dot = fmaf(qg[c + 7], att_bf_hi(u.w), dot);
                }
            } else {
                for (int i = 0; i < d; i++) dot = fmaf(qg[i], bf2f(kr[i]), dot);
            }
            sS[it] = __fmul_rn(dot, scale);
        }
        __syncthreads();

        // Online softmax, one warp per head: the tile's max and sum by fixed
        // shuffle trees; scores become exp(score - running max).
        for (int g = warp; g < group; g += nwarps) {
            float *sg = sS + g * ATT_G_TILE;
            float tmax = -inf_f32();
            for (int j = lane; j < n; j += 32) tmax = fmaxf(tmax, sg[j]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(ATT_FULL, tmax, o));
            const float mOld = mS[g];
            const float mNew = fmaxf(mOld, tmax);
            float tsum = 0.0f;
            for (int j = lane; j < n; j += 32) {
                const float e = expf(__fsub_rn(sg[j], mNew));
                sg[j] = e;
                tsum = __fadd_rn(tsum, e);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) tsum = __fadd_rn(tsum, __shfl_xor_sync(ATT_FULL, tsum, o));
            __syncwarp(); // every lane has read mS[g] before lane 0 replaces it
            if (lane == 0) {
                const float alpha = expf(__fsub_rn(mOld, mNew)); // 0 on the first tile
                aS[g] = alpha;
                lS[g] = fmaf(lS[g], alpha, tsum);
                mS[g] = mNew;
            }
        }
        __syncthreads();

        // Weighted sum of values: output (g, i) -> one thread, positions in
        // order; V reads of a warp are consecutive elements of one row.
        for (int o = tid; o < group * d; o += blockDim.x) {
            const int g = o / d, i = o - g * d;
            const float *pg = sS + g * ATT_G_TILE;
            float acc = __fmul_rn(accS[o], aS[g]);
            for (int j = 0; j < n; j++) acc = fmaf(pg[j], bf2f(vS[j * ks + i]), acc);
            accS[o] = acc;
        }
    }
    __syncthreads();
    bf16_t *orow = out + ((size_t)row * qHeads + (size_t)kvh * group) * d;
    for (int o = tid; o < group * d; o += blockDim.x) orow[o] = f2bf(__fdiv_rn(accS[o], lS[o / d]));
}


// ---- att_tc<D, GROUP, W>: tensor cores, positions split at fixed bounds. ----
//
// The m16 rows of a warp's MMA tile are (query row, head) pairs: the GROUP
// query heads that share the KV head, for 16 / GROUP consecutive query rows
// of one sequence. Scores are q.k on BF16 MMAs (FP32 accumulation) scaled
// into the base-2 domain; probabilities enter the P.V MMA as two BF16
// terms (p = hi + lo to 16 significant bits), so the weighted sum keeps
// near-FP32 precision.
//
// The reduction tree of one query row is fixed by its position alone:
//   - chunks of ATT_CHUNK positions go through an online softmax (running
//     max, rescale) within a split of ATT_SPLIT positions, starting afresh
//     at each split;
//   - the splits of a group of ATT_GROUPLEN positions are joined in order
//     (att_join), starting from the group's first split;
//   - the groups are joined in order into the row's result, which is
//     divided by its sum and rounded to BF16.
// A row that has a single query in its tile (decode) spreads its groups
// over gridDim.z blocks (partials in the scratch buffer, joined by the
// last block to finish) and, in a 4-warp block, a group's splits over the
// warps; rows of a prefill tile, and decode rows in a 1-warp block, walk
// their splits in one warp. All follow the same tree, so a row's output
// bits do not depend on the batch, the grid, the block width or whether it
// was prefilled or decoded. A position a row must not see scores -Inf
// (probability 0, the running max and sum untouched, the rescale exactly 1),
// and cache rows past the warp's last visible position are zero-filled, so
// stale cache contents never reach a result.
constexpr int ATT_SPLITS = 4;                        // splits a group joins (the warps of a 4-warp block)
constexpr int ATT_CHUNK = 32;                         // positions a cp.async stage holds
constexpr int ATT_SPLIT = 128;                        // positions of one online softmax
constexpr int ATT_GROUPLEN = ATT_SPLITS * ATT_SPLIT;  // positions a group joins
constexpr float ATT_LOG2E = 1.4426950408889634f;

template <int D>
struct AttTC {
    static_assert(D % 16 == 0 && D >= 16 && D <= 128, "head dim");
    static constexpr int KS = D / 16;                    // k16 steps of q.k
    static constexpr int NT = D / 8;                     // n8 tiles of the output
    static constexpr int LD = D + 8;                     // shared row stride (elements): conflict-free ldmatrix
    static constexpr int UPR = D / 8;                    // 16-byte units a row
    static constexpr int UNITS = ATT_CHUNK * UPR / 32;   // units of K (and of V) a lane copies per chunk
    static constexpr int STAGE = 2 * ATT_CHUNK * LD;     // elements of a stage: K rows, then V rows
    static constexpr int ACC = NT * 4;                   // accumulator floats a lane holds
    static constexpr int AREA = 32 * ACC;                // floats of a warp tile's accumulators (16 x D)
    static constexpr int ENTRY = AREA + 32;              // floats of a scratch partial: acc, m[16], l[16]
    // Shared memory of a block of W warps: each warp's two stages, two
    // accumulator areas per warp, the warps' per-row maxima and sums, the
    // last-block flag.
    template <int W>
    __host__ __device__ static constexpr int smem() { return W * 2 * STAGE * 2 + W * 2 * AREA * 4 + 2 * W * 16 * 4 + 16; }
};

__device__ __forceinline__ float att_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void att_ldsm4(unsigned b[4], const bf16_t *p) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(s));
}

__device__ __forceinline__ void att_ldsm4t(unsigned b[4], const bf16_t *p) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(s));
}

// att_bf2 rounds a (low half) and b (high half) to a BF16 pair, each as
// f2bf does (one packed conversion).
__device__ __forceinline__ unsigned att_bf2(float a, float b) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// att_hilo splits probabilities a (low half) and b into BF16 pairs hi and
// lo with a ~ hi + lo (the first term rounded, the second the rounded rest).
__device__ __forceinline__ void att_hilo(float a, float b, unsigned &hi, unsigned &lo) {
    hi = att_bf2(a, b);
    lo = att_bf2(__fsub_rn(a, __uint_as_float(hi << 16)), __fsub_rn(b, __uint_as_float(hi & 0xffff0000u)));
}

// AttMix is how a partial S (max sm) joins a partial G (max gm): keep G
// (S is empty), take S (G is empty), or rescale both to the larger max.
struct AttMix {
    int how;
    float ca, cb, m;
};

__device__ __forceinline__ AttMix att_mix(float gm, float sm) {
    AttMix x;
    x.ca = 1.0f;
    x.cb = 1.0f;
    if (sm == -inf_f32()) {
        x.how = 0;
        x.m = gm;
    } else if (gm == -inf_f32()) {
        x.how = 1;
        x.m = sm;
    } else {
        x.how = 2;
        x.m = fmaxf(gm, sm);
        if (gm != x.m) x.ca = att_ex2(__fsub_rn(gm, x.m));
        if (sm != x.m) x.cb = att_ex2(__fsub_rn(sm, x.m));
    }
    return x;
}

__device__ __forceinline__ float att_join(const AttMix &x, float g, float s) {
    return x.how == 0 ? g : x.how == 1 ? s : __fadd_rn(__fmul_rn(g, x.ca), __fmul_rn(s, x.cb));
}

// att_row is the m16 row of accumulator element idx of an area (element
// e = idx / 32 of lane idx % 32: n8 tile e / 4, fragment slot e % 4).
__device__ __forceinline__ int att_row(int idx) { return ((idx & 31) >> 2) + ((idx >> 5) & 2 ? 8 : 0); }
// att_col is its column (head dimension).
__device__ __forceinline__ int att_col(int idx) { return 8 * (idx >> 7) + 2 * (idx & 3) + ((idx >> 5) & 1); }

// AttSplit is one warp's online softmax over a split: per lane the maxima
// and sums of its rows lane/4 (A) and lane/4 + 8 (B), and its accumulators.
template <int D>
struct AttSplit {
    float mA, mB, lA, lB;
    float acc[D / 8][4];
    __device__ __forceinline__ void reset() {
        mA = mB = -inf_f32();
        lA = lB = 0.0f;
#pragma unroll
        for (int n = 0; n < D / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    }
};

// AttWalk is a warp's joins as it walks its rows' splits in order: each
// split into the group partial G (maxima gm, sums gl), each finished group
// into the total Tt (tm, tl); G and Tt are shared-memory areas whose
// element idx = e * 32 + lane the lane owns. Every walk joins through it,
// so every walk adds in the same order with the same operations.
template <int D>
struct AttWalk {
    float gmA, gmB, glA, glB, tmA, tmB, tlA, tlB;
    // start empties the total; group empties G (a group starts empty).
    __device__ __forceinline__ void start(float *Tt, int lane) {
        tmA = tmB = -inf_f32();
        tlA = tlB = 0.0f;
        for (int e = 0; e < AttTC<D>::ACC; e++) Tt[e * 32 + lane] = 0.0f;
    }
    __device__ __forceinline__ void group(float *G, int lane) {
        gmA = gmB = -inf_f32();
        glA = glB = 0.0f;
        for (int e = 0; e < AttTC<D>::ACC; e++) G[e * 32 + lane] = 0.0f;
    }
    // split joins a finished split s into G.
    __device__ __forceinline__ void split(float *G, const AttSplit<D> &s, int lane) {
        const AttMix xA = att_mix(gmA, s.mA), xB = att_mix(gmB, s.mB);
#pragma unroll
        for (int n = 0; n < AttTC<D>::NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int idx = (n * 4 + c) * 32 + lane;
                G[idx] = att_join(c < 2 ? xA : xB, G[idx], s.acc[n][c]);
            }
        glA = att_join(xA, glA, s.lA);
        glB = att_join(xB, glB, s.lB);
        gmA = xA.m;
        gmB = xB.m;
    }
    // finish hands store each element of Tt that belongs to one of the
    // warp's wrows query rows (j: the lane's row of A or B), with its sum.
    template <class Store>
    __device__ __forceinline__ void finish(const float *Tt, int jA, int jB, int wrows, int lane, Store store) const {
        for (int e = 0; e < AttTC<D>::ACC; e++) {
            const int idx = e * 32 + lane;
            const bool b = (e & 2) != 0;
            const int j = b ? jB : jA;
            if (j < wrows) store(idx, Tt[idx], b ? tlB : tlA, j);
        }
    }
    // total joins the finished group G into Tt.
    __device__ __forceinline__ void total(float *Tt, const float *G, int lane) {
        const AttMix yA = att_mix(tmA, gmA), yB = att_mix(tmB, gmB);
        for (int e = 0; e < AttTC<D>::ACC; e++) {
            const int idx = e * 32 + lane;
            Tt[idx] = att_join((e & 2) ? yB : yA, Tt[idx], G[idx]);
        }
        tlA = att_join(yA, tlA, glA);
        tlB = att_join(yB, tlB, glB);
        tmA = yA.m;
        tmB = yB.m;
    }
};

// AttKV is where a warp's K and V rows come from.
struct AttKV {
    const bf16_t *ck, *cv;
    const int *pt; // the sequence's page-table row
    int pageSize, kvHeads, kvh;
};

// att_row_off is the element offset of position p's K (and V) row of the
// KV head, or -1 from position limit on.
template <int D>
__device__ __forceinline__ long long att_row_off(const AttKV &kv, int p, int limit) {
    if (p >= limit) return -1;
    const int page = p / kv.pageSize;
    const long long slot = (long long)kv.pt[page] * kv.pageSize + (p - page * kv.pageSize);
    return (slot * kv.kvHeads + kv.kvh) * D;
}

// att_load copies the chunk of positions c0 .. c0 + ATT_CHUNK - 1 into a
// stage (zeros from position limit on) and commits it as one group. Lane l
// looks up position c0 + l's row once; the lanes that copy a row's 16-byte
// units take its offset from that lane.
template <int D>
__device__ __forceinline__ void att_load(bf16_t *stage, const AttKV &kv, int c0, int limit, int lane) {
    typedef AttTC<D> T;
    static_assert(ATT_CHUNK == 32, "a lane per position");
    const long long mine = att_row_off<D>(kv, c0 + lane, limit);
#pragma unroll
    for (int i = 0; i < T::UNITS; i++) {
        const int u = lane + 32 * i, pi = u / T::UPR, part = u % T::UPR;
        const long long row = __shfl_sync(ATT_FULL, mine, pi);
        const bool ok = row >= 0;
        const long long off = ok ? row + part * 8 : 0;
        cp_async(stage + pi * T::LD + part * 8, kv.ck + off, 16, ok);
        cp_async(stage + (ATT_CHUNK + pi) * T::LD + part * 8, kv.cv + off, 16, ok);
    }
    cp_async_commit();
}

// att_load_rows copies this warp's rows of the chunk of positions c0 ..
// c0 + ATT_CHUNK - 1 into a stage the block's ATT_SPLITS warps share
// (warp w rows ATT_CHUNK / ATT_SPLITS * w ..), zeros from position limit
// on, and commits them as one group.
template <int D>
__device__ __forceinline__ void att_load_rows(bf16_t *stage, const AttKV &kv, int c0, int limit, int warp, int lane) {
    typedef AttTC<D> T;
    constexpr int RW = ATT_CHUNK / ATT_SPLITS, UNITS = RW * T::UPR; // rows and 16-byte units a warp
    const int r0 = RW * warp;
    const long long mine = att_row_off<D>(kv, c0 + r0 + lane % RW, limit);
#pragma unroll
    for (int u0 = 0; u0 < UNITS; u0 += 32) {
        const int u = u0 + lane, pi = min(u / T::UPR, RW - 1), part = u % T::UPR;
        const long long row = __shfl_sync(ATT_FULL, mine, pi);
        if (UNITS % 32 == 0 || u < UNITS) {
            const bool ok = row >= 0;
            const long long off = ok ? row + part * 8 : 0;
            cp_async(stage + (r0 + pi) * T::LD + part * 8, kv.ck + off, 16, ok);
            cp_async(stage + (ATT_CHUNK + r0 + pi) * T::LD + part * 8, kv.cv + off, 16, ok);
        }
    }
    cp_async_commit();
}

// att_chunk folds one staged chunk (positions c0 ..) into the split: rows A
// and B see positions below cntA and cntB; V rows from position vlim on
// are taken as zeros whatever the stage holds (as att_load zero-fills
// them).
template <int D>
__device__ __forceinline__ void att_chunk(AttSplit<D> &s, const unsigned (&qf)[D / 16][4], const bf16_t *stage, int c0, int cntA,
                                          int cntB, float scale2, int lane, int vlim) {
    typedef AttTC<D> T;
    float sc[4][4];
#pragma unroll
    for (int n = 0; n < 4; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < T::KS; ks++) {
#pragma unroll
        for (int n = 0; n < 4; n += 2) {
            unsigned b[4];
            att_ldsm4(b, stage + (8 * (n + (lane >> 4)) + (lane & 7)) * T::LD + ks * 16 + ((lane >> 3) & 1) * 8);
            mma16816(sc[n], qf[ks], b[0], b[1]);
            mma16816(sc[n + 1], qf[ks], b[2], b[3]);
        }
    }
    const int lc = 2 * (lane & 3), cA = cntA - c0, cB = cntB - c0;
    float mxA = -inf_f32(), mxB = -inf_f32();
#pragma unroll
    for (int n = 0; n < 4; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int j = 8 * n + lc + e;
            sc[n][e] = j < cA ? __fmul_rn(sc[n][e], scale2) : -inf_f32();
            sc[n][2 + e] = j < cB ? __fmul_rn(sc[n][2 + e], scale2) : -inf_f32();
            mxA = fmaxf(mxA, sc[n][e]);
            mxB = fmaxf(mxB, sc[n][2 + e]);
        }
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        mxA = fmaxf(mxA, __shfl_xor_sync(ATT_FULL, mxA, o));
        mxB = fmaxf(mxB, __shfl_xor_sync(ATT_FULL, mxB, o));
    }
    const float nA = fmaxf(s.mA, mxA), nB = fmaxf(s.mB, mxB);
    const bool deadA = nA == -inf_f32(), deadB = nB == -inf_f32();
    const float aA = nA == s.mA ? 1.0f : att_ex2(__fsub_rn(s.mA, nA));
    const float aB = nB == s.mB ? 1.0f : att_ex2(__fsub_rn(s.mB, nB));
    float sumA = 0.0f, sumB = 0.0f;
#pragma unroll
    for (int n = 0; n < 4; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            sc[n][e] = deadA ? 0.0f : att_ex2(__fsub_rn(sc[n][e], nA));
            sc[n][2 + e] = deadB ? 0.0f : att_ex2(__fsub_rn(sc[n][2 + e], nB));
            sumA = __fadd_rn(sumA, sc[n][e]);
            sumB = __fadd_rn(sumB, sc[n][2 + e]);
        }
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        sumA = __fadd_rn(sumA, __shfl_xor_sync(ATT_FULL, sumA, o));
        sumB = __fadd_rn(sumB, __shfl_xor_sync(ATT_FULL, sumB, o));
    }
    s.lA = __fadd_rn(__fmul_rn(s.lA, aA), sumA);
    s.lB = __fadd_rn(__fmul_rn(s.lB, aB), sumB);
    s.mA = nA;
    s.mB = nB;
    // A rescale of exactly 1 changes nothing (a NaN stays NaN and becomes
    // the same BF16 NaN), so a warp skips it when no row's maximum moved.
    if (__any_sync(ATT_FULL, aA != 1.0f || aB != 1.0f)) {
#pragma unroll
        for (int n = 0; n < T::NT; n++) {
            s.acc[n][0] = __fmul_rn(s.acc[n][0], aA);
            s.acc[n][1] = __fmul_rn(s.acc[n][1], aA);
            s.acc[n][2] = __fmul_rn(s.acc[n][2], aB);
            s.acc[n][3] = __fmul_rn(s.acc[n][3], aB);
        }
    }
    const bf16_t *vs = stage + ATT_CHUNK * T::LD;
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        unsigned ah[4], al[4];
        att_hilo(sc[2 * kk][0], sc[2 * kk][1], ah[0], al[0]);
        att_hilo(sc[2 * kk][2], sc[2 * kk][3], ah[1], al[1]);
        att_hilo(sc[2 * kk + 1][0], sc[2 * kk + 1][1], ah[2], al[2]);
        att_hilo(sc[2 * kk + 1][2], sc[2 * kk + 1][3], ah[3], al[3]);
        // A lane's B words hold positions p, p + 1 (b[0], b[2]) and p + 8,
        // p + 9 (b[1], b[3]), p = c0 + 16 kk + 2 (lane % 4).
        unsigned m0 = ~0u, m1 = ~0u;
        if (c0 + ATT_CHUNK > vlim) {
            const int p = c0 + 16 * kk + 2 * (lane & 3);
            m0 = (p < vlim ? 0xffffu : 0u) | (p + 1 < vlim ? 0xffff0000u : 0u);
            m1 = (p + 8 < vlim ? 0xffffu : 0u) | (p + 9 < vlim ? 0xffff0000u : 0u);
        }
#pragma unroll
        for (int n = 0; n < T::NT; n += 2) {
            unsigned b[4];
            att_ldsm4t(b, vs + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * T::LD + 8 * (n + (lane >> 4)));
            b[0] &= m0;
            b[1] &= m1;
            b[2] &= m0;
            b[3] &= m1;
            mma16816(s.acc[n], ah, b[0], b[1]);
            mma16816(s.acc[n], al, b[0], b[1]);
            mma16816(s.acc[n + 1], ah, b[2], b[3]);
            mma16816(s.acc[n + 1], al, b[2], b[3]);
        }
    }
}

// att_split runs the online softmax over positions s0 .. s1 - 1 (one
// split; s1 <= the warp's limit). The chunk at s0 must already be issued
// into stage `stage` of bufs; after the split's last chunk the one at
// `next` (>= 0) is issued, so the walk over several splits stays
// pipelined.
template <int D>
__device__ __forceinline__ void att_split(AttSplit<D> &s, const unsigned (&qf)[D / 16][4], bf16_t *bufs, int &stage, const AttKV &kv,
                                          int s0, int s1, int next, int limit, int cntA, int cntB, float scale2, int lane) {
    typedef AttTC<D> T;
    s.reset();
    for (int c0 = s0; c0 < s1; c0 += ATT_CHUNK) {
        const int nc = c0 + ATT_CHUNK < s1 ? c0 + ATT_CHUNK : next;
        if (nc >= 0) att_load<D>(bufs + (stage ^ 1) * T::STAGE, kv, nc, limit, lane);
        else cp_async_commit(); // an empty group keeps the wait count
        cp_async_wait<1>();
        __syncwarp();
        att_chunk<D>(s, qf, bufs + stage * T::STAGE, c0, cntA, cntB, scale2, lane, 0x7fffffff);
        __syncwarp(); // every lane is done with the stage before it is refilled
        stage ^= 1;
    }
}

// counter_of is the (sequence, KV head) counter at the front of scratch.
__device__ __forceinline__ int *counter_of(float *scratch, int i) { return reinterpret_cast<int *>(scratch) + i; }

// att_idle tells a block with blockIdx.z > 0 that it has no work, before
// the checks of att_locate: only a one-row tile (the row starts a tile of
// rpb rows and is its sequence's last query row) spreads over z, and only
// over the groups of 512 positions its sequence has. The grid is sized for
// the longest sequence the cache allows, so at short contexts most blocks
// leave here. Inputs that att_locate would refuse may read either way:
// block z = 0 checks and reports them, and nothing is written for the row.
__device__ __forceinline__ bool att_idle(const int *seqLens, const int *queryStart, int nseq, int rpb) {
    const int row = blockIdx.x;
    const int seq = att_seq_of(queryStart, nseq, row);
    if (seq < 0 || seq >= nseq) return true;
    const int local = row - queryStart[seq], nq = queryStart[seq + 1] - queryStart[seq];
    if (local % rpb != 0 || nq - local != 1) return true;
    return (long long)blockIdx.z * ATT_GROUPLEN >= (long long)seqLens[seq];
}

// att_tc: grid (query rows, KV heads, z), blocks of W warps (4 or 1). A
// block whose row starts a tile of its sequence (16 / GROUP rows a warp, W
// warps) serves the tile; other blocks exit. A one-row tile spreads its
// groups over the gridDim.z blocks of its row: with gridDim.z > 1 each
// group's partial goes to scratch (per sequence and KV head: a counter at
// the front, then maxGroups entries of AttTC<D>::ENTRY floats) and the last
// block joins them; with gridDim.z == 1 the block joins them itself and
// scratch may be null. For a one-row tile a 4-warp block runs a group's
// four splits on its four warps at once; a 1-warp block walks them in
// order. A prefill tile's warps each walk their own rows' splits in order,
// in a 4-warp block over stages the warps share. Either way a group's
// splits are joined in split order and the groups in group order, by the
// same operations, so W changes no bit: the host takes 4 warps when a
// launch has few rows (a row's positions spread widest) or mostly prefill
// rows, and 1 when it has many decode rows (four blocks a multiprocessor,
// no warp idle while another walks).
template <int D, int GROUP, int W>
__global__ void __launch_bounds__(W * 32, 1)
att_tc(int *err, bf16_t *out, const bf16_t *q, const bf16_t *ck, const bf16_t *cv, const int *pageTable, const int *seqLens,
       const int *queryStart, float *scratch, int tq, int qHeads, int kvHeads, int pageSize, int pages, int nseq, int maxPages,
       int maxGroups, float scale) {
    typedef AttTC<D> T;
    static_assert(16 % GROUP == 0, "group");
    static_assert(W == 1 || W == ATT_SPLITS, "block width");
    constexpr int RPW = 16 / GROUP; // query rows a warp holds
    constexpr int RPB = W * RPW;    // query rows a tile holds
    if (blockIdx.z > 0 && att_idle(seqLens, queryStart, nseq, RPB)) return;
    AttRow r;
    if (!att_locate(err, pageTable, seqLens, queryStart, tq, pageSize, pages, nseq, maxPages, r)) return;
    const int kvh = blockIdx.y, z = blockIdx.z, nz = gridDim.z;
    const int local = blockIdx.x - r.q0;
    if (local % RPB != 0) return; // not the first row of a tile
    const int nrows = min(RPB, r.nq - local);
    const bool split = nrows == 1;
    if (!split && z != 0) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int first = r.len - r.nq + local; // the tile's first row sees positions 0 .. first

    extern __shared__ float4 att_smem[];
    bf16_t *bufs = reinterpret_cast<bf16_t *>(att_smem) + warp * 2 * T::STAGE;
    float *areas = reinterpret_cast<float *>(reinterpret_cast<bf16_t *>(att_smem) + W * 2 * T::STAGE);
    float *mS = areas + W * 2 * T::AREA, *lS = mS + W * 16;
    int *lastS = reinterpret_cast<int *>(lS + W * 16);

    // The warp's rows: its query rows wbase .. wbase + wrows - 1 of the
    // tile; a lane holds m16 rows lr (A) and lr + 8 (B), row m being query
    // row m / GROUP and head m % GROUP.
    const int wbase = split ? 0 : warp * RPW;
    const int wrows = split ? 1 : max(0, min(RPW, nrows - wbase));
    const int lr = lane >> 2, lc = 2 * (lane & 3);
    const int jA = lr / GROUP, jB = (lr + 8) / GROUP;
    const int cntA = jA < wrows ? first + wbase + jA + 1 : 0;
    const int cntB = jB < wrows ? first + wbase + jB + 1 : 0;
    const int limit = wrows > 0 ? first + wbase + wrows : 0; // positions the warp's last row sees
    const float scale2 = __fmul_rn(scale, ATT_LOG2E);
    const AttKV kv{ck, cv, pageTable + (size_t)r.seq * maxPages, pageSize, kvHeads, kvh};

    unsigned qf[T::KS][4];
    {
        const bf16_t *qa = q + ((size_t)(r.q0 + local + wbase + jA) * qHeads + kvh * GROUP + lr % GROUP) * D + lc;
        const bf16_t *qb = q + ((size_t)(r.q0 + local + wbase + jB) * qHeads + kvh * GROUP + (lr + 8) % GROUP) * D + lc;
#pragma unroll
        for (int ks = 0; ks < T::KS; ks++) {
            qf[ks][0] = cntA ? *reinterpret_cast<const unsigned *>(qa + ks * 16) : 0u;
            qf[ks][1] = cntB ? *reinterpret_cast<const unsigned *>(qb + ks * 16) : 0u;
            qf[ks][2] = cntA ? *reinterpret_cast<const unsigned *>(qa + ks * 16 + 8) : 0u;
            qf[ks][3] = cntB ? *reinterpret_cast<const unsigned *>(qb + ks * 16 + 8) : 0u;
        }
    }

    // out writes element idx of a finished accumulator area of the warp's
    // rows (acc / sum, BF16).
    auto store = [&](int idx, float acc, float sum, int j) {
        const int m = att_row(idx);
        const size_t orow = (size_t)(r.q0 + local + wbase + j) * qHeads + kvh * GROUP + m % GROUP;
        out[orow * D + att_col(idx)] = f2bf(__fdiv_rn(acc, sum));
    };
    float *entries = scratch + ((nseq * kvHeads + 3) & ~3);
    const size_t entry0 = (size_t)(r.seq * kvHeads + kvh) * maxGroups;

    if (!split && W == ATT_SPLITS) {
        // A prefill tile in a 4-warp block: the warps walk the positions
        // the tile's last row sees together, chunk after chunk, through
        // two stages of the block that each warp fills a quarter of
        // (att_load_rows). A warp folds a chunk only below its own rows'
        // limit, reading cache rows past it as zeros, so it runs the
        // operations of the walk below on the same values: the same bits,
        // from a quarter of the cache reads.
        const int blimit = first + nrows;
        bf16_t *sbuf = reinterpret_cast<bf16_t *>(att_smem);
        float *G = areas + (warp * 2) * T::AREA, *Tt = G + T::AREA;
        AttWalk<D> wk;
        wk.start(Tt, lane);
        AttSplit<D> s;
        int stage = 0;
        att_load_rows<D>(sbuf, kv, 0, blimit, warp, lane);
        for (int c0 = 0; c0 < blimit; c0 += ATT_CHUNK) {
            const int nc = c0 + ATT_CHUNK;
            if (nc < blimit) att_load_rows<D>(sbuf + (stage ^ 1) * T::STAGE, kv, nc, blimit, warp, lane);
            else cp_async_commit(); // an empty group keeps the wait count
            cp_async_wait<1>();
            __syncthreads(); // every warp's rows of chunk c0 have landed
            if (c0 < limit) {
                if (c0 % ATT_SPLIT == 0) {
                    s.reset();
                    if (c0 % ATT_GROUPLEN == 0) wk.group(G, lane);
                }
                att_chunk<D>(s, qf, sbuf + stage * T::STAGE, c0, cntA, cntB, scale2, lane, limit);
                if (nc % ATT_SPLIT == 0 || nc >= limit) { // the split ends
                    wk.split(G, s, lane);
                    if (nc % ATT_GROUPLEN == 0 || nc >= limit) wk.total(Tt, G, lane); // the group ends
                }
            }
            __syncthreads(); // every warp is done with the stage before it is refilled
            stage ^= 1;
        }
        wk.finish(Tt, jA, jB, wrows, lane, store);
        return;
    }
    if (!split || W == 1) {
        // The warp walks its splits in order: all of a prefill tile's, or
        // a one-row tile's groups z, z + nz, ... . It joins them into its
        // group partial G and the groups into its total Tt (both in shared
        // memory, each element owned by its lane), or, for a one-row tile
        // spread over several blocks, writes each group's partial to
        // scratch for the last block to join.
        if (wrows == 0) return;
        const int ngroups = (limit + ATT_GROUPLEN - 1) / ATT_GROUPLEN;
        const int g0 = split ? z : 0, gstep = split ? nz : 1;
        if (g0 >= ngroups) return;
        // Only blocks z < ngroups have work: where that is one block, it
        // joins its groups itself (the same operations as through scratch).
        const bool spread = split && min(nz, ngroups) > 1;
        // G and Tt start at zero, as the 4-warp block's registers do: a
        // row whose partial is empty keeps them.
        float *G = areas + (warp * 2) * T::AREA, *Tt = G + T::AREA;
        AttWalk<D> wk;
        wk.start(Tt, lane);
        int stage = 0;
        att_load<D>(bufs, kv, g0 * ATT_GROUPLEN, limit, lane);
        AttSplit<D> s;
        for (int g = g0; g < ngroups; g += gstep) {
            wk.group(G, lane);
            for (int k = 0; k < ATT_SPLITS; k++) {
                const int s0 = (g * ATT_SPLITS + k) * ATT_SPLIT;
                if (s0 >= limit) break;
                const int s1 = min(s0 + ATT_SPLIT, limit);
                const int ng = (g + gstep) * ATT_GROUPLEN;
                const int next = k + 1 < ATT_SPLITS && s1 < limit ? s1 : ng < limit ? ng : -1;
                att_split<D>(s, qf, bufs, stage, kv, s0, s1, next, limit, cntA, cntB, scale2, lane);
                wk.split(G, s, lane);
            }
            if (spread) {
                float *ent = entries + (entry0 + g) * T::ENTRY;
                for (int e = 0; e < T::ACC; e++) ent[e * 32 + lane] = G[e * 32 + lane];
                if ((lane & 3) == 0) {
                    ent[T::AREA + lr] = wk.gmA;
                    ent[T::AREA + lr + 8] = wk.gmB;
                    ent[T::AREA + 16 + lr] = wk.glA;
                    ent[T::AREA + 16 + lr + 8] = wk.glB;
                }
                continue;
            }
            wk.total(Tt, G, lane);
        }
        if (spread) {
            // The last of the row's blocks to finish joins every group
            // into Tt, element by element, as the 4-warp block does.
            __threadfence();
            __syncwarp();
            int last = 0;
            if (lane == 0) last = atomicAdd(counter_of(scratch, r.seq * kvHeads + kvh), 1) == min(nz, ngroups) - 1;
            if (!__shfl_sync(ATT_FULL, last, 0)) return;
            __threadfence();
            float tacc[T::ACC];
#pragma unroll
            for (int e = 0; e < T::ACC; e++) tacc[e] = 0.0f;
#pragma unroll 2
            for (int g = 0; g < ngroups; g++) {
                const float *ent = entries + (entry0 + g) * T::ENTRY;
                const AttMix yA = att_mix(wk.tmA, __ldcg(ent + T::AREA + lr)), yB = att_mix(wk.tmB, __ldcg(ent + T::AREA + lr + 8));
#pragma unroll
                for (int e = 0; e < T::ACC; e++) tacc[e] = att_join((e & 2) ? yB : yA, tacc[e], __ldcg(ent + e * 32 + lane));
                wk.tlA = att_join(yA, wk.tlA, __ldcg(ent + T::AREA + 16 + lr));
                wk.tlB = att_join(yB, wk.tlB, __ldcg(ent + T::AREA + 16 + lr + 8));
                wk.tmA = yA.m;
                wk.tmB = yB.m;
            }
            if (lane == 0) *counter_of(scratch, r.seq * kvHeads + kvh) = 0; // ready for the next launch
#pragma unroll
            for (int e = 0; e < T::ACC; e++) Tt[e * 32 + lane] = tacc[e];
        }
        wk.finish(Tt, jA, jB, wrows, lane, store);
        return;
    }

    // A one-row tile in a 4-warp block: warp w takes split 4g + w of each
    // group g of this block (g = z, z + nz, ...), prefetching its next
    // split's first chunk across groups. Thread tid owns accumulator
    // elements tid + 128 i of the tile, all of one m16 row, and joins them
    // in registers.
    constexpr int PER = T::AREA / (W * 32);
    const int ngroups = (limit + ATT_GROUPLEN - 1) / ATT_GROUPLEN;
    if (z >= ngroups) return;
    const bool spread = min(nz, ngroups) > 1; // else this block joins every group itself
    const int myRow = att_row(tid);
    const bool rowWriter = (lane & 3) == 0 && (warp & 1) == 0; // one thread a row
    float *A = areas + (warp * 2) * T::AREA;
    float tacc[PER], tm = -inf_f32(), tl = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++) tacc[i] = 0.0f;
    int stage = 0;
    if ((z * ATT_SPLITS + warp) * ATT_SPLIT < limit) att_load<D>(bufs, kv, (z * ATT_SPLITS + warp) * ATT_SPLIT, limit, lane);
    for (int g = z; g < ngroups; g += nz) {
        AttSplit<D> s;
        const int s0 = (g * ATT_SPLITS + warp) * ATT_SPLIT, n0 = ((g + nz) * ATT_SPLITS + warp) * ATT_SPLIT;
        if (s0 < limit)
            att_split<D>(s, qf, bufs, stage, kv, s0, min(s0 + ATT_SPLIT, limit), n0 < limit ? n0 : -1, limit, cntA, cntB, scale2, lane);
        else
            s.reset();
#pragma unroll
        for (int n = 0; n < T::NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) A[(n * 4 + c) * 32 + lane] = s.acc[n][c];
        if ((lane & 3) == 0) {
            mS[warp * 16 + lr] = s.mA;
            lS[warp * 16 + lr] = s.lA;
            mS[warp * 16 + lr + 8] = s.mB;
            lS[warp * 16 + lr + 8] = s.lB;
        }
        __syncthreads();
        // The group's partial: its splits joined in order.
        float gv[PER], gm = -inf_f32(), gl = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; i++) gv[i] = 0.0f;
        for (int w = 0; w < ATT_SPLITS; w++) {
            const AttMix x = att_mix(gm, mS[w * 16 + myRow]);
#pragma unroll
            for (int i = 0; i < PER; i++) gv[i] = att_join(x, gv[i], areas[(w * 2) * T::AREA + tid + 128 * i]);
            gl = att_join(x, gl, lS[w * 16 + myRow]);
            gm = x.m;
        }
        __syncthreads(); // the areas are free for the next group
        if (!spread) {
            const AttMix x = att_mix(tm, gm);
#pragma unroll
            for (int i = 0; i < PER; i++) tacc[i] = att_join(x, tacc[i], gv[i]);
            tl = att_join(x, tl, gl);
            tm = x.m;
        } else {
            float *ent = entries + (entry0 + g) * T::ENTRY;
#pragma unroll
            for (int i = 0; i < PER; i++) ent[tid + 128 * i] = gv[i];
            if (rowWriter) {
                ent[T::AREA + myRow] = gm;
                ent[T::AREA + 16 + myRow] = gl;
            }
        }
    }
    if (spread) {
        // The last of the row's blocks to finish joins every group.
        __threadfence();
        __syncthreads();
        if (tid == 0) *lastS = atomicAdd(counter_of(scratch, r.seq * kvHeads + kvh), 1) == min(nz, ngroups) - 1;
        __syncthreads();
        if (!*lastS) return;
        __threadfence();
#pragma unroll 4
        for (int g = 0; g < ngroups; g++) {
            const float *ent = entries + (entry0 + g) * T::ENTRY;
            const AttMix x = att_mix(tm, __ldcg(ent + T::AREA + myRow));
#pragma unroll
            for (int i = 0; i < PER; i++) tacc[i] = att_join(x, tacc[i], __ldcg(ent + tid + 128 * i));
            tl = att_join(x, tl, __ldcg(ent + T::AREA + 16 + myRow));
            tm = x.m;
        }
        if (tid == 0) *counter_of(scratch, r.seq * kvHeads + kvh) = 0; // ready for the next launch
    }
    if (myRow < GROUP) {
#pragma unroll
        for (int i = 0; i < PER; i++) store(tid + 128 * i, tacc[i], tl, 0);
    }
}

} // namespace rw
