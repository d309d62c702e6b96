package kernels

import "fmt"

// The ops of the dense part of the model (embedding, norms, attention over
// the paged KV cache, sampling). Embedding, RMSNorm, residual adds and RoPE
// follow Hugging Face transformers' BF16 implementation step by step where it
// rounds to BF16, so the engine can be compared with it token by token.
// Attention keeps FP32 from the scores to the weighted sum of values, like
// fused (sdpa / flash) attention rather than eager attention, which rounds
// scores and probabilities to BF16.

// EmbedArgs: Out[t] = Table[IDs[t]].
type EmbedArgs struct {
	Out   *Buffer // BF16 [T, H]
	Table *Buffer // BF16 [V, H]
	IDs   *Buffer // I32 [T]; each in [0, V)
}

// RMSNormArgs: for each row x of Src (the last dimension),
//
//	r      = 1 / sqrt(mean(x^2) + Eps)           (FP32, sum in index order)
//	Out[i] = bf16( Weight[i] * bf16(x[i] * r) )
//
// which is transformers' RMSNorm: normalise in FP32, cast to BF16, then
// scale. Src and Out may be the same buffer. Applied to [T*heads, D] views it
// is the per-head q/k norm.
//
// With Residual set, the residual add comes first, in place: Src =
// bf16(Src + Residual) element-wise (AddArgs), then Out is the norm of the
// new Src; Out then must not overlap Src or Residual. The results are those
// of Add followed by RMSNorm.
type RMSNormArgs struct {
	Out      *Buffer // BF16 [R, D]
	Src      *Buffer // BF16 [R, D]
	Weight   *Buffer // BF16 [D]
	Eps      float32
	Residual *Buffer // BF16 [R, D], optional
}

// AddArgs: Out = bf16(A + B), element-wise (the residual stream). Out may
// alias A or B.
type AddArgs struct {
	Out, A, B *Buffer // BF16, same shape
}

// RoPEArgs applies rotary position embeddings in place, in the rotate-half
// (GPT-NeoX) layout that Qwen3-MoE and Mixtral use. For token t, head h,
// i < D/2, with c = Cos[Positions[t], i] and s = Sin[Positions[t], i] (the
// table holds BF16 values, as transformers casts cos/sin to the activation
// dtype):
//
//	x1, x2 = X[t,h,i], X[t,h,i+D/2]
//	X[t,h,i]     = bf16( bf16(x1*c) - bf16(x2*s) )
//	X[t,h,i+D/2] = bf16( bf16(x2*c) + bf16(x1*s) )
type RoPEArgs struct {
	X         *Buffer // BF16 [T, heads, D]
	Positions *Buffer // I32 [T]
	Cos, Sin  *Buffer // BF16 [maxPositions, D/2]
}

// KVCache is the paged key/value cache of one layer: Pages pages of
// PageSize token slots. Slot s of the cache is page s/PageSize, offset
// s%PageSize.
type KVCache struct {
	K, V *Buffer // BF16 [pages, pageSize, kvHeads, D]
}

// KVWriteArgs stores the keys and values of T tokens into their slots. A
// negative slot skips the token: padding rows of a captured batch write
// nothing. Two tokens must not name the same slot.
type KVWriteArgs struct {
	Cache KVCache
	K, V  *Buffer // BF16 [T, kvHeads, D]
	Slots *Buffer // I32 [T]: the cache slot of each token, or < 0 to skip it
}

// AttentionArgs is causal grouped-query attention of new tokens over the
// paged cache (their own keys already written). Sequences are packed:
// sequence s owns query rows QueryStart[s] .. QueryStart[s+1]; it has
// SeqLens[s] tokens in the cache in total, the last of which are its
// queries, so query row i of s sits at position SeqLens[s] - n_s + i and
// attends to cache positions 0..that position. Position p of sequence s is
// in slot PageTable[s, p/pageSize]*pageSize + p%pageSize. Prefill (many
// queries per sequence) and decode (one) are the same op.
//
// Per query head (query head h reads KV head h / (qHeads/kvHeads)), in FP32:
// scores = (q . k) * Scale, softmax with the maximum subtracted, then
// out = sum_p prob_p * v_p, rounded to BF16. The order of the sums is the
// backend's (the CPU's is position order; the GPU's a fixed tree over
// position ranges), but fixed by the query's position alone: a query's bits
// do not depend on the batch or on whether it is prefilled with other rows
// or decoded alone.
//
// QueryStart is non-decreasing within [0, Tq]; query rows outside
// QueryStart[0] .. QueryStart[S] are padding and are left untouched, and a
// sequence with no queries does nothing. Page-table entries past a
// sequence's SeqLens are never read (unused entries may hold anything).
type AttentionArgs struct {
	Out        *Buffer // BF16 [Tq, qHeads, D]
	Q          *Buffer // BF16 [Tq, qHeads, D]
	Cache      KVCache
	PageTable  *Buffer // I32 [S, maxPages]
	SeqLens    *Buffer // I32 [S]
	QueryStart *Buffer // I32 [S+1]
	Scale      float32
	// Scratch (optional) lets a backend spread one sequence's positions
	// over more of the device, for decode at long contexts; its size comes
	// from the backend's AttentionScratch. The result is the same bits
	// with or without it.
	Scratch *Buffer
}

// AttentionScratcher is a backend that can use AttentionArgs.Scratch.
type AttentionScratcher interface {
	// AttentionScratch returns the bytes of scratch an attention of up to
	// seqs sequences, each up to maxLen positions, needs for the given
	// geometry (0: the backend has no use for it).
	AttentionScratch(seqs, qHeads, kvHeads, d, maxLen int) int
}

// QKVPrepArgs prepares attention's inputs for T new tokens in one op: the
// per-head RMSNorm of Q and K (when QNorm and KNorm are set; RMSNormArgs
// over [T*heads, D] rows), RoPE on both (RoPEArgs), then the KV-cache write
// of K and V (KVWriteArgs). Q and K are updated in place. The results are
// those of the three ops in that order, except that a backend may sum the
// norm's squares in its own fixed order.
type QKVPrepArgs struct {
	Q            *Buffer // BF16 [T, qHeads, D]
	K, V         *Buffer // BF16 [T, kvHeads, D]
	QNorm, KNorm *Buffer // BF16 [D]: both or neither
	Eps          float32
	Positions    *Buffer // I32 [T]
	Cos, Sin     *Buffer // BF16 [maxPositions, D/2]
	Cache        KVCache
	Slots        *Buffer // I32 [T]
}

// Validate checks the operands by the three ops' own checks.
func (a QKVPrepArgs) Validate() (t, qHeads int, cs CacheShape, maxPos int, err error) {
	if (a.QNorm == nil) != (a.KNorm == nil) {
		return 0, 0, cs, 0, fmt.Errorf("kernels: qkv prep: q norm and k norm must be both set or both unset")
	}
	var d int
	if t, qHeads, d, maxPos, err = (RoPEArgs{X: a.Q, Positions: a.Positions, Cos: a.Cos, Sin: a.Sin}).Validate(); err != nil {
		return 0, 0, cs, 0, fmt.Errorf("%w (q)", err)
	}
	if _, cs, err = (KVWriteArgs{Cache: a.Cache, K: a.K, V: a.V, Slots: a.Slots}).Validate(); err != nil {
		return 0, 0, cs, 0, err
	}
	if cs.D != d || a.K.Dim(0) != t {
		return 0, 0, cs, 0, fmt.Errorf("kernels: qkv prep: q %v and k %v differ in tokens or head dim", a.Q, a.K)
	}
	if a.QNorm != nil {
		for _, w := range []struct {
			name string
			b    *Buffer
		}{{"q norm", a.QNorm}, {"k norm", a.KNorm}} {
			if err := check("qkv prep", w.name, w.b, BF16, 1); err != nil {
				return 0, 0, cs, 0, err
			}
			if err := shapeIs("qkv prep", w.name, w.b, d); err != nil {
				return 0, 0, cs, 0, err
			}
		}
		if !(a.Eps > 0) {
			return 0, 0, cs, 0, fmt.Errorf("kernels: qkv prep: eps %v must be positive", a.Eps)
		}
	}
	return t, qHeads, cs, maxPos, nil
}

// QKVPrepSteps runs a as RMSNorm (q and k heads), RoPE (q, k) and KVWrite
// calls on ops: QKVPrep for a backend, or a geometry, with no fused kernel.
func QKVPrepSteps(ops ModelOps, a QKVPrepArgs) error {
	t, qh, cs, _, err := a.Validate()
	if err != nil {
		return err
	}
	if a.QNorm != nil {
		v := Views{}
		q2, k2 := v.Reshape(a.Q, t*qh, cs.D), v.Reshape(a.K, t*cs.KVHeads, cs.D)
		if v.Err != nil {
			return v.Err
		}
		if err := ops.RMSNorm(RMSNormArgs{Out: q2, Src: q2, Weight: a.QNorm, Eps: a.Eps}); err != nil {
			return err
		}
		if err := ops.RMSNorm(RMSNormArgs{Out: k2, Src: k2, Weight: a.KNorm, Eps: a.Eps}); err != nil {
			return err
		}
	}
	for _, x := range []*Buffer{a.Q, a.K} {
		if err := ops.RoPE(RoPEArgs{X: x, Positions: a.Positions, Cos: a.Cos, Sin: a.Sin}); err != nil {
			return err
		}
	}
	return ops.KVWrite(KVWriteArgs{Cache: a.Cache, K: a.K, V: a.V, Slots: a.Slots})
}

// UnsampledToken is the token Sample writes for a row it cannot draw from.
const UnsampledToken = -1

// SampleArgs draws one token per row of Logits.
//
// Row r samples with temperature Temperature[r] from p = softmax(s), where
// s_i = (logit_i - max logit) / T, each operation rounded to FP32: every s_i
// is at most 0 and the largest is exactly 0, so any positive finite T works
// (a tiny T concentrates p on the largest logits instead of overflowing).
// The kept set is the TopK[r] most likely tokens (0: all), then the
// shortest prefix of those whose cumulative probability reaches TopP[r]
// (1: all, whatever the rounding of the sum); "most likely" orders by
// descending probability, ties by ascending id. The draw is
// u = philox.Uniform(Seeds[r], SampleIDs[r], Positions[r]) (counter-based,
// so a sample's tokens do not depend on the other rows of the batch);
// walking the kept tokens in ascending id order, the token is the first
// whose cumulative probability divided by the kept total exceeds u (the
// last kept token if rounding leaves none). Without truncation no sort is
// needed. Temperature 0 is greedy (argmax, lowest id on ties).
//
// LogProbs[r] is log softmax(s)[token] over the whole vocabulary (greedy:
// log softmax(logits)): the temperature-scaled distribution before top-k
// and top-p truncation, which is what a trainer recomputes.
//
// A row whose logits hold a NaN or +Inf, or are all -Inf, cannot be drawn
// from: its token is UnsampledToken and its logprob NaN, and the other rows
// are drawn as usual (a model that blows up on one sequence fails that
// sequence only). Invalid parameters (temperature, top k, top p) are an
// error of the whole call.
type SampleArgs struct {
	Logits      *Buffer // F32 [S, V]
	Temperature *Buffer // F32 [S]
	TopK        *Buffer // I32 [S]
	TopP        *Buffer // F32 [S]
	Seeds       *Buffer // I32 [S, 2]: the 64-bit seed, low word first
	SampleIDs   *Buffer // I32 [S]: the sample's index within its request
	Positions   *Buffer // I32 [S]: the position of the token being drawn
	Tokens      *Buffer // I32 [S] out
	LogProbs    *Buffer // F32 [S] out
}

// LogProbsArgs scores given tokens (teacher forcing): LogProbs[r] =
// log softmax(Logits[r])[Tokens[r]] in FP32 (temperature 1).
type LogProbsArgs struct {
	Logits   *Buffer // F32 [S, V]
	Tokens   *Buffer // I32 [S]
	LogProbs *Buffer // F32 [S]
}

// ModelOps is the part of the op set the dense model layers use.
type ModelOps interface {
	Embed(args EmbedArgs) error
	RMSNorm(args RMSNormArgs) error
	Add(args AddArgs) error
	RoPE(args RoPEArgs) error
	KVWrite(args KVWriteArgs) error
	QKVPrep(args QKVPrepArgs) error
	Attention(args AttentionArgs) error
	Sample(args SampleArgs) error
	LogProbs(args LogProbsArgs) error
}

// Validate checks the operands and returns T, H and V.
func (a EmbedArgs) Validate() (t, h, v int, err error) {
	if err := check("embed", "table", a.Table, BF16, 2); err != nil {
		return 0, 0, 0, err
	}
	v, h = a.Table.Dim(0), a.Table.Dim(1)
	if err := check("embed", "ids", a.IDs, I32, 1); err != nil {
		return 0, 0, 0, err
	}
	t = a.IDs.Dim(0)
	if err := check("embed", "out", a.Out, BF16, 2); err != nil {
		return 0, 0, 0, err
	}
	return t, h, v, shapeIs("embed", "out", a.Out, t, h)
}

// Validate checks the operands and returns the row count and width.
func (a RMSNormArgs) Validate() (rows, d int, err error) {
	if err := check("rmsnorm", "src", a.Src, BF16, 2); err != nil {
		return 0, 0, err
	}
	rows, d = a.Src.Dim(0), a.Src.Dim(1)
	if err := check("rmsnorm", "out", a.Out, BF16, 2); err != nil {
		return 0, 0, err
	}
	if err := shapeIs("rmsnorm", "out", a.Out, rows, d); err != nil {
		return 0, 0, err
	}
	if err := check("rmsnorm", "weight", a.Weight, BF16, 1); err != nil {
		return 0, 0, err
	}
	if !(a.Eps > 0) {
		return 0, 0, fmt.Errorf("kernels: rmsnorm: eps %v must be positive", a.Eps)
	}
	if err := shapeIs("rmsnorm", "weight", a.Weight, d); err != nil {
		return 0, 0, err
	}
	if a.Residual == nil {
		return rows, d, nil
	}
	if err := check("rmsnorm", "residual", a.Residual, BF16, 2); err != nil {
		return 0, 0, err
	}
	if err := shapeIs("rmsnorm", "residual", a.Residual, rows, d); err != nil {
		return 0, 0, err
	}
	return rows, d, disjoint("rmsnorm", []operand{{"out", a.Out}, {"src", a.Src}}, []operand{{"residual", a.Residual}, {"weight", a.Weight}})
}

// Validate checks the operands and returns the element count.
func (a AddArgs) Validate() (int, error) {
	for _, o := range []struct {
		name string
		b    *Buffer
	}{{"out", a.Out}, {"a", a.A}, {"b", a.B}} {
		if o.b == nil || o.b.DType() != BF16 {
			return 0, fmt.Errorf("kernels: add: %s %v: want bf16", o.name, o.b)
		}
		if err := shapeIs("add", o.name, o.b, a.Out.shape...); err != nil {
			return 0, err
		}
	}
	return a.Out.Len(), nil
}

// Validate checks the operands and returns T, heads, D and the table length.
func (a RoPEArgs) Validate() (t, heads, d, maxPos int, err error) {
	if err := check("rope", "x", a.X, BF16, 3); err != nil {
		return 0, 0, 0, 0, err
	}
	t, heads, d = a.X.Dim(0), a.X.Dim(1), a.X.Dim(2)
	if d%2 != 0 {
		return 0, 0, 0, 0, fmt.Errorf("kernels: rope: head dim %d is odd", d)
	}
	if err := check("rope", "positions", a.Positions, I32, 1); err != nil {
		return 0, 0, 0, 0, err
	}
	if err := shapeIs("rope", "positions", a.Positions, t); err != nil {
		return 0, 0, 0, 0, err
	}
	if err := check("rope", "cos", a.Cos, BF16, 2); err != nil {
		return 0, 0, 0, 0, err
	}
	maxPos = a.Cos.Dim(0)
	if err := shapeIs("rope", "cos", a.Cos, maxPos, d/2); err != nil {
		return 0, 0, 0, 0, err
	}
	if err := check("rope", "sin", a.Sin, BF16, 2); err != nil {
		return 0, 0, 0, 0, err
	}
	return t, heads, d, maxPos, shapeIs("rope", "sin", a.Sin, maxPos, d/2)
}

// CacheShape is the geometry of a KVCache.
type CacheShape struct{ Pages, PageSize, KVHeads, D int }

// Validate checks that K and V are alike and returns their geometry.
func (c KVCache) Validate(op string) (CacheShape, error) {
	if err := check(op, "cache.k", c.K, BF16, 4); err != nil {
		return CacheShape{}, err
	}
	s := CacheShape{c.K.Dim(0), c.K.Dim(1), c.K.Dim(2), c.K.Dim(3)}
	if s.PageSize == 0 || s.KVHeads == 0 || s.D == 0 {
		return s, fmt.Errorf("kernels: %s: cache %v has an empty page, head count or head dim", op, c.K)
	}
	if err := check(op, "cache.v", c.V, BF16, 4); err != nil {
		return s, err
	}
	return s, shapeIs(op, "cache.v", c.V, s.Pages, s.PageSize, s.KVHeads, s.D)
}

// Validate checks the operands and returns T and the cache geometry.
func (a KVWriteArgs) Validate() (int, CacheShape, error) {
	cs, err := a.Cache.Validate("kv write")
	if err != nil {
		return 0, cs, err
	}
	if err := check("kv write", "k", a.K, BF16, 3); err != nil {
		return 0, cs, err
	}
	t := a.K.Dim(0)
	for _, o := range []struct {
		name string
		b    *Buffer
	}{{"k", a.K}, {"v", a.V}} {
		if err := check("kv write", o.name, o.b, BF16, 3); err != nil {
			return 0, cs, err
		}
		if err := shapeIs("kv write", o.name, o.b, t, cs.KVHeads, cs.D); err != nil {
			return 0, cs, err
		}
	}
	if err := check("kv write", "slots", a.Slots, I32, 1); err != nil {
		return 0, cs, err
	}
	return t, cs, shapeIs("kv write", "slots", a.Slots, t)
}

// AttentionShape is the geometry Validate derives.
type AttentionShape struct {
	Tq, QHeads, S, MaxPages int
	Cache                   CacheShape
}

// Validate checks the operands and returns the geometry.
func (a AttentionArgs) Validate() (AttentionShape, error) {
	var s AttentionShape
	var err error
	if s.Cache, err = a.Cache.Validate("attention"); err != nil {
		return s, err
	}
	if err := check("attention", "q", a.Q, BF16, 3); err != nil {
		return s, err
	}
	s.Tq, s.QHeads = a.Q.Dim(0), a.Q.Dim(1)
	if err := shapeIs("attention", "q", a.Q, s.Tq, s.QHeads, s.Cache.D); err != nil {
		return s, err
	}
	if s.QHeads%s.Cache.KVHeads != 0 {
		return s, fmt.Errorf("kernels: attention: %d query heads do not group over %d kv heads", s.QHeads, s.Cache.KVHeads)
	}
	if err := check("attention", "out", a.Out, BF16, 3); err != nil {
		return s, err
	}
	if err := shapeIs("attention", "out", a.Out, s.Tq, s.QHeads, s.Cache.D); err != nil {
		return s, err
	}
	if err := check("attention", "page table", a.PageTable, I32, 2); err != nil {
		return s, err
	}
	s.S, s.MaxPages = a.PageTable.Dim(0), a.PageTable.Dim(1)
	if err := check("attention", "seq lens", a.SeqLens, I32, 1); err != nil {
		return s, err
	}
	if err := shapeIs("attention", "seq lens", a.SeqLens, s.S); err != nil {
		return s, err
	}
	if err := check("attention", "query start", a.QueryStart, I32, 1); err != nil {
		return s, err
	}
	if err := shapeIs("attention", "query start", a.QueryStart, s.S+1); err != nil {
		return s, err
	}
	if !(a.Scale > 0) {
		return s, fmt.Errorf("kernels: attention: scale %v must be positive", a.Scale)
	}
	outs := []operand{{"out", a.Out}}
	if a.Scratch != nil {
		outs = append(outs, operand{"scratch", a.Scratch})
	}
	return s, disjoint("attention", outs, []operand{{"q", a.Q}, {"cache.k", a.Cache.K}, {"cache.v", a.Cache.V},
		{"page table", a.PageTable}, {"seq lens", a.SeqLens}, {"query start", a.QueryStart}})
}

// Validate checks the operands and returns S and V.
func (a SampleArgs) Validate() (s, v int, err error) {
	if err := check("sample", "logits", a.Logits, F32, 2); err != nil {
		return 0, 0, err
	}
	s, v = a.Logits.Dim(0), a.Logits.Dim(1)
	if v == 0 {
		return 0, 0, fmt.Errorf("kernels: sample: empty vocabulary")
	}
	for _, o := range []struct {
		name string
		b    *Buffer
		dt   DType
	}{{"temperature", a.Temperature, F32}, {"top k", a.TopK, I32}, {"top p", a.TopP, F32},
		{"sample ids", a.SampleIDs, I32}, {"positions", a.Positions, I32}, {"tokens", a.Tokens, I32}, {"logprobs", a.LogProbs, F32}} {
		if err := check("sample", o.name, o.b, o.dt, 1); err != nil {
			return 0, 0, err
		}
		if err := shapeIs("sample", o.name, o.b, s); err != nil {
			return 0, 0, err
		}
	}
	if err := check("sample", "seeds", a.Seeds, I32, 2); err != nil {
		return 0, 0, err
	}
	if err := shapeIs("sample", "seeds", a.Seeds, s, 2); err != nil {
		return 0, 0, err
	}
	return s, v, disjoint("sample", []operand{{"tokens", a.Tokens}, {"logprobs", a.LogProbs}}, []operand{{"logits", a.Logits},
		{"temperature", a.Temperature}, {"top k", a.TopK}, {"top p", a.TopP}, {"seeds", a.Seeds}, {"sample ids", a.SampleIDs}, {"positions", a.Positions}})
}

// Validate checks the operands and returns S and V.
func (a LogProbsArgs) Validate() (s, v int, err error) {
	if err := check("logprobs", "logits", a.Logits, F32, 2); err != nil {
		return 0, 0, err
	}
	s, v = a.Logits.Dim(0), a.Logits.Dim(1)
	if v == 0 {
		return 0, 0, fmt.Errorf("kernels: logprobs: empty vocabulary")
	}
	for _, o := range []struct {
		name string
		b    *Buffer
		dt   DType
	}{{"tokens", a.Tokens, I32}, {"logprobs", a.LogProbs, F32}} {
		if err := check("logprobs", o.name, o.b, o.dt, 1); err != nil {
			return 0, 0, err
		}
		if err := shapeIs("logprobs", o.name, o.b, s); err != nil {
			return 0, 0, err
		}
	}
	return s, v, nil
}
