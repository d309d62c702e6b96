//go:build !amd64

package refit

// changedBitmapVector: the portable loops do all the work here.
func changedBitmapVector(bm, old, new []byte) (done, changed int) { return 0, 0 }
