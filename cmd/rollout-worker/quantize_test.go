package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
)

// bf16Tensor builds a BF16 tensor from float32 values (rounded to BF16).
func bf16Tensor(name string, shape []uint64, vals []float32) stfile.Tensor {
	data := make([]byte, 2*len(vals))
	bf16.Encode(data, vals)
	return stfile.Tensor{Name: name, DType: stfile.BF16, Shape: shape, Data: data}
}

// randomBF16 returns a BF16 tensor of random values whose magnitudes vary per
// row, with some all-zero blocks and rows, from a fixed seed.
func randomBF16(name string, seed uint64, shape ...uint64) stfile.Tensor {
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	n := 1
	for _, d := range shape {
		n *= int(d)
	}
	k := int(shape[len(shape)-1])
	vals := make([]float32, n)
	for i := range vals {
		row := i / k
		switch {
		case row%7 == 3: // an all-zero row
		case (i/16)%11 == 5: // an all-zero block
		default:
			vals[i] = float32(rng.NormFloat64() * math.Ldexp(1, row%9-4))
		}
	}
	return bf16Tensor(name, shape, vals)
}

func writeInput(t *testing.T, tensors ...stfile.Tensor) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "in.safetensors")
	if err := stfile.Write(path, tensors, map[string]string{"source": "test"}); err != nil {
		t.Fatal(err)
	}
	return path
}

func bf16Values(data []byte) []uint16 {
	v := make([]uint16, len(data)/2)
	for i := range v {
		v[i] = binary.LittleEndian.Uint16(data[2*i:])
	}
	return v
}

func f32Bits(data []byte) []uint32 {
	v := make([]uint32, len(data)/4)
	for i := range v {
		v[i] = binary.LittleEndian.Uint32(data[4*i:])
	}
	return v
}

// mustTensor returns the named output tensor after checking its dtype and shape.
func mustTensor(t *testing.T, f *stfile.File, name string, dt stfile.DType, shape []uint64) stfile.Tensor {
	t.Helper()
	got, err := f.Tensor(name)
	if err != nil {
		t.Fatal(err)
	}
	if got.DType != dt || !slices.Equal(got.Shape, shape) {
		t.Fatalf("%s: %s %v, want %s %v", name, got.DType, got.Shape, dt, shape)
	}
	return got
}

// checkAgainstCodec verifies the outputs for input tensor in against the
// nvfp4 codec called directly, matrix by matrix.
func checkAgainstCodec(t *testing.T, f *stfile.File, in stfile.Tensor, mode, layout string) {
	t.Helper()
	rank3 := len(in.Shape) == 3
	lead := in.Shape[:len(in.Shape)-2]
	n, k := int(in.Shape[len(in.Shape)-2]), int(in.Shape[len(in.Shape)-1])
	e := 1
	if rank3 {
		e = int(in.Shape[0])
	}
	blocks := k / 16
	rowsP, colsP := nvfp4.SwizzledDims(n, blocks)

	packed := mustTensor(t, f, in.Name+".packed", stfile.U8, append(slices.Clone(lead), uint64(n), uint64(k/2)))
	bsShape := append(slices.Clone(lead), uint64(n), uint64(blocks))
	perMatrix := n * blocks
	if layout == layoutSwizzled {
		bsShape = append(slices.Clone(lead), uint64(rowsP*colsP))
		perMatrix = rowsP * colsP
	}
	bs := mustTensor(t, f, in.Name+".block_scales", stfile.U8, bsShape)
	scShape := slices.Clone(lead)
	if mode == modePerToken {
		scShape = append(scShape, uint64(n))
	}
	sc := f32Bits(mustTensor(t, f, in.Name+".scale", stfile.F32, scShape).Data)

	src := bf16Values(in.Data)
	for m := range e {
		msrc := src[m*n*k : (m+1)*n*k]
		wantPacked := make([]byte, n*k/2)
		wantLinear := make([]byte, n*blocks)
		var wantScales []float32
		if mode == modePerTensor {
			s, err := nvfp4.QuantizeMatrix(wantPacked, wantLinear, msrc, n, k)
			if err != nil {
				t.Fatal(err)
			}
			wantScales = []float32{s}
		} else {
			wantScales = make([]float32, n)
			if err := nvfp4.QuantizePerRow(wantPacked, wantLinear, wantScales, msrc, n, k); err != nil {
				t.Fatal(err)
			}
		}
		if got := packed.Data[m*n*k/2 : (m+1)*n*k/2]; !bytes.Equal(got, wantPacked) {
			t.Errorf("%s matrix %d: packed bytes differ from nvfp4 codec", in.Name, m)
		}
		gotBS := bs.Data[m*perMatrix : (m+1)*perMatrix]
		if layout == layoutSwizzled {
			wantSw := make([]byte, perMatrix)
			if err := nvfp4.Swizzle(wantSw, wantLinear, n, blocks); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(gotBS, wantSw) {
				t.Errorf("%s matrix %d: swizzled block scales differ from nvfp4.Swizzle", in.Name, m)
			}
			back := make([]byte, n*blocks)
			if err := nvfp4.Unswizzle(back, gotBS, n, blocks); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(back, wantLinear) {
				t.Errorf("%s matrix %d: unswizzled block scales differ from the linear ones", in.Name, m)
			}
		} else if !bytes.Equal(gotBS, wantLinear) {
			t.Errorf("%s matrix %d: linear block scales differ from nvfp4 codec", in.Name, m)
		}
		gotSc := sc[m*len(wantScales) : (m+1)*len(wantScales)]
		for i, s := range wantScales {
			if gotSc[i] != math.Float32bits(s) {
				t.Errorf("%s matrix %d: scale %d = %#08x, want %#08x", in.Name, m, i, gotSc[i], math.Float32bits(s))
				break
			}
		}
	}
}

func TestQuantizeMatchesCodec(t *testing.T) {
	weights := []stfile.Tensor{
		randomBF16("layers.0.attn.qkv.weight", 1, 5, 48),
		randomBF16("layers.0.mlp.experts.fc1", 2, 3, 4, 32),   // rank 3
		randomBF16("layers.0.mlp.experts.fc2", 3, 2, 130, 80), // rank 3, two 128-row tiles, cols_p > K/16
		randomBF16("lm_head.weight", 4, 33, 16),
	}
	norm := stfile.Tensor{Name: "layers.0.norm.weight", DType: stfile.F32, Shape: []uint64{16}, Data: make([]byte, 64)}
	tests := []struct {
		mode, layout string
		match        string // "" quantizes every tensor of an all-BF16 file
		workers      int
	}{
		{modePerTensor, layoutLinear, "", 4},
		{modePerTensor, layoutSwizzled, "", 1},
		{modePerToken, layoutLinear, `(qkv|head)\.weight$|experts`, 3},
		{modePerToken, layoutSwizzled, `experts\.fc\d$`, 8},
		{modePerTensor, layoutSwizzled, `^lm_head\.|fc2`, 2},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%s/%s/match=%q", tc.mode, tc.layout, tc.match), func(t *testing.T) {
			inputs := slices.Clone(weights)
			selected := weights
			if tc.match != "" {
				inputs = append(inputs, norm) // F32: must be left out by --match
				re := regexp.MustCompile(tc.match)
				selected = nil
				for _, w := range weights {
					if re.MatchString(w.Name) {
						selected = append(selected, w)
					}
				}
			}
			in := writeInput(t, inputs...)
			out := filepath.Join(t.TempDir(), "out.safetensors")
			cfg := quantizeConfig{in: in, out: out, mode: tc.mode, layout: tc.layout, workers: tc.workers}
			if tc.match != "" {
				cfg.match = regexp.MustCompile(tc.match)
			}
			st, err := quantizeFile(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			f, err := stfile.Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()

			var wantNames []string
			bytesIn, matrices := 0, 0
			for _, w := range selected {
				wantNames = append(wantNames, w.Name+".packed", w.Name+".block_scales", w.Name+".scale")
				bytesIn += len(w.Data)
				matrices++
				if len(w.Shape) == 3 {
					matrices += int(w.Shape[0]) - 1
				}
				checkAgainstCodec(t, f, w, tc.mode, tc.layout)
			}
			slices.Sort(wantNames)
			if got := f.Names(); !slices.Equal(got, wantNames) {
				t.Errorf("output tensors %q, want %q", got, wantNames)
			}
			wantMeta := map[string]string{"format": "nvfp4", "block_size": "16", "mode": tc.mode, "layout": tc.layout}
			gotMeta := f.Metadata()
			for key, v := range wantMeta {
				if gotMeta[key] != v {
					t.Errorf("metadata %q = %q, want %q", key, gotMeta[key], v)
				}
			}
			if st.tensors != len(selected) || st.matrices != matrices || st.bytesIn != int64(bytesIn) || st.bytesOut != f.Size() {
				t.Errorf("stats %+v, want %d tensors, %d matrices, %d bytes in, %d out", st, len(selected), matrices, bytesIn, f.Size())
			}
		})
	}
}

// exampleBlock is the block of docs/NVFP4.md section 8.
var exampleBlock = []float32{0, .125, -.3125, .5, .875, -1, 1.375, 1.875, -2.5, 3, 3.5, -4.25, 5, 5.5, -6.5, 7}

// TestQuantizeWorkedExample runs examples A (per-tensor, amax 10) and B
// (per-token, row amax 7) of docs/NVFP4.md end to end through a file.
func TestQuantizeWorkedExample(t *testing.T) {
	// Row 0 is the example block; row 1 holds 10 and zeros, so the matrix
	// amax is 10 (example A's global scale).
	vals := append(slices.Clone(exampleBlock), make([]float32, 16)...)
	vals[16] = 10
	w := bf16Tensor("w", []uint64{2, 16}, vals)
	for i, v := range vals {
		if bf16.Round(v) != v {
			t.Fatalf("value %d (%v) is not exact in BF16", i, v)
		}
	}
	examplePacked := []byte{0x00, 0x19, 0xa1, 0x32, 0x5c, 0xe5, 0x66, 0x7f}
	tests := []struct {
		mode       string
		wantSF     []byte   // row 0, row 1
		wantScales []uint32 // F32 bits of T.scale
	}{
		// A: SF 0x7A, S_dec 0x3B73CF3E. Row 1: 10*S_enc*INV6 = 448 -> 0x7E.
		{modePerTensor, []byte{0x7a, 0x7e}, []uint32{0x3b73cf3e}},
		// B: row amax 7 -> SF 0x7E, per_token_scale 0x3B2AAAAB; row 1 amax 10.
		{modePerToken, []byte{0x7e, 0x7e}, []uint32{0x3b2aaaab, math.Float32bits(1 / (float32(2688) / 10))}},
	}
	for _, tc := range tests {
		t.Run(tc.mode, func(t *testing.T) {
			in := writeInput(t, w)
			out := filepath.Join(t.TempDir(), "out.safetensors")
			var stderr bytes.Buffer
			err := runQuantize(context.Background(), []string{"--in", in, "--out", out, "--mode", tc.mode, "--layout", "linear"}, &bytes.Buffer{}, &stderr)
			if err != nil {
				t.Fatal(err)
			}
			f, err := stfile.Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			packed := mustTensor(t, f, "w.packed", stfile.U8, []uint64{2, 8})
			if got := packed.Data[:8]; !bytes.Equal(got, examplePacked) {
				t.Errorf("row 0 packed % x, want % x", got, examplePacked)
			}
			// Row 1: 10 * enc rounds to 6 (code 7), zeros are code 0.
			if got, want := packed.Data[8:], []byte{0x07, 0, 0, 0, 0, 0, 0, 0}; !bytes.Equal(got, want) {
				t.Errorf("row 1 packed % x, want % x", got, want)
			}
			if got := mustTensor(t, f, "w.block_scales", stfile.U8, []uint64{2, 1}).Data; !bytes.Equal(got, tc.wantSF) {
				t.Errorf("block scales % x, want % x", got, tc.wantSF)
			}
			shape := []uint64{}
			if tc.mode == modePerToken {
				shape = []uint64{2}
			}
			if got := f32Bits(mustTensor(t, f, "w.scale", stfile.F32, shape).Data); !slices.Equal(got, tc.wantScales) {
				t.Errorf("scales %#08x, want %#08x", got, tc.wantScales)
			}
			if !strings.Contains(stderr.String(), "1 tensors") {
				t.Errorf("summary %q", stderr.String())
			}
		})
	}
}

func TestQuantizeErrors(t *testing.T) {
	good := randomBF16("good", 9, 2, 32)
	nanVals := make([]float32, 2*32)
	nanVals[37] = float32(math.NaN())
	infVals := make([]float32, 3*2*16)
	infVals[2*16+5] = float32(math.Inf(-1))
	tests := []struct {
		name  string
		input []stfile.Tensor // nil: no tensor file (see raw)
		raw   func(t *testing.T, path string)
		args  []string // after --in IN --out OUT
		want  []string // substrings of the error; "IN" is replaced by the input path
		code  int
	}{
		{name: "F32 tensor", input: []stfile.Tensor{good, {Name: "norm", DType: stfile.F32, Shape: []uint64{2, 16}, Data: make([]byte, 128)}},
			want: []string{"IN", `"norm"`, "dtype F32, want BF16"}, code: 1},
		{name: "K=24", input: []stfile.Tensor{randomBF16("odd", 1, 4, 24)},
			want: []string{"IN", `"odd"`, "K = 24", "multiple of 16"}, code: 1},
		{name: "rank 1", input: []stfile.Tensor{good, randomBF16("bias", 1, 32)},
			want: []string{"IN", `"bias"`, "rank 1"}, code: 1},
		{name: "rank 4", input: []stfile.Tensor{randomBF16("conv", 1, 2, 2, 2, 16)},
			want: []string{"IN", `"conv"`, "rank 4"}, code: 1},
		{name: "zero dimension", input: []stfile.Tensor{bf16Tensor("empty", []uint64{0, 16}, nil)},
			want: []string{"IN", `"empty"`, "zero dimension"}, code: 1},
		{name: "NaN value", input: []stfile.Tensor{good, bf16Tensor("nan", []uint64{2, 32}, nanVals)},
			want: []string{"IN", `"nan"`, "[1, 5]", "NaN"}, code: 1},
		{name: "Inf value", input: []stfile.Tensor{good, bf16Tensor("inf", []uint64{3, 2, 16}, infVals)},
			want: []string{"IN", `"inf"`, "[1, 0, 5]", "-Inf"}, code: 1},
		{name: "missing file", raw: func(*testing.T, string) {},
			want: []string{"IN", "no such file"}, code: 1},
		{name: "truncated file", raw: func(t *testing.T, path string) {
			full := filepath.Join(t.TempDir(), "full.safetensors")
			if err := stfile.Write(full, []stfile.Tensor{good}, nil); err != nil {
				t.Fatal(err)
			}
			b, _ := os.ReadFile(full)
			os.WriteFile(path, b[:len(b)-10], 0o644)
		}, want: []string{"IN", "malformed"}, code: 1},
		{name: "not safetensors", raw: func(t *testing.T, path string) {
			os.WriteFile(path, []byte("this is not a safetensors file"), 0o644)
		}, want: []string{"IN", "malformed"}, code: 1},
		{name: "bad mode", input: []stfile.Tensor{good}, args: []string{"--mode", "per-block"},
			want: []string{"--mode", `"per-block"`}, code: 2},
		{name: "bad layout", input: []stfile.Tensor{good}, args: []string{"--layout", "tiled"},
			want: []string{"--layout", `"tiled"`}, code: 2},
		{name: "match nothing", input: []stfile.Tensor{good}, args: []string{"--match", `^experts\.`},
			want: []string{"IN", `--match "^experts\\."`, "selects none"}, code: 1},
		{name: "bad regexp", input: []stfile.Tensor{good}, args: []string{"--match", `(`},
			want: []string{"--match", "missing closing )"}, code: 2},
		{name: "no tensors", input: []stfile.Tensor{},
			want: []string{"IN", "no tensors"}, code: 1},
		{name: "out is in", input: []stfile.Tensor{good}, args: []string{"--out", "IN"},
			want: []string{"is the input file"}, code: 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			in := filepath.Join(dir, "in.safetensors")
			if tc.raw != nil {
				tc.raw(t, in)
			} else if err := stfile.Write(in, tc.input, nil); err != nil {
				t.Fatal(err)
			}
			before, _ := os.ReadFile(in)
			out := filepath.Join(dir, "out.safetensors")
			args := []string{"--in", in, "--out", out}
			for _, a := range tc.args {
				args = append(args, strings.ReplaceAll(a, "IN", in))
			}

			err := runQuantize(context.Background(), args, &bytes.Buffer{}, &bytes.Buffer{})
			if err == nil {
				t.Fatal("quantize succeeded")
			}
			for _, w := range tc.want {
				if w = strings.ReplaceAll(w, "IN", in); !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			var stderr bytes.Buffer
			if code := run(context.Background(), append([]string{"quantize"}, args...), &bytes.Buffer{}, &stderr); code != tc.code {
				t.Errorf("exit status %d, want %d; stderr:\n%s", code, tc.code, &stderr)
			}
			if !strings.Contains(stderr.String(), err.Error()) {
				t.Errorf("stderr %q does not report the error", &stderr)
			}
			if _, err := os.Stat(out); !os.IsNotExist(err) {
				t.Errorf("output %s exists after a failed run (stat: %v)", out, err)
			}
			if after, _ := os.ReadFile(in); !bytes.Equal(before, after) {
				t.Error("input file changed")
			}
			ents, _ := os.ReadDir(dir)
			for _, e := range ents {
				if e.Name() != "in.safetensors" {
					t.Errorf("left behind: %s", e.Name())
				}
			}
		})
	}
}

func TestQuantizeCancelled(t *testing.T) {
	in := writeInput(t, randomBF16("w", 1, 4, 8, 32))
	out := filepath.Join(t.TempDir(), "out.safetensors")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := quantizeFile(ctx, quantizeConfig{in: in, out: out, mode: modePerTensor, layout: layoutLinear, workers: 2})
	if err != context.Canceled {
		t.Errorf("err = %v, want context.Canceled", err)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("output exists after a cancelled run")
	}
}
