// Package policy is the model and its generation engine: Hugging Face
// config.json and safetensors loading (Qwen3-MoE, Mixtral, and a squared-ReLU
// expert variant), the forward pass (embeddings, RMSNorm, grouped-query
// attention with RoPE over a paged KV cache, the moe layers, the LM head),
// sampling, scoring, and the continuous-batching loop with its step boundary
// for weight commits.
//
// A Model owns every buffer it uses, allocated once in NewModel on one
// backend, and is driven by one goroutine at a time: the Engine's loop, which
// owns the backend while it runs. Weights reach a Model only through
// Model.Resolve, which maps a Hugging Face tensor name to its destination
// buffer and byte layout; the checkpoint loader and the refit receiver both
// write through it.
package policy
