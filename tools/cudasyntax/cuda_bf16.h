// Stand-in for the CUDA headers, for tools/cudasyntax/check.sh only: it
// declares what the kernels use so that g++ -fsyntax-only can parse and
// instantiate them. Nothing here runs.
#pragma once
#include <cstdint>
#include <cmath>
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __shared__
#define __constant__ static
#define __restrict__
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __align__(n) __attribute__((aligned(n)))
struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
extern uint3 threadIdx, blockIdx; extern dim3 blockDim, gridDim;
extern int warpSize;
struct uint2 { unsigned x, y; }; struct uint4 { unsigned x, y, z, w; }; struct int2 { int x, y; }; struct int4 { int x, y, z, w; };
struct float2 { float x, y; }; struct float4 { float x, y, z, w; }; struct ushort2 { unsigned short x, y; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline int2 make_int2(int a, int b) { return {a, b}; }
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct __nv_bfloat16 { unsigned short x; }; struct __nv_bfloat162 { __nv_bfloat16 x, y; };
__nv_bfloat16 __float2bfloat16_rn(float); float __bfloat162float(__nv_bfloat16);
template <typename T> T __ldg(const T *p) { return *p; }
template <typename T> T __ldcg(const T *p) { return *p; }
template <typename T> T __shfl_xor_sync(unsigned, T v, int, int = 32) { return v; }
template <typename T> T __shfl_sync(unsigned, T v, int, int = 32) { return v; }
template <typename T> T __shfl_down_sync(unsigned, T v, int, int = 32) { return v; }
template <typename T> T __shfl_up_sync(unsigned, T v, int, int = 32) { return v; }
template <typename T> T atomicAdd(T *, T); template <typename T> T atomicMax(T *, T); template <typename T> T atomicMin(T *, T);
template <typename T> T atomicCAS(T *, T, T); template <typename T> T atomicExch(T *, T); template <typename T> T atomicOr(T *, T);
void __syncthreads(); void __syncwarp(unsigned = 0xffffffffu); void __threadfence(); void __threadfence_block(); void __trap();
int __syncthreads_or(int); int __syncthreads_and(int); int __syncthreads_count(int);
unsigned __ballot_sync(unsigned, int); int __any_sync(unsigned, int); int __all_sync(unsigned, int);
float __int_as_float(int); int __float_as_int(float); float __uint_as_float(unsigned); unsigned __float_as_uint(float);
float __fmul_rn(float, float); float __fadd_rn(float, float); float __fsub_rn(float, float); float __fdiv_rn(float, float);
float __fmaf_rn(float, float, float); float __frcp_rn(float); float __fsqrt_rn(float); float __expf(float); float __logf(float);
double __dmul_rn(double, double); double __dadd_rn(double, double);
int __clz(int); int __popc(unsigned); int __ffs(int); unsigned __brev(unsigned); int __clzll(long long); int __popcll(unsigned long long);
unsigned __byte_perm(unsigned, unsigned, unsigned); unsigned __funnelshift_l(unsigned, unsigned, unsigned); unsigned __funnelshift_r(unsigned, unsigned, unsigned);
int __float2int_rn(float); int __float2int_rz(float); unsigned __float2uint_rn(float); float __int2float_rn(int); float __uint2float_rn(unsigned);
int __mul24(int, int); int __umulhi(unsigned, unsigned); long long clock64(); unsigned __activemask();
size_t __cvta_generic_to_shared(const void *);
using std::min; using std::max;
inline int min(int a, int b) { return a < b ? a : b; } inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; } inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; } inline long long max(long long a, long long b) { return a > b ? a : b; }
unsigned __vmaxu2(unsigned, unsigned); unsigned __vminu2(unsigned, unsigned);
unsigned long long __double2ull_rn(double); unsigned long long __double2ull_ru(double); unsigned long long __double2ull_rd(double);
template <typename T> unsigned __match_any_sync(unsigned, T);
void __nanosleep(unsigned); unsigned __reduce_max_sync(unsigned, unsigned); unsigned __reduce_min_sync(unsigned, unsigned);
unsigned __reduce_add_sync(unsigned, unsigned); unsigned __reduce_or_sync(unsigned, unsigned);
__nv_bfloat162 __float2bfloat162_rn(float); __nv_bfloat162 __floats2bfloat162_rn(float, float); __nv_bfloat162 __hmul2(__nv_bfloat162, __nv_bfloat162);
__nv_bfloat162 __hfma2(__nv_bfloat162, __nv_bfloat162, __nv_bfloat162); __nv_bfloat162 __hadd2(__nv_bfloat162, __nv_bfloat162);
float2 __bfloat1622float2(__nv_bfloat162); __nv_bfloat162 __halves2bfloat162(__nv_bfloat16, __nv_bfloat16);
