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
// A Scheduler is driven by one goroutine (the engine's loop).
package sched
