// Compile unit: NVFP4 quantization (per row, and per matrix in three
// kernels: amax, blocks, scales) and the fill kernel the per-matrix path
// zeroes its amax words with.
#include "numerics.cuh"
#include "reduce.cuh"
#include "ptx.cuh"
#include "quant.cuh"

namespace rw {

__global__ void fill_u32(unsigned *p, int n, unsigned v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}

// quant_amax folds max|x| of matrix blockIdx.y (per elements) into
// amax[blockIdx.y] as FP32 bits. BF16 magnitudes shifted left by 16 are
// their FP32 bits, which order like the values (NaN above Inf, so NaN
// propagates), and an integer atomic max is order-free: deterministic.
__global__ void quant_amax(const bf16_t *src, unsigned *amax, long long per, int vec) {
    __shared__ unsigned scratch[32];
    unsigned v = amax_span(src + (long long)blockIdx.y * per, per, (long long)blockIdx.x * blockDim.x + threadIdx.x,
                           (long long)gridDim.x * blockDim.x, vec);
    v = block_reduce(v, scratch, OpMax());
    if (threadIdx.x == 0) atomicMax(&amax[blockIdx.y], v << 16);
}

// quant_scales turns each matrix's amax (FP32 bits) into its S_dec.
__global__ void quant_scales(float *scale, int mats) {
    int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= mats) return;
    float senc, sdec;
    encode_scale(scale[m], &senc, &sdec);
    scale[m] = sdec;
}

// quant_rows: a block per row (quant_row_block); given is null (per row)
// or the tensor's S_dec (per tensor).
__global__ void quant_rows(const bf16_t *src, unsigned char *packed, unsigned char *scales, float *scale, int rows, int k, int kp,
                           int vec, const float *given) {
    pdl_enter();
    if (blockIdx.x < rows) quant_row_block(src, packed, scales, scale, blockIdx.x, k, kp, vec, given);
}

// quant_blocks quantizes matrix blockIdx.y (of rowsPerMat rows, blocksPer
// = rowsPerMat * kp/16 16-element blocks) with its global scale, one block
// per thread and step: coalesced 32-byte reads, 8-byte writes. amax[m]
// holds the matrix amax as FP32 bits; each thread turns it into the scales
// (two IEEE divisions, spread over the several blocks it takes) and the
// block fills the enc table once.
__global__ void quant_blocks(const bf16_t *src, unsigned char *packed, unsigned char *scales, const unsigned *amax,
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

} // namespace rw
