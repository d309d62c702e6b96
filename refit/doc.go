// Package refit is the weight-version protocol over NATS: the publisher that
// streams a BF16 checkpoint (or a subset) as one version, and the receiver
// in the worker that verifies chunks, writes them into the resident BF16
// stacks and staging, validates the version as a whole, commits it at the
// engine's step boundary (staged copies, in-place requantization of the
// touched experts, version bump) and times every refit per layer and phase.
//
// Status: not implemented yet; it is the subject of the refit issue, which
// builds on moe.Layer.Requantize (in-place NVFP4 rebuild) from this commit.
package refit
