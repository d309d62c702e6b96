package kernels

import (
	"fmt"
	"time"
)

// Marker marks where groups of ops begin on a backend's op stream. A model
// given one calls Mark before each group of its forward pass (the
// embedding, the dense projections, attention, the router, the experts,
// sampling, ...).
type Marker interface {
	// Mark records a point after every op issued so far; the ops issued
	// from it to the next point belong to group. Inside a capture the point
	// becomes part of the graph and is recorded at every launch.
	Mark(group string) error
}

// Profile is a Marker whose points the device records, so the device time
// of each group can be read back once the marked work has run.
type Profile interface {
	Marker
	// Groups returns the device time between each point and the next,
	// summed by group, for the last run of the marked work (after a Sync,
	// or after the launch of a graph captured with the marks, and a Sync).
	Groups() (map[string]time.Duration, error)
	// Close releases the profile's device resources; graphs captured with
	// its marks must not be launched after it.
	Close() error
}

// Profiler is implemented by backends that time marked work on the device
// (the CUDA backend, with events).
type Profiler interface {
	NewProfile() (Profile, error)
}

// BatchCopier is implemented by backends that issue many copies in one
// call, for less than one Copy each costs where every call crosses to the
// thread that owns the device: the refit commit copies hundreds of staged
// tensors while generation waits.
type BatchCopier interface {
	// CopyAll copies src[i] into dst[i] for every i, in order, as Copy
	// does. It checks every pair before it copies any.
	CopyAll(dst, src []*Buffer) error
}

// CopyAll copies src[i] into dst[i] for every i: through be's CopyAll if it
// has one, else one Copy at a time after checking every pair's sizes.
func CopyAll(be Backend, dst, src []*Buffer) error {
	if len(dst) != len(src) {
		return fmt.Errorf("copy all: %d destinations for %d sources", len(dst), len(src))
	}
	if bc, ok := be.(BatchCopier); ok {
		return bc.CopyAll(dst, src)
	}
	for i := range dst {
		if dst[i] == nil || src[i] == nil || dst[i].Size() != src[i].Size() {
			return fmt.Errorf("copy all: pair %d: %v into %v", i, src[i], dst[i])
		}
	}
	for i := range dst {
		if err := be.Copy(dst[i], src[i]); err != nil {
			return err
		}
	}
	return nil
}

// GemmSetter is implemented by backends that run several GEMMs of one
// input in one launch (a layer's q, k and v projections): fewer launches
// where a decode step at one token is bound by them.
type GemmSetter interface {
	// GemmSet computes dst[i] = a * w[i]^T for every i, each with the bits
	// Gemm gives it alone.
	GemmSet(dst []*Buffer, a *Buffer, w []*Buffer) error
}

// GemmSet computes dst[i] = a * w[i]^T for every i: through be's GemmSet if
// it has one, else one Gemm at a time after checking them all.
func GemmSet(be Backend, dst []*Buffer, a *Buffer, w []*Buffer) error {
	if gs, ok := be.(GemmSetter); ok {
		return gs.GemmSet(dst, a, w)
	}
	if _, _, _, err := ValidateGemmSet(dst, a, w); err != nil {
		return err
	}
	for i := range dst {
		if err := be.Gemm(dst[i], a, w[i]); err != nil {
			return err
		}
	}
	return nil
}
