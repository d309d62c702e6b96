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
	v := kernels.Views{}
	ids, pos, slots := v.Rows(ws.ids, sh.T), v.Rows(ws.pos, sh.T), v.Rows(ws.slots, sh.T)
	pageTable, seqLens, queryStart := v.Rows(ws.pageTable, sh.S), v.Rows(ws.seqLens, sh.S), v.Rows(ws.queryStart, sh.S+1)
	logitRows := v.Rows(ws.logitRows, sh.L)
	h, x, tmp := v.Rows(ws.h, sh.T), v.Rows(ws.x, sh.T), v.Rows(ws.tmp, sh.T)
	q, attn, k, vv := v.Rows(ws.q, sh.T), v.Rows(ws.attn, sh.T), v.Rows(ws.k, sh.T), v.Rows(ws.v, sh.T)
	q2, attn2 := v.Reshape(q, sh.T, c.Heads*c.HeadDim), v.Reshape(attn, sh.T, c.Heads*c.HeadDim)
	k2, v2 := v.Reshape(k, sh.T, c.KVHeads*c.HeadDim), v.Reshape(vv, sh.T, c.KVHeads*c.HeadDim)
	qh, kh := v.Reshape(q, sh.T*c.Heads, c.HeadDim), v.Reshape(k, sh.T*c.KVHeads, c.HeadDim)
	sel, logits := v.Rows(ws.sel, sh.L), v.Rows(ws.logits, sh.L)
	if v.Err != nil {
		return v.Err
	}
	eps := c.RMSNormEps
	scale := float32(1 / math.Sqrt(float64(c.HeadDim)))
	mark := func(group string) func() error { return func() error { return m.mark(group) } }
	if err := run(mark("embed"), func() error { return be.Embed(kernels.EmbedArgs{Out: h, Table: m.embed, IDs: ids}) }); err != nil {
		return err
	}
	for i := range m.layers {
		l := &m.layers[i]
		err := run(
			mark("norms"),
			func() error { return be.RMSNorm(kernels.RMSNormArgs{Out: x, Src: h, Weight: l.inNorm, Eps: eps}) },
			mark("projections"),
			func() error { return be.Gemm(q2, x, l.q) },
			func() error { return be.Gemm(k2, x, l.k) },
			func() error { return be.Gemm(v2, x, l.v) },
			mark("norms"),
			func() error {
				if !c.QKNorm {
					return nil
				}
				if err := be.RMSNorm(kernels.RMSNormArgs{Out: qh, Src: qh, Weight: l.qNorm, Eps: eps}); err != nil {
					return err
				}
				return be.RMSNorm(kernels.RMSNormArgs{Out: kh, Src: kh, Weight: l.kNorm, Eps: eps})
			},
			mark("attention"),
			func() error { return be.RoPE(kernels.RoPEArgs{X: q, Positions: pos, Cos: m.cos, Sin: m.sin}) },
			func() error { return be.RoPE(kernels.RoPEArgs{X: k, Positions: pos, Cos: m.cos, Sin: m.sin}) },
			func() error { return be.KVWrite(kernels.KVWriteArgs{Cache: l.kv, K: k, V: vv, Slots: slots}) },
			func() error {
				return be.Attention(kernels.AttentionArgs{Out: attn, Q: q, Cache: l.kv, PageTable: pageTable,
					SeqLens: seqLens, QueryStart: queryStart, Scale: scale})
			},
			mark("projections"),
			func() error { return be.Gemm(tmp, attn2, l.o) },
			mark("norms"),
			func() error { return be.Add(kernels.AddArgs{Out: h, A: h, B: tmp}) },
			func() error { return be.RMSNorm(kernels.RMSNormArgs{Out: x, Src: h, Weight: l.postNorm, Eps: eps}) },
			func() error { return l.moe.Forward(tmp, x) }, // marks "router" and "experts"
			mark("norms"),
			func() error { return be.Add(kernels.AddArgs{Out: h, A: h, B: tmp}) },
		)
		if err != nil {
			return fmt.Errorf("layer %d: %w", i, err)
		}
	}
	if sh.L == 0 {
		return nil // a prefill chunk that ends no prompt: only the KV cache matters
	}
	return run(
		mark("lm_head"),
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

// SampleRow is the sampling setup of one logit row.
type SampleRow struct {
	Temperature float32
	TopK        int32
	TopP        float32
	Seed        uint64
	SampleID    int32 // the sample's index within its request
	Position    int32 // the position of the token being drawn
}

// StepInput is one forward pass, as host data: T tokens of S sequences
// (packed: sequence s owns tokens QueryStart[s] .. QueryStart[s+1]), and the
// token rows whose logits are wanted.
type StepInput struct {
	Tokens, Positions, Slots []int32   // [T]; slot < 0: padding, not stored
	SeqLens, QueryStart      []int32   // [S], [S+1]
	PageTable                [][]int32 // S rows of page ids (missing entries are 0)
	LogitRows                []int32   // [L]: rows of the T tokens
	Sampling                 []SampleRow
}

// Pad appends padding rows to a decode-only step until it has n tokens (a
// graph bucket's size): each a token at position 0 stored nowhere, in a
// sequence with no queries, sampled greedily and ignored.
func (in *StepInput) Pad(n int) {
	for range n - len(in.Tokens) {
		in.Tokens = append(in.Tokens, 0)
		in.Positions = append(in.Positions, 0)
		in.Slots = append(in.Slots, -1)
		in.SeqLens = append(in.SeqLens, 0)
		in.PageTable = append(in.PageTable, nil)
		in.QueryStart = append(in.QueryStart, in.QueryStart[len(in.QueryStart)-1])
		in.LogitRows = append(in.LogitRows, 0)
		in.Sampling = append(in.Sampling, SampleRow{TopP: 1})
	}
}

// Stage writes in into the model's input buffers and returns its Shape.
// Sampling may be empty (scoring); otherwise it has one row per logit row.
// There may be no logit rows: a prefill chunk that ends no prompt only
// fills the KV cache.
func (m *Model) Stage(in StepInput) (Shape, error) {
	sh := Shape{T: len(in.Tokens), S: len(in.SeqLens), L: len(in.LogitRows)}
	o := m.opts
	switch {
	case sh.T == 0 || sh.T > o.MaxTokens:
		return sh, fmt.Errorf("policy: stage: %d tokens, want 1..%d", sh.T, o.MaxTokens)
	case sh.S == 0 || sh.S > o.MaxSeqs:
		return sh, fmt.Errorf("policy: stage: %d sequences, want 1..%d", sh.S, o.MaxSeqs)
	case sh.L > o.MaxLogitRows:
		return sh, fmt.Errorf("policy: stage: %d logit rows, want at most %d", sh.L, o.MaxLogitRows)
	case len(in.Positions) != sh.T || len(in.Slots) != sh.T || len(in.QueryStart) != sh.S+1 || len(in.PageTable) != sh.S:
		return sh, fmt.Errorf("policy: stage: inconsistent lengths (%d tokens, %d positions, %d slots, %d sequences, %d query starts, %d page rows)",
			sh.T, len(in.Positions), len(in.Slots), sh.S, len(in.QueryStart), len(in.PageTable))
	case len(in.Sampling) != 0 && len(in.Sampling) != sh.L:
		return sh, fmt.Errorf("policy: stage: %d sampling rows for %d logit rows", len(in.Sampling), sh.L)
	}
	width := m.ws.pageTable.Dim(1)
	table := make([]int32, sh.S*width)
	for s, row := range in.PageTable {
		if len(row) > width {
			return sh, fmt.Errorf("policy: stage: sequence %d has %d pages, at most %d fit", s, len(row), width)
		}
		copy(table[s*width:], row)
	}
	uploads := []struct {
		b    *kernels.Buffer
		data []byte
	}{
		{m.ws.ids, kernels.Int32Bytes(in.Tokens)}, {m.ws.pos, kernels.Int32Bytes(in.Positions)}, {m.ws.slots, kernels.Int32Bytes(in.Slots)},
		{m.ws.seqLens, kernels.Int32Bytes(in.SeqLens)}, {m.ws.queryStart, kernels.Int32Bytes(in.QueryStart)}, {m.ws.pageTable, kernels.Int32Bytes(table)},
		{m.ws.logitRows, kernels.Int32Bytes(in.LogitRows)},
	}
	if len(in.Sampling) > 0 {
		temp, topP := make([]float32, sh.L), make([]float32, sh.L)
		topK, ids, pos, seeds := make([]int32, sh.L), make([]int32, sh.L), make([]int32, sh.L), make([]int32, 2*sh.L)
		for i, r := range in.Sampling {
			temp[i], topP[i], topK[i], ids[i], pos[i] = r.Temperature, r.TopP, r.TopK, r.SampleID, r.Position
			seeds[2*i], seeds[2*i+1] = int32(uint32(r.Seed)), int32(uint32(r.Seed>>32))
		}
		uploads = append(uploads, []struct {
			b    *kernels.Buffer
			data []byte
		}{{m.ws.temperature, kernels.Float32Bytes(temp)}, {m.ws.topP, kernels.Float32Bytes(topP)}, {m.ws.topK, kernels.Int32Bytes(topK)},
			{m.ws.sampleIDs, kernels.Int32Bytes(ids)}, {m.ws.samplePos, kernels.Int32Bytes(pos)}, {m.ws.seeds, kernels.Int32Bytes(seeds)}}...)
	}
	for _, u := range uploads {
		if err := m.be.Upload(u.b, 0, u.data); err != nil {
			return sh, fmt.Errorf("policy: stage: %w", err)
		}
	}
	return sh, nil
}

// Forward runs the staged forward pass and, when sample is set, draws one
// token per logit row. It only issues ops over fixed buffers, so it can be
// captured as a graph for a given Shape.
func (m *Model) Forward(sh Shape, sample bool) error {
	if m.closed {
		return fmt.Errorf("policy: forward: model is closed")
	}
	if err := m.step(sh); err != nil {
		return fmt.Errorf("policy: forward: %w", err)
	}
	if !sample || sh.L == 0 {
		return m.mark("") // the end of the last group
	}
	v := kernels.Views{}
	args := kernels.SampleArgs{
		Logits: v.Rows(m.ws.logits, sh.L), Temperature: v.Rows(m.ws.temperature, sh.L), TopK: v.Rows(m.ws.topK, sh.L),
		TopP: v.Rows(m.ws.topP, sh.L), Seeds: v.Rows(m.ws.seeds, sh.L), SampleIDs: v.Rows(m.ws.sampleIDs, sh.L),
		Positions: v.Rows(m.ws.samplePos, sh.L), Tokens: v.Rows(m.ws.tokensOut, sh.L), LogProbs: v.Rows(m.ws.logprobs, sh.L),
	}
	if v.Err != nil {
		return v.Err
	}
	if err := m.mark("sampling"); err != nil {
		return err
	}
	if err := m.be.Sample(args); err != nil {
		return fmt.Errorf("policy: sample: %w", err)
	}
	return m.mark("") // the end of the last group
}

// Samples downloads the tokens and logprobs the last sampling Forward drew
// for the first n logit rows.
func (m *Model) Samples(n int) ([]int32, []float32, error) {
	tok, lp := make([]byte, 4*n), make([]byte, 4*n)
	if err := m.be.Download(tok, m.ws.tokensOut, 0); err != nil {
		return nil, nil, err
	}
	if err := m.be.Download(lp, m.ws.logprobs, 0); err != nil {
		return nil, nil, err
	}
	return kernels.BytesInt32(tok), kernels.BytesFloat32(lp), nil
}

// ScoreRows computes log softmax(logits)[tokens[i]] for the first
// len(tokens) logit rows of the last Forward.
func (m *Model) ScoreRows(tokens []int32) ([]float32, error) {
	n := len(tokens)
	v := kernels.Views{}
	logits, tok, lp := v.Rows(m.ws.logits, n), v.Rows(m.ws.tokensOut, n), v.Rows(m.ws.logprobs, n)
	if v.Err != nil {
		return nil, v.Err
	}
	if err := m.be.Upload(tok, 0, kernels.Int32Bytes(tokens)); err != nil {
		return nil, err
	}
	if err := m.be.LogProbs(kernels.LogProbsArgs{Logits: logits, Tokens: tok, LogProbs: lp}); err != nil {
		return nil, fmt.Errorf("policy: score: %w", err)
	}
	out := make([]byte, 4*n)
	if err := m.be.Download(out, lp, 0); err != nil {
		return nil, err
	}
	return kernels.BytesFloat32(out), nil
}

// Routing downloads the expert ids every layer routed the first n tokens of
// the last Forward to: [layer][token*k + j].
func (m *Model) Routing(n int) ([][]int32, error) {
	out := make([][]int32, len(m.layers))
	k := m.cfg.TopK
	for i, l := range m.layers {
		raw := make([]byte, 4*n*k)
		if err := m.be.Download(raw, l.moe.Routing(), 0); err != nil {
			return nil, err
		}
		out[i] = kernels.BytesInt32(raw)
	}
	return out, nil
}

// CopyPage copies KV page src to page dst in every layer (copy-on-write of
// a shared prompt's partial last page).
func (m *Model) CopyPage(dst, src int) error {
	for i, l := range m.layers {
		for _, c := range []*kernels.Buffer{l.kv.K, l.kv.V} {
			d, err := c.Slice(dst, dst+1)
			if err != nil {
				return err
			}
			s, err := c.Slice(src, src+1)
			if err != nil {
				return err
			}
			if err := m.be.Copy(d, s); err != nil {
				return fmt.Errorf("policy: layer %d: copy page %d to %d: %w", i, src, dst, err)
			}
		}
	}
	return nil
}
