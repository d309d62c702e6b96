package cpu_test

import (
	"encoding/binary"
	"math"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
)

func f32Vals(t *testing.T, be kernels.Backend, vals []float32, shape ...int) *kernels.Buffer {
	t.Helper()
	b := mustAlloc(t, be, kernels.F32, shape...)
	raw := make([]byte, 4*len(vals))
	for i, v := range vals {
		binary.LittleEndian.PutUint32(raw[4*i:], math.Float32bits(v))
	}
	if err := be.Upload(b, 0, raw); err != nil {
		t.Fatal(err)
	}
	return b
}

// sampleArgs is a Sample call over the given logits [len(temp), V] with one
// parameter set per row; seeds, sample ids and positions are zero.
func sampleArgs(t *testing.T, be kernels.Backend, logits []float32, temp []float32, topK []int32, topP []float32) kernels.SampleArgs {
	s := len(temp)
	return kernels.SampleArgs{
		Logits: f32Vals(t, be, logits, s, len(logits)/s), Temperature: f32Vals(t, be, temp, s),
		TopK: i32Buf(t, be, topK...), TopP: f32Vals(t, be, topP, s), Seeds: mustAlloc(t, be, kernels.I32, s, 2),
		SampleIDs: mustAlloc(t, be, kernels.I32, s), Positions: mustAlloc(t, be, kernels.I32, s),
		Tokens: mustAlloc(t, be, kernels.I32, s), LogProbs: mustAlloc(t, be, kernels.F32, s),
	}
}

// attentionArgs is one sequence of length 4 with queries 0..2 on a cache of
// 2 pages of 2 slots (1 KV head, D 8, 2 query heads).
func attentionArgs(t *testing.T, be kernels.Backend, table []int32, lens int32, start ...int32) kernels.AttentionArgs {
	return kernels.AttentionArgs{
		Out: mustAlloc(t, be, kernels.BF16, 3, 2, 8), Q: mustAlloc(t, be, kernels.BF16, 3, 2, 8),
		Cache:     kernels.KVCache{K: mustAlloc(t, be, kernels.BF16, 2, 2, 1, 8), V: mustAlloc(t, be, kernels.BF16, 2, 2, 1, 8)},
		PageTable: reshape(t, i32Buf(t, be, table...), 1, len(table)), SeqLens: i32Buf(t, be, lens),
		QueryStart: i32Buf(t, be, start...), Scale: 1,
	}
}

// Data-dependent errors of the model ops: checked before anything is
// written, naming the entry.
func TestModelDataErrors(t *testing.T) {
	be := newBackend(t)
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	logits := []float32{1, 2, 3, 4, 5, 6} // 2 rows of 3
	cache := kernels.KVCache{K: mustAlloc(t, be, kernels.BF16, 2, 4, 1, 8), V: mustAlloc(t, be, kernels.BF16, 2, 4, 1, 8)}
	kv := mustAlloc(t, be, kernels.BF16, 3, 1, 8)
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"embed id", be.Embed(kernels.EmbedArgs{Out: mustAlloc(t, be, kernels.BF16, 3, 8),
			Table: mustAlloc(t, be, kernels.BF16, 10, 8), IDs: i32Buf(t, be, 0, 9, 10)}),
			"cpu: embed: token 2 has id 10"},
		{"embed negative id", be.Embed(kernels.EmbedArgs{Out: mustAlloc(t, be, kernels.BF16, 1, 8),
			Table: mustAlloc(t, be, kernels.BF16, 10, 8), IDs: i32Buf(t, be, -1)}),
			"token 0 has id -1"},
		{"rope position", be.RoPE(kernels.RoPEArgs{X: mustAlloc(t, be, kernels.BF16, 2, 1, 8), Positions: i32Buf(t, be, 3, 4),
			Cos: mustAlloc(t, be, kernels.BF16, 4, 4), Sin: mustAlloc(t, be, kernels.BF16, 4, 4)}),
			"cpu: rope: token 1 is at position 4"},
		{"kv write slot", be.KVWrite(kernels.KVWriteArgs{Cache: cache, K: kv, V: kv, Slots: i32Buf(t, be, 0, 8, 1)}),
			"cpu: kv write: token 1 names slot 8, the cache has 8"},
		{"kv write duplicate", be.KVWrite(kernels.KVWriteArgs{Cache: cache, K: kv, V: kv, Slots: i32Buf(t, be, 3, 1, 3)}),
			"tokens 0 and 2 both name slot 3"},
		{"attention page", be.Attention(attentionArgs(t, be, []int32{1, 2}, 4, 0, 3)),
			"cpu: attention: sequence 0: page table entry 1 is page 2"},
		{"attention short sequence", be.Attention(attentionArgs(t, be, []int32{1, 0}, 2, 0, 3)),
			"sequence 0 has 3 queries but length 2"},
		{"attention long sequence", be.Attention(attentionArgs(t, be, []int32{1, 0}, 5, 0, 3)),
			"sequence 0 has length 5, its page table row holds 4"},
		{"attention query start past q", be.Attention(attentionArgs(t, be, []int32{1, 0}, 4, 0, 4)),
			"query start runs from 0 to 4, q has 3 rows"},
		{"attention query start decreases", be.Attention(func() kernels.AttentionArgs {
			a := attentionArgs(t, be, []int32{1, 0, 0, 1}, 4, 0, 3)
			a.PageTable, a.SeqLens, a.QueryStart = reshape(t, a.PageTable, 2, 2), i32Buf(t, be, 4, 4), i32Buf(t, be, 0, 3, 1)
			return a
		}()), "query start decreases at sequence 1 (3 > 1)"},
		{"sample temperature", be.Sample(sampleArgs(t, be, logits, []float32{1, -1}, []int32{0, 0}, []float32{1, 1})),
			"cpu: sample: row 1: temperature -1"},
		{"sample temperature NaN", be.Sample(sampleArgs(t, be, logits, []float32{nan, 1}, []int32{0, 0}, []float32{1, 1})),
			"row 0: temperature NaN"},
		{"sample temperature Inf", be.Sample(sampleArgs(t, be, logits, []float32{inf, 1}, []int32{0, 0}, []float32{1, 1})),
			"row 0: temperature +Inf"},
		{"sample top p 0", be.Sample(sampleArgs(t, be, logits, []float32{1, 1}, []int32{0, 0}, []float32{1, 0})),
			"row 1: top p 0"},
		{"sample top p > 1", be.Sample(sampleArgs(t, be, logits, []float32{1, 1}, []int32{0, 0}, []float32{1.5, 1})),
			"row 0: top p 1.5"},
		{"sample top k negative", be.Sample(sampleArgs(t, be, logits, []float32{1, 1}, []int32{0, -1}, []float32{1, 1})),
			"row 1: top k -1"},
		{"sample top k > V", be.Sample(sampleArgs(t, be, logits, []float32{1, 1}, []int32{4, 0}, []float32{1, 1})),
			"row 0: top k 4"},
		{"logprobs token", be.LogProbs(kernels.LogProbsArgs{Logits: f32Vals(t, be, logits, 2, 3),
			Tokens: i32Buf(t, be, 2, 3), LogProbs: mustAlloc(t, be, kernels.F32, 2)}),
			"cpu: logprobs: row 1: token 3, vocabulary is 3"},
		{"logprobs Inf logit", be.LogProbs(kernels.LogProbsArgs{Logits: f32Vals(t, be, []float32{1, inf, 3}, 1, 3),
			Tokens: i32Buf(t, be, 0), LogProbs: mustAlloc(t, be, kernels.F32, 1)}),
			"cpu: logprobs: row 0: logit 1 is +Inf"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.err == nil || !strings.Contains(tc.err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", tc.err, tc.want)
			}
		})
	}
}

// Query rows past QueryStart[S] are padding: the CPU backend leaves them
// as they are.
func TestAttentionPaddingRows(t *testing.T) {
	be := newBackend(t)
	a := attentionArgs(t, be, []int32{1, 0}, 4, 0, 1)
	pattern := make([]byte, a.Out.Size())
	for i := range pattern {
		pattern[i] = byte(i)
	}
	if err := be.Upload(a.Out, 0, pattern); err != nil {
		t.Fatal(err)
	}
	if err := be.Attention(a); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, a.Out.Size())
	if err := be.Download(got, a.Out, 0); err != nil {
		t.Fatal(err)
	}
	row := a.Out.Size() / 3
	if string(got[row:]) != string(pattern[row:]) {
		t.Fatal("attention wrote padding rows")
	}
}

// Masked (-Inf) tokens have probability 0 and are never drawn, even with
// every token kept.
func TestSampleNeverDrawsMasked(t *testing.T) {
	be := newBackend(t)
	const S, V = 300, 8
	logits, temp, topK, topP := make([]float32, S*V), make([]float32, S), make([]int32, S), make([]float32, S)
	for r := range S {
		for i := range V {
			logits[r*V+i] = float32(i % 3)
			if i%2 == 1 {
				logits[r*V+i] = float32(math.Inf(-1))
			}
		}
		temp[r], topP[r] = 3, 1
	}
	a := sampleArgs(t, be, logits, temp, topK, topP)
	pos := make([]byte, 4*S)
	for r := range S {
		binary.LittleEndian.PutUint32(pos[4*r:], uint32(r))
	}
	if err := be.Upload(a.Positions, 0, pos); err != nil {
		t.Fatal(err)
	}
	if err := be.Sample(a); err != nil {
		t.Fatal(err)
	}
	raw := make([]byte, 4*S)
	if err := be.Download(raw, a.Tokens, 0); err != nil {
		t.Fatal(err)
	}
	seen := map[uint32]int{}
	for r := range S {
		tok := binary.LittleEndian.Uint32(raw[4*r:])
		if tok%2 == 1 {
			t.Fatalf("row %d drew masked token %d", r, tok)
		}
		seen[tok]++
	}
	if len(seen) != V/2 {
		t.Fatalf("drew %v, want every unmasked token", seen)
	}
}

// Degenerate cache geometry is an error, not a division by zero.
func TestAttentionEmptyPages(t *testing.T) {
	be := newBackend(t)
	a := attentionArgs(t, be, []int32{0, 0}, 0, 0, 0)
	a.Cache = kernels.KVCache{K: mustAlloc(t, be, kernels.BF16, 2, 0, 1, 8), V: mustAlloc(t, be, kernels.BF16, 2, 0, 1, 8)}
	if err := be.Attention(a); err == nil || !strings.Contains(err.Error(), "has an empty page") {
		t.Fatalf("error %v, want one about the page size", err)
	}
}
