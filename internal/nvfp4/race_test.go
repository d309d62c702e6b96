//go:build race

package nvfp4

// The race detector slows the exhaustive sweeps about tenfold; they
// sample instead (see exhaustiveStride).
func init() { raceEnabled = true }
