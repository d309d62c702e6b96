// Package sched is the generation engine's scheduler: the requests, their
// admission, the KV-cache page allocator, the running samples, prefill
// chunking under a step's token budget, and the bookkeeping that turns a
// step's sampled tokens into emitted tokens, finished samples and forks.
//
// It has no model and no backend. A step is planned as plain data (a Plan:
// tokens, positions, KV slots, page table, query starts, logit rows,
// sampling rows, the owner of every logit row, and the page copies to do
// first); an executor runs it; its Results (a token and a logprob per logit
// row, the routed experts when some owner asked) are committed back. So the
// scheduler is tested with scripts of submits, aborts and fake sampled
// tokens, without a model (sched_test.go).
//
// Planning and committing allocate nothing on the host for decode steps in
// steady state: plans are two preallocated buffers used in turn, and a
// sample's output slices are allocated for max_tokens when it is forked.
//
// Up to two steps may be planned before the first is committed: step N+1 is
// planned while N runs, assuming every sample decoding in N goes on. Its
// decode inputs then come from N's sampled tokens on the device (Plan.Feed),
// a sample that cannot go past N (max_tokens) gets no row in N+1, and a
// sample that ends at N (a stop token, a failed draw, an abort) has its row
// of N+1 discarded at commit, its pages released only once N+1, which may
// still write them, has been committed.
//
// KV pages are reserved for a request's whole max_tokens on admission, or
// with Config.OnDemand taken as samples grow: admission then reserves the
// prompt's pages and each sample's first page, leaving a page free for
// every running sample, and a sample that needs a page nobody has makes
// room by preempting the youngest work (requests are aged by admission,
// samples of one request by index): running samples, samples being
// recomputed, prompts being prefilled. The oldest is never preempted, so
// something always progresses. A preempted sample keeps the tokens it has
// emitted, frees its pages (once the step in flight that may write them is
// committed; its row in that step is discarded) and, ahead of any new
// request, is recomputed: its prompt and tokens prefilled again into pages
// of its own, the last chunk's row drawing its next token. Draws are keyed
// by (seed, sample, position) and the kernels are batch invariant, so its
// tokens and logprobs are bitwise those it would have produced unpreempted.
//
// A Scheduler is driven by one goroutine (the engine's loop).
package sched
