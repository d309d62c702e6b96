package nvfp4

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// TestSwizzleOffsetDoc checks the offsets listed in docs/NVFP4.md section 6 (K/16 = 8).
func TestSwizzleOffsetDoc(t *testing.T) {
	_, colsP := SwizzledDims(256, 8)
	cases := []struct{ m, k, want int }{
		{0, 0, 0}, {1, 0, 16}, {32, 0, 4}, {0, 1, 1}, {0, 4, 512}, {127, 3, 511}, {128, 0, 1024},
	}
	for _, c := range cases {
		if got := SwizzleOffset(c.m, c.k, colsP); got != c.want {
			t.Errorf("SwizzleOffset(%d, %d, %d) = %d, want %d", c.m, c.k, colsP, got, c.want)
		}
	}
}

// TestSwizzledDims: rows round up to 128, blocks to 4.
func TestSwizzledDims(t *testing.T) {
	cases := []struct{ rows, blocks, rowsP, colsP int }{
		{1, 1, 128, 4}, {128, 4, 128, 4}, {129, 5, 256, 8}, {200, 8, 256, 8}, {256, 13, 256, 16},
	}
	for _, c := range cases {
		if r, k := SwizzledDims(c.rows, c.blocks); r != c.rowsP || k != c.colsP {
			t.Errorf("SwizzledDims(%d, %d) = %d, %d; want %d, %d", c.rows, c.blocks, r, k, c.rowsP, c.colsP)
		}
	}
}

// swizzleOffsetRef is section 6's formula written out independently: the
// 128-row tile, then the 4-column group, then the 32x4x4 interleave.
func swizzleOffsetRef(m, k, colsP int) int {
	tileRow, inTile := m/128, m%128
	return tileRow*(colsP/4)*512 + (k/4)*512 + (inTile%32)*16 + (inTile/32)*4 + k%4
}

// TestSwizzle: Swizzle is a bijection from the rows x blocks scales onto the
// non-padding positions, padding bytes are zero, and Unswizzle inverts it.
func TestSwizzle(t *testing.T) {
	shapes := []struct{ rows, blocks int }{
		{1, 1}, {1, 4}, {3, 5}, {32, 4}, {100, 7}, {128, 4}, {128, 8}, {129, 3}, {200, 8}, {256, 12}, {300, 13},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, s := range shapes {
		name := fmt.Sprintf("%dx%d", s.rows, s.blocks)
		rowsP, colsP := SwizzledDims(s.rows, s.blocks)

		// Bijection onto the non-padding positions, checked with the offsets.
		owner := make([]int, rowsP*colsP)
		for i := range owner {
			owner[i] = -1
		}
		for m := range s.rows {
			for k := range s.blocks {
				off := SwizzleOffset(m, k, colsP)
				if ref := swizzleOffsetRef(m, k, colsP); off != ref {
					t.Fatalf("%s: SwizzleOffset(%d, %d) = %d, want %d", name, m, k, off, ref)
				}
				if off < 0 || off >= len(owner) {
					t.Fatalf("%s: offset %d of (%d, %d) outside %d bytes", name, off, m, k, len(owner))
				}
				if owner[off] != -1 {
					t.Fatalf("%s: (%d, %d) and element %d share offset %d", name, m, k, owner[off], off)
				}
				owner[off] = m*s.blocks + k
			}
		}
		// The padded grid is a bijection onto all rowsP*colsP bytes.
		seen := make([]bool, rowsP*colsP)
		for m := range rowsP {
			for k := range colsP {
				off := SwizzleOffset(m, k, colsP)
				if seen[off] {
					t.Fatalf("%s: padded offset %d hit twice", name, off)
				}
				seen[off] = true
			}
		}

		// Swizzle with nonzero data (1..255) into a dirty buffer.
		linear := make([]byte, s.rows*s.blocks)
		for i := range linear {
			linear[i] = byte(1 + rng.IntN(255))
		}
		sw := make([]byte, rowsP*colsP)
		for i := range sw {
			sw[i] = 0xAA
		}
		if err := Swizzle(sw, linear, s.rows, s.blocks); err != nil {
			t.Fatalf("%s: Swizzle: %v", name, err)
		}
		for off, b := range sw {
			if o := owner[off]; o == -1 {
				if b != 0 {
					t.Errorf("%s: padding byte %d = 0x%02X, want 0", name, off, b)
				}
			} else if b != linear[o] {
				t.Errorf("%s: byte %d = 0x%02X, want linear[%d] = 0x%02X", name, off, b, o, linear[o])
			}
		}
		back := make([]byte, len(linear))
		if err := Unswizzle(back, sw, s.rows, s.blocks); err != nil {
			t.Fatalf("%s: Unswizzle: %v", name, err)
		}
		checkBytes(t, name+": Unswizzle(Swizzle(x))", back, linear)
	}
}

// TestSwizzleSizeErrors: wrong buffer sizes are reported.
func TestSwizzleSizeErrors(t *testing.T) {
	cases := []struct {
		name                 string
		rows, blocks, nl, ns int
	}{
		{"linear short", 3, 5, 14, 128 * 8},
		{"linear long", 3, 5, 16, 128 * 8},
		{"swizzled unpadded", 3, 5, 15, 15},
		{"swizzled short", 3, 5, 15, 128*8 - 1},
		{"swizzled long", 3, 5, 15, 128*8 + 1},
		{"rows not padded", 129, 4, 129 * 4, 129 * 4},
	}
	for _, c := range cases {
		if err := Swizzle(make([]byte, c.ns), make([]byte, c.nl), c.rows, c.blocks); err == nil {
			t.Errorf("%s: Swizzle gave no error", c.name)
		}
		if err := Unswizzle(make([]byte, c.nl), make([]byte, c.ns), c.rows, c.blocks); err == nil {
			t.Errorf("%s: Unswizzle gave no error", c.name)
		}
	}
}
