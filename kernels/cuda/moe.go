package cuda

import (
	"encoding/binary"
	"errors"
	"fmt"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// The MoE ops and the dense GEMM. Launch geometry lives here; the kernels
// are in src/ (dispatch.cu, quantize.cu, gemm_*.cu) and the registry
// (registry.go) names them.

// GEMM tile of grouped_gemm and gemm_staged: BM sorted rows by BN output
// columns per block of gemmThreads.
const (
	gemmBM = 64
	gemmBN = 64
)

// Operand formats of the GEMM kernel.
const (
	fmtBF16 int32 = 0
	fmtFP4  int32 = 1
)

// Output types of the GEMM kernel.
const (
	outBF16 int32 = 0
	outF32  int32 = 1
)

// aligned16 reports whether a BF16 matrix of row length k at b can be read
// 16 bytes at a time.
func aligned16(b *kernels.Buffer, k int) int32 {
	if b != nil && b.Addr()%16 == 0 && k%8 == 0 {
		return 1
	}
	return 0
}

// gemmLaunch holds the GEMM kernel's arguments.
type gemmLaunch struct {
	aFmt, wFmt         int32
	a, aPacked, aSF    drv.DevicePtr
	aScale             drv.DevicePtr
	aK, aVec           int32
	gather             drv.DevicePtr
	ta                 int32
	w, wPacked, wSF    drv.DevicePtr
	wScale             drv.DevicePtr
	wK, wVec           int32
	n                  int32 // W rows per expert
	offsets            drv.DevicePtr
	e, r               int32 // experts; rows of out (sorted rows, or M)
	kp                 int32 // reduction length (the padded K)
	act                int32
	out                drv.DevicePtr
	outN, outFmt       int32
	maxTiles, colTiles int
}

func (g gemmLaunch) run(be *Backend) error {
	return be.launch(kGroupedGemm, drv.Dim3{X: g.maxTiles, Y: g.colTiles}, drv.Dim3{X: gemmThreads}, 0,
		be.errw, g.aFmt, g.a, g.aPacked, g.aSF, g.aScale, g.aK, g.aVec, g.gather, g.ta,
		g.wFmt, g.w, g.wPacked, g.wSF, g.wScale, g.wK, g.wVec, g.n,
		g.offsets, g.e, g.r, g.kp, g.act, g.out, g.outN, g.outFmt)
}

// gemmNarrowN is the widest output the narrow GEMMs compute: the grid's
// y limit (65535 blocks of 8 columns). Every dense GEMM of the model (the
// router, q/k/v/o, the LM head) is narrower. The dense GEMMs never take
// the generic tiled kernel, which read a decode step's weights at a few
// percent of the memory bandwidth and adds in another order.
const gemmNarrowN = 65535 * 8

// gemmWideM is the row count from which narrow GEMMs take 32 x 32 blocks
// (gemm_narrow_wide) instead of 16 x 8 ones: the same bits
// (src/gemm_dense.cu), a fraction of the activation and weight reads (the
// router at 4096 tokens read its input 32 times over).
const gemmWideM = 32

// gemmNarrow8M: up to this many rows the narrow GEMM is gemm_narrow8,
// gemm_narrow with more slices in flight a warp (src/gemm_dense.cu), the
// same bits.
const gemmNarrow8M = 8

// gemmNarrow8ShortK: up to this K, gemm_narrow8 is gemm_narrow8_short, which
// keeps a warp's 4 double slices (32 k each, 16 warps) in flight in fewer
// registers, two blocks a multiprocessor; the same bits.
const gemmNarrow8ShortK = 4 * 32 * 16

// planDenseTile picks the dense GEMM's tiled kernel for an m x n x k GEMM
// on sms multiprocessors, and whether to take it (ok) rather than a narrow
// one. A tiled block walks the whole K in turn, a stage of loads after
// another, so it pays only where the grid holds many blocks: 64 x 128
// tiles from two blocks a multiprocessor, 64 x 64 ones from about one;
// never for the few rows gemm_narrow8_short takes (m <= 8, k <= 2048),
// which streams even the LM head faster. The choice changes no bit of the
// output (src/gemm_dense.cu), so it may follow m. Measured on an H100
// (TestDenseGemmPaths, graph-timed): the 151936 x 2048 LM head at one row
// 197 us narrow against 226 us tiled, at 8 rows 206 against 233; q (4096 x
// 2048) at 256 rows 27.1 us tiled against 54.7 us narrow; o (2048 x 4096)
// at 128 rows 34.5 us tiled, 23.2 us narrow.
func planDenseTile(m, n, k, sms int) (t denseTileKernel, ok bool) {
	if m <= gemmNarrow8M && k <= gemmNarrow8ShortK {
		return denseSmall, false
	}
	blocks := func(k denseTileKernel) int { return ((m + k.bm - 1) / k.bm) * ((n + k.bn - 1) / k.bn) }
	if blocks(denseWide) >= 2*sms {
		return denseWide, true
	}
	return denseSmall, 10*blocks(denseSmall) >= 9*sms
}

// packedAligned checks what the NVFP4 kernels assume of a quantized
// operand's addresses: packed rows are read and written 8 bytes at a time,
// the FP32 scales 4. Buffers from Alloc and their row views always are; a
// misaligned byte-range view would fault the whole CUDA context.
func packedAligned(op, name string, q kernels.NVFP4) error {
	if q.Packed != nil && q.Packed.Addr()%8 != 0 {
		return fmt.Errorf("cuda: %s: %s.packed %v is not 8-byte aligned", op, name, q.Packed)
	}
	if q.Scale != nil && q.Scale.Addr()%4 != 0 {
		return fmt.Errorf("cuda: %s: %s.scale %v is not 4-byte aligned", op, name, q.Scale)
	}
	return nil
}

// Gemm computes dst = a * w^T (BF16 tensor cores, FP32 accumulation).
func (be *Backend) Gemm(dst, a, w *kernels.Buffer) error {
	return be.gemm([]*kernels.Buffer{dst}, a, []*kernels.Buffer{w}, gemmAuto)
}

// denseSegMax is how many GEMMs one dense launch computes side by side
// (src/gemm_dense.cu DenseSegs), and denseSegAlign what every width but
// the last must be a multiple of: the widest block's columns, so that no
// block straddles two GEMMs.
const (
	denseSegMax   = 3
	denseSegAlign = 128
)

// GemmSet computes dst[i] = a * w[i]^T for every i (kernels.GemmSetter):
// in one launch where they fit one (up to denseSegMax GEMMs of one output
// type, widths but the last multiples of denseSegAlign), else one launch
// each. Either way each output has the bits Gemm gives it.
func (be *Backend) GemmSet(dst []*kernels.Buffer, a *kernels.Buffer, w []*kernels.Buffer) error {
	return be.gemm(dst, a, w, gemmAuto)
}

// gemmSegmentable reports whether the GEMMs dst[i] = a * w[i]^T can share
// a launch: shapes and types that DenseSegs takes, and operands the narrow
// kernels take (aligned, even K, the summed width within gemmNarrowN), so
// that a set never lands on the generic kernel, which adds in another
// order, where its members alone would not. The launch checks the rest.
func gemmSegmentable(dst []*kernels.Buffer, a *kernels.Buffer, w []*kernels.Buffer) bool {
	if len(dst) > denseSegMax || len(dst) != len(w) || a == nil || a.Addr()%4 != 0 {
		return false
	}
	n := 0
	for i := range dst {
		if dst[i] == nil || w[i] == nil || dst[i].DType() != dst[0].DType() || w[i].Rank() != 2 || w[i].Dim(1)%2 != 0 ||
			w[i].Addr()%4 != 0 || i < len(dst)-1 && w[i].Dim(0)%denseSegAlign != 0 {
			return false
		}
		n += w[i].Dim(0)
	}
	return n <= gemmNarrowN
}

// gemmPath picks the dense GEMM's kernel family: gemmAuto is the
// production choice (tiled or narrow wherever its shape and alignment
// allow); the others force one family, for tests that compare them.
// gemmForceNarrow16 is the narrow family with 16 x 8 blocks at every row
// count (gemm_narrow, gemm_narrow8 and its short form; never
// gemm_narrow_wide's 32 x 32).
type gemmPath int

const (
	gemmAuto gemmPath = iota
	gemmForceNarrow
	gemmForceNarrow16
	gemmForceTile
	gemmForceGeneric
)

// denseSegs is the DenseSegs kernel argument: weights, outputs, widths.
func denseSegs(dst, w []*kernels.Buffer) drv.RawArg {
	b := make(drv.RawArg, 64)
	for i := range dst {
		binary.LittleEndian.PutUint64(b[8*i:], uint64(ptr(w[i])))
		binary.LittleEndian.PutUint64(b[24+8*i:], uint64(ptr(dst[i])))
		binary.LittleEndian.PutUint32(b[48+4*i:], uint32(w[i].Dim(0)))
	}
	return b
}

// gemm runs the GEMMs dst[i] = a * w[i]^T: one launch of the dense kernels
// where gemmSegmentable allows (a single GEMM always: the launch picks its
// family), else one launch each.
func (be *Backend) gemm(dst []*kernels.Buffer, a *kernels.Buffer, w []*kernels.Buffer, path gemmPath) error {
	if len(dst) != 1 && !gemmSegmentable(dst, a, w) {
		if _, _, _, err := kernels.ValidateGemmSet(dst, a, w); err != nil {
			return fmt.Errorf("cuda: %w", err)
		}
		for i := range dst {
			if err := be.gemm(dst[i:i+1], a, w[i:i+1], path); err != nil {
				return err
			}
		}
		return nil
	}
	var m, k int
	var ns []int
	validate := func() (err error) {
		m, ns, k, err = kernels.ValidateGemmSet(dst, a, w)
		return err
	}
	args := struct {
		Dst []*kernels.Buffer
		A   *kernels.Buffer
		W   []*kernels.Buffer
	}{dst, a, w}
	return be.issue("gemm", args, validate, func(*drv.Ctx) error {
		n := 0
		narrowOK, tileOK := a.Addr()%4 == 0 && k%2 == 0, a.Addr()%16 == 0 && k%32 == 0
		for i := range dst {
			n += ns[i]
			narrowOK = narrowOK && w[i].Addr()%4 == 0
			// The tiled kernel copies 16 bytes at a time, a double slice
			// of 32 k per row, and stores output pairs.
			tileOK = tileOK && w[i].Addr()%16 == 0 && dst[i].Addr()%8 == 0
		}
		if m == 0 || n == 0 {
			return nil
		}
		narrowOK = narrowOK && n <= gemmNarrowN
		tileOK = tileOK && narrowOK
		if (path == gemmForceNarrow || path == gemmForceNarrow16) && !narrowOK || path == gemmForceTile && !tileOK {
			return fmt.Errorf("cuda: gemm: the forced dense kernels cannot take %dx%d * %dx%d", m, k, n, k)
		}
		out := outBF16
		if dst[0].DType() == kernels.F32 {
			out = outF32
		}
		t, tile := planDenseTile(m, n, k, be.info.SMs)
		if tileOK && (path == gemmForceTile || path == gemmAuto && tile) {
			if be.denseTile != (denseTileKernel{}) {
				t = be.denseTile
			}
			return be.launch(t, drv.Dim3{X: (m + t.bm - 1) / t.bm, Y: (n + t.bn - 1) / t.bn}, drv.Dim3{X: t.threads()}, t.smem(),
				ptr(a), denseSegs(dst, w), int32(m), int32(k), out)
		}
		if narrowOK && path != gemmForceGeneric {
			if m >= gemmWideM && path != gemmForceNarrow16 {
				return be.launch(kGemmNarrowWide, drv.Dim3{X: (m + 31) / 32, Y: (n + 31) / 32}, drv.Dim3{X: 512}, gemmWideSmem,
					ptr(a), denseSegs(dst, w), int32(m), int32(k), out)
			}
			kern := kGemmNarrow
			if m <= gemmNarrow8M {
				kern = be.narrow8
				if kern == kGemmNarrow8 && k <= gemmNarrow8ShortK {
					kern = kGemmNarrow8Short
				}
			}
			return be.launch(kern, drv.Dim3{X: (m + 15) / 16, Y: (n + 7) / 8}, drv.Dim3{X: 512}, 0,
				ptr(a), denseSegs(dst, w), int32(m), int32(k), out)
		}
		for i := range dst {
			g := gemmLaunch{aFmt: fmtBF16, a: ptr(a), aK: int32(k), aVec: aligned16(a, k), ta: int32(m),
				wFmt: fmtBF16, w: ptr(w[i]), wK: int32(k), wVec: aligned16(w[i], k), n: int32(ns[i]),
				e: 1, r: int32(m), kp: int32(k), act: int32(kernels.Identity), out: ptr(dst[i]), outN: int32(ns[i]),
				maxTiles: (m + gemmBM - 1) / gemmBM, colTiles: (ns[i] + gemmBN - 1) / gemmBN, outFmt: out}
			if err := g.run(be); err != nil {
				return err
			}
		}
		return nil
	})
}

// GroupedGemm runs the per-expert GEMMs over expert-sorted rows with the
// activation fused into the epilogue.
func (be *Backend) GroupedGemm(a kernels.GroupedGemmArgs) error {
	var s kernels.GroupedGemmShape
	validate := func() (err error) {
		if s, err = a.Validate(); err != nil {
			return err
		}
		return errors.Join(packedAligned("grouped gemm", "A", a.A.Q), packedAligned("grouped gemm", "W", a.W.Q))
	}
	return be.issue("grouped gemm", a, validate, func(*drv.Ctx) error {
		if s.R == 0 || s.OutN == 0 {
			return nil
		}
		g := gemmLaunch{ta: int32(s.Ta), gather: ptr(a.Gather), n: int32(s.N), offsets: ptr(a.Offsets),
			e: int32(s.E), r: int32(s.R), kp: int32(s.Kp), act: int32(a.Act), out: ptr(a.Out), outN: int32(s.OutN), outFmt: outBF16,
			// Each expert adds at most one partial tile to the R/BM full ones.
			maxTiles: s.R/gemmBM + min(s.E, s.R), colTiles: (s.OutN + gemmBN - 1) / gemmBN}
		if a.A.Quantized() && a.W.Quantized() {
			return be.groupedGemmFP4(a, s)
		}
		if !a.A.Quantized() && !a.W.Quantized() {
			if ok, err := be.groupedGemmBF16(a, s); ok || err != nil {
				return err
			}
		}
		if a.Scatter != nil {
			return errScatter
		}
		if a.A.Quantized() {
			g.aFmt, g.aPacked, g.aSF, g.aScale, g.aK = fmtFP4, ptr(a.A.Q.Packed), ptr(a.A.Q.Scales), ptr(a.A.Q.Scale), int32(2*a.A.Q.Packed.Dim(1))
		} else {
			g.aFmt, g.a, g.aK, g.aVec = fmtBF16, ptr(a.A.BF16), int32(a.A.BF16.Dim(1)), aligned16(a.A.BF16, a.A.BF16.Dim(1))
		}
		if a.W.Quantized() {
			g.wFmt, g.wPacked, g.wSF, g.wScale, g.wK = fmtFP4, ptr(a.W.Q.Packed), ptr(a.W.Q.Scales), ptr(a.W.Q.Scale), int32(2*a.W.Q.Packed.Dim(2))
		} else {
			g.wFmt, g.w, g.wK, g.wVec = fmtBF16, ptr(a.W.BF16), int32(a.W.BF16.Dim(2)), aligned16(a.W.BF16, a.W.BF16.Dim(2))
		}
		return g.run(be)
	})
}

// streamFits reports whether the streamed kernels can address an A of ta
// rows of k elements: they use 32-bit element offsets. Past that (about
// 300,000 rows at K = 7168) the older kernels run instead, whose bits
// differ: batch invariance holds below that size.
func streamFits(ta, k int) bool { return int64(ta)*int64(k) < 1<<31 }

// splitK reports whether the NVFP4 streamed GEMM splits K over a cluster
// of two blocks: for rows of 4096 elements or more (FC1 of the DeepSeek-V3
// MoE layer, hidden 7168, intermediate 2048, 256 experts, top-8: K =
// 7168). Measured on the H200: FC1 at 1 token 74.6 -> 43.6 us, at 2-4 rows
// per expert 182 -> 149 us; FC2 (K = 2048) and the BF16 kernels only lost
// (more blocks, each too short to fill its pipeline).
// K alone decides, never the batch: batch invariance holds.
func splitK(k int) bool { return k >= 4096 }

// streamFewBlocks: a streamed launch of 16-row tiles (not SwiGLU) with
// fewer blocks than this many an SM runs the _j1 kernels, one n8 tile a
// warp, so twice the blocks. At the DeepSeek-V3 layer shapes on an H200
// (132 SMs) that is the one-token layer (8 experts' tiles: 128 to 448
// blocks); from 8 tokens on the launches have 1088 blocks or more.
// Measured on the H200 (ncu at one token):
// NVFP4 FC1 46.3-48.0 -> 41.1-42.5 us, FC2 44.9-45.8 -> 41.6-43.0; BF16
// FC2 135.5-137.5 -> 126.8-131.2, FC1 unchanged; the layer 109.7 -> 100.0
// us. Four is the NVFP4 kernel's residency an SM.
const streamFewBlocks = 4

// streamLaunch launches a streamed grouped GEMM kernel (gemm_stream.cu,
// 8 warps of one, two or four n8 tiles). Its row tile is 16, 32 or 64
// rows, by the average rows per expert; the tile never changes an output
// bit (src/gemm_stream.cu), so the choice keeps batch invariance.
// TestStreamSmemFits bounds the shared memory.
func (be *Backend) streamLaunch(fp4 bool, a kernels.GroupedGemmArgs, s kernels.GroupedGemmShape, args ...any) error {
	l := streamPlan(fp4, a.Act, s, be.info.SMs, be.streamJ, be.streamM8Rows)
	return be.launch(l.kernel, l.grid, drv.Dim3{X: 256}, l.smem, scatterArgs(a, args)...)
}

// streamLaunchPlan is a streamed kernel's launch: kernel, grid and dynamic
// shared memory.
type streamLaunchPlan struct {
	kernel streamKernel
	grid   drv.Dim3
	smem   int
}

// streamPlan picks the streamed kernel and its geometry for a GEMM of
// shape s on a device of sms SMs; j forces the n8 tiles a warp of a
// 16-row-tile kernel (0: by streamFewBlocks). An NVFP4 launch that would
// take 16-row tiles of two n8 tiles a warp takes 8-row ones (the whole K
// range of a tile's activations staged at once) where the experts average
// at most m8Rows rows and a block's K range fits streamM8Chunks.
func streamPlan(fp4 bool, act kernels.Activation, s kernels.GroupedGemmShape, sms, j, m8Rows int) streamLaunchPlan {
	k := streamKernel{fp4: fp4, bm: 64, j: 2, swiglu: act == kernels.SwiGLU}
	switch {
	case s.R <= 8*s.E:
		k.bm = 16
	case s.R <= 24*s.E:
		k.bm = 32
	}
	cols := 128
	if k.swiglu {
		cols = 64
	}
	grid := drv.Dim3{X: s.R/k.bm + min(s.E, s.R), Y: (s.OutN + cols - 1) / cols, Z: 1}
	if fp4 && splitK(s.Kp) {
		// Z: the two blocks of a cluster, which split K (src/gemm_stream.cu).
		k.ks2, grid.Z = true, 2
	}
	if k.bm == 16 && !k.swiglu {
		if j == 0 {
			j = 2
			if grid.X*grid.Y*grid.Z < streamFewBlocks*sms {
				j = 1
			}
		}
		if j == 1 {
			// One n8 tile a warp, twice the blocks, each with half the
			// shared memory. Same bits (src/gemm_stream.cu g5_gemm).
			k.j, grid.Y = 1, (s.OutN+cols/2-1)/(cols/2)
		}
	}
	if fp4 && k.bm == 32 {
		// Four n8 tiles a warp (twice the columns a block): each A
		// fragment read from shared memory feeds four MMAs instead of two,
		// and the block's activation staging serves twice the columns.
		// Measured on the H200 (bench moe, the layer at 512 tokens): 2812
		// -> 2345 us. Same bits (src/gemm_stream.cu g5_gemm).
		k.j, grid.Y = 4, (s.OutN+2*cols-1)/(2*cols)
	}
	if fp4 && k.bm == 16 && k.j == 2 && s.R <= m8Rows*s.E {
		nchb := (s.Kp + 127) / 128
		if k.ks2 {
			nchb = (nchb + 1) / 2
		}
		if nchb <= streamM8Chunks {
			// Same bits: each output row's MMAs and K order are those of
			// the 16-row tile (src/gemm_stream.cu g5_tail, ROW 8).
			k.bm, grid.X = 8, s.R/8+min(s.E, s.R)
			return streamLaunchPlan{kernel: k, grid: grid, smem: streamM8Smem(k.j, nchb)}
		}
	}
	return streamLaunchPlan{kernel: k, grid: grid, smem: streamSmem(fp4, k.bm, k.j)}
}

// scatterArgs appends the streamed and tiled kernels' last arguments: the
// atomic finalize's buffers, or nulls.
func scatterArgs(a kernels.GroupedGemmArgs, args []any) []any {
	if sc := a.Scatter; sc != nil {
		return append(args, ptr(sc.Acc), ptr(sc.Tokens), ptr(sc.Weights), ptr(sc.Slots), int32(sc.Acc.Dim(0)), int32(sc.Weights.Dim(1)))
	}
	return append(args, drv.DevicePtr(0), drv.DevicePtr(0), drv.DevicePtr(0), drv.DevicePtr(0), int32(0), int32(0))
}

// defaultM8Rows is the average rows per expert at or below which the NVFP4
// streamed GEMMs take 8-row tiles (streamPlan). Measured on an H100 at the
// Qwen3-30B-A3B expert shapes (TestStreamedGemmDecode): 3-9% faster than
// the 16-row tiles at 8 and 64 tokens (0.5 and 4 rows an expert on
// average; at 32 tokens FC1 3% slower, FC2 5% faster), 16% slower at 128
// (8 rows), where many experts take two 8-row tiles, each reading all of
// the expert's weights.
const defaultM8Rows = 4

// defaultTileRows is the average rows per expert above which the NVFP4
// grouped GEMMs take the tiled kernel instead of the streamed one: where
// the streamed kernel would take 64-row tiles. Measured on the H200
// (TestStreamedGemm, FC1 at the DeepSeek-V3 layer shapes): 24 rows per
// expert, streamed 232 us, tiled 283; 32 rows, streamed 447, tiled 289.
// Both give every output the same bits (src/gemm_stream.cu), so the choice
// keeps batch invariance.
const defaultTileRows = 24

// defaultTile8Rows is the average rows per expert above which the tiled
// kernel runs with 8 warps of 64 x 32 instead of 16 of 32 x 32: measured on
// the H200 (TestStreamedGemm, FC1 at the DeepSeek-V3 layer shapes), 16
// warps win at 16-64 rows per expert (64: 356 against 380 us), 8 at 128
// (539 against 578 us). Both give the same bits. On sm_90a gemm_fp4_ws
// takes over from defaultWSRows, so this applies to other targets.
const defaultTile8Rows = 96

// defaultWSRows is the average rows per expert above which the tiled
// GEMM is the warp-specialised wgmma kernel (gemm_fp4_ws) on sm_90a.
// Measured on the H200 (TestStreamedGemm, FC1 / FC2 at the DeepSeek-V3
// layer shapes, 32 experts): 64 rows, ws 313.0 / 345.9 us against 350.2 /
// 382.2 for the 16-warp tile; 128 rows, 421.3 / 496.1 against 537.6 /
// 602.9 for the 8-warp one. At 32 rows only an earlier form of the kernel
// was measured (it lost: 364 against 295 us), so the line sits between 32
// and 64.
const defaultWSRows = 48

// defaultWS192Rows is the average rows per expert above which gemm_fp4_ws
// takes 192-row tiles (gemm_fp4_ws192): at 4096 tokens (128 +- 11 rows an
// expert) each expert is then one tile instead of a full one and one of
// about 10 rows, which dequantizes every weight row all the same: the
// layer 12-13% faster there (measured on the H200 with bench moe). Below,
// the 128-row tile wins: 512 threads leave it up to 128 registers a thread
// against 96, and few experts pass 128 rows. Measured on the H200 (bench
// moe at 3328 and 3584 tokens, each kernel forced everywhere above 48
// rows): at 104 rows (3328 tokens) the 128-row tile 1.2% / 0.7% faster
// (squared ReLU / SwiGLU), at 112 (3584 tokens) the 192-row one 1.2% /
// 1.8%, hence the line at 104.
const defaultWS192Rows = 104

// tileLaunch launches the tiled kernel (gemm_tile.cu) or the
// warp-specialised one (gemm_ws.cu), K split over a cluster of two like
// the streamed kernels, by K alone.
func (be *Backend) tileLaunch(a kernels.GroupedGemmArgs, s kernels.GroupedGemmShape, args ...any) error {
	l := tilePlan(a.Act, s, be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows)
	return be.launch(l.kernel, l.grid, drv.Dim3{X: l.threads}, l.smem, scatterArgs(a, args)...)
}

// tileLaunchPlan is a tiled kernel's launch: kernel (a tileKernel or a
// wsKernel), grid, threads a block and dynamic shared memory.
type tileLaunchPlan struct {
	kernel  any
	grid    drv.Dim3
	threads int
	smem    int
}

// tilePlan picks the tiled NVFP4 kernel for a GEMM of shape s: the
// warp-specialised one with 192-row tiles above ws192Rows rows per expert
// on average, with 128-row tiles above wsRows, else the 8-warp one above
// tile8Rows, else 16 warps.
func tilePlan(act kernels.Activation, s kernels.GroupedGemmShape, tile8Rows, wsRows, ws192Rows int) tileLaunchPlan {
	swiglu := act == kernels.SwiGLU
	cols := 128
	if swiglu {
		cols = 64
	}
	ks2 := splitK(s.Kp)
	var l tileLaunchPlan
	bm := 128
	switch {
	case s.R > ws192Rows*s.E:
		l.kernel, l.threads, l.smem, bm = wsKernel{rows: 192, swiglu: swiglu, ks2: ks2}, 640, wsSmem192, 192
	case s.R > wsRows*s.E:
		l.kernel, l.threads, l.smem = wsKernel{rows: 128, swiglu: swiglu, ks2: ks2}, 512, wsSmem
	case s.R > tile8Rows*s.E:
		l.kernel, l.threads, l.smem = tileKernel{warps: 8, swiglu: swiglu, ks2: ks2}, 256, tileSmem
	default:
		l.kernel, l.threads, l.smem = tileKernel{warps: 16, swiglu: swiglu, ks2: ks2}, 512, tileSmem
	}
	// X: an upper bound on the row tiles (each expert adds at most one
	// partial tile to the R/bm full ones); blocks past the last exit.
	l.grid = drv.Dim3{X: s.R/bm + min(s.E, s.R), Y: (s.OutN + cols - 1) / cols, Z: 1}
	if ks2 {
		l.grid.Z = 2
	}
	return l
}

// groupedGemmFP4 launches an NVFP4 x NVFP4 kernel (the per-token recipe's
// expert GEMMs): the tiled one for many rows per expert, the streamed one
// for few, or the staged one when A is too large for 32-bit offsets.
func (be *Backend) groupedGemmFP4(a kernels.GroupedGemmArgs, s kernels.GroupedGemmShape) error {
	args := []any{be.errw, ptr(a.A.Q.Packed), ptr(a.A.Q.Scales), ptr(a.A.Q.Scale), int32(s.Kp), ptr(a.Gather), int32(s.Ta),
		ptr(a.W.Q.Packed), ptr(a.W.Q.Scales), ptr(a.W.Q.Scale), int32(s.N), ptr(a.Offsets), int32(s.E), int32(s.R),
		int32(a.Act), ptr(a.Out), int32(s.OutN)}
	if streamFits(s.Ta, s.Kp) {
		if s.R > be.fp4TileRows*s.E {
			return be.tileLaunch(a, s, args...)
		}
		return be.streamLaunch(true, a, s, args...)
	}
	if a.Scatter != nil {
		return errScatter
	}
	k := stagedKernel{bm: 64, swiglu: a.Act == kernels.SwiGLU}
	if s.R <= 16*s.E {
		k.bm = 16
	}
	tiles := s.R/k.bm + min(s.E, s.R)
	return be.launch(k, drv.Dim3{X: tiles, Y: (s.OutN + gemmBN - 1) / gemmBN}, drv.Dim3{X: gemmThreads}, stagedSmem(k.bm, k.swiglu), args...)
}

// groupedGemmBF16 launches the streamed BF16 x BF16 kernel (the bf16
// recipe's expert GEMMs) when both operands can be read 16 bytes at a
// time; it reports false otherwise (the generic kernel runs instead).
func (be *Backend) groupedGemmBF16(a kernels.GroupedGemmArgs, s kernels.GroupedGemmShape) (bool, error) {
	k := a.A.BF16.Dim(1)
	if aligned16(a.A.BF16, k) == 0 || aligned16(a.W.BF16, k) == 0 || !streamFits(s.Ta, k) {
		return false, nil
	}
	return true, be.streamLaunch(false, a, s, be.errw, ptr(a.A.BF16), drv.DevicePtr(0), drv.DevicePtr(0), int32(k),
		ptr(a.Gather), int32(s.Ta), ptr(a.W.BF16), drv.DevicePtr(0), drv.DevicePtr(0), int32(s.N), ptr(a.Offsets), int32(s.E),
		int32(s.R), int32(a.Act), ptr(a.Out), int32(s.OutN))
}

// Route computes the router's scores and top-k, one warp per token: with
// the scores in registers up to 256 experts and top-32, else in shared memory.
func (be *Backend) Route(a kernels.RouteArgs) error {
	var t, e, k int
	validate := func() (err error) {
		t, e, k, err = a.Validate()
		return err
	}
	return be.issue("route", a, validate, func(*drv.Ctx) error {
		if t == 0 {
			return nil
		}
		const warps = routeWarps
		if per := routePer(e); per > 0 && k <= 32 {
			return be.launch(routeKernel{per}, drv.Dim3{X: (t + warps - 1) / warps}, drv.Dim3{X: 32 * warps}, 0,
				routeArgs(a, t, e, k)...)
		}
		shared := routeSmem(e, k)
		if shared > int(be.info.SharedOptin) {
			return fmt.Errorf("cuda: route: %d experts need %d bytes of shared memory, the device has %d", e, shared, be.info.SharedOptin)
		}
		return be.launch(kRoute, drv.Dim3{X: (t + warps - 1) / warps}, drv.Dim3{X: 32 * warps}, shared, routeArgs(a, t, e, k)...)
	})
}

// routeArgs are the route kernels' arguments (route, route_r*, and the
// first ones of dispatch_r*).
func routeArgs(a kernels.RouteArgs, t, e, k int) []any {
	renorm := int32(0)
	if a.Renormalize {
		renorm = 1
	}
	return []any{ptr(a.Logits), ptr(a.IDs), ptr(a.Weights), int32(t), int32(e), int32(k), int32(a.Scoring), renorm, a.Scale}
}

// routePer returns how many scores a lane of route_r* keeps in registers
// for e experts (1, 2, 4 or 8), or 0 past 256 experts, where route keeps
// them in shared memory. Both give the same ids and weights (src/gemm_stream.cu).
func routePer(e int) int {
	for per := 1; per <= 8; per *= 2 {
		if e <= 32*per {
			return per
		}
	}
	return 0
}

// dispatchMaxT is the most tokens dispatch_r* routes: one warp each in
// the counting sort's block of 32 warps.
const dispatchMaxT = 32

// Dispatch runs Route, Permute on its ids and, when q is not nil, a PerRow
// or PerTensor Quantize of the activations (kernels.Dispatcher). Up to 32 tokens, 256
// experts and top-32 it is one kernel (dispatch_r*: block 0 routes, a warp
// a token, and sorts; the next blocks quantize a row each), otherwise the
// separate ops.
func (be *Backend) Dispatch(r kernels.RouteArgs, p kernels.PermuteArgs, q *kernels.QuantizeArgs) error {
	t, e, k, qs, verr := kernels.ValidateDispatch(r, p, q)
	if verr == nil {
		verr = permuteFits("dispatch", e)
	}
	if verr == nil && q != nil {
		verr = packedAligned("dispatch", "quantize dst", q.Dst)
	}
	per, qrows := routePer(e), qs.Mats*qs.Rows
	if verr == nil && (t > dispatchMaxT || per == 0 || k > 32 || qrows > 2*dispatchMaxT) {
		if err := be.Route(r); err != nil {
			return err
		}
		if err := be.Permute(p); err != nil {
			return err
		}
		if q != nil {
			return be.Quantize(*q)
		}
		return nil
	}
	op := struct { // its buffers: checked for ownership, recorded by a capture
		R kernels.RouteArgs
		P kernels.PermuteArgs
		Q *kernels.QuantizeArgs
	}{r, p, q}
	return be.issue("dispatch", op, func() error { return verr }, func(*drv.Ctx) error {
		var qsrc, qpacked, qscales, qscale, qgiven drv.DevicePtr
		vec := int32(0)
		if q != nil {
			qsrc, qpacked, qscales, qscale, qgiven = ptr(q.Src), ptr(q.Dst.Packed), ptr(q.Dst.Scales), ptr(q.Dst.Scale), ptr(q.Input)
			vec = aligned16(q.Src, qs.K)
		}
		args := append(routeArgs(r, t, e, k), be.errw, ptr(p.Offsets), ptr(p.Rows), ptr(p.Slots), qsrc, qpacked, qscales, qscale,
			int32(qs.K), int32(qs.Kp), vec, qgiven)
		return be.launch(dispatchKernel{per}, drv.Dim3{X: 1 + qrows}, drv.Dim3{X: 1024}, permuteSmem(e), args...)
	})
}

// permuteMaxExperts bounds E for the one-block counting sort, whose shared
// memory holds 32 per-warp counters per expert (permuteSmem).
const permuteMaxExperts = 1024

// permuteFits checks e against permuteMaxExperts for op.
func permuteFits(op string, e int) error {
	if e > permuteMaxExperts {
		return fmt.Errorf("cuda: %s: %d experts; this backend sorts at most %d", op, e, permuteMaxExperts)
	}
	return nil
}

// Permute sorts the assignments by expert: a stable counting sort in one
// block of 32 warps, each owning a contiguous segment of assignments.
func (be *Backend) Permute(a kernels.PermuteArgs) error {
	var t, k, e int
	validate := func() (err error) {
		if t, k, e, err = a.Validate(); err != nil {
			return err
		}
		return permuteFits("permute", e)
	}
	return be.issue("permute", a, validate, func(*drv.Ctx) error {
		return be.launch(kPermute, drv.Dim3{X: 1}, drv.Dim3{X: 1024}, permuteSmem(e),
			be.errw, ptr(a.IDs), ptr(a.Offsets), ptr(a.Rows), ptr(a.Slots), int32(t*k), int32(k), int32(e))
	})
}

var _ kernels.Amaxer = (*Backend)(nil)

// Amax folds a tensor's largest |value| into a scalar on the op stream
// (kernels.Amaxer): quant_amax's order-free integer max over the FP32
// bits, onto zero first unless it accumulates.
func (be *Backend) Amax(a kernels.AmaxArgs) error {
	var n int
	validate := func() (err error) {
		n, err = a.Validate()
		return err
	}
	return be.issue("amax", a, validate, func(*drv.Ctx) error {
		if !a.Accumulate {
			if err := be.launch(kFillU32, drv.Dim3{X: 1}, drv.Dim3{X: 256}, 0, ptr(a.Dst), int32(1), uint32(0)); err != nil {
				return err
			}
		}
		if n == 0 {
			return nil
		}
		blocks := max(min((n/8+256*4-1)/(256*4), 1024), 1)
		return be.launch(kQuantAmax, drv.Dim3{X: blocks, Y: 1}, drv.Dim3{X: 256}, 0, ptr(a.Src), ptr(a.Dst), int64(n), aligned16(a.Src, n))
	})
}

// Quantize runs the NVFP4 codec: PerRow and PerTensor with a block per row. PerMatrix mode first
// takes each matrix's amax into Scale (as FP32 bits, with an order-free
// atomic max; or copies the caller's, a.Amax, saving a read of every
// matrix), then quantizes, then turns each amax into S_dec, all on the
// stream with no host synchronisation.
func (be *Backend) Quantize(a kernels.QuantizeArgs) error {
	var s kernels.QuantizeShape
	validate := func() (err error) {
		if s, err = a.Validate(); err != nil {
			return err
		}
		if a.Mode == kernels.PerMatrix && s.Rows*(s.Kp/16) >= 1<<31 {
			// The per-matrix kernels index a matrix's blocks in 32 bits.
			return fmt.Errorf("cuda: quantize: %d 16-element blocks per matrix, the most is 2^31-1", s.Rows*(s.Kp/16))
		}
		return packedAligned("quantize", "dst", a.Dst)
	}
	return be.issue("quantize", a, validate, func(c *drv.Ctx) error {
		rows := s.Mats * s.Rows
		if rows == 0 {
			return nil
		}
		vec := aligned16(a.Src, s.K)
		per := s.Rows * s.K
		if a.Mode == kernels.PerMatrix && a.Amax != nil {
			// The caller's amax (FP32, non-negative: its bits are the ones
			// quant_amax leaves) stands for the pass over the matrices.
			if err := c.DtoDAsync(ptr(a.Dst.Scale), ptr(a.Amax), 4*s.Mats, be.stream); err != nil {
				return fmt.Errorf("cuda: quantize: amax: %w", err)
			}
		} else if a.Mode == kernels.PerMatrix {
			if err := be.launch(kFillU32, drv.Dim3{X: (s.Mats + 255) / 256}, drv.Dim3{X: 256}, 0,
				ptr(a.Dst.Scale), int32(s.Mats), uint32(0)); err != nil {
				return err
			}
			blocks := min((per/8+256*4-1)/(256*4), 1024)
			// A grid's y dimension stops at 65535: larger stacks take several launches.
			for m0 := 0; m0 < s.Mats; m0 += 65535 {
				n := min(65535, s.Mats-m0)
				if err := be.launch(kQuantAmax, drv.Dim3{X: max(blocks, 1), Y: n}, drv.Dim3{X: 256}, 0,
					ptr(a.Src).Add(2*m0*per), ptr(a.Dst.Scale).Add(4*m0), int64(per), vec); err != nil {
					return err
				}
			}
		}
		if a.Mode == kernels.PerMatrix {
			blocksPer := s.Rows * (s.Kp / 16)
			for m0 := 0; m0 < s.Mats; m0 += 65535 {
				n := min(65535, s.Mats-m0)
				if err := be.launch(kQuantBlocks, drv.Dim3{X: min((blocksPer+quantBlocksPerThread*256-1)/(quantBlocksPerThread*256), 1<<20), Y: n}, drv.Dim3{X: 256}, 0,
					ptr(a.Src).Add(2*m0*per), ptr(a.Dst.Packed).Add(m0*s.Rows*s.Kp/2), ptr(a.Dst.Scales).Add(m0*s.Rows*s.Kp/16),
					ptr(a.Dst.Scale).Add(4*m0), uint32(blocksPer), int32(s.Rows), int32(s.K), int32(s.Kp), vec); err != nil {
					return err
				}
			}
			return be.launch(kQuantScales, drv.Dim3{X: (s.Mats + 255) / 256}, drv.Dim3{X: 256}, 0,
				ptr(a.Dst.Scale), int32(s.Mats))
		}
		// A block per row, no wider than the row's 16-element blocks (the
		// shape decides, never the batch).
		threads := max(32, min(256, (s.Kp/16+31)/32*32))
		return be.launch(kQuantRows, drv.Dim3{X: rows}, drv.Dim3{X: threads}, 0,
			ptr(a.Src), ptr(a.Dst.Packed), ptr(a.Dst.Scales), ptr(a.Dst.Scale), int32(rows), int32(s.K), int32(s.Kp), vec, ptr(a.Input))
	})
}

// quantBlocksPerThread is about how many 16-element blocks a quant_blocks
// thread takes: enough to spread its per-matrix scale arithmetic.
const quantBlocksPerThread = 8

// errScatter refuses the atomic finalize where only the older grouped GEMM
// kernels apply.
var errScatter = errors.New("cuda: grouped gemm: the scatter (atomic finalize) runs only in the streamed kernels: " +
	"both operands NVFP4, or BF16 rows of whole 16-byte units, and A below 2^31 elements")

// FinalizeScattered rounds the atomic finalize's sums to BF16 and clears them.
func (be *Backend) FinalizeScattered(out, acc *kernels.Buffer) error {
	var t, h int
	validate := func() (err error) {
		t, h, err = kernels.ValidateFinalizeScattered(out, acc)
		return err
	}
	return be.issue("finalize scattered", [2]*kernels.Buffer{out, acc}, validate, func(*drv.Ctx) error {
		n := t * h
		if n == 0 {
			return nil
		}
		return be.launch(kFinalizeScattered, drv.Dim3{X: min((n+255)/256, 4096)}, drv.Dim3{X: 256}, 0, ptr(out), ptr(acc), int64(n))
	})
}

// Finalize sums each token's weighted expert rows in fixed k order.
func (be *Backend) Finalize(a kernels.FinalizeArgs) error {
	var t, h, k int
	validate := func() (err error) {
		t, h, k, err = a.Validate()
		return err
	}
	return be.issue("finalize", a, validate, func(*drv.Ctx) error {
		if t == 0 || h == 0 {
			return nil
		}
		threads := 256
		return be.launch(kFinalize, drv.Dim3{X: t, Y: (h + 2*threads - 1) / (2 * threads)}, drv.Dim3{X: threads}, 0,
			be.errw, ptr(a.Out), ptr(a.Rows), ptr(a.Weights), ptr(a.Slots), int32(h), int32(k), int32(a.Rows.Dim(0)))
	})
}
