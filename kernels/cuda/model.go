package cuda

import (
	"fmt"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// The dense model's ops (kernels.ModelOps). Launch geometry lives here; the
// kernels are in src/model.cu, their block sizes in registry.go. Every kernel that follows an index read from
// a buffer takes the device error word first, skips the affected row and
// reports it (errors.go).

// Block sizes (registry.go) are each fixed, or a function of a shape only,
// so every reduction order depends on the row's own shape, never on the
// batch.
const addMaxBlocks = 4096 // add: grid-stride

// Embed gathers table rows: one block per token.
func (be *Backend) Embed(a kernels.EmbedArgs) error {
	var t, h, v int
	validate := func() (err error) {
		t, h, v, err = a.Validate()
		return err
	}
	return be.issue("embed", a, validate, func(*drv.Ctx) error {
		if t == 0 || h == 0 {
			return nil
		}
		return be.launch(kEmbed, drv.Dim3{X: t}, drv.Dim3{X: copyThreads}, 0,
			be.errw, ptr(a.Out), ptr(a.Table), ptr(a.IDs), int32(h), int32(v))
	})
}

// RMSNorm normalises rows: one block per row, its size a function of the
// width alone (a multiple of 32, at most normMaxThreads); with a residual,
// model_add_rmsnorm adds it first in the same launch.
func (be *Backend) RMSNorm(a kernels.RMSNormArgs) error {
	var rows, d int
	validate := func() (err error) {
		rows, d, err = a.Validate()
		return err
	}
	return be.issue("rmsnorm", a, validate, func(*drv.Ctx) error {
		if rows == 0 || d == 0 {
			return nil
		}
		threads := min(normMaxThreads, (d+31)/32*32)
		if a.Residual != nil {
			return be.launch(kAddRMSNorm, drv.Dim3{X: rows}, drv.Dim3{X: threads}, 0,
				ptr(a.Out), ptr(a.Src), ptr(a.Residual), ptr(a.Weight), int32(d), a.Eps)
		}
		return be.launch(kRMSNorm, drv.Dim3{X: rows}, drv.Dim3{X: threads}, 0,
			ptr(a.Out), ptr(a.Src), ptr(a.Weight), int32(d), a.Eps)
	})
}

// Add is the residual add, element-wise (grid-stride, 8 elements a thread
// when the buffers allow 16-byte accesses).
func (be *Backend) Add(a kernels.AddArgs) error {
	var n int
	validate := func() (err error) {
		n, err = a.Validate()
		return err
	}
	return be.issue("add", a, validate, func(*drv.Ctx) error {
		if n == 0 {
			return nil
		}
		blocks := min(addMaxBlocks, (n+8*addThreads-1)/(8*addThreads))
		return be.launch(kAdd, drv.Dim3{X: blocks}, drv.Dim3{X: addThreads}, 0,
			ptr(a.Out), ptr(a.A), ptr(a.B), int64(n))
	})
}

// RoPE rotates X in place: one block per token.
func (be *Backend) RoPE(a kernels.RoPEArgs) error {
	var t, heads, d, maxPos int
	validate := func() (err error) {
		t, heads, d, maxPos, err = a.Validate()
		return err
	}
	return be.issue("rope", a, validate, func(*drv.Ctx) error {
		if t == 0 || heads == 0 || d == 0 {
			return nil
		}
		return be.launch(kRoPE, drv.Dim3{X: t}, drv.Dim3{X: copyThreads}, 0,
			be.errw, ptr(a.X), ptr(a.Positions), ptr(a.Cos), ptr(a.Sin), int32(heads), int32(d), int32(maxPos))
	})
}

// KVWrite scatters keys and values into their cache slots: one block per
// token; negative slots are skipped. Duplicate slots cannot be detected on
// the device (see model_kv_write).
func (be *Backend) KVWrite(a kernels.KVWriteArgs) error {
	var t int
	var cs kernels.CacheShape
	validate := func() (err error) {
		t, cs, err = a.Validate()
		return err
	}
	return be.issue("kv write", a, validate, func(*drv.Ctx) error {
		if t == 0 {
			return nil
		}
		return be.launch(kKVWrite, drv.Dim3{X: t}, drv.Dim3{X: copyThreads}, 0,
			be.errw, ptr(a.Cache.K), ptr(a.Cache.V), ptr(a.K), ptr(a.V), ptr(a.Slots),
			int32(cs.KVHeads*cs.D), int64(cs.Pages)*int64(cs.PageSize))
	})
}

// QKVPrep is the q/k norms, RoPE and the cache write in one launch
// (model_qkv_prep: a warp per token and head, prepThreads / 32 heads a
// block); head dims past prepMaxD take the three ops one by one.
func (be *Backend) QKVPrep(a kernels.QKVPrepArgs) error {
	t, qh, cs, maxPos, err := a.Validate()
	if err != nil {
		return err
	}
	if cs.D > prepMaxD {
		return kernels.QKVPrepSteps(be, a)
	}
	var eps float32
	if a.QNorm != nil {
		eps = a.Eps
	}
	return be.issue("qkv prep", a, func() error { return nil }, func(*drv.Ctx) error {
		if t == 0 {
			return nil
		}
		heads := (qh + cs.KVHeads + prepThreads/32 - 1) / (prepThreads / 32)
		return be.launch(kQKVPrep, drv.Dim3{X: t, Y: heads}, drv.Dim3{X: prepThreads}, 0,
			be.errw, ptr(a.Q), ptr(a.K), ptr(a.V), ptr(a.QNorm), ptr(a.KNorm), eps, ptr(a.Positions), ptr(a.Cos), ptr(a.Sin),
			ptr(a.Cache.K), ptr(a.Cache.V), ptr(a.Slots), int32(qh), int32(cs.KVHeads), int32(cs.D), int32(maxPos),
			int64(cs.Pages)*int64(cs.PageSize))
	})
}

// Attention is causal GQA over the paged cache. Geometries att_tc is built
// for (attDims, attGroups) run on tensor cores: a block per (query row, KV
// head, z), where only the first row of each tile of a sequence's rows
// works, and a decode row's positions spread over gridDim.z blocks when
// there is scratch; planAttention picks the block width and z from the
// launch's size. Other geometries take att_generic: one block per (query
// row, KV head). Neither the kernels, the width nor z change a row's bits
// (attention.cu).
func (be *Backend) Attention(a kernels.AttentionArgs) error { return be.attention(a, attAuto) }

// attMode chooses attention's kernel: as Attention does, att_generic
// whatever the geometry, or att_tc in blocks of a given width (for tests
// that compare them).
type attMode int

const (
	attAuto attMode = iota
	attGeneric
	attWide   // att_tc, 4-warp blocks
	attNarrow // att_tc, 1-warp blocks
)

// attention is Attention with the kernel chosen by mode.
func (be *Backend) attention(a kernels.AttentionArgs, mode attMode) error {
	var s kernels.AttentionShape
	var shared, groups int
	var tc bool
	var key attKernel
	var plan attPlan
	validate := func() (err error) {
		if s, err = a.Validate(); err != nil {
			return err
		}
		group, d := s.QHeads/s.Cache.KVHeads, s.Cache.D
		_, tc = be.kernels[attKernel{d, group, 4}]
		tc = tc && mode != attGeneric
		if !tc {
			shared = attentionShared(group, d)
		} else {
			groups = (s.MaxPages*s.Cache.PageSize + attTCGroupLen - 1) / attTCGroupLen
			warps := map[attMode]int{attWide: 4, attNarrow: 1}[mode] // 0: planAttention's choice
			if _, narrow := be.kernels[attKernel{d, group, 1}]; !narrow {
				if warps == 1 {
					return fmt.Errorf("cuda: attention: head dim %d has no 1-warp kernel", d)
				}
				warps = 4
			}
			if warps == 0 && s.Tq >= 2*s.S {
				// Mostly prefill rows: 4-warp blocks, whose warps share
				// their tile's cache reads (attention.cu).
				warps = 4
			}
			plan = planAttention(s.Tq*s.Cache.KVHeads, groups, be.info.SMs, warps)
			key = attKernel{d, group, plan.warps}
			shared = attTCSmem(d, plan.warps)
		}
		if shared > be.info.SharedOptin {
			return fmt.Errorf("cuda: attention: %d query heads per kv head of dim %d need %d bytes of shared memory, the device has %d",
				group, d, shared, be.info.SharedOptin)
		}
		return nil
	}
	return be.issue("attention", a, validate, func(*drv.Ctx) error {
		if s.Tq == 0 || s.QHeads == 0 || s.S == 0 {
			return nil
		}
		cs := s.Cache
		if !tc {
			return be.launch(kAttention, drv.Dim3{X: s.Tq, Y: cs.KVHeads}, drv.Dim3{X: attThreads}, shared,
				be.errw, ptr(a.Out), ptr(a.Q), ptr(a.Cache.K), ptr(a.Cache.V), ptr(a.PageTable), ptr(a.SeqLens), ptr(a.QueryStart),
				int32(s.Tq), int32(s.QHeads), int32(cs.KVHeads), int32(cs.D), int32(cs.PageSize), int32(cs.Pages),
				int32(s.S), int32(s.MaxPages), a.Scale)
		}
		// z > 1 needs scratch that holds the launch's sequences; without
		// it the launch runs z = 1 (the same bits, fewer blocks).
		z, scratch := plan.z, drv.DevicePtr(0)
		if a.Scratch == nil || a.Scratch.Size() < attScratchBytes(s.S, cs.KVHeads, groups, cs.D) {
			z = 1
		}
		if z > 1 {
			scratch = ptr(a.Scratch)
		}
		return be.launch(key, drv.Dim3{X: s.Tq, Y: cs.KVHeads, Z: z}, drv.Dim3{X: 32 * plan.warps}, shared,
			be.errw, ptr(a.Out), ptr(a.Q), ptr(a.Cache.K), ptr(a.Cache.V), ptr(a.PageTable), ptr(a.SeqLens), ptr(a.QueryStart),
			scratch, int32(s.Tq), int32(s.QHeads), int32(cs.KVHeads), int32(cs.PageSize), int32(cs.Pages),
			int32(s.S), int32(s.MaxPages), int32(groups), a.Scale)
	})
}

// AttentionScratch is the scratch Attention uses to spread a decode row's
// positions over several blocks (kernels.AttentionScratcher): 0 for a
// geometry att_tc does not serve. Only launches of few enough rows spread
// (attSpreadSeqs), so it is sized for at most that many sequences; a
// launch of more sequences runs without it (the same bits, fewer blocks).
func (be *Backend) AttentionScratch(seqs, qHeads, kvHeads, d, maxLen int) int {
	if kvHeads <= 0 || qHeads%kvHeads != 0 {
		return 0
	}
	if _, ok := be.kernels[attKernel{d, qHeads / kvHeads, 4}]; !ok {
		return 0
	}
	seqs = min(seqs, attSpreadSeqs(kvHeads, be.info.SMs))
	return attScratchBytes(seqs, kvHeads, (maxLen+attTCGroupLen-1)/attTCGroupLen, d)
}

// Sample draws one token per row: one block of sampleThreads per row.
func (be *Backend) Sample(a kernels.SampleArgs) error {
	var rows, v int
	validate := func() (err error) {
		rows, v, err = a.Validate()
		return err
	}
	return be.issue("sample", a, validate, func(*drv.Ctx) error {
		if rows == 0 {
			return nil
		}
		// model_sample checks every row and serves those that truncate;
		// the wide sampler the others, a block per segment of a row, where
		// its scratch holds the launch.
		segs := (v + sampleSeg - 1) / sampleSeg
		wide := rows <= sampleWideRows && segs <= sampleWideSegs && be.sampleWide
		if err := be.launch(kSample, drv.Dim3{X: rows}, drv.Dim3{X: sampleThreads}, 0,
			be.errw, ptr(a.Logits), ptr(a.Temperature), ptr(a.TopK), ptr(a.TopP), ptr(a.Seeds),
			ptr(a.SampleIDs), ptr(a.Positions), ptr(a.Tokens), ptr(a.LogProbs), int32(v), boolArg(wide)); err != nil || !wide {
			return err
		}
		grid := drv.Dim3{X: segs, Y: rows}
		if err := be.launch(kSampleMax, grid, drv.Dim3{X: sampleWideThreads}, 0,
			ptr(a.Logits), ptr(a.Temperature), ptr(a.TopK), ptr(a.TopP), be.sampleScr, int32(sampleWideRows), int32(v)); err != nil {
			return err
		}
		return be.launch(kSampleWide, grid, drv.Dim3{X: sampleWideThreads}, 0,
			ptr(a.Logits), ptr(a.Temperature), ptr(a.TopK), ptr(a.TopP), ptr(a.Seeds), ptr(a.SampleIDs), ptr(a.Positions),
			ptr(a.Tokens), ptr(a.LogProbs), be.sampleScr, int32(sampleWideRows), int32(v))
	})
}

// boolArg is a C int flag.
func boolArg(b bool) int32 {
	if b {
		return 1
	}
	return 0
}

// LogProbs scores given tokens: one block of logprobsThreads per row.
func (be *Backend) LogProbs(a kernels.LogProbsArgs) error {
	var rows, v int
	validate := func() (err error) {
		rows, v, err = a.Validate()
		return err
	}
	return be.issue("logprobs", a, validate, func(*drv.Ctx) error {
		if rows == 0 {
			return nil
		}
		return be.launch(kLogProbs, drv.Dim3{X: rows}, drv.Dim3{X: logprobsThreads}, 0,
			be.errw, ptr(a.Logits), ptr(a.Tokens), ptr(a.LogProbs), int32(v))
	})
}

// ScatterBF16 writes a sparse BF16 delta: one block per span (model.cu
// checks each span before it writes and reports a bad one).
func (be *Backend) ScatterBF16(a kernels.ScatterBF16Args) error {
	var spans int
	validate := func() (err error) {
		spans, err = a.Validate()
		return err
	}
	return be.issue("scatter bf16", a, validate, func(*drv.Ctx) error {
		if spans == 0 {
			return nil
		}
		return be.launch(kScatterBF16, drv.Dim3{X: spans}, drv.Dim3{X: scatterThreads}, 0,
			be.errw, ptr(a.Dst).Add(2*a.Offset), int64(a.Len), ptr(a.Spans), ptr(a.Masks), int64(a.Masks.Len()),
			ptr(a.Values), int64(a.Values.Len()))
	})
}
