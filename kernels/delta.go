package kernels

import (
	"encoding/binary"
	"fmt"
	"math/bits"
)

// Sparse BF16 deltas: how a refit version that changes few weights is
// applied (refit/PROTOCOL.md, "Delta tensors"). A delta names, span by span
// of a BF16 buffer, the elements that change, by an index list or a bitmap,
// and gives their new values.

// DeltaSpanElems is the most elements one span covers: an element's index
// within its span fits 16 bits, and a span's bitmap is at most 2048 words.
const DeltaSpanElems = 1 << 16

// How a span names the elements it writes.
const (
	// DeltaIndices: Count 16-bit element indices within the span, strictly
	// increasing, each below Len, two to a 32-bit word of the masks, the
	// lower half first (the little-endian bytes of a uint16 array).
	DeltaIndices = 0
	// DeltaBitmap: ceil(Len/32) 32-bit words; bit b of word w (least
	// significant first) marks element 32w+b of the span. Exactly Count
	// bits are set, none at or past Len.
	DeltaBitmap = 1
)

// DeltaSpanWords is the number of int32s that describe one span in
// ScatterBF16Args.Spans.
const DeltaSpanWords = 8

// DeltaSpan is one span of a scatter: the elements [Start, Start+Len) of
// the op's region (relative to its Offset), of which Count are written.
type DeltaSpan struct {
	Start int64 // first element, relative to the op's Offset
	Len   int32 // elements, 1 to DeltaSpanElems
	Form  int32 // DeltaIndices or DeltaBitmap
	Count int32 // elements written, 0 to Len
	Mask  int32 // first word of its index list or bitmap in the masks
	Value int32 // first of its Count values
}

// MaskWords is the number of 32-bit words of the masks the span reads:
// ceil(Count/2) for an index list, ceil(Len/32) for a bitmap.
func (s DeltaSpan) MaskWords() int {
	if s.Form == DeltaBitmap {
		return (int(s.Len) + 31) / 32
	}
	return (int(s.Count) + 1) / 2
}

// Words encodes s as the DeltaSpanWords int32s of ScatterBF16Args.Spans:
// Start's low and high 32 bits, Len, Form, Count, Mask, Value, and 0.
func (s DeltaSpan) Words() [DeltaSpanWords]int32 {
	return [DeltaSpanWords]int32{int32(uint32(s.Start)), int32(uint32(uint64(s.Start) >> 32)), s.Len, s.Form, s.Count, s.Mask, s.Value, 0}
}

// AppendDeltaSpans appends the little-endian bytes of the spans' Words: the
// contents of a ScatterBF16Args.Spans buffer.
func AppendDeltaSpans(b []byte, spans []DeltaSpan) []byte {
	for _, s := range spans {
		for _, w := range s.Words() {
			b = binary.LittleEndian.AppendUint32(b, uint32(w))
		}
	}
	return b
}

// ScatterBF16Args writes BF16 values into Dst span by span: how a sparse
// weight delta is applied. Dst is addressed as a flat array of elements,
// whatever its shape. For each span s, the k-th element it names (in
// increasing order), element j of the span, takes the k-th of its values:
//
//	Dst[Offset + s.Start + j] = Values[s.Value + k]
//
// Only the elements [Offset, Offset+Len) of Dst are written: every span
// must lie inside them. Spans must not overlap (the order of their writes
// is unspecified).
//
// A span that breaks a rule (Len or Start out of range, an unknown form,
// Count above Len, its words or values outside Masks or Values, indices
// that are not strictly increasing or not below Len, a bitmap that marks
// another number of elements than Count or any at or past Len) is an
// error, on the call or at the next Sync, naming the span; it writes
// nothing, and what the other spans wrote is unspecified.
type ScatterBF16Args struct {
	Dst    *Buffer // BF16, any shape
	Offset int     // first element of the region written
	Len    int     // elements of the region
	Spans  *Buffer // I32 [S, DeltaSpanWords]: DeltaSpan.Words of each span
	Masks  *Buffer // I32 [M]: the spans' index lists and bitmaps
	Values *Buffer // BF16 [V]: the spans' values
}

// Validate checks the operands and returns the number of spans.
func (a ScatterBF16Args) Validate() (spans int, err error) {
	if a.Dst == nil || a.Dst.DType() != BF16 {
		return 0, fmt.Errorf("kernels: scatter bf16: dst %v: want bf16", a.Dst)
	}
	if a.Offset < 0 || a.Len < 0 || a.Offset > a.Dst.Len()-a.Len {
		return 0, fmt.Errorf("kernels: scatter bf16: elements [%d, %d+%d) outside dst %v of %d elements", a.Offset, a.Offset, a.Len, a.Dst, a.Dst.Len())
	}
	if err := check("scatter bf16", "spans", a.Spans, I32, 2); err != nil {
		return 0, err
	}
	if a.Spans.Dim(1) != DeltaSpanWords {
		return 0, fmt.Errorf("kernels: scatter bf16: spans %v: want [S, %d]", a.Spans, DeltaSpanWords)
	}
	if err := check("scatter bf16", "masks", a.Masks, I32, 1); err != nil {
		return 0, err
	}
	if err := check("scatter bf16", "values", a.Values, BF16, 1); err != nil {
		return 0, err
	}
	return a.Spans.Dim(0), disjoint("scatter bf16", []operand{{"dst", a.Dst}}, []operand{{"spans", a.Spans}, {"masks", a.Masks}, {"values", a.Values}})
}

// HostScatterBF16 is a ScatterBF16 whose spans, masks and values are in
// host memory: what DeltaStager.StageScatterBF16 takes.
type HostScatterBF16 struct {
	Dst    *Buffer // BF16, any shape
	Offset int     // first element of the region written
	Len    int     // elements of the region
	Spans  []DeltaSpan
	Masks  []byte // little-endian 32-bit words
	Values []byte // little-endian BF16 values
}

// Validate checks the operands and every span (CheckDeltaSpan).
func (a HostScatterBF16) Validate() error {
	if a.Dst == nil || a.Dst.DType() != BF16 {
		return fmt.Errorf("kernels: scatter bf16: dst %v: want bf16", a.Dst)
	}
	if a.Offset < 0 || a.Len < 0 || a.Offset > a.Dst.Len()-a.Len {
		return fmt.Errorf("kernels: scatter bf16: elements [%d, %d+%d) outside dst %v of %d elements", a.Offset, a.Offset, a.Len, a.Dst, a.Dst.Len())
	}
	if len(a.Masks)%4 != 0 || len(a.Values)%2 != 0 {
		return fmt.Errorf("kernels: scatter bf16: %d bytes of masks and %d of values: want whole words and values", len(a.Masks), len(a.Values))
	}
	for i, s := range a.Spans {
		if err := CheckDeltaSpan(s, a.Len, a.Masks, a.Values); err != nil {
			return fmt.Errorf("kernels: scatter bf16: span %d: %w", i, err)
		}
	}
	return nil
}

// CheckDeltaSpan checks span s against the rules of ScatterBF16Args for a
// region of n elements, with masks (32-bit words) and values (BF16) as
// little-endian bytes.
func CheckDeltaSpan(s DeltaSpan, n int, masks, values []byte) error {
	switch {
	case s.Len < 1 || s.Len > DeltaSpanElems:
		return fmt.Errorf("%d elements: want 1 to %d", s.Len, DeltaSpanElems)
	case s.Start < 0 || s.Start > int64(n)-int64(s.Len):
		return fmt.Errorf("elements [%d, %d) outside the %d of the region", s.Start, s.Start+int64(s.Len), n)
	case s.Form != DeltaIndices && s.Form != DeltaBitmap:
		return fmt.Errorf("form %d: want %d (indices) or %d (bitmap)", s.Form, DeltaIndices, DeltaBitmap)
	case s.Count < 0 || s.Count > s.Len:
		return fmt.Errorf("%d values for %d elements", s.Count, s.Len)
	case s.Mask < 0 || int64(s.Mask)+int64(s.MaskWords()) > int64(len(masks)/4):
		return fmt.Errorf("words [%d, %d) outside the %d of the masks", s.Mask, int64(s.Mask)+int64(s.MaskWords()), len(masks)/4)
	case s.Value < 0 || int64(s.Value)+int64(s.Count) > int64(len(values)/2):
		return fmt.Errorf("values [%d, %d) outside the %d given", s.Value, int64(s.Value)+int64(s.Count), len(values)/2)
	}
	m := masks[4*int(s.Mask):][:4*s.MaskWords()]
	if s.Form == DeltaIndices {
		prev := -1
		for k := range int(s.Count) {
			j := int(binary.LittleEndian.Uint16(m[2*k:]))
			if j >= int(s.Len) || j <= prev {
				return fmt.Errorf("index %d is %d (after %d): want strictly increasing indices below %d", k, j, prev, s.Len)
			}
			prev = j
		}
		return nil
	}
	set := 0
	for w := range s.MaskWords() {
		word := binary.LittleEndian.Uint32(m[4*w:])
		if past := 32*(w+1) - int(s.Len); past > 0 && word>>(32-past) != 0 {
			return fmt.Errorf("bitmap word %d marks elements past the span's %d", w, s.Len)
		}
		set += bits.OnesCount32(word)
	}
	if set != int(s.Count) {
		return fmt.Errorf("bitmap marks %d elements, the span has %d values", set, s.Count)
	}
	return nil
}

// DeltaStager is implemented by backends whose staging (Stager) also
// applies sparse BF16 deltas: the refit path writes a delta version into
// the resident weight stacks, and into staging buffers, while the
// op-issuing goroutine keeps working. Like Stage, its methods may be called
// from any goroutine, are never captured, and return once the bytes are
// written; the caller guarantees that no op reads or writes the bytes they
// write (nor writes those they read) meanwhile.
type DeltaStager interface {
	Stager
	// StageScatterBF16 is ScatterBF16 with its spans, masks and values in
	// host memory. A span that breaks a rule is an error of the call.
	StageScatterBF16(a HostScatterBF16) error
	// StageCopy copies n bytes of src from byte offset srcOff into dst at
	// byte offset dstOff (device to device).
	StageCopy(dst *Buffer, dstOff int, src *Buffer, srcOff, n int) error
}

// AmaxStager is implemented by backends that measure a BF16 stack's
// matrices on the staging path, after the bytes staged so far and off the
// op stream: the refit path takes the amax of the experts a version
// rewrote before the commit, so that the commit's requantization
// (QuantizeArgs.Amax) reads each matrix once instead of twice while
// generation waits.
type AmaxStager interface {
	// StageAmax writes each matrix's largest |value| of src (BF16 [E, N,
	// K]) into dst (F32 [E]), after every byte staged so far; StageSync
	// waits for it. The caller guarantees no op writes src or touches dst
	// meanwhile.
	StageAmax(dst, src *Buffer) error
}

// ValidateAmax checks StageAmax's operands and returns E and N x K.
func ValidateAmax(dst, src *Buffer) (mats, per int, err error) {
	if err := check("stage amax", "src", src, BF16, 3); err != nil {
		return 0, 0, err
	}
	if err := check("stage amax", "dst", dst, F32, 1); err != nil {
		return 0, 0, err
	}
	if err := shapeIs("stage amax", "dst", dst, src.Dim(0)); err != nil {
		return 0, 0, err
	}
	return src.Dim(0), src.Dim(1) * src.Dim(2), disjoint("stage amax", []operand{{"dst", dst}}, []operand{{"src", src}})
}
