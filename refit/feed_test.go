package refit

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// residentEquals checks that every weight the worker's model holds (the
// resident BF16 buffers) is byte for byte the tensor of the checkpoint in
// dir.
func residentEquals(t *testing.T, what string, m *policy.Model, dir string) {
	t.Helper()
	f, err := stfile.Open(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	targets, err := m.Tensors()
	if err != nil {
		t.Fatal(err)
	}
	for _, tg := range targets {
		want, err := f.Tensor(tg.Name)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, tg.Size())
		if err := m.Backend().Download(got, tg.Buffer, tg.Offset); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want.Data) {
			t.Fatalf("%s: tensor %s differs from the checkpoint", what, tg.Name)
		}
	}
}

// chunkSeq reads a live chunk's Refit-Seq header.
func chunkSeq(msg *nats.Msg) int {
	seq, _ := strconv.Atoi(msg.Header.Get(HeaderSeq))
	return seq
}

// TestRefitLiveAndFallback: chunks arrive live (core NATS) and whatever the
// live path misses or gets wrong comes from the stream. Workers that miss
// the first chunks (a late subscriber), one in the middle, or the last
// ones, or get a corrupted chunk live, or live bytes that pass the chunk's
// CRC but not the manifest's chunk table, all apply the version, bit for bit;
// a worker that misses nothing takes every chunk live.
func TestRefitLiveAndFallback(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 30), modelDir(t, 31)
	stream := subset(t, b, nil)
	const chunk = 8 << 10
	n := (len(stream) + chunk - 1) / chunk
	if n < 8 {
		t.Fatalf("%d chunks: want at least 8", n)
	}
	type want int
	const (
		allLive   want = iota // every chunk live
		mixed                 // some live, the rest from the stream
		allStored             // the whole version from the stream
	)
	cases := []struct {
		name string
		hook func(msg *nats.Msg) bool
		want want
	}{
		{"live", nil, allLive},
		{"late subscriber", func(msg *nats.Msg) bool { return chunkSeq(msg) < 3 }, allStored},
		{"gap", func(msg *nats.Msg) bool { return chunkSeq(msg) == n/2 }, mixed},
		{"tail", func(msg *nats.Msg) bool { return chunkSeq(msg) >= n-2 }, mixed},
		{"corrupted live", func(msg *nats.Msg) bool {
			if chunkSeq(msg) == 4 {
				msg.Data[7] ^= 1
			}
			return false
		}, mixed},
		{"live bytes not the manifest's", func(msg *nats.Msg) bool {
			// Consistent (its CRC fits its header) but not what was stored:
			// its CRC is not the manifest's chunk table entry.
			if chunkSeq(msg) == 4 {
				msg.Data[7] ^= 1
				msg.Header.Set(HeaderCRC, fmt.Sprintf("%08x", CRC32C(msg.Data)))
			}
			return false
		}, allStored},
	}
	p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: chunk}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.ensure(context.Background()); err != nil {
		t.Fatal(err)
	}
	workers := make([]*worker, len(cases))
	for i, tc := range cases {
		workers[i] = startWorker(t, srv.URL(), a, tc.name, moe.RecipePerToken, func(c *ReceiverConfig) {
			// Long enough that a loaded machine (CI runs packages in parallel) never
			// looks like a lost chunk to the "live" worker; "tail" waits it out once.
			c.LiveIdle = time.Second
		})
		workers[i].r.liveHook = tc.hook // set before Run reads a chunk: Run waits for the bucket and the version first
		select {
		case <-workers[i].r.liveReady:
		case <-time.After(10 * time.Second):
			t.Fatalf("worker %s: no live subscription after 10 s", tc.name)
		}
	}
	publish(t, p, 1, stream, true)
	wantS, wantSc := fresh(t, b, moe.RecipePerToken)
	for i, tc := range cases {
		w := workers[i]
		st := w.waitStatus(t, 1)
		if st.State != StateApplied {
			t.Fatalf("%s: %+v", tc.name, st)
		}
		live, stored := w.chunks(t)
		t.Logf("%s: %d chunks live, %d from the stream", tc.name, live, stored)
		ok := live+stored == n
		switch tc.want {
		case allLive:
			ok = ok && stored == 0
		case mixed:
			ok = ok && live > 0 && stored > 0
		case allStored:
			ok = ok && live == 0
		}
		if !ok {
			t.Errorf("%s: %d chunks live and %d from the stream, of %d", tc.name, live, stored, n)
		}
		residentEquals(t, tc.name, w.m, b)
		gotS, gotSc := rollouts(t, w.e)
		sameRollouts(t, tc.name+" vs fresh B", gotS, gotSc, wantS, wantSc)
	}
}

// TestLiveOverflow: when the live subscription overflowed (the rest of a
// version that fell back to the stream piled up unread), the slow-consumer
// error that the next read returns does not send the next version to the
// stream, and the feed that fell back discards its version's leftovers,
// keeping the first message of a later version for the next receive.
func TestLiveOverflow(t *testing.T) {
	srv := refittest.StartServer(t)
	nc := refittest.Connect(t, srv.URL())
	r := &Receiver{nc: nc, liveOpts: liveOptions(nc), cfg: ReceiverConfig{Model: testModel, LiveIdle: 50 * time.Millisecond, MaxBytes: 64 << 10,
		LivePendingBytes: 64 << 10}, log: zap.NewNop()}
	l, err := r.subscribeLive(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.close)
	pub := refittest.Connect(t, srv.URL())
	payload := make([]byte, 8<<10)
	send := func(v uint64, n int) {
		t.Helper()
		for range n {
			if err := pub.Publish(VersionSubject(testModel, v), payload); err != nil {
				t.Fatal(err)
			}
		}
		if err := pub.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	send(1, 20) // 160 KiB into a 64 KiB limit
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if d, _ := l.sub.Dropped(); d > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no message dropped: the overflow did not happen")
		}
	}

	// Version 2's feed: the slow-consumer error is skipped, not a reason
	// to leave the live path; version 1's leftovers are skipped too.
	f := &chunkFeed{r: r, a: Announce{Version: 2}, subject: VersionSubject(testModel, 2), live: l, log: zap.NewNop()}
	for i := 0; ; i++ {
		_, _, skip, why := f.nextLive(context.Background(), expect{total: -1})
		if why != "" {
			if i == 0 || !strings.Contains(why, "no live chunk") {
				t.Fatalf("read %d: the feed left the live path: %s", i, why)
			}
			break // version 1's leftovers are all read; nothing of version 2 was sent
		}
		if !skip {
			t.Fatalf("read %d: a version 1 message taken as version 2's chunk", i)
		}
	}

	// A feed that fell back drains its version's leftovers, stopping at a
	// later version's first message.
	send(2, 5)
	send(3, 1)
	send(3, 2)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if n, _, _ := l.sub.Pending(); n == 8 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the 8 messages did not all arrive")
		}
	}
	f.drain, f.live = l, nil
	f.drainLive()
	if l.stash == nil || l.stash.Subject != VersionSubject(testModel, 3) {
		t.Fatalf("stash %v: want version 3's first message", l.stash)
	}
	if n, _, _ := l.sub.Pending(); n != 2 {
		t.Fatalf("%d messages left: want version 3's other 2", n)
	}
}

// TestStreamPull reads the eight parts of a version (48 MiB each, chunks
// of 1 MiB) from their streams at once, as a worker does after it falls
// back or joins late, each part over its own connection (partJS): every
// chunk arrives in order, and the server never cuts a connection off as a
// slow consumer. Consumers that pulled the receiver's whole MaxBytes each
// over one connection were cut off again and again, each time starting
// over; pulling two chunks at a time, they sometimes stopped pulling
// (pullBytes).
func TestStreamPull(t *testing.T) {
	if testing.Short() {
		t.Skip("publishes 384 MiB")
	}
	srv := refittest.StartServer(t)
	p := newPublisher(t, srv.URL())
	const parts, chunk, n = 8, 1<<20 - 4<<10, 48 // the default chunk on a server of 1 MiB max_payload
	for i := range parts {
		if _, err := p.ensurePartStream(context.Background(), i); err != nil {
			t.Fatal(err)
		}
	}
	pub := refittest.Connect(t, srv.URL())
	pjs, err := jetstream.New(pub)
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, chunk)
	for part := range parts {
		for i := range n {
			data[0], data[1], data[2] = byte(i), byte(i>>8), byte(part)
			c := Chunk{Version: 1, Seq: i, Offset: int64(i) * chunk, Total: n * chunk, Chunks: n, CRC: CRC32C(data)}
			msg := &nats.Msg{Subject: PartSubject(testModel, 1, part), Header: c.Header(), Data: data}
			if _, err := pjs.PublishMsgAsync(msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	select {
	case <-pjs.PublishAsyncComplete():
	case <-time.After(60 * time.Second):
		t.Fatal("publish did not complete")
	}

	var cutOff atomic.Int64
	nc, err := nats.Connect(srv.URL(), nats.DisconnectErrHandler(func(*nats.Conn, error) { cutOff.Add(1) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	// The parts' own connections count their cut-offs too.
	lo := liveOptions(nc)
	lo.DisconnectedErrCB = func(*nats.Conn, error) { cutOff.Add(1) }
	r := &Receiver{nc: nc, js: js, liveOpts: lo, log: zap.NewNop(), cfg: ReceiverConfig{Model: testModel, MaxBytes: 64 << 20, ChunkTimeout: 20 * time.Second}}
	t.Cleanup(r.closePartConns)
	start := time.Now()
	errs := make(chan error, parts)
	for part := range parts {
		go func() {
			f := r.newFeed(Announce{Protocol: ProtocolVersion, Model: testModel, Version: 1, Full: true, Subject: PartSubject(testModel, 1, part),
				TotalBytes: n * chunk, ChunkBytes: chunk, Chunks: n}, part, nil)
			defer f.close()
			want := expect{total: -1}
			for i := range n {
				c, err := f.next(context.Background(), want)
				if err != nil {
					errs <- fmt.Errorf("part %d, chunk %d: %w", part, i, err)
					return
				}
				if c.data[0] != byte(i) || c.data[1] != byte(i>>8) || c.data[2] != byte(part) {
					errs <- fmt.Errorf("part %d, chunk %d: the payload of part %d, chunk %d", part, i, c.data[2], int(c.data[0])|int(c.data[1])<<8)
					return
				}
				want = expect{seq: i + 1, offset: int64(i+1) * chunk, total: c.Total, chunks: c.Chunks}
			}
			errs <- nil
		}()
	}
	for range parts {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	el := time.Since(start)
	t.Logf("%d parts of %d MiB from their streams in %v (%.2f GB/s), cut off %d times",
		parts, n*chunk>>20, el, float64(parts*n*chunk)/el.Seconds()/1e9, cutOff.Load())
	if c := cutOff.Load(); c != 0 {
		t.Errorf("the server cut a connection off %d times", c)
	}
	if got := len(r.partConns); got != parts-1 {
		t.Errorf("%d part stream connections, want one for each of parts 1-%d", got, parts-1)
	}
}

// TestReceiverConfigErrors: a receiver configuration out of range is
// refused, naming the field, before anything is connected or allocated.
func TestReceiverConfigErrors(t *testing.T) {
	for _, c := range []struct {
		cfg  ReceiverConfig
		want string
	}{
		{ReceiverConfig{Model: "bad model", Worker: "w"}, "model id"},
		{ReceiverConfig{Model: testModel}, "empty worker id"},
		{ReceiverConfig{Model: testModel, Worker: "w", LivePendingBytes: -1}, "live pending bytes -1"},
		{ReceiverConfig{Model: testModel, Worker: "w", LiveParts: MaxParts + 1}, fmt.Sprintf("live parts %d", MaxParts+1)},
	} {
		_, err := NewReceiver(nil, nil, nil, c.cfg, zap.NewNop(), nil)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: error %v, want it to name %q", c.cfg, err, c.want)
		}
	}
}
