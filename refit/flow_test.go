package refit

import (
	"bytes"
	"context"
	"encoding/json"
	"maps"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// TestFlowGate: a part's live pass lets out one window before any report,
// then waits for one up to the timeout; it holds a window ahead of the
// slowest worker reporting on the part, goes on without one that sends no
// report on any part for the timeout (and ignores it after), waits longer
// for one still reporting on another part, stops waiting at once for one
// that stopped following the part live, and ignores reports on other
// versions and parts.
func TestFlowGate(t *testing.T) {
	const window, timeout = 4, 60 * time.Millisecond
	report := func(g *flowGate, worker string, v uint64, part, next int) {
		t.Helper()
		b, err := json.Marshal(FlowReport{Worker: worker, Version: v, Part: part, Next: next})
		if err != nil {
			t.Fatal(err)
		}
		g.note(&nats.Msg{Data: b})
	}
	// waits reports how long wait took for chunk seq of part 0.
	waits := func(g *flowGate, seq int, first time.Time) time.Duration {
		t.Helper()
		start := time.Now()
		if err := g.wait(context.Background(), 0, seq, window, timeout, first); err != nil {
			t.Fatal(err)
		}
		return time.Since(start)
	}
	quick, slow := func(d time.Duration) bool { return d < timeout/3 }, func(d time.Duration) bool { return d >= timeout*9/10 }

	g := newFlowGate()
	g.start(7)
	now := time.Now()
	if d := waits(g, window-1, now); !quick(d) {
		t.Errorf("first window: waited %v", d)
	}
	if d := waits(g, window, now); !slow(d) {
		t.Errorf("no report: waited %v, want the timeout", d)
	}
	// Unpaced from then on, until someone reports.
	if d := waits(g, 100, now); !quick(d) {
		t.Errorf("no report after the timeout: waited %v", d)
	}

	g.start(8)
	report(g, "a", 8, 0, 10)
	report(g, "b", 8, 0, 12)
	report(g, "c", 8, 1, 0) // another part
	report(g, "d", 7, 0, 0) // another version
	if d := waits(g, 10+window-1, time.Now()); !quick(d) {
		t.Errorf("within the window of the slowest: waited %v", d)
	}
	// waitsFor reports how long chunk seq waited while worker reports next
	// half a timeout in.
	waitsFor := func(seq int, worker string, next int) time.Duration {
		t.Helper()
		go func() {
			time.Sleep(timeout / 2)
			report(g, worker, 8, 0, next)
		}()
		return waits(g, seq, time.Now())
	}
	if d := waitsFor(10+window, "a", 11); quick(d) || slow(d) {
		t.Errorf("a window ahead of a: waited %v, want until a's report", d)
	}
	// a stands still at 11: after the timeout the pass leaves it behind,
	// b still paces it, and a's later reports are ignored.
	if d := waits(g, 11+window, time.Now()); !slow(d) {
		t.Errorf("a stalled: waited %v, want the timeout", d)
	}
	report(g, "a", 8, 0, 12)
	if got := g.left(); !slices.Equal(got, []string{"a/0"}) {
		t.Errorf("left behind %v, want [a/0]", got)
	}
	if d := waitsFor(12+window, "b", 20); quick(d) || slow(d) {
		t.Errorf("b paces: waited %v, want until b's report", d)
	}
	// b's part 0 stands still at 20 for two timeouts while b keeps
	// reporting on part 1: b is alive, so the pass waits for it, until its
	// part 0 moves.
	go func() {
		for i := 1; i <= 8; i++ {
			time.Sleep(timeout / 4)
			report(g, "b", 8, 1, i)
		}
		report(g, "b", 8, 0, 21)
	}()
	if d := waits(g, 20+window, time.Now()); d < 2*timeout || slices.Contains(g.left(), "b/0") {
		t.Errorf("b slow on part 0, reporting on part 1: waited %v, left behind %v; want b's part 0 report, b kept", d, g.left())
	}
	// Silent on every part, b is left behind after the timeout.
	if d := waits(g, 21+window, time.Now()); !slow(d) || !slices.Contains(g.left(), "b/0") {
		t.Errorf("b silent: waited %v, left behind %v; want the timeout, b/0 left", d, g.left())
	}

	// A worker that says it stopped following part 0 live is not waited
	// for there from then on (its later reports on it are ignored), nor
	// counted as left behind; a worker still following paces the part.
	g.start(9)
	report(g, "a", 9, 0, 0)
	report(g, "e", 9, 0, 5)
	go func() {
		time.Sleep(timeout / 4)
		b, _ := json.Marshal(FlowReport{Worker: "a", Version: 9, Part: 0, Stopped: true})
		g.note(&nats.Msg{Data: b})
	}()
	if d := waits(g, window, time.Now()); d < timeout/4 || slow(d) || len(g.left()) > 0 {
		t.Errorf("a stopped following part 0: waited %v, left behind %v; want until its report, none left", d, g.left())
	}
	report(g, "a", 9, 0, 1) // ignored: a window past it goes out below
	if d := waits(g, 5+window-1, time.Now()); !quick(d) {
		t.Errorf("within e's window: waited %v", d)
	}
	if d := waits(g, 5+window, time.Now()); !slow(d) {
		t.Errorf("a window ahead of e: waited %v, want the timeout", d)
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := g.wait(ctx, 0, 20+window, window, time.Hour, time.Now()); err == nil {
		t.Error("wait with a cancelled context returned nil")
	}
}

// TestLiveFlowControl: a worker that takes live chunks slower than the
// publisher sends them, with a pending limit a few chunks deep, still
// takes every chunk live: the live pass waits for its reports. Without
// them (a worker that does not report), the same worker falls behind, its
// subscription drops chunks, and it reads the rest from the streams. With
// part 1 on a server of its own (not one cluster with the first), its
// reports must still reach the publisher, which listens on the first. With
// a window past what the worker's client queues, the worker drops chunks
// even though it reports, and says it stopped following the parts it
// reads from the streams. A version of parts stored as it goes (protocol
// 3, not live first) is paced the same way.
func TestLiveFlowControl(t *testing.T) {
	for _, tc := range []struct {
		name       string
		reports    bool
		partServer bool // part 1 on a server of its own, not clustered with the first
		window     int  // chunks
		fallsBack  bool
		stored     bool // a version of parts stored as it goes (protocol 3), not live first
	}{
		{"paced", true, false, 3, false, false},
		{"unpaced", false, false, 3, true, false},
		{"paced, part server", true, true, 3, false, false},
		{"window past the worker's queue", true, false, 20, true, false},
		{"stored, paced", true, false, 3, false, true},
		{"stored, unpaced", false, false, 3, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := refittest.StartServer(t)
			var servers []string
			if tc.partServer {
				servers = []string{refittest.StartServer(t).URL()}
			}
			const chunk = 4093
			p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: chunk, Parts: 2,
				PartServers: servers, LiveFirst: !tc.stored, FlowWindow: int64(tc.window * chunk), FlowTimeout: 300 * time.Millisecond}, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Close() })
			a := modelDir(t, 93)
			w := startWorker(t, srv.URL(), a, "slow", moe.RecipePerToken, func(c *ReceiverConfig) {
				c.LiveParts, c.LivePendingBytes, c.PartServers = 2, 6*chunk, servers
			})
			w.r.chunkDelay = 2 * time.Millisecond
			w.r.reportBytes = 1 // every chunk
			if !tc.reports {
				w.r.reportBytes = -1
			}
			<-w.r.liveReady
			// The reports as the publisher sees them, in order.
			reports := make(chan FlowReport, 1<<16)
			rc := refittest.Connect(t, srv.URL())
			rs, err := rc.Subscribe(FlowSubject(testModel), func(m *nats.Msg) {
				var r FlowReport
				if json.Unmarshal(m.Data, &r) == nil {
					reports <- r
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := rs.SetPendingLimits(-1, -1); err != nil {
				t.Fatal(err)
			}
			if err := rc.Flush(); err != nil {
				t.Fatal(err)
			}
			b := perturbDir(t, a, 1, 0.3, nil)
			stream := subset(t, b, nil)
			if _, err := p.Publish(context.Background(), 1, bytes.NewReader(stream), int64(len(stream)), true); err != nil {
				t.Fatal(err)
			}
			st := w.waitStatus(t, 1)
			if st.State != StateApplied || st.Chunks == nil {
				t.Fatalf("%+v", st)
			}
			checkServes(t, tc.name, w, b, moe.RecipePerToken)
			// The status says where every chunk of the version came from
			// (two parts of whole chunks but for each one's last), and the
			// metrics count the same.
			live, stored := w.chunks(t)
			if least := (len(stream) + chunk - 1) / chunk; live+stored < least || live+stored > least+1 {
				t.Errorf("status: chunks %+v, the version is %d chunks of %d bytes in two parts", *st.Chunks, least, chunk)
			}
			if l, s := testutil.ToFloat64(w.r.metrics.chunks.WithLabelValues("live")), testutil.ToFloat64(w.r.metrics.chunks.WithLabelValues("stream")); l != float64(live) || s != float64(stored) {
				t.Errorf("metrics: %v chunks live, %v from the streams; the worker took %d and %d", l, s, live, stored)
			}
			if (stored != 0) != tc.fallsBack {
				t.Errorf("%d chunks live, %d from the streams", live, stored)
			}
			if err := rs.Unsubscribe(); err != nil {
				t.Fatal(err)
			}
			// A reporting worker says it follows each part before its
			// first chunk (next 0), then moves on.
			// One that falls back on a part says it stopped following it.
			firsts, stopped := map[int]int{}, 0
			for len(reports) > 0 {
				r := <-reports
				if _, ok := firsts[r.Part]; !ok {
					firsts[r.Part] = r.Next
				}
				if r.Stopped {
					stopped++
				}
			}
			if want := map[int]int{0: 0, 1: 0}; tc.reports && !maps.Equal(firsts, want) || !tc.reports && len(firsts) > 0 {
				t.Errorf("first report on each part: %v", firsts)
			}
			if want := tc.reports && tc.fallsBack; (stopped > 0) != want {
				t.Errorf("%d reports of a part no longer followed live, want some: %v", stopped, want)
			}
		})
	}
}

// pausingSource is a version's bytes that stall once, for pause, at the
// first read past at: a publisher held back mid-version.
type pausingSource struct {
	*bytes.Reader
	at     int64
	pause  time.Duration
	paused atomic.Bool
}

func (s *pausingSource) ReadAt(p []byte, off int64) (int, error) {
	if off >= s.at && !s.paused.Swap(true) {
		time.Sleep(s.pause)
	}
	return s.Reader.ReadAt(p, off)
}

// TestLivePublisherPause: the publisher of a version stored as it goes
// stalls mid-part (held back by the servers' store or by the workers'
// reports) for 10 times the worker's LiveIdle. Nothing was lost, so the
// worker waits on the live path and takes every chunk live; a chunk lost
// on the way after the pause still sends that part to its stream.
func TestLivePublisherPause(t *testing.T) {
	for _, tc := range []struct {
		name string
		lose bool
	}{
		{"paused", false},
		{"paused, then a chunk lost", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := refittest.StartServer(t)
			const chunk = 4093
			p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: chunk, Parts: 2}, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Close() })
			a := modelDir(t, 95)
			w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(c *ReceiverConfig) {
				c.LiveParts, c.LiveIdle = 2, 40*time.Millisecond
			})
			if tc.lose {
				var seen atomic.Bool
				w.r.liveHook = func(msg *nats.Msg) bool { return chunkSeq(msg) == 6 && !seen.Swap(true) }
			}
			<-w.r.liveReady
			b := perturbDir(t, a, 1, 0.3, nil)
			stream := subset(t, b, nil)
			src := &pausingSource{Reader: bytes.NewReader(stream), at: int64(len(stream)) / 8, pause: 400 * time.Millisecond}
			if _, err := p.Publish(context.Background(), 1, src, int64(len(stream)), true); err != nil {
				t.Fatal(err)
			}
			if !src.paused.Load() {
				t.Fatal("the publisher did not pause")
			}
			st := w.waitStatus(t, 1)
			if st.State != StateApplied || st.Chunks == nil {
				t.Fatalf("%+v", st)
			}
			checkServes(t, tc.name, w, b, moe.RecipePerToken)
			if st.Chunks.Stream != 0 != tc.lose {
				t.Errorf("chunks %+v: want some from the streams %v", *st.Chunks, tc.lose)
			}
		})
	}
}
