// Package refit is the weight-version protocol over NATS JetStream
// (PROTOCOL.md): the Publisher, which streams a BF16 safetensors checkpoint
// (or a subset, or a delta on the previous version: DeltaSource) as one
// version, reading it in chunks (Source), and the Receiver in the worker, which
// verifies every chunk as it arrives, writes it straight into the resident
// BF16 expert stacks or into staging buffers, validates the version as a
// whole, commits it at the engine's step boundary (staged copies, in-place
// requantization of the touched experts, version bump) and reports per-layer
// timings. A version may come in parts, over connections (and servers)
// of their own, and a version in parts may go out live first: over core
// NATS, paced by the workers' progress reports (flowGate), sealed, and
// only then stored, so that workers commit at what core NATS carries.
//
// A Receiver's Run owns it; it needs a backend that implements
// kernels.Stager (bytes written from its goroutine while the engine's loop
// runs) and it commits only through Engine.AtBoundary, so generation pauses
// just for the commit. A Publisher serialises its own Publish calls; one
// process should publish a given model.
package refit
