package cuda

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
)

// TestStageScatterBatches: a staged delta larger than a staging buffer (the
// least size, 1 MiB) goes through both pinned buffers in turn, batch after
// batch, and writes what the CPU backend writes, bit for bit; so does one
// whose largest span (an index list of every element: 256 KiB) fills most
// of a buffer alone.
func TestStageScatterBatches(t *testing.T) {
	be := minStagingBackend(t)
	ref, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(3, 4))
	const n = 64 * kernels.DeltaSpanElems
	initial := make([]byte, 2*n)
	for i := range initial {
		initial[i] = byte(r.Uint32())
	}
	var spans []kernels.DeltaSpan
	var masks, values []byte
	for s := range n / kernels.DeltaSpanElems {
		form, frac := int32(kernels.DeltaBitmap), 0.3
		switch s % 3 {
		case 1:
			form, frac = kernels.DeltaIndices, 0.05
		case 2:
			form, frac = kernels.DeltaIndices, 1 // the largest span
		}
		sp := kernels.DeltaSpan{Start: int64(s * kernels.DeltaSpanElems), Len: kernels.DeltaSpanElems, Form: form,
			Mask: int32(len(masks) / 4), Value: int32(len(values) / 2)}
		words := make([]uint32, kernels.DeltaSpanElems/32)
		for j := range kernels.DeltaSpanElems {
			if frac < 1 && r.Float64() >= frac {
				continue
			}
			sp.Count++
			if form == kernels.DeltaIndices {
				masks = binary.LittleEndian.AppendUint16(masks, uint16(j))
			} else {
				words[j/32] |= 1 << (j % 32)
			}
			values = binary.LittleEndian.AppendUint16(values, uint16(r.Uint32()))
		}
		if form == kernels.DeltaIndices && sp.Count%2 == 1 {
			masks = append(masks, 0, 0)
		}
		if form == kernels.DeltaBitmap {
			for _, w := range words {
				masks = binary.LittleEndian.AppendUint32(masks, w)
			}
		}
		spans = append(spans, sp)
	}
	t.Logf("%d spans, %d bytes of words and %d of values: %d staging buffers' worth", len(spans), len(masks), len(values),
		(len(masks)+len(values))/minStagingBytes)
	var got, want []byte
	for _, b := range []kernels.Backend{be, ref} {
		dst, err := b.Alloc(kernels.BF16, n+10)
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Upload(dst, 0, append(initial, make([]byte, 20)...)); err != nil {
			t.Fatal(err)
		}
		a := kernels.HostScatterBF16{Dst: dst, Offset: 10, Len: n, Spans: spans, Masks: masks, Values: values}
		if err := b.(kernels.DeltaStager).StageScatterBF16(a); err != nil {
			t.Fatal(err)
		}
		out := make([]byte, dst.Size())
		if err := b.Download(out, dst, 0); err != nil {
			t.Fatal(err)
		}
		if b == be {
			got = out
		} else {
			want = out
		}
		if err := b.Free(dst); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(got, want) {
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("byte %d (element %d) differs from the CPU backend's", i, i/2-10)
			}
		}
	}
}

// TestStagingBytesLeast: staging buffers smaller than the largest delta
// span are refused, before the device is opened.
func TestStagingBytesLeast(t *testing.T) {
	if _, err := New(Config{StagingBytes: minStagingBytes - 1}, nil); err == nil || !strings.Contains(err.Error(), "the largest delta span") {
		t.Errorf("staging buffers below the least size: %v", err)
	}
}

// TestStageRing stages 20 MiB in pieces of 700 KB through 1 MiB pinned
// buffers: slices cross buffers, the ring wraps several times, and the
// caller overwrites its source as soon as Stage returns. After StageSync
// the device holds every byte as staged.
func TestStageRing(t *testing.T) {
	be := minStagingBackend(t)
	const total, piece = 20 << 20, 700 << 10
	dst, err := be.Alloc(kernels.U8, total+3)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, total+3)
	r := rand.New(rand.NewPCG(5, 6))
	src := make([]byte, piece)
	for off := 3; off < total+3; off += piece {
		n := min(piece, total+3-off)
		for i := range src[:n] {
			src[i] = byte(r.Uint32())
		}
		copy(want[off:], src[:n])
		if err := be.Stage(dst, off, src[:n]); err != nil {
			t.Fatal(err)
		}
		clear(src) // reused at once, as the receiver reuses its chunks
	}
	if err := be.StageSync(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, total+3)
	if err := be.Download(got, dst, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		i := 0
		for got[i] == want[i] {
			i++
		}
		t.Fatalf("byte %d: %#x, staged %#x", i, got[i], want[i])
	}
}

// minStagingBackend opens a backend of the least staging buffers (1 MiB),
// so that tests cross and reuse them with little data; it skips without a
// GPU and closes at the test's end.
func minStagingBackend(t *testing.T) *Backend {
	t.Helper()
	be, err := New(Config{StagingBytes: minStagingBytes}, nil)
	if errors.Is(err, drv.ErrNoDevice) {
		t.Skip("no CUDA device: " + err.Error())
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	return be
}
