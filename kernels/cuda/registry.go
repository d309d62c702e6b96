package cuda

import (
	"fmt"
	"slices"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
)

// The kernel registry: the one place on the host where a kernel's name,
// compile unit, template arguments, block and cluster shape, dynamic shared
// memory and minimum architecture are written. Launches name a kernel by
// its key (a plainKernel constant or a family's key struct), and launch
// checks the launch against the kernel's entry.

// kernelSpec is one kernel variant.
type kernelSpec struct {
	key  any    // plainKernel or a family key (routeKernel, streamKernel, ...)
	name string // host name: logs, errors, tests
	unit string // compile unit, a file of src/
	expr string // NVRTC name expression of the entry point
	// threads is the block size; 0: chosen per launch, up to maxThreads.
	threads, maxThreads int
	clusterZ            int // blocks a cluster along z (0: no cluster)
	// smem is the dynamic shared memory; smemPerLaunch: chosen per launch
	// (by a function below), up to the device's opt-in limit.
	smem    int
	minArch string // "" or archWGMMA
	// pdl: the kernel reads global memory only after pdl_wait (ptx.cuh),
	// so it is launched with programmatic stream serialization.
	pdl bool
}

// smemPerLaunch marks a kernelSpec whose dynamic shared memory depends on
// the launch.
const smemPerLaunch = -1

// archWGMMA is the one target with wgmma (gemm_ws.cu).
const archWGMMA = "sm_90a"

// plainKernel names the kernels that have one variant.
type plainKernel int

const (
	kFillU32 plainKernel = iota
	kQuantAmax
	kQuantScales
	kQuantRows
	kQuantBlocks
	kRoute
	kPermute
	kFinalize
	kFinalizeScattered
	kGroupedGemm
	kGemmNarrow
	kGemmNarrow8
	kGemmNarrow8Short
	kGemmNarrowWide
	kEmbed
	kRMSNorm
	kAddRMSNorm
	kAdd
	kRoPE
	kKVWrite
	kQKVPrep
	kAttention
	kSample
	kSampleMax
	kSampleWide
	kLogProbs
	kScatterBF16
)

// routeKernel is route_r<per>: per scores a lane in registers.
type routeKernel struct{ per int }

// dispatchKernel is dispatch_r<per>: route_r<per>, permute and quant_rows
// in one launch.
type dispatchKernel struct{ per int }

// stagedKernel is gemm_staged<bm, swiglu>, the staged NVFP4 grouped GEMM.
type stagedKernel struct {
	bm     int
	swiglu bool
}

// streamKernel is a streamed grouped GEMM: bm-row tiles (16, 32, 64; 8 for
// the NVFP4 kernels that stage a tile's whole K range at once), j n8 tiles
// a warp, NVFP4 or BF16 operands, K split over a cluster pair (ks2).
type streamKernel struct {
	fp4         bool
	bm, j       int
	swiglu, ks2 bool
}

// tileKernel is the tiled NVFP4 grouped GEMM of warps warps (16 or 8).
type tileKernel struct {
	warps       int
	swiglu, ks2 bool
}

// denseTileKernel is gemm_dense_tile<DenseTile<bm, bn, wm, wn, stages,
// sps>>: bm x bn tiles of a dense GEMM's output in wm x wn warps, a
// cp.async ring of stages stages of sps double slices (32 k) each.
type denseTileKernel struct{ bm, bn, wm, wn, stages, sps int }

// denseTiles are the tiled dense GEMM's variants (planDenseTile): 64 x
// 128 and 64 x 64 in 4 warps, each ring 96 KB, two blocks a
// multiprocessor. (128 x 128 tiles in 8 warps measured slower than 64 x
// 128 ones on an H100 at every shape of the model up to 2048 rows.)
var denseTiles = []denseTileKernel{denseWide, denseSmall}

var (
	denseWide  = denseTileKernel{64, 128, 2, 2, 4, 2}
	denseSmall = denseTileKernel{64, 64, 2, 2, 3, 4}
)

func (k denseTileKernel) threads() int { return 32 * k.wm * k.wn }

// smem is DenseTile::SMEM: a double slice holds 64 bytes of every A and w
// row.
func (k denseTileKernel) smem() int { return k.stages * k.sps * (k.bm + k.bn) * 64 }

// attKernel is att_tc<d, group, warps>, attention on tensor cores for head
// dim d and group query heads per KV head, in blocks of warps warps (4 or
// 1) (attention.cu).
type attKernel struct{ d, group, warps int }

// attDims and attGroups are the geometries att_tc is built for; others
// take att_generic. attNarrowDims are the head dims also built in 1-warp
// blocks (the others always run 4 warps a block).
var (
	attDims       = []int{16, 32, 64, 128}
	attGroups     = []int{1, 2, 4, 8, 16}
	attNarrowDims = []int{64, 128}
)

// wsKernel is the warp-specialised wgmma NVFP4 grouped GEMM of rows-row
// tiles (128 or 192).
type wsKernel struct {
	rows        int
	swiglu, ks2 bool
}

// Shared memory and block sizes the registry's entries use.
const (
	gemmThreads = 128 // grouped_gemm, gemm_staged: 4 warps
	// g4LD is gemm_staged's shared tile row stride in BF16 elements.
	g4LD = 128 + 8
	// gemmWideSmem is gemm_narrow_wide's: the 16 warps' partial sums of the
	// 32 x 32 tile (rows padded to 33).
	gemmWideSmem = 16 * 32 * 33 * 4
	// streamTileSmem: each 16-row tile of activations takes 4 KB of shared
	// memory per K chunk, double buffered.
	streamTileSmem = 2 * 4096
	// streamDepth16 is g5_depth for NVFP4 16-row tiles (gemm_stream.cu): 5
	// chunks, so that four blocks share an SM (TestStreamSmemFits).
	streamDepth16 = 5
	// tileSmem is the tiled kernel's: two shared buffers of 2 x 2048
	// 16-byte items.
	tileSmem = 2 * 2 * 2048 * 16
	// wsSmem and wsSmem192 are the warp-specialised kernel's (gemm_ws.cu
	// gw_gemm, MT = 2, 3): 2 stages of the tile's activation rows and 128
	// weight rows, 128 K of BF16 each (256 bytes a row), 4 (2) chunks of
	// the producers' raw codes and scales (256 threads x 4 (5) rows x 20
	// bytes), and 1 KB to align the stages to 1024 bytes for the 128-byte
	// swizzle.
	wsSmem    = 2*(128+128)*256 + 4*256*4*20 + 1024
	wsSmem192 = 2*(192+128)*256 + 2*256*5*20 + 1024
	// Model kernels' block sizes (model.go).
	copyThreads    = 128  // embed, kv write, rope: one block per token
	prepThreads    = 128  // qkv prep: a warp per (token, head), 4 heads a block (MODEL_PREP_WARPS)
	prepMaxD       = 256  // qkv prep: the largest head dim (MODEL_PREP_MAXD)
	normMaxThreads = 256  // rmsnorm: one block per row
	addThreads     = 256  // add: grid-stride
	attTile        = 64   // att_generic: positions per shared-memory tile (attention.cu ATT_G_TILE)
	attThreads     = 256  // att_generic: threads per (query row, kv head) (ATT_G_THREADS)
	attTCGroupLen  = 512  // att_tc: positions a group joins (ATT_GROUPLEN)
	sampleThreads  = 1024 // sample: one block per row (MODEL_SAMPLE_THREADS)
	// The wide sampler (model_sample_max, model_sample_wide): a block per
	// segment of sampleSeg logits of a row (MODEL_SAMPLE_SEG,
	// MODEL_SAMPLE_WIDE_THREADS), for up to sampleWideRows rows of up to
	// sampleWideSegs segments (its scratch: a counter a row, then a
	// 24-byte ModelSampleSeg a segment).
	sampleSeg         = 8192
	sampleWideThreads = 256
	sampleWideRows    = 1024
	sampleWideSegs    = 32
	sampleScratch     = (sampleWideRows*4+7)&^7 + sampleWideRows*sampleWideSegs*24
	logprobsThreads   = 512 // logprobs: one block per row (MODEL_LOGPROBS_THREADS)
	scatterThreads    = 256 // scatter bf16: one block per span (MODEL_SCATTER_THREADS)
	routeWarps        = 4   // route, route_r: a warp per token
)

// streamSmem is the dynamic shared memory of a streamed kernel of bm-row
// tiles and j n8 tiles a warp: the activation buffers and each warp's ring
// of weight chunks (g5_depth deep): for NVFP4 16 B of codes per lane and
// tile and half a lane pair's scale word per chunk, for BF16 4 chunks of
// 64 B.
func streamSmem(fp4 bool, bm, j int) int {
	ring := 4 * 64 // bytes per lane and tile: 4 chunks of 64 B
	if fp4 {
		depth := 8
		switch {
		case bm == 16:
			depth = streamDepth16
		case j == 4:
			depth = 4
		}
		ring = depth * (16 + 2) // per chunk: 16 B of codes, half a lane pair's scale word
	}
	return bm/16*streamTileSmem + 8*j*32*ring
}

// Streamed NVFP4 kernels of 8-row tiles (gemm_stream.cu g5_gemm, M8): the
// ring is streamDepthM8 chunks deep and the activation region holds the
// block's whole K range, at most streamM8Chunks chunks of 2 KB, so that
// three blocks fit an SM (TestStreamSmemFits).
const (
	streamDepthM8  = 4
	streamM8Chunks = 18
)

// streamM8Smem is the dynamic shared memory of an 8-row kernel of j n8
// tiles a warp whose blocks take nchb chunks of K each: g5_m8units.
func streamM8Smem(j, nchb int) int {
	return max(nchb*128, 2*256)*16 + 8*j*32*streamDepthM8*(16+2)
}

// stagedSmem is gemm_staged's: bm activation rows and the weight rows (64,
// or 128 for SwiGLU) of g4LD BF16 elements.
func stagedSmem(bm int, swiglu bool) int {
	wRows := 64
	if swiglu {
		wRows = 128
	}
	return (bm + wRows) * g4LD * 2
}

// routeSmem is route's: each warp's scores, chosen scores and taken flags.
func routeSmem(e, k int) int { return routeWarps * (e*5 + k*4) }

// permuteSmem is the counting sort's shared memory (permute, dispatch_r):
// 32 per-warp counters and an offset per expert, and one more offset.
func permuteSmem(e int) int { return (32*e + e + 1) * 4 }

// attTCSmem is the dynamic shared memory of att_tc for head dim d in
// blocks of w warps (AttTC<D>::smem<W>()): each warp's two stages of 32 K
// and 32 V rows (padded by 8 elements) and two 16 x d FP32 areas, the
// per-row maxima and sums, a flag.
func attTCSmem(d, w int) int { return w*2*(2*32*(d+8))*2 + w*2*16*d*4 + 2*w*16*4 + 16 }

// attWideBlocks and attNarrowBlocks are how many 4-warp and 1-warp att_tc
// blocks of head dim 128 a multiprocessor holds (shared memory bound: 205
// KB, and 4 x 51 KB, of 228 KB).
const (
	attWideBlocks   = 1
	attNarrowBlocks = 4
)

// attWidePairs: launches of fewer than this many (query row, KV head)
// pairs a multiprocessor take 4-warp blocks. Measured on an H100
// (TestAttentionDecodeSpeed, 4 KV heads, batch 64: 2 pairs a
// multiprocessor): 4 warps 65.8 / 200.5 / 731.7 us at 1 k / 4 k / 16 k
// positions against 75.6 / 306.7 / 1200.3 with 1 warp, 22.0 against 13.9
// at 128; at batch 256 (8 a multiprocessor) 1 warp is as fast or faster
// at every context.
const attWidePairs = 2

// attPlan is how att_tc serves a launch: blocks of warps warps, and a
// one-row tile's groups spread over z blocks.
type attPlan struct{ warps, z int }

// planAttention picks att_tc's block width and spread for a launch of
// pairs (query row, KV head) pairs whose sequences have at most groups
// groups of positions, on sms multiprocessors; warps is the block width
// to use, or 0 to choose. Fewer pairs than attWidePairs a multiprocessor
// take 4-warp blocks, a group's four splits side by side; more take 1-warp
// blocks. A
// decode row's groups spread over as many blocks as fit the
// multiprocessors' free slots in one wave (a second wave of blocks would
// walk as long as the first), then over as few as walk the same number of
// groups each. Neither choice changes a row's bits (attention.cu), so it
// may follow the batch.
func planAttention(pairs, groups, sms, warps int) attPlan {
	pairs, groups = max(1, pairs), max(1, groups)
	if warps == 0 {
		warps = 4
		if pairs >= attWidePairs*sms {
			warps = 1
		}
	}
	slots := sms * attWideBlocks
	if warps == 1 {
		slots = sms * attNarrowBlocks
	}
	z := min(groups, max(1, slots/pairs))
	best := ceilDiv(groups, ceilDiv(groups, z))
	return attPlan{warps: warps, z: best}
}

// ceilDiv is a / b rounded up, for a >= 0 and b > 0.
func ceilDiv(a, b int) int { return (a + b - 1) / b }

// attSpreadSeqs is the most sequences a launch of kvHeads KV heads can
// spread over z > 1 blocks (planAttention: two blocks a pair need at most
// half the slots, at most attNarrowBlocks*sms/2 pairs): the scratch
// AttentionScratch sizes holds that many.
func attSpreadSeqs(kvHeads, sms int) int {
	return (attNarrowBlocks*sms/2 + kvHeads - 1) / kvHeads
}

// attScratchEntry is the floats of one group partial in att_tc's scratch
// (AttTC<D>::ENTRY): the 16 x d accumulators and 16 maxima and sums.
func attScratchEntry(d int) int { return 16*d + 32 }

// attScratchBytes is the scratch att_tc needs for s sequences of kvHeads
// KV heads and groups partials each: a counter per (sequence, KV head),
// rounded up to 4, then the entries.
func attScratchBytes(s, kvHeads, groups, d int) int {
	return 4 * ((s*kvHeads+3)&^3 + s*kvHeads*groups*attScratchEntry(d))
}

// attentionShared is the dynamic shared memory of att_generic for a
// group of query heads per KV head and head dim d: the K and V tiles (rows
// padded by 8 elements), the tile's row offsets, then FP32 q, accumulators,
// scores and three per-head values.
func attentionShared(group, d int) int {
	return 2*attTile*(d+8)*2 + attTile*8 + (2*group*d+group*attTile+3*group)*4
}

// name is the streamed kernel's host name, e.g. gemm_fp4_stream_m16_ks2_j1.
func (k streamKernel) name() string {
	n := "gemm_bf16_stream"
	if k.fp4 {
		n = "gemm_fp4_stream"
	}
	n += fmt.Sprintf("_m%d", k.bm)
	if k.swiglu {
		n += "_swiglu"
	}
	if k.ks2 {
		n += "_ks2"
	}
	if k.j != 2 {
		n += fmt.Sprintf("_j%d", k.j)
	}
	return n
}

// streamVariants are the streamed kernels the host launches (streamPlan):
// NVFP4 8-row tiles with two n8 tiles a warp, 16-row tiles with one or two
// (one only without SwiGLU), 32-row tiles with four, 64-row tiles with
// two, each with and without the K split; BF16 likewise with two n8 tiles
// a warp at every tile size from 16 rows and no K split.
func streamVariants() []streamKernel {
	var ks []streamKernel
	for _, ks2 := range []bool{false, true} {
		for _, v := range []streamKernel{{bm: 8, j: 2}, {bm: 8, j: 2, swiglu: true}, {bm: 16, j: 2}, {bm: 16, j: 1},
			{bm: 16, j: 2, swiglu: true}, {bm: 32, j: 4}, {bm: 32, j: 4, swiglu: true}, {bm: 64, j: 2}, {bm: 64, j: 2, swiglu: true}} {
			v.fp4, v.ks2 = true, ks2
			ks = append(ks, v)
		}
	}
	for _, v := range []streamKernel{{bm: 16, j: 2}, {bm: 16, j: 1}, {bm: 16, j: 2, swiglu: true}, {bm: 32, j: 2},
		{bm: 32, j: 2, swiglu: true}, {bm: 64, j: 2}, {bm: 64, j: 2, swiglu: true}} {
		ks = append(ks, v)
	}
	return ks
}

// cppBool writes b as a C++ template argument.
func cppBool(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

// ks2Entry returns a family's entry point with the K split's suffix.
func ks2Entry(base string, ks2 bool) string {
	if ks2 {
		return base + "_ks2"
	}
	return base
}

// clusterOf is the cluster size along z of a K-split kernel.
func clusterOf(ks2 bool) int {
	if ks2 {
		return 2
	}
	return 0
}

// kernelRegistry returns every kernel variant, built afresh.
func kernelRegistry() []kernelSpec {
	plain := func(key plainKernel, name, unit string, threads, smem int, pdl bool) kernelSpec {
		return kernelSpec{key: key, name: name, unit: unit, expr: "rw::" + name, threads: threads, smem: smem, pdl: pdl}
	}
	perLaunch := func(s kernelSpec, maxThreads int) kernelSpec {
		s.threads, s.maxThreads = 0, maxThreads
		return s
	}
	ks := []kernelSpec{
		plain(kFillU32, "fill_u32", "quantize.cu", 256, 0, false),
		plain(kQuantAmax, "quant_amax", "quantize.cu", 256, 0, false),
		plain(kQuantScales, "quant_scales", "quantize.cu", 256, 0, false),
		perLaunch(plain(kQuantRows, "quant_rows", "quantize.cu", 0, 0, true), 256),
		plain(kQuantBlocks, "quant_blocks", "quantize.cu", 256, 0, false),
		plain(kRoute, "route", "dispatch.cu", 32*routeWarps, smemPerLaunch, false),
		plain(kPermute, "permute", "dispatch.cu", 1024, smemPerLaunch, false),
		plain(kFinalize, "finalize", "dispatch.cu", 256, 0, true),
		plain(kFinalizeScattered, "finalize_scattered", "dispatch.cu", 256, 0, false),
		plain(kGroupedGemm, "grouped_gemm", "gemm_generic.cu", gemmThreads, 0, false),
		plain(kGemmNarrow, "gemm_narrow", "gemm_dense.cu", 512, 0, true),
		plain(kGemmNarrow8, "gemm_narrow8", "gemm_dense.cu", 512, 0, true),
		plain(kGemmNarrow8Short, "gemm_narrow8_short", "gemm_dense.cu", 512, 0, true),
		plain(kGemmNarrowWide, "gemm_narrow_wide", "gemm_dense.cu", 512, gemmWideSmem, true),
		plain(kEmbed, "model_embed", "model.cu", copyThreads, 0, true),
		perLaunch(plain(kRMSNorm, "model_rmsnorm", "model.cu", 0, 0, true), normMaxThreads),
		perLaunch(plain(kAddRMSNorm, "model_add_rmsnorm", "model.cu", 0, 0, true), normMaxThreads),
		plain(kAdd, "model_add", "model.cu", addThreads, 0, true),
		plain(kRoPE, "model_rope", "model.cu", copyThreads, 0, true),
		plain(kKVWrite, "model_kv_write", "model.cu", copyThreads, 0, true),
		plain(kQKVPrep, "model_qkv_prep", "model.cu", prepThreads, 0, true),
		plain(kAttention, "att_generic", "attention.cu", attThreads, smemPerLaunch, false),
		plain(kSample, "model_sample", "model.cu", sampleThreads, 0, false),
		plain(kSampleMax, "model_sample_max", "model.cu", sampleWideThreads, 0, false),
		plain(kSampleWide, "model_sample_wide", "model.cu", sampleWideThreads, 0, false),
		plain(kLogProbs, "model_logprobs", "model.cu", logprobsThreads, 0, false),
		plain(kScatterBF16, "model_scatter_bf16", "model.cu", scatterThreads, 0, false),
	}
	for _, k := range denseTiles {
		ks = append(ks, kernelSpec{key: k, name: fmt.Sprintf("gemm_dense_tile_%dx%d", k.bm, k.bn), unit: "gemm_dense.cu",
			expr:    fmt.Sprintf("rw::gemm_dense_tile<rw::DenseTile<%d, %d, %d, %d, %d, %d>>", k.bm, k.bn, k.wm, k.wn, k.stages, k.sps),
			threads: k.threads(), smem: k.smem(), pdl: true})
	}
	for _, d := range attDims {
		for _, g := range attGroups {
			ks = append(ks, kernelSpec{key: attKernel{d, g, 4}, name: fmt.Sprintf("att_tc_d%d_g%d", d, g), unit: "attention.cu",
				expr: fmt.Sprintf("rw::att_tc<%d, %d, 4>", d, g), threads: 4 * 32, smem: attTCSmem(d, 4)})
			if slices.Contains(attNarrowDims, d) {
				ks = append(ks, kernelSpec{key: attKernel{d, g, 1}, name: fmt.Sprintf("att_tc_d%d_g%d_w1", d, g), unit: "attention.cu",
					expr: fmt.Sprintf("rw::att_tc<%d, %d, 1>", d, g), threads: 32, smem: attTCSmem(d, 1)})
			}
		}
	}
	for _, per := range []int{1, 2, 4, 8} {
		ks = append(ks,
			kernelSpec{key: routeKernel{per}, name: fmt.Sprintf("route_r%d", per), unit: "dispatch.cu",
				expr: fmt.Sprintf("rw::route_r<%d>", per), threads: 32 * routeWarps},
			kernelSpec{key: dispatchKernel{per}, name: fmt.Sprintf("dispatch_r%d", per), unit: "dispatch.cu",
				expr: fmt.Sprintf("rw::dispatch_r<%d>", per), threads: 1024, smem: smemPerLaunch, pdl: true})
	}
	for _, bm := range []int{64, 16} {
		for _, swiglu := range []bool{false, true} {
			name := fmt.Sprintf("grouped_gemm_fp4_m%d", bm)
			if swiglu {
				name += "_swiglu"
			}
			ks = append(ks, kernelSpec{key: stagedKernel{bm, swiglu}, name: name, unit: "gemm_generic.cu",
				expr: fmt.Sprintf("rw::gemm_staged<%d, %s>", bm, cppBool(swiglu)), threads: gemmThreads, smem: stagedSmem(bm, swiglu)})
		}
	}
	for _, v := range streamVariants() {
		tile := fmt.Sprintf("%d, %d, %s, %s", v.bm/16, v.j, cppBool(v.swiglu), cppBool(v.fp4))
		smem := streamSmem(v.fp4, v.bm, v.j)
		if v.bm == 8 {
			tile, smem = fmt.Sprintf("1, %d, %s, %s, true", v.j, cppBool(v.swiglu), cppBool(v.fp4)), smemPerLaunch
		}
		ks = append(ks, kernelSpec{key: v, name: v.name(), unit: "gemm_stream.cu",
			expr:    fmt.Sprintf("rw::%s<rw::StreamTile<%s>>", ks2Entry("gemm_stream", v.ks2), tile),
			threads: 256, clusterZ: clusterOf(v.ks2), smem: smem, pdl: true})
	}
	for _, ks2 := range []bool{false, true} {
		for _, warps := range []int{16, 8} {
			for _, swiglu := range []bool{false, true} {
				name := "gemm_fp4_tile"
				if warps == 8 {
					name += "_w8"
				}
				if swiglu {
					name += "_swiglu"
				}
				ks = append(ks, kernelSpec{key: tileKernel{warps, swiglu, ks2}, name: ks2Entry(name, ks2), unit: "gemm_tile.cu",
					expr:    fmt.Sprintf("rw::%s<rw::TileShape<%d, %s>>", ks2Entry("gemm_tile", ks2), warps, cppBool(swiglu)),
					threads: 32 * warps, clusterZ: clusterOf(ks2), smem: tileSmem})
			}
		}
		for _, rows := range []int{128, 192} {
			for _, swiglu := range []bool{false, true} {
				name, smem := "gemm_fp4_ws", wsSmem
				if rows == 192 {
					name, smem = "gemm_fp4_ws192", wsSmem192
				}
				if swiglu {
					name += "_swiglu"
				}
				mt := rows / 64
				ks = append(ks, kernelSpec{key: wsKernel{rows, swiglu, ks2}, name: ks2Entry(name, ks2), unit: "gemm_ws.cu",
					expr:    fmt.Sprintf("rw::%s<rw::WsTile<%d, %s>>", ks2Entry("gemm_ws", ks2), mt, cppBool(swiglu)),
					threads: 256 + 128*mt, clusterZ: clusterOf(ks2), smem: smem, minArch: archWGMMA})
			}
		}
	}
	return ks
}

// check reports a launch that does not match the kernel's entry: the block
// size, the cluster shape, the dynamic shared memory or the architecture.
func (k *kernelSpec) check(arch string, grid, block drv.Dim3, shared, sharedOptin int) error {
	threads := block.X * max(block.Y, 1) * max(block.Z, 1)
	switch {
	case k.threads != 0 && threads != k.threads:
		return fmt.Errorf("cuda: launch %s: block of %d threads, the kernel is built for %d", k.name, threads, k.threads)
	case k.threads == 0 && (threads < 1 || threads > k.maxThreads):
		return fmt.Errorf("cuda: launch %s: block of %d threads, the kernel takes 1 to %d", k.name, threads, k.maxThreads)
	case k.clusterZ > 1 && max(grid.Z, 1)%k.clusterZ != 0:
		return fmt.Errorf("cuda: launch %s: grid z %d is not a multiple of its cluster's %d blocks", k.name, grid.Z, k.clusterZ)
	case k.smem == smemPerLaunch && (shared < 0 || shared > sharedOptin):
		return fmt.Errorf("cuda: launch %s: %d bytes of dynamic shared memory, the device allows %d", k.name, shared, sharedOptin)
	case k.smem != smemPerLaunch && shared != k.smem:
		return fmt.Errorf("cuda: launch %s: %d bytes of dynamic shared memory, the kernel is built for %d", k.name, shared, k.smem)
	case k.minArch != "" && arch != k.minArch:
		return fmt.Errorf("cuda: launch %s: the kernel needs %s, the device is %s", k.name, k.minArch, arch)
	}
	return nil
}
