package kernelstest

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// deltaSpan is a span of a test delta: the elements j of [start,
// start+len) it changes, with their values.
type deltaSpan struct {
	start, len int
	form       int32
	changed    []int // increasing
	values     []uint16
}

// encodeDelta lays out spans as ScatterBF16 takes them, with the words and
// values of each span in the given order: index lists as uint16 pairs,
// bitmaps bit j of word j/32.
func encodeDelta(spans []deltaSpan) (ds []kernels.DeltaSpan, masks, values []byte) {
	for _, s := range spans {
		d := kernels.DeltaSpan{Start: int64(s.start), Len: int32(s.len), Form: s.form, Count: int32(len(s.changed)),
			Mask: int32(len(masks) / 4), Value: int32(len(values) / 2)}
		if s.form == kernels.DeltaIndices {
			for _, j := range s.changed {
				masks = binary.LittleEndian.AppendUint16(masks, uint16(j))
			}
			if len(s.changed)%2 == 1 {
				masks = append(masks, 0, 0)
			}
		} else {
			words := make([]uint32, (s.len+31)/32)
			for _, j := range s.changed {
				words[j/32] |= 1 << (j % 32)
			}
			for _, w := range words {
				masks = binary.LittleEndian.AppendUint32(masks, w)
			}
		}
		for _, v := range s.values {
			values = binary.LittleEndian.AppendUint16(values, v)
		}
		ds = append(ds, d)
	}
	return ds, masks, values
}

// randSpan returns a span of n elements at start of which about frac
// change (at least one when frac > 0).
func randSpan(r *rand.Rand, start, n int, form int32, frac float64) deltaSpan {
	s := deltaSpan{start: start, len: n, form: form}
	for j := range n {
		if frac >= 1 || r.Float64() < frac {
			s.changed = append(s.changed, j)
		}
	}
	if frac > 0 && len(s.changed) == 0 {
		s.changed = []int{r.IntN(n)}
	}
	for range s.changed {
		s.values = append(s.values, uint16(r.Uint32()))
	}
	return s
}

// testScatterBF16 checks ScatterBF16, and on a kernels.DeltaStager its
// staged form from host memory and StageCopy, bit for bit against a plain
// reference: spans of one element to DeltaSpanElems, lengths around a
// 32-bit word, index lists and bitmaps, nothing to everything changed,
// listed out of order, inside a region at an offset of a buffer of another
// shape. Elements outside the spans keep their values. Each broken rule of
// a span is an error (on the call or at the next Sync) and leaves none
// pending.
func testScatterBF16(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(61, 62))
	const rows, cols, offset, region = 3, 70000, 1000, 205000
	initial := randBF16(r, rows*cols, 1)
	spans := []deltaSpan{
		randSpan(r, 0, 1, kernels.DeltaBitmap, 1),
		randSpan(r, 1, 1, kernels.DeltaIndices, 0),
		randSpan(r, 5, 31, kernels.DeltaBitmap, 0.5),
		randSpan(r, 40, 32, kernels.DeltaIndices, 1),
		randSpan(r, 80, 33, kernels.DeltaBitmap, 1),
		randSpan(r, 120, 33, kernels.DeltaIndices, 0.3),
		randSpan(r, 200, kernels.DeltaSpanElems, kernels.DeltaBitmap, 0.2),
		randSpan(r, 65800, kernels.DeltaSpanElems, kernels.DeltaIndices, 0.01),
		randSpan(r, 131400, kernels.DeltaSpanElems, kernels.DeltaBitmap, 1),
		randSpan(r, 197000, 7999, kernels.DeltaIndices, 0.05),
		randSpan(r, 204999, 1, kernels.DeltaIndices, 1),
	}
	r.Shuffle(len(spans), func(i, j int) { spans[i], spans[j] = spans[j], spans[i] })
	want := slices.Clone(initial)
	for _, s := range spans {
		for k, j := range s.changed {
			want[offset+s.start+j] = s.values[k]
		}
	}
	ds, masks, values := encodeDelta(spans)

	t.Run("op", func(t *testing.T) {
		dst := bf16Buf(t, be, initial, rows, cols)
		sb := alloc(t, be, kernels.I32, len(ds), kernels.DeltaSpanWords)
		upload(t, be, sb, kernels.AppendDeltaSpans(nil, ds))
		mb := alloc(t, be, kernels.I32, len(masks)/4)
		upload(t, be, mb, masks)
		vb := alloc(t, be, kernels.BF16, len(values)/2)
		upload(t, be, vb, values)
		if err := be.ScatterBF16(kernels.ScatterBF16Args{Dst: dst, Offset: offset, Len: region, Spans: sb, Masks: mb, Values: vb}); err != nil {
			t.Fatal(err)
		}
		expectBytes(t, "scatter bf16", download(t, be, dst), kernels.Uint16Bytes(want), 2*cols)
	})
	st, ok := be.(kernels.DeltaStager)
	if !ok {
		t.Logf("%s is no kernels.DeltaStager: the staged forms are not tested", be.Name())
	} else {
		t.Run("staged", func(t *testing.T) {
			dst := bf16Buf(t, be, initial, rows, cols)
			if err := st.StageScatterBF16(kernels.HostScatterBF16{Dst: dst, Offset: offset, Len: region, Spans: ds, Masks: masks, Values: values}); err != nil {
				t.Fatal(err)
			}
			expectBytes(t, "stage scatter bf16", download(t, be, dst), kernels.Uint16Bytes(want), 2*cols)
		})
		t.Run("stage copy", func(t *testing.T) {
			src := bf16Buf(t, be, initial, rows, cols)
			other := randBF16(r, 5000, 1)
			dst := bf16Buf(t, be, other, 5000)
			if err := st.StageCopy(dst, 6, src, 2*cols+10, 1000); err != nil {
				t.Fatal(err)
			}
			exp := kernels.Uint16Bytes(other)
			copy(exp[6:], kernels.Uint16Bytes(initial)[2*cols+10:][:1000])
			if got := download(t, be, dst); !bytes.Equal(got, exp) {
				t.Fatalf("stage copy: byte %d differs", firstDiff(got, exp))
			}
			if err := st.StageCopy(dst, 9500, src, 0, 1000); err == nil {
				t.Fatal("stage copy past the end of dst accepted")
			}
		})
	}

	t.Run("errors", func(t *testing.T) {
		// Four elements of 100 change: 3, 7, 50 and 99.
		good := func(form int32) deltaSpan {
			return deltaSpan{start: 10, len: 100, form: form, changed: []int{3, 7, 50, 99}, values: []uint16{1, 2, 3, 4}}
		}
		for _, c := range []struct {
			name string
			form int32
			edit func(s *kernels.DeltaSpan, masks []byte)
		}{
			{"empty span", kernels.DeltaIndices, func(s *kernels.DeltaSpan, _ []byte) { s.Len, s.Count = 0, 0 }},
			{"span too long", kernels.DeltaIndices, func(s *kernels.DeltaSpan, _ []byte) { s.Len = kernels.DeltaSpanElems + 1 }},
			{"span past the region", kernels.DeltaIndices, func(s *kernels.DeltaSpan, _ []byte) { s.Start = region - 50 }},
			{"negative start", kernels.DeltaIndices, func(s *kernels.DeltaSpan, _ []byte) { s.Start = -1 }},
			{"unknown form", kernels.DeltaIndices, func(s *kernels.DeltaSpan, _ []byte) { s.Form = 2 }},
			{"count above len", kernels.DeltaIndices, func(s *kernels.DeltaSpan, _ []byte) { s.Count = s.Len + 1 }},
			{"words outside the masks", kernels.DeltaBitmap, func(s *kernels.DeltaSpan, _ []byte) { s.Mask = 1 }},
			{"values outside", kernels.DeltaIndices, func(s *kernels.DeltaSpan, _ []byte) { s.Value = 1 }},
			{"index repeated", kernels.DeltaIndices, func(s *kernels.DeltaSpan, m []byte) { copy(m[2:4], m[0:2]) }},
			{"index decreasing", kernels.DeltaIndices, func(s *kernels.DeltaSpan, m []byte) { binary.LittleEndian.PutUint16(m[4:], 5) }},
			{"index past len", kernels.DeltaIndices, func(s *kernels.DeltaSpan, m []byte) { binary.LittleEndian.PutUint16(m[6:], 100) }},
			{"bitmap count", kernels.DeltaBitmap, func(s *kernels.DeltaSpan, _ []byte) { s.Count = 3 }},
			// Element 99 (bit 3 of word 3) moved to 106, past the span.
			{"bitmap past len", kernels.DeltaBitmap, func(s *kernels.DeltaSpan, m []byte) { binary.LittleEndian.PutUint32(m[12:], 1<<10) }},
		} {
			t.Run(c.name, func(t *testing.T) {
				ds, masks, values := encodeDelta([]deltaSpan{good(c.form)})
				c.edit(&ds[0], masks)
				dst := alloc(t, be, kernels.BF16, rows, cols)
				sb := alloc(t, be, kernels.I32, 1, kernels.DeltaSpanWords)
				upload(t, be, sb, kernels.AppendDeltaSpans(nil, ds))
				mb := alloc(t, be, kernels.I32, len(masks)/4)
				upload(t, be, mb, masks)
				vb := alloc(t, be, kernels.BF16, len(values)/2)
				upload(t, be, vb, values)
				err := be.ScatterBF16(kernels.ScatterBF16Args{Dst: dst, Offset: offset, Len: region, Spans: sb, Masks: mb, Values: vb})
				if err == nil {
					err = be.Sync()
				}
				if err == nil {
					t.Errorf("scatter bf16: %s not reported", c.name)
				}
				if err := be.Sync(); err != nil {
					t.Errorf("scatter bf16: the error is still pending after it was reported: %v", err)
				}
				if ok {
					err := st.StageScatterBF16(kernels.HostScatterBF16{Dst: dst, Offset: offset, Len: region, Spans: ds, Masks: masks, Values: values})
					if err == nil {
						t.Errorf("stage scatter bf16: %s not reported", c.name)
					}
				}
			})
		}
		// The region itself must lie inside Dst.
		dst := alloc(t, be, kernels.BF16, 10)
		sb := alloc(t, be, kernels.I32, 0, kernels.DeltaSpanWords)
		mb, vb := alloc(t, be, kernels.I32, 1), alloc(t, be, kernels.BF16, 1)
		for _, reg := range [][2]int{{0, 11}, {5, 6}, {-1, 2}} {
			err := be.ScatterBF16(kernels.ScatterBF16Args{Dst: dst, Offset: reg[0], Len: reg[1], Spans: sb, Masks: mb, Values: vb})
			wantError(t, fmt.Sprintf("region [%d, +%d) of 10 elements", reg[0], reg[1]), "scatter bf16", err)
		}
	})
}
