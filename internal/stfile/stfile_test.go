package stfile

import (
	"bytes"
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/nlpodyssey/safetensors"
)

func f32Bytes(vs ...float32) []byte {
	b := make([]byte, 0, 4*len(vs))
	for _, v := range vs {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	return b
}

func seq(n int, start byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = start + byte(i)
	}
	return b
}

func TestRoundTrip(t *testing.T) {
	tests := []struct {
		name     string
		tensors  []Tensor
		metadata map[string]string
	}{
		{name: "empty file"},
		{name: "metadata only", metadata: map[string]string{"format": "nvfp4", "block_size": "16"}},
		{
			name:    "one matrix",
			tensors: []Tensor{{Name: "w", DType: F32, Shape: []uint64{2, 3}, Data: f32Bytes(1, 2, 3, 4, 5, 6)}},
		},
		{
			name: "scalar and vector",
			tensors: []Tensor{
				{Name: "w.scale", DType: F32, Shape: []uint64{}, Data: f32Bytes(0.25)},
				{Name: "nil shape scalar", DType: F32, Shape: nil, Data: f32Bytes(-3)},
				{Name: "v", DType: F32, Shape: []uint64{3}, Data: f32Bytes(1, 2, 3)},
			},
		},
		{
			name: "mixed dtypes",
			tensors: []Tensor{
				{Name: "a.packed", DType: U8, Shape: []uint64{2, 4, 8}, Data: seq(64, 0)},
				{Name: "b", DType: BF16, Shape: []uint64{3, 16}, Data: seq(96, 7)},
				{Name: "c", DType: I64, Shape: []uint64{2}, Data: seq(16, 100)},
				{Name: "d", DType: BOOL, Shape: []uint64{1, 1, 1, 1}, Data: []byte{1}},
			},
			metadata: map[string]string{"mode": "per-token"},
		},
		{
			name: "zero-size tensors",
			tensors: []Tensor{
				{Name: "empty", DType: F32, Shape: []uint64{0, 4}, Data: []byte{}},
				{Name: "empty2", DType: U8, Shape: []uint64{5, 0}, Data: nil},
				{Name: "x", DType: U8, Shape: []uint64{3}, Data: []byte{9, 8, 7}},
			},
		},
		{
			name: "8-bit floats",
			tensors: []Tensor{
				{Name: "w.weight", DType: U8, Shape: []uint64{2, 8}, Data: seq(16, 3)},
				{Name: "w.weight_scale", DType: F8E4M3, Shape: []uint64{2, 1}, Data: []byte{0x38, 0x7e}},
				{Name: "w.weight_scale_2", DType: F32, Shape: []uint64{}, Data: f32Bytes(0.5)},
				{Name: "x", DType: F8E5M2, Shape: []uint64{3}, Data: []byte{0x3c, 0x00, 0x80}},
			},
			metadata: map[string]string{"quant_algo": "NVFP4"},
		},
		{
			name:    "unicode name",
			tensors: []Tensor{{Name: "layers.0.mlp/écart \"q\"", DType: I8, Shape: []uint64{2}, Data: []byte{0x80, 0x7f}}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "rt.safetensors")
			if err := Write(path, tc.tensors, tc.metadata); err != nil {
				t.Fatal(err)
			}
			f, err := Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()

			var want []string
			for _, tt := range tc.tensors {
				want = append(want, tt.Name)
			}
			slices.Sort(want)
			if got := f.Names(); !slices.Equal(got, want) {
				t.Errorf("Names() = %q, want %q", got, want)
			}
			wantMeta := tc.metadata
			if wantMeta == nil {
				wantMeta = map[string]string{}
			}
			if got := f.Metadata(); !reflect.DeepEqual(got, wantMeta) {
				t.Errorf("Metadata() = %v, want %v", got, wantMeta)
			}
			for _, w := range tc.tensors {
				got, err := f.Tensor(w.Name)
				if err != nil {
					t.Fatal(err)
				}
				wantShape := w.Shape
				if wantShape == nil {
					wantShape = []uint64{}
				}
				if got.Name != w.Name || got.DType != w.DType || !slices.Equal(got.Shape, wantShape) || got.Shape == nil ||
					!bytes.Equal(got.Data, w.Data) {
					t.Errorf("tensor %q: got %s %v % x, want %s %v % x", w.Name, got.DType, got.Shape, got.Data, w.DType, wantShape, w.Data)
				}
			}
			if st, err := os.Stat(path); err != nil || st.Size() != f.Size() {
				t.Errorf("Size() = %d, stat %v %v", f.Size(), st, err)
			}
			// The header is padded to 8 bytes, so the data section is aligned.
			raw, _ := os.ReadFile(path)
			if n := binary.LittleEndian.Uint64(raw); n%8 != 0 {
				t.Errorf("header length %d is not a multiple of 8", n)
			}
		})
	}
}

// TestOwnSerializerMatchesLibrary: the encoder of files holding 8-bit
// floats writes the library's bytes for a file of the library's types.
func TestOwnSerializerMatchesLibrary(t *testing.T) {
	ts := map[string]view{}
	for _, tt := range []Tensor{
		{Name: "a.packed", DType: U8, Shape: []uint64{2, 4, 8}, Data: seq(64, 0)},
		{Name: "b", DType: BF16, Shape: []uint64{3, 16}, Data: seq(96, 7)},
		{Name: "c", DType: I64, Shape: []uint64{2}, Data: seq(16, 100)},
		{Name: "s", DType: F32, Shape: []uint64{}, Data: f32Bytes(2)},
		{Name: "\"q\" é", DType: I8, Shape: []uint64{1}, Data: []byte{1}},
	} {
		ts[tt.Name] = view{tt}
	}
	for _, md := range []map[string]string{nil, {"k": "v", "format": "pt"}} {
		var lib, own bytes.Buffer
		if err := safetensors.SerializeToWriter(ts, md, &lib); err != nil {
			t.Fatal(err)
		}
		if err := serializeOwn(ts, md, &own); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(lib.Bytes(), own.Bytes()) {
			t.Errorf("metadata %v:\nlibrary %q\nown     %q", md, lib.Bytes(), own.Bytes())
		}
	}
}

func TestTensorShapeIsACopy(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.safetensors")
	if err := Write(path, []Tensor{{Name: "v", DType: U8, Shape: []uint64{2, 2}, Data: seq(4, 0)}}, nil); err != nil {
		t.Fatal(err)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	a, _ := f.Tensor("v")
	a.Shape[0] = 99
	b, _ := f.Tensor("v")
	if b.Shape[0] != 2 {
		t.Errorf("Tensor shape changed to %v by a caller", b.Shape)
	}
}

func TestCloseIsIdempotent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.safetensors")
	if err := Write(path, []Tensor{{Name: "v", DType: U8, Shape: []uint64{3}, Data: seq(3, 0)}}, nil); err != nil {
		t.Fatal(err)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	_, err = f.Tensor("v")
	if err == nil || !strings.Contains(err.Error(), "closed") || !strings.Contains(err.Error(), path) {
		t.Errorf("Tensor after Close: err = %v, want a 'closed' error naming %s", err, path)
	}
}

func TestMissingTensor(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.safetensors")
	if err := Write(path, nil, nil); err != nil {
		t.Fatal(err)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Tensor("nope"); err == nil || !strings.Contains(err.Error(), `"nope"`) || !strings.Contains(err.Error(), path) {
		t.Errorf("err = %v, want one naming the tensor and file", err)
	}
}

func TestWriteErrors(t *testing.T) {
	ok := Tensor{Name: "ok", DType: U8, Shape: []uint64{1}, Data: []byte{1}}
	tests := []struct {
		name    string
		tensors []Tensor
		want    string // substring of the error besides the path
	}{
		{"empty name", []Tensor{{DType: U8, Shape: []uint64{1}, Data: []byte{1}}}, "empty name"},
		{"reserved name", []Tensor{{Name: "__metadata__", DType: U8, Shape: []uint64{1}, Data: []byte{1}}}, "reserved"},
		{"duplicate", []Tensor{ok, ok}, `"ok" given twice`},
		{"short data", []Tensor{ok, {Name: "w", DType: F32, Shape: []uint64{2, 2}, Data: make([]byte, 15)}}, `"w"`},
		{"scalar without data", []Tensor{{Name: "s", DType: F32, Shape: []uint64{}}}, `"s"`},
		{"bad dtype", []Tensor{{Name: "d", DType: DType(200), Shape: []uint64{1}, Data: []byte{1}}}, "invalid dtype"},
		{"huge shape", []Tensor{{Name: "h", DType: F64, Shape: []uint64{1 << 62, 4}}}, "too large"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "out.safetensors")
			err := Write(path, tc.tensors, nil)
			if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one naming %s and containing %q", err, path, tc.want)
			}
			if ents, _ := os.ReadDir(dir); len(ents) != 0 {
				t.Errorf("files left behind: %v", ents)
			}
		})
	}
}

func TestWriteReplacesAtomically(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "out.safetensors")
	if err := Write(path, []Tensor{{Name: "old", DType: U8, Shape: []uint64{1}, Data: []byte{1}}}, nil); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(path)
	// A failed write leaves the old file as it was.
	if err := Write(path, []Tensor{{Name: "bad", DType: U8, Shape: []uint64{2}, Data: []byte{1}}}, nil); err == nil {
		t.Fatal("Write of a malformed tensor succeeded")
	}
	if after, _ := os.ReadFile(path); !bytes.Equal(before, after) {
		t.Error("failed Write changed the existing file")
	}
	// A successful one replaces it, with a mode others can read.
	if err := Write(path, []Tensor{{Name: "new", DType: U8, Shape: []uint64{1}, Data: []byte{2}}}, nil); err != nil {
		t.Fatal(err)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if got := f.Names(); !slices.Equal(got, []string{"new"}) {
		t.Errorf("Names() = %q after replace", got)
	}
	if st, _ := os.Stat(path); st.Mode().Perm()&0o044 == 0 {
		t.Errorf("mode %v is not group/other readable", st.Mode())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("directory holds %v, want only the output", ents)
	}
	// Writing into a missing directory fails naming the path.
	bad := filepath.Join(dir, "missing", "x.safetensors")
	if err := Write(bad, nil, nil); err == nil || !strings.Contains(err.Error(), bad) {
		t.Errorf("err = %v, want one naming %s", err, bad)
	}
}

// header builds a safetensors file from a raw JSON header and data bytes.
func header(json string, data []byte) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(json)))
	b = append(b, json...)
	return append(b, data...)
}

// validFile returns the bytes of a small valid file written by Write.
func validFile(tb testing.TB) []byte {
	tb.Helper()
	path := filepath.Join(tb.TempDir(), "seed.safetensors")
	err := Write(path, []Tensor{
		{Name: "w", DType: BF16, Shape: []uint64{2, 16}, Data: seq(64, 1)},
		{Name: "w.scale", DType: F32, Shape: []uint64{}, Data: f32Bytes(0.5)},
	}, map[string]string{"k": "v"})
	if err != nil {
		tb.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

func TestOpenErrors(t *testing.T) {
	good := validFile(t)
	tests := []struct {
		name string
		data []byte // nil: no file at all
		dir  bool
		want string
	}{
		{name: "missing", want: "no such file"},
		{name: "directory", dir: true, want: "is a directory"},
		{name: "empty", data: []byte{}, want: "header too small"},
		{name: "short header length", data: []byte{1, 2, 3}, want: "header too small"},
		{name: "truncated data", data: good[:len(good)-1], want: "malformed"},
		{name: "truncated header", data: good[:20], want: "malformed"},
		{name: "extra byte", data: append(slices.Clone(good), 0), want: "malformed"},
		{name: "header length past end", data: binary.LittleEndian.AppendUint64(nil, 1000), want: "invalid header length"},
		{name: "header length huge", data: binary.LittleEndian.AppendUint64(nil, 1<<62), want: "header too large"},
		{name: "not json", data: header(`{"a":`, nil), want: "malformed"},
		{name: "bad dtype", data: header(`{"a":{"dtype":"F8","shape":[1],"data_offsets":[0,1]}}`, []byte{0}), want: "malformed"},
		{name: "offset mismatch", data: header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`, make([]byte, 4)), want: "malformed"},
		{name: "gap", data: header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, make([]byte, 2)), want: "malformed"},
		{name: "huge shape", data: header(`{"a":{"dtype":"U64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}`, nil), want: "malformed"},
		{name: "metadata not strings", data: header(`{"__metadata__":{"a":1}}`, nil), want: "malformed"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "in.safetensors")
			switch {
			case tc.dir:
				if err := os.Mkdir(path, 0o755); err != nil {
					t.Fatal(err)
				}
			case tc.data != nil:
				if err := os.WriteFile(path, tc.data, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			f, err := Open(path)
			if err == nil {
				f.Close()
				t.Fatal("Open succeeded")
			}
			if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one naming %s and containing %q", err, path, tc.want)
			}
		})
	}
}

// addFileSeeds seeds a fuzz test of a safetensors file reader: a valid
// file, its truncations and single-byte corruptions, and headers at the
// edges (zero-length tensors, overflowing shapes, null values).
func addFileSeeds(f *testing.F) {
	good := validFile(f)
	f.Add(good)
	for _, n := range []int{0, 7, 8, 9, 16, len(good) / 2, len(good) - 1} {
		f.Add(good[:n])
	}
	for _, i := range []int{0, 3, 7, 8, 12, 30, len(good) - 1} {
		c := slices.Clone(good)
		c[i] ^= 0xff
		f.Add(c)
	}
	f.Add(header(`{"a":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}`, []byte{7}))
	f.Add(header(`{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`, nil))
	f.Add(header(`{"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,18446744073709551615]}}`, nil))
	f.Add(header(`{"__metadata__":null}`, nil))
	f.Add(header(`null`, nil))
	f.Add(header(`{"s":{"dtype":"F8_E4M3","shape":[2,1],"data_offsets":[0,2]},"t":{"dtype":"F8_E5M2","shape":[1],"data_offsets":[2,3]}}`, []byte{0x38, 0x7e, 0x3c}))
	f.Add(header(`{"s":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},"t":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[1,2]}}`, []byte{1, 2}))
}

// FuzzOpen feeds arbitrary bytes to Open as a file: it must return an error
// or a File whose tensors are all consistent, never panic.
func FuzzOpen(f *testing.F) {
	addFileSeeds(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		path := filepath.Join(t.TempDir(), "fuzz.safetensors")
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		file, err := Open(path)
		if err != nil {
			if !strings.Contains(err.Error(), path) {
				t.Errorf("error %q does not name the file", err)
			}
			return
		}
		defer file.Close()
		total := 0
		for _, name := range file.Names() {
			tt, err := file.Tensor(name)
			if err != nil {
				t.Fatal(err)
			}
			n, ok := tt.NumElements()
			if !ok || len(tt.Data) != n*int(tt.DType.Size()) {
				t.Fatalf("tensor %q: %d bytes for %s %v", name, len(tt.Data), tt.DType, tt.Shape)
			}
			total += len(tt.Data)
			_ = bytes.Count(tt.Data, []byte{0}) // touch every byte of the mapping
		}
		if total > len(data) {
			t.Fatalf("tensors hold %d bytes of a %d-byte file", total, len(data))
		}
		if err := file.Close(); err != nil {
			t.Fatal(err)
		}
		if err := file.Close(); err != nil {
			t.Fatal(err)
		}
	})
}
