package refit

import (
	"bytes"
	"encoding/binary"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

func TestParseSyntheticSpec(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want SyntheticSpec
		err  string
	}{
		{spec: "synthetic:tiny", want: SyntheticSpec{Preset: "tiny", Seed: 1}},
		{spec: "synthetic:qwen3-30b-a3b?layers=8&seed=7&steps=0.01,0.05",
			want: SyntheticSpec{Preset: "qwen3-30b-a3b", Layers: 8, Seed: 7, Steps: []float64{0.01, 0.05}}},
		{spec: "synthetic:tiny?steps=1", want: SyntheticSpec{Preset: "tiny", Seed: 1, Steps: []float64{1}}},
		{spec: "tiny", err: `want the prefix "synthetic:"`},
		{spec: "synthetic:nope", err: `unknown preset "nope"`},
		{spec: "synthetic:tiny?layers=3", err: "3 layers, want 1 to 2"},
		{spec: "synthetic:tiny?layers=-1", err: "layers \"-1\""},
		{spec: "synthetic:tiny?seed=x", err: `seed "x"`},
		{spec: "synthetic:tiny?steps=0.1,1.5", err: `steps: "1.5" is not a fraction`},
		{spec: "synthetic:tiny?steps=0.1,,0.2", err: `steps: "" is not a fraction`},
		{spec: "synthetic:tiny?step=0.1", err: `unknown parameter "step"`},
		{spec: "synthetic:tiny?seed=1&seed=2", err: "seed given 2 times"},
		{spec: "synthetic:tiny?%zz", err: "invalid URL escape"},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			got, err := ParseSyntheticSpec(tc.spec)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Preset != tc.want.Preset || got.Layers != tc.want.Layers || got.Seed != tc.want.Seed || !slices.Equal(got.Steps, tc.want.Steps) {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
			again, err := ParseSyntheticSpec(got.String())
			if err != nil || again.String() != got.String() {
				t.Fatalf("%q does not read back: %+v, %v", got.String(), again, err)
			}
		})
	}
}

// readSource reads a source's whole stream.
func readSource(t testing.TB, s interface {
	io.ReaderAt
	Size() int64
}) []byte {
	t.Helper()
	b, err := io.ReadAll(io.NewSectionReader(s, 0, s.Size()))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSyntheticSource: a synthetic checkpoint holds the preset's tensors
// (the depth cut as asked), reads the same at any offsets and on every
// open, holds only finite values, and differs from its base by the
// fraction of elements its last step names.
func TestSyntheticSource(t *testing.T) {
	cfg, err := policy.PresetLayers("qwen3-30b-a3b", 1)
	if err != nil {
		t.Fatal(err)
	}
	// Layer 0's attention and two of its experts: the real shapes, a
	// few tens of megabytes.
	only := regexp.MustCompile(`^model\.layers\.0\.(self_attn|mlp\.experts\.[01]\.)`)
	src, err := OpenSource("synthetic:qwen3-30b-a3b?layers=1&seed=3", only)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	var want []string
	var dataBytes int64
	for _, ts := range policy.CheckpointTensors(cfg) {
		if only.MatchString(ts.Name) {
			want = append(want, ts.Name)
			n := int64(2)
			for _, d := range ts.Shape {
				n *= int64(d)
			}
			dataBytes += n
		}
	}
	slices.SortFunc(want, naturalCompare)
	if !slices.Equal(src.Names(), want) || src.Full() || len(want) != 12 {
		t.Fatalf("names %q (full %v), want %q", src.Names(), src.Full(), want)
	}
	all := readSource(t, src)
	hlen := binary.LittleEndian.Uint64(all)
	h, err := ParseHeader(all[8:8+hlen], int64(len(all)))
	if err != nil {
		t.Fatal(err)
	}
	if len(h.Tensors) != len(want) || int64(len(all))-h.DataStart() != dataBytes {
		t.Fatalf("header holds %d tensors, %d data bytes; want %d, %d", len(h.Tensors), int64(len(all))-h.DataStart(), len(want), dataBytes)
	}
	data := all[8+hlen:]
	for i := 0; i+1 < len(data); i += 2 {
		if bad(data[i], data[i+1]) {
			t.Fatalf("value at data byte %d is NaN or Inf", i)
		}
	}
	for _, at := range []struct{ off, n int64 }{{0, 5}, {3, 1 << 20}, {int64(len(all)) - 9, 9}, {int64(len(all)) / 3, 12345}} {
		p := make([]byte, at.n)
		if _, err := src.ReadAt(p, at.off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(p, all[at.off:at.off+at.n]) {
			t.Fatalf("%d bytes at %d differ from the whole read", at.n, at.off)
		}
	}
	// The bytes a tensor lends in place (the delta encoder's view) are
	// those read, where they wrap around the block too (read then).
	for i, ti := range src.tensors {
		n := min(ti.size, 2*DeltaRegionElems)
		for _, at := range []int64{0, 2 * 12345, ti.size - n, syntheticBlockBytes - ti.r.(*blockReader).salt - 64} {
			at = min(max(at, 0), ti.size-n)
			p := make([]byte, n)
			v, err := src.viewTensor(i, p, at)
			if err != nil {
				t.Fatal(err)
			}
			if err := src.readTensor(i, p, at); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(v, p) {
				t.Fatalf("tensor %s: the view at %d differs from the read", ti.name, at)
			}
		}
	}
	again, err := OpenSource("synthetic:qwen3-30b-a3b?layers=1&seed=3", only)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if !bytes.Equal(readSource(t, again), all) {
		t.Fatal("a second open reads other bytes")
	}

	for _, tc := range []struct {
		next, base string
		frac       float64
	}{
		{"synthetic:tiny?seed=3&steps=0.05", "synthetic:tiny?seed=3", 0.05},
		{"synthetic:tiny?seed=3&steps=0.01,0.2", "synthetic:tiny?seed=3&steps=0.01", 0.2},
		{"synthetic:tiny?seed=3&steps=0", "synthetic:tiny?seed=3", 0},
	} {
		d, err := OpenDelta(tc.next, tc.base, nil)
		if err != nil {
			t.Fatal(err)
		}
		st := d.Stats()
		d.Close()
		got := float64(st.ChangedElements) / float64(st.Elements)
		if got < tc.frac*0.9 || got > tc.frac*1.1 {
			t.Errorf("%s on %s: %.4f of the elements changed, want %.2f", tc.next, tc.base, got, tc.frac)
		}
	}
}

// TestRefitSynthetic: a worker applies a full synthetic version and a
// delta on it, bit for bit the checkpoints they stand for.
func TestRefitSynthetic(t *testing.T) {
	srv := refittest.StartServer(t)
	p := newPublisher(t, srv.URL())
	a := modelDir(t, 61)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	// asDir writes a synthetic checkpoint's stream as a model directory
	// next to a's config.
	asDir := func(spec string) string {
		src, err := OpenSource(spec, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer src.Close()
		dir := t.TempDir()
		cfg, err := os.ReadFile(filepath.Join(a, "config.json"))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "model.safetensors"), readSource(t, src), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	full, err := OpenSource("synthetic:tiny?seed=9", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer full.Close()
	publish(t, p, 1, readSource(t, full), true)
	if st := w.waitStatus(t, 1); st.State != StateApplied {
		t.Fatalf("full synthetic version: %+v", st)
	}
	residentEquals(t, "full synthetic version", w.m, asDir("synthetic:tiny?seed=9"))

	d, err := OpenDelta("synthetic:tiny?seed=9&steps=0.05", "synthetic:tiny?seed=9", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if st := d.Stats(); st.DeltaTensors == 0 {
		t.Fatalf("a 5%% synthetic step sends no delta tensors: %+v", st)
	}
	publishDelta(t, p, 2, 1, readSource(t, d))
	if st := w.waitStatus(t, 2); st.State != StateApplied {
		t.Fatalf("synthetic delta version: %+v", st)
	}
	residentEquals(t, "synthetic delta version", w.m, asDir("synthetic:tiny?seed=9&steps=0.05"))
}

// BenchmarkDeltaRead reads a delta stream in 1 MiB chunks, one after the
// other, as the publisher does: one layer of Qwen3-30B-A3B's shapes (1.2
// GB a side), 1% and 5% of the elements changed. MB/s is of the checkpoint
// bytes the delta stands for.
func BenchmarkDeltaRead(b *testing.B) {
	for _, step := range []string{"0.01", "0.05"} {
		b.Run("changed="+step, func(b *testing.B) {
			d, err := OpenDelta("synthetic:qwen3-30b-a3b?layers=1&steps="+step, "synthetic:qwen3-30b-a3b?layers=1", regexp.MustCompile(`^model\.layers\.0\.`))
			if err != nil {
				b.Fatal(err)
			}
			defer d.Close()
			b.SetBytes(d.Stats().FullBytes)
			buf := make([]byte, 1<<20)
			for b.Loop() {
				for off := int64(0); off < d.Size(); off += int64(len(buf)) {
					if _, err := d.ReadAt(buf[:min(int64(len(buf)), d.Size()-off)], off); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
