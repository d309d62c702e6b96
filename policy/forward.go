package policy

import (
	"fmt"
	"math"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// workspace holds a forward pass's inputs and activations, allocated once
// for the model's maxima and used through views of the current sizes.
type workspace struct {
	// Per-token inputs [MaxTokens].
	ids, pos, slots *kernels.Buffer
	// Per-sequence inputs.
	pageTable  *kernels.Buffer // I32 [MaxSeqs, maxPagesPerSeq]
	seqLens    *kernels.Buffer // I32 [MaxSeqs]
	queryStart *kernels.Buffer // I32 [MaxSeqs+1]
	logitRows  *kernels.Buffer // I32 [MaxLogitRows]: token rows to produce logits for

	// Activations.
	h, x, tmp *kernels.Buffer // BF16 [MaxTokens, H]
	q, attn   *kernels.Buffer // BF16 [MaxTokens, Hq, D]
	k, v      *kernels.Buffer // BF16 [MaxTokens, Hkv, D]
	sel       *kernels.Buffer // BF16 [MaxLogitRows, H]
	logits    *kernels.Buffer // F32 [MaxLogitRows, V]

	// Sampling parameters and results, one row per logit row.
	temperature, topP, logprobs                  *kernels.Buffer // F32
	topK, sampleIDs, samplePos, seeds, tokensOut *kernels.Buffer // I32 (seeds [rows, 2])
}

func newWorkspace(m *Model, buf func(kernels.DType, ...int) *kernels.Buffer) workspace {
	c, o := m.cfg, m.opts
	T, S, L := o.MaxTokens, o.MaxSeqs, o.MaxLogitRows
	return workspace{
		ids: buf(kernels.I32, T), pos: buf(kernels.I32, T), slots: buf(kernels.I32, T),
		pageTable: buf(kernels.I32, S, o.maxPagesPerSeq(c)), seqLens: buf(kernels.I32, S), queryStart: buf(kernels.I32, S+1),
		logitRows: buf(kernels.I32, L),
		h:         buf(kernels.BF16, T, c.Hidden), x: buf(kernels.BF16, T, c.Hidden), tmp: buf(kernels.BF16, T, c.Hidden),
		q: buf(kernels.BF16, T, c.Heads, c.HeadDim), attn: buf(kernels.BF16, T, c.Heads, c.HeadDim),
		k: buf(kernels.BF16, T, c.KVHeads, c.HeadDim), v: buf(kernels.BF16, T, c.KVHeads, c.HeadDim),
		sel: buf(kernels.BF16, L, c.Hidden), logits: buf(kernels.F32, L, c.VocabSize),
		temperature: buf(kernels.F32, L), topP: buf(kernels.F32, L), logprobs: buf(kernels.F32, L),
		topK: buf(kernels.I32, L), sampleIDs: buf(kernels.I32, L), samplePos: buf(kernels.I32, L),
		seeds: buf(kernels.I32, L, 2), tokensOut: buf(kernels.I32, L),
	}
}

// Shape is the size of one forward pass: T tokens of S sequences, with
// logits for L rows. A step of a given Shape issues the same ops over the
// same buffers every time, which is what lets it be captured and replayed.
type Shape struct{ T, S, L int }

// step issues the forward pass over the staged inputs: every op reads and
// writes fixed workspace buffers through views of the sizes in sh, so the
// sequence of ops depends on sh alone.
func (m *Model) step(sh Shape) error {
	c, ws, be := m.cfg, &m.ws, m.be
	v := views{}
	ids, pos, slots := v.rows(ws.ids, sh.T), v.rows(ws.pos, sh.T), v.rows(ws.slots, sh.T)
	pageTable, seqLens, queryStart := v.rows(ws.pageTable, sh.S), v.rows(ws.seqLens, sh.S), v.rows(ws.queryStart, sh.S+1)
	logitRows := v.rows(ws.logitRows, sh.L)
	h, x, tmp := v.rows(ws.h, sh.T), v.rows(ws.x, sh.T), v.rows(ws.tmp, sh.T)
	q, attn, k, vv := v.rows(ws.q, sh.T), v.rows(ws.attn, sh.T), v.rows(ws.k, sh.T), v.rows(ws.v, sh.T)
	q2, attn2 := v.reshape(q, sh.T, c.Heads*c.HeadDim), v.reshape(attn, sh.T, c.Heads*c.HeadDim)
	k2, v2 := v.reshape(k, sh.T, c.KVHeads*c.HeadDim), v.reshape(vv, sh.T, c.KVHeads*c.HeadDim)
	qh, kh := v.reshape(q, sh.T*c.Heads, c.HeadDim), v.reshape(k, sh.T*c.KVHeads, c.HeadDim)
	sel, logits := v.rows(ws.sel, sh.L), v.rows(ws.logits, sh.L)
	if v.err != nil {
		return v.err
	}
	eps := c.RMSNormEps
	scale := float32(1 / math.Sqrt(float64(c.HeadDim)))
	if err := be.Embed(kernels.EmbedArgs{Out: h, Table: m.embed, IDs: ids}); err != nil {
		return err
	}
	for i := range m.layers {
		l := &m.layers[i]
		err := run(
			func() error { return be.RMSNorm(kernels.RMSNormArgs{Out: x, Src: h, Weight: l.inNorm, Eps: eps}) },
			func() error { return be.Gemm(q2, x, l.q) },
			func() error { return be.Gemm(k2, x, l.k) },
			func() error { return be.Gemm(v2, x, l.v) },
			func() error {
				if !c.QKNorm {
					return nil
				}
				if err := be.RMSNorm(kernels.RMSNormArgs{Out: qh, Src: qh, Weight: l.qNorm, Eps: eps}); err != nil {
					return err
				}
				return be.RMSNorm(kernels.RMSNormArgs{Out: kh, Src: kh, Weight: l.kNorm, Eps: eps})
			},
			func() error { return be.RoPE(kernels.RoPEArgs{X: q, Positions: pos, Cos: m.cos, Sin: m.sin}) },
			func() error { return be.RoPE(kernels.RoPEArgs{X: k, Positions: pos, Cos: m.cos, Sin: m.sin}) },
			func() error { return be.KVWrite(kernels.KVWriteArgs{Cache: l.kv, K: k, V: vv, Slots: slots}) },
			func() error {
				return be.Attention(kernels.AttentionArgs{Out: attn, Q: q, Cache: l.kv, PageTable: pageTable,
					SeqLens: seqLens, QueryStart: queryStart, Scale: scale})
			},
			func() error { return be.Gemm(tmp, attn2, l.o) },
			func() error { return be.Add(kernels.AddArgs{Out: h, A: h, B: tmp}) },
			func() error { return be.RMSNorm(kernels.RMSNormArgs{Out: x, Src: h, Weight: l.postNorm, Eps: eps}) },
			func() error { return l.moe.Forward(tmp, x) },
			func() error { return be.Add(kernels.AddArgs{Out: h, A: h, B: tmp}) },
		)
		if err != nil {
			return fmt.Errorf("layer %d: %w", i, err)
		}
	}
	return run(
		func() error { return be.RMSNorm(kernels.RMSNormArgs{Out: x, Src: h, Weight: m.norm, Eps: eps}) },
		func() error { return be.Embed(kernels.EmbedArgs{Out: sel, Table: x, IDs: logitRows}) }, // gather rows
		func() error { return be.Gemm(logits, sel, m.lmHead) },
	)
}

// run calls fns in order and stops at the first error.
func run(fns ...func() error) error {
	for _, f := range fns {
		if err := f(); err != nil {
			return err
		}
	}
	return nil
}

// views makes views of workspaces, keeping the first error.
type views struct{ err error }

func (v *views) rows(b *kernels.Buffer, n int) *kernels.Buffer {
	if v.err != nil {
		return nil
	}
	r, err := b.Rows(n)
	v.err = err
	return r
}

func (v *views) reshape(b *kernels.Buffer, shape ...int) *kernels.Buffer {
	if v.err != nil {
		return nil
	}
	r, err := b.Reshape(shape...)
	v.err = err
	return r
}
