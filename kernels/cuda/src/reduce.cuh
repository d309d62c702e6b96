// Block and warp reductions in a fixed order, so a result never depends on
// timing.
#ifndef RW_REDUCE_CUH
#define RW_REDUCE_CUH


namespace rw {

// Block-wide reductions over blockDim.x threads (a multiple of 32, at most
// 1024) in a fixed tree, so the result never depends on timing. scratch
// holds 32 values. Every thread gets the result.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T *scratch, Op op) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads(); // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        T acc = scratch[0];
        for (int i = 1; i < nw; i++) acc = op(acc, scratch[i]);
        scratch[0] = acc;
    }
    __syncthreads();
    return scratch[0];
}

// warp_scan returns the inclusive prefix sum of v over the lanes of a full
// warp, in lane order, by a fixed shuffle tree (deterministic for floating
// point too).
template <typename T> __device__ __forceinline__ T warp_scan(T v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v = v + t;
    }
    return v;
}

struct OpAdd {
    template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct OpMax {
    template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};

} // namespace rw

#endif // RW_REDUCE_CUH
