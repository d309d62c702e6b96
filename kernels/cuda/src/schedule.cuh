// Tile scheduling of the grouped GEMMs: which expert and rows a block
// computes (gg_schedule), and the activation rows they gather
// (gg_sources). Offsets are checked here and reported (errors.cuh).
#ifndef RW_SCHEDULE_CUH
#define RW_SCHEDULE_CUH

#include "numerics.cuh"
#include "reduce.cuh"
#include "errors.cuh"

namespace rw {

constexpr int GG_BM = 64; // rows of a generic grouped GEMM tile (gg_sources' default)

// gg_schedule (warp 0 of a block) finds the expert and the BM-row tile of
// that expert this block computes, from the tiles of BM rows each expert's
// offsets range splits into, in expert order: up to 32 * GG_SCHED_PER
// experts one warp scan over runs of GG_SCHED_PER experts a lane, else an
// inclusive warp scan over 32 experts at a time. Both give every block the
// same tile. expert -1: no tile (the grid is an upper bound).
// Offsets outside [0, R] or decreasing are reported by block (0, 0) and
// clamped, so nothing is read or written out of bounds.
constexpr int GG_SCHED_PER = 8; // experts a lane takes in gg_schedule's one-round path
__device__ __forceinline__ void gg_schedule(int *err, const int *offsets, int E, int R, int lane, int BM, int *s_expert,
                                               int *s_row0, int *s_row1) {
    {
        int expert = -1, row0 = 0, row1 = 0;
        if (offsets == nullptr) {
            if ((int)blockIdx.x * BM < R) { expert = 0; row0 = blockIdx.x * BM; row1 = min(R, row0 + BM); }
        } else if (E <= 32 * GG_SCHED_PER) {
            // Lane l takes experts GG_SCHED_PER*l ... onwards: its offsets are
            // loaded at once, so a block waits on one round of loads, not
            // one per 32 experts up to its own (every one, for the blocks
            // past the last tile).
            const int idx = blockIdx.x, e0 = GG_SCHED_PER * lane;
            if (blockIdx.x == 0 && blockIdx.y == 0 && lane == 0 && (offsets[0] < 0 || offsets[E] > R))
                report(err, E_GG_OFFSETS, offsets[0], offsets[E], R);
            int c[GG_SCHED_PER + 1]; // the lane's offsets, clamped to [0, R]
#pragma unroll
            for (int i = 0; i <= GG_SCHED_PER; i++) c[i] = e0 + i <= E ? max(0, min(offsets[e0 + i], R)) : 0;
            int tiles[GG_SCHED_PER], hi[GG_SCHED_PER], sum = 0;
#pragma unroll
            for (int i = 0; i < GG_SCHED_PER; i++) {
                const int e = e0 + i;
                hi[i] = c[i + 1];
                tiles[i] = 0;
                if (e < E) {
                    if (hi[i] < c[i]) {
                        if (blockIdx.x == 0 && blockIdx.y == 0) report(err, E_GG_DECREASE, e, offsets[e], offsets[e + 1]);
                        hi[i] = c[i];
                    }
                    tiles[i] = (hi[i] - c[i] + BM - 1) / BM;
                }
                sum += tiles[i];
            }
            const int incl = warp_scan(sum), excl = incl - sum;
            const unsigned hit = __ballot_sync(0xffffffffu, sum > 0 && idx >= excl && idx < incl);
            if (hit) {
                const int src = __ffs(hit) - 1;
                int t = idx - excl, ex = -1, r0 = 0, r1 = 0;
#pragma unroll
                for (int i = 0; i < GG_SCHED_PER; i++) {
                    if (ex < 0 && t < tiles[i]) {
                        ex = e0 + i;
                        r0 = c[i] + t * BM;
                        r1 = min(hi[i], r0 + BM);
                    } else if (ex < 0) {
                        t -= tiles[i];
                    }
                }
                expert = __shfl_sync(0xffffffffu, ex, src);
                row0 = __shfl_sync(0xffffffffu, r0, src);
                row1 = __shfl_sync(0xffffffffu, r1, src);
            }
        } else {
            int idx = blockIdx.x, base = 0;
            if (blockIdx.x == 0 && blockIdx.y == 0 && lane == 0 && (offsets[0] < 0 || offsets[E] > R))
                report(err, E_GG_OFFSETS, offsets[0], offsets[E], R);
            for (int e0 = 0; e0 < E && expert < 0; e0 += 32) {
                int e = e0 + lane;
                int lo = 0, hi = 0;
                if (e < E) {
                    lo = max(0, min(offsets[e], R));
                    hi = max(0, min(offsets[e + 1], R));
                    if (hi < lo) {
                        if (blockIdx.x == 0 && blockIdx.y == 0) report(err, E_GG_DECREASE, e, offsets[e], offsets[e + 1]);
                        hi = lo;
                    }
                }
                const int tiles = (hi - lo + BM - 1) / BM, incl = warp_scan(tiles);
                int excl = incl - tiles;
                unsigned hit = __ballot_sync(0xffffffffu, tiles > 0 && idx >= base + excl && idx < base + incl);
                if (hit) {
                    int src = __ffs(hit) - 1;
                    int t = idx - base - __shfl_sync(0xffffffffu, excl, src);
                    int l = __shfl_sync(0xffffffffu, lo, src), h = __shfl_sync(0xffffffffu, hi, src);
                    expert = e0 + src;
                    row0 = l + t * BM;
                    row1 = min(h, row0 + BM);
                }
                base += __shfl_sync(0xffffffffu, incl, 31);
            }
        }
        if (lane == 0) { *s_expert = expert; *s_row0 = row0; *s_row1 = row1; }
    }
}

// gg_sources fills src[i], i < bm, with the A row of sorted row row0+i
// (-1: none, or a bad gather entry, which is reported and skipped).
__device__ __forceinline__ void gg_sources(int *err, int *src, const int *gather, int row0, int row1, int Ta, int bm = GG_BM) {
    for (int i = threadIdx.x; i < bm; i += blockDim.x) {
        int r = row0 + i, a = -1;
        if (r < row1) {
            a = gather ? gather[r] : r;
            if (a < 0 || a >= Ta) {
                report(err, E_GG_GATHER, r, a, Ta);
                a = -1;
            }
        }
        src[i] = a;
    }
}

} // namespace rw

#endif // RW_SCHEDULE_CUH
