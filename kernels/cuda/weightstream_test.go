package cuda

import (
	"errors"
	"fmt"
	"testing"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
)

// weightStreamSrc holds copy-only kernels that read expert weight matrices
// the way the streamed grouped GEMM does (gemm_stream.cu), without the
// arithmetic: a block of 8 warps takes one expert and 128 rows, a warp 16
// of them (two tiles of 8), and every chunk lands in a per-warp ring in
// shared memory through cp.async, DEPTH chunks ahead. The layouts differ in
// which bytes a warp's copy of one chunk covers:
//
//	ROWS = 1: rows as stored (row-major packed codes); a lane of quad t4
//	          copies bytes 16 t4 .. 16 t4 + 15 of its row's STEP-byte chunk
//	          (STEP 64: the kernel's 128-K chunks; 128: two of them at once).
//	ROWS = 0: the 8 rows of a tile stored chunk by chunk, so a tile's chunk
//	          is one contiguous run of 8 STEP bytes, each copy instruction of
//	          a warp 512 of them.
//
// BAR adds the kernel's block barrier after every chunk. The block scales
// the real kernel also copies (a word per lane pair and chunk) are left out.
const weightStreamSrc = `
#include <cuda_bf16.h>

template <int STEP, int DEPTH, bool ROWS, bool BAR>
__global__ void __launch_bounds__(256, 4) probe(const unsigned char *W, int N, int RB, unsigned *out) {
    extern __shared__ __align__(16) uint4 ring[];
    constexpr int U = STEP / 64; // 16-byte units a lane copies per tile and chunk
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
    const long long ebase = (long long)blockIdx.x * N * RB;
    const int row = blockIdx.y * 128 + warp * 16; // the warp's first row
    const unsigned char *p[2];
    for (int j = 0; j < 2; j++) {
        const int r = row + 8 * j;
        p[j] = ROWS ? W + ebase + (long long)(r + g) * RB + 16 * t4 : W + ebase + (long long)r * RB + lane * 16;
    }
    const int nch = RB / STEP;
    uint4 *slot = ring + warp * DEPTH * 2 * U * 32 + lane;
    auto issue = [&](int u, int c) {
        for (int j = 0; j < 2; j++)
            for (int v = 0; v < U; v++) {
                const unsigned char *src = ROWS ? p[j] + (long long)c * STEP + 64 * v : p[j] + (long long)c * 8 * STEP + 512 * v;
                const unsigned s = (unsigned)__cvta_generic_to_shared(slot + ((u * 2 + j) * U + v) * 32);
                asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
            }
    };
    for (int u = 0; u < DEPTH; u++) {
        if (u < nch) issue(u, u);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    unsigned acc = 0;
    for (int c = 0, u = 0; c < nch; c++, u = u + 1 == DEPTH ? 0 : u + 1) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(DEPTH - 1) : "memory");
        for (int j = 0; j < 2 * U; j++) {
            const uint4 w = slot[(u * 2 * U + j) * 32];
            acc ^= w.x ^ w.y ^ w.z ^ w.w;
        }
        if (c + DEPTH < nch) issue(u, c + DEPTH);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        if (BAR) __syncthreads();
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

// plain reads n 16-byte units once, grid-stride: what the memory gives a
// kernel that only streams.
__global__ void plain(const uint4 *W, long long n, unsigned *out) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 w = __ldcg(W + i);
        acc ^= w.x ^ w.y ^ w.z ^ w.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
`

// BenchmarkWeightStream times the copy-only kernels of weightStreamSrc over
// the NVFP4 expert matrices of the Qwen3-30B-A3B MoE layer (128 experts;
// FC1 1536 x 2048 with gate and up, FC2 2048 x 768: 201 and 101 MB, more
// than the L2 holds), each launch reading every matrix once, and reports
// the bandwidth each layout reaches, next to a plain streaming read of the
// same bytes ("plain"): how much of the memory's speed the streamed GEMM's
// way of reading its weights leaves on the table before any arithmetic.
// Run on a GPU: go test ./kernels/cuda -run '^$' -bench WeightStream
func BenchmarkWeightStream(b *testing.B) {
	be := gpu(b)
	type variant struct {
		step, depth int
		rows, bar   bool
	}
	vs := []variant{
		{64, 5, true, true}, {64, 5, true, false}, {64, 6, true, true}, {128, 3, true, true},
		{64, 5, false, true}, {64, 6, false, true}, {128, 3, false, true},
	}
	expr := func(v variant) string {
		return fmt.Sprintf("probe<%d, %d, %t, %t>", v.step, v.depth, v.rows, v.bar)
	}
	exprs := []string{"plain"}
	for _, v := range vs {
		exprs = append(exprs, expr(v))
	}
	comp, err := be.dev.Compile(drv.Program{Name: "weight_stream.cu", Source: weightStreamSrc, NameExpressions: exprs})
	if err != nil {
		b.Fatal(err)
	}
	const E = 128
	var (
		m          *drv.Module
		w, out     drv.DevicePtr
		e0, e1     *drv.Event
		sms        = be.dev.Info().SMs
		matrixSize = E * 2048 * 1024
	)
	do := func(b *testing.B, fn func(c *drv.Ctx) error) {
		b.Helper()
		if err := be.dev.Do(fn); err != nil {
			b.Fatal(err)
		}
	}
	do(b, func(c *drv.Ctx) (err error) {
		if m, err = c.LoadModule(comp.Cubin); err != nil {
			return err
		}
		if w, err = c.Alloc(matrixSize); err != nil {
			return err
		}
		if out, err = c.Alloc(64); err != nil {
			return err
		}
		if e0, err = c.NewEvent(); err != nil {
			return err
		}
		if e1, err = c.NewEvent(); err != nil {
			return err
		}
		return c.Memset8(w, 0x5a, matrixSize)
	})
	b.Cleanup(func() {
		_ = be.dev.Do(func(c *drv.Ctx) error {
			return errors.Join(e0.Destroy(), e1.Destroy(), c.Free(out), c.Free(w), m.Unload())
		})
	})
	// run times b.N launches between two events.
	run := func(b *testing.B, bytes int, launch func() error) {
		do(b, func(c *drv.Ctx) error {
			if err := launch(); err != nil { // warm
				return err
			}
			b.ResetTimer()
			if err := e0.Record(nil); err != nil {
				return err
			}
			for range b.N {
				if err := launch(); err != nil {
					return err
				}
			}
			if err := e1.Record(nil); err != nil {
				return err
			}
			if err := e1.Sync(); err != nil {
				return err
			}
			b.StopTimer()
			el, err := c.Elapsed(e0, e1)
			if err != nil {
				return err
			}
			per := el.Seconds() / float64(b.N)
			b.ReportMetric(per*1e6, "us/launch")
			b.ReportMetric(float64(bytes)/per/1e12, "TB/s")
			return nil
		})
	}
	for _, s := range []struct {
		name  string
		n, rb int
	}{{"fc1_1536x2048", 1536, 1024}, {"fc2_2048x768", 2048, 384}} {
		bytes := E * s.n * s.rb
		b.Run(s.name+"/plain", func(b *testing.B) {
			var f *drv.Function
			do(b, func(*drv.Ctx) (err error) { f, err = m.Function(comp.Lowered["plain"]); return err })
			run(b, bytes, func() error {
				return f.Launch(drv.Dim3{X: 4 * sms}, drv.Dim3{X: 512}, 0, nil, w, int64(bytes/16), out)
			})
		})
		for _, v := range vs {
			layout := "rows"
			if !v.rows {
				layout = "tiles"
			}
			b.Run(fmt.Sprintf("%s/%s_step%d_depth%d_barrier_%t", s.name, layout, v.step, v.depth, v.bar), func(b *testing.B) {
				// Every variant's ring (at most 48 KB) is padded to the 56 KB
				// that keep four blocks a multiprocessor, as the NVFP4
				// kernel's 16-row tiles have.
				smem := max(8*v.depth*2*(v.step/64)*32*16, 56<<10)
				var f *drv.Function
				var occ int
				do(b, func(*drv.Ctx) (err error) {
					if f, err = m.Function(comp.Lowered[expr(v)]); err != nil {
						return err
					}
					if err = f.SetMaxDynamicShared(smem); err != nil {
						return err
					}
					occ, err = f.MaxActiveBlocksPerSM(256, smem)
					return err
				})
				run(b, bytes, func() error {
					return f.Launch(drv.Dim3{X: E, Y: s.n / 128}, drv.Dim3{X: 256}, smem, nil, w, int32(s.n), int32(s.rb), out)
				})
				b.ReportMetric(float64(occ), "blocks/SM") // after run: its ResetTimer drops metrics reported before
			})
		}
	}
}
