// The dense model's ops (kernels/model.go): embedding, RMSNorm, residual
// add, RoPE, KV-cache write, sampling and log-probs (attention is
// attention.cu), and
// the scatter of a sparse BF16 weight delta (refit). The
// numerics follow the CPU reference (kernels/cpu/model.go) step by step:
// every FP32 operation the CPU rounds on its own is one __fmul_rn /
// __fadd_rn / __fdiv_rn here (nvcc would otherwise fuse products into FMAs),
// float64 stays float64, and every reduction is a fixed tree per row, so a
// row's result never depends on the rest of the batch. A bad index read
// from a buffer skips its row (nothing is written for it) and is reported
// through the device error word (report, errors.cuh).
//
// Compile unit: the model ops. Names start with model_.
#include "numerics.cuh"
#include "ptx.cuh"
#include "reduce.cuh"
#include "errors.cuh"

namespace rw {

constexpr unsigned MODEL_FULL = 0xffffffffu;

struct model_OpMin {
    template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return b < a ? b : a; }
};

// model_copy_row copies n BF16 values with the threads of the block, 16
// bytes at a time when both rows allow it (a bit-exact copy either way).
__device__ __forceinline__ void model_copy_row(bf16_t *dst, const bf16_t *src, int n) {
    if ((n & 7) == 0 && (((unsigned long long)dst | (unsigned long long)src) & 15) == 0) {
        uint4 *d = reinterpret_cast<uint4 *>(dst);
        const uint4 *s = reinterpret_cast<const uint4 *>(src);
        for (int i = threadIdx.x; i < (n >> 3); i += blockDim.x) d[i] = s[i];
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    }
}

// The short per-token kernels (embed, RMSNorm, add, RoPE, KV write) start
// with pdl_enter (ptx.cuh): launched with programmatic stream
// serialization, the next one's launch overlaps this one's run.

// ---- Embed: one block per token. ----

__global__ void model_embed(int *err, bf16_t *out, const bf16_t *table, const int *ids, int h, int v) {
    pdl_enter();
    const int t = blockIdx.x;
    const int id = ids[t];
    if (id < 0 || id >= v) {
        if (threadIdx.x == 0) report(err, E_EMBED_ID, t, id, v);
        return;
    }
    model_copy_row(out + (size_t)t * h, table + (size_t)id * h, h);
}

// MODEL_NORM_PER is how many of its elements a norm's thread loads before
// it uses them: its strided elements are added in the same order, but the
// loads of a row go out together rather than one memory round trip after
// another (a 2048-wide row at one token took about 10 us a norm that way).
constexpr int MODEL_NORM_PER = 8;

// model_norm_scale writes o[i] = w[i] * bf16(x[i] * r) for the calling
// thread's strided elements, their loads batched as above.
__device__ __forceinline__ void model_norm_scale(bf16_t *o, const bf16_t *x, const bf16_t *w, int d, float r) {
    const int bd = blockDim.x;
    for (int i0 = threadIdx.x; i0 < d; i0 += MODEL_NORM_PER * bd) {
        float xv[MODEL_NORM_PER], wv[MODEL_NORM_PER];
#pragma unroll
        for (int u = 0; u < MODEL_NORM_PER; u++)
            if (i0 + u * bd < d) {
                xv[u] = bf2f(x[i0 + u * bd]);
                wv[u] = bf2f(w[i0 + u * bd]);
            }
#pragma unroll
        for (int u = 0; u < MODEL_NORM_PER; u++)
            if (i0 + u * bd < d) o[i0 + u * bd] = f2bf(__fmul_rn(wv[u], bfround(__fmul_rn(xv[u], r))));
    }
}

// ---- RMSNorm: one block per row (blockDim a multiple of 32). ----
//
// Src and Out may be the same buffer: the first pass reads the whole row,
// the reduction's __syncthreads orders those reads before any write, and in
// the second pass each element is read by the thread that then writes it.
// So neither pointer is __restrict__.
__global__ void model_rmsnorm(bf16_t *out, const bf16_t *src, const bf16_t *w, int d, float eps) {
    __shared__ float scratch[32];
    pdl_enter();
    const bf16_t *x = src + (size_t)blockIdx.x * d;
    bf16_t *o = out + (size_t)blockIdx.x * d;
    const int bd = blockDim.x;
    // Each square of a BF16 value is exact in FP32; the sum is FP32 in a
    // fixed order (per-thread strided partials, then block_reduce's tree).
    float ss = 0.0f;
    for (int i0 = threadIdx.x; i0 < d; i0 += MODEL_NORM_PER * bd) {
        float v[MODEL_NORM_PER];
#pragma unroll
        for (int u = 0; u < MODEL_NORM_PER; u++) v[u] = i0 + u * bd < d ? bf2f(x[i0 + u * bd]) : 0.0f;
#pragma unroll
        for (int u = 0; u < MODEL_NORM_PER; u++)
            if (i0 + u * bd < d) ss = __fadd_rn(ss, __fmul_rn(v[u], v[u]));
    }
    ss = block_reduce(ss, scratch, OpAdd());
    const float mean = __fdiv_rn(ss, (float)d);
    // A correctly rounded 1/sqrt, as the CPU computes it (float64, one
    // rounding to FP32); double sqrt and division are IEEE here.
    const float r = (float)(1.0 / sqrt((double)__fadd_rn(mean, eps)));
    model_norm_scale(o, x, w, d, r);
}

// ---- Add + RMSNorm: one block per row, the residual add in place, then
// the norm of the sums (model_add then model_rmsnorm, bit for bit: the same
// per-thread order and tree for a block of the same size). ----
__global__ void model_add_rmsnorm(bf16_t *out, bf16_t *src, const bf16_t *res, const bf16_t *w, int d, float eps) {
    __shared__ float scratch[32];
    pdl_enter();
    bf16_t *x = src + (size_t)blockIdx.x * d;
    const bf16_t *y = res + (size_t)blockIdx.x * d;
    bf16_t *o = out + (size_t)blockIdx.x * d;
    const int bd = blockDim.x;
    float ss = 0.0f;
    for (int i0 = threadIdx.x; i0 < d; i0 += MODEL_NORM_PER * bd) {
        bf16_t xv[MODEL_NORM_PER], yv[MODEL_NORM_PER];
#pragma unroll
        for (int u = 0; u < MODEL_NORM_PER; u++)
            if (i0 + u * bd < d) {
                xv[u] = x[i0 + u * bd];
                yv[u] = y[i0 + u * bd];
            }
#pragma unroll
        for (int u = 0; u < MODEL_NORM_PER; u++)
            if (i0 + u * bd < d) {
                const bf16_t sum = f2bf(__fadd_rn(bf2f(xv[u]), bf2f(yv[u])));
                x[i0 + u * bd] = sum;
                const float v = bf2f(sum);
                ss = __fadd_rn(ss, __fmul_rn(v, v));
            }
    }
    ss = block_reduce(ss, scratch, OpAdd());
    const float mean = __fdiv_rn(ss, (float)d);
    const float r = (float)(1.0 / sqrt((double)__fadd_rn(mean, eps)));
    model_norm_scale(o, x, w, d, r); // each thread reads back its own writes
}

// ---- Add: element-wise, grid-stride. Out may alias A or B (each element
// is read before it is written, by the same thread). ----

__device__ __forceinline__ unsigned model_add2(unsigned a, unsigned b) {
    unsigned lo = f2bf(__fadd_rn(__uint_as_float(a << 16), __uint_as_float(b << 16)));
    unsigned hi = f2bf(__fadd_rn(__uint_as_float(a & 0xffff0000u), __uint_as_float(b & 0xffff0000u)));
    return lo | (hi << 16);
}

__global__ void model_add(bf16_t *out, const bf16_t *a, const bf16_t *b, long long n) {
    pdl_enter();
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((n & 7) == 0 && (((unsigned long long)out | (unsigned long long)a | (unsigned long long)b) & 15) == 0) {
        uint4 *o = reinterpret_cast<uint4 *>(out);
        const uint4 *x = reinterpret_cast<const uint4 *>(a);
        const uint4 *y = reinterpret_cast<const uint4 *>(b);
        for (long long i = first; i < (n >> 3); i += stride) {
            uint4 u = x[i], v = y[i], r;
            r.x = model_add2(u.x, v.x);
            r.y = model_add2(u.y, v.y);
            r.z = model_add2(u.z, v.z);
            r.w = model_add2(u.w, v.w);
            o[i] = r;
        }
    } else {
        for (long long i = first; i < n; i += stride) out[i] = f2bf(__fadd_rn(bf2f(a[i]), bf2f(b[i])));
    }
}

// ---- RoPE: one block per token, in place, rotate-half layout. ----

__global__ void model_rope(int *err, bf16_t *x, const int *positions, const bf16_t *cosT, const bf16_t *sinT,
                                      int heads, int d, int maxPos) {
    pdl_enter();
    const int t = blockIdx.x;
    const int p = positions[t];
    if (p < 0 || p >= maxPos) {
        if (threadIdx.x == 0) report(err, E_ROPE_POS, t, p, maxPos);
        return;
    }
    const int half = d / 2;
    const bf16_t *c = cosT + (size_t)p * half;
    const bf16_t *s = sinT + (size_t)p * half;
    bf16_t *tok = x + (size_t)t * heads * d;
    for (int k = threadIdx.x; k < heads * half; k += blockDim.x) {
        const int h = k / half, i = k - h * half;
        bf16_t *row = tok + (size_t)h * d;
        const float x1 = bf2f(row[i]), x2 = bf2f(row[i + half]);
        const float ci = bf2f(c[i]), si = bf2f(s[i]);
        row[i] = f2bf(__fsub_rn(bfround(__fmul_rn(x1, ci)), bfround(__fmul_rn(x2, si))));
        row[i + half] = f2bf(__fadd_rn(bfround(__fmul_rn(x2, ci)), bfround(__fmul_rn(x1, si))));
    }
}

// ---- QKV prep: a warp per (token, head). ----
//
// The per-head RMSNorm of q and k (when the weights are given), RoPE, and
// the cache write of k and v, in one launch: grid (tokens, head blocks),
// MODEL_PREP_WARPS heads a block, so that a token's heads run side by side
// (block y = 0 also copies the token's v to the cache and reports). Each
// head row goes through its warp: the sum of squares in lane order then a fixed shuffle tree,
// the normalised values (BF16, as model_rmsnorm writes them) in shared
// memory, then the rotation as model_rope does it, written back to q or k
// and, for k, to the cache slot. A bad position skips the token, a slot
// past the cache skips its cache write; both are reported.
constexpr int MODEL_PREP_WARPS = 4;
constexpr int MODEL_PREP_MAXD = 256;

__global__ void model_qkv_prep(int *err, bf16_t *q, bf16_t *k, const bf16_t *v, const bf16_t *qn, const bf16_t *kn, float eps,
                               const int *positions, const bf16_t *cosT, const bf16_t *sinT, bf16_t *ck, bf16_t *cv,
                               const int *slots, int qHeads, int kvHeads, int d, int maxPos, long long nslots) {
    __shared__ float buf[MODEL_PREP_WARPS][MODEL_PREP_MAXD];
    pdl_enter();
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool reporter = blockIdx.y == 0 && threadIdx.x == 0;
    const int p = positions[t];
    if (p < 0 || p >= maxPos) {
        if (reporter) report(err, E_ROPE_POS, t, p, maxPos);
        return;
    }
    const int slot = slots[t];
    const bool store = slot >= 0 && (long long)slot < nslots;
    if (slot >= 0 && !store && reporter) report(err, E_KV_SLOT, t, slot, (int)min(nslots, 2147483647LL));
    const int half = d / 2;
    const bf16_t *c = cosT + (size_t)p * half;
    const bf16_t *sn = sinT + (size_t)p * half;
    float *b = buf[warp];
    for (int h = blockIdx.y * MODEL_PREP_WARPS + warp; h < qHeads + kvHeads; h += gridDim.y * MODEL_PREP_WARPS) {
        const bool isK = h >= qHeads;
        bf16_t *row = isK ? k + ((size_t)t * kvHeads + (h - qHeads)) * d : q + ((size_t)t * qHeads + h) * d;
        const bf16_t *w = isK ? kn : qn;
        if (w != nullptr) {
            float ss = 0.0f;
            for (int i = lane; i < d; i += 32) {
                const float x = bf2f(row[i]);
                ss = __fadd_rn(ss, __fmul_rn(x, x));
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(MODEL_FULL, ss, o));
            const float mean = __fdiv_rn(ss, (float)d);
            const float r = (float)(1.0 / sqrt((double)__fadd_rn(mean, eps)));
            for (int i = lane; i < d; i += 32) b[i] = bfround(__fmul_rn(bf2f(w[i]), bfround(__fmul_rn(bf2f(row[i]), r))));
        } else {
            for (int i = lane; i < d; i += 32) b[i] = bf2f(row[i]);
        }
        __syncwarp();
        bf16_t *crow = ck + ((size_t)slot * kvHeads + (h - qHeads)) * d;
        for (int i = lane; i < half; i += 32) {
            const float x1 = b[i], x2 = b[i + half], ci = bf2f(c[i]), si = bf2f(sn[i]);
            const bf16_t o1 = f2bf(__fsub_rn(bfround(__fmul_rn(x1, ci)), bfround(__fmul_rn(x2, si))));
            const bf16_t o2 = f2bf(__fadd_rn(bfround(__fmul_rn(x2, ci)), bfround(__fmul_rn(x1, si))));
            row[i] = o1;
            row[i + half] = o2;
            if (isK && store) {
                crow[i] = o1;
                crow[i + half] = o2;
            }
        }
        __syncwarp(); // the warp's buffer is read before the next head fills it
    }
    if (store && blockIdx.y == 0) model_copy_row(cv + (size_t)slot * kvHeads * d, v + (size_t)t * kvHeads * d, kvHeads * d);
}

// ---- KVWrite: one block per token. ----
//
// A negative slot is padding and writes nothing. Two tokens naming the same
// slot break the contract; the device cannot detect it cheaply (it would
// need a pass over all tokens per token, or a scratch map), so their writes
// race and the slot holds one of them, possibly mixed per 16-byte chunk.
__global__ void model_kv_write(int *err, bf16_t *ck, bf16_t *cv, const bf16_t *k, const bf16_t *v,
                                          const int *slots, int row, long long nslots) {
    pdl_enter();
    const int t = blockIdx.x;
    const int s = slots[t];
    if (s < 0) return;
    if ((long long)s >= nslots) {
        if (threadIdx.x == 0) report(err, E_KV_SLOT, t, s, (int)min(nslots, 2147483647LL));
        return;
    }
    model_copy_row(ck + (size_t)s * row, k + (size_t)t * row, row);
    model_copy_row(cv + (size_t)s * row, v + (size_t)t * row, row);
}

// ---- Sampling and log-probs: one block per row. ----

// model_philox_uniform is internal/philox.Uniform, bit for bit:
// Philox4x32-10 of counter {position, sampleID, 0, 0} under the seed, then
// the top 53 bits of x0:x1 scaled by 2^-53 (both steps exact).
__device__ __forceinline__ double model_philox_uniform(unsigned long long seed, unsigned sampleID, unsigned position) {
    unsigned c0 = position, c1 = sampleID, c2 = 0u, c3 = 0u;
    unsigned k0 = (unsigned)seed, k1 = (unsigned)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const unsigned n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    const unsigned long long x = ((((unsigned long long)c0) << 32) | (unsigned long long)c1) >> 11;
    return (double)x * 0x1p-53;
}

// model_key maps a scaled logit (never NaN) to a uint32 that orders like the
// value: the sampling order "descending probability" is descending key
// (the probability is exp(s - max) / z, increasing in s). -0 is keyed as +0,
// since both have the same probability. The smallest key, that of -Inf, is
// 0x007fffff, so key 0 is below every token.
__device__ __forceinline__ unsigned model_key(float s) {
    const unsigned b = __float_as_uint(s == 0.0f ? 0.0f : s);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// model_unkey inverts model_key.
__device__ __forceinline__ float model_unkey(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Probabilities are summed for top-p as 2^-62 fixed point in uint64: integer
// sums are exact in any order, so shared-memory atomics stay deterministic,
// and 2^-62 per token is far below any float64 rounding that matters here.
__device__ __forceinline__ unsigned long long model_fix(double p) { return __double2ull_rn(p * 0x1p62); }

// model_prefix_match reports whether key agrees with prefix above bit
// shift+8 (the digits a radix pass at shift has already chosen).
__device__ __forceinline__ bool model_prefix_match(unsigned key, unsigned prefix, int shift) {
    return shift >= 24 || ((key ^ prefix) >> (shift + 8)) == 0u;
}

// model_block_exscan returns the exclusive prefix sum of v over the threads
// of the block in thread order, and the total in *total; the additions are
// in a fixed order (warp scans by shuffles, then the warp totals), so the
// result is deterministic for floating-point T too. scratch holds 33 values.
template <typename T>
__device__ __forceinline__ T model_block_exscan(T v, T *scratch, T *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const T inc = warp_scan(v);
    T ex = __shfl_up_sync(MODEL_FULL, inc, 1);
    if (lane == 0) ex = (T)0;
    __syncthreads(); // scratch may still be read by a previous call
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const T w = lane < nw ? scratch[lane] : (T)0;
        const T wi = warp_scan(w);
        T we = __shfl_up_sync(MODEL_FULL, wi, 1);
        if (lane == 0) we = (T)0;
        const T tot = __shfl_sync(MODEL_FULL, wi, 31);
        __syncwarp();
        scratch[lane] = we;
        if (lane == 0) scratch[32] = tot;
    }
    __syncthreads();
    *total = scratch[32];
    return warp == 0 ? ex : scratch[warp] + ex;
}

// model_select_bin, run by warp 0 over a 256-bin histogram: the largest
// bin b with above + sum(hist[b..255]) >= target. It stores b (-1 if even
// the whole histogram falls short) in *bin and the new above, above + the
// bins over b, in *newAbove.
__device__ __forceinline__ void model_select_bin(const unsigned long long *hist, unsigned long long above,
                                                 unsigned long long target, int *bin, unsigned long long *newAbove) {
    const int lane = threadIdx.x & 31;
    // Lane l owns bins 255-8l down to 248-8l: lane order is descending bins.
    unsigned long long local = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) local += hist[255 - 8 * lane - j];
    const unsigned long long inc = warp_scan(local);
    const unsigned ballot = __ballot_sync(MODEL_FULL, above + inc >= target);
    if (ballot == 0u) {
        if (lane == 0) {
            *bin = -1;
            *newAbove = above;
        }
        return;
    }
    const int l = __ffs(ballot) - 1;
    if (lane == l) {
        unsigned long long c = above + inc - local; // everything above this lane's bins
        for (int j = 0; j < 8; j++) {
            const int b = 255 - 8 * lane - j;
            if (c + hist[b] >= target) {
                *bin = b;
                *newAbove = c;
                break;
            }
            c += hist[b];
        }
    }
}

constexpr int MODEL_SAMPLE_THREADS = 1024;

// model_scaled is a sampled row's scaled logit, as kernels.SampleArgs
// defines it: (l - lmax) / T, each operation rounded to FP32 (the CPU
// backend's scaled). With lmax 0 and T 1 it is l itself.
__device__ __forceinline__ float model_scaled(float l, float lmax, float T) { return __fdiv_rn(__fsub_rn(l, lmax), T); }

// model_sample_greedy writes a greedy row's token (the greedy key's id:
// its low word holds ~id) and its logprob, logit - log sum exp (lse), the
// CPU's form.
__device__ __forceinline__ void model_sample_greedy(const float *row, unsigned long long best, double lse, int *token, float *logprob) {
    const int tok = (int)(0xffffffffu - (unsigned)(best & 0xffffffffull));
    *token = tok;
    *logprob = (float)((double)row[tok] - lse);
}

// model_sample_u is row r's uniform draw: Philox of its seed, sample id and
// position.
__device__ __forceinline__ double model_sample_u(const int *seeds, const int *sampleIDs, const int *positions, int r) {
    return model_philox_uniform((unsigned long long)(unsigned)seeds[2 * r] | ((unsigned long long)(unsigned)seeds[2 * r + 1] << 32),
                                (unsigned)sampleIDs[r], (unsigned)positions[r]);
}

// model_sample_scan is the samplers' pass 1 over logits lo .. hi - 1 of a
// row, by the whole block: whether one is NaN or +Inf, the largest, and the
// greedy key (largest key, then lowest id: the low word holds ~id), all
// order-free.
__device__ __forceinline__ void model_sample_scan(const float *row, int lo, int hi, float *scrF, int *scrI, unsigned long long *scrU,
                                                  int *badOut, float *lmaxOut, unsigned long long *bestOut) {
    int bad = 0;
    float lmax = -inf_f32();
    unsigned long long best = 0;
    for (int i = lo + (int)threadIdx.x; i < hi; i += blockDim.x) {
        const float l = row[i];
        if (l != l || l == inf_f32()) {
            bad = 1;
            continue;
        }
        lmax = fmaxf(lmax, l);
        const unsigned long long kk = ((unsigned long long)model_key(l) << 32) | (unsigned long long)(0xffffffffu - (unsigned)i);
        best = kk > best ? kk : best;
    }
    *badOut = block_reduce(bad, scrI, OpMax());
    *bestOut = block_reduce(best, scrU, OpMax());
    *lmaxOut = block_reduce(lmax, scrF, OpMax());
}

// model_sample_wide_row tells the rows model_sample_max and
// model_sample_wide serve, where model_sample is asked to (wide): rows with
// valid parameters that are greedy or keep every token (top k 0 or V, top
// p 1), the sampling of an RL rollout. model_sample still checks every
// row's parameters and serves the truncated ones.
__device__ __forceinline__ bool model_sample_wide_row(float temp, int tk, float tp, int V) {
    if (!(temp >= 0.0f) || temp == inf_f32() || !(tp > 0.0f && tp <= 1.0f) || tk < 0 || tk > V) return false;
    return temp == 0.0f || ((tk == 0 || tk == V) && tp >= 1.0f);
}

// The wide sampler splits a row into segments of MODEL_SAMPLE_SEG logits,
// a block each, so that one row spreads over the GPU instead of one
// multiprocessor (a 151936-wide row took 330 us in one block). The split
// depends on V alone, so a row's bits do not depend on the batch.
constexpr int MODEL_SAMPLE_SEG = 8192;
constexpr int MODEL_SAMPLE_WIDE_THREADS = 256;

// ModelSampleSeg is a segment's partial in the wide sampler's scratch
// (after a counter per row): its largest logit, whether it holds a NaN or
// +Inf, its greedy key and its weight sum.
struct ModelSampleSeg {
    double z;
    unsigned long long best;
    float lmax;
    int bad;
};

__device__ __forceinline__ ModelSampleSeg *model_sample_segs(void *scratch, int rowsCap, int r, int nseg) {
    return reinterpret_cast<ModelSampleSeg *>(reinterpret_cast<char *>(scratch) + ((rowsCap * 4 + 7) & ~7)) + (size_t)r * nseg;
}

// model_sample_max: grid (segments, rows). Pass 1 of model_sample over one
// segment: its validity, largest logit and greedy key.
__global__ void __launch_bounds__(MODEL_SAMPLE_WIDE_THREADS)
model_sample_max(const float *logits, const float *temperature, const int *topK, const float *topP, void *scratch, int rowsCap, int V) {
    __shared__ float scrF[33];
    __shared__ int scrI[33];
    __shared__ unsigned long long scrU[33];
    const int b = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
    if (!model_sample_wide_row(temperature[r], topK[r], topP[r], V)) return;
    const float *row = logits + (size_t)r * V;
    const int lo = b * MODEL_SAMPLE_SEG, hi = min(V, lo + MODEL_SAMPLE_SEG);
    int bad;
    float lmax;
    unsigned long long best;
    model_sample_scan(row, lo, hi, scrF, scrI, scrU, &bad, &lmax, &best);
    if (tid == 0) {
        ModelSampleSeg *e = model_sample_segs(scratch, rowsCap, r, gridDim.x) + b;
        e->bad = bad;
        e->best = best;
        e->lmax = lmax;
    }
}

// model_sample_seg_sum is the weight sum of logits lo .. hi - 1 of a row
// over the block: thread t adds its contiguous share in id order, the
// block adds the shares by model_block_exscan (start: the threads before
// t). w = exp(s - m), s the scaled logit.
__device__ __forceinline__ double model_sample_seg_sum(const float *row, int lo, int hi, float lshift, float T, double m, double *scrD,
                                                       double *start, int *t0, int *t1) {
    const int per = (hi - lo + blockDim.x - 1) / blockDim.x;
    *t0 = min(hi, lo + (int)threadIdx.x * per);
    *t1 = min(hi, *t0 + per);
    double w = 0.0;
    for (int i = *t0; i < *t1; i++) w += exp((double)model_scaled(row[i], lshift, T) - m);
    double total;
    *start = model_block_exscan(w, scrD, &total);
    return total;
}

// model_sample_wide: grid (segments, rows), after model_sample_max. Each
// block joins its row's segment maxima (max and or: no order), then adds
// its segment's weights exp(s - m) (model_sample's scaling); the row's last
// block to finish adds the segment sums in segment order (z), and draws:
// the first token, in id order, whose cumulative weight / z exceeds u
// (model_sample's draw over unnormalised weights), found segment by
// segment, then within the segment as model_sample does within a row.
// Logprobs as model_sample writes them.
__global__ void __launch_bounds__(MODEL_SAMPLE_WIDE_THREADS)
model_sample_wide(const float *logits, const float *temperature, const int *topK, const float *topP, const int *seeds,
                  const int *sampleIDs, const int *positions, int *tokens, float *logprobs, void *scratch, int rowsCap, int V) {
    __shared__ double scrD[33];
    __shared__ int scrI[33];
    __shared__ int lastS;
    __shared__ double zS;
    __shared__ int segS;
    __shared__ double cS;
    const int b = blockIdx.x, r = blockIdx.y, tid = threadIdx.x, nseg = gridDim.x;
    const float temp = temperature[r];
    if (!model_sample_wide_row(temp, topK[r], topP[r], V)) return;
    const float *row = logits + (size_t)r * V;
    ModelSampleSeg *segs = model_sample_segs(scratch, rowsCap, r, nseg);
    // The row's maximum, validity and greedy key, from every segment (each
    // thread reads them all: they are few).
    int bad = 0;
    float lmax = -inf_f32();
    unsigned long long best = 0;
    for (int j = 0; j < nseg; j++) {
        bad |= segs[j].bad;
        lmax = fmaxf(lmax, segs[j].lmax);
        best = segs[j].best > best ? segs[j].best : best;
    }
    if (bad || lmax == -inf_f32()) {
        if (b == 0 && tid == 0) {
            tokens[r] = -1;
            logprobs[r] = __int_as_float(0x7fc00000); // NaN
        }
        return;
    }
    const bool greedy = temp == 0.0f;
    const float T = greedy ? 1.0f : temp;
    const float lshift = greedy ? 0.0f : lmax;
    const double m = greedy ? (double)lmax : 0.0;
    const int lo = b * MODEL_SAMPLE_SEG, hi = min(V, lo + MODEL_SAMPLE_SEG);
    double start;
    int t0, t1;
    const double zb = model_sample_seg_sum(row, lo, hi, lshift, T, m, scrD, &start, &t0, &t1);
    if (tid == 0) segs[b].z = zb;
    __threadfence();
    __syncthreads();
    int *counter = reinterpret_cast<int *>(scratch) + r;
    if (tid == 0) lastS = atomicAdd(counter, 1) == nseg - 1;
    __syncthreads();
    if (!lastS) return;
    __threadfence();
    if (tid == 0) {
        *counter = 0; // ready for the next launch
        double z = 0.0;
        for (int j = 0; j < nseg; j++) z += __ldcg(&segs[j].z);
        zS = z;
    }
    __syncthreads();
    const double z = zS, logZ = log(z);
    if (greedy) {
        if (tid == 0) model_sample_greedy(row, best, m + logZ, &tokens[r], &logprobs[r]);
        return;
    }
    const double u = model_sample_u(seeds, sampleIDs, positions, r);
    if (tid == 0) {
        // The segment the draw falls in: the first whose end crosses u, or
        // (rounding) the last that holds any weight.
        double c = 0.0, cLast = 0.0;
        int seg = -1, segLast = 0;
        for (int j = 0; j < nseg; j++) {
            const double zj = __ldcg(&segs[j].z);
            if (zj > 0.0) {
                segLast = j;
                cLast = c;
                if ((c + zj) / z > u) {
                    seg = j;
                    break;
                }
            }
            c += zj;
        }
        segS = seg >= 0 ? seg : segLast;
        cS = seg >= 0 ? c : cLast;
    }
    __syncthreads();
    const int s0 = segS * MODEL_SAMPLE_SEG, s1 = min(V, s0 + MODEL_SAMPLE_SEG);
    model_sample_seg_sum(row, s0, s1, lshift, T, m, scrD, &start, &t0, &t1);
    int pick = V, lastKept = -1;
    double cum = cS + start;
    for (int i = t0; i < t1; i++) {
        const double w = exp((double)model_scaled(row[i], lshift, T) - m);
        if (w > 0.0) lastKept = i;
        cum += w;
        if (w > 0.0 && cum / z > u) {
            pick = i;
            break;
        }
    }
    pick = block_reduce(pick, scrI, model_OpMin());
    __syncthreads();
    // Rounding left no crossing inside: the segment's last token of weight
    // (every thread walked its whole share, so lastKept is its last).
    if (pick == V) lastKept = block_reduce(lastKept, scrI, OpMax());
    if (tid == 0) {
        const int tok = pick < V ? pick : lastKept;
        tokens[r] = tok;
        logprobs[r] = (float)((double)model_scaled(row[tok], lshift, T) - logZ); // the CPU's form (m is 0)
    }
}

// model_sample draws one token per row, as kernels.SampleArgs and the CPU
// backend's Sample document. Validation: temperature, top p, top k (a bad
// parameter is reported in the error word and the row skipped), then the
// logits: a row with a NaN or +Inf logit, or only -Inf ones, gets token -1
// and logprob NaN, and nothing is reported (it fails that row only).
// Greedy rows take the argmax (lowest id on ties).
//
// Otherwise scaled s = (logit - max logit) / T (model_scaled, FP32: at most
// 0, so no temperature overflows it), probabilities exp(s) / z in float64. The kept set is described by a key threshold kF and a tie count
// nF: token i is kept when key(s_i) > kF, or key(s_i) == kF and it is one of
// the first nF tokens (in id order) with that key. Without truncation kF =
// 0 keeps every token, with no sort and no selection pass.
//   - Top-k: a radix select over the keys (4 passes of 8 bits, counts)
//     finds the k-th largest key; the tokens above it are kept and the ties
//     at it are taken in ascending id order up to k.
//   - Top-p: a second radix select, now weighing each kept token with its
//     fixed-point probability, finds the largest key whose kept tokens at
//     or above it reach top p; at that key as many ties (lowest ids first)
//     are kept as it takes to reach top p: the shortest prefix of the
//     (probability desc, id asc) order.
//   - The draw walks the kept tokens in id order over contiguous per-thread
//     segments: float64 segment sums, a fixed-order block scan, and the
//     first token whose cumulative probability / kept total exceeds u.
// Ordering by the key rather than by the rounded float64 probability only
// differs where two different scaled logits round to the same float64
// probability; there the key keeps the exact order.
__global__ void __launch_bounds__(MODEL_SAMPLE_THREADS)
model_sample(int *err, const float *logits, const float *temperature, const int *topK, const float *topP,
             const int *seeds, const int *sampleIDs, const int *positions, int *tokens, float *logprobs, int V, int wide) {
    __shared__ double scrD[33];
    __shared__ float scrF[33];
    __shared__ unsigned long long scrU[33];
    __shared__ int scrI[33];
    __shared__ unsigned long long hist[256];
    __shared__ unsigned long long wbuf[MODEL_SAMPLE_THREADS];
    __shared__ int selBin;
    __shared__ unsigned long long selAbove;

    const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const float *row = logits + (size_t)r * V;

    // Parameters, in the CPU's order.
    const float temp = temperature[r];
    const float tp = topP[r];
    const int tk = topK[r];
    if (!(temp >= 0.0f) || temp == inf_f32()) {
        if (tid == 0) report(err, E_SAMPLE_TEMP, r, __float_as_int(temp), 0);
        return;
    }
    if (!(tp > 0.0f && tp <= 1.0f)) {
        if (tid == 0) report(err, E_SAMPLE_TOPP, r, __float_as_int(tp), 0);
        return;
    }
    if (tk < 0 || tk > V) {
        if (tid == 0) report(err, E_SAMPLE_TOPK, r, tk, V);
        return;
    }
    const bool greedy = temp == 0.0f;
    if (wide && model_sample_wide_row(temp, tk, tp, V)) return; // model_sample_wide's row

    // Pass 1: validity, the largest logit, and the greedy argmax (largest
    // key, then lowest id: the low word holds ~id).
    int bad;
    float lmax;
    unsigned long long best;
    model_sample_scan(row, 0, V, scrF, scrI, scrU, &bad, &lmax, &best);
    if (bad || lmax == -inf_f32()) {
        if (tid == 0) {
            tokens[r] = -1;
            logprobs[r] = __int_as_float(0x7fc00000); // NaN
        }
        return;
    }
    // Greedy works on the raw logits (s = logit, max lmax); sampling on
    // model_scaled, whose maximum is exactly 0.
    const float T = greedy ? 1.0f : temp;
    const float lshift = greedy ? 0.0f : lmax;
    const double m = greedy ? (double)lmax : 0.0;

    // Pass 2: z = sum exp(s - max), float64, fixed order.
    double z = 0.0;
    for (int i = tid; i < V; i += blockDim.x) z += exp((double)model_scaled(row[i], lshift, T) - m);
    z = block_reduce(z, scrD, OpAdd());
    const double logZ = log(z);

    if (greedy) {
        if (tid == 0) model_sample_greedy(row, best, m + logZ, &tokens[r], &logprobs[r]);
        return;
    }

    // Contiguous per-thread segments, for every pass that needs id order.
    const int seg = (V + blockDim.x - 1) / blockDim.x;
    const int b0 = min(V, tid * seg), b1 = min(V, b0 + seg);

    unsigned kF = 0u; // kept: key > kF, or key == kF among the first nF such tokens
    int nF = 0;

    // Top-k: the k-th largest key. Counts are aggregated per warp
    // (__match_any_sync) before the shared atomics.
    if (tk > 0 && tk < V) {
        unsigned prefix = 0u;
        unsigned long long above = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            for (int base = 0; base < V; base += blockDim.x) { // uniform trip count: whole warps reach the match
                const int i = base + tid;
                const bool valid = i < V;
                const unsigned key = valid ? model_key(model_scaled(row[i], lshift, T)) : 0u;
                const bool match = valid && model_prefix_match(key, prefix, shift);
                const unsigned bin = match ? ((key >> shift) & 255u) : 256u;
                const unsigned mask = __match_any_sync(MODEL_FULL, bin);
                if (match && lane == __ffs(mask) - 1) atomicAdd(&hist[bin], (unsigned long long)__popc(mask));
            }
            __syncthreads();
            if (tid < 32) model_select_bin(hist, above, (unsigned long long)tk, &selBin, &selAbove);
            __syncthreads();
            // k <= V tokens always reach the target at the first pass, and
            // the chosen bin carries it to the next.
            prefix |= (unsigned)selBin << shift;
            above = selAbove;
        }
        kF = prefix;
        nF = tk - (int)above; // count(key > kF) < k <= count(key >= kF)
    }

    // myTies counts this thread's tokens with key kF; tieBase is the number
    // before its segment, so a token's rank among the ties is known while
    // walking the segment in order.
    int tieBase = 0, tieTotal = 0;
    auto countTies = [&]() {
        int mine = 0;
        for (int i = b0; i < b1; i++) mine += model_key(model_scaled(row[i], lshift, T)) == kF;
        tieBase = model_block_exscan(mine, scrI, &tieTotal);
    };

    // Top-p (top p = 1 keeps every token of the top-k set, however the sum
    // rounds).
    if (tp < 1.0f) {
        countTies();
        const unsigned long long target = __double2ull_ru((double)tp * 0x1p62); // cum >= p, in fixed point
        unsigned prefix = 0u;
        unsigned long long above = 0;
        bool found = true;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            int seen = 0;
            for (int j = 0; j < seg; j++) { // uniform trip count: whole warps reach the match
                const int i = b0 + j;
                const bool valid = i < b1;
                const float s = valid ? model_scaled(row[i], lshift, T) : 0.0f;
                const unsigned key = model_key(s);
                const bool kept = valid && (key > kF || (key == kF && tieBase + seen < nF));
                if (valid && key == kF) seen++;
                const bool match = kept && model_prefix_match(key, prefix, shift);
                const unsigned bin = match ? ((key >> shift) & 255u) : 256u;
                wbuf[tid] = match ? model_fix(exp((double)s - m) / z) : 0ull;
                const unsigned mask = __match_any_sync(MODEL_FULL, bin);
                __syncwarp();
                if (match && lane == __ffs(mask) - 1) {
                    unsigned long long sum = 0;
                    for (unsigned mm = mask; mm != 0u; mm &= mm - 1u) sum += wbuf[(tid & ~31) + __ffs(mm) - 1];
                    atomicAdd(&hist[bin], sum);
                }
                __syncwarp(); // wbuf is rewritten next iteration
            }
            __syncthreads();
            if (tid < 32) model_select_bin(hist, above, target, &selBin, &selAbove);
            __syncthreads();
            if (selBin < 0) { // the kept tokens never reach top p: keep them all
                found = false;
                break;
            }
            prefix |= (unsigned)selBin << shift;
            above = selAbove;
        }
        if (found) {
            // Every token with key `prefix` has the same probability q; the
            // shortest prefix takes the fewest ties that reach the target
            // (at most the kept ones there, which reach it by selection).
            const unsigned long long qf = model_fix(exp((double)model_unkey(prefix) - m) / z);
            const unsigned long long need = (target - above + qf - 1) / qf;
            kF = prefix;
            nF = (int)need;
        }
    }

    // The draw. Pass S: each segment's kept probability sum and last kept
    // token; a fixed-order scan gives each segment's start and the total.
    countTies();
    double segSum = 0.0;
    int lastKept = -1;
    {
        int seen = 0;
        for (int i = b0; i < b1; i++) {
            const float s = model_scaled(row[i], lshift, T);
            const unsigned key = model_key(s);
            const bool kept = key > kF || (key == kF && tieBase + seen < nF);
            if (key == kF) seen++;
            if (kept) {
                segSum += exp((double)s - m) / z;
                lastKept = i;
            }
        }
    }
    double total;
    const double start = model_block_exscan(segSum, scrD, &total);
    lastKept = block_reduce(lastKept, scrI, OpMax());
    const double u = model_sample_u(seeds, sampleIDs, positions, r);
    // Pass D: the first kept token whose cumulative probability / total
    // exceeds u. (A zero-probability token never qualifies, even where the
    // segments' separately rounded sums disagree at a boundary.)
    int pick = V;
    {
        int seen = 0;
        double cum = start;
        for (int i = b0; i < b1; i++) {
            const float s = model_scaled(row[i], lshift, T);
            const unsigned key = model_key(s);
            const bool kept = key > kF || (key == kF && tieBase + seen < nF);
            if (key == kF) seen++;
            if (kept) {
                const double p = exp((double)s - m) / z;
                cum += p;
                if (p > 0.0 && cum / total > u) {
                    pick = i;
                    break;
                }
            }
        }
    }
    pick = block_reduce(pick, scrI, model_OpMin());
    if (tid == 0) {
        const int tok = pick < V ? pick : lastKept; // rounding left no crossing: the last kept token
        tokens[r] = tok;
        logprobs[r] = (float)((double)model_scaled(row[tok], lshift, T) - logZ); // the CPU's form (m is 0)
    }
}

constexpr int MODEL_LOGPROBS_THREADS = 512;

// model_logprobs: log softmax(logits)[token] in float64, one block per row.
__global__ void __launch_bounds__(MODEL_LOGPROBS_THREADS)
model_logprobs(int *err, const float *logits, const int *tokens, float *logprobs, int V) {
    __shared__ double scrD[32];
    __shared__ int scrI[32];
    const int r = blockIdx.x, tid = threadIdx.x;
    const float *row = logits + (size_t)r * V;
    const int tok = tokens[r];
    if (tok < 0 || tok >= V) {
        if (tid == 0) report(err, E_LOGPROBS_TOKEN, r, tok, V);
        return;
    }
    int badIdx = V;
    float lmax = -inf_f32();
    for (int i = tid; i < V; i += blockDim.x) {
        const float l = row[i];
        if (l != l || l == inf_f32()) badIdx = min(badIdx, i);
        else lmax = fmaxf(lmax, l);
    }
    badIdx = block_reduce(badIdx, scrI, model_OpMin());
    const double m = block_reduce((double)lmax, scrD, OpMax());
    if (badIdx < V) {
        if (tid == 0) report(err, E_LOGPROBS_LOGIT, r, badIdx, __float_as_int(row[badIdx]));
        return;
    }
    if (m == -(double)inf_f32()) {
        if (tid == 0) report(err, E_LOGPROBS_ALLNEG, r, 0, 0);
        return;
    }
    double z = 0.0;
    for (int i = tid; i < V; i += blockDim.x) z += exp((double)row[i] - m);
    z = block_reduce(z, scrD, OpAdd());
    if (tid == 0) logprobs[r] = (float)((double)row[tok] - (m + log(z)));
}

// ---- ScatterBF16: one block per span of a sparse BF16 delta (kernels/delta.go). ----
//
// A span is MODEL_SPAN_WORDS ints (DeltaSpan.Words): its first element
// (low, high word), its length, its form, its count of values, its first
// mask word and its first value. The block checks the whole span before it
// writes: a span that breaks a rule writes nothing and is reported. An index
// list is written by a block-stride loop. A bitmap (at most 2048 words) is
// split into MODEL_SCATTER_PER words a thread; the set bits are counted, the
// counts scanned in thread order to give each thread the index of its first
// value, and each thread writes its elements in increasing order. Spans do
// not overlap, so the writes of different blocks never meet.
constexpr int MODEL_SCATTER_THREADS = 256;
constexpr int MODEL_SPAN_WORDS = 8;
constexpr int MODEL_SPAN_ELEMS = 65536;
constexpr int MODEL_SCATTER_PER = MODEL_SPAN_ELEMS / 32 / MODEL_SCATTER_THREADS;

__global__ void __launch_bounds__(MODEL_SCATTER_THREADS)
model_scatter_bf16(int *err, bf16_t *dst, long long len, const int *spans, const unsigned *masks, long long nmasks,
                   const bf16_t *values, long long nvalues) {
    __shared__ int warpSums[MODEL_SCATTER_THREADS / 32];
    const int s = blockIdx.x, tid = threadIdx.x;
    const int *d = spans + (size_t)s * MODEL_SPAN_WORDS;
    const long long start = (long long)(unsigned)d[0] | ((long long)d[1] << 32);
    const int n = d[2], form = d[3], count = d[4], mask = d[5], value = d[6];
    const long long words = form == 1 ? (long long)(n + 31) / 32 : ((long long)count + 1) / 2;
    if (!(n >= 1 && n <= MODEL_SPAN_ELEMS && start >= 0 && start <= len - n && (form == 0 || form == 1) &&
          count >= 0 && count <= n && mask >= 0 && mask + words <= nmasks && value >= 0 &&
          value + (long long)count <= nvalues)) {
        if (tid == 0) report(err, E_DELTA_SPAN, s, n, count);
        return;
    }
    bf16_t *out = dst + start;
    const bf16_t *val = values + value;
    if (form == 0) {
        const unsigned short *idx = reinterpret_cast<const unsigned short *>(masks + mask);
        int bad = -1;
        for (int k = tid; k < count; k += MODEL_SCATTER_THREADS) {
            const int j = idx[k];
            if (j >= n || (k > 0 && (int)idx[k - 1] >= j)) bad = k;
        }
        if (__syncthreads_or(bad >= 0)) {
            if (bad >= 0) report(err, E_DELTA_INDEX, s, bad, idx[bad]);
            return;
        }
        for (int k = tid; k < count; k += MODEL_SCATTER_THREADS) out[idx[k]] = val[k];
        return;
    }
    const unsigned *bm = masks + mask;
    const int nw = (n + 31) / 32, w0 = tid * MODEL_SCATTER_PER;
    int mine = 0, stray = 0;
    for (int w = w0; w < w0 + MODEL_SCATTER_PER && w < nw; ++w) {
        const unsigned b = bm[w];
        if (w == nw - 1 && (n & 31)) stray |= (b >> (n & 31)) != 0; // bits past the span's end
        mine += __popc(b);
    }
    const int lane = tid & 31, warp = tid >> 5;
    const int incl = warp_scan(mine);
    if (lane == 31) warpSums[warp] = incl;
    __syncthreads();
    int before = incl - mine, total = 0;
    for (int i = 0; i < MODEL_SCATTER_THREADS / 32; ++i) {
        if (i < warp) before += warpSums[i];
        total += warpSums[i];
    }
    if (__syncthreads_or(stray) || total != count) {
        if (tid == 0) report(err, E_DELTA_BITMAP, s, total, count);
        return;
    }
    int k = before;
    for (int w = w0; w < w0 + MODEL_SCATTER_PER && w < nw; ++w) {
        for (unsigned b = bm[w]; b != 0; b &= b - 1) out[32 * w + __ffs((int)b) - 1] = val[k++];
    }
}

} // namespace rw
