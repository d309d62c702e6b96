package sched

import "fmt"

// Pages hands out KV-cache pages. A request reserves pages on admission
// and takes them one at a time as tokens arrive: with reservations for
// the whole request (the default) a running sample never waits for memory;
// with pages on demand the reservation covers only the prompt and each
// sample's first page, and samples grow into pages nobody reserved (Grow).
// Shared pages (a prompt's full pages, used by all of its samples) are
// reference counted.
type Pages struct {
	free     []int
	refs     []int
	taken    int
	reserved int // promised to admitted requests, not yet taken
	// cache, when set, holds pages of prompt prefixes that nobody else
	// may hold: they are evicted when pages run short.
	cache *prefixCache
}

// NewPages returns an allocator of n pages. Take hands out low pages first.
func NewPages(n int) *Pages {
	a := &Pages{free: make([]int, n), refs: make([]int, n)}
	for i := range a.free {
		a.free[i] = n - 1 - i // Take pops from the end: low pages first
	}
	return a
}

// Reserve promises n pages, evicting cached prefixes as needed; false
// when they are not available (nothing is evicted then).
func (a *Pages) Reserve(n int) bool {
	if short := a.taken + a.reserved + n - len(a.refs); short > 0 {
		if a.cache == nil || a.cache.evictable() < short {
			return false
		}
		for range short {
			a.cache.evictOne()
		}
	}
	a.reserved += n
	return true
}

// Unreserve returns n promised pages that will not be taken.
func (a *Pages) Unreserve(n int) { a.reserved -= n }

// Take hands out a reserved page with one reference.
func (a *Pages) Take() (int, error) {
	if a.reserved <= 0 || len(a.free) == 0 {
		return 0, fmt.Errorf("policy: kv cache: no reserved page left (%d taken, %d reserved, %d free)", a.taken, a.reserved, len(a.free))
	}
	p := a.free[len(a.free)-1]
	a.free = a.free[:len(a.free)-1]
	a.reserved--
	a.taken++
	a.refs[p] = 1
	return p, nil
}

// Avail returns the free pages nobody has reserved.
func (a *Pages) Avail() int { return len(a.free) - a.reserved }

// Reclaimable returns Avail plus the cached prefix pages Grow and Reserve
// may evict.
func (a *Pages) Reclaimable() int {
	n := a.Avail()
	if a.cache != nil {
		n += a.cache.evictable()
	}
	return n
}

// Grow hands out a free page nobody reserved, with one reference,
// evicting a cached prefix if it must; false when there is none.
func (a *Pages) Grow() (int, bool) {
	if a.Avail() <= 0 && (a.cache == nil || !a.cache.evictOne()) {
		return 0, false
	}
	p := a.free[len(a.free)-1]
	a.free = a.free[:len(a.free)-1]
	a.taken++
	a.refs[p] = 1
	return p, true
}

// Share adds k references to page p.
func (a *Pages) Share(p, k int) { a.refs[p] += k }

// Release drops one reference; the page is free again at zero.
func (a *Pages) Release(p int) {
	a.refs[p]--
	if a.refs[p] == 0 {
		a.free = append(a.free, p)
		a.taken--
	}
}

// InUse returns the pages held by sequences.
func (a *Pages) InUse() int { return a.taken }

// Reserved returns the pages promised and not yet taken.
func (a *Pages) Reserved() int { return a.reserved }

// Refs returns page p's reference count.
func (a *Pages) Refs(p int) int { return a.refs[p] }
