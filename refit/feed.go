package refit

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// DefaultLivePendingBytes is the live chunks a part's subscription holds
// unread before it drops: a publisher sends a part at up to about 2 GB/s,
// so 256 MiB rides out about a tenth of a second of the worker not
// reading (starting a version, a collection), where the default of the
// NATS client, 64 MiB, overflowed in the first half-second of a version
// of four parts on a GPU worker. The memory is taken only while behind.
const DefaultLivePendingBytes = 256 << 20

// DefaultLiveIdle is how long a receiver waits for the next live chunk
// before it looks for a lost one (ReceiverConfig.LiveIdle).
const DefaultLiveIdle = 250 * time.Millisecond

// The live path (PROTOCOL.md, "Worker behaviour"): a JetStream publish is
// also delivered to the core-NATS subscribers of its subject, so a worker
// that subscribes to refit.<model>.v.* gets every chunk as the server
// receives it, without the stream's store-then-redeliver round (which is
// what limited throughput: docs/REFIT.md, "Throughput"). Core NATS drops
// what it cannot deliver and does not replay, so the live path is only a
// fast path: a chunk that is missing, out of order or fails a check sends
// the receiver to the stream for the rest of the version, and the
// manifest's digest is checked whatever path the bytes came by. The
// stream stays the store of record for late joiners, gaps and restarts.

// liveSub is the receiver's core-NATS subscription to every version
// subject of its model, on a connection of its own. Run owns it (subscribes
// before it watches the bucket, so no chunk of an announced version is
// published before it, and closes it on return); receive reads it. The
// subscription's pending limit bounds by bytes what waits to be read:
// beyond it NATS drops chunks and the receiver falls back to the stream.
//
// Its own connection, because the server pushes every chunk to every
// worker: a worker that falls behind may be cut off by the server as a
// slow consumer, and that must end only the live path (the worker
// reconnects and reads what it missed from the stream), never the
// connection its rollout service answers on.
type liveSub struct {
	nc  *nats.Conn
	sub *nats.Subscription
	// stash is a chunk of a later version read while receiving an earlier
	// one: the next receive starts with it.
	stash *nats.Msg
}

// subscribeLive connects (with the options of the receiver's connection),
// subscribes to the model's version subjects and waits until the server has
// the subscription. It retries with backoff until ctx ends: a worker that
// starts while NATS is down waits for it, as it waits for the bucket.
func (r *Receiver) subscribeLive(ctx context.Context, part int) (*liveSub, error) {
	for backoff := 10 * time.Millisecond; ; backoff = min(2*backoff, 5*time.Second) {
		l, err := r.trySubscribeLive(ctx, part)
		if err == nil {
			return l, nil
		}
		r.log.Warn("refit: live subscription failed; retrying", zap.Duration("in", backoff), zap.Error(err))
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(backoff):
		}
	}
}

// liveOptions copies nc's options for the live connection: the same
// servers, credentials and TLS, none of nc's handlers (a closed or errored
// live connection must not reach whatever owns nc, such as a micro
// service's handlers).
func liveOptions(nc *nats.Conn) nats.Options {
	opts := nc.Opts
	opts.Name = strings.TrimSpace(opts.Name + " refit-live")
	opts.ClosedCB, opts.DisconnectedCB, opts.DisconnectedErrCB, opts.ConnectedCB = nil, nil, nil, nil
	opts.ReconnectedCB, opts.DiscoveredServersCB, opts.AsyncErrorCB, opts.LameDuckModeHandler = nil, nil, nil, nil
	opts.ReconnectErrCB = nil
	return opts
}

// partOptions points opts at the server of part (PublisherConfig and
// ReceiverConfig PartServers): part i >= 1 at servers[(i-1) mod len],
// part 0, or every part without servers, where opts already point.
func partOptions(opts nats.Options, servers []string, part int) nats.Options {
	if part >= 1 && len(servers) > 0 {
		opts.Url, opts.Servers = servers[(part-1)%len(servers)], nil
	}
	return opts
}

// parseServerURL parses a NATS server URL, "nats://" assumed where it
// names no scheme (as nats.go does).
func parseServerURL(s string) (*url.URL, error) {
	if !strings.Contains(s, "://") {
		s = "nats://" + s
	}
	return url.Parse(s)
}

// redactedURL is a server URL without its user information (credentials),
// for logs and errors.
func redactedURL(s string) string {
	pu, err := parseServerURL(s)
	if err != nil {
		return "(a server URL that does not parse)"
	}
	return pu.Scheme + "://" + pu.Host
}

// checkPartServers checks a list of part servers: at most MaxParts - 1
// (parts 1 to MaxParts - 1), each a server URL ("nats://host:port", or
// "host:port"), no two alike.
func checkPartServers(servers []string) error {
	if len(servers) > MaxParts-1 {
		return fmt.Errorf("%d part servers: at most %d (parts 1 to %d)", len(servers), MaxParts-1, MaxParts-1)
	}
	seen := map[string]bool{}
	for i, s := range servers {
		pu, err := parseServerURL(s)
		if err != nil || pu.Host == "" || pu.Port() == "" || strings.ContainsAny(s, " ,") {
			return fmt.Errorf("part server %d %q: want a server URL such as nats://127.0.0.1:4223", i+1, redactedURL(s))
		}
		if seen[s] {
			return fmt.Errorf("part server %s listed twice", redactedURL(s))
		}
		seen[s] = true
	}
	return nil
}

func (r *Receiver) trySubscribeLive(ctx context.Context, part int) (*liveSub, error) {
	subjects := PartLiveSubjects(r.cfg.Model, part)
	opts := partOptions(r.liveOpts, r.cfg.PartServers, part)
	nc, err := opts.Connect()
	if err != nil {
		return nil, fmt.Errorf("refit: receiver: connect for part %d's live chunks: %w", part, err)
	}
	sub, err := nc.SubscribeSync(subjects)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("refit: receiver: subscribe to %s: %w", subjects, err)
	}
	// Unlimited messages, bounded bytes: chunk sizes vary with max_payload.
	limit := DefaultLivePendingBytes
	if r.cfg.LivePendingBytes > 0 {
		limit = r.cfg.LivePendingBytes
	}
	if err := sub.SetPendingLimits(-1, limit); err != nil {
		nc.Close()
		return nil, fmt.Errorf("refit: receiver: live pending limits: %w", err)
	}
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second) // a flush needs a deadline
	defer cancel()
	if err := nc.FlushWithContext(fctx); err != nil {
		nc.Close()
		return nil, fmt.Errorf("refit: receiver: subscribe to %s: flush: %w", subjects, err)
	}
	return &liveSub{nc: nc, sub: sub}, nil
}

// close ends the subscription and its connection.
func (l *liveSub) close() { l.nc.Close() }

// next returns the next live message, the stashed one first.
func (l *liveSub) next(ctx context.Context) (*nats.Msg, error) {
	if m := l.stash; m != nil {
		l.stash = nil
		return m, nil
	}
	return l.sub.NextMsgWithContext(ctx)
}

// feedChunk is one verified chunk, in order.
type feedChunk struct {
	Chunk
	data []byte
}

// chunkFeed yields the chunks of one version in order, each verified
// against the chunks before it (sequence, offset, totals, CRC-32C): from
// the live subscription while it keeps up, then from an ordered JetStream
// consumer on the version's subject. It belongs to one receive call, which
// must call close.
type chunkFeed struct {
	r    *Receiver
	a    Announce // the version, its part's subject, bytes and chunks in place of part 0's
	part int
	// subject is where the part's chunks come live, stored where its
	// stream keeps them: the same subject but for live-first versions.
	subject, stored string
	log             *zap.Logger

	live *liveSub // nil once the feed has switched to the stream
	// watch follows the bucket while the stream is read: a newer version
	// announced before this one completed ends it (versionWatch).
	watch *versionWatch
	// drain is the live subscription after the switch: the rest of this
	// version keeps arriving there, and is discarded as the stream is read
	// (see drainLive) so that it cannot fill the pending limit and make
	// the next version lose its live chunks.
	drain *liveSub

	// The stream consumer, once opened.
	msgs    chan jetstream.Msg
	stopper func()
	resume  int // the chunk the stream must deliver next; earlier ones are skipped until it comes
	synced  bool
	timer   *time.Timer
	fromJS  int // chunks taken from the stream
	fromNet int // chunks taken live
	// lastLive is when the feed started or last read a live message.
	lastLive time.Time
	// The live subscription's drops and its connection's reconnects when
	// the feed started (liveLost); lost: a test hook dropped a chunk.
	dropped    int
	reconnects uint64
	lost       bool
	// unreported is the live bytes taken since the last progress report.
	unreported int
}

// report tells the publisher of a live-first version how far the part got
// live (flowGate), every FlowReportBytes and at its last chunk. A report
// that cannot be sent only leaves the live pass unpaced by this worker.
func (f *chunkFeed) report(c Chunk, n int) {
	if f.unreported += n; f.unreported < cmp.Or(f.r.reportBytes, FlowReportBytes) && c.Seq != c.Chunks-1 {
		return
	}
	f.unreported = 0
	f.sendReport(c.Seq + 1)
}

// follow reports, before any chunk, that this worker follows the part
// live (next 0): the live pass then holds its window from the start.
// Otherwise a worker still planning the version (its header, the staging)
// when the pass's wait for a first report runs out would see the pass go
// on unpaced, and could be cut off past the server's max_pending.
func (f *chunkFeed) follow() {
	if f.live != nil {
		f.sendReport(0)
	}
}

// sendStopped tells the publisher of a version of parts that this
// worker no longer follows the part live, so that the live pass does not
// wait for it there (it would until this worker fell silent on every
// part, holding the part back for every other worker).
func (f *chunkFeed) sendStopped() {
	f.send(FlowReport{Worker: f.r.cfg.Worker, Version: f.a.Version, Part: f.part, Stopped: true})
}

// sendReport sends a progress report: next is the next chunk the part
// needs. Reports on every part go to the receiver's own server, where the
// announcements are and the publisher listens, not to the part's server:
// part servers need not be one cluster.
func (f *chunkFeed) sendReport(next int) {
	f.send(FlowReport{Worker: f.r.cfg.Worker, Version: f.a.Version, Part: f.part, Next: next})
}

// send publishes report r, for versions of parts only (live first, or
// followed live as they are stored).
func (f *chunkFeed) send(r FlowReport) {
	if f.a.Protocol != ProtocolLive && f.a.Protocol != ProtocolParts || f.r.reportBytes < 0 {
		return
	}
	b, err := json.Marshal(r)
	if err == nil {
		err = f.r.nc.Publish(FlowSubject(f.r.cfg.Model), b)
	}
	if err != nil {
		f.log.Debug("refit: progress report not sent", zap.Error(err))
	}
}

// newFeed prepares the feed of part of version a (a's subject, bytes and
// chunks those of the part): live first when live is given.
func (r *Receiver) newFeed(a Announce, part int, live *liveSub) *chunkFeed {
	log := r.log.With(zap.Uint64("version", a.Version))
	if part > 0 {
		log = log.With(zap.Int("part", part))
	}
	f := &chunkFeed{r: r, a: a, part: part, subject: liveSubject(a.Protocol, r.cfg.Model, a.Version, part),
		stored: storedSubject(a.Protocol, r.cfg.Model, a.Version, part), live: live, log: log, lastLive: time.Now()}
	if live != nil {
		f.dropped, _ = live.sub.Dropped()
		f.reconnects = live.nc.Stats().Reconnects
	}
	return f
}

// close stops the stream consumer, if any, and discards what is left of
// this version on the live subscription.
func (f *chunkFeed) close() {
	f.drainLive()
	if f.stopper != nil {
		f.stopper()
		f.stopper = nil
	}
	if f.timer != nil {
		f.timer.Stop()
	}
}

// expect is what the next chunk must be; total < 0 while unknown.
type expect struct {
	seq    int
	offset int64
	total  int64
	chunks int
}

// check verifies a chunk against what is expected of it.
func (f *chunkFeed) check(c Chunk, data []byte, want expect) error {
	switch {
	case c.Version != f.a.Version:
		return fmt.Errorf("chunk of version %d on the subject of version %d", c.Version, f.a.Version)
	case c.Protocol != f.a.Protocol:
		return fmt.Errorf("version %d: chunk %d of protocol %d, the version is announced in protocol %d", f.a.Version, c.Seq, c.Protocol, f.a.Protocol)
	case c.Seq != want.seq || c.Offset != want.offset:
		return fmt.Errorf("version %d: chunk %d at offset %d, want chunk %d at offset %d", f.a.Version, c.Seq, c.Offset, want.seq, want.offset)
	case want.total >= 0 && (c.Total != want.total || c.Chunks != want.chunks):
		return fmt.Errorf("version %d: chunk %d says %d bytes in %d chunks, earlier chunks said %d in %d", f.a.Version, c.Seq, c.Total, c.Chunks, want.total, want.chunks)
	}
	return c.Verify(data)
}

// next returns the chunk want describes, verified. A live chunk that is not
// it (a gap, a failed check) or a live path that goes quiet switches the
// feed to the stream, which then decides: there a chunk that fails a check
// is an error, and so is silence for ChunkTimeout.
func (f *chunkFeed) next(ctx context.Context, want expect) (feedChunk, error) {
	for f.live != nil {
		c, data, skip, why := f.nextLive(ctx, want)
		if ctx.Err() != nil {
			return feedChunk{}, ctx.Err()
		}
		if skip {
			continue
		}
		if why == "" {
			f.fromNet++
			f.report(c, len(data))
			return feedChunk{Chunk: c, data: data}, nil
		}
		f.log.Info("refit: fetching the rest of the version from the stream", zap.Int("from_chunk", want.seq),
			zap.Int("live_chunks", f.fromNet), zap.String("why", why))
		f.sendStopped()
		if err := f.toStream(ctx, want.seq); err != nil {
			return feedChunk{}, err
		}
	}
	if f.msgs == nil { // no live path for this version
		if err := f.toStream(ctx, want.seq); err != nil {
			return feedChunk{}, err
		}
	}
	return f.nextStored(ctx, want)
}

// nextLive reads one live message. It returns the chunk when it is the one
// wanted (why empty), skip for a message to ignore (another version's, a
// resent chunk already received), or why the live path cannot go on.
func (f *chunkFeed) nextLive(ctx context.Context, want expect) (c Chunk, data []byte, skip bool, why string) {
	lctx, cancel := context.WithTimeout(ctx, f.r.cfg.LiveIdle)
	msg, err := f.live.next(lctx)
	cancel()
	switch {
	case ctx.Err() != nil:
		return c, nil, false, "stopping"
	case errors.Is(err, context.DeadlineExceeded) && f.a.Protocol == ProtocolLive:
		// The stream gets a live-first version's chunks only after its
		// live pass: a pause of the live pass is waited out (up to
		// ChunkTimeout of silence), unless the version is sealed, which
		// says the live pass is over and the rest was lost.
		switch {
		case f.r.sealed.Load() == f.a.Version:
			return c, nil, false, "the version is sealed: its live chunks are all sent"
		case time.Since(f.lastLive) >= f.r.cfg.ChunkTimeout:
			return c, nil, false, fmt.Sprintf("no live chunk for %v", f.r.cfg.ChunkTimeout)
		}
		return c, nil, true, ""
	case errors.Is(err, context.DeadlineExceeded):
		// A version stored as it goes: a pause of the live path is a
		// chunk lost (liveLost), which switches to the stream, or a
		// publisher held back, which the stream would not cut short:
		// that is waited out, up to ChunkTimeout of silence.
		silent := time.Since(f.lastLive).Round(time.Millisecond)
		if why := f.liveLost(ctx); why != "" {
			return c, nil, false, fmt.Sprintf("no live chunk for %v: %s", silent, why)
		}
		if silent >= f.r.cfg.ChunkTimeout {
			return c, nil, false, fmt.Sprintf("no live chunk for %v", silent)
		}
		return c, nil, true, ""
	case errors.Is(err, nats.ErrSlowConsumer):
		// Something was dropped: perhaps this version's chunk, which the
		// sequence check then catches, perhaps leftovers of an older one.
		// The error itself says nothing about this version.
		return c, nil, true, ""
	case err != nil:
		return c, nil, false, fmt.Sprintf("live subscription: %v", err)
	}
	f.lastLive = time.Now()
	if msg.Subject != f.subject {
		if v, ok := versionOfLiveSubject(f.r.cfg.Model, f.part, msg.Subject); ok && v > f.a.Version {
			// A later version has started: this one's live chunks are over.
			f.live.stash = msg
			return c, nil, false, fmt.Sprintf("version %d started live", v)
		}
		return c, nil, true, "" // an older version's
	}
	if f.r.liveHook != nil && f.r.liveHook(msg) {
		f.lost = true
		return c, nil, true, "" // tests: lost on the way
	}
	c, err = ParseChunk(msg.Header, len(msg.Data))
	if err != nil {
		return c, nil, false, fmt.Sprintf("live chunk: %v", err)
	}
	if c.Version == f.a.Version && c.Seq < want.seq {
		return c, nil, true, "" // a chunk sent again after a lost acknowledgement
	}
	if err := f.check(c, msg.Data, want); err != nil {
		return c, nil, false, err.Error()
	}
	return c, msg.Data, false, ""
}

// liveLost says why a quiet live path of a version stored as it goes
// cannot go on, or "" when it may wait on. Such a version's chunks come
// live as the server takes them, so the wanted one can be missing only if
// this worker's client dropped it (past its pending limit), the server cut
// the live connection off (past its max_pending: the client reconnects),
// or the publisher gave up on the version (a newer one is announced).
// Otherwise the publisher is held back (by the servers' store, by the
// workers' reports) or the chunk is on its way, and the stream would not
// have it sooner.
func (f *chunkFeed) liveLost(ctx context.Context) string {
	if d, err := f.live.sub.Dropped(); err != nil || d > f.dropped || f.lost {
		return "live chunks were dropped"
	}
	if f.live.nc.Stats().Reconnects > f.reconnects {
		return "the live connection was cut off and made again"
	}
	if f.watch == nil {
		return ""
	}
	qctx, cancel := context.WithTimeout(ctx, f.r.cfg.LiveIdle)
	defer cancel()
	if e, err := f.watch.kv.Get(qctx, KeyAnnounce); err == nil {
		if a, err := f.r.parseAnnounce(e.Value()); err == nil && a.Version > f.a.Version {
			return fmt.Sprintf("version %d is announced", a.Version)
		}
	}
	return ""
}

// toStream switches the feed to the stream, from chunk seq on.
func (f *chunkFeed) toStream(ctx context.Context, seq int) error {
	wasLive := f.live != nil
	if wasLive {
		f.drain = f.live
	}
	f.live = nil
	name := PartStreamName(f.r.cfg.Model, f.part)
	js, where, err := f.r.partJS(f.part)
	if err != nil {
		return err
	}
	stream, err := js.Stream(ctx, name)
	if err != nil {
		return fmt.Errorf("stream %s%s: %w", name, where, err)
	}
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{f.stored}, DeliverPolicy: jetstream.DeliverAllPolicy}
	if start, ok := f.startSeq(ctx, stream, seq); ok {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, start
	}
	cons, err := stream.OrderedConsumer(ctx, cfg)
	if err != nil {
		return fmt.Errorf("consumer for version %d: %w", f.a.Version, err)
	}
	msgs := make(chan jetstream.Msg, 4)
	done := make(chan struct{}) // ends a callback blocked on msgs once the feed closes
	cc, err := cons.Consume(func(m jetstream.Msg) {
		select {
		case msgs <- m:
		case <-done:
		case <-ctx.Done():
		}
	}, jetstream.PullMaxBytes(pullBytes(f.r.cfg.MaxBytes, f.a.ChunkBytes)))
	if err != nil {
		return fmt.Errorf("consume version %d: %w", f.a.Version, err)
	}
	f.msgs, f.resume = msgs, seq
	f.stopper = func() {
		cc.Stop()
		close(done)
	}
	// The stream has ChunkTimeout to deliver the next chunk; for a version
	// stored as it goes, less the live path's silence before the switch,
	// which waited for the same chunk (a live-first version's stream is
	// filled only after its live pass: a full ChunkTimeout).
	wait := f.r.cfg.ChunkTimeout
	if f.a.Protocol != ProtocolLive && wasLive {
		wait = max(wait-time.Since(f.lastLive), f.r.cfg.LiveIdle)
	}
	f.timer = time.NewTimer(wait)
	return nil
}

// pullBytes is how many bytes a part's stream consumer pulls ahead, over
// the part's own connection (Receiver.partJS): maxBytes, but no more than
// streamPullBytes, and no less than four chunks of chunkBytes.
//
// What a connection's consumers pull may all be on its way at once, and
// Consume asks for more while half a pull is still coming; past the
// server's outbound limit for one client (64 MiB by default) the server
// cuts the connection off as a slow consumer, and every ordered consumer
// on it starts over after the reconnect. Measured on one embedded server,
// memory streams of 1 MiB messages: one consumer 2.0-2.3 GB/s pulling 8
// to 24 MiB and 0.07-0.4 GB/s at 48-64 MiB; four consumers on one
// connection 1.8-2.1 GB/s pulling 4-8 MiB each and 0.02-0.03 GB/s at 16
// MiB each, cut off 19-26 times a GiB. Hence a connection a part. The
// floor: pulling about two chunks at a time, eight parts' consumers on one
// connection (2 MiB each) sometimes stopped asking for more after a chunk
// or a few, with hundreds waiting in the stream and no pull open at the
// server, until the chunk timeout rejected the version (nats.go's Consume
// asks again once what it still expects falls under half the window, and
// a window of two messages left it expecting bytes that were not coming).
// TestStreamPull checks both.
func pullBytes(maxBytes, chunkBytes int) int {
	return max(min(maxBytes, streamPullBytes), 4*(chunkBytes+64<<10))
}

// streamPullBytes is what a part's stream consumer pulls ahead at most
// (pullBytes).
const streamPullBytes = 16 << 20

// startSeq finds the stream sequence to replay chunk seq from: chunks are
// stored in order (Nats-Expected-Last-Msg-Id), so chunk seq is at least
// seq - c places after chunk c, the subject's first message. Starting
// there can only deliver chunks at or before seq, which the feed skips.
// ok is false when the whole subject is to be replayed.
func (f *chunkFeed) startSeq(ctx context.Context, stream jetstream.Stream, seq int) (uint64, bool) {
	if seq == 0 {
		return 0, false
	}
	first, err := stream.GetMsg(ctx, 1, jetstream.WithGetMsgSubject(f.stored))
	if err != nil {
		return 0, false
	}
	c, err := ParseChunk(first.Header, len(first.Data))
	if err != nil || c.Seq > seq {
		return 0, false
	}
	return first.Sequence + uint64(seq-c.Seq), true
}

// nextStored reads chunks from the stream until the wanted one; until the
// chunk the feed switched at arrives, earlier ones (received live) are
// skipped.
func (f *chunkFeed) nextStored(ctx context.Context, want expect) (feedChunk, error) {
	for {
		f.drainLive()
		var msg jetstream.Msg
		var updates <-chan jetstream.KeyValueEntry
		if f.watch != nil {
			updates = f.watch.updates
		}
		select {
		case <-ctx.Done():
			return feedChunk{}, ctx.Err()
		case <-f.timer.C:
			return feedChunk{}, fmt.Errorf("version %d: no chunk for %v after %d of %d bytes (publisher gone?)",
				f.a.Version, f.r.cfg.ChunkTimeout, want.offset, max(want.total, f.a.TotalBytes))
		case e, ok := <-updates:
			if !ok {
				f.watch.updates = nil
			} else if err := f.watch.note(ctx, e); err != nil {
				return feedChunk{}, err
			}
			continue
		case msg = <-f.msgs:
		}
		f.timer.Reset(f.r.cfg.ChunkTimeout)
		data := msg.Data()
		c, err := ParseChunk(msg.Headers(), len(data))
		if err != nil {
			return feedChunk{}, fmt.Errorf("version %d: %w", f.a.Version, err)
		}
		if !f.synced && c.Version == f.a.Version && c.Seq < f.resume {
			continue // received live already
		}
		f.synced = true
		if err := f.check(c, data, want); err != nil {
			return feedChunk{}, err
		}
		f.fromJS++
		return feedChunk{Chunk: c, data: data}, nil
	}
}

// drainLive discards, without waiting, the live messages of this version
// and older ones that are queued on the subscription the feed left; a
// message of a later version is stashed for the next receive and ends the
// drain (what follows it is that version's).
func (f *chunkFeed) drainLive() {
	l := f.drain
	if l == nil {
		return
	}
	for l.stash == nil {
		if n, _, err := l.sub.Pending(); err != nil || n == 0 {
			return
		}
		msg, err := l.sub.NextMsg(time.Millisecond)
		switch {
		case errors.Is(err, nats.ErrSlowConsumer):
			continue // the drops the overflow caused; the queue is still there
		case err != nil:
			return
		}
		if v, ok := versionOfLiveSubject(f.r.cfg.Model, f.part, msg.Subject); ok && v > f.a.Version {
			l.stash = msg
		}
	}
}

// versionOfLiveSubject parses the version of a subject part's live
// subscription delivers: a version subject (PartSubject) or a live one
// (LiveSubject).
func versionOfLiveSubject(model string, part int, subject string) (uint64, bool) {
	return versionOfPartSubject(model, part, strings.TrimSuffix(subject, ".live"))
}

// versionOfPartSubject parses the version of a subject of part of model's
// versions (PartSubject).
func versionOfPartSubject(model string, part int, subject string) (uint64, bool) {
	return versionAfter(partPrefix(model, part)+"v.", subject)
}

// versionOfStoredSubject parses the version of a subject that part's
// stream stores: the part's version subject (PartSubject) or its stored
// subject (StoredSubject).
func versionOfStoredSubject(model string, part int, subject string) (uint64, bool) {
	if v, ok := versionOfPartSubject(model, part, subject); ok {
		return v, true
	}
	return versionAfter(partPrefix(model, part)+"s.", subject)
}

// versionAfter parses the version that follows prefix in subject.
func versionAfter(prefix, subject string) (uint64, bool) {
	rest, ok := strings.CutPrefix(subject, prefix)
	if !ok {
		return 0, false
	}
	v, err := strconv.ParseUint(rest, 10, 64)
	return v, err == nil
}

// digester computes the SHA-256 of a protocol-1 version on its own
// goroutine, so that the costliest per-byte step of such a version runs
// beside the receive loop (on another core) rather than in it. The slices
// it is given must not change afterwards (chunk payloads are not reused).
// The receive call that makes it owns it and must call close; at most
// depth slices wait to be hashed.
type digester struct {
	in    chan []byte
	out   chan [sha256.Size]byte
	abort atomic.Bool
	done  bool
}

func newDigester(depth int) *digester {
	d := &digester{in: make(chan []byte, depth), out: make(chan [sha256.Size]byte, 1)}
	go func() {
		h := sha256.New()
		for b := range d.in {
			if !d.abort.Load() {
				h.Write(b)
			}
		}
		var sum [sha256.Size]byte
		h.Sum(sum[:0])
		d.out <- sum
	}()
	return d
}

// write queues b; it blocks while depth slices wait.
func (d *digester) write(ctx context.Context, b []byte) error {
	select {
	case d.in <- b:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// sum waits for the hash of everything written and stops the goroutine.
func (d *digester) sum() string {
	d.done = true
	close(d.in)
	s := <-d.out
	return hex.EncodeToString(s[:])
}

// close stops the goroutine if sum did not, dropping what is queued.
func (d *digester) close() {
	if d.done {
		return
	}
	d.done = true
	d.abort.Store(true)
	close(d.in)
	<-d.out
}
