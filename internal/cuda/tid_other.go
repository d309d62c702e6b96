//go:build !linux

package cuda

// gettid is not available here: the owner-thread check is off (0 matches).
func gettid() int { return 0 }
