// Batch invariance of the grouped GEMMs. The host picks the streamed
// (gemm_stream.cu), tiled (gemm_tile.cu) or warp-specialised (gemm_ws.cu)
// kernel, and its row tile, by the batch's rows per expert; a token's
// output bits must not depend on that choice, on the batch or on M. They
// do not because every kernel
//  - schedules tiles and gathers rows the same way (schedule.cuh),
//  - builds its MMA fragments with the same values in the same K order:
//    the same k16 slices (g5_slice4), in order, chunk after chunk
//    (fragments.cuh),
//  - splits long K over a cluster pair by K alone and adds the halves in
//    one order (ks2_add), and
//  - rounds, scales, activates and stores through one epilogue
//    (g5_epilogue, epilogue.cuh).
// Change any of these and every kernel changes with it; a kernel that
// took its own copy could drift and break invariance silently
// (TestGroupedGemmInvariance checks it on the GPU).
#ifndef RW_INVARIANCE_CUH
#define RW_INVARIANCE_CUH

#include "schedule.cuh"
#include "fragments.cuh"
#include "epilogue.cuh"

#endif // RW_INVARIANCE_CUH
