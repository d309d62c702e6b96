// Compile unit: the MoE layer's dispatch and finalize: the router (top-k
// over scores, in registers or shared memory), the stable counting sort by
// expert (permute), the fused one-launch dispatch for small batches, the
// weighted finalize and the atomic finalize's last step.
#include "numerics.cuh"
#include "reduce.cuh"
#include "ptx.cuh"
#include "errors.cuh"
#include "quant.cuh"

namespace rw {

// ---- Route ----

// route_key orders scores as unsigned integers: numbers by value (-0 as
// +0), NaN below all of them; equal keys go to the lower expert id.
__device__ __forceinline__ unsigned route_key(float v) {
    const unsigned b = __float_as_uint(v == 0.f ? 0.f : v);
    if (v != v) return 0;
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

// route_best returns the key of the best untaken score among a lane's
// experts and its id in *bi (-1: none left; ties to the lower id).
__device__ __forceinline__ unsigned route_best(const float *s, const unsigned char *taken, int E, int lane, int *bi) {
    unsigned bk = 0;
    *bi = -1;
    for (int i = lane; i < E; i += 32)
        if (!taken[i]) {
            const unsigned k = route_key(s[i]);
            if (*bi < 0 || k > bk) {
                bk = k;
                *bi = i;
            }
        }
    return bk;
}

// route: one warp per token. Scores in shared memory; top-k by repeated
// argmax (ties to the lower id, NaN below every number).
__global__ void route(const float *logits, int *ids, float *weights, int T, int E, int K, int scoring,
                                 int renorm, float scale) {
    extern __shared__ unsigned char route_smem[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x * (blockDim.x >> 5) + warp;
    const int warps = blockDim.x >> 5;
    float *s = reinterpret_cast<float *>(route_smem) + warp * E;
    float *sel = reinterpret_cast<float *>(route_smem) + warps * E + warp * K; // the chosen scores, in order
    unsigned char *taken = route_smem + warps * (E + K) * 4 + warp * E;
    if (t >= T) return;
    const float *l = logits + (long long)t * E;
    if (scoring == 1) { // softmax
        float m = -inf_f32();
        for (int i = lane; i < E; i += 32) m = fmaxf(m, l[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float sum = 0.f;
        for (int i = lane; i < E; i += 32) {
            float e = expf(__fsub_rn(l[i], m));
            s[i] = e;
            sum = __fadd_rn(sum, e);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
        for (int i = lane; i < E; i += 32) s[i] = __fdiv_rn(s[i], sum);
    } else { // sigmoid
        for (int i = lane; i < E; i += 32) s[i] = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-l[i])));
    }
    for (int i = lane; i < E; i += 32) taken[i] = 0;
    __syncwarp();
    // Each lane keeps the best of its own experts (lane, lane+32, ...); a
    // round takes the warp's best by two reductions, on an order-preserving
    // key (NaN lowest) and then on the id among equal keys, and only the
    // winning lane looks for its next best.
    int bi;
    unsigned bk = route_best(s, taken, E, lane, &bi);
    for (int j = 0; j < K; j++) {
        const unsigned kmax = __reduce_max_sync(0xffffffffu, bk);
        const int win = (int)__reduce_min_sync(0xffffffffu, bi >= 0 && bk == kmax ? (unsigned)bi : 0xffffffffu);
        if (bi == win) {
            taken[win] = 1;
            ids[(long long)t * K + j] = win;
            sel[j] = s[win];
            bk = route_best(s, taken, E, lane, &bi);
        }
        __syncwarp();
    }
    float wsum = 0.f;
    if (renorm) { // the sum in k order, as the CPU adds it
        for (int j = 0; j < K; j++) wsum = __fadd_rn(wsum, sel[j]);
    }
    for (int j = lane; j < K; j += 32) {
        float w = sel[j];
        if (renorm && wsum != 0.f) w = __fdiv_rn(w, wsum);
        weights[(long long)t * K + j] = __fmul_rn(w, scale);
    }
}

// route_regs: route for E <= 32 * PER and K <= 32, one warp per token,
// with the scores in registers (lane l holds experts l, l + 32, ...) and
// no shared memory: the same arithmetic in the same order as route, so the
// same ids and weights. A round's winner is the lane with the best key
// (ties: the lower id); only it moves on to its next best.
template <int PER>
__device__ __forceinline__ void route_regs(const float *logits, int *ids, float *weights, int t, int E, int K, int scoring,
                                           int renorm, float scale) {
    const int lane = threadIdx.x & 31;
    const float *l = logits + (long long)t * E;
    float s[PER];
#pragma unroll
    for (int m = 0; m < PER; m++) s[m] = lane + 32 * m < E ? l[lane + 32 * m] : 0.f;
    if (scoring == 1) { // softmax
        float mx = -inf_f32();
#pragma unroll
        for (int m = 0; m < PER; m++)
            if (lane + 32 * m < E) mx = fmaxf(mx, s[m]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float sum = 0.f;
#pragma unroll
        for (int m = 0; m < PER; m++)
            if (lane + 32 * m < E) {
                s[m] = expf(__fsub_rn(s[m], mx));
                sum = __fadd_rn(sum, s[m]);
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
#pragma unroll
        for (int m = 0; m < PER; m++) s[m] = __fdiv_rn(s[m], sum);
    } else { // sigmoid
#pragma unroll
        for (int m = 0; m < PER; m++) s[m] = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-s[m])));
    }
    unsigned left = 0; // the lane's untaken experts, bit m for expert lane + 32m
#pragma unroll
    for (int m = 0; m < PER; m++)
        if (lane + 32 * m < E) left |= 1u << m;
    // best: the lane's best untaken key, its slot (-1: none) and score.
    auto best = [&](unsigned &bk, int &bm, float &bs) {
        bk = 0;
        bm = -1;
        bs = 0.f;
#pragma unroll
        for (int m = 0; m < PER; m++)
            if (left >> m & 1) {
                const unsigned k = route_key(s[m]);
                if (bm < 0 || k > bk) {
                    bk = k;
                    bm = m;
                    bs = s[m];
                }
            }
    };
    unsigned bk;
    int bm;
    float bs;
    best(bk, bm, bs);
    float mine = 0.f, wsum = 0.f; // lane j keeps the score chosen in round j
    for (int j = 0; j < K; j++) {
        const unsigned kmax = __reduce_max_sync(0xffffffffu, bk);
        const int win = (int)__reduce_min_sync(0xffffffffu, bm >= 0 && bk == kmax ? (unsigned)(lane + 32 * bm) : 0xffffffffu);
        const float ws = __shfl_sync(0xffffffffu, bs, win & 31);
        if (lane == j) mine = ws;
        wsum = __fadd_rn(wsum, ws); // the sum in k order, as the CPU adds it
        if (lane == (win & 31)) {
            ids[(long long)t * K + j] = win;
            left &= ~(1u << (win >> 5));
            best(bk, bm, bs);
        }
    }
    if (lane < K) {
        float w = mine;
        if (renorm && wsum != 0.f) w = __fdiv_rn(w, wsum);
        weights[(long long)t * K + lane] = __fmul_rn(w, scale);
    }
}

// route_r<PER>: the router with each lane's PER scores in registers (up to
// 32 * PER experts), one warp a token.
template <int PER>
__global__ void route_r(const float *logits, int *ids, float *weights, int T, int E, int K, int scoring, int renorm, float scale) {
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t < T) route_regs<PER>(logits, ids, weights, t, E, K, scoring, renorm, scale);
}

// ---- Permute ----

// permute_block (the body of permute and dispatch_r*): a stable
// counting sort of the n = T*k assignments by expert in one block of 32
// warps. Warp w owns the contiguous segment w of the
// assignments: it counts its experts (shared-memory atomics: counts are
// order-free), a column scan turns the counts into each warp's first slot
// per expert, and each warp then walks its segment in order, ranking equal
// experts within a 32-wide chunk with __match_any_sync. The result depends
// only on the ids.
__device__ __forceinline__ void permute_block(int *err, const int *ids, int *offsets, int *rows, int *slots, int n, int k, int E,
                                              int *perm_smem) {
    int *cnt = perm_smem;       // [32][E]
    int *off = perm_smem + 32 * E; // [E+1]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int seg = (n + 31) / 32;
    int lo = min(n, warp * seg), hi = min(n, lo + seg);
    for (int i = threadIdx.x; i < 32 * E; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int i = lo + lane; i < hi; i += 32) {
        int id = ids[i];
        if (id < 0 || id >= E) report(err, E_PERMUTE_EXPERT, i, id, E);
        else atomicAdd(&cnt[warp * E + id], 1);
    }
    __syncthreads();
    // Per-expert totals, then their exclusive scan by warp 0, 32 at a time.
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int tot = 0;
        for (int w = 0; w < 32; w++) tot += cnt[w * E + e];
        off[e] = tot;
    }
    __syncthreads();
    if (warp == 0) {
        int base = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            int e = e0 + lane;
            const int v = e < E ? off[e] : 0, incl = warp_scan(v);
            if (e < E) off[e] = base + incl - v;
            base += __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) off[E] = base;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int acc = off[e];
        for (int w = 0; w < 32; w++) {
            int c = cnt[w * E + e];
            cnt[w * E + e] = acc;
            acc += c;
        }
    }
    for (int e = threadIdx.x; e <= E; e += blockDim.x) offsets[e] = off[e];
    __syncthreads();
    for (int c0 = lo; c0 < hi; c0 += 32) {
        int i = c0 + lane;
        int id = i < hi ? ids[i] : -2;
        bool ok = id >= 0 && id < E;
        if (!ok) id = -1 - (i < hi); // invalid and past-the-end lanes group apart from every expert
        unsigned peers = __match_any_sync(0xffffffffu, id);
        if (ok) {
            int rank = __popc(peers & ((1u << lane) - 1));
            int r = cnt[warp * E + id] + rank;
            rows[r] = i / k;
            slots[i] = r;
        } else if (i < hi) {
            slots[i] = -1;
        }
        __syncwarp();
        if (ok && (peers & ((1u << lane) - 1)) == 0) cnt[warp * E + id] += __popc(peers);
        __syncwarp();
    }
}

// permute_small is permute_block for n <= 32 assignments (a decode step's
// few tokens), with the same results: a stable sort is unique, so an
// assignment's slot is the count of valid ids below its expert plus the
// count of equal ones before it, and offsets[e] the count of valid ids
// below e. One warp ranks (each lane one assignment, the ids in shared
// memory), then the block's threads count the offsets: two barriers
// instead of permute_block's six passes over 32 x E counts.
__device__ __forceinline__ void permute_small(int *err, const int *ids, int *offsets, int *rows, int *slots, int n, int k, int E,
                                              int *sids) {
    if (threadIdx.x < 32) {
        const int i = threadIdx.x;
        const int id = i < n ? ids[i] : -1;
        const bool ok = i < n && id >= 0 && id < E;
        if (i < n && !ok) report(err, E_PERMUTE_EXPERT, i, id, E);
        sids[i] = ok ? id : 0x7fffffff; // an invalid id is below no expert
        __syncwarp();
        if (ok) {
            int r = 0;
            for (int j = 0; j < n; j++) {
                const int o = sids[j];
                r += o < id || (o == id && j < i);
            }
            rows[r] = i / k;
            slots[i] = r;
        } else if (i < n) {
            slots[i] = -1;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
        int c = 0;
        for (int j = 0; j < n; j++) c += sids[j] < e;
        offsets[e] = c;
    }
}

__global__ void permute(int *err, const int *ids, int *offsets, int *rows, int *slots, int n, int k, int E) {
    extern __shared__ int perm_smem[];
    permute_block(err, ids, offsets, rows, slots, n, k, E, perm_smem);
}

// dispatch_r*: the MoE layer's dispatch for at most 32 tokens in one
// launch. Block 0 routes (route_r*, warp t routing token t) and sorts
// (permute_small up to 32 assignments, else permute_block in its 32
// warps), reading the ids back after the barrier
// with plain loads (the block's own writes are visible to it then); blocks
// 1..qrows quantize activation row b-1 (quant_row_block, as quant_rows:
// the row's amax is an order-free max, so the block's width changes no
// bit; qgiven, when not null, is the per_tensor recipe's S_dec). Same
// results as route_r*, permute and quant_rows.
template <int PER>
__global__ void __launch_bounds__(1024)
    dispatch_r(const float *logits, int *ids, float *weights, int T, int E, int K, int scoring, int renorm, float scale, int *err,
               int *offsets, int *rows, int *slots, const bf16_t *qsrc, unsigned char *qpacked, unsigned char *qscales,
               float *qscale, int qk, int qkp, int qvec, const float *qgiven) {
    pdl_enter();
    if (blockIdx.x > 0) {
        quant_row_block(qsrc, qpacked, qscales, qscale, blockIdx.x - 1, qk, qkp, qvec, qgiven);
        return;
    }
    extern __shared__ int perm_smem[];
    const int t = threadIdx.x >> 5;
    if (t < T) route_regs<PER>(logits, ids, weights, t, E, K, scoring, renorm, scale);
    __syncthreads();
    if (T * K <= 32) permute_small(err, ids, offsets, rows, slots, T * K, K, E, perm_smem);
    else permute_block(err, ids, offsets, rows, slots, T * K, K, E, perm_smem);
}

// ---- Finalize ----

// finalize: out[t, c] = bf16(sum_j w[t,j] * rows[slots[t*k+j], c]), each
// product rounded to FP32 and summed in j order. A bad slot skips the token.
// FIN_FASTK: finalize keeps up to this many slots a token in registers
// (top-k of 8 and below; larger k takes the loop that reloads them).
constexpr int FIN_FASTK = 8;
__global__ void finalize(int *err, bf16_t *out, const bf16_t *rows, const float *w, const int *slots, int H,
                                    int K, int R) {
    pdl_enter();
    const int t = blockIdx.x;
    if (K <= FIN_FASTK && H % 2 == 0 && ((reinterpret_cast<unsigned long long>(rows) | reinterpret_cast<unsigned long long>(out)) & 3) == 0) {
        // The token's slots and weights read once, together; then each
        // column pair's K row reads issued together (4-byte pairs: H even,
        // aligned rows), summed in j order as below: the same bits, one
        // memory round trip a pair instead of K.
        int sl[FIN_FASTK];
        float wt[FIN_FASTK];
#pragma unroll
        for (int j = 0; j < FIN_FASTK; j++) {
            sl[j] = j < K ? slots[(long long)t * K + j] : 0;
            wt[j] = j < K ? w[(long long)t * K + j] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < FIN_FASTK; j++)
            if (j < K && (sl[j] < 0 || sl[j] >= R)) {
                if (blockIdx.y == 0 && threadIdx.x == 0) report(err, E_FIN_SLOT, t * K + j, sl[j], R);
                return;
            }
        for (int c = (blockIdx.y * blockDim.x + threadIdx.x) * 2; c < H; c += gridDim.y * blockDim.x * 2) {
            unsigned v[FIN_FASTK];
#pragma unroll
            for (int j = 0; j < FIN_FASTK; j++)
                v[j] = j < K ? *reinterpret_cast<const unsigned *>(rows + (long long)sl[j] * H + c) : 0u;
            float a0 = 0.f, a1 = 0.f;
#pragma unroll
            for (int j = 0; j < FIN_FASTK; j++)
                if (j < K) {
                    a0 = __fadd_rn(a0, __fmul_rn(wt[j], __uint_as_float(v[j] << 16)));
                    a1 = __fadd_rn(a1, __fmul_rn(wt[j], __uint_as_float(v[j] & 0xffff0000u)));
                }
            *reinterpret_cast<unsigned *>(out + (long long)t * H + c) = (unsigned)f2bf(a0) | (unsigned)f2bf(a1) << 16;
        }
        return;
    }
    for (int j = 0; j < K; j++) {
        int s = slots[(long long)t * K + j];
        if (s < 0 || s >= R) {
            if (blockIdx.y == 0 && threadIdx.x == 0) report(err, E_FIN_SLOT, t * K + j, s, R);
            return;
        }
    }
    for (int c = (blockIdx.y * blockDim.x + threadIdx.x) * 2; c < H; c += gridDim.y * blockDim.x * 2) {
        float a0 = 0.f, a1 = 0.f;
        for (int j = 0; j < K; j++) {
            int s = slots[(long long)t * K + j];
            float wj = w[(long long)t * K + j];
            const bf16_t *y = rows + (long long)s * H + c;
            a0 = __fadd_rn(a0, __fmul_rn(wj, bf2f(y[0])));
            if (c + 1 < H) a1 = __fadd_rn(a1, __fmul_rn(wj, bf2f(y[1])));
        }
        out[(long long)t * H + c] = f2bf(a0);
        if (c + 1 < H) out[(long long)t * H + c + 1] = f2bf(a1);
    }
}

// finalize_scattered: out = bf16(acc), then acc = 0 for the next forward
// (the atomic finalize's last step; kernels.Scatter).
__global__ void finalize_scattered(bf16_t *out, float *acc, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        out[i] = f2bf(acc[i]);
        acc[i] = 0.f;
    }
}

} // namespace rw
