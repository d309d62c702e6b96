package sched

import (
	"slices"
)

// prefixCache keeps the KV pages of prompt prefixes for reuse by later
// requests: an entry is one full page of a prompt (PageSize tokens),
// reached from the entry of the page before it, so a lookup walks a
// prompt's pages from the first and shares the longest chain that holds
// exactly its tokens. Entries belong to one policy version: a version
// change drops them all, so KV computed under old weights never serves a
// new version's tokens.
//
// The cache holds one reference to each entry's page; an entry whose page
// nobody else holds is evictable, least recently used first (the deepest
// first among equals, so chains shrink from their ends).
type prefixCache struct {
	ps      int
	pages   *Pages
	version uint64
	byHash  map[uint64][]*prefixEntry
	entries []*prefixEntry // live entries, in no order
	clock   uint64
	evicted uint64 // entries evicted for their pages
}

type prefixEntry struct {
	hash   uint64
	parent *prefixEntry // nil for a prompt's first page
	tokens []int32      // the page's tokens
	page   int
	depth  int    // pages before this one in its prompt
	used   uint64 // clock of the last lookup or insert that touched it
	live   bool
}

func newPrefixCache(ps int, pages *Pages) *prefixCache {
	return &prefixCache{ps: ps, pages: pages, byHash: map[uint64][]*prefixEntry{}}
}

// chainHash extends a prefix's hash by one page of tokens (FNV-1a, 64
// bits). Lookups compare tokens and parents too: a collision costs a
// miss, never a wrong page.
func chainHash(h uint64, tokens []int32) uint64 {
	const prime = 1099511628211
	if h == 0 {
		h = 14695981039346656037
	}
	for _, t := range tokens {
		for k := range 4 {
			h ^= uint64(byte(uint32(t) >> (8 * k)))
			h *= prime
		}
	}
	return h
}

// find returns the live entry of parent's chain holding tokens.
func (c *prefixCache) find(h uint64, parent *prefixEntry, tokens []int32) *prefixEntry {
	for _, e := range c.byHash[h] {
		if e.live && e.parent == parent && slices.Equal(e.tokens, tokens) {
			return e
		}
	}
	return nil
}

// match returns the entries of the longest cached chain over the first
// pages full pages of the sequence tok(0), tok(1), ..., marking them used.
func (c *prefixCache) match(tok func(i int) int32, pages int) []*prefixEntry {
	if len(c.entries) == 0 || pages <= 0 {
		return nil
	}
	c.clock++
	buf := make([]int32, c.ps)
	var out []*prefixEntry
	var parent *prefixEntry
	var h uint64
	for i := range pages {
		for j := range buf {
			buf[j] = tok(i*c.ps + j)
		}
		h = chainHash(h, buf)
		e := c.find(h, parent, buf)
		if e == nil {
			break
		}
		e.used = c.clock
		out = append(out, e)
		parent = e
	}
	return out
}

// insert adds the full pages of a prefilled prompt (pages[i] holds tokens
// i*ps .. (i+1)*ps-1 of prompt), taking a reference to each page it adds.
// A page whose prefix is cached already (by this prompt's own lookup, or by
// an identical prompt prefilled alongside) is not added again.
func (c *prefixCache) insert(prompt []int32, pages []int) {
	c.clock++
	var parent *prefixEntry
	var h uint64
	for i, pg := range pages {
		tokens := prompt[i*c.ps : (i+1)*c.ps]
		h = chainHash(h, tokens)
		if e := c.find(h, parent, tokens); e != nil {
			e.used = c.clock
			parent = e
			continue
		}
		e := &prefixEntry{hash: h, parent: parent, tokens: slices.Clone(tokens), page: pg, depth: i, used: c.clock, live: true}
		c.pages.Share(pg, 1)
		c.byHash[h] = append(c.byHash[h], e)
		c.entries = append(c.entries, e)
		parent = e
	}
}

// evictable counts the entries whose page only the cache holds.
func (c *prefixCache) evictable() int {
	n := 0
	for _, e := range c.entries {
		if c.pages.Refs(e.page) == 1 {
			n++
		}
	}
	return n
}

// evictOne frees the page of the least recently used evictable entry;
// false when none is.
func (c *prefixCache) evictOne() bool {
	victim := -1
	for i, e := range c.entries {
		if c.pages.Refs(e.page) != 1 {
			continue
		}
		if victim < 0 {
			victim = i
			continue
		}
		v := c.entries[victim]
		if e.used < v.used || (e.used == v.used && e.depth > v.depth) {
			victim = i
		}
	}
	if victim < 0 {
		return false
	}
	c.drop(victim)
	c.evicted++
	return true
}

// drop removes entry i and releases its page.
func (c *prefixCache) drop(i int) {
	e := c.entries[i]
	e.live = false
	list := slices.DeleteFunc(c.byHash[e.hash], func(x *prefixEntry) bool { return x == e })
	if len(list) == 0 {
		delete(c.byHash, e.hash)
	} else {
		c.byHash[e.hash] = list
	}
	last := len(c.entries) - 1
	c.entries[i], c.entries[last] = c.entries[last], nil
	c.entries = c.entries[:last]
	c.pages.Release(e.page)
}

// setVersion drops every entry when the policy version changes.
func (c *prefixCache) setVersion(v uint64) {
	if v == c.version {
		return
	}
	c.version = v
	for len(c.entries) > 0 {
		c.drop(len(c.entries) - 1)
	}
}

// size returns the live entries (cached pages).
func (c *prefixCache) size() int { return len(c.entries) }
