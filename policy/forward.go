package policy

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/policy/sched"
)

// workspace holds a forward pass's inputs and activations, allocated once
// for the model's maxima and used through views of the current sizes.
type workspace struct {
	// inputs holds every per-step input, so a step is staged with one
	// upload of its host image, host (layout: inputLayout). The input
	// buffers below are views of it.
	inputs *kernels.Buffer
	host   []byte
	lay    inputLayout

	// Per-token inputs [MaxTokens].
	ids, pos, slots *kernels.Buffer
	feed            *kernels.Buffer // I32 [MaxTokens]: the previous step's logit row whose token is the input, or -1
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
	// attScratch lets the backend spread a decode row's attention over
	// more of the device (kernels.AttentionScratcher); nil if it has no use.
	attScratch *kernels.Buffer
	logits     *kernels.Buffer // F32 [MaxLogitRows, V]

	// Sampling parameters (inputs) and results, one row per logit row.
	temperature, topP, logprobs                  *kernels.Buffer // F32
	topK, sampleIDs, samplePos, seeds, tokensOut *kernels.Buffer // I32 (seeds [rows, 2])
}

// inputLayout is where each per-step input lies in the inputs buffer, in
// bytes. The page table comes last: a step uploads the image up to the end
// of its own rows.
type inputLayout struct {
	ids, pos, slots, feed, seqLens, queryStart, logitRows           int
	temperature, topP, topK, sampleIDs, samplePos, seeds, pageTable int
	size                                                            int
}

func newInputLayout(T, S, L, width int) inputLayout {
	var l inputLayout
	at := 0
	next := func(elems int) int { off := at; at += 4 * elems; return off }
	l.ids, l.pos, l.slots, l.feed = next(T), next(T), next(T), next(T)
	l.seqLens, l.queryStart, l.logitRows = next(S), next(S+1), next(L)
	l.temperature, l.topP, l.topK, l.sampleIDs, l.samplePos, l.seeds = next(L), next(L), next(L), next(L), next(L), next(2*L)
	l.pageTable = next(S * width)
	l.size = at
	return l
}

func newWorkspace(m *Model, buf func(kernels.DType, ...int) *kernels.Buffer) workspace {
	c, o := m.cfg, m.opts
	T, S, L := o.MaxTokens, o.MaxSeqs, o.MaxLogitRows
	width := o.maxPagesPerSeq(c)
	lay := newInputLayout(T, S, L, width)
	ws := workspace{
		lay: lay, host: make([]byte, lay.size),
		h: buf(kernels.BF16, T, c.Hidden), x: buf(kernels.BF16, T, c.Hidden), tmp: buf(kernels.BF16, T, c.Hidden),
		q: buf(kernels.BF16, T, c.Heads, c.HeadDim), attn: buf(kernels.BF16, T, c.Heads, c.HeadDim),
		k: buf(kernels.BF16, T, c.KVHeads, c.HeadDim), v: buf(kernels.BF16, T, c.KVHeads, c.HeadDim),
		sel: buf(kernels.BF16, L, c.Hidden), logits: buf(kernels.F32, L, c.VocabSize),
		logprobs: buf(kernels.F32, L), tokensOut: buf(kernels.I32, L),
		inputs: buf(kernels.I32, lay.size/4),
	}
	if ws.inputs == nil {
		return ws // buf failed; alloc reports it
	}
	if sc, ok := m.be.(kernels.AttentionScratcher); ok {
		if n := sc.AttentionScratch(S, c.Heads, c.KVHeads, c.HeadDim, width*o.PageSize); n > 0 {
			ws.attScratch = buf(kernels.F32, (n+3)/4)
		}
	}
	in, v := ws.inputs, kernels.Views{}
	ws.ids, ws.pos, ws.slots, ws.feed = v.View(in, lay.ids, kernels.I32, T), v.View(in, lay.pos, kernels.I32, T),
		v.View(in, lay.slots, kernels.I32, T), v.View(in, lay.feed, kernels.I32, T)
	ws.seqLens, ws.queryStart = v.View(in, lay.seqLens, kernels.I32, S), v.View(in, lay.queryStart, kernels.I32, S+1)
	ws.logitRows = v.View(in, lay.logitRows, kernels.I32, L)
	ws.temperature, ws.topP = v.View(in, lay.temperature, kernels.F32, L), v.View(in, lay.topP, kernels.F32, L)
	ws.topK, ws.sampleIDs, ws.samplePos = v.View(in, lay.topK, kernels.I32, L), v.View(in, lay.sampleIDs, kernels.I32, L),
		v.View(in, lay.samplePos, kernels.I32, L)
	ws.seeds = v.View(in, lay.seeds, kernels.I32, L, 2)
	ws.pageTable = v.View(in, lay.pageTable, kernels.I32, S, width)
	if v.Err != nil {
		panic(fmt.Sprintf("policy: workspace views: %v", v.Err)) // the layout is sized for them
	}
	return ws
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
		// The residual adds ride in the next norm: the previous layer's
		// MoE output (tmp) joins h in this layer's input norm, the
		// attention output in the post-attention norm.
		var residual *kernels.Buffer
		if i > 0 {
			residual = tmp
		}
		err := run(
			mark("norms"),
			func() error {
				return be.RMSNorm(kernels.RMSNormArgs{Out: x, Src: h, Weight: l.inNorm, Eps: eps, Residual: residual})
			},
			mark("projections"),
			func() error { // one launch where the backend can (kernels.GemmSet)
				return kernels.GemmSet(be, []*kernels.Buffer{q2, k2, v2}, x, []*kernels.Buffer{l.q, l.k, l.v})
			},
			mark("attention"),
			func() error {
				a := kernels.QKVPrepArgs{Q: q, K: k, V: vv, Positions: pos, Cos: m.cos, Sin: m.sin, Cache: l.kv, Slots: slots}
				if c.QKNorm {
					a.QNorm, a.KNorm, a.Eps = l.qNorm, l.kNorm, eps
				}
				return be.QKVPrep(a)
			},
			func() error {
				return be.Attention(kernels.AttentionArgs{Out: attn, Q: q, Cache: l.kv, PageTable: pageTable,
					SeqLens: seqLens, QueryStart: queryStart, Scale: scale, Scratch: ws.attScratch})
			},
			mark("projections"),
			func() error { return be.Gemm(tmp, attn2, l.o) },
			mark("norms"),
			func() error {
				return be.RMSNorm(kernels.RMSNormArgs{Out: x, Src: h, Weight: l.postNorm, Eps: eps, Residual: tmp})
			},
			func() error { // marks "router" and "experts"; tmp joins h in the next norm
				if m.calibrating {
					return l.moe.Calibrate(tmp, x)
				}
				return l.moe.Forward(tmp, x)
			},
		)
		if err != nil {
			return fmt.Errorf("layer %d: %w", i, err)
		}
	}
	if sh.L == 0 {
		return nil // a prefill chunk that ends no prompt: only the KV cache matters
	}
	var residual *kernels.Buffer
	if len(m.layers) > 0 {
		residual = tmp // the last layer's MoE output
	}
	return run(
		mark("lm_head"),
		func() error {
			return be.RMSNorm(kernels.RMSNormArgs{Out: x, Src: h, Weight: m.norm, Eps: eps, Residual: residual})
		},
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
type SampleRow = sched.SampleRow

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
// fills the KV cache. Every input goes up in one upload.
func (m *Model) Stage(in StepInput) (Shape, error) {
	sh := Shape{T: len(in.Tokens), S: len(in.SeqLens), L: len(in.LogitRows)}
	if err := m.checkShape(sh); err != nil {
		return sh, err
	}
	switch {
	case len(in.Positions) != sh.T || len(in.Slots) != sh.T || len(in.QueryStart) != sh.S+1 || len(in.PageTable) != sh.S:
		return sh, fmt.Errorf("policy: stage: inconsistent lengths (%d tokens, %d positions, %d slots, %d sequences, %d query starts, %d page rows)",
			sh.T, len(in.Positions), len(in.Slots), sh.S, len(in.QueryStart), len(in.PageTable))
	case len(in.Sampling) != 0 && len(in.Sampling) != sh.L:
		return sh, fmt.Errorf("policy: stage: %d sampling rows for %d logit rows", len(in.Sampling), sh.L)
	}
	ws, h := &m.ws, m.ws.host
	lay := ws.lay
	width := ws.pageTable.Dim(1)
	for s, row := range in.PageTable {
		if len(row) > width {
			return sh, fmt.Errorf("policy: stage: sequence %d has %d pages, at most %d fit", s, len(row), width)
		}
		off := lay.pageTable + 4*s*width
		putI32(h, off, row)
		clear(h[off+4*len(row) : off+4*width]) // missing entries are 0
	}
	putI32(h, lay.ids, in.Tokens)
	putI32(h, lay.pos, in.Positions)
	putI32(h, lay.slots, in.Slots)
	fillI32(h, lay.feed, sh.T, -1)
	putI32(h, lay.seqLens, in.SeqLens)
	putI32(h, lay.queryStart, in.QueryStart)
	putI32(h, lay.logitRows, in.LogitRows)
	for i, r := range in.Sampling {
		putSampleRow(h, &lay, i, r)
	}
	return sh, m.upload(sh.S)
}

// stagePlan writes a planned step into the model's input buffers, padded
// to padded tokens when that is more (a decode-only step run in a graph's
// bucket: see StepInput.Pad), and returns its Shape.
func (m *Model) stagePlan(p *sched.Plan, padded int) (Shape, error) {
	T, S, L := len(p.Tokens), len(p.SeqLens), len(p.LogitRows)
	pad := max(0, padded-T)
	sh := Shape{T: T + pad, S: S + pad, L: L + pad}
	if err := m.checkShape(sh); err != nil {
		return sh, err
	}
	ws, h := &m.ws, m.ws.host
	lay := ws.lay
	width, ps := ws.pageTable.Dim(1), m.opts.PageSize
	if p.Width != width || len(p.Positions) != T || len(p.Slots) != T || len(p.Feed) != T || len(p.QueryStart) != S+1 ||
		len(p.Sampling) != L || len(p.PageTable) != S*width {
		return sh, fmt.Errorf("policy: stage: inconsistent plan (%d tokens, %d positions, %d slots, %d feeds, %d sequences, %d query starts, %d sampling rows for %d logit rows, page table %d of width %d, want %d)",
			T, len(p.Positions), len(p.Slots), len(p.Feed), S, len(p.QueryStart), len(p.Sampling), L, len(p.PageTable), p.Width, width)
	}
	for s := range S {
		putI32(h, lay.pageTable+4*s*width, p.PageRow(s, ps)) // the rest of the row is never read
	}
	putI32(h, lay.ids, p.Tokens)
	fillI32(h, lay.ids+4*T, pad, 0)
	putI32(h, lay.pos, p.Positions)
	fillI32(h, lay.pos+4*T, pad, 0)
	putI32(h, lay.slots, p.Slots)
	fillI32(h, lay.slots+4*T, pad, -1)
	putI32(h, lay.feed, p.Feed)
	fillI32(h, lay.feed+4*T, pad, -1)
	putI32(h, lay.seqLens, p.SeqLens)
	fillI32(h, lay.seqLens+4*S, pad, 0)
	putI32(h, lay.queryStart, p.QueryStart)
	fillI32(h, lay.queryStart+4*(S+1), pad, p.QueryStart[S])
	putI32(h, lay.logitRows, p.LogitRows)
	fillI32(h, lay.logitRows+4*L, pad, 0)
	for i, r := range p.Sampling {
		putSampleRow(h, &lay, i, r)
	}
	for i := range pad {
		putSampleRow(h, &lay, L+i, SampleRow{TopP: 1})
	}
	return sh, m.upload(sh.S)
}

// checkShape checks a step's sizes against the model's maxima.
func (m *Model) checkShape(sh Shape) error {
	o := m.opts
	switch {
	case sh.T == 0 || sh.T > o.MaxTokens:
		return fmt.Errorf("policy: stage: %d tokens, want 1..%d", sh.T, o.MaxTokens)
	case sh.S == 0 || sh.S > o.MaxSeqs:
		return fmt.Errorf("policy: stage: %d sequences, want 1..%d", sh.S, o.MaxSeqs)
	case sh.L > o.MaxLogitRows:
		return fmt.Errorf("policy: stage: %d logit rows, want at most %d", sh.L, o.MaxLogitRows)
	}
	return nil
}

// upload sends the host image of the inputs, up to the end of the first
// s page-table rows, in one copy.
func (m *Model) upload(s int) error {
	n := m.ws.lay.pageTable + 4*s*m.ws.pageTable.Dim(1)
	if err := m.be.Upload(m.ws.inputs, 0, m.ws.host[:n]); err != nil {
		return fmt.Errorf("policy: stage: %w", err)
	}
	return nil
}

func putI32(b []byte, off int, v []int32) {
	b = b[off : off+4*len(v)]
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
	}
}

func fillI32(b []byte, off, n int, x int32) {
	b = b[off : off+4*n]
	for i := range n {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
	}
}

// putSampleRow writes sampling row i.
func putSampleRow(b []byte, l *inputLayout, i int, r SampleRow) {
	le := binary.LittleEndian
	le.PutUint32(b[l.temperature+4*i:], math.Float32bits(r.Temperature))
	le.PutUint32(b[l.topP+4*i:], math.Float32bits(r.TopP))
	le.PutUint32(b[l.topK+4*i:], uint32(r.TopK))
	le.PutUint32(b[l.sampleIDs+4*i:], uint32(r.SampleID))
	le.PutUint32(b[l.samplePos+4*i:], uint32(r.Position))
	le.PutUint64(b[l.seeds+8*i:], r.Seed) // low word first
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
	tok, lp, raw := make([]int32, n), make([]float32, n), make([]byte, 4*n)
	if err := m.samplesInto(tok, lp, raw); err != nil {
		return nil, nil, err
	}
	return tok, lp, nil
}

// samplesInto downloads the first len(tok) sampled tokens and logprobs
// through raw (4*len(tok) bytes).
func (m *Model) samplesInto(tok []int32, lp []float32, raw []byte) error {
	if err := m.be.Download(raw, m.ws.tokensOut, 0); err != nil {
		return err
	}
	for i := range tok {
		tok[i] = int32(binary.LittleEndian.Uint32(raw[4*i:]))
	}
	if err := m.be.Download(raw, m.ws.logprobs, 0); err != nil {
		return err
	}
	for i := range lp {
		lp[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
	}
	return nil
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
	for i := range out {
		out[i] = make([]int32, n*m.cfg.TopK)
	}
	if err := m.routingInto(out, make([]byte, 4*n*m.cfg.TopK)); err != nil {
		return nil, err
	}
	return out, nil
}

// routingInto downloads every layer's expert ids of the first
// len(dst[layer])/k tokens through raw (4*len(dst[layer]) bytes).
func (m *Model) routingInto(dst [][]int32, raw []byte) error {
	for i, l := range m.layers {
		if err := m.be.Download(raw, l.moe.Routing(), 0); err != nil {
			return err
		}
		for j := range dst[i] {
			dst[i][j] = int32(binary.LittleEndian.Uint32(raw[4*j:]))
		}
	}
	return nil
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

// feed sets the input token of each of the first t token rows whose feed
// entry is a logit row of the previous step to the token sampled there.
func (m *Model) feed(t int) error {
	return fmt.Errorf("policy: feed: not supported")
}
