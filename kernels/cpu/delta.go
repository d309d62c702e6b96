package cpu

import (
	"encoding/binary"
	"fmt"
	"math/bits"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// Sparse BF16 deltas (kernels/delta.go): the op on buffers, and its staged
// form from host memory for the refit path.

var _ kernels.DeltaStager = (*Backend)(nil)

// ScatterBF16 writes the values each span names into Dst. Every span is
// checked before anything is written: a bad span is an error of the call
// and nothing is written.
func (be *Backend) ScatterBF16(a kernels.ScatterBF16Args) error {
	return issue(be, "scatter bf16", a, be.prepScatterBF16)
}

func (be *Backend) prepScatterBF16(a kernels.ScatterBF16Args) (func() error, error) {
	n, err := a.Validate()
	if err != nil {
		return nil, err
	}
	if err := be.owns("scatter bf16", map[string]*kernels.Buffer{"dst": a.Dst, "spans": a.Spans, "masks": a.Masks, "values": a.Values}); err != nil {
		return nil, err
	}
	return func() error {
		raw := a.Spans.Host()
		spans := make([]kernels.DeltaSpan, n)
		for i := range spans {
			w := func(k int) int32 { return int32(binary.LittleEndian.Uint32(raw[4*(i*kernels.DeltaSpanWords+k):])) }
			spans[i] = kernels.DeltaSpan{Start: int64(uint32(w(0))) | int64(w(1))<<32, Len: w(2), Form: w(3), Count: w(4), Mask: w(5), Value: w(6)}
		}
		return scatterBF16("scatter bf16", kernels.HostScatterBF16{Dst: a.Dst, Offset: a.Offset, Len: a.Len, Spans: spans,
			Masks: a.Masks.Host(), Values: a.Values.Host()})
	}, nil
}

// StageScatterBF16 is ScatterBF16 from host memory. Unlike the op it may be
// called from any goroutine and is never captured (kernels.DeltaStager).
func (be *Backend) StageScatterBF16(a kernels.HostScatterBF16) error {
	if _, err := be.host("stage scatter bf16", "dst", a.Dst); err != nil {
		return err
	}
	return scatterBF16("stage scatter bf16", a)
}

// scatterBF16 checks every span of a, then writes them.
func scatterBF16(op string, a kernels.HostScatterBF16) error {
	if err := a.Validate(); err != nil {
		return fmt.Errorf("cpu: %s: %w", op, err)
	}
	dst := u16s(a.Dst)[a.Offset:][:a.Len]
	for _, s := range a.Spans {
		out := dst[s.Start:][:s.Len]
		m := a.Masks[4*int(s.Mask):][:4*s.MaskWords()]
		v := a.Values[2*int(s.Value):][:2*int(s.Count)]
		if s.Form == kernels.DeltaIndices {
			for k := range int(s.Count) {
				out[binary.LittleEndian.Uint16(m[2*k:])] = binary.LittleEndian.Uint16(v[2*k:])
			}
			continue
		}
		k := 0
		for w := range s.MaskWords() {
			for word := binary.LittleEndian.Uint32(m[4*w:]); word != 0; word &= word - 1 {
				out[32*w+bits.TrailingZeros32(word)] = binary.LittleEndian.Uint16(v[2*k:])
				k++
			}
		}
	}
	return nil
}

// StageCopy copies n bytes of src at srcOff into dst at dstOff. It may be
// called from any goroutine and is never captured (kernels.DeltaStager).
func (be *Backend) StageCopy(dst *kernels.Buffer, dstOff int, src *kernels.Buffer, srcOff, n int) error {
	d, err := be.host("stage copy", "dst", dst)
	if err != nil {
		return err
	}
	s, err := be.host("stage copy", "src", src)
	if err != nil {
		return err
	}
	if n < 0 || dstOff < 0 || srcOff < 0 || dstOff > len(d)-n || srcOff > len(s)-n {
		return fmt.Errorf("cpu: stage copy: %d bytes from offset %d of %v (%d bytes) to offset %d of %v (%d bytes)",
			n, srcOff, src, len(s), dstOff, dst, len(d))
	}
	copy(d[dstOff:dstOff+n], s[srcOff:srcOff+n])
	return nil
}
