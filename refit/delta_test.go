package refit

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/policy"
)

// perturb returns a copy of the BF16 bytes old with about frac of its
// elements changed to other finite values (at least one when frac > 0).
func perturb(r *rand.Rand, old []byte, frac float64) []byte {
	out := slices.Clone(old)
	n := len(old) / 2
	change := func(i int) {
		v := bf16.ToFloat32(binary.LittleEndian.Uint16(out[2*i:]))
		w := bf16.FromFloat32(v + float32(r.NormFloat64())*0.01 + 1e-3)
		if w == binary.LittleEndian.Uint16(out[2*i:]) {
			w ^= 1
		}
		binary.LittleEndian.PutUint16(out[2*i:], w)
	}
	hit := false
	for i := range n {
		if r.Float64() < frac {
			change(i)
			hit = true
		}
	}
	if frac > 0 && !hit && n > 0 {
		change(r.IntN(n))
	}
	return out
}

// encodeDeltaTensor encodes the delta of a whole tensor, region by region.
func encodeDeltaTensor(old, new []byte) []byte {
	var out, work []byte
	for at := 0; at < len(new); at += 2 * DeltaRegionElems {
		end := min(len(new), at+2*DeltaRegionElems)
		out, _, work = appendDeltaRecord(out, old[at:end], new[at:end], work)
	}
	return out
}

// decodeDelta applies the records of a delta tensor to a copy of old,
// feeding the decoder the bytes in pieces cut at cuts.
func decodeDelta(old, enc []byte, cuts ...int) ([]byte, error) {
	out := slices.Clone(old)
	d := newDeltaDecoder(int64(len(old) / 2))
	var spans []kernels.DeltaSpan
	var masks, values []byte
	emit := func(rec deltaRecord, region int64) error {
		var s kernels.DeltaSpan
		s, masks, values = rec.span(0, region, regionLen(d.n, region), masks, values)
		spans = append(spans, s)
		return nil
	}
	prev := 0
	for _, c := range append(cuts, len(enc)) {
		if err := d.feed(enc[prev:c], emit); err != nil {
			return nil, err
		}
		prev = c
	}
	if err := d.done(); err != nil {
		return nil, err
	}
	// The spans are what the backend takes: apply them as the op's
	// definition has it.
	for _, s := range spans {
		if err := kernels.CheckDeltaSpan(s, len(old)/2, masks, values); err != nil {
			return nil, err
		}
		m, v := masks[4*s.Mask:], values[2*s.Value:]
		k := 0
		for j := range int(s.Len) {
			var hit bool
			if s.Form == kernels.DeltaIndices {
				hit = k < int(s.Count) && int(binary.LittleEndian.Uint16(m[2*k:])) == j
			} else {
				hit = binary.LittleEndian.Uint32(m[4*(j/32):])&(1<<(j%32)) != 0
			}
			if hit {
				copy(out[2*(int(s.Start)+j):], v[2*k:2*k+2])
				k++
			}
		}
	}
	return out, nil
}

// TestDeltaRoundTrip: the records of a tensor, from nothing to everything
// changed, decode (in one piece, or cut anywhere, records split across
// pieces) to exactly the new tensor; each record takes the smaller form,
// the index list on a tie.
func TestDeltaRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{1, 31, 33, 1000, DeltaRegionElems, DeltaRegionElems + 77, 3*DeltaRegionElems - 5} {
		for _, frac := range []float64{0, 0.001, 0.01, 0.05, 0.2, 1} {
			old := make([]byte, 2*n)
			for i := range old {
				old[i] = byte(r.Uint32())
			}
			for i := 0; i < len(old); i += 2 { // finite values
				old[i+1] &= 0xbf
			}
			new := perturb(r, old, frac)
			enc := encodeDeltaTensor(old, new)
			cuts := [][]int{nil, {1}, {3, 8, 9}, {len(enc) / 2}, {len(enc) - 1}}
			if len(enc) < 10 {
				cuts = [][]int{nil}
			}
			for _, c := range cuts {
				got, err := decodeDelta(old, enc, c...)
				if err != nil {
					t.Fatalf("n %d, %.3f changed, cut at %v: %v", n, frac, c, err)
				}
				if !bytes.Equal(got, new) {
					t.Fatalf("n %d, %.3f changed, cut at %v: decodes to other values", n, frac, c)
				}
			}
			// Every record is the smaller form.
			for at, region := 0, int64(0); at < len(enc); region++ {
				l := regionLen(int64(n), region)
				size, err := deltaRecordLen(enc[at:], l)
				if err != nil {
					t.Fatal(err)
				}
				k := int(binary.LittleEndian.Uint32(enc[at+4:]))
				want, form := DeltaRecordSize(l, k)
				if size != want || int(enc[at]) != form {
					t.Fatalf("n %d region %d: %d of %d changed: form %d of %d bytes, want form %d of %d", n, region, k, l, enc[at], size, form, want)
				}
				at += size
			}
		}
	}
	// Where the two forms take the same bytes, the index list is chosen:
	// 64 elements (2 bitmap words), 4 changed: 8+16 either way.
	if size, form := DeltaRecordSize(64, 4); size != 24 || form != DeltaIndexList {
		t.Errorf("tie: form %d of %d bytes, want the index list of 24", form, size)
	}
	if _, form := DeltaRecordSize(64, 5); form != DeltaBitmap {
		t.Errorf("5 of 64 changed: form %d, want the bitmap", form)
	}
}

// TestDeltaRecordErrors: a malformed record is refused, naming the region.
func TestDeltaRecordErrors(t *testing.T) {
	old := make([]byte, 2*100)
	new := slices.Clone(old)
	for _, i := range []int{3, 7, 50} {
		binary.LittleEndian.PutUint16(new[2*i:], bf16.FromFloat32(1))
	}
	idx := encodeDeltaTensor(old, new) // an index list: 8 + 3*4 bytes
	for i := 0; i < len(new); i += 2 {
		binary.LittleEndian.PutUint16(new[i:], bf16.FromFloat32(float32(i)))
	}
	bm := encodeDeltaTensor(old, new) // a bitmap: 8 + 16 + 99*2 (element 0 stays 0)
	if idx[0] != DeltaIndexList || bm[0] != DeltaBitmap {
		t.Fatalf("forms %d and %d", idx[0], bm[0])
	}
	edit := func(b []byte, f func(b []byte)) []byte {
		b = slices.Clone(b)
		f(b)
		return b
	}
	for _, c := range []struct {
		name string
		enc  []byte
	}{
		{"unknown form", edit(idx, func(b []byte) { b[0] = 2 })},
		{"reserved byte", edit(idx, func(b []byte) { b[2] = 1 })},
		{"count above the region", edit(idx, func(b []byte) { binary.LittleEndian.PutUint32(b[4:], 101) })},
		{"index repeated", edit(idx, func(b []byte) { copy(b[10:12], b[8:10]) })},
		{"index decreasing", edit(idx, func(b []byte) { binary.LittleEndian.PutUint16(b[12:], 4) })},
		{"index past the region", edit(idx, func(b []byte) { binary.LittleEndian.PutUint16(b[12:], 100) })},
		{"NaN", edit(idx, func(b []byte) { binary.LittleEndian.PutUint16(b[len(b)-2:], 0x7fc0) })},
		{"Inf", edit(bm, func(b []byte) { binary.LittleEndian.PutUint16(b[len(b)-2:], 0xff80) })},
		{"bitmap count", edit(bm, func(b []byte) { b[8] &^= 2 })},
		{"bitmap past the region", edit(bm, func(b []byte) { b[8+12] ^= 0x18 })}, // element 99 moved to 100
		{"truncated", idx[:len(idx)-1]},
		{"bytes after the last region", append(slices.Clone(idx), 0)},
		{"header only", idx[:5]},
	} {
		_, err := decodeDelta(old, c.enc)
		if err == nil {
			t.Errorf("%s: accepted", c.name)
		} else if !errors.Is(err, ErrProtocol) && c.name != "truncated" && c.name != "header only" {
			t.Errorf("%s: %v, not a protocol error", c.name, err)
		}
	}
}

// TestChangedIn: whether a record changes elements of a range, for both
// forms, against the elements it changes.
func TestChangedIn(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, frac := range []float64{0.002, 0.05, 0.5} {
		const n = 300
		old := make([]byte, 2*n)
		new := perturb(r, old, frac)
		rec, err := parseDeltaRecord(encodeDeltaTensor(old, new), n)
		if err != nil {
			t.Fatal(err)
		}
		for range 2000 {
			a := r.IntN(n + 1)
			b := a + r.IntN(n+1-a)
			want := !bytes.Equal(old[2*a:2*b], new[2*a:2*b])
			if got := rec.changedIn(a, b); got != want {
				t.Fatalf("form %d: changed in [%d, %d): %v, want %v", rec.form, a, b, got, want)
			}
		}
	}
}

// TestMarkExperts: a delta of a fused expert tensor marks exactly the
// experts whose elements changed, whatever the regions' boundaries.
func TestMarkExperts(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	for _, per := range []int{100, 2048, 50000, 100000} {
		const E = 8
		n := E * per
		old := make([]byte, 2*n)
		new := slices.Clone(old)
		want := make([]bool, E)
		for _, e := range []int{1, 4, 7} {
			i := e*per + r.IntN(per)
			new[2*i] = 1
			want[e] = true
		}
		w := &write{target: policy.Target{Experts: [2]int{0, E}}, delta: newDeltaDecoder(int64(n))}
		err := w.delta.feed(encodeDeltaTensor(old, new), func(rec deltaRecord, region int64) error {
			w.markExperts(rec, region, regionLen(int64(n), region))
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(w.experts, want) {
			t.Errorf("%d elements an expert: marked %v, want %v", per, w.experts, want)
		}
	}
}

// TestDeltaBytesRange: the header's bounds on a delta tensor's bytes hold
// the records of nothing and of everything changed.
func TestDeltaBytesRange(t *testing.T) {
	for _, n := range []int{1, 2, 31, 32, 33, DeltaRegionElems, 2*DeltaRegionElems + 1} {
		lo, hi := deltaBytesRange(int64(n))
		old := make([]byte, 2*n)
		none := encodeDeltaTensor(old, old)
		all := encodeDeltaTensor(old, perturb(rand.New(rand.NewPCG(1, 1)), old, 1))
		if int64(len(none)) != lo || int64(len(all)) > hi {
			t.Errorf("%d elements: records of %d and %d bytes, bounds [%d, %d]", n, len(none), len(all), lo, hi)
		}
	}
}

// FuzzDeltaTensor feeds arbitrary bytes to the decoder of a delta tensor:
// it never panics; decoding in one piece or in two gives the same result;
// and what it accepts the backend accepts too (every span passes
// kernels.CheckDeltaSpan).
func FuzzDeltaTensor(f *testing.F) {
	old := make([]byte, 2*200)
	new := perturb(rand.New(rand.NewPCG(3, 3)), old, 0.02)
	f.Add(encodeDeltaTensor(old, new), uint32(200), uint16(7))
	f.Add(encodeDeltaTensor(old, perturb(rand.New(rand.NewPCG(4, 4)), old, 0.5)), uint32(200), uint16(30))
	f.Add([]byte{1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0x80, 0x3f}, uint32(3), uint16(9))
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, uint32(DeltaRegionElems+1), uint16(8))
	f.Fuzz(func(t *testing.T, enc []byte, nn uint32, cut uint16) {
		old := make([]byte, 2*int(nn%(3*DeltaRegionElems)))
		whole, err1 := decodeDelta(old, enc)
		c := int(cut) % (len(enc) + 1)
		split, err2 := decodeDelta(old, enc, c)
		if (err1 == nil) != (err2 == nil) || !bytes.Equal(whole, split) {
			t.Fatalf("one piece: %v; cut at %d: %v", err1, c, err2)
		}
	})
}

// BenchmarkDeltaEncode encodes a region's record from two 128 KiB sides in
// memory (no reads), at the fractions of changed elements a trainer's step
// leaves, cycling through 16 regions changed at different places, so a
// branch predictor cannot learn one; MB/s is of one side's bytes.
func BenchmarkDeltaEncode(b *testing.B) {
	r := rand.New(rand.NewPCG(3, 4))
	const regions = 16
	old := make([]byte, 2*DeltaRegionElems)
	for i := range old {
		old[i] = byte(r.Uint32()) & 0xbf
	}
	for _, frac := range []float64{0.01, 0.05, 0.2} {
		var news [regions][]byte
		for i := range news {
			news[i] = perturb(r, old, frac)
		}
		b.Run(fmt.Sprintf("changed=%g", frac), func(b *testing.B) {
			b.SetBytes(int64(len(old)))
			var rec, work []byte
			i := 0
			for b.Loop() {
				rec, _, work = appendDeltaRecord(rec[:0], old, news[i%regions], work)
				i++
			}
		})
		b.Run(fmt.Sprintf("size/changed=%g", frac), func(b *testing.B) {
			b.SetBytes(int64(len(old)))
			bm := make([]byte, bitmapBytes(DeltaRegionElems))
			i := 0
			for b.Loop() {
				changedBitmap(bm, old, news[i%regions])
				i++
			}
		})
	}
}

// BenchmarkDeltaDecode parses a tensor's records as a worker does, fed in
// 1 MiB pieces, into the spans the backend's scatter takes; MB/s is of the
// tensor's BF16 bytes.
func BenchmarkDeltaDecode(b *testing.B) {
	r := rand.New(rand.NewPCG(5, 6))
	old := make([]byte, 2*64*DeltaRegionElems)
	for i := range old {
		old[i] = byte(r.Uint32()) & 0xbf
	}
	for _, frac := range []float64{0.01, 0.05, 0.2} {
		enc := encodeDeltaTensor(old, perturb(r, old, frac))
		b.Run(fmt.Sprintf("changed=%g", frac), func(b *testing.B) {
			b.SetBytes(int64(len(old)))
			var masks, values []byte
			for b.Loop() {
				d := newDeltaDecoder(int64(len(old) / 2))
				masks, values = masks[:0], values[:0]
				emit := func(rec deltaRecord, region int64) error {
					_, masks, values = rec.span(0, region, regionLen(d.n, region), masks, values)
					return nil
				}
				for at := 0; at < len(enc); at += 1 << 20 {
					if err := d.feed(enc[at:min(len(enc), at+1<<20)], emit); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

// TestChangedElements: the encoder's bitmap (and its count, which the sizing pass
// uses) and its index list agree with an element-by-element scan, through the vector
// compares and the portable loops, for every single changed bit of every
// lane of 53 elements (a vector block, a portable one and a tail), and for
// random pairs of all densities and lengths up to a whole region.
func TestChangedElements(t *testing.T) {
	check := func(t *testing.T, what string, old, new []byte) {
		t.Helper()
		n := len(new) / 2
		var want []int
		for e := range n {
			if old[2*e] != new[2*e] || old[2*e+1] != new[2*e+1] {
				want = append(want, e)
			}
		}
		// Both the vector compares (where the machine has them) and the
		// portable loops alone.
		for _, path := range []struct {
			name   string
			bitmap func(bm, old, new []byte) int
		}{
			{"", changedBitmap},
			{"portable ", func(bm, old, new []byte) int { return changedBitmapFrom(bm, old, new, 0) }},
		} {
			bm := bytes.Repeat([]byte{0xff}, bitmapBytes(n)) // stale bits must go
			k := path.bitmap(bm, old, new)
			pos := make([]byte, 2*n+8)
			changedIndices(pos, bm)
			var got, set []int
			for j := range k {
				got = append(got, int(binary.LittleEndian.Uint16(pos[2*j:])))
			}
			for e := range 8 * len(bm) {
				if bm[e/8]>>(e%8)&1 != 0 {
					set = append(set, e)
				}
			}
			if k != len(want) || !slices.Equal(got, want) || !slices.Equal(set, want) {
				t.Fatalf("%s%s: changed %v; bitmap %d bits %v, indices %v", path.name, what, want, k, set, got)
			}
		}
	}
	old := make([]byte, 2*53)
	for e := range 53 {
		for bit := range 16 {
			new := slices.Clone(old)
			new[2*e+bit/8] ^= 1 << (bit % 8)
			check(t, fmt.Sprintf("element %d, bit %d", e, bit), old, new)
		}
	}
	r := rand.New(rand.NewPCG(7, 8))
	for _, n := range []int{0, 1, 3, 4, 15, 16, 17, 33, 1000, DeltaRegionElems} {
		for _, frac := range []float64{0, 0.01, 0.05, 0.3, 1} {
			a := make([]byte, 2*n)
			for i := range a {
				a[i] = byte(r.Uint32())
			}
			b := slices.Clone(a)
			for e := range n {
				if r.Float64() < frac {
					b[2*e+r.IntN(2)] ^= byte(1 + r.IntN(255))
				}
			}
			check(t, fmt.Sprintf("%d elements, %g changed", n, frac), a, b)
		}
	}
}
