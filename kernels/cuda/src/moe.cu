// The MoE ops and the dense GEMM: route, permute, NVFP4 quantize, the
// grouped GEMM (BF16 or NVFP4 operands, fused activation) and finalize.

extern "C" __global__ void fill_u32(unsigned *p, int n, unsigned v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}

// ---- Quantize ----

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

// quant_amax folds max|x| of matrix blockIdx.y (per elements) into
// amax[blockIdx.y] as FP32 bits. BF16 magnitudes shifted left by 16 are
// their FP32 bits, which order like the values (NaN above Inf, so NaN
// propagates), and an integer atomic max is order-free: deterministic.
extern "C" __global__ void quant_amax(const bf16_t *src, unsigned *amax, long long per, int vec) {
    __shared__ unsigned scratch[32];
    unsigned v = amax_span(src + (long long)blockIdx.y * per, per, (long long)blockIdx.x * blockDim.x + threadIdx.x,
                           (long long)gridDim.x * blockDim.x, vec);
    v = block_reduce(v, scratch, OpMax());
    if (threadIdx.x == 0) atomicMax(&amax[blockIdx.y], v << 16);
}

// quant_scales turns each matrix's amax (FP32 bits) into its S_dec.
extern "C" __global__ void quant_scales(float *scale, int mats) {
    int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= mats) return;
    float senc, sdec;
    encode_scale(scale[m], &senc, &sdec);
    scale[m] = sdec;
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
#define ENC_TABLE 128

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

// quant_rows is the per-token recipe: one row per block (quant_row_block),
// with the row's own global scale. The block takes the row's amax (an order-free max), then
// quantizes blocks t, t+blockDim, ... in thread t, and writes the row's
// S_dec. A block per row keeps decode (a handful of rows) from running on
// a single warp.
__device__ __forceinline__ void quant_row_block(const bf16_t *src, unsigned char *packed, unsigned char *scales, float *scale, int row,
                                                int k, int kp, int vec) {
    __shared__ unsigned red[32];
    const bf16_t *r = src + (long long)row * k;
    const unsigned m = block_reduce(amax_span(r, k, threadIdx.x, blockDim.x, vec), red, OpMax());
    float senc, sdec;
    encode_scale(__uint_as_float(m << 16), &senc, &sdec);
    const float sencinv6 = __fmul_rn(senc, NVFP4_INV6);
    for (int b = threadIdx.x; b < kp / 16; b += blockDim.x) quant_store(src, packed, scales, row, b, k, kp, vec, sencinv6, sdec);
    if (threadIdx.x == 0) scale[row] = sdec;
}

extern "C" __global__ void quant_rows(const bf16_t *src, unsigned char *packed, unsigned char *scales, float *scale, int rows,
                                      int k, int kp, int vec) {
    pdl_enter();
    if (blockIdx.x < rows) quant_row_block(src, packed, scales, scale, blockIdx.x, k, kp, vec);
}

// quant_blocks quantizes matrix blockIdx.y (of rowsPerMat rows, blocksPer
// = rowsPerMat * kp/16 16-element blocks) with its global scale, one block
// per thread and step: coalesced 32-byte reads, 8-byte writes. amax[m]
// holds the matrix amax as FP32 bits; each thread turns it into the scales
// (two IEEE divisions, spread over the several blocks it takes) and the
// block fills the enc table once.
extern "C" __global__ void quant_blocks(const bf16_t *src, unsigned char *packed, unsigned char *scales, const unsigned *amax,
                                        unsigned blocksPer, int rowsPerMat, int k, int kp, int vec) {
    __shared__ float s_enc[ENC_TABLE];
    const int m = blockIdx.y;
    float senc, sdec;
    encode_scale(__uint_as_float(amax[m]), &senc, &sdec);
    fill_enc_table(s_enc, sdec);
    __syncthreads();
    quant_matrix_blocks(src + (long long)m * rowsPerMat * k, packed + (long long)m * rowsPerMat * (kp / 2),
                        scales + (long long)m * rowsPerMat * (kp / 16), blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x,
                        blocksPer, k, kp, vec, __fmul_rn(senc, NVFP4_INV6), s_enc);
}

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
extern "C" __global__ void route(const float *logits, int *ids, float *weights, int T, int E, int K, int scoring,
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
        float m = -INFINITY;
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
        float mx = -INFINITY;
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

#define ROUTE_REGS(PER)                                                                                                        \
    extern "C" __global__ void route_r##PER(const float *logits, int *ids, float *weights, int T, int E, int K, int scoring,   \
                                            int renorm, float scale) {                                                         \
        const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);                                                     \
        if (t < T) route_regs<PER>(logits, ids, weights, t, E, K, scoring, renorm, scale);                                     \
    }
ROUTE_REGS(1)
ROUTE_REGS(2)
ROUTE_REGS(4)
ROUTE_REGS(8)

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

extern "C" __global__ void permute(int *err, const int *ids, int *offsets, int *rows, int *slots, int n, int k, int E) {
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
// bit). Same results as route_r*, permute and quant_rows.
#define DISPATCH(PER)                                                                                                          \
    extern "C" __global__ void __launch_bounds__(1024) dispatch_r##PER(                                                        \
        const float *logits, int *ids, float *weights, int T, int E, int K, int scoring, int renorm, float scale, int *err,   \
        int *offsets, int *rows, int *slots, const bf16_t *qsrc, unsigned char *qpacked, unsigned char *qscales,             \
        float *qscale, int qk, int qkp, int qvec) {                                                                            \
        pdl_enter();                                                                                                           \
        if (blockIdx.x > 0) {                                                                                                  \
            quant_row_block(qsrc, qpacked, qscales, qscale, blockIdx.x - 1, qk, qkp, qvec);                                    \
            return;                                                                                                            \
        }                                                                                                                      \
        extern __shared__ int perm_smem[];                                                                                     \
        const int t = threadIdx.x >> 5;                                                                                        \
        if (t < T) route_regs<PER>(logits, ids, weights, t, E, K, scoring, renorm, scale);                                     \
        __syncthreads();                                                                                                       \
        if (T * K <= 32) permute_small(err, ids, offsets, rows, slots, T * K, K, E, perm_smem);                                \
        else permute_block(err, ids, offsets, rows, slots, T * K, K, E, perm_smem);                                            \
    }
DISPATCH(1)
DISPATCH(2)
DISPATCH(4)
DISPATCH(8)

// ---- Finalize ----

// finalize: out[t, c] = bf16(sum_j w[t,j] * rows[slots[t*k+j], c]), each
// product rounded to FP32 and summed in j order. A bad slot skips the token.
// FIN_FASTK: finalize keeps up to this many slots a token in registers
// (top-k of 8 and below; larger k takes the loop that reloads them).
#define FIN_FASTK 8

extern "C" __global__ void finalize(int *err, bf16_t *out, const bf16_t *rows, const float *w, const int *slots, int H,
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

// ---- Grouped GEMM ----
//
// One kernel for the dense GEMM (no offsets: one group of r rows) and the
// grouped expert GEMMs. A block computes BM sorted rows of one expert by
// BN output columns (for SwiGLU also the BN matching "up" rows of W), with
// 4 warps of 32x32 and BF16 mma.sync m16n8k16 (FP32 accumulation). NVFP4
// operands are dequantized to BF16 exactly while they are staged in shared
// memory. Each output's reduction runs over K in the same order whatever
// the batch: BK-wide steps, and within a step the MMA's k16 slices in order.

#define GG_BM 64
#define GG_BN 64
#define GG_BK 32
#define GG_LD (GG_BK + 8) // padded row of a shared tile, in BF16 elements

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

__device__ __forceinline__ void mma16816(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// gg_schedule (warp 0 of a block) finds the expert and the BM-row tile of
// that expert this block computes, from the tiles of BM rows each expert's
// offsets range splits into, in expert order: up to 32 * GG_SCHED_PER
// experts one warp scan over runs of GG_SCHED_PER experts a lane, else an
// inclusive warp scan over 32 experts at a time. Both give every block the
// same tile. expert -1: no tile (the grid is an upper bound).
// Offsets outside [0, R] or decreasing are reported by block (0, 0) and
// clamped, so nothing is read or written out of bounds.
#define GG_SCHED_PER 8 // experts a lane takes in gg_schedule's one-round path
__device__ __forceinline__ void gg_schedule(int *err, const int *offsets, int E, int R, int lane, int BM, int *s_expert,
                                               int *s_row0, int *s_row1) {
    {
        int expert = -1, row0 = 0, row1 = 0;
        if (offsets == nullptr) {
            if ((int)blockIdx.x * BM < R) { expert = 0; row0 = blockIdx.x * BM; row1 = min(R, row0 + BM); }
        } else if (E <= 32 * GG_SCHED_PER) {
            // Lane l takes experts GG_SCHED_PER*l ... onwards: its offsets are
            // loaded at once, so a block waits on one round of loads, not
            // one per 32 experts up to its own (every one, for the blocks
            // past the last tile).
            const int idx = blockIdx.x, e0 = GG_SCHED_PER * lane;
            if (blockIdx.x == 0 && blockIdx.y == 0 && lane == 0 && (offsets[0] < 0 || offsets[E] > R))
                report(err, E_GG_OFFSETS, offsets[0], offsets[E], R);
            int c[GG_SCHED_PER + 1]; // the lane's offsets, clamped to [0, R]
#pragma unroll
            for (int i = 0; i <= GG_SCHED_PER; i++) c[i] = e0 + i <= E ? max(0, min(offsets[e0 + i], R)) : 0;
            int tiles[GG_SCHED_PER], hi[GG_SCHED_PER], sum = 0;
#pragma unroll
            for (int i = 0; i < GG_SCHED_PER; i++) {
                const int e = e0 + i;
                hi[i] = c[i + 1];
                tiles[i] = 0;
                if (e < E) {
                    if (hi[i] < c[i]) {
                        if (blockIdx.x == 0 && blockIdx.y == 0) report(err, E_GG_DECREASE, e, offsets[e], offsets[e + 1]);
                        hi[i] = c[i];
                    }
                    tiles[i] = (hi[i] - c[i] + BM - 1) / BM;
                }
                sum += tiles[i];
            }
            const int incl = warp_scan(sum), excl = incl - sum;
            const unsigned hit = __ballot_sync(0xffffffffu, sum > 0 && idx >= excl && idx < incl);
            if (hit) {
                const int src = __ffs(hit) - 1;
                int t = idx - excl, ex = -1, r0 = 0, r1 = 0;
#pragma unroll
                for (int i = 0; i < GG_SCHED_PER; i++) {
                    if (ex < 0 && t < tiles[i]) {
                        ex = e0 + i;
                        r0 = c[i] + t * BM;
                        r1 = min(hi[i], r0 + BM);
                    } else if (ex < 0) {
                        t -= tiles[i];
                    }
                }
                expert = __shfl_sync(0xffffffffu, ex, src);
                row0 = __shfl_sync(0xffffffffu, r0, src);
                row1 = __shfl_sync(0xffffffffu, r1, src);
            }
        } else {
            int idx = blockIdx.x, base = 0;
            if (blockIdx.x == 0 && blockIdx.y == 0 && lane == 0 && (offsets[0] < 0 || offsets[E] > R))
                report(err, E_GG_OFFSETS, offsets[0], offsets[E], R);
            for (int e0 = 0; e0 < E && expert < 0; e0 += 32) {
                int e = e0 + lane;
                int lo = 0, hi = 0;
                if (e < E) {
                    lo = max(0, min(offsets[e], R));
                    hi = max(0, min(offsets[e + 1], R));
                    if (hi < lo) {
                        if (blockIdx.x == 0 && blockIdx.y == 0) report(err, E_GG_DECREASE, e, offsets[e], offsets[e + 1]);
                        hi = lo;
                    }
                }
                const int tiles = (hi - lo + BM - 1) / BM, incl = warp_scan(tiles);
                int excl = incl - tiles;
                unsigned hit = __ballot_sync(0xffffffffu, tiles > 0 && idx >= base + excl && idx < base + incl);
                if (hit) {
                    int src = __ffs(hit) - 1;
                    int t = idx - base - __shfl_sync(0xffffffffu, excl, src);
                    int l = __shfl_sync(0xffffffffu, lo, src), h = __shfl_sync(0xffffffffu, hi, src);
                    expert = e0 + src;
                    row0 = l + t * BM;
                    row1 = min(h, row0 + BM);
                }
                base += __shfl_sync(0xffffffffu, incl, 31);
            }
        }
        if (lane == 0) { *s_expert = expert; *s_row0 = row0; *s_row1 = row1; }
    }
}

// gg_sources fills src[i], i < bm, with the A row of sorted row row0+i
// (-1: none, or a bad gather entry, which is reported and skipped).
__device__ __forceinline__ void gg_sources(int *err, int *src, const int *gather, int row0, int row1, int Ta, int bm = GG_BM) {
    for (int i = threadIdx.x; i < bm; i += blockDim.x) {
        int r = row0 + i, a = -1;
        if (r < row1) {
            a = gather ? gather[r] : r;
            if (a < 0 || a >= Ta) {
                report(err, E_GG_GATHER, r, a, Ta);
                a = -1;
            }
        }
        src[i] = a;
    }
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

extern "C" __global__ void __launch_bounds__(128)
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
#define G4_BK 128
#define G4_LD (G4_BK + 8)

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

#define G4_KERNEL(NAME, BM, SWIGLU)                                                                                           \
    extern "C" __global__ void __launch_bounds__(128)                                                                         \
        NAME(int *err, const unsigned char *aPacked, const unsigned char *aSF, const float *aScale, int Kp, const int *gather,  \
             int Ta, const unsigned char *wPacked, const unsigned char *wSF, const float *wScale, int N, const int *offsets,   \
             int E, int R, int act, bf16_t *out, int outN) {                                                                   \
        g4_gemm<BM, SWIGLU>(err, aPacked, aSF, aScale, Kp, gather, Ta, wPacked, wSF, wScale, N, offsets, E, R, act, out, outN); \
    }
G4_KERNEL(grouped_gemm_fp4_m64, 64, false)
G4_KERNEL(grouped_gemm_fp4_m64_swiglu, 64, true)
G4_KERNEL(grouped_gemm_fp4_m16, 16, false)
G4_KERNEL(grouped_gemm_fp4_m16_swiglu, 16, true)

// ---- Grouped GEMM, weights streamed into MMA fragments ----
//
// The expert GEMMs of both recipes: NVFP4 x NVFP4 (per_token) up to 24
// rows per expert (gt_gemm, below, takes more) and BF16 x BF16 (bf16) at
// every batch size. A block of 8 warps computes
// BM = 16*MI sorted rows of one expert by 128 output columns (64 for
// SwiGLU, whose warps also take the matching "up" rows). The activations
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
// NVFP4 dequantization is exact and needs no table for the codes: g5_pair
// places E2M1 nibbles i and i+4 of a word as BF16 code * 2^-126 (code 0.5
// is subnormal, which BF16 arithmetic keeps), and one packed BF16 multiply
// by bf16(E4M3 * 2^118) (a 256-entry table in shared memory) gives
// value * 2^-8: e2m1 * E4M3 has at most 6 significant bits and stays in
// BF16's normal range. The products in the MMA are then 2^-16 times the
// true ones, so the FP32 accumulator times 2^16 is exact too.
// TestConformance/GroupedGemmExact checks all of it bit for bit.
#define G5_KC 128 // K per chunk

// Weight chunks in flight per warp: G5_D. The codes go to a per-warp ring
// in shared memory by cp.async (16 B per lane and tile for NVFP4, 64 B for
// BF16), and so do the NVFP4 block scales (a word per lane pair and tile).
// NVFP4 16-row tiles keep 5 chunks, so that four blocks fit in an SM's
// shared memory (kernels/cuda/moe.go streamSmem) and registers (G5_MINB):
// at 8-128 tokens 1-2% faster than three blocks of 7 chunks. The 32-row
// kernels with four n8 tiles a warp (_j4) keep 4, the bytes in flight of
// two tiles and 8 chunks, so that two blocks fit an SM.
#define G5_D(FP4, MI, J) ((FP4) ? ((MI) == 1 ? 5 : (J) == 4 ? 4 : 8) : 4)
#define G5_MINB(FP4, MI, J) ((FP4) && (MI) == 1 ? 4 : (FP4) && (J) == 4 ? 2 : 1) // blocks an SM the registers must allow
#define G5_NW 8 // warps per block
#define G5_WB(FP4) ((FP4) ? 16 : 64) // bytes per lane, tile and chunk
#define G5_ROWCH 32 // chunks of a one-row tile's K range staged at once: 256 B each in the 2 x 4 KB of a 16-row tile's buffers

// cp_async copies 16 or 8 bytes (zero-filled where !full). The 16-byte
// copies carry the weight streams: a row of a 128-K chunk is 64 bytes
// (NVFP4, four lanes of 16) of a 128-byte line the next chunk reads the
// other half of, so they ask L2 to fetch the whole line (.L2::128B). H200
// (session 13): the NVFP4 layer 9-10% faster at 8-128 tokens, 0.5-1.6% at 1
// and 512 tokens; the BF16 recipe 3-5% faster. .L2::256B made the BF16
// recipe 6-7% slower; the hint on the 4- and 8-byte copies changed nothing.
__device__ __forceinline__ void cp_async(void *smem, const void *gmem, int bytes, bool full) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    if (bytes == 16)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 16 : 0) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 8 : 0) : "memory");
}
// cp_async4 copies n (0..4) bytes from gmem (4-byte aligned) and
// zero-fills the rest of the 4 at smem.
__device__ __forceinline__ void cp_async4(void *smem, const void *gmem, int n) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
// cp_async4_if copies 4 bytes when p holds: a predicated instruction, not a
// branch around it.
__device__ __forceinline__ void cp_async4_if(void *smem, const void *gmem, bool p) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\t@p cp.async.ca.shared.global [%0], [%1], 4;\n}\n" ::"r"(s), "l"(gmem),
                 "r"((int)p)
                 : "memory");
}
template <bool B, typename T, typename F>
struct G5Cond {
    typedef T type;
};
template <typename T, typename F>
struct G5Cond<false, T, F> {
    typedef F type;
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

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

// The _ks2 kernels split K over thread block clusters of two: block z of a
// pair takes chunks [z*h, (z+1)*h), h = ceil(chunks/2), and block 0 adds
// block 1's sums (read from its shared memory) to its own, in that order,
// for every tile size. The host picks them by K alone (long NVFP4 rows,
// where one block per tile leaves the GPU half idle at small batch), so
// batch invariance holds.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// ld_peer4 reads a float4 at p in the shared memory of cluster block rank.
__device__ __forceinline__ float4 ld_peer4(const void *p, unsigned rank) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    unsigned ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(ra) : "memory");
    return v;
}

// ks2_add ends the K split of a cluster pair: block 1 leaves its N float4
// sums per thread in its shared memory at xs (free by then), block 0 adds
// them to its own in that order; it reports whether this block goes on to
// the epilogue (block 0).
template <int N, int NT>
__device__ __forceinline__ bool ks2_add(float (*acc)[4], uint4 *smem, int rank, int tid) {
    float4 *xs = reinterpret_cast<float4 *>(smem);
    if (rank == 1) {
#pragma unroll
        for (int n = 0; n < N; n++) xs[n * NT + tid] = make_float4(acc[n][0], acc[n][1], acc[n][2], acc[n][3]);
    }
    cluster_sync();
    if (rank == 0) {
#pragma unroll
        for (int n = 0; n < N; n++) {
            const float4 o = ld_peer4(&xs[n * NT + tid], 1);
            acc[n][0] = __fadd_rn(acc[n][0], o.x);
            acc[n][1] = __fadd_rn(acc[n][1], o.y);
            acc[n][2] = __fadd_rn(acc[n][2], o.z);
            acc[n][3] = __fadd_rn(acc[n][3], o.w);
        }
    }
    cluster_sync(); // block 1 waits until its sums are read
    return rank == 0;
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

// g5_rowstage fills aq with a one-row tile's A fragments for chunks cbeg ..
// cend - 1, all at once: aq[cc * 16 + k * 4 + q4] holds, for the lanes of
// t4 = q4, row 0's words of slices 2k and 2k + 1 of chunk cc as {lo(2k),
// lo(2k + 1), hi(2k), hi(2k + 1)}: the words g5_astore gives row 0 (zeros
// past K or for a missing row, a < 0). Both slices come from the same code
// word and block scale, so a thread converts them together. The NVFP4
// g5_tail's ROW path passes each 16-byte word to slice 2k's MMA as it is
// and to slice 2k + 1's with its odd words in the even places (below).
__device__ __forceinline__ void g5_rowstage(uint4 *aq, const void *A, const unsigned char *aSF, int K, int a, int cbeg, int cend,
                                            const unsigned *lut, int tid, int nt) {
#pragma unroll 2
    for (int it = tid; it < (cend - cbeg) * 16; it += nt) {
        const int c = cbeg + (it >> 4), k = (it >> 2) & 3, q4 = it & 3;
        unsigned lo0 = 0, hi0 = 0, lo1 = 0, hi1 = 0;
        if (a >= 0 && c * G5_KC + 32 * q4 + 16 * (k >> 1) < K) {
            const int e = a * K + c * G5_KC + 32 * q4 + 8 * k;
            const unsigned q = __ldg(reinterpret_cast<const unsigned *>(static_cast<const unsigned char *>(A) + e / 2));
            const unsigned sc = lut[__ldg(aSF + a * (K / 16) + c * (G5_KC / 16) + 2 * q4 + (k >> 1))];
            g5_slice4(q, sc, 2 * k, lo0, hi0);
            g5_slice4(q, sc, 2 * k + 1, lo1, hi1);
        }
        aq[it] = make_uint4(lo0, lo1, hi0, hi1);
    }
}

// g5_epilogue writes a warp's outputs: acc[i][j] is the MMA tile of rows
// rbase + 16i (+ g, + g + 8) of the block's row tile, columns cw + 8j
// (+ 2t4, + 2t4 + 1); for SwiGLU tile j < J/2 is a gate and j + J/2 its
// up. For NVFP4 acc * 2^16 (exact), then * per-row scale * alpha, each an
// FP32 rounding; the activation; one BF16 rounding. With a scatter (sacc),
// the BF16 value times the row's routing weight is added into the token's
// FP32 sums instead (kernels.Scatter).
template <int MI, int J, bool SWIGLU, bool FP4>
__device__ __forceinline__ void g5_epilogue(int *err, float acc[][J][4], int rbase, int cw, const int *src, int row0, int row1,
                                            float alpha, const float *aScale, int act, bf16_t *out, int outN, float *sacc,
                                            const int *stok, const float *swt, const int *sslots, int sT, int sk, int g, int t4) {
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int rr = rbase + 16 * i + g + 8 * h, r = row0 + rr;
            if (r >= row1) continue;
            const int a = src[rr];
            if (a < 0) continue;
            const float as = FP4 ? aScale[a] : 1.f;
            float *srow = nullptr;
            float sw = 0.f;
            if (sacc) {
                const int t = stok[r];
                if (t < 0 || t >= sT) {
                    report(err, E_SCATTER_TOKEN, r, t, sT);
                    continue;
                }
                int j = 0;
                while (j < sk && sslots[(long long)t * sk + j] != r) j++;
                if (j == sk) {
                    report(err, E_SCATTER_SLOT, r, t, sk);
                    continue;
                }
                sw = swt[(long long)t * sk + j];
                srow = sacc + (long long)t * outN;
            }
#pragma unroll
            for (int q = 0; q < 2; q++) {
                float v[J];
#pragma unroll
                for (int j = 0; j < J; j++) {
                    v[j] = acc[i][j][2 * h + q];
                    if (FP4) v[j] = __fmul_rn(__fmul_rn(v[j] * 65536.f, as), alpha);
                }
                if constexpr (SWIGLU) {
#pragma unroll
                    for (int j = 0; j < J / 2; j++) {
                        const int col = cw + 8 * j + 2 * t4 + q;
                        const bf16_t y = f2bf(__fmul_rn(__fdiv_rn(v[j], __fadd_rn(1.f, expf(-v[j]))), v[j + J / 2]));
                        if (col < outN) {
                            if (srow) atomicAdd(srow + col, __fmul_rn(sw, bf2f(y)));
                            else out[(long long)r * outN + col] = y;
                        }
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < J; j++) {
                        const int col = cw + 8 * j + 2 * t4 + q;
                        float x = v[j];
                        if (act == 2) {
                            x = fmaxf(x, 0.f);
                            x = __fmul_rn(x, x);
                        }
                        if (col < outN) {
                            if (srow) atomicAdd(srow + col, __fmul_rn(sw, bfround(x)));
                            else out[(long long)r * outN + col] = f2bf(x);
                        }
                    }
                }
            }
        }
}

// g5_tail runs a block's tile once its rows are known (g5_gemm): MA of
// the launch's MI m16 row tiles hold rows, and only those are staged and
// multiplied. The shared memory keeps the launch's layout (MI). A row's
// MMAs, K order and bits are the same whatever MA is.
template <int MA, int H, int MI, int J, bool SWIGLU, bool FP4, bool V16, int KS, bool ROW = false>
__device__ __forceinline__ void g5_tail(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K,
                                        const void *W, const unsigned char *wSF, const float *wScale, int N, int act, bf16_t *out,
                                        int outN, float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk,
                                        int expert, int row0, int row1, const int *s_src, const unsigned *lut) {
    constexpr int NW = G5_NW, D = G5_D(FP4, MI, J), WU = G5_WB(FP4) / 16; // WU: 16-byte units per lane, tile, chunk
    static_assert(J == 2 || J == 4 || (J == 1 && !SWIGLU), "SwiGLU pairs gate tiles with their up tiles");
    static_assert(!ROW || (MA == 1 && MI == 1 && FP4 && G5_ROWCH * 32 * 8 <= 2 * MI * 256 * 16),
                  "ROW: an NVFP4 16-row tile, its K range in the activation buffers");
    extern __shared__ __align__(16) uint4 g5_smem[]; // A: 2 x MI x 256 items; W: per warp D x J x WU x 32 units; NVFP4 scales: per warp D x J x 16 words
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;

    // This warp's J n8 tiles of W rows: 8 J columns, or for SwiGLU 8 JC
    // gate columns (tiles j < JC) and their up rows (tiles JC + j).
    // Columns past outN read the last row and are never written.
    constexpr int JC = SWIGLU ? J / 2 : J; // n8 tiles of output columns a warp
    const int cw = blockIdx.y * (8 * JC * NW) + warp * (8 * JC);
    const int nch = (K + G5_KC - 1) / G5_KC, nfull = K / G5_KC, half = KS == 2 ? (nch + 1) / 2 : nch;
    const int rank = KS == 2 ? (int)blockIdx.z : 0;
    const int cbeg = rank * half, cend = min(nch, cbeg + half);
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
    uint4 *wsm = g5_smem + 2 * MI * 256 + warp * (D * J * WU * 32) + lane;
    unsigned *ssm = reinterpret_cast<unsigned *>(g5_smem + 2 * MI * 256 + NW * (D * J * WU * 32)) + warp * (D * J * 16) + (lane >> 1);
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
    // ROW (a tile of one row, g5_gemm): the whole K range is staged here,
    // once, and the chunk loop below meets no block barrier.
    const bool stage = !ROW && (H == 2 || ast.off[0][0] >= 0);
    // ROW: a lane's two slices 2k, 2k + 1 of a chunk are one 16-byte word
    // (g5_rowstage's layout), and the four lanes of a group read 64
    // contiguous bytes: 4 LDS.128 a chunk, one wavefront each.
    const uint4 *aq = g5_smem + t4;
    if constexpr (ROW) {
        g5_rowstage(g5_smem, A, aSF, K, s_src[0], cbeg, cend, lut, tid, NT);
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
        if constexpr (ROW) {
#pragma unroll
            for (int k = 0; k < 4; k++) ar[k] = aq[(c - cbeg) * 16 + k * 4];
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
            if constexpr (ROW) {
                // Rows 0-7 of the m16 tile (a[i].x, .z) get row 0's words;
                // rows 8-15 (.y, .w) get whatever is at hand: each output
                // row's MMA reads only its own A row, so row 0's bits are
                // those of a zero-padded tile, and rows 1-15 are never
                // written (row1 = row0 + 1). Slice 2k takes the staged
                // word as it is; slice 2k + 1 repeats its odd words, so
                // the MMA's aligned register quad takes two moves at most.
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
template <int MI, int J, bool SWIGLU, bool FP4, bool V16, int KS>
__device__ __forceinline__ void g5_gemm(int *err, const void *A, const unsigned char *aSF, const float *aScale, int K,
                                        const int *gather, int Ta, const void *W, const unsigned char *wSF, const float *wScale,
                                        int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN, float *sacc,
                                        const int *stok, const float *swt, const int *sslots, int sT, int sk) {
    constexpr int BM = 16 * MI;
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

    // A partial tile runs with only its m16 tiles that hold rows.
    const int ma = (row1 - row0 + 15) / 16;
#define G5_TAIL(MA, H, ROW)                                                                                                    \
    g5_tail<MA, H, MI, J, SWIGLU, FP4, V16, KS, ROW>(err, A, aSF, aScale, K, W, wSF, wScale, N, act, out, outN, sacc, stok,    \
                                                     swt, sslots, sT, sk, expert, row0, row1, s_src, lut)
    if constexpr (MI == 1) {
        // An NVFP4 tile of one row in the _j1 kernels (a token per expert:
        // the one-token layer) whose block's K range fits the 8 KB of
        // activation buffers as 256-byte chunks (G5_ROWCH): the ROW path of
        // g5_tail. Not in the J = 2 kernels: with a ROW path ptxas spilled
        // 48-64 bytes in each of them (64 registers for four blocks an SM)
        // and they ran 0.7-8% slower at 8-128 tokens (session 12, run2).
        if constexpr (FP4 && J == 1) {
            const int nch = (K + G5_KC - 1) / G5_KC;
            if (row1 - row0 == 1 && (KS == 2 ? (nch + 1) / 2 : nch) <= G5_ROWCH) {
                G5_TAIL(1, 1, true);
                return;
            }
        }
        // A 16-row tile of at most 8 rows stages only rows 0-7 (G5AStage).
        if (row1 - row0 <= 8) {
            G5_TAIL(1, 1, false);
            return;
        }
    }
    if constexpr (MI >= 2) {
        if (ma <= 1) {
            G5_TAIL(1, 2, false);
            return;
        }
    }
    if constexpr (MI >= 4) {
        if (ma <= 2) {
            G5_TAIL(2, 2, false);
            return;
        }
    }
    G5_TAIL(MI, 2, false);
#undef G5_TAIL
}


// finalize_scattered: out = bf16(acc), then acc = 0 for the next forward
// (the atomic finalize's last step; kernels.Scatter).
extern "C" __global__ void finalize_scattered(bf16_t *out, float *acc, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        out[i] = f2bf(acc[i]);
        acc[i] = 0.f;
    }
}

// The kernels; the _ks2 ones run as clusters of two blocks along z (grid z
// = 2). V16 needs whole 16-byte units per row (K % 64 == 0 for NVFP4, so
// that the block scales of a lane pair are one aligned word; K % 8 == 0
// for BF16), 16-byte aligned W and (NVFP4) 4-byte aligned block scales.
#define G5_BODY(MI, J, SWIGLU, FP4, KS)                                                                                        \
    const bool v16 = (FP4 ? K % 64 == 0 && (reinterpret_cast<unsigned long long>(wSF) & 3) == 0 : K % 8 == 0) &&               \
                     (reinterpret_cast<unsigned long long>(W) & 15) == 0;                                                      \
    if (v16)                                                                                                                   \
        g5_gemm<MI, J, SWIGLU, FP4, true, KS>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out,  \
                                              outN, sacc, stok, swt, sslots, sT, sk);                                          \
    else                                                                                                                       \
        g5_gemm<MI, J, SWIGLU, FP4, false, KS>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, \
                                               outN, sacc, stok, swt, sslots, sT, sk);
#define G5_PARAMS                                                                                                              \
    (int *err, const void *A, const unsigned char *aSF, const float *aScale, int K, const int *gather, int Ta, const void *W,   \
     const unsigned char *wSF, const float *wScale, int N, const int *offsets, int E, int R, int act, bf16_t *out, int outN,    \
     float *sacc, const int *stok, const float *swt, const int *sslots, int sT, int sk)
#define G5_KERNEL(NAME, MI, J, SWIGLU, FP4)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * G5_NW, G5_MINB(FP4, MI, J)) NAME G5_PARAMS { G5_BODY(MI, J, SWIGLU, FP4, 1) }
#define G5_KERNEL_KS2(NAME, MI, J, SWIGLU)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * G5_NW, G5_MINB(true, MI, J)) __cluster_dims__(1, 1, 2) NAME G5_PARAMS {     \
        G5_BODY(MI, J, SWIGLU, true, 2)                                                                                        \
    }

// The NVFP4 32-row tiles run only with four n8 tiles a warp (_j4; the
// host's streamPlan): with two, each A fragment fed two MMAs and the
// kernels were bound by shared memory (docs/MOE.md, fourteenth session).
G5_KERNEL(gemm_fp4_stream_m16, 1, 2, false, true)
G5_KERNEL(gemm_fp4_stream_m16_j1, 1, 1, false, true)
G5_KERNEL(gemm_fp4_stream_m16_swiglu, 1, 2, true, true)
G5_KERNEL(gemm_fp4_stream_m32_j4, 2, 4, false, true)
G5_KERNEL(gemm_fp4_stream_m32_swiglu_j4, 2, 4, true, true)
G5_KERNEL(gemm_fp4_stream_m64, 4, 2, false, true)
G5_KERNEL(gemm_fp4_stream_m64_swiglu, 4, 2, true, true)
G5_KERNEL_KS2(gemm_fp4_stream_m16_ks2, 1, 2, false)
G5_KERNEL_KS2(gemm_fp4_stream_m16_ks2_j1, 1, 1, false)
G5_KERNEL_KS2(gemm_fp4_stream_m16_swiglu_ks2, 1, 2, true)
G5_KERNEL_KS2(gemm_fp4_stream_m32_ks2_j4, 2, 4, false)
G5_KERNEL_KS2(gemm_fp4_stream_m32_swiglu_ks2_j4, 2, 4, true)
G5_KERNEL_KS2(gemm_fp4_stream_m64_ks2, 4, 2, false)
G5_KERNEL_KS2(gemm_fp4_stream_m64_swiglu_ks2, 4, 2, true)
G5_KERNEL(gemm_bf16_stream_m16, 1, 2, false, false)
G5_KERNEL(gemm_bf16_stream_m16_j1, 1, 1, false, false)
G5_KERNEL(gemm_bf16_stream_m16_swiglu, 1, 2, true, false)
G5_KERNEL(gemm_bf16_stream_m32, 2, 2, false, false)
G5_KERNEL(gemm_bf16_stream_m32_swiglu, 2, 2, true, false)
G5_KERNEL(gemm_bf16_stream_m64, 4, 2, false, false)
G5_KERNEL(gemm_bf16_stream_m64_swiglu, 4, 2, true, false)

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
#define GT_ITEMS (8 * 8 * 32) // 16-byte items per operand and chunk: 8 tiles (m16, or n8 pairs) x 8 slices x 32 lanes

// GTShare is one thread's raw share of a chunk: 16 code bytes (quarter t4
// of the chunk) of two rows, and their block scales (2t4, 2t4 + 1).
struct GTShare {
    uint4 q[2];
    unsigned sf[2];
};

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

// V16 for gt_gemm: whole 16-byte units per row (K % 32 == 0) from 16-byte
// aligned A and W, block scales 2-byte aligned.
#define GT_BODY(NW, SWIGLU, KS)                                                                                                \
    const bool v16 = K % 32 == 0 && ((reinterpret_cast<unsigned long long>(W) | reinterpret_cast<unsigned long long>(A)) & 15) == 0 && \
                     ((reinterpret_cast<unsigned long long>(wSF) | reinterpret_cast<unsigned long long>(aSF)) & 1) == 0;      \
    if (v16)                                                                                                                   \
        gt_gemm<NW, SWIGLU, true, KS>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, \
                                      stok, swt, sslots, sT, sk);                                                              \
    else                                                                                                                       \
        gt_gemm<NW, SWIGLU, false, KS>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, \
                                       stok, swt, sslots, sT, sk);
#define GT_KERNEL(NAME, NW, SWIGLU)                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) NAME G5_PARAMS { GT_BODY(NW, SWIGLU, 1) }                        \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) __cluster_dims__(1, 1, 2) NAME##_ks2 G5_PARAMS {                \
        GT_BODY(NW, SWIGLU, 2)                                                                                                 \
    }
GT_KERNEL(gemm_fp4_tile, 16, false)
GT_KERNEL(gemm_fp4_tile_swiglu, 16, true)
GT_KERNEL(gemm_fp4_tile_w8, 8, false)
GT_KERNEL(gemm_fp4_tile_w8_swiglu, 8, true)

// ---- Grouped GEMM, NVFP4 x NVFP4, many rows per expert: warp-specialised wgmma ----
//
// gt_gemm (above) is latency-bound at one block of 8 warps an SM: every
// warp dequantizes its share of a chunk, waits at the block barrier, then
// reads its fragments and issues its MMAs, so the tensor cores idle while
// the dequantization runs and the other way round (docs/MOE.md: no eligible
// warp 68.6% of the cycles, tensor pipe 32% active). gw_gemm computes a
// 64 MT x 128 tile (MT = 2: the same 128 x 128 tile) with the work split
// by role:
//  - warps 0-7 (producers) copy each 128-K chunk's raw NVFP4 codes and
//    block scales GW_RAW chunks ahead into their own slots of shared
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
// wgmma adds a k16 step's products as mma.sync m16n8k16 does (found with
// the fifth session's wgmma kernel, 61d8543: TestGroupedGemmInvariance), so
// with the same slices in order, the same K split (ks2_add) and the same
// epilogue every output has gt_gemm's and g5_gemm's bits.
// MT is the tile's rows in 64-row bands, one consumer warpgroup each: 2
// (128 rows) or 3 (192 rows: at 4096 tokens an expert's 128 +- 11 rows
// then take one tile, not a full one and one of about 10 rows that
// dequantizes every weight row all the same).
#define GW_STAGES 2 // dequantized stages
#define GW_HALFB 16384 // bytes of half a chunk's K of the 128 weight rows, BF16
#define GW_RAW(MT) ((MT) == 2 ? 4 : 2) // raw chunks in flight a producer thread (what shared memory leaves room for)
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

// gw_desc is the wgmma descriptor of a K-major operand at shared address
// a with the 128-byte swizzle: 8-row groups 1024 bytes apart (the stride
// byte offset; the leading one is unused when a step's K lies in one row).
__device__ __forceinline__ unsigned long long gw_desc(unsigned a) {
    return (unsigned long long)((a & 0x3FFFF) >> 4) | 1ull << 16 | (unsigned long long)(1024 >> 4) << 32 | 1ull << 62;
}

// gw_mma issues d += A * B^T for a 64 x 16 A and a 128 x 16 B (descriptors
// da, db), asynchronously: wgmma m64n128k16, FP32 accumulation.
__device__ __forceinline__ void gw_mma(float (&d)[16][4], unsigned long long da, unsigned long long db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                   "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                   "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                   "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
                   "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
                   "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
                   "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
                   "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
                   "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
                   "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
                   "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
                   "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
                   "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
                   "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
                   "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
                   "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                 : "l"(da), "l"(db), "r"(1));
#else
    __trap(); // the host launches gw_gemm on sm_90a only
#endif
}

__device__ __forceinline__ void gw_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void gw_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// gw_wait waits until at most N of this warpgroup's MMA groups are
// pending; the empty asm statements keep the compiler from touching the
// accumulators before then.
template <int N>
__device__ __forceinline__ void gw_wait(float (&d)[16][4]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
#pragma unroll
    for (int j = 0; j < 16; j++) asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
}

// gw_proxy makes this thread's shared-memory stores visible to the
// asynchronous proxy that wgmma reads through (before the arrival).
__device__ __forceinline__ void gw_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// mbarriers at shared addresses: init (count arrivals a phase), arrive,
// and wait until the phase of the given parity has completed (a fresh
// barrier counts the phase before its first as completed, parity 1).
__device__ __forceinline__ void mb_init(unsigned a, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_arrive(unsigned a) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mb_wait(unsigned a, unsigned parity) {
    asm volatile("{\n.reg .pred p;\nGW_WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra GW_WAIT;\n}\n" ::"r"(a),
                 "r"(parity)
                 : "memory");
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
    constexpr int HALFA = BM * 128, OPA = 2 * HALFA, STAGE = OPA + 2 * GW_HALFB, RAW = GW_RAW(MT);
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

// CA for gw_gemm: whole chunks (K % 128 == 0) from 16-byte aligned A and
// W, block scales 4-byte aligned (rows of K / 16 scale bytes then are too).
#define GW_BODY(SWIGLU, KS, MT)                                                                                                \
    const bool ca = K % 128 == 0 && ((reinterpret_cast<unsigned long long>(W) | reinterpret_cast<unsigned long long>(A)) & 15) == 0 && \
                    ((reinterpret_cast<unsigned long long>(wSF) | reinterpret_cast<unsigned long long>(aSF)) & 3) == 0;       \
    if (ca)                                                                                                                    \
        gw_gemm<SWIGLU, true, KS, MT>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, \
                                      stok, swt, sslots, sT, sk);                                                              \
    else                                                                                                                       \
        gw_gemm<SWIGLU, false, KS, MT>(err, A, aSF, aScale, K, gather, Ta, W, wSF, wScale, N, offsets, E, R, act, out, outN, sacc, \
                                       stok, swt, sslots, sT, sk);
#define GW_KERNEL(NAME, SWIGLU, MT)                                                                                            \
    extern "C" __global__ void __launch_bounds__(256 + 128 * (MT), 1) NAME G5_PARAMS { GW_BODY(SWIGLU, 1, MT) }               \
    extern "C" __global__ void __launch_bounds__(256 + 128 * (MT), 1) __cluster_dims__(1, 1, 2) NAME##_ks2 G5_PARAMS {       \
        GW_BODY(SWIGLU, 2, MT)                                                                                                 \
    }
GW_KERNEL(gemm_fp4_ws, false, 2)
GW_KERNEL(gemm_fp4_ws_swiglu, true, 2)
GW_KERNEL(gemm_fp4_ws192, false, 3)
GW_KERNEL(gemm_fp4_ws192_swiglu, true, 3)

// ---- Dense GEMM for narrow outputs (the router) ----
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
#define GN_WARPS 16

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
__device__ __forceinline__ void gn_gemm(const bf16_t *A, const bf16_t *W, void *out, int M, int N, int K, int outFmt, float *part) {
    constexpr int RM = 16 * MI, CN = 8 * NJ, LDP = CN + 1;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int r0 = blockIdx.x * RM, c0 = blockIdx.y * CN;
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
    constexpr int DU = UNROLL / 2 > 0 ? UNROLL / 2 : 1; // double slices per iteration
    for (int k = warp * 32; k < K; k += 32 * GN_WARPS * DU) {
        uint4 af[DU][MI][2], bf[DU][NJ];
#pragma unroll
        for (int u = 0; u < DU; u++) { // all loads first: they fly together
            const int kk = k + u * 32 * GN_WARPS + 8 * t4;
#pragma unroll
            for (int i = 0; i < MI; i++) {
                af[u][i][0] = gn_ld8(ar[i][0], kk, K, rok[i][0], vec);
                af[u][i][1] = H == 2 ? gn_ld8(ar[i][1], kk, K, rok[i][1], vec) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < NJ; j++) bf[u][j] = gn_ld8(wr[j], kk, K, wok[j], vec);
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

extern "C" __global__ void __launch_bounds__(32 * GN_WARPS) gemm_narrow(const bf16_t *A, const bf16_t *W, void *out, int M, int N,
                                                                        int K, int outFmt) {
    __shared__ float part[GN_WARPS * 16 * 9];
    pdl_enter();
    gn_gemm<1, 1, 8>(A, W, out, M, N, K, outFmt, part);
}

// gemm_narrow8: gemm_narrow for M <= 8 (one row tile, its first half):
// a warp's 14 double slices of a 7168-long K (the router at one token) in
// flight at once, one round of loads instead of 4. The same bits. ptxas
// gives it 24 bytes of spills at 128 registers; measured on the H200 it
// was still 0.7 us faster at one token than 7 slices in flight without
// spills (docs/MOE.md).
extern "C" __global__ void __launch_bounds__(32 * GN_WARPS) gemm_narrow8(const bf16_t *A, const bf16_t *W, void *out, int M, int N,
                                                                         int K, int outFmt) {
    __shared__ float part[GN_WARPS * 16 * 9];
    pdl_enter();
    gn_gemm<1, 1, 28, 1>(A, W, out, M, N, K, outFmt, part);
}

// gemm_narrow_wide: dynamic shared memory GN_WARPS x 32 x 33 floats.
extern "C" __global__ void __launch_bounds__(32 * GN_WARPS) gemm_narrow_wide(const bf16_t *A, const bf16_t *W, void *out, int M,
                                                                             int N, int K, int outFmt) {
    extern __shared__ float gn_part[];
    pdl_enter();
    gn_gemm<2, 4, 2>(A, W, out, M, N, K, outFmt, gn_part);
}
