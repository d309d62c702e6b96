// Package cuda is the CUDA implementation of the kernels op set.
//
// The kernels are CUDA C++ embedded from src/ (go:embed): shared headers
// (.cuh) and one compile unit (.cu) per kernel family, in namespace rw.
// registry.go is the one host table of kernel variants (entry point, unit,
// template arguments as an NVRTC name expression, block and cluster shape,
// dynamic shared memory, minimum arch); every launch names its kernel by a
// registry key and is checked against the entry. New compiles the units for
// the device's architecture (sm_90a on Hopper; the wgmma unit only there)
// as separate NVRTC programs, concurrently, one per unit or, for the
// template-only GEMM units, one per kernel variant, each cached on disk
// under its own key (internal/cuda); "rollout-worker kernels warm" fills
// the cache ahead of time. The device error codes are written once, in
// errors.go, which generates the kernels' errors.cuh. docs/CUDA.md
// ("Source layout") lists the headers and units.
//
// No cgo: the driver and NVRTC are loaded at run time, so the package
// builds with CGO_ENABLED=0 everywhere and New returns an error matching
// internal/cuda.ErrNoDevice where there is no GPU.
//
// Numerics follow the op contracts of package kernels: the NVFP4 quantizers
// are bit-exact ports of internal/nvfp4 (every step one IEEE binary32
// operation, __fmul_rn and friends, no fast math); GEMMs dequantize NVFP4
// operands to BF16 exactly and run BF16 tensor-core MMA with FP32
// accumulation (mma.sync; on sm_90a the many-rows tile runs wgmma, which
// adds a k16 step's products as mma.sync does), each output's reduction
// order fixed by K alone, so a row never depends on the batch or the
// kernel the host picks for it; every other reduction is a fixed tree per
// row.
//
// Ownership and concurrency: one goroutine, locked to its OS thread
// (internal/cuda.Device), owns the CUDA context; every method reaches it
// through Device.Do, which serialises callers. Ops are enqueued on one
// compute stream and run asynchronously; Upload, Download, Copy and Zero
// are ordered with them (blocking streams), Sync waits and reports the
// first index error a kernel recorded in the device error word. Stage, used
// by the refit path from its own goroutine, copies through two pinned host
// buffers on a second stream, overlapping the ops. Every buffer carries its
// root allocation as its owner, so liveness and aliasing checks are exact.
package cuda
