// Hopper-only PTX (sm_90a): wgmma descriptors, issue, fences and waits,
// and mbarriers. Only gemm_ws.cu includes it, and the backend compiles that
// unit for sm_90a alone (kernels/cuda/sources.go), so nothing here needs a
// guard for other targets.
#ifndef RW_WGMMA_CUH
#define RW_WGMMA_CUH


namespace rw {

// gw_desc is the wgmma descriptor of a K-major operand at shared address
// a with the 128-byte swizzle: 8-row groups 1024 bytes apart (the stride
// byte offset; the leading one is unused when a step's K lies in one row).
__device__ __forceinline__ unsigned long long gw_desc(unsigned a) {
    return (unsigned long long)((a & 0x3FFFF) >> 4) | 1ull << 16 | (unsigned long long)(1024 >> 4) << 32 | 1ull << 62;
}

// gw_mma issues d += A * B^T for a 64 x 16 A and a 128 x 16 B (descriptors
// da, db), asynchronously: wgmma m64n128k16, FP32 accumulation.
__device__ __forceinline__ void gw_mma(float (&d)[16][4], unsigned long long da, unsigned long long db) {
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
}

__device__ __forceinline__ void gw_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void gw_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// gw_wait waits until at most N of this warpgroup's MMA groups are
// pending; the empty asm statements keep the compiler from touching the
// accumulators before then.
template <int N>
__device__ __forceinline__ void gw_wait(float (&d)[16][4]) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
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

} // namespace rw

#endif // RW_WGMMA_CUH
