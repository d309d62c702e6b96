package refit

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// Flow control of a version of parts (PROTOCOL.md, "Live first" and
// "Parts"): of a live-first version's live pass, and of the stored pass of
// one stored as it goes, which workers follow live. Core NATS does not
// slow a publisher for a subscriber that reads its socket but falls behind
// in handling what it read: the client queues, then drops, and a worker
// that drops a live chunk reads the rest of the part from its stream
// (after the stored pass, for a live-first version). So workers report how
// far they got, part by part, and the publisher keeps each part's pass
// within a window of the slowest worker that keeps reporting. Below, "the
// live pass" is whichever pass the workers follow.

// FlowSubject is the core-NATS subject of workers' live progress reports.
func FlowSubject(model string) string { return "refit." + model + ".flow" }

// FlowReportBytes is how many bytes of a part's live chunks a worker takes
// between two progress reports (and it reports the part's last chunk).
const FlowReportBytes = 4 << 20

// DefaultFlowWindow is how far, in bytes, a part's live pass may run ahead
// of the slowest worker reporting on it. What is in flight may all wait in
// one place: in the server, for a worker that does not read its socket
// fast enough, where past the server's max_pending for a client (64 MiB
// by default) the server cuts the worker off as a slow consumer, or in
// the worker's client, past its live pending limit
// (DefaultLivePendingBytes) dropped. The server counts a write to a
// client as pending until the whole of it is written: for a worker that
// reads slowly, what it is being sent still counts while the next window's
// bytes queue behind it, so the server may count about twice the window
// (and a report's worth more). A window of 48 MiB was cut off that way,
// paced to the chunk. So the window, and the bytes between reports, stay
// under half of max_pending.
const DefaultFlowWindow = 24 << 20

// DefaultFlowTimeout is how long a worker may send no report at all, on
// any part, while the live pass waits for it on one, before the pass goes
// on without it there (it then reads the rest of that part from the
// stream), and how long a live pass waits for the first report on a part
// before it goes on unpaced (no worker follows it live). A worker still
// reporting on its other parts is alive: one of its parts may stall for
// longer (a busy worker's parts do not move evenly), and leaving it behind
// would cost it that part's live chunks, so the pass waits for it.
const DefaultFlowTimeout = time.Second

// FlowReport is a worker's progress on a part of a version of parts:
// Next is the next chunk it needs (every chunk before it taken). Stopped:
// the worker no longer follows the part live (it missed a chunk and reads
// the rest from the stream), so the live pass need not wait for it there.
type FlowReport struct {
	Worker  string `json:"worker"`
	Version uint64 `json:"version"`
	Part    int    `json:"part"`
	Next    int    `json:"next"`
	Stopped bool   `json:"stopped,omitempty"`
}

// flowKey is a worker's part.
type flowKey struct {
	worker string
	part   int
}

// flowGate paces the live pass of the version in hand by the reports of
// the workers on it. The status subscription's goroutine feeds it (note);
// each part's sender asks it before each chunk (wait).
type flowGate struct {
	mu      sync.Mutex
	version uint64
	marks   map[flowKey]int      // the next chunk each worker's part needs
	heard   map[string]time.Time // each worker's latest report on the version, any part
	dropped map[flowKey]bool     // workers the pass went on without
	stopped map[flowKey]bool     // workers that stopped following a part live
	changed chan struct{}        // closed, and replaced, at each report that moves a mark
}

func newFlowGate() *flowGate {
	return &flowGate{marks: map[flowKey]int{}, heard: map[string]time.Time{}, dropped: map[flowKey]bool{}, stopped: map[flowKey]bool{},
		changed: make(chan struct{})}
}

// start forgets the reports of earlier versions.
func (g *flowGate) start(version uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.version = version
	clear(g.marks)
	clear(g.heard)
	clear(g.dropped)
	clear(g.stopped)
}

// note records a report; it runs on the subscription's goroutine.
func (g *flowGate) note(msg *nats.Msg) {
	var r FlowReport
	if err := json.Unmarshal(msg.Data, &r); err != nil || r.Worker == "" || r.Part < 0 || r.Part >= MaxParts {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	k := flowKey{r.Worker, r.Part}
	if r.Version != g.version {
		return
	}
	now := time.Now()
	g.heard[r.Worker] = now
	if g.dropped[k] || g.stopped[k] {
		return
	}
	if r.Stopped {
		// The pass stops waiting for this worker on the part at once.
		g.stopped[k] = true
		delete(g.marks, k)
		close(g.changed)
		g.changed = make(chan struct{})
		return
	}
	if m, ok := g.marks[k]; !ok || r.Next > m {
		g.marks[k] = r.Next
		close(g.changed)
		g.changed = make(chan struct{})
	}
}

// wait returns once chunk seq of part may go out: no worker reporting on
// the part is more than window chunks behind it, but those that sent no
// report on any part for timeout while it waited, which the pass leaves
// behind on this part. Before any report on the part it lets the first
// window out, then waits up to timeout (from first, the pass's start) for
// one.
func (g *flowGate) wait(ctx context.Context, part, seq, window int, timeout time.Duration, first time.Time) error {
	began := time.Now()
	for {
		g.mu.Lock()
		now := time.Now()
		behind, any := false, false
		var soonest time.Time
		for k, m := range g.marks {
			if k.part != part {
				continue
			}
			any = true
			if seq-m < window {
				continue
			}
			since := g.heard[k.worker] // every mark came with a report
			if since.Before(began) {
				since = began
			}
			if now.Sub(since) >= timeout {
				delete(g.marks, k)
				g.dropped[k] = true
				continue
			}
			behind = true
			if end := since.Add(timeout); soonest.IsZero() || end.Before(soonest) {
				soonest = end
			}
		}
		if !any && seq >= window {
			// Nobody has reported on this part yet.
			if end := first.Add(timeout); now.Before(end) {
				behind, soonest = true, end
			}
		}
		changed := g.changed
		g.mu.Unlock()
		if !behind {
			return nil
		}
		t := time.NewTimer(time.Until(soonest))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-changed:
		case <-t.C:
		}
		t.Stop()
	}
}

// left returns the workers the live pass went on without, as
// "worker/part" strings.
func (g *flowGate) left() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []string
	for k := range g.dropped {
		out = append(out, fmt.Sprintf("%s/%d", k.worker, k.part))
	}
	return out
}
