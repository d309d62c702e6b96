package kernels

import (
	"strings"
	"testing"
)

// TestView: a view reinterprets a range of its parent's bytes under
// another dtype and shape, at the matching address, and refuses ranges
// that are misaligned or run past the parent.
func TestView(t *testing.T) {
	mem := make([]byte, 64)
	root, err := NewHostBuffer("owner", I32, []int{16}, mem, 0x1000)
	if err != nil {
		t.Fatal(err)
	}
	v, err := root.View(8, F32, 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	if v.DType() != F32 || v.Dim(0) != 2 || v.Dim(1) != 3 || v.Addr() != 0x1008 || v.Owner() != "owner" || len(v.Host()) != 24 {
		t.Fatalf("view %v: dtype %s, %d host bytes, owner %v", v, v.DType(), len(v.Host()), v.Owner())
	}
	v.Host()[0] = 7
	if mem[8] != 7 {
		t.Fatal("the view does not alias its parent")
	}
	for _, tc := range []struct {
		off   int
		dt    DType
		shape []int
	}{{2, I32, []int{1}}, {-4, I32, []int{1}}, {60, I32, []int{2}}, {0, BF16, []int{33}}} {
		if _, err := root.View(tc.off, tc.dt, tc.shape...); err == nil || !strings.Contains(err.Error(), "view") {
			t.Errorf("View(%d, %s, %v): %v, want an error", tc.off, tc.dt, tc.shape, err)
		}
	}
}
