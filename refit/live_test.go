package refit

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// TestRefitLiveFirst: versions in parts sent live first (protocol 4) are
// applied, bitwise, before the streams hold them: the publisher holds its
// stored pass until every worker has reported the version, which a worker
// waiting for the manifest never would. A worker that loses a live chunk
// of every part reads the rest from the streams once they are stored; a
// late joiner reads every part from there; no stream stores a live
// subject, and each keeps the newest two versions.
func TestRefitLiveFirst(t *testing.T) {
	srv := refittest.StartServer(t)
	p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: 4093, Parts: 3, LiveFirst: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	a := modelDir(t, 91)
	// Workers follow every part live from their start: the live pass of a
	// small version is over before a worker could subscribe to more.
	parts := func(c *ReceiverConfig) { c.LiveParts = 3 }
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, parts)
	lossy := startWorker(t, srv.URL(), a, "lossy", moe.RecipePerToken, parts)
	lossy.r.liveHook = func(msg *nats.Msg) bool { return chunkSeq(msg) == 1 }
	// tail loses the end of every part: it learns from the seal that no
	// more is coming live.
	tail := startWorker(t, srv.URL(), a, "tail", moe.RecipePerToken, parts)
	tail.r.liveHook = func(msg *nats.Msg) bool { return chunkSeq(msg) >= 3 }
	<-w.r.liveReady
	<-lossy.r.liveReady
	<-tail.r.liveReady

	// The stored pass of a version waits for w's status on it: w commits
	// on the seal. lossy cannot: it waits for its lost chunks, stored after.
	var early atomic.Int32 // versions w applied before their stored pass
	p.afterLive = func(v uint64) {
		deadline := time.Now().Add(5 * time.Second)
		for w.r.LastStatus().Version != v && time.Now().Before(deadline) {
			time.Sleep(2 * time.Millisecond)
		}
		if st := w.r.LastStatus(); st.Version == v && st.State == StateApplied {
			early.Add(1)
		}
	}
	b := perturbDir(t, a, 1, 0.3, nil)
	m, err := p.Publish(context.Background(), 1, bytes.NewReader(subset(t, b, nil)), int64(len(subset(t, b, nil))), true)
	if err != nil {
		t.Fatal(err)
	}
	if m.Protocol != ProtocolLive || len(m.Parts) != 3 || m.Subject != StoredSubject(testModel, 1, 0) {
		t.Fatalf("manifest of protocol %d with %d parts on %s, want %d with 3 on %s", m.Protocol, len(m.Parts), m.Subject,
			ProtocolLive, StoredSubject(testModel, 1, 0))
	}
	d := perturbDir(t, b, 2, 0.05, nil)
	stream, stats := deltaOf(t, d, b)
	if stats.DeltaTensors == 0 {
		t.Fatalf("no delta tensors: %+v", stats)
	}
	versions := []struct {
		v    uint64
		dir  string
		send func()
	}{
		{1, b, func() {}},
		{2, d, func() { publishDelta(t, p, 2, 1, stream) }},
	}
	for _, tc := range versions {
		tc.send()
		for _, wk := range []*worker{w, lossy, tail} {
			if st := wk.waitStatus(t, tc.v); st.State != StateApplied {
				t.Fatalf("version %d: %s: %+v", tc.v, wk.r.cfg.Worker, st)
			}
			checkServes(t, "live-first version", wk, tc.dir, moe.RecipePerToken)
		}
	}
	if n := early.Load(); n != 2 {
		t.Errorf("w applied %d versions of 2 before they were stored", n)
	}
	if live, stored := w.chunks(t); live == 0 || stored != 0 {
		t.Errorf("w: %d chunks live, %d from the streams; want all live", live, stored)
	}
	for _, wk := range []*worker{lossy, tail} {
		if _, stored := wk.chunks(t); stored == 0 {
			t.Errorf("%s: no chunk from the streams", wk.r.cfg.Worker)
		}
	}

	p.afterLive = nil
	e := perturbDir(t, d, 3, 0.2, nil)
	publish(t, p, 3, subset(t, e, nil), true)
	late := startWorker(t, srv.URL(), a, "late", moe.RecipePerToken, parts)
	if st := late.waitStatus(t, 3); st.State != StateApplied {
		t.Fatalf("late join to a live-first version: %+v", st)
	}
	checkServes(t, "late join to a live-first version", late, e, moe.RecipePerToken)
	if live, stored := late.chunks(t); live != 0 || stored == 0 {
		t.Errorf("late join: %d chunks live, %d from the streams", live, stored)
	}

	nc := refittest.Connect(t, srv.URL())
	for i := range 3 {
		held := partSubjects(t, nc, i)
		if len(held) != 2 {
			t.Errorf("part %d's stream holds %v, want the newest two versions", i, held)
		}
		for _, s := range held {
			if want := StoredSubject(testModel, 0, i); !strings.HasPrefix(s, want[:len(want)-1]) {
				t.Errorf("part %d's stream holds %s, not a stored subject", i, s)
			}
		}
	}
}

// TestLiveSubjects: a live-first version is announced on its stored
// subjects; its chunks come live on subjects no stream captures and every
// worker's live subscription matches; the stored ones no worker follows
// live. Announcements of protocol 4 on version subjects, and of protocol
// 3 on stored ones, are protocol errors.
func TestLiveSubjects(t *testing.T) {
	for _, tc := range []struct{ got, want string }{
		{StoredSubject("m", 12, 0), "refit.m.s.12"},
		{StoredSubject("m", 12, 3), "refit.m.p3.s.12"},
		{LiveSubject("m", 12, 0), "refit.m.v.12.live"},
		{LiveSubject("m", 12, 3), "refit.m.p3.v.12.live"},
		{PartLiveSubjects("m", 0), "refit.m.v.>"},
		{PartLiveSubjects("m", 3), "refit.m.p3.v.>"},
		{PartStoredSubjects("m", 3), "refit.m.p3.s.*"},
		{partSubjectsFilter("m", 3), "refit.m.p3.*.*"},
	} {
		if tc.got != tc.want {
			t.Errorf("got %q, want %q", tc.got, tc.want)
		}
	}
	for _, part := range []int{0, 3} {
		live, stored, version := LiveSubject("m", 12, part), StoredSubject("m", 12, part), PartSubject("m", 12, part)
		follows := func(s string) bool { return subjectMatches(PartLiveSubjects("m", part), s) }
		captures := func(s string) bool {
			return subjectMatches(PartStreamSubjects("m", part), s) || subjectMatches(PartStoredSubjects("m", part), s)
		}
		switch {
		case !follows(live) || captures(live):
			t.Errorf("part %d: live subject %s: followed %v, stored %v", part, live, follows(live), captures(live))
		case follows(stored) || !captures(stored):
			t.Errorf("part %d: stored subject %s: followed %v, stored %v", part, stored, follows(stored), captures(stored))
		case !follows(version) || !captures(version):
			t.Errorf("part %d: version subject %s: followed %v, stored %v", part, version, follows(version), captures(version))
		}
		for _, s := range []string{live, stored, version} {
			if v, ok := versionOfLiveSubject("m", part, s); s != stored && (!ok || v != 12) {
				t.Errorf("versionOfLiveSubject(%s) = %d, %v", s, v, ok)
			}
			if v, ok := versionOfStoredSubject("m", part, s); s != live && (!ok || v != 12) {
				t.Errorf("versionOfStoredSubject(%s) = %d, %v", s, v, ok)
			}
		}
	}

	live := strings.NewReplacer(`"protocol":3`, `"protocol":4`, "refit.m-1.v.7", "refit.m-1.s.7", "refit.m-1.p1.v.7", "refit.m-1.p1.s.7")
	ann := `{"protocol":3,"model":"m-1","version":7,"full":true,"subject":"refit.m-1.v.7","total_bytes":10000,"chunk_bytes":4000,"chunks":3,"parts":[` +
		wtPart0 + `,` + wtPart1 + `]}`
	if _, err := ParseAnnounce([]byte(ann)); err != nil {
		t.Fatalf("protocol 3: %v", err)
	}
	if a, err := ParseAnnounce([]byte(live.Replace(ann))); err != nil || a.Protocol != ProtocolLive || a.Parts[1].Subject != "refit.m-1.p1.s.7" {
		t.Errorf("protocol 4: %+v, %v", a, err)
	}
	for _, bad := range []string{
		strings.Replace(ann, `"protocol":3`, `"protocol":4`, 1),                       // protocol 4 on version subjects
		strings.Replace(live.Replace(ann), `"protocol":4`, `"protocol":3`, 1),         // protocol 3 on stored subjects
		strings.Replace(live.Replace(ann), "refit.m-1.p1.s.7", "refit.m-1.p1.v.7", 1), // one part on its version subject
	} {
		if _, err := ParseAnnounce([]byte(bad)); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "subject") {
			t.Errorf("%s: got %v, want an ErrProtocol naming the subject", bad, err)
		}
	}
	if m, err := ParseManifest([]byte(live.Replace(wtManifestParts))); err != nil || m.Protocol != ProtocolLive {
		t.Errorf("protocol 4 manifest: %+v, %v", m, err)
	}
}

// subjectMatches reports whether NATS subject s matches pattern p (tokens,
// "*" one of them, a final ">" one or more).
func subjectMatches(p, s string) bool {
	pt, st := strings.Split(p, "."), strings.Split(s, ".")
	for i, tok := range pt {
		switch {
		case tok == ">":
			return len(st) > i
		case i >= len(st) || (tok != "*" && tok != st[i]):
			return false
		}
	}
	return len(pt) == len(st)
}

// stopAfter is a source whose reads past limit bytes cancel a publish (its
// publisher dies) and fail.
type stopAfter struct {
	src    *bytes.Reader
	limit  int64
	cancel context.CancelFunc
}

func (s *stopAfter) ReadAt(p []byte, off int64) (int, error) {
	if off+int64(len(p)) > s.limit {
		s.cancel()
		return 0, context.Canceled
	}
	return s.src.ReadAt(p, off)
}

// TestLiveFirstDies: a live-first version whose publisher dies in its
// live pass (no seal, nothing stored) gives way at once to the next version
// a restarted publisher announces: the worker rejects it as superseded,
// well within chunk_timeout, and applies the next one.
func TestLiveFirstDies(t *testing.T) {
	const chunkTimeout = 20 * time.Second
	srv := refittest.StartServer(t)
	a, b, c := modelDir(t, 94), modelDir(t, 95), modelDir(t, 96)
	statuses := watchStatuses(t, srv.URL())
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(cfg *ReceiverConfig) {
		cfg.LiveParts, cfg.ChunkTimeout = 3, chunkTimeout
	})
	<-w.r.liveReady
	cfg := PublisherConfig{Model: testModel, ChunkBytes: 4093, Parts: 3, LiveFirst: true}
	dying, err := NewPublisher(refittest.Connect(t, srv.URL()), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dying.Close() })
	stream := subset(t, b, nil)
	ctx, cancel := context.WithCancel(context.Background())
	src := &stopAfter{src: bytes.NewReader(stream), limit: int64(len(stream)) / 2, cancel: cancel}
	if _, err := dying.Publish(ctx, 1, src, int64(len(stream)), true); err == nil {
		t.Fatal("a publish whose source fails halfway succeeded")
	}
	for deadline := time.Now().Add(10 * time.Second); w.r.receivedBytes() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the worker received nothing of the dying version")
		}
	}

	start := time.Now()
	p, err := NewPublisher(refittest.Connect(t, srv.URL()), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	next, err := p.NextVersion(context.Background())
	if err != nil || next != 2 {
		t.Fatalf("next version %d, %v; want 2", next, err)
	}
	publish(t, p, 2, subset(t, c, nil), true)
	if st := statuses.wait(t, "w", 2); st.State != StateApplied {
		t.Fatalf("version 2: %+v", st)
	}
	if took := time.Since(start); took > chunkTimeout/4 {
		t.Fatalf("version 2 applied %v after it was published, chunk_timeout is %v", took, chunkTimeout)
	}
	if dead, _ := statuses.find("w", 1); dead.State != StateRejected || !strings.Contains(dead.Reason, "superseded by version 2") {
		t.Fatalf("version 1: %+v, want rejected as superseded by version 2", dead)
	}
	residentEquals(t, "the version after a dead live-first one", w.m, c)
}
