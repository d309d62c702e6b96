package cpu

import (
	"fmt"
	"math"
	"slices"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/philox"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// The dense model's ops (kernels.ModelOps). Every op checks shapes (the
// shared Validate), ownership, and then every index it will follow (token
// ids, positions, slots, page table entries) before it writes anything, so a
// bad index is an error naming the entry rather than a wild read. Numerics
// follow kernels/model.go step by step; where an FP32 product feeds an FP32
// sum, a float32 conversion keeps Go from fusing them into an FMA on
// architectures that would (arm64), as the GPU kernels use __fmul_rn.

// addChunk is the number of elements one Add work item handles.
const addChunk = 1 << 14

// Embed gathers table rows.
func (be *Backend) Embed(a kernels.EmbedArgs) error {
	return issue(be, "embed", a, be.prepEmbed)
}

func (be *Backend) prepEmbed(a kernels.EmbedArgs) (func() error, error) {
	t, h, v, err := a.Validate()
	if err != nil {
		return nil, err
	}
	if err := be.owns("embed", map[string]*kernels.Buffer{"out": a.Out, "table": a.Table, "ids": a.IDs}); err != nil {
		return nil, err
	}
	return func() error {
		ids, table, out := i32s(a.IDs), u16s(a.Table), u16s(a.Out)
		for i, id := range ids {
			if id < 0 || int(id) >= v {
				return fmt.Errorf("cpu: embed: token %d has id %d, vocabulary is %d", i, id, v)
			}
		}
		be.parallel(t, func(i int) {
			copy(out[i*h:(i+1)*h], table[int(ids[i])*h:][:h])
		})
		return nil
	}, nil
}

// RMSNorm normalises rows. The sum of squares is FP32 in index order (the
// squares of BF16 values are exact); r = 1/sqrt(mean + eps) is computed in
// float64 from the FP32 mean + eps and rounded once to FP32, i.e. a correctly
// rounded rsqrt, which a GPU's rsqrtf approximates within 2 ulp.
func (be *Backend) RMSNorm(a kernels.RMSNormArgs) error {
	return issue(be, "rmsnorm", a, be.prepRMSNorm)
}

func (be *Backend) prepRMSNorm(a kernels.RMSNormArgs) (func() error, error) {
	rows, d, err := a.Validate()
	if err != nil {
		return nil, err
	}
	bufs := map[string]*kernels.Buffer{"out": a.Out, "src": a.Src, "weight": a.Weight}
	if a.Residual != nil {
		bufs["residual"] = a.Residual
	}
	if err := be.owns("rmsnorm", bufs); err != nil {
		return nil, err
	}
	return func() error {
		src, out, w := u16s(a.Src), u16s(a.Out), u16s(a.Weight)
		var res []uint16
		if a.Residual != nil {
			res = u16s(a.Residual)
		}
		be.parallel(rows, func(r int) {
			x, o := src[r*d:(r+1)*d], out[r*d:(r+1)*d]
			if res != nil { // the residual add first, as Add does it
				for i, y := range res[r*d : (r+1)*d] {
					x[i] = bf16.FromFloat32(bf16.ToFloat32(x[i]) + bf16.ToFloat32(y))
				}
			}
			var ss float32
			for _, h := range x {
				v := bf16.ToFloat32(h)
				ss += float32(v * v)
			}
			mean := ss / float32(d)
			rs := float32(1 / math.Sqrt(float64(mean+a.Eps)))
			// Src and Out may be the same buffer: element i is read before it
			// is written, and r is already known.
			for i, h := range x {
				y := bf16.Round(bf16.ToFloat32(h) * rs)
				o[i] = bf16.FromFloat32(bf16.ToFloat32(w[i]) * y)
			}
		})
		return nil
	}, nil
}

// Add is the residual add, element-wise; Out may alias A or B.
func (be *Backend) Add(a kernels.AddArgs) error {
	return issue(be, "add", a, be.prepAdd)
}

func (be *Backend) prepAdd(a kernels.AddArgs) (func() error, error) {
	n, err := a.Validate()
	if err != nil {
		return nil, err
	}
	if err := be.owns("add", map[string]*kernels.Buffer{"out": a.Out, "a": a.A, "b": a.B}); err != nil {
		return nil, err
	}
	return func() error {
		out, x, y := u16s(a.Out), u16s(a.A), u16s(a.B)
		be.parallel((n+addChunk-1)/addChunk, func(c int) {
			for i := c * addChunk; i < min((c+1)*addChunk, n); i++ {
				out[i] = bf16.FromFloat32(bf16.ToFloat32(x[i]) + bf16.ToFloat32(y[i]))
			}
		})
		return nil
	}, nil
}

// RoPE rotates X in place, rotate-half layout.
func (be *Backend) RoPE(a kernels.RoPEArgs) error {
	return issue(be, "rope", a, be.prepRoPE)
}

func (be *Backend) prepRoPE(a kernels.RoPEArgs) (func() error, error) {
	t, heads, d, maxPos, err := a.Validate()
	if err != nil {
		return nil, err
	}
	if err := be.owns("rope", map[string]*kernels.Buffer{"x": a.X, "positions": a.Positions, "cos": a.Cos, "sin": a.Sin}); err != nil {
		return nil, err
	}
	return func() error {
		x, pos, cos, sin := u16s(a.X), i32s(a.Positions), u16s(a.Cos), u16s(a.Sin)
		for i, p := range pos {
			if p < 0 || int(p) >= maxPos {
				return fmt.Errorf("cpu: rope: token %d is at position %d, the tables hold %d", i, p, maxPos)
			}
		}
		half := d / 2
		be.parallel(t, func(tok int) {
			c, s := cos[int(pos[tok])*half:][:half], sin[int(pos[tok])*half:][:half]
			for h := range heads {
				row := x[(tok*heads+h)*d:][:d]
				for i := range half {
					x1, x2 := bf16.ToFloat32(row[i]), bf16.ToFloat32(row[i+half])
					ci, si := bf16.ToFloat32(c[i]), bf16.ToFloat32(s[i])
					row[i] = bf16.FromFloat32(bf16.Round(x1*ci) - bf16.Round(x2*si))
					row[i+half] = bf16.FromFloat32(bf16.Round(x2*ci) + bf16.Round(x1*si))
				}
			}
		})
		return nil
	}, nil
}

// KVWrite scatters the new keys and values into their cache slots; a
// negative slot is skipped. Two tokens naming the same slot are an error: on
// a GPU they would race, so the result would be undefined.
func (be *Backend) KVWrite(a kernels.KVWriteArgs) error {
	return issue(be, "kv write", a, be.prepKVWrite)
}

func (be *Backend) prepKVWrite(a kernels.KVWriteArgs) (func() error, error) {
	t, cs, err := a.Validate()
	if err != nil {
		return nil, err
	}
	bufs := map[string]*kernels.Buffer{"cache.k": a.Cache.K, "cache.v": a.Cache.V, "k": a.K, "v": a.V, "slots": a.Slots}
	if err := be.owns("kv write", bufs); err != nil {
		return nil, err
	}
	return func() error {
		slots := i32s(a.Slots)
		nslots := cs.Pages * cs.PageSize
		seen := make(map[int32]int, t)
		for i, s := range slots {
			if s < 0 {
				continue // padding: nothing to store
			}
			if int(s) >= nslots {
				return fmt.Errorf("cpu: kv write: token %d names slot %d, the cache has %d", i, s, nslots)
			}
			if j, dup := seen[s]; dup {
				return fmt.Errorf("cpu: kv write: tokens %d and %d both name slot %d", j, i, s)
			}
			seen[s] = i
		}
		row := cs.KVHeads * cs.D // elements of one token's K (or V)
		ck, cv, k, v := u16s(a.Cache.K), u16s(a.Cache.V), u16s(a.K), u16s(a.V)
		be.parallel(t, func(i int) {
			s := int(slots[i])
			if s < 0 {
				return
			}
			copy(ck[s*row:(s+1)*row], k[i*row:(i+1)*row])
			copy(cv[s*row:(s+1)*row], v[i*row:(i+1)*row])
		})
		return nil
	}, nil
}

// QKVPrep is RMSNorm of the q and k heads, RoPE and KVWrite, in that
// order, with the CPU's own ops (so the same bits as calling them).
func (be *Backend) QKVPrep(a kernels.QKVPrepArgs) error { return kernels.QKVPrepSteps(be, a) }

// Attention is causal GQA over the paged cache.
//
// QueryStart must be non-decreasing within [0, Tq]; query rows outside
// QueryStart[0] .. QueryStart[S] are left untouched (padding). A sequence's
// SeqLens must cover its queries and fit its page-table row, and every page
// it reads must exist. Each (query row, KV head) is one work item that reads
// only its own sequence's pages and sums in position order, so a query's
// output never depends on the rest of the batch.
func (be *Backend) Attention(a kernels.AttentionArgs) error {
	return issue(be, "attention", a, be.prepAttention)
}

func (be *Backend) prepAttention(a kernels.AttentionArgs) (func() error, error) {
	s, err := a.Validate()
	if err != nil {
		return nil, err
	}
	bufs := map[string]*kernels.Buffer{"out": a.Out, "q": a.Q, "cache.k": a.Cache.K, "cache.v": a.Cache.V,
		"page table": a.PageTable, "seq lens": a.SeqLens, "query start": a.QueryStart}
	if err := be.owns("attention", bufs); err != nil {
		return nil, err
	}
	return func() error {
		pt, lens, qs := i32s(a.PageTable), i32s(a.SeqLens), i32s(a.QueryStart)
		cs := s.Cache
		if qs[0] < 0 || int(qs[s.S]) > s.Tq {
			return fmt.Errorf("cpu: attention: query start runs from %d to %d, q has %d rows", qs[0], qs[s.S], s.Tq)
		}
		for seq := range s.S {
			if qs[seq+1] < qs[seq] {
				return fmt.Errorf("cpu: attention: query start decreases at sequence %d (%d > %d)", seq, qs[seq], qs[seq+1])
			}
		}
		// rowSeq[i] is the sequence of query row i (-1: padding).
		rowSeq := make([]int32, s.Tq)
		for i := range rowSeq {
			rowSeq[i] = -1
		}
		maxLen := 0
		for seq := range s.S {
			n, l := int(qs[seq+1])-int(qs[seq]), int(lens[seq])
			if l < n {
				return fmt.Errorf("cpu: attention: sequence %d has %d queries but length %d", seq, n, l)
			}
			if l > s.MaxPages*cs.PageSize {
				return fmt.Errorf("cpu: attention: sequence %d has length %d, its page table row holds %d", seq, l, s.MaxPages*cs.PageSize)
			}
			for j, p := range pt[seq*s.MaxPages:][:(l+cs.PageSize-1)/cs.PageSize] {
				if p < 0 || int(p) >= cs.Pages {
					return fmt.Errorf("cpu: attention: sequence %d: page table entry %d is page %d, the cache has %d", seq, j, p, cs.Pages)
				}
			}
			for i := qs[seq]; i < qs[seq+1]; i++ {
				rowSeq[i] = int32(seq)
			}
			if n > 0 {
				maxLen = max(maxLen, l)
			}
		}

		group := s.QHeads / cs.KVHeads
		d, kvRow := cs.D, cs.KVHeads*cs.D
		q, out, ck, cv := u16s(a.Q), u16s(a.Out), u16s(a.Cache.K), u16s(a.Cache.V)
		be.parallel(s.Tq*cs.KVHeads, func(item int) {
			row, kvh := item/cs.KVHeads, item%cs.KVHeads
			seq := int(rowSeq[row])
			if seq < 0 {
				return
			}
			l, n := int(lens[seq]), int(qs[seq+1]-qs[seq])
			pos := l - n + row - int(qs[seq]) // this query's position; it sees 0..pos
			pages := pt[seq*s.MaxPages:][:s.MaxPages]
			buf := be.getScratch(maxLen + 2*d)
			defer be.putScratch(buf)
			scores, qf, acc := (*buf)[:pos+1], (*buf)[maxLen:maxLen+d], (*buf)[maxLen+d:maxLen+2*d]
			// base returns the element offset of position p's KV head kvh.
			base := func(p int) int {
				slot := int(pages[p/cs.PageSize])*cs.PageSize + p%cs.PageSize
				return slot*kvRow + kvh*d
			}
			for h := kvh * group; h < (kvh+1)*group; h++ {
				decodeBF16(qf, q[(row*s.QHeads+h)*d:][:d])
				m := float32(math.Inf(-1))
				for p := range scores {
					scores[p] = dotBF16(qf, ck[base(p):][:d]) * a.Scale
					m = max(m, scores[p])
				}
				var sum float32
				for p, v := range scores {
					scores[p] = float32(math.Exp(float64(v - m)))
					sum += scores[p]
				}
				clear(acc)
				for p, e := range scores {
					prob := e / sum
					vr := cv[base(p):][:d]
					for i, vv := range vr {
						acc[i] += float32(prob * bf16.ToFloat32(vv))
					}
				}
				o := out[(row*s.QHeads+h)*d:][:d]
				for i, v := range acc {
					o[i] = bf16.FromFloat32(v)
				}
			}
		})
		return nil
	}, nil
}

// Sample draws one token per row, exactly as kernels.SampleArgs documents,
// with these choices the contract leaves to the backend:
//
//   - Temperature must be 0 or positive and finite; TopP in (0, 1]; TopK in
//     [0, V]. Violations are errors naming the row, checked before any
//     output is written.
//   - Logits must be finite or -Inf (a masked token), with at least one
//     finite value; a NaN or +Inf, or logits / T overflowing FP32, is an
//     error naming the row (a silent arbitrary token would poison a rollout).
//   - scaled = logits / T in FP32; the probabilities are softmax(scaled) in
//     float64 (maximum subtracted, sum in token order).
//   - Order: descending probability, ties by ascending id. Keep the first
//     TopK (0: all), then the shortest prefix whose cumulative probability
//     (float64, in order) is >= TopP; TopP = 1 keeps every token, so that
//     rounding in the running sum cannot drop the tail.
//   - u = philox.Uniform(seed, sampleID, position); walking the kept tokens
//     in ascending id order, the token is the first whose cumulative kept
//     probability divided by the kept total (both float64 sums in that
//     order) is > u, else the last kept one. Without truncation no sort is
//     needed at all. Tokens of probability 0 can never be drawn.
//   - Greedy (T = 0) is the argmax, lowest id on ties; no draw is made.
//
// On an error the outputs are unspecified.
func (be *Backend) Sample(a kernels.SampleArgs) error {
	return issue(be, "sample", a, be.prepSample)
}

func (be *Backend) prepSample(a kernels.SampleArgs) (func() error, error) {
	rows, v, err := a.Validate()
	if err != nil {
		return nil, err
	}
	bufs := map[string]*kernels.Buffer{"logits": a.Logits, "temperature": a.Temperature, "top k": a.TopK, "top p": a.TopP,
		"seeds": a.Seeds, "sample ids": a.SampleIDs, "positions": a.Positions, "tokens": a.Tokens, "logprobs": a.LogProbs}
	if err := be.owns("sample", bufs); err != nil {
		return nil, err
	}
	return func() error {
		logits, temp, topK, topP := f32s(a.Logits), f32s(a.Temperature), i32s(a.TopK), f32s(a.TopP)
		seeds, ids, pos, tokens, lps := i32s(a.Seeds), i32s(a.SampleIDs), i32s(a.Positions), i32s(a.Tokens), f32s(a.LogProbs)
		for r := range rows {
			switch t := temp[r]; {
			case !(t >= 0) || math.IsInf(float64(t), 1):
				return fmt.Errorf("cpu: sample: row %d: temperature %v: want 0 (greedy) or a positive finite value", r, t)
			case !(topP[r] > 0 && topP[r] <= 1):
				return fmt.Errorf("cpu: sample: row %d: top p %v: want (0, 1]", r, topP[r])
			case topK[r] < 0 || int(topK[r]) > v:
				return fmt.Errorf("cpu: sample: row %d: top k %d: want 0 (all) up to the vocabulary, %d", r, topK[r], v)
			}
		}
		be.parallel(rows, func(r int) {
			p := sampleParams{
				temp: temp[r], topK: int(topK[r]), topP: topP[r],
				seed:     uint64(uint32(seeds[2*r])) | uint64(uint32(seeds[2*r+1]))<<32,
				sampleID: uint32(ids[r]), position: uint32(pos[r]),
			}
			tok, lp, err := sampleRow(logits[r*v:(r+1)*v], p)
			if err != nil { // this row only: the others are drawn as usual
				tok, lp = kernels.UnsampledToken, float32(math.NaN())
			}
			tokens[r], lps[r] = int32(tok), lp
		})
		return nil
	}, nil
}

// LogProbs scores given tokens under softmax(logits), in float64.
func (be *Backend) LogProbs(a kernels.LogProbsArgs) error {
	return issue(be, "logprobs", a, be.prepLogProbs)
}

func (be *Backend) prepLogProbs(a kernels.LogProbsArgs) (func() error, error) {
	rows, v, err := a.Validate()
	if err != nil {
		return nil, err
	}
	if err := be.owns("logprobs", map[string]*kernels.Buffer{"logits": a.Logits, "tokens": a.Tokens, "logprobs": a.LogProbs}); err != nil {
		return nil, err
	}
	return func() error {
		logits, tokens, lps := f32s(a.Logits), i32s(a.Tokens), f32s(a.LogProbs)
		for r, tok := range tokens {
			if tok < 0 || int(tok) >= v {
				return fmt.Errorf("cpu: logprobs: row %d: token %d, vocabulary is %d", r, tok, v)
			}
		}
		errs := make([]error, rows)
		be.parallel(rows, func(r int) {
			row := logits[r*v : (r+1)*v]
			m, err := rowMax(row)
			if err != nil {
				errs[r] = fmt.Errorf("cpu: logprobs: row %d: %w", r, err)
				return
			}
			lps[r] = float32(float64(row[tokens[r]]) - logSumExp(row, m))
		})
		for _, err := range errs {
			if err != nil {
				return err
			}
		}
		return nil
	}, nil
}

// rowMax returns the largest value of a row of logits, which must be finite
// or -Inf with at least one finite value.
func rowMax(row []float32) (float64, error) {
	m := math.Inf(-1)
	for i, l := range row {
		switch {
		case l != l || math.IsInf(float64(l), 1):
			return 0, fmt.Errorf("logit %d is %v", i, l)
		case float64(l) > m:
			m = float64(l)
		}
	}
	if math.IsInf(m, -1) {
		return 0, fmt.Errorf("every logit is -Inf")
	}
	return m, nil
}

// logSumExp returns log(sum(exp(row))) in float64, given the row's maximum m.
func logSumExp(row []float32, m float64) float64 {
	var z float64
	for _, l := range row {
		z += math.Exp(float64(l) - m)
	}
	return m + math.Log(z)
}

type sampleParams struct {
	temp, topP         float32
	topK               int
	seed               uint64
	sampleID, position uint32
}

// sampleRow draws one token from a row of logits (see Sample) and returns it
// with its log-probability under softmax(logits / T).
func sampleRow(logits []float32, p sampleParams) (int, float32, error) {
	m, err := rowMax(logits)
	if err != nil {
		return 0, 0, err
	}
	if p.temp == 0 {
		best := 0
		for i, l := range logits {
			if l > logits[best] {
				best = i
			}
		}
		return best, float32(float64(logits[best]) - logSumExp(logits, m)), nil
	}

	// Scaled logits s = (logit - max) / T in FP32: at most 0, so no
	// temperature overflows them; the maximum is exactly 0 and z >= 1.
	v := len(logits)
	lmax := float32(m)
	prob := make([]float64, v)
	for i, l := range logits {
		prob[i] = float64(scaled(l, lmax, p.temp))
	}
	var z float64
	for i, s := range prob {
		prob[i] = math.Exp(s)
		z += prob[i]
	}
	logZ := math.Log(z)
	for i := range prob {
		prob[i] /= z
	}

	var kept []int32
	if (p.topK == 0 || p.topK == v) && p.topP >= 1 {
		kept = make([]int32, v)
		for i := range kept {
			kept[i] = int32(i)
		}
	} else {
		kept = sortedTop(prob, p.topK)
	}
	if p.topP < 1 {
		var cum float64
		for j, id := range kept {
			cum += prob[id]
			if cum >= float64(p.topP) {
				kept = kept[:j+1]
				break
			}
		}
	}
	slices.Sort(kept) // the draw walks the kept tokens by id
	var total float64
	for _, id := range kept {
		total += prob[id]
	}
	u := philox.Uniform(p.seed, p.sampleID, p.position)
	tok := int(kept[len(kept)-1])
	var cum float64
	for _, id := range kept {
		cum += prob[id]
		if cum/total > u {
			tok = int(id)
			break
		}
	}
	return tok, float32(float64(scaled(logits[tok], lmax, p.temp)) - logZ), nil
}

// scaled is a logit of a row whose largest logit is lmax, at temperature t,
// as Sample defines it: (l - lmax) / t, each operation rounded to FP32.
func scaled(l, lmax, t float32) float32 { return float32(l-lmax) / t }

// before reports whether token a comes before token b in sampling order:
// higher probability first, ties by lower id.
func before(prob []float64, a, b int32) bool {
	return prob[a] > prob[b] || prob[a] == prob[b] && a < b
}

// sortedTop returns the ids of the k first tokens in sampling order (k = 0:
// all of them), sorted. A small k uses a bounded heap, O(V log k), instead
// of sorting the whole vocabulary.
func sortedTop(prob []float64, k int) []int32 {
	v := len(prob)
	if k == 0 || k > v {
		k = v
	}
	cmp := func(a, b int32) int {
		switch {
		case before(prob, a, b):
			return -1
		case before(prob, b, a):
			return 1
		}
		return 0
	}
	if 4*k >= v {
		ids := make([]int32, v)
		for i := range ids {
			ids[i] = int32(i)
		}
		slices.SortFunc(ids, cmp)
		return ids[:k]
	}
	// heap[0] is the last (worst) of the k best seen so far.
	heap := make([]int32, 0, k)
	for i := range int32(v) {
		if len(heap) < k {
			heap = append(heap, i)
			for c := len(heap) - 1; c > 0; {
				par := (c - 1) / 2
				if !before(prob, heap[par], heap[c]) {
					break
				}
				heap[par], heap[c] = heap[c], heap[par]
				c = par
			}
			continue
		}
		if !before(prob, i, heap[0]) {
			continue
		}
		heap[0] = i
		for c := 0; ; {
			w, l, r := c, 2*c+1, 2*c+2
			if l < k && before(prob, heap[w], heap[l]) {
				w = l
			}
			if r < k && before(prob, heap[w], heap[r]) {
				w = r
			}
			if w == c {
				break
			}
			heap[c], heap[w] = heap[w], heap[c]
			c = w
		}
	}
	slices.SortFunc(heap, cmp)
	return heap
}
