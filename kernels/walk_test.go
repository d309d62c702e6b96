package kernels

import (
	"slices"
	"testing"
)

// TestAppendBuffersScatter checks that an optional operand behind a pointer
// (GroupedGemmArgs.Scatter) is walked: backends check its buffers'
// ownership and list them in captured graphs through AppendBuffers.
func TestAppendBuffersScatter(t *testing.T) {
	bufs := make([]*Buffer, 7)
	for i := range bufs {
		bufs[i] = &Buffer{dtype: F32, shape: []int{1}}
	}
	args := GroupedGemmArgs{A: Operand{BF16: bufs[0]}, W: Operand{BF16: bufs[1]}, Offsets: bufs[2],
		Scatter: &Scatter{Acc: bufs[3], Tokens: bufs[4], Weights: bufs[5], Slots: bufs[6]}}
	got := AppendBuffers(nil, map[*Buffer]bool{}, args)
	for i, b := range bufs {
		if !slices.Contains(got, b) {
			t.Errorf("buffer %d not listed", i)
		}
	}
	if len(got) != len(bufs) {
		t.Errorf("%d buffers listed, want %d", len(got), len(bufs))
	}
	args.Scatter = nil // a nil pointer is skipped
	if got := AppendBuffers(nil, map[*Buffer]bool{}, args); len(got) != 3 {
		t.Errorf("without a scatter: %d buffers listed, want 3", len(got))
	}
}
