package refit

import (
	"bytes"
	"encoding/json"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
)

// stTensors is a small checkpoint: BF16 tensors of several layers (names
// whose natural and byte orders differ), a scalar and an empty tensor.
func stTensors() []stfile.Tensor {
	return []stfile.Tensor{
		ptTensor("model.layers.10.mlp.experts.0.down_proj.weight", stfile.BF16, 1, 8, 4),
		ptTensor("model.layers.2.mlp.experts.0.down_proj.weight", stfile.BF16, 2, 8, 4),
		ptTensor("model.layers.2.mlp.experts.1.down_proj.weight", stfile.BF16, 3, 8, 4),
		ptTensor("model.layers.2.input_layernorm.weight", stfile.BF16, 4, 8),
		ptTensor("model.norm.weight", stfile.BF16, 5, 8),
		ptTensor("lm_head.scalar", stfile.BF16, 6),
		ptTensor("model.empty", stfile.BF16, 7, 0, 4),
	}
}

// stRead returns all of s's bytes.
func stRead(t *testing.T, s *Source) []byte {
	t.Helper()
	b, err := io.ReadAll(io.NewSectionReader(s, 0, s.Size()))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// stCheck checks that stream is a valid version stream of exactly the
// named tensors of want, in natural name order.
func stCheck(t *testing.T, stream []byte, want []stfile.Tensor, names ...string) {
	t.Helper()
	h, _, err := readHeader(bytes.NewReader(stream), int64(len(stream)))
	if err != nil {
		t.Fatal(err)
	}
	if h.DataStart()%8 != 0 {
		t.Errorf("data starts at %d, not 8-aligned", h.DataStart())
	}
	byName := map[string]stfile.Tensor{}
	for _, w := range want {
		byName[w.Name] = w
	}
	var got []string
	for _, ti := range h.Tensors {
		got = append(got, ti.Name)
		w := byName[ti.Name]
		if !slices.Equal(ti.Shape, toInts(w.Shape)) || ti.DType != "BF16" {
			t.Errorf("tensor %s: %s%v, want BF16%v", ti.Name, ti.DType, ti.Shape, w.Shape)
		}
		if data := stream[h.DataStart()+ti.Begin : h.DataStart()+ti.End]; !bytes.Equal(data, w.Data) {
			t.Errorf("tensor %s: data differs", ti.Name)
		}
	}
	if !slices.Equal(got, names) {
		t.Errorf("tensors in data order %q, want %q", got, names)
	}
}

func toInts(s []uint64) []int {
	out := make([]int, len(s))
	for i, d := range s {
		out[i] = int(d)
	}
	return out
}

var stAllNames = []string{
	"lm_head.scalar",
	"model.empty",
	"model.layers.2.input_layernorm.weight",
	"model.layers.2.mlp.experts.0.down_proj.weight",
	"model.layers.2.mlp.experts.1.down_proj.weight",
	"model.layers.10.mlp.experts.0.down_proj.weight",
	"model.norm.weight",
}

func TestOpenSourceFile(t *testing.T) {
	want := stTensors()
	path := filepath.Join(t.TempDir(), "ckpt.safetensors")
	if err := stfile.Write(path, want, map[string]string{"format": "pt"}); err != nil {
		t.Fatal(err)
	}
	s, err := OpenSource(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !s.Full() || !slices.Equal(s.Names(), stAllNames) {
		t.Errorf("full %v, names %q", s.Full(), s.Names())
	}
	stream := stRead(t, s)
	stCheck(t, stream, want, stAllNames...)

	// ReadAt anywhere, of any length, agrees with the whole.
	rng := rand.New(rand.NewPCG(1, 2))
	for range 500 {
		off := rng.Int64N(s.Size() + 10)
		p := make([]byte, rng.IntN(300))
		n, err := s.ReadAt(p, off)
		end := min(off+int64(len(p)), s.Size())
		if wantN := max(end-off, 0); int64(n) != wantN || !bytes.Equal(p[:n], stream[min(off, s.Size()):end]) {
			t.Fatalf("ReadAt(%d bytes at %d) = %d, %v", len(p), off, n, err)
		}
		if (n < len(p)) != (err == io.EOF) {
			t.Fatalf("ReadAt(%d bytes at %d) = %d, %v", len(p), off, n, err)
		}
	}
	if _, err := s.ReadAt(make([]byte, 1), -1); err == nil {
		t.Error("negative offset: no error")
	}

	// --only: a partial version, or a full one when it matches everything.
	part, err := OpenSource(path, regexp.MustCompile(`layers\.2\.mlp`))
	if err != nil {
		t.Fatal(err)
	}
	defer part.Close()
	if part.Full() {
		t.Error("a subset is full")
	}
	stCheck(t, stRead(t, part), want, stAllNames[3:5]...)
	all, err := OpenSource(path, regexp.MustCompile(`.`))
	if err != nil {
		t.Fatal(err)
	}
	if !all.Full() || !bytes.Equal(stRead(t, all), stream) {
		t.Error("--only matching every tensor differs from no --only")
	}
	if err := all.Close(); err != nil {
		t.Fatal(err)
	}
	if err := all.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
	if _, err := all.ReadAt(make([]byte, 1), 0); err == nil {
		t.Error("read after close: no error")
	}
}

func TestOpenSourceDirectory(t *testing.T) {
	want := stTensors()
	// model.safetensors
	dir := t.TempDir()
	ptFile(t, dir, want...)
	s, err := OpenSource(dir, regexp.MustCompile(`^model\.norm`))
	if err != nil {
		t.Fatal(err)
	}
	stCheck(t, stRead(t, s), want, "model.norm.weight")
	s.Close()

	// Shards and their index.
	dir = t.TempDir()
	shards := map[string][]stfile.Tensor{"model-00001-of-00002.safetensors": want[:3], "model-00002-of-00002.safetensors": want[3:]}
	weightMap := map[string]string{}
	for file, ts := range shards {
		if err := stfile.Write(filepath.Join(dir, file), ts, nil); err != nil {
			t.Fatal(err)
		}
		for _, ts := range ts {
			weightMap[ts.Name] = file
		}
	}
	index, _ := json.Marshal(map[string]any{"metadata": map[string]any{"total_size": 1}, "weight_map": weightMap})
	if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), index, 0o644); err != nil {
		t.Fatal(err)
	}
	s, err = OpenSource(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !s.Full() {
		t.Error("not full")
	}
	stCheck(t, stRead(t, s), want, stAllNames...)
}

func TestOpenSourceRejects(t *testing.T) {
	mixed := append(stTensors(), ptTensor("model.layers.1.scale", stfile.F32, 1, 4), ptTensor("model.layers.0.idx", stfile.I64, 2, 2))
	mixedPath := ptFile(t, t.TempDir(), mixed...)
	emptyDir := t.TempDir()
	badIndex := t.TempDir()
	os.WriteFile(filepath.Join(badIndex, "model.safetensors.index.json"), []byte(`{"weight_map":{"a":"../x.safetensors"}}`), 0o644)
	lying := t.TempDir()
	ptFile(t, lying, stTensors()...)
	os.Rename(filepath.Join(lying, "model.safetensors"), filepath.Join(lying, "shard.safetensors"))
	os.WriteFile(filepath.Join(lying, "model.safetensors.index.json"), []byte(`{"weight_map":{"ghost":"shard.safetensors"}}`), 0o644)
	noMap := t.TempDir()
	os.WriteFile(filepath.Join(noMap, "model.safetensors.index.json"), []byte(`{}`), 0o644)
	garbage := filepath.Join(t.TempDir(), "garbage.safetensors")
	os.WriteFile(garbage, []byte("not safetensors"), 0o644)

	tests := []struct {
		name, path string
		only       string
		want       []string
	}{
		{"missing", filepath.Join(emptyDir, "nope.safetensors"), "", []string{"no such file"}},
		{"empty dir", emptyDir, "", []string{"no model.safetensors or model.safetensors.index.json"}},
		{"garbage", garbage, "", []string{"garbage.safetensors", "malformed"}},
		{"shard outside", badIndex, "", []string{`shard "../x.safetensors" is not a file in the model directory`}},
		{"index lies", lying, "", []string{"lists ghost in shard.safetensors"}},
		{"no weight map", noMap, "", []string{"empty or missing weight_map"}},
		{"not BF16", mixedPath, "", []string{"2 selected tensors are not BF16", "model.layers.0.idx (I64), model.layers.1.scale (F32)"}},
		{"not BF16 selected", mixedPath, `scale`, []string{"1 selected tensors are not BF16", "model.layers.1.scale (F32)"}},
		{"no match", mixedPath, `^nothing`, []string{`no tensor name matches "^nothing" (of 9 tensors)`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var re *regexp.Regexp
			if tc.only != "" {
				re = regexp.MustCompile(tc.only)
			}
			s, err := OpenSource(tc.path, re)
			if err == nil {
				s.Close()
				t.Fatal("no error")
			}
			if !strings.HasPrefix(err.Error(), "refit: source "+tc.path+": ") {
				t.Errorf("error %q does not name the source", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
	// BF16 tensors next to others are fine when --only leaves those out.
	s, err := OpenSource(mixedPath, regexp.MustCompile(`weight`))
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
}

func TestNaturalCompare(t *testing.T) {
	want := []string{"a", "a0", "a1", "a01", "a2", "a2b", "a10", "a10.1", "a10.2", "a10.10", "b", "b1c"}
	got := slices.Clone(want)
	rand.New(rand.NewPCG(3, 4)).Shuffle(len(got), func(i, j int) { got[i], got[j] = got[j], got[i] })
	slices.SortFunc(got, naturalCompare)
	if !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
	for _, a := range want {
		for _, b := range want {
			if c, d := naturalCompare(a, b), naturalCompare(b, a); (c == 0) != (a == b) || (c < 0) != (d > 0) && a != b {
				t.Errorf("compare(%q, %q) = %d, reversed %d", a, b, c, d)
			}
		}
	}
}
