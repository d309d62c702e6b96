// Package nvfp4 is the bit-exact NVFP4 codec of docs/NVFP4.md, in pure Go.
//
// NVFP4 stores a matrix as 4-bit E2M1 codes in blocks of 16 consecutive
// elements along a row, one E4M3 block-scale byte per block, and one FP32
// decode scale per matrix (weights: one per expert) or per row (per-token
// activations). Every arithmetic step below is a single binary32 operation
// rounded to nearest-even, in the order the recipe gives, so the results match
// Transformer Engine's exact quantizer and this project's CUDA kernels bit for
// bit: packed codes, block-scale bytes and FP32 scales.
//
// The functions are pure and work on caller-owned slices; they are safe for
// concurrent use on disjoint outputs. Inputs are BF16 bit patterns because
// every tensor this project quantizes is BF16 (weights, and activations that
// were rounded to BF16 first).
package nvfp4
