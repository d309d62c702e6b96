// Package cudagraph is the capture/replay abstraction the decode step runs
// through: one captured graph per batch-size bucket, replayed with inputs
// written into fixed buffers, with a registry of the buffers a capture
// references and a check that none was reallocated since.
//
// Status: not implemented yet; it is the subject of the policy/engine issue
// (CPU implementation) and the CUDA backend issue (real CUDA graphs).
package cudagraph
