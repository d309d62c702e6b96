// Package stfile reads and writes safetensors files for the rollout worker's
// offline tools (for example `rollout-worker quantize`).
//
// # Reading
//
// Open maps a file read-only into memory (syscall.Mmap on Linux and macOS; on
// other systems the whole file is read into a heap buffer instead) and parses
// its header (the format github.com/nlpodyssey/safetensors defines, plus the
// F8_E4M3 and F8_E5M2 types it lacks). The header is treated as
// untrusted input: every tensor's byte range is checked against the file's
// size, so a malformed or truncated file gives an error, never a panic or an
// out-of-range slice.
//
// Ownership rules:
//
//   - Tensor.Data returned by File.Tensor aliases the mapping. It is
//     read-only (writing to it faults on Linux and macOS) and it is valid only
//     until File.Close; copy what must outlive the File.
//   - File.Close unmaps the file. It is idempotent; after it, Tensor returns
//     an error. Close must not race with other calls on the same File, but
//     Names, Metadata and Tensor may be called concurrently with each other.
//   - Another process truncating a mapped file makes later reads of the
//     mapping fault (SIGBUS). Tools open files they (or a finished job) wrote
//     and do not share them with writers.
//
// # Streaming
//
// OpenReader reads and checks only the header (the same checks as Open)
// and hands out each tensor's place in the file (TensorInfo); its bytes are
// read with Reader.ReadAt (pread). No page of the file is mapped, so
// nothing of it counts in the process's resident memory: what a process
// that streams checkpoints larger than its memory uses (the refit
// publisher). It works the same on every system.
//
// # Writing
//
// Write serializes tensors with safetensors.SerializeToWriter (files holding
// F8_E4M3 or F8_E5M2 tensors in the same layout by its own encoder) into a
// temporary file in the destination's directory, syncs it and renames it over
// the destination, so readers see either the old file or the complete new one
// and a failed write leaves nothing behind. Scalar tensors (shape []) are
// supported. Write copies nothing: the tensors' Data may alias another File's
// mapping as long as that File stays open until Write returns.
//
// Errors name the file and, where there is one, the tensor.
package stfile
