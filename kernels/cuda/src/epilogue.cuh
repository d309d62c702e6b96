// Epilogues of the grouped GEMMs: the K split's cluster reduction
// (ks2_add) and g5_epilogue (scales, activation fusion, BF16 rounding,
// stores or the atomic finalize's scatter). See invariance.cuh.
#ifndef RW_EPILOGUE_CUH
#define RW_EPILOGUE_CUH

#include "numerics.cuh"
#include "errors.cuh"
#include "ptx.cuh"

namespace rw {

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

} // namespace rw

#endif // RW_EPILOGUE_CUH
