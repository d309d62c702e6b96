package policy

import "fmt"

// pageAlloc hands out KV-cache pages. A request reserves, on admission, the
// most pages it can ever hold, so a running sample never waits for memory
// and nothing is ever preempted; pages are then taken one at a time as
// tokens arrive. Shared pages (a prompt's full pages, used by all of its
// samples) are reference counted. Owned by the engine loop.
type pageAlloc struct {
	free     []int
	refs     []int
	taken    int
	reserved int // promised to admitted requests, not yet taken
}

func newPageAlloc(n int) pageAlloc {
	a := pageAlloc{free: make([]int, n), refs: make([]int, n)}
	for i := range a.free {
		a.free[i] = n - 1 - i // take() pops from the end: low pages first
	}
	return a
}

// reserve promises n pages; false when they are not available.
func (a *pageAlloc) reserve(n int) bool {
	if a.taken+a.reserved+n > len(a.refs) {
		return false
	}
	a.reserved += n
	return true
}

// unreserve returns n promised pages that will not be taken.
func (a *pageAlloc) unreserve(n int) { a.reserved -= n }

// take hands out a reserved page with one reference.
func (a *pageAlloc) take() (int, error) {
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

// share adds k references to page p.
func (a *pageAlloc) share(p, k int) { a.refs[p] += k }

// release drops one reference; the page is free again at zero.
func (a *pageAlloc) release(p int) {
	a.refs[p]--
	if a.refs[p] == 0 {
		a.free = append(a.free, p)
		a.taken--
	}
}

// inUse returns the pages held by sequences.
func (a *pageAlloc) inUse() int { return a.taken }
