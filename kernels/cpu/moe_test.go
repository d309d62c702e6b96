package cpu_test

import (
	"encoding/binary"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
)

func i32Buf(t *testing.T, be kernels.Backend, vals ...int32) *kernels.Buffer {
	t.Helper()
	b, err := be.Alloc(kernels.I32, len(vals))
	if err != nil {
		t.Fatal(err)
	}
	raw := make([]byte, 4*len(vals))
	for i, v := range vals {
		binary.LittleEndian.PutUint32(raw[4*i:], uint32(v))
	}
	if err := be.Upload(b, 0, raw); err != nil {
		t.Fatal(err)
	}
	return b
}

func mustAlloc(t *testing.T, be kernels.Backend, dt kernels.DType, shape ...int) *kernels.Buffer {
	t.Helper()
	b, err := be.Alloc(dt, shape...)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func reshape(t *testing.T, b *kernels.Buffer, shape ...int) *kernels.Buffer {
	t.Helper()
	v, err := b.Reshape(shape...)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// Data-dependent errors: the CPU backend checks indices before it touches
// memory, and says which entry was wrong. (A GPU backend cannot report these
// at call time, so they are not part of the conformance suite.)
func TestDataErrors(t *testing.T) {
	be := newBackend(t)
	E, H := 3, 16
	w := mustAlloc(t, be, kernels.BF16, E, 8, H)
	x := mustAlloc(t, be, kernels.BF16, 2, H)
	out := mustAlloc(t, be, kernels.BF16, 4, 8)
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"permute unknown expert", be.Permute(kernels.PermuteArgs{
			IDs: reshape(t, i32Buf(t, be, 0, 1, 2, 3), 2, 2), Offsets: mustAlloc(t, be, kernels.I32, E+1),
			Rows: mustAlloc(t, be, kernels.I32, 4), Slots: mustAlloc(t, be, kernels.I32, 4)}),
			"assignment (1, 1) names expert 3 of 3"},
		{"gather out of range", be.GroupedGemm(kernels.GroupedGemmArgs{
			A: kernels.Operand{BF16: x}, Gather: i32Buf(t, be, 0, 1, 2, 0), W: kernels.Operand{BF16: w},
			Offsets: i32Buf(t, be, 0, 2, 4, 4), Act: kernels.Identity, Out: out}),
			"sorted row 2 gathers row 2 of 2"},
		{"offsets decrease", be.GroupedGemm(kernels.GroupedGemmArgs{
			A: kernels.Operand{BF16: x}, Gather: i32Buf(t, be, 0, 1, 1, 0), W: kernels.Operand{BF16: w},
			Offsets: i32Buf(t, be, 0, 3, 2, 4), Act: kernels.Identity, Out: out}),
			"offsets decrease at expert 1"},
		{"offsets past the rows", be.GroupedGemm(kernels.GroupedGemmArgs{
			A: kernels.Operand{BF16: x}, Gather: i32Buf(t, be, 0, 1, 1, 0), W: kernels.Operand{BF16: w},
			Offsets: i32Buf(t, be, 0, 2, 4, 5), Act: kernels.Identity, Out: out}),
			"out has 4 rows"},
		{"finalize slot", be.Finalize(kernels.FinalizeArgs{
			Out: mustAlloc(t, be, kernels.BF16, 2, 8), Rows: out, Weights: mustAlloc(t, be, kernels.F32, 2, 2),
			Slots: i32Buf(t, be, 0, 1, 9, 3)}),
			"slot 9 of assignment (1, 0)"},
		{"route zero scale", be.Route(kernels.RouteArgs{
			Logits: mustAlloc(t, be, kernels.F32, 2, E), IDs: mustAlloc(t, be, kernels.I32, 2, 1),
			Weights: mustAlloc(t, be, kernels.F32, 2, 1), Scoring: kernels.Softmax}),
			"scale 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.err == nil || !strings.Contains(tc.err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", tc.err, tc.want)
			}
		})
	}
}

func TestFreeTwice(t *testing.T) {
	be := newBackend(t)
	b := mustAlloc(t, be, kernels.F32, 3)
	if err := be.Free(b); err != nil {
		t.Fatal(err)
	}
	if err := be.Free(b); err == nil {
		t.Fatal("second Free succeeded")
	}
	v, _ := mustAlloc(t, be, kernels.F32, 3).Rows(1)
	if err := be.Free(v); err == nil {
		t.Fatal("Free of a view succeeded")
	}
}

// TestQuantizeAmaxChecked: a per-matrix quantization given an amax that is
// not its matrix's fails, naming the matrix, and leaves the error for the
// caller rather than wrong scales.
func TestQuantizeAmaxChecked(t *testing.T) {
	be, err := cpu.New(cpu.Config{Workers: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	const e, n, k = 2, 4, 32
	mk := func(dt kernels.DType, shape ...int) *kernels.Buffer {
		t.Helper()
		b, err := be.Alloc(dt, shape...)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	src := mk(kernels.BF16, e, n, k)
	vals := make([]uint16, e*n*k)
	for i := range vals {
		vals[i] = bf16.FromFloat32(float32(i%7) - 3)
	}
	if err := be.Upload(src, 0, kernels.Uint16Bytes(vals)); err != nil {
		t.Fatal(err)
	}
	amax := mk(kernels.F32, e)
	if err := be.Upload(amax, 0, kernels.Float32Bytes([]float32{3, 2.5})); err != nil {
		t.Fatal(err)
	}
	q := kernels.NVFP4{Packed: mk(kernels.U8, e, n, k/2), Scales: mk(kernels.U8, e, n, k/16), Scale: mk(kernels.F32, e)}
	err = be.Quantize(kernels.QuantizeArgs{Src: src, Dst: q, Mode: kernels.PerMatrix, Amax: amax})
	if err == nil {
		err = be.Sync()
	}
	if err == nil || !strings.Contains(err.Error(), "matrix 1") {
		t.Fatalf("quantize with a wrong amax for matrix 1: %v", err)
	}
}
