//go:build !amd64

package refit

// changedBitmapVector: the portable loops do all the work here.
func changedBitmapVector(bm, old, new []byte) (done, changed int) { return 0, 0 }

// countChangedVector: the portable loop does all the work here.
func countChangedVector(old, new []byte) (done, changed int) { return 0, 0 }
