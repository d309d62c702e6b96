package refit

import "golang.org/x/sys/cpu"

// The delta encoder's compares on x86-64 with AVX2: 64 bytes (32 BF16
// elements) a step, compared as 16-bit lanes and packed into one 32-bit
// mask, the bitmap form's layout (changed_amd64.s).

//go:noescape
func changedBitmapAVX2(bm, old, new []byte) int

// changedBitmapVector fills bm for old and new's whole blocks of 32
// elements where the machine has AVX2, and returns the elements done and
// how many of them changed (0, 0 without AVX2).
func changedBitmapVector(bm, old, new []byte) (done, changed int) {
	if !cpu.X86.HasAVX2 {
		return 0, 0
	}
	w := len(new) &^ 63
	if w == 0 {
		return 0, 0
	}
	_ = bm[w/16-1] // the assembly writes this much
	return w / 2, changedBitmapAVX2(bm, old[:w], new[:w])
}
