package cuda

import (
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/kernels"
)

// TestAttentionDecodeSpeed times decode attention (one query row a
// sequence) at Qwen3-30B-A3B's head geometry (32 query heads, 4 KV heads of
// 128) over the paged cache, against its floor: the KV bytes the call reads
// at 4.3 TB/s. It times att_tc with scratch (positions split over blocks),
// without, and att_generic (up to 256 k positions a call), side by side;
// the conformance suite checks that they agree. Contexts 1 k to 32 k, batch
// 1 to 256; -short skips it.
func TestAttentionDecodeSpeed(t *testing.T) {
	be := gpu(t)
	if testing.Short() {
		t.Skip("timing test")
	}
	const qh, kvh, d, ps, iters = 32, 4, 128, 16, 10
	alloc := func(dt kernels.DType, shape ...int) *kernels.Buffer {
		t.Helper()
		b, err := be.Alloc(dt, shape...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = be.Free(b) })
		return b
	}
	free := func(bs ...*kernels.Buffer) {
		for _, b := range bs {
			if err := be.Free(b); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("%6s %5s %10s %10s %8s %12s %10s", "ctx", "batch", "floor us", "split us", "x floor", "no split us", "generic us")
	for _, ctx := range []int{1024, 4096, 16384, 32768} {
		for _, b := range []int{1, 8, 64, 256} {
			pagesPer := (ctx + ps - 1) / ps
			pages := b * pagesPer
			ck, err := be.Alloc(kernels.BF16, pages, ps, kvh, d)
			if err != nil {
				t.Fatal(err)
			}
			cv, err := be.Alloc(kernels.BF16, pages, ps, kvh, d)
			if err != nil {
				t.Fatal(err)
			}
			table := make([]int32, b*pagesPer)
			for i := range table {
				table[i] = int32(i)
			}
			lens, start := make([]int32, b), make([]int32, b+1)
			for i := range lens {
				lens[i], start[i+1] = int32(ctx), int32(i+1)
			}
			pt, sl, qs := alloc(kernels.I32, b, pagesPer), alloc(kernels.I32, b), alloc(kernels.I32, b+1)
			for _, u := range []struct {
				b *kernels.Buffer
				v []int32
			}{{pt, table}, {sl, lens}, {qs, start}} {
				if err := be.Upload(u.b, 0, kernels.Int32Bytes(u.v)); err != nil {
					t.Fatal(err)
				}
			}
			q, out := alloc(kernels.BF16, b, qh, d), alloc(kernels.BF16, b, qh, d)
			var scratch *kernels.Buffer
			if n := be.AttentionScratch(b, qh, kvh, d, ctx); n > 0 {
				scratch = alloc(kernels.F32, (n+3)/4)
			}
			args := kernels.AttentionArgs{Out: out, Q: q, Cache: kernels.KVCache{K: ck, V: cv}, PageTable: pt, SeqLens: sl,
				QueryStart: qs, Scale: 0.088, Scratch: scratch}
			plain := args
			plain.Scratch = nil
			var ts [3]time.Duration
			for i, run := range []func() error{
				func() error { return be.attention(args, false) },
				func() error { return be.attention(plain, false) },
				func() error { return be.attention(plain, true) },
			} {
				if i == 2 && ctx*b > 4096*64 {
					continue // the generic kernel is slow; enough sizes to compare
				}
				if err := run(); err != nil {
					t.Fatal(err)
				}
				if ts[i], err = be.Time(iters, run); err != nil {
					t.Fatal(err)
				}
			}
			floor := float64(b) * float64(ctx) * kvh * d * 2 * 2 / 4.3e12
			us := func(d time.Duration) float64 { return float64(d) / 1e3 }
			t.Logf("%6d %5d %10.1f %10.1f %7.2fx %12.1f %10.1f", ctx, b, floor*1e6, us(ts[0]), ts[0].Seconds()/floor, us(ts[1]), us(ts[2]))
			free(ck, cv)
		}
	}
}
