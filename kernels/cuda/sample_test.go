package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

// sampleCase is one row of a Sample call.
type sampleCase struct {
	name string
	temp float32
	topK int32
	topP float32
	nan  bool // one logit is NaN
}

// sampleRows runs Sample over rows of random logits of width v (the same
// seed gives the same logits), with the wide sampler on or off.
func sampleRows(t *testing.T, be *Backend, wide bool, v int, cases []sampleCase, seed uint64) ([]int32, []float32) {
	t.Helper()
	defer func(w bool) { be.sampleWide = w }(be.sampleWide)
	be.sampleWide = wide
	r := rand.New(rand.NewPCG(seed, 1))
	s := len(cases)
	logits := make([]float32, s*v)
	for i := range logits {
		logits[i] = float32(r.NormFloat64() * 3)
	}
	temp, topP := make([]float32, s), make([]float32, s)
	topK, seeds, ids, pos := make([]int32, s), make([]int32, 2*s), make([]int32, s), make([]int32, s)
	for i, c := range cases {
		if c.nan {
			logits[i*v+v/2] = float32(math.NaN())
		}
		temp[i], topK[i], topP[i] = c.temp, c.topK, c.topP
		seeds[2*i], seeds[2*i+1], ids[i], pos[i] = int32(seed), 7, int32(i), int32(100+i)
	}
	up := func(dt kernels.DType, b []byte, shape ...int) *kernels.Buffer {
		t.Helper()
		buf := moetest.Alloc(t, be, dt, shape...)
		if err := be.Upload(buf, 0, b); err != nil {
			t.Fatal(err)
		}
		return buf
	}
	tokens, lps := moetest.Alloc(t, be, kernels.I32, s), moetest.Alloc(t, be, kernels.F32, s)
	err := be.Sample(kernels.SampleArgs{
		Logits: up(kernels.F32, kernels.Float32Bytes(logits), s, v), Temperature: up(kernels.F32, kernels.Float32Bytes(temp), s),
		TopK: up(kernels.I32, kernels.Int32Bytes(topK), s), TopP: up(kernels.F32, kernels.Float32Bytes(topP), s),
		Seeds: up(kernels.I32, kernels.Int32Bytes(seeds), s, 2), SampleIDs: up(kernels.I32, kernels.Int32Bytes(ids), s),
		Positions: up(kernels.I32, kernels.Int32Bytes(pos), s), Tokens: tokens, LogProbs: lps,
	})
	if err != nil {
		t.Fatal(err)
	}
	tb, lb := make([]byte, tokens.Size()), make([]byte, lps.Size())
	if err := be.Download(tb, tokens, 0); err != nil {
		t.Fatal(err)
	}
	if err := be.Download(lb, lps, 0); err != nil {
		t.Fatal(err)
	}
	return kernels.BytesInt32(tb), kernels.BytesFloat32(lb)
}

// TestSampleWide compares the wide sampler (a block per 8192-logit
// segment of a row: rows that keep every token, and greedy ones) with
// model_sample alone on the same rows, at a Qwen3 vocabulary, a width one
// past whole segments and a width of one segment's part: the same tokens,
// logprobs within 1e-6 (their sums run in another order); truncated rows,
// which model_sample serves either way, bit for bit; a row with a NaN
// logit fails alone. A row alone gives the bits it gets among the others,
// and a launch of more rows than the wide sampler's scratch holds takes
// model_sample for all of them.
func TestSampleWide(t *testing.T) {
	be := gpu(t)
	var cases []sampleCase
	for i := range 24 {
		cases = append(cases, sampleCase{name: fmt.Sprintf("t1_%d", i), temp: 1, topP: 1})
	}
	cases = append(cases,
		sampleCase{name: "t0.7", temp: 0.7, topP: 1},
		sampleCase{name: "t1.3 topk V", temp: 1.3, topP: 1, topK: -1},
		sampleCase{name: "greedy", temp: 0, topP: 1},
		sampleCase{name: "greedy topk 5", temp: 0, topP: 0.5, topK: 5},
		sampleCase{name: "topk 50", temp: 1, topP: 1, topK: 50},
		sampleCase{name: "topp 0.9", temp: 1, topP: 0.9},
		sampleCase{name: "nan", temp: 1, topP: 1, nan: true},
		sampleCase{name: "greedy nan", temp: 0, topP: 1, nan: true},
	)
	for _, v := range []int{151936, 3*sampleSeg + 5, 1000} {
		cs := append([]sampleCase(nil), cases...)
		for i := range cs {
			if cs[i].topK == -1 {
				cs[i].topK = int32(v)
			}
		}
		t.Run(fmt.Sprintf("V%d", v), func(t *testing.T) {
			wTok, wLP := sampleRows(t, be, true, v, cs, 11)
			nTok, nLP := sampleRows(t, be, false, v, cs, 11)
			for i, c := range cs {
				truncated := c.temp != 0 && ((c.topK != 0 && int(c.topK) != v) || c.topP < 1)
				switch {
				case c.nan:
					if wTok[i] != -1 || !math.IsNaN(float64(wLP[i])) {
						t.Errorf("%s: token %d logprob %g, want -1 and NaN", c.name, wTok[i], wLP[i])
					}
				case truncated:
					if wTok[i] != nTok[i] || math.Float32bits(wLP[i]) != math.Float32bits(nLP[i]) {
						t.Errorf("%s: %d %g, model_sample alone %d %g: a truncated row's bits changed", c.name, wTok[i], wLP[i], nTok[i], nLP[i])
					}
				default:
					if wTok[i] != nTok[i] || math.Abs(float64(wLP[i]-nLP[i])) > 1e-6*max(1, math.Abs(float64(nLP[i]))) {
						t.Errorf("%s: wide %d %g, model_sample %d %g", c.name, wTok[i], wLP[i], nTok[i], nLP[i])
					}
				}
			}
			// Row 0 alone, the same logits (the first row of the seed).
			aTok, aLP := sampleRows(t, be, true, v, cs[:1], 11)
			if aTok[0] != wTok[0] || math.Float32bits(aLP[0]) != math.Float32bits(wLP[0]) {
				t.Errorf("row 0 alone: %d %g, among %d rows: %d %g", aTok[0], aLP[0], len(cs), wTok[0], wLP[0])
			}
		})
	}
	t.Run("rows past the scratch", func(t *testing.T) {
		many := make([]sampleCase, sampleWideRows+3)
		for i := range many {
			many[i] = sampleCase{temp: 1, topP: 1}
		}
		wTok, wLP := sampleRows(t, be, true, 64, many, 5)
		nTok, nLP := sampleRows(t, be, false, 64, many, 5)
		for i := range many {
			if wTok[i] != nTok[i] || math.Float32bits(wLP[i]) != math.Float32bits(nLP[i]) {
				t.Fatalf("row %d: %d %g, model_sample alone %d %g", i, wTok[i], wLP[i], nTok[i], nLP[i])
			}
		}
	})
}
