// Package moe is the routed mixture-of-experts layer: router, top-k,
// expert-sorted permutation, two grouped expert GEMMs with the activation
// fused, and the deterministic finalize, run through the kernels op set.
//
// The BF16 expert stacks are the canonical weights and the refit
// destination. A recipe decides what the expert GEMMs read: the BF16 stacks
// themselves (RecipeBF16, the baseline), or NVFP4 copies built from them
// (RecipePerToken: NVFP4 x NVFP4 with per-token activation scales;
// RecipeWeightOnly: BF16 activations x NVFP4 weights). Requantize rebuilds the
// copies from the stacks into the same buffers, so graphs captured over them
// stay valid after a refit.
//
// A Layer allocates every buffer it will ever use in New (weights, copies,
// workspaces for up to Config.MaxTokens tokens) and frees them in Close. It is
// not safe for concurrent use: the goroutine that owns the backend calls
// Forward and Requantize, one at a time. The one exception is StageAmax,
// which the refit path calls from its own goroutine while the layer is open
// (it issues work on the backend's staging path and bumps an atomic
// counter); the RequantizeHinted that uses its hint must come after it.
package moe
