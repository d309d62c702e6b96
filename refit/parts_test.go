package refit

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// TestSplitParts: parts hold every tensor once, in data order, of about
// equal bytes, and each reads as a stream whose tensors are the version's.
func TestSplitParts(t *testing.T) {
	stream := subset(t, modelDir(t, 81), nil)
	h, _, err := readHeader(bytes.NewReader(stream), int64(len(stream)))
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]TensorInfo{}
	for _, ti := range h.Tensors {
		byName[ti.Name] = ti
	}
	for _, n := range []int{2, 3, 5, len(h.Tensors), len(h.Tensors) + 4} {
		parts, err := splitParts(bytes.NewReader(stream), h, n)
		if err != nil {
			t.Fatal(err)
		}
		if want := min(n, len(h.Tensors)); len(parts) != want {
			t.Fatalf("%d parts asked: %d, want %d", n, len(parts), want)
		}
		seen := map[string]bool{}
		var biggest int64
		for i, ps := range parts {
			b, err := io.ReadAll(io.NewSectionReader(ps, 0, ps.size))
			if err != nil {
				t.Fatal(err)
			}
			ph, _, err := readHeader(bytes.NewReader(b), int64(len(b)))
			if err != nil {
				t.Fatalf("part %d of %d: %v", i, n, err)
			}
			if len(ph.Tensors) != ps.tensors || ps.tensors == 0 {
				t.Fatalf("part %d of %d: %d tensors, says %d", i, n, len(ph.Tensors), ps.tensors)
			}
			for _, ti := range ph.Tensors {
				orig := byName[ti.Name]
				if seen[ti.Name] {
					t.Fatalf("tensor %s in two parts", ti.Name)
				}
				seen[ti.Name] = true
				if !bytes.Equal(b[ph.DataStart()+ti.Begin:ph.DataStart()+ti.End], stream[h.DataStart()+orig.Begin:h.DataStart()+orig.End]) {
					t.Fatalf("part %d: tensor %s differs from the version's", i, ti.Name)
				}
			}
			biggest = max(biggest, ps.size)
		}
		if len(seen) != len(h.Tensors) {
			t.Fatalf("%d parts hold %d of %d tensors", n, len(seen), len(h.Tensors))
		}
		if n == 2 && biggest > int64(len(stream))*3/4 {
			t.Errorf("2 parts: the bigger holds %d of %d bytes", biggest, len(stream))
		}
	}
}

// TestRefitParts: versions of three parts (full, partial, delta), each part
// a stream of its own over its own connection, applied bit for bit by a
// worker following one part live from the start (the others subscribed
// when the first such version comes) and by a worker that joins late and
// reads every part from its stream; under the per_token recipe (experts
// written in place) and the bf16 one (everything staged).
func TestRefitParts(t *testing.T) {
	for _, recipe := range []moe.Recipe{moe.RecipePerToken, moe.RecipeBF16} {
		t.Run(string(recipe), func(t *testing.T) { testRefitParts(t, recipe) })
	}
}

func testRefitParts(t *testing.T, recipe moe.Recipe) {
	srv := refittest.StartServer(t)
	// Chunks of an odd size, so that headers and records are split across
	// them.
	p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: 4093, Parts: 3}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	a := modelDir(t, 82)
	w := startWorker(t, srv.URL(), a, "w", recipe, nil)
	<-w.r.liveReady

	b := perturbDir(t, a, 1, 0.3, nil)
	m, err := p.Publish(context.Background(), 1, bytes.NewReader(subset(t, b, nil)), int64(len(subset(t, b, nil))), true)
	if err != nil {
		t.Fatal(err)
	}
	if m.Protocol != ProtocolParts || len(m.Parts) != 3 {
		t.Fatalf("manifest of protocol %d with %d parts, want %d with 3", m.Protocol, len(m.Parts), ProtocolParts)
	}
	if st := w.waitStatus(t, 1); st.State != StateApplied {
		t.Fatalf("full version in parts: %+v", st)
	}
	checkServes(t, "full version in parts", w, b, recipe)

	c := perturbDir(t, b, 2, 0.5, experts)
	publish(t, p, 2, subset(t, c, experts), false)
	if st := w.waitStatus(t, 2); st.State != StateApplied {
		t.Fatalf("partial version in parts: %+v", st)
	}
	checkServes(t, "partial version in parts", w, c, recipe)

	d := perturbDir(t, c, 3, 0.05, nil)
	stream, stats := deltaOf(t, d, c)
	if stats.DeltaTensors == 0 {
		t.Fatalf("no delta tensors: %+v", stats)
	}
	publishDelta(t, p, 3, 2, stream)
	if st := w.waitStatus(t, 3); st.State != StateApplied || st.Bytes <= 0 {
		t.Fatalf("delta version in parts: %+v", st)
	}
	checkServes(t, "delta version in parts", w, d, recipe)
	if live, stored := w.chunks(t); live == 0 {
		t.Errorf("the delta version's parts came live in %d chunks, from the streams in %d", live, stored)
	}

	full := perturbDir(t, d, 4, 0.2, nil)
	publish(t, p, 4, subset(t, full, nil), true)
	if st := w.waitStatus(t, 4); st.State != StateApplied {
		t.Fatalf("full version 4 in parts: %+v", st)
	}
	checkServes(t, "full version 4 in parts", w, full, recipe)
	// A worker that starts now catches up: it reads every part of the
	// newest version, complete in the streams, from there.
	late := startWorker(t, srv.URL(), a, "late", recipe, nil)
	if st := late.waitStatus(t, 4); st.State != StateApplied {
		t.Fatalf("late join to a version in parts: %+v", st)
	}
	checkServes(t, "late join to a version in parts", late, full, recipe)
	if live, stored := late.chunks(t); live != 0 || stored == 0 {
		t.Errorf("late join: %d chunks live, %d from the streams", live, stored)
	}

	// Every part stream holds the newest two versions only.
	nc := refittest.Connect(t, srv.URL())
	for i := range 3 {
		if held := partSubjects(t, nc, i); len(held) > 2 {
			t.Errorf("part %d's stream holds %v", i, held)
		}
	}
}

// TestPartsRejects: a publisher of parts refuses to sign and more parts
// than MaxParts; a worker rejects a version of parts with an unknown tensor
// in one part before any part writes, and one with a NaN in its last part
// while it serves its version, and applies the next full version.
func TestPartsRejects(t *testing.T) {
	srv := refittest.StartServer(t)
	nc := refittest.Connect(t, srv.URL())
	for _, tc := range []struct {
		cfg  PublisherConfig
		want string
	}{
		{PublisherConfig{Model: testModel, Parts: MaxParts + 1}, fmt.Sprintf("parts %d: want 0 to %d", MaxParts+1, MaxParts)},
		{PublisherConfig{Model: testModel, Parts: -1}, "parts -1"},
		{PublisherConfig{Model: testModel, Parts: 2, Signer: sgSigner(t)}, "parts are not signed"},
	} {
		if _, err := NewPublisher(nc, tc.cfg, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error naming %q", tc.cfg, err, tc.want)
		}
	}

	p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: 8 << 10, Parts: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	a := modelDir(t, 83)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(cfg *ReceiverConfig) { cfg.LiveParts = 2 })
	<-w.r.liveReady
	b := perturbDir(t, a, 5, 0.3, nil)
	good := subset(t, b, nil)

	// An unknown tensor, sorted last, so in the last part.
	bogus := streamOf(t, append(tensorsOf(t, good), stfile.Tensor{Name: "model.zz.weight", DType: stfile.BF16, Shape: []uint64{64}, Data: make([]byte, 128)}))
	publish(t, p, 1, bogus, true)
	if st := w.waitStatus(t, 1); st.State != StateRejected || !strings.Contains(st.Reason, "unknown tensor") {
		t.Fatalf("an unknown tensor in one part: %+v", st)
	}
	residentEquals(t, "after a version of parts rejected by its header", w.m, a)

	// A NaN in the last part's last tensor: the first part's bytes are
	// written by then.
	h, _, err := readHeader(bytes.NewReader(good), int64(len(good)))
	if err != nil {
		t.Fatal(err)
	}
	last := h.Tensors[0]
	for _, ti := range h.Tensors {
		if ti.Begin > last.Begin {
			last = ti
		}
	}
	publish(t, p, 2, setBF16(t, good, last.Name, 0, float32(math.NaN())), true)
	if st := w.waitStatus(t, 2); st.State != StateRejected || !strings.Contains(st.Reason, "NaN or Inf") {
		t.Fatalf("a NaN in the last part: %+v", st)
	}
	servesA(t, w, a)

	publish(t, p, 3, good, true)
	if st := w.waitStatus(t, 3); st.State != StateApplied {
		t.Fatalf("full version after rejected ones: %+v", st)
	}
	checkServes(t, "full version after rejected ones", w, b, moe.RecipePerToken)
}

// tensorsOf returns the tensors of a stream.
func tensorsOf(t *testing.T, stream []byte) []stfile.Tensor {
	t.Helper()
	h, _, err := readHeader(bytes.NewReader(stream), int64(len(stream)))
	if err != nil {
		t.Fatal(err)
	}
	var out []stfile.Tensor
	for _, ti := range h.Tensors {
		shape := make([]uint64, len(ti.Shape))
		for i, d := range ti.Shape {
			shape[i] = uint64(d)
		}
		out = append(out, stfile.Tensor{Name: ti.Name, DType: stfile.BF16, Shape: shape,
			Data: stream[h.DataStart()+ti.Begin : h.DataStart()+ti.End]})
	}
	return out
}

// stallingReader reads a stream until byte limit, then blocks until its
// context ends: a publisher that stops mid-version.
type stallingReader struct {
	ctx   context.Context
	b     []byte
	limit int64
}

func (s *stallingReader) ReadAt(p []byte, off int64) (int, error) {
	if off+int64(len(p)) > s.limit {
		<-s.ctx.Done()
		return 0, s.ctx.Err()
	}
	return copy(p, s.b[off:]), nil
}

// TestPartsSuperseded: a version in parts whose publisher stops in its last
// part, after the first part is complete, gives way at once to a newer
// version announced after it, well within chunk_timeout.
func TestPartsSuperseded(t *testing.T) {
	const chunkTimeout = 20 * time.Second
	srv := refittest.StartServer(t)
	a, b, c := modelDir(t, 84), modelDir(t, 85), modelDir(t, 86)
	statuses := watchStatuses(t, srv.URL())
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(cfg *ReceiverConfig) {
		cfg.ChunkTimeout, cfg.LiveParts = chunkTimeout, 2
	})
	<-w.r.liveReady
	fullB := subset(t, b, nil)
	dead, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: 4096, Parts: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dead.Close() })
	pctx, stop := context.WithCancel(context.Background())
	t.Cleanup(stop)
	// The last 64 KiB never come: part 1 stalls near its end.
	src := &stallingReader{ctx: pctx, b: fullB, limit: int64(len(fullB)) - 64<<10}
	died := make(chan error, 1)
	go func() {
		_, err := dead.Publish(pctx, 1, src, int64(len(fullB)), true)
		died <- err
	}()
	for deadline := time.Now().Add(10 * time.Second); w.r.receivedBytes() < int64(len(fullB))/2; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the worker received %d of %d bytes of version 1", w.r.receivedBytes(), len(fullB))
		}
	}
	stop()
	if err := <-died; err == nil {
		t.Fatal("the stalled publish completed")
	}

	start := time.Now()
	p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: 4096, Parts: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	publish(t, p, 2, subset(t, c, nil), true)
	st := statuses.wait(t, "w", 2)
	took := time.Since(start)
	if st.State != StateApplied {
		t.Fatalf("version 2: %+v", st)
	}
	if old, _ := statuses.find("w", 1); old.State != StateRejected || !strings.Contains(old.Reason, "superseded by version 2") {
		t.Fatalf("version 1: %+v, want rejected as superseded by version 2", old)
	}
	if took > chunkTimeout/4 {
		t.Fatalf("version 2 applied %v after it was published, chunk_timeout is %v", took, chunkTimeout)
	}
	residentEquals(t, "the version after a dead one in parts", w.m, c)
}

// TestPartsPurge: the streams of parts a version does not use (it has too
// few tensors for them) are purged of versions older than the previous
// one, as the streams it uses are.
func TestPartsPurge(t *testing.T) {
	srv := refittest.StartServer(t)
	nc := refittest.Connect(t, srv.URL())
	p, err := NewPublisher(nc, PublisherConfig{Model: testModel, ChunkBytes: 4096, Parts: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	dir := modelDir(t, 87)
	publish(t, p, 1, subset(t, dir, nil), true)
	two := regexp.MustCompile(`^model\.layers\.0\.(input|post_attention)_layernorm\.weight$`)
	publish(t, p, 2, subset(t, dir, two), false)
	publish(t, p, 3, subset(t, dir, two), false)
	for i := range 4 {
		held := partSubjects(t, nc, i)
		var want []string
		if i < 2 {
			want = []string{PartSubject(testModel, 2, i), PartSubject(testModel, 3, i)}
		}
		if !slices.Equal(held, want) {
			t.Errorf("part %d's stream holds %v, want %v", i, held, want)
		}
	}
}

// partSubjects returns the version subjects that hold messages in the
// stream of part i, sorted.
func partSubjects(t *testing.T, nc *nats.Conn, i int) []string {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(context.Background(), PartStreamName(testModel, i))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background(), jetstream.WithSubjectFilter(partSubjectsFilter(testModel, i)))
	if err != nil {
		t.Fatal(err)
	}
	return slices.Sorted(maps.Keys(info.State.Subjects))
}

// TestRefitPartServers: a version in four parts over three servers of
// their own (part 0 and the announcements on the first, parts 1-3 on the
// others by PartServers) is applied as it is over one; each part server
// carries its parts' bytes; a delta and a late joiner (every part from its
// stream, over the part servers) too.
func TestRefitPartServers(t *testing.T) {
	main, s1, s2 := refittest.StartServer(t), refittest.StartServer(t), refittest.StartServer(t)
	servers := []string{s1.URL(), s2.URL()}
	p, err := NewPublisher(refittest.Connect(t, main.URL()), PublisherConfig{Model: testModel, ChunkBytes: 4093, Parts: 4,
		PartServers: servers}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	onServers := func(c *ReceiverConfig) { c.PartServers = servers }
	a := modelDir(t, 83)
	w := startWorker(t, main.URL(), a, "w", moe.RecipePerToken, onServers)
	<-w.r.liveReady

	before := [2]refittest.Traffic{}
	for i, s := range []*refittest.Server{s1, s2} {
		if before[i], err = s.Traffic(); err != nil {
			t.Fatal(err)
		}
	}
	b := perturbDir(t, a, 1, 0.3, nil)
	full := subset(t, b, nil)
	m, err := p.Publish(context.Background(), 1, bytes.NewReader(full), int64(len(full)), true)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Parts) != 4 {
		t.Fatalf("manifest of %d parts, want 4", len(m.Parts))
	}
	if st := w.waitStatus(t, 1); st.State != StateApplied {
		t.Fatalf("full version over part servers: %+v", st)
	}
	checkServes(t, "full version over part servers", w, b, moe.RecipePerToken)
	// Part i >= 1 lives on servers[(i-1) % 2]: s1 carries parts 1 and 3,
	// s2 part 2, each in (publisher to server) and out (to the worker).
	want := [2]int64{m.Parts[1].TotalBytes + m.Parts[3].TotalBytes, m.Parts[2].TotalBytes}
	for i, s := range []*refittest.Server{s1, s2} {
		now, err := s.Traffic()
		if err != nil {
			t.Fatal(err)
		}
		in, out := now.InBytes-before[i].InBytes, now.OutBytes-before[i].OutBytes
		if in < want[i] || out < want[i] {
			t.Errorf("part server %d carried %d bytes in and %d out, want at least its parts' %d each way", i+1, in, out, want[i])
		}
	}
	// No part stream but part 0's on the main server.
	for i := 1; i < 4; i++ {
		if _, err := jsOf(t, main.URL()).Stream(context.Background(), PartStreamName(testModel, i)); !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Errorf("part %d's stream on the main server: %v, want not found", i, err)
		}
	}

	c := perturbDir(t, b, 2, 0.05, nil)
	stream, _ := deltaOf(t, c, b)
	publishDelta(t, p, 2, 1, stream)
	if st := w.waitStatus(t, 2); st.State != StateApplied {
		t.Fatalf("delta over part servers: %+v", st)
	}
	checkServes(t, "delta over part servers", w, c, moe.RecipePerToken)

	late := startWorker(t, main.URL(), a, "late", moe.RecipePerToken, onServers)
	if st := late.waitStatus(t, 2); st.State != StateApplied {
		t.Fatalf("late join over part servers: %+v", st)
	}
	checkServes(t, "late join over part servers", late, c, moe.RecipePerToken)
}

// jsOf is a JetStream on a new connection to url.
func jsOf(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(refittest.Connect(t, url))
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// TestPartServersRejects: part servers are checked where they are given.
func TestPartServersRejects(t *testing.T) {
	srv := refittest.StartServer(t)
	nc := refittest.Connect(t, srv.URL())
	tests := []struct {
		name    string
		parts   int
		servers []string
		want    string
	}{
		{"one part", 1, []string{srv.URL()}, "versions of one part"},
		{"not a URL", 2, []string{"nats://"}, "want a server URL"},
		{"no port", 2, []string{"nats://127.0.0.1"}, "want a server URL"},
		{"twice", 3, []string{srv.URL(), srv.URL()}, "listed twice"},
		{"too many", 2, make([]string, MaxParts), "at most 15"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewPublisher(nc, PublisherConfig{Model: testModel, Parts: tc.parts, PartServers: tc.servers}, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("publisher: %v, want an error with %q", err, tc.want)
			}
			if tc.parts < 2 {
				return
			}
			m, err := policy.LoadModel(testBackend(t), modelDir(t, 84), testOpts(moe.RecipePerToken))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Close() })
			_, err = NewReceiver(nc, m, policy.NewEngine(m, policy.EngineConfig{}), ReceiverConfig{Model: testModel, Worker: "w",
				PartServers: tc.servers}, nil, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("receiver: %v, want an error with %q", err, tc.want)
			}
		})
	}
}

// TestAutoParts: one part a 2 GiB, at least one a server, at most one a
// four cores and MaxParts.
func TestAutoParts(t *testing.T) {
	const gib = 1 << 30
	tests := []struct {
		size          int64
		cpus, servers int
		want          int
	}{
		{0, 16, 0, 1},
		{100 << 20, 16, 0, 1},
		{2 * gib, 16, 0, 1},
		{2*gib + 1, 16, 0, 2},
		{11 * gib, 16, 0, 4},
		{11 * gib, 64, 0, 6},
		{61 * gib, 16, 0, 4},
		{61 * gib, 8, 0, 2},
		{61 * gib, 128, 0, MaxParts},
		{61 * gib, 0, 0, 1},
		{61 * gib, 3, 0, 1},
		{100 << 20, 16, 3, 4},
		{61 * gib, 2, 3, 4},
		{61 * gib, 16, 20, MaxParts},
	}
	for _, tc := range tests {
		if got := AutoParts(tc.size, tc.cpus, tc.servers); got != tc.want {
			t.Errorf("AutoParts(%d, %d cores, %d servers) = %d, want %d", tc.size, tc.cpus, tc.servers, got, tc.want)
		}
	}
}
