package sched

// Plan is one step as plain data: T tokens of S sequences (packed: sequence
// s owns tokens QueryStart[s] .. QueryStart[s+1]), the token rows whose
// logits are sampled, who owns each of those rows, and the page copies to
// do before the forward pass. Its slices are the scheduler's: valid until
// the step is committed, and not to be changed by the executor.
type Plan struct {
	// Step numbers the plans, from 1; they are committed in this order.
	Step uint64
	// Version is the policy version the step runs under (set by the
	// engine; every token the step draws records it).
	Version uint64

	Tokens    []int32 // [T]; -1 where Feed names the token instead
	Positions []int32 // [T]
	Slots     []int32 // [T]: KV-cache slot page*PageSize + offset
	// Feed [T]: where >= 0, the token's input is the token sampled in the
	// previous step's logit row Feed[i] (still on the device when this
	// step was planned); -1 takes Tokens[i].
	Feed []int32
	// Fed reports whether some Feed entry is >= 0.
	Fed bool

	SeqLens    []int32 // [S]: tokens in the cache once this step has run
	QueryStart []int32 // [S+1]
	// PageTable is S rows of Width page ids; row s holds the sequence's
	// first ceil(SeqLens[s] / PageSize) pages, and its other entries are
	// stale (never read).
	PageTable []int32
	Width     int

	LogitRows []int32     // [L]: rows of the T tokens
	Sampling  []SampleRow // [L]
	Owners    []Owner     // [L]

	// Copies are done, in order, before the forward pass: a forked
	// sample's copy of its prompt's partial last page.
	Copies []PageCopy
	// DecodeOnly: one token per sequence, every one sampled (a step a
	// captured graph can replay).
	DecodeOnly bool
	// Routing: some owner asked for the routed experts of its tokens.
	Routing bool

	table []int32 // PageTable's storage: MaxSeqs rows
}

// Owner is the owner of a logit row: a decoding sample, or sample Sample of
// a request whose prefill ends in this step (forked when the step is
// committed).
type Owner struct {
	Seq    *Seq
	Req    *Req
	Sample int
}

// PageCopy asks for KV page Src to be copied to page Dst in every layer.
type PageCopy struct{ Dst, Src int }

// Results are what an executed step returns: a token and its logprob per
// logit row.
type Results struct {
	Tokens   []int32   // [L]; Unsampled where nothing could be drawn
	LogProbs []float32 // [L]
	// Routing, when the plan asked for it: per layer, the TopK expert ids
	// of each of the step's T tokens ([layer][token*TopK + j]).
	Routing [][]int32
	// Graph reports that the step was replayed from a captured graph.
	Graph bool
}

// PageRow returns row s of the page table: the pages the sequence's
// SeqLens[s] tokens occupy.
func (p *Plan) PageRow(s, pageSize int) []int32 {
	n := (int(p.SeqLens[s]) + pageSize - 1) / pageSize
	return p.PageTable[s*p.Width : s*p.Width+n]
}

func (p *Plan) reset() {
	p.Tokens, p.Positions, p.Slots, p.Feed = p.Tokens[:0], p.Positions[:0], p.Slots[:0], p.Feed[:0]
	p.SeqLens, p.QueryStart = p.SeqLens[:0], append(p.QueryStart[:0], 0)
	p.LogitRows, p.Sampling, p.Owners, p.Copies = p.LogitRows[:0], p.Sampling[:0], p.Owners[:0], p.Copies[:0]
	p.PageTable = p.table[:0]
	p.Fed, p.DecodeOnly, p.Routing, p.Version = false, true, false, 0
	clear(p.Owners[:cap(p.Owners)]) // drop references to finished samples
}
