package refit

import (
	"fmt"
	"testing"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// TestRefitFanOut: a version published through one server of a 3-server
// NATS cluster reaches 4 workers connected to the other two servers, each
// of which applies it bit for bit (its rollouts equal a fresh load). The
// publisher's server sends the chunks once to each other server, not once
// per worker: the servers the workers hang off fan the version out. Each
// server's bytes sent during the version are logged against the version's
// size.
func TestRefitFanOut(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-server JetStream cluster")
	}
	servers := refittest.StartCluster(t, "refit", 3)
	a, b := modelDir(t, 21), modelDir(t, 22)
	var workers []*worker
	perServer := make([]int, len(servers))
	for i := range 4 {
		at := 1 + i%2 // two workers on each of servers 2 and 3
		perServer[at]++
		workers = append(workers, startWorker(t, servers[at].URL(), a, fmt.Sprintf("w-%d", i+1), moe.RecipePerToken, nil))
	}
	p := newPublisher(t, servers[0].URL())
	stream := subset(t, b, nil)
	// A first version settles the stream, the bucket and every worker's
	// subscriptions; the second is the one measured.
	publish(t, p, 1, stream, true)
	for _, w := range workers {
		if st := w.waitStatus(t, 1); st.State != StateApplied {
			t.Fatalf("version 1 on %s: %+v", w.r.cfg.Worker, st)
		}
	}
	before := make([]refittest.Traffic, len(servers))
	for i, s := range servers {
		var err error
		if before[i], err = s.Traffic(); err != nil {
			t.Fatal(err)
		}
	}
	publish(t, p, 2, stream, true)
	for _, w := range workers {
		if st := w.waitStatus(t, 2); st.State != StateApplied {
			t.Fatalf("version 2 on %s: %+v", w.r.cfg.Worker, st)
		}
	}
	size := float64(len(stream))
	var sent []float64
	for i, s := range servers {
		after, err := s.Traffic()
		if err != nil {
			t.Fatal(err)
		}
		out := float64(after.OutBytes - before[i].OutBytes)
		sent = append(sent, out)
		t.Logf("server %d (%d workers): sent %.1f MB, %.2fx the version's %.1f MB", i+1, perServer[i], out/1e6, out/size, size/1e6)
	}
	// The publisher's server carries the version to the two other servers
	// (and the stream's copy where the stream lives), not to four workers.
	if sent[0] >= 3.5*size {
		t.Errorf("the publisher's server sent %.2fx the version: it carried the workers' copies itself", sent[0]/size)
	}
	for i := 1; i < 3; i++ {
		if sent[i] < 1.9*size {
			t.Errorf("server %d sent %.2fx the version to its two workers: want about 2x or more", i+1, sent[i]/size)
		}
	}
	wantS, wantSc := fresh(t, b, moe.RecipePerToken)
	for _, w := range workers {
		gotS, gotSc := rollouts(t, w.e)
		sameRollouts(t, "fan-out refit on "+w.r.cfg.Worker+" vs fresh B", gotS, gotSc, wantS, wantSc)
	}
}
