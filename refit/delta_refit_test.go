package refit

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// perturbDir writes a copy of the model in dir with about frac of the
// elements of each tensor matching re (every tensor if nil) changed.
func perturbDir(t testing.TB, dir string, seed uint64, frac float64, re *regexp.Regexp) string {
	t.Helper()
	f, err := stfile.Open(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := rand.New(rand.NewPCG(seed, seed+1))
	var out []stfile.Tensor
	for _, n := range f.Names() {
		tn, err := f.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		if re == nil || re.MatchString(n) {
			tn.Data = perturb(r, tn.Data, frac)
		}
		out = append(out, tn)
	}
	next := t.TempDir()
	if err := stfile.Write(filepath.Join(next, "model.safetensors"), out, nil); err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(next, "config.json"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	return next
}

// deltaOf returns the stream of the delta of next on base (model
// directories), and its statistics.
func deltaOf(t testing.TB, next, base string) ([]byte, DeltaStats) {
	t.Helper()
	d, err := OpenDelta(next, base, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	b, err := io.ReadAll(io.NewSectionReader(d, 0, d.Size()))
	if err != nil {
		t.Fatal(err)
	}
	return b, d.Stats()
}

func publishDelta(t *testing.T, p *Publisher, v, base uint64, stream []byte) {
	t.Helper()
	if _, err := p.PublishDelta(context.Background(), v, base, bytes.NewReader(stream), int64(len(stream))); err != nil {
		t.Fatalf("publish delta version %d on %d: %v", v, base, err)
	}
}

// checkServes checks that the worker's resident BF16 weights are byte for
// byte the checkpoint in dir and that it generates what a fresh worker
// loaded with dir does.
func checkServes(t *testing.T, what string, w *worker, dir string, recipe moe.Recipe) {
	t.Helper()
	residentEquals(t, what, w.m, dir)
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, dir, recipe)
	sameRollouts(t, what+" vs fresh", gotS, gotSc, wantS, wantSc)
}

// TestRefitDelta: full, partial, delta and delta-after-delta versions in a
// row; after each, the worker's resident BF16 weights are bit for bit the
// version's checkpoint and it generates exactly what a fresh worker loaded
// with that checkpoint does (so the touched NVFP4 experts were
// requantized), under the per_token and the bf16 recipes (the latter
// stages every delta tensor: the served tensor is copied into staging,
// patched, and copied back at the commit). A delta that changes one
// element of one expert touches that expert's layer only (which experts a
// delta marks for requantization: TestMarkExperts, TestRefitDeltaFused).
func TestRefitDelta(t *testing.T) {
	for _, recipe := range []moe.Recipe{moe.RecipePerToken, moe.RecipeBF16} {
		t.Run(string(recipe), func(t *testing.T) {
			srv := refittest.StartServer(t)
			// Chunks of an odd size, so that records are split across them
			// at every kind of place.
			p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: 999}, nil)
			if err != nil {
				t.Fatal(err)
			}
			a := modelDir(t, 51)
			w := startWorker(t, srv.URL(), a, "w", recipe, nil)
			b := perturbDir(t, a, 1, 0.3, nil)
			publish(t, p, 1, subset(t, b, nil), true)
			if st := w.waitStatus(t, 1); st.State != StateApplied {
				t.Fatalf("full version: %+v", st)
			}
			checkServes(t, "full version", w, b, recipe)

			c := perturbDir(t, b, 2, 0.5, experts)
			publish(t, p, 2, subset(t, c, experts), false)
			if st := w.waitStatus(t, 2); st.State != StateApplied {
				t.Fatalf("partial version: %+v", st)
			}
			checkServes(t, "partial version", w, c, recipe)

			prev := c
			for i, frac := range []float64{0.01, 0.2} {
				v := uint64(3 + i)
				next := perturbDir(t, prev, uint64(10+i), frac, nil)
				stream, stats := deltaOf(t, next, prev)
				t.Logf("delta version %d, %.0f%% changed: %d of %d bytes a full version takes (%d of %d tensors, %d as deltas)",
					v, 100*frac, stats.Bytes, stats.FullBytes, stats.Changed, stats.Tensors, stats.DeltaTensors)
				if stats.DeltaTensors == 0 || stats.Bytes >= stats.FullBytes {
					t.Fatalf("delta of %.0f%%: %+v", 100*frac, stats)
				}
				publishDelta(t, p, v, v-1, stream)
				st := w.waitStatus(t, v)
				if st.State != StateApplied || st.Bytes != int64(len(stream)) {
					t.Fatalf("delta version %d: %+v", v, st)
				}
				checkServes(t, fmt.Sprintf("delta version %d", v), w, next, recipe)
				prev = next
			}

			// One element of one expert: its layer alone is listed.
			one := perturbDir(t, prev, 20, 1e-9, regexp.MustCompile(`^model\.layers\.1\.mlp\.experts\.5\.down_proj\.`))
			stream, stats := deltaOf(t, one, prev)
			if stats.Changed != 1 || stats.ChangedElements != 1 {
				t.Fatalf("one element changed: %+v", stats)
			}
			publishDelta(t, p, 5, 4, stream)
			st := w.waitStatus(t, 5)
			if st.State != StateApplied || len(st.Layers) != 1 || st.Layers[0].Layer != 1 {
				t.Fatalf("one element: %+v", st)
			}
			checkServes(t, "one element", w, one, recipe)
		})
	}
}

// TestRefitDeltaSmall: on the small preset, whose embedding and head span
// 16 regions each, deltas of 1% and 20% apply bit for bit.
func TestRefitDeltaSmall(t *testing.T) {
	cfg, err := policy.Preset("small")
	if err != nil {
		t.Fatal(err)
	}
	a := t.TempDir()
	if err := policy.WriteRandomModel(a, cfg, 55); err != nil {
		t.Fatal(err)
	}
	srv := refittest.StartServer(t)
	p := newPublisher(t, srv.URL())
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	prev := a
	for i, frac := range []float64{0.01, 0.2} {
		v := uint64(1 + i)
		next := perturbDir(t, prev, uint64(30+i), frac, nil)
		stream, _ := deltaOf(t, next, prev)
		publishDelta(t, p, v, v-1, stream)
		if st := w.waitStatus(t, v); st.State != StateApplied {
			t.Fatalf("delta version %d: %+v", v, st)
		}
		checkServes(t, fmt.Sprintf("delta version %d", v), w, next, moe.RecipePerToken)
		prev = next
	}
}

// TestRefitDeltaFused: a delta on a fused expert tensor (every expert of a
// layer in one tensor, several experts to a region), changing two of its
// experts (so only those are requantized), leaves the worker bit for bit
// where the whole fused tensor does (which requantizes all of them): the
// same stack, the same rollouts.
func TestRefitDeltaFused(t *testing.T) {
	a := modelDir(t, 52)
	srvD, srvW := refittest.StartServer(t), refittest.StartServer(t)
	wd := startWorker(t, srvD.URL(), a, "delta", moe.RecipePerToken, nil)
	ww := startWorker(t, srvW.URL(), a, "whole", moe.RecipePerToken, nil)
	const name = "model.layers.0.mlp.experts.down_proj"
	tg, err := wd.m.Resolve(name)
	if err != nil {
		t.Fatal(err)
	}
	old := make([]byte, tg.Size())
	if err := wd.m.Backend().Download(old, tg.Buffer, tg.Offset); err != nil {
		t.Fatal(err)
	}
	// Experts 2 and 5 of 8 change, a few elements each; one region holds
	// them all.
	per := len(old) / 2 / 8
	new := slices.Clone(old)
	for _, i := range []int{2*per + 3, 2*per + 100, 5*per + per - 1} {
		new[2*i] ^= 0x10
	}
	shape := make([]uint64, len(tg.Shape))
	for i, d := range tg.Shape {
		shape[i] = uint64(d)
	}
	enc := encodeDeltaTensor(old, new)
	head, err := versionHeader([]headerOut{{name: name, dtype: DeltaDType, shape: shape, size: int64(len(enc))}})
	if err != nil {
		t.Fatal(err)
	}
	rawPublish(t, srvD.URL(), 1, append(head, enc...), false, 0, 4096, -1, nil)
	rawPublish(t, srvW.URL(), 1, streamOf(t, []stfile.Tensor{{Name: name, DType: stfile.BF16, Shape: shape, Data: new}}), false, 0, 4096, -1, nil)
	for _, w := range []*worker{wd, ww} {
		if st := w.waitStatus(t, 1); st.State != StateApplied {
			t.Fatalf("%s: %+v", w.r.cfg.Worker, st)
		}
		tg, err := w.m.Resolve(name)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, tg.Size())
		if err := w.m.Backend().Download(got, tg.Buffer, tg.Offset); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, new) {
			t.Fatalf("%s: the fused stack is not the new tensor", w.r.cfg.Worker)
		}
	}
	gotS, gotSc := rollouts(t, wd.e)
	wantS, wantSc := rollouts(t, ww.e)
	sameRollouts(t, "fused delta vs the whole fused tensor", gotS, gotSc, wantS, wantSc)
}

// TestRefitDeltaRejections: a delta on a base the worker does not serve is
// answered needs_full; a corrupted chunk, a malformed record, a NaN value
// and a full version holding delta tensors are rejected, and the worker
// keeps serving its version; a delta after a rejection that wrote into the
// stacks in place is needs_full too (a delta patches what the stacks hold,
// so it cannot clean them); a full version then recovers, and deltas apply
// again.
func TestRefitDeltaRejections(t *testing.T) {
	srv := refittest.StartServer(t)
	a := modelDir(t, 53)
	b := perturbDir(t, a, 3, 0.3, nil)
	c := perturbDir(t, b, 4, 0.05, nil)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(c *ReceiverConfig) { c.ChunkTimeout = 500 * time.Millisecond })
	publish(t, newPublisher(t, srv.URL()), 1, subset(t, b, nil), true)
	if st := w.waitStatus(t, 1); st.State != StateApplied {
		t.Fatalf("full version: %+v", st)
	}
	delta, _ := deltaOf(t, c, b)
	hdr, err := ParseHeader(delta[8:8+binary.LittleEndian.Uint64(delta)], int64(len(delta)))
	if err != nil {
		t.Fatal(err)
	}
	// The first delta tensor of an expert (written in place), and the
	// stream offset of its first record with a change.
	var first TensorInfo
	for _, ti := range hdr.Tensors {
		if ti.DType == DeltaDType && experts.MatchString(ti.Name) {
			first = ti
			break
		}
	}
	recAt := hdr.DataStart() + first.Begin
	for binary.LittleEndian.Uint32(delta[recAt+4:]) == 0 {
		recAt += deltaRecordHeader
	}
	size, err := deltaRecordLen(delta[recAt:], DeltaRegionElems)
	if err != nil {
		t.Fatal(err)
	}
	edit := func(f func(b []byte)) []byte {
		b := slices.Clone(delta)
		f(b)
		return b
	}
	servesB := func(t *testing.T) {
		gotS, gotSc := rollouts(t, w.e)
		wantS, wantSc := fresh(t, b, moe.RecipePerToken)
		sameRollouts(t, "after a version not applied, the worker still serves version 1", gotS, gotSc, wantS, wantSc)
	}
	v := uint64(1)
	for _, tc := range []struct {
		name  string
		pub   func(v uint64)
		state string
		want  string
	}{
		{"delta on another base", func(v uint64) { rawPublish(t, srv.URL(), v, delta, false, 0, 4096, -1, nil) },
			StateNeedsFull, "is a delta on version 0, this worker serves 1"},
		{"malformed record", func(v uint64) {
			rawPublish(t, srv.URL(), v, edit(func(b []byte) { b[recAt] = 7 }), false, 1, 4096, -1, nil)
		}, StateRejected, "form 7"},
		{"index out of order", func(v uint64) {
			bad := edit(func(b []byte) {
				if b[recAt] == DeltaIndexList && binary.LittleEndian.Uint32(b[recAt+4:]) > 1 {
					copy(b[recAt+10:recAt+12], b[recAt+8:recAt+10])
				} else { // a bitmap: one bit fewer than its count
					for i := recAt + 8; ; i++ {
						if b[i] != 0 {
							b[i] &= b[i] - 1
							break
						}
					}
				}
			})
			rawPublish(t, srv.URL(), v, bad, false, 1, 4096, -1, nil)
		}, StateRejected, "protocol error"},
		{"NaN value", func(v uint64) {
			rawPublish(t, srv.URL(), v, edit(func(b []byte) { binary.LittleEndian.PutUint16(b[recAt+int64(size)-2:], 0x7fc1) }), false, 1, 4096, -1, nil)
		}, StateRejected, "NaN or Inf"},
		{"announced full", func(v uint64) { rawPublish(t, srv.URL(), v, delta, true, 0, 4096, -1, nil) },
			StateRejected, "delta tensors"},
		// Last: the chunks before it wrote expert records in place.
		{"corrupted chunk", func(v uint64) {
			rawPublish(t, srv.URL(), v, delta, false, 1, 4096, -1, func(seq int, h nats.Header, d []byte) []byte {
				if seq == len(delta)/4096-1 {
					d[100] ^= 0x40
				}
				return d
			})
		}, StateRejected, "crc32c"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v++
			tc.pub(v)
			st := w.waitStatus(t, v)
			if st.State != tc.state || !strings.Contains(st.Reason, tc.want) {
				t.Fatalf("status %+v, want %s mentioning %q", st, tc.state, tc.want)
			}
			if st.CurrentVersion != 1 {
				t.Fatalf("serving version %d, want 1", st.CurrentVersion)
			}
			if tc.name != "corrupted chunk" && len(w.r.dirty) > 0 {
				t.Fatalf("%d ranges dirty: the version was refused before any expert element changed", len(w.r.dirty))
			}
			servesB(t)
		})
	}
	if len(w.r.dirty) == 0 {
		t.Fatal("no dirty ranges after deltas rejected mid-stream")
	}
	// The stacks hold bytes of rejected deltas: a delta cannot be applied
	// on them...
	v++
	rawPublish(t, srv.URL(), v, delta, false, 1, 4096, -1, nil)
	if st := w.waitStatus(t, v); st.State != StateNeedsFull || !strings.Contains(st.Reason, "left dirty") {
		t.Fatalf("a delta over dirty stacks: %+v, want needs_full", st)
	}
	servesB(t)
	// ...a full version can, and deltas apply again after it.
	v++
	rawPublish(t, srv.URL(), v, subset(t, c, nil), true, 0, 4096, -1, nil)
	if st := w.waitStatus(t, v); st.State != StateApplied {
		t.Fatalf("full version: %+v", st)
	}
	d := perturbDir(t, c, 5, 0.02, nil)
	dd, _ := deltaOf(t, d, c)
	v++
	rawPublish(t, srv.URL(), v, dd, false, v-1, 4096, -1, nil)
	if st := w.waitStatus(t, v); st.State != StateApplied {
		t.Fatalf("delta after the full version: %+v", st)
	}
	checkServes(t, "delta after recovering", w, d, moe.RecipePerToken)
}

// TestPublishDelta: a delta stream goes out only through PublishDelta, on
// exactly the newest version published; NewestVersion names that version.
func TestPublishDelta(t *testing.T) {
	srv := refittest.StartServer(t)
	p := newPublisher(t, srv.URL())
	ctx := context.Background()
	a := modelDir(t, 54)
	b := perturbDir(t, a, 6, 0.05, nil)
	if v, err := p.NewestVersion(ctx); err != nil || v != 0 {
		t.Fatalf("newest version before any: %d, %v", v, err)
	}
	publish(t, p, 1, subset(t, a, nil), true)
	if v, err := p.NewestVersion(ctx); err != nil || v != 1 {
		t.Fatalf("newest version: %d, %v", v, err)
	}
	stream, _ := deltaOf(t, b, a)
	if _, err := p.Publish(ctx, 2, bytes.NewReader(stream), int64(len(stream)), false); err == nil || !strings.Contains(err.Error(), "PublishDelta") {
		t.Fatalf("Publish of delta tensors: %v", err)
	}
	if _, err := p.PublishDelta(ctx, 2, 0, bytes.NewReader(stream), int64(len(stream))); err == nil || !strings.Contains(err.Error(), "the newest version published is 1") {
		t.Fatalf("PublishDelta on the wrong base: %v", err)
	}
	m, err := p.PublishDelta(ctx, 2, 1, bytes.NewReader(stream), int64(len(stream)))
	if err != nil || m.Full || m.Base != 1 {
		t.Fatalf("PublishDelta: %+v, %v", m, err)
	}
}

// TestDeltaSourceReadAt: a delta stream read at any offsets, in any
// pieces, concurrently, is the same bytes; its header lists the changed
// tensors only, each a delta tensor where that is smaller.
func TestDeltaSourceReadAt(t *testing.T) {
	dir := t.TempDir()
	r := rand.New(rand.NewPCG(9, 9))
	mk := func(n int) []byte { return perturb(r, make([]byte, 2*n), 1) }
	base := []stfile.Tensor{
		{Name: "a.big", DType: stfile.BF16, Shape: []uint64{3, 70001}, Data: mk(3 * 70001)},
		{Name: "b.same", DType: stfile.BF16, Shape: []uint64{100}, Data: mk(100)},
		{Name: "c.all", DType: stfile.BF16, Shape: []uint64{1000}, Data: mk(1000)},
		{Name: "d.empty", DType: stfile.BF16, Shape: []uint64{0}, Data: []byte{}},
	}
	next := []stfile.Tensor{base[0], base[1], base[2], base[3]}
	next[0].Data = perturb(r, base[0].Data, 0.03)
	next[2].Data = perturb(r, base[2].Data, 1)
	bp, np := filepath.Join(dir, "base.safetensors"), filepath.Join(dir, "next.safetensors")
	if err := stfile.Write(bp, base, nil); err != nil {
		t.Fatal(err)
	}
	if err := stfile.Write(np, next, nil); err != nil {
		t.Fatal(err)
	}
	d, err := OpenDelta(np, bp, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	want, err := io.ReadAll(io.NewSectionReader(d, 0, d.Size()))
	if err != nil {
		t.Fatal(err)
	}
	h, _, err := readHeader(bytes.NewReader(want), int64(len(want)))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ti := range h.Tensors {
		got = append(got, ti.Name+":"+ti.DType)
	}
	if w := []string{"a.big:" + DeltaDType, "c.all:BF16"}; !slices.Equal(got, w) {
		t.Fatalf("tensors %v, want %v", got, w)
	}
	if st := d.Stats(); st.Tensors != 4 || st.Changed != 2 || st.DeltaTensors != 1 || st.Bytes != int64(len(want)) {
		t.Fatalf("stats %+v", st)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for range 200 {
				off := r.Int64N(int64(len(want)))
				p := make([]byte, 1+r.IntN(min(len(want)-int(off), 300000)))
				if n, err := d.ReadAt(p, off); n != len(p) || err != nil || !bytes.Equal(p, want[off:off+int64(n)]) {
					t.Errorf("ReadAt(%d bytes at %d): %d, %v, or other bytes", len(p), off, n, err)
					return
				}
			}
		})
	}
	wg.Wait()
	// And it decodes to the new checkpoint.
	for _, ti := range h.Tensors {
		if ti.DType != DeltaDType {
			continue
		}
		dec, err := decodeDelta(base[0].Data, want[h.DataStart()+ti.Begin:h.DataStart()+ti.End])
		if err != nil || !bytes.Equal(dec, next[0].Data) {
			t.Fatalf("%s decodes to other bytes (%v)", ti.Name, err)
		}
	}
}

// TestDeltaSize reports what a delta version takes against a full one with
// 1%, 5% and 20% of the elements changed at random, over 8 tensors of 2^20
// elements (16 MiB of BF16): about 4 bytes a changed element while index
// lists are smaller (below 1/16 changed), then 1 bit an element and 2
// bytes a changed one.
func TestDeltaSize(t *testing.T) {
	dir := t.TempDir()
	r := rand.New(rand.NewPCG(11, 12))
	var base []stfile.Tensor
	for i := range 8 {
		base = append(base, stfile.Tensor{Name: fmt.Sprintf("model.layers.%d.w", i), DType: stfile.BF16, Shape: []uint64{1024, 1024},
			Data: perturb(r, make([]byte, 2<<20), 1)})
	}
	bp := filepath.Join(dir, "base.safetensors")
	if err := stfile.Write(bp, base, nil); err != nil {
		t.Fatal(err)
	}
	for _, frac := range []float64{0.01, 0.05, 0.2} {
		next := slices.Clone(base)
		for i := range next {
			next[i].Data = perturb(r, base[i].Data, frac)
		}
		np := filepath.Join(dir, fmt.Sprintf("next%v.safetensors", frac))
		if err := stfile.Write(np, next, nil); err != nil {
			t.Fatal(err)
		}
		d, err := OpenDelta(np, bp, nil)
		if err != nil {
			t.Fatal(err)
		}
		st := d.Stats()
		d.Close()
		perElem := min(4*frac, 1.0/8+2*frac) // bytes an element, records' headers aside
		want := float64(st.Elements) * perElem
		t.Logf("%4.0f%% changed: delta %9d bytes, full %9d bytes: %5.2f%% of the full version (%d of %d elements changed)",
			100*frac, st.Bytes, st.FullBytes, 100*float64(st.Bytes)/float64(st.FullBytes), st.ChangedElements, st.Elements)
		if got := float64(st.Bytes); got < 0.95*want || got > 1.05*want+float64(st.FullBytes-2*st.Elements)+float64(8*st.Elements/DeltaRegionElems) {
			t.Errorf("%.0f%% changed: %d bytes, want about %.0f", 100*frac, st.Bytes, want)
		}
	}
}
