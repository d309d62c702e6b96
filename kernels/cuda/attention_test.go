package cuda

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

// attBench is a paged KV cache with b sequences and a query row (or
// several) for each, at Qwen3-30B-A3B's head geometry unless told.
type attBench struct {
	args    kernels.AttentionArgs
	scratch *kernels.Buffer
}

// newAttBench uploads a cache of pages of ps positions holding sequences
// of lens (each on its own pages, in a shuffled order), nq[i] query rows
// of sequence i, random values.
func newAttBench(t *testing.T, be *Backend, r *rand.Rand, qh, kvh, d, ps int, lens, nq []int) *attBench {
	t.Helper()
	maxPages := 0
	for _, l := range lens {
		maxPages = max(maxPages, (l+ps-1)/ps)
	}
	pages := len(lens) * maxPages
	perm := r.Perm(pages)
	table := make([]int32, pages)
	for i := range table {
		table[i] = int32(perm[i])
	}
	start := []int32{0}
	lens32 := make([]int32, len(lens))
	for i, l := range lens {
		lens32[i] = int32(l)
		start = append(start, start[i]+int32(nq[i]))
	}
	tq := int(start[len(lens)])
	rnd := func(n int) []byte {
		b := make([]byte, 2*n)
		for i := range n {
			v := bf16.FromFloat32(float32(r.NormFloat64()))
			b[2*i], b[2*i+1] = byte(v), byte(v>>8)
		}
		return b
	}
	up := func(data []byte, dt kernels.DType, shape ...int) *kernels.Buffer {
		t.Helper()
		return uploaded(t, be, data, dt, shape...)
	}
	// Large caches are left unset (zeros): only the sizes matter for timing.
	cache := kernels.KVCache{K: moetest.Alloc(t, be, kernels.BF16, pages, ps, kvh, d), V: moetest.Alloc(t, be, kernels.BF16, pages, ps, kvh, d)}
	if pages*ps*kvh*d <= 1<<24 {
		for _, c := range []*kernels.Buffer{cache.K, cache.V} {
			if err := be.Upload(c, 0, rnd(pages*ps*kvh*d)); err != nil {
				t.Fatal(err)
			}
		}
	}
	ab := &attBench{args: kernels.AttentionArgs{
		Out: moetest.Alloc(t, be, kernels.BF16, tq, qh, d), Q: up(rnd(tq*qh*d), kernels.BF16, tq, qh, d), Cache: cache,
		PageTable: up(kernels.Int32Bytes(table), kernels.I32, len(lens), maxPages), SeqLens: up(kernels.Int32Bytes(lens32), kernels.I32, len(lens)),
		QueryStart: up(kernels.Int32Bytes(start), kernels.I32, len(lens)+1), Scale: 0.088,
	}}
	if n := be.AttentionScratch(len(lens), qh, kvh, d, maxPages*ps); n > 0 {
		ab.scratch = moetest.Alloc(t, be, kernels.F32, (n+3)/4)
	}
	return ab
}

// run attends with the kernel mode picks, with the scratch or without, and
// returns the output's bytes.
func (ab *attBench) run(t *testing.T, be *Backend, mode attMode, scratch bool) []byte {
	t.Helper()
	a := ab.args
	if scratch {
		a.Scratch = ab.scratch
	}
	if err := be.attention(a, mode); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, a.Out.Size())
	if err := be.Download(got, a.Out, 0); err != nil {
		t.Fatal(err)
	}
	return got
}

// TestAttentionWidths runs att_tc in 4-warp and 1-warp blocks, with and
// without scratch (one-row tiles spread over blocks or not), on decode
// rows and prefill chunks whose sequences end inside, at and past split
// and group bounds: every output bit must agree. The conformance suite
// checks the kernels against the reference at sizes the host serves in
// 4-warp blocks; this ties the 1-warp blocks to them.
func TestAttentionWidths(t *testing.T) {
	be := gpu(t)
	lens := []int{1, 31, 100, 128, 129, 511, 512, 513, 1100, 2100, 4097}
	for _, g := range []struct{ qh, kvh, d int }{{32, 4, 128}, {16, 4, 64}, {16, 16, 128}} {
		for _, prefill := range []bool{false, true} {
			nq := make([]int, len(lens))
			for i, l := range lens {
				nq[i] = 1
				if prefill {
					nq[i] = min(l, 1+i*7) // tiles of several rows, some ending in a one-row tile
				}
			}
			ab := newAttBench(t, be, rand.New(rand.NewPCG(uint64(g.d), uint64(g.kvh))), g.qh, g.kvh, g.d, 16, lens, nq)
			want := ab.run(t, be, attWide, false)
			for _, c := range []struct {
				name    string
				mode    attMode
				scratch bool
			}{{"4 warps, scratch", attWide, true}, {"1 warp", attNarrow, false}, {"1 warp, scratch", attNarrow, true},
				{"1 warp, scratch again", attNarrow, true}, {"auto", attAuto, true}} {
				if got := ab.run(t, be, c.mode, c.scratch); !bytes.Equal(got, want) {
					t.Errorf("heads %d/%d of %d, prefill %v: %s differs from 4 warps without scratch", g.qh, g.kvh, g.d, prefill, c.name)
				}
			}
		}
	}
}

// TestPlanAttention checks the block width and spread the host picks.
func TestPlanAttention(t *testing.T) {
	for _, c := range []struct {
		pairs, groups, sms, warps int
		want                      attPlan
	}{
		{4, 64, 132, 0, attPlan{4, 32}},   // batch 1, long: 4 warps, one wave of blocks walking two groups each
		{4, 2, 132, 0, attPlan{4, 2}},     // no more blocks than groups
		{32, 64, 132, 0, attPlan{4, 4}},   // batch 8: one wave (4 x 32 blocks), 16 groups a block
		{32, 32, 132, 0, attPlan{4, 4}},   // not 9 blocks a pair: a second wave walks as long as the first
		{256, 64, 132, 0, attPlan{4, 1}},  // batch 64: still 4 warps, a group's splits side by side
		{264, 64, 132, 0, attPlan{1, 2}},  // two pairs a multiprocessor: 1-warp blocks, four a multiprocessor, one wave
		{300, 8, 132, 0, attPlan{1, 1}},   // not 2 blocks a pair: 1.14 waves of 4 groups walk longer than one of 8
		{256, 8, 132, 1, attPlan{1, 2}},   // not 3 blocks a pair: 1.45 waves of 3 groups walk longer than one of 4
		{1024, 64, 132, 0, attPlan{1, 1}}, // batch 256
		{1024, 64, 132, 4, attPlan{4, 1}}, // told 4 warps
		{4, 64, 132, 1, attPlan{1, 64}},   // told 1 warp
		{0, 0, 132, 0, attPlan{4, 1}},     // nothing to do still plans a grid
		{132, 1, 132, 0, attPlan{4, 1}},   // one group: nothing to spread
	} {
		if got := planAttention(c.pairs, c.groups, c.sms, c.warps); got != c.want {
			t.Errorf("planAttention(%d, %d, %d, %d) = %+v, want %+v", c.pairs, c.groups, c.sms, c.warps, got, c.want)
		}
	}
}

// TestAttentionDecodeSpeed times decode attention (one query row a
// sequence) at Qwen3-30B-A3B's head geometry (32 query heads, 4 KV heads of
// 128) over the paged cache, against its floor: the KV bytes the call reads
// at 4.3 TB/s. Each time is one launch's share of a graph of 10 launches
// replayed 5 times, so the host's enqueue is not in it. It times the
// kernel the host picks, att_tc in 4-warp and in 1-warp blocks (all with
// scratch) and att_generic (up to 256 k positions a call, enqueued one by
// one) side by side; TestAttentionWidths and the conformance suite check
// that they agree. Contexts 128 to 32 k, batch 1 to 256; -short skips it.
func TestAttentionDecodeSpeed(t *testing.T) {
	be := gpu(t)
	if testing.Short() {
		t.Skip("timing test")
	}
	const qh, kvh, d, ps, launches, replays = 32, 4, 128, 16, 10, 5
	t.Logf("%6s %5s %9s %9s %8s %10s %10s %11s %11s", "ctx", "batch", "floor us", "auto us", "x floor", "4 warps us", "1 warp us", "plan", "generic us")
	for _, ctx := range []int{128, 1024, 4096, 16384, 32768} {
		for _, b := range []int{1, 8, 64, 256} {
			// A subtest a size, so that its cache is freed before the next.
			t.Run(fmt.Sprintf("ctx%d_b%d", ctx, b), func(t *testing.T) {
				lens, nq := make([]int, b), make([]int, b)
				for i := range lens {
					lens[i], nq[i] = ctx, 1
				}
				ab := newAttBench(t, be, rand.New(rand.NewPCG(uint64(ctx), uint64(b))), qh, kvh, d, ps, lens, nq)
				args := ab.args
				args.Scratch = ab.scratch
				var ts [3]time.Duration
				for i, mode := range []attMode{attAuto, attWide, attNarrow} {
					ts[i] = graphTime(t, be, launches, replays, func(int) error { return be.attention(args, mode) })
				}
				gen := "-"
				if ctx*b <= 4096*64 {
					run := func() error { return be.attention(ab.args, attGeneric) }
					if err := run(); err != nil {
						t.Fatal(err)
					}
					dt, err := be.Time(launches, run)
					if err != nil {
						t.Fatal(err)
					}
					gen = us(dt)
				}
				p := planAttention(b*kvh, (ctx+attTCGroupLen-1)/attTCGroupLen, be.info.SMs, 0)
				floor := float64(b) * float64(ctx) * kvh * d * 2 * 2 / 4.3e12
				t.Logf("%6d %5d %9.1f %9s %7.2fx %10s %10s %6dw z%-3d %11s", ctx, b, floor*1e6, us(ts[0]), ts[0].Seconds()/floor,
					us(ts[1]), us(ts[2]), p.warps, p.z, gen)
			})
		}
	}
}

// us formats d in microseconds.
func us(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e3) }
