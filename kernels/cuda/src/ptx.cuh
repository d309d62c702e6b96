// PTX wrappers: programmatic dependent launch, cp.async, mma.sync and the
// compile-time type choice the streamed kernels use for their operands.
#ifndef RW_PTX_CUH
#define RW_PTX_CUH


namespace rw {

// Programmatic dependent launch (the registry's pdl kernels,
// kernels/cuda/registry.go). pdl_wait holds the calling thread until every
// kernel before this one on the stream has finished and its writes are
// visible (at once where the launch had no programmatic dependency): a
// kernel touches global memory only after it, but for what no kernel of the
// chain before it writes (the narrow dense GEMMs' weights: gemm_dense.cu).
// pdl_trigger lets the next such kernel on the stream launch its blocks
// once every block of this one has triggered or exited; they run up to
// their own pdl_wait, so what overlaps is the launch, the block start-up
// and any work before the wait that reads no global memory.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// pdl_enter begins the layer's short kernels: wait first, then trigger, so
// the next kernel's blocks arrive only once all before this one have
// finished. (Triggering first lets the whole chain's blocks become
// resident while the first kernel runs: measured on the H200, 19% slower
// at one token.)
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_trigger();
}

__device__ __forceinline__ void mma16816(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// cp_async copies 16 or 8 bytes (zero-filled where !full). The 16-byte
// copies carry the weight streams: a row of a 128-K chunk is 64 bytes
// (NVFP4, four lanes of 16) of a 128-byte line the next chunk reads the
// other half of, so they ask L2 to fetch the whole line (.L2::128B).
// Measured on the H200 (the whole layer, bench moe): the NVFP4 layer 9-10%
// faster at 8-128 tokens, 0.5-1.6% at 1 and 512 tokens; the BF16 recipe
// 3-5% faster. .L2::256B made the BF16 recipe 6-7% slower; the hint on the
// 4- and 8-byte copies changed nothing.
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

} // namespace rw

#endif // RW_PTX_CUH
