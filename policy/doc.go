// Package policy is the model: Hugging Face config.json and safetensors
// loading (Qwen3-MoE, Mixtral, and squared-ReLU experts), the forward pass
// (embeddings, RMSNorm, grouped-query attention with RoPE over a paged KV
// cache, the moe layers, the LM head), sampling and the continuous-batching
// generation loop with its step boundary for weight commits.
//
// Status: not implemented yet; it is the subject of the policy/engine issue.
// The ops it needs are defined in kernels (kernels.ModelOps) and implemented
// by the CPU backend.
package policy
