package refit

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// Publisher defaults and limits (see PROTOCOL.md, "Flow control").
const (
	DefaultMaxInflightBytes = 64 << 20
	DefaultPublishTimeout   = 10 * time.Second
	// ChunkHeaderRoom is what a chunk leaves of the server's max_payload
	// for its NATS headers.
	ChunkHeaderRoom = 4 << 10
	// DefaultChunkBytes is the chunk size unless the server's max_payload
	// is smaller. Not the largest allowed (MaxChunkBytes): workers take
	// chunks live, so smaller chunks pipeline better (a worker starts on
	// the first one sooner and ends sooner after the last): 1 MiB chunks
	// refit 10-15% faster than 4 MiB ones on loopback (docs/REFIT.md,
	// "Throughput"), 2 MiB ones in between.
	DefaultChunkBytes = 1 << 20
)

// Backoff between retries of a failed publish (a chunk, the announcement,
// the manifest): doubling from retryMin up to retryMax.
const (
	retryMin = 20 * time.Millisecond
	retryMax = time.Second
)

// PublisherConfig configures a Publisher. Zero values take the defaults.
type PublisherConfig struct {
	// Model is the model id, [A-Za-z0-9_-]{1,64}.
	Model string
	// MaxInflightBytes bounds the chunk bytes published but not yet
	// acknowledged by JetStream (default DefaultMaxInflightBytes). It must
	// hold at least one chunk.
	MaxInflightBytes int64
	// ChunkBytes is the size of every chunk but the last; 0 means
	// min(DefaultChunkBytes, max_payload - ChunkHeaderRoom) of the server
	// the connection is on. More than min(MaxChunkBytes, max_payload -
	// ChunkHeaderRoom) is an error.
	ChunkBytes int
	// Storage of the stream and the bucket: jetstream.FileStorage (the zero
	// value, the default) or jetstream.MemoryStorage.
	Storage jetstream.StorageType
	// Replicas of the stream and the bucket in a cluster; 0 means 1.
	Replicas int
	// MaxStreamBytes, when positive, caps the stream's bytes (its
	// max_bytes; the oldest chunks go first). 0 keeps every chunk of the
	// newest two versions, which is what late joiners and workers that
	// miss live chunks read: a cap below two versions' bytes saves the
	// server's memory or disk at the price of those workers rejecting the
	// version when what they miss is gone (PROTOCOL.md, "JetStream
	// objects"); the next version is then full.
	MaxStreamBytes int64
	// Parts splits every version of more than one tensor into this many
	// parts (at tensor boundaries, of about equal bytes), each a stream
	// of its own published over a NATS connection of its own at once
	// (PROTOCOL.md, "Parts"): protocol 3, for more than one connection's
	// throughput. 0 or 1: one part, protocol 2. At most MaxParts; not
	// with Signer. The extra connections take the options of the one
	// NewPublisher is given; MaxInflightBytes bounds each.
	Parts int
	// PartServers, when set, are the NATS servers that carry parts 1 and
	// on: part i >= 1 is published over a connection to PartServers[(i-1)
	// mod len] and its stream is created there, so that a version's bytes
	// cross several servers (separate ones, or members of one cluster).
	// Part 0, the announcements and the manifests stay on the server of
	// the connection NewPublisher is given. Workers must be given the same
	// list (ReceiverConfig.PartServers). Empty: every part on that server.
	PartServers []string
	// LiveFirst sends a version of parts live first (PROTOCOL.md, "Live
	// first"; protocol 4): every part's chunks over core NATS at once,
	// then the seal, with which workers that received them all commit,
	// and only then the same chunks into the parts' streams, acknowledged,
	// and the manifest. The stream is then off the path to the workers'
	// commit: a version commits at what core NATS carries rather than at
	// what the servers store. Publish still returns once the manifest is
	// written. Versions of one part are not affected.
	LiveFirst bool
	// FlowWindow is how far, in bytes, a part's live pass (or, in a
	// version of parts not sent live first, its stored pass, which workers
	// follow live) may run ahead of the slowest worker reporting its
	// progress on it (default DefaultFlowWindow; at least one chunk);
	// FlowTimeout how long such a worker may stand still before the pass
	// goes on without it (default DefaultFlowTimeout). Versions of parts
	// only.
	FlowWindow  int64
	FlowTimeout time.Duration
	// PublishTimeout bounds the wait for one acknowledgement and one
	// JetStream API call (default DefaultPublishTimeout); after it the
	// operation is retried.
	PublishTimeout time.Duration
	// Signer, when set, signs every announcement and manifest
	// (PROTOCOL.md, "Signatures"): workers given a trust file apply only
	// signed versions. Its manifests also carry the whole stream's SHA-256,
	// at the cost of one SHA-256 pass over the bytes here and at every
	// worker that checks signatures.
	Signer *Signer
}

// Publisher publishes versions of one model (PROTOCOL.md). One Publisher,
// and one process, should publish a given model: Publish calls of a
// Publisher are serialized, and the stream's ordering guard (below) makes
// two concurrent publishers of one model stall each other.
type Publisher struct {
	nc  *nats.Conn
	js  jetstream.JetStream
	cfg PublisherConfig
	log *zap.Logger

	mu sync.Mutex // held by Publish
	// conns publish the parts of a version: conns[0] is nc and js, the
	// others the connections made for Parts. Each keeps its chunk buffers
	// for reuse by the next Publish (under mu).
	conns []*partConn

	// The workers' statuses on the versions this Publisher announced, the
	// last few of them, by version and worker (PROTOCOL.md, "After a
	// status other than applied"): a partial version is refused while a
	// worker's status on the previous version was not applied.
	statusSub *nats.Subscription
	// flow paces the passes workers follow live (a live-first version's live
	// pass, a stored version of parts' stored pass) by their progress
	// reports (flowSub); nil for a Publisher of one part.
	flow     *flowGate
	flowSub  *nats.Subscription
	statusMu sync.Mutex
	outcomes map[uint64]map[string]Status

	// onInflight, when set (by tests), sees the unacknowledged chunk bytes
	// after every chunk is published.
	onInflight func(bytes int64)
	// afterLive, when set (by tests), runs between a live-first version's
	// live pass (and its seal) and its stored pass.
	afterLive func(version uint64)
	// protocol is what Publish speaks: ProtocolVersion, or Protocol1 in
	// tests that play an older publisher.
	protocol int
}

// partConn is a connection that publishes one part of each version.
type partConn struct {
	nc   *nats.Conn
	js   jetstream.JetStream
	own  bool     // made by the Publisher, closed by Close
	free [][]byte // chunk buffers for reuse
}

// NewPublisher checks cfg, fills in its defaults and returns a Publisher
// on nc. A nil log logs nothing. It makes no JetStream calls: Publish
// creates or updates the stream and the bucket. It subscribes to the
// model's status subject, to record the workers' statuses on its versions
// (until Close, or until nc closes).
func NewPublisher(nc *nats.Conn, cfg PublisherConfig, log *zap.Logger) (*Publisher, error) {
	if log == nil {
		log = zap.NewNop()
	}
	fail := func(format string, args ...any) (*Publisher, error) {
		return nil, fmt.Errorf("refit: new publisher for model %q: %s", cfg.Model, fmt.Sprintf(format, args...))
	}
	if nc == nil {
		return fail("no NATS connection")
	}
	if !ValidModelID(cfg.Model) {
		return fail("invalid model id (want 1 to 64 of [A-Za-z0-9_-])")
	}
	maxChunk := min(int64(MaxChunkBytes), nc.MaxPayload()-ChunkHeaderRoom)
	if maxChunk <= 0 {
		return fail("the server's max_payload of %d bytes leaves no room for chunks (%d bytes go to headers)", nc.MaxPayload(), ChunkHeaderRoom)
	}
	switch {
	case cfg.ChunkBytes == 0:
		cfg.ChunkBytes = int(min(DefaultChunkBytes, maxChunk))
	case cfg.ChunkBytes < 0 || int64(cfg.ChunkBytes) > maxChunk:
		return fail("chunk bytes %d: want 1 to %d (min of %d and the server's max_payload %d less %d for headers)",
			cfg.ChunkBytes, maxChunk, MaxChunkBytes, nc.MaxPayload(), ChunkHeaderRoom)
	}
	if cfg.MaxInflightBytes == 0 {
		cfg.MaxInflightBytes = DefaultMaxInflightBytes
	}
	if cfg.MaxInflightBytes < int64(cfg.ChunkBytes) {
		return fail("max inflight bytes %d is less than one chunk of %d bytes", cfg.MaxInflightBytes, cfg.ChunkBytes)
	}
	if cfg.Storage != jetstream.FileStorage && cfg.Storage != jetstream.MemoryStorage {
		return fail("storage %v: want file or memory", cfg.Storage)
	}
	if cfg.Replicas < 0 {
		return fail("replicas %d", cfg.Replicas)
	}
	if cfg.MaxStreamBytes != 0 && cfg.MaxStreamBytes < cfg.MaxInflightBytes {
		return fail("max stream bytes %d: want 0 (no cap) or at least the %d bytes in flight", cfg.MaxStreamBytes, cfg.MaxInflightBytes)
	}
	if cfg.Replicas == 0 {
		cfg.Replicas = 1
	}
	if cfg.PublishTimeout < 0 {
		return fail("publish timeout %v", cfg.PublishTimeout)
	}
	if cfg.PublishTimeout == 0 {
		cfg.PublishTimeout = DefaultPublishTimeout
	}
	switch {
	case cfg.FlowWindow < 0 || cfg.FlowWindow > 0 && cfg.FlowWindow < int64(cfg.ChunkBytes):
		return fail("flow window %d: want 0 (the default) or at least one chunk of %d bytes", cfg.FlowWindow, cfg.ChunkBytes)
	case cfg.FlowTimeout < 0:
		return fail("flow timeout %v", cfg.FlowTimeout)
	}
	cfg.FlowWindow = cmp.Or(cfg.FlowWindow, DefaultFlowWindow)
	cfg.FlowTimeout = cmp.Or(cfg.FlowTimeout, DefaultFlowTimeout)
	switch {
	case cfg.Parts < 0 || cfg.Parts > MaxParts:
		return fail("parts %d: want 0 to %d", cfg.Parts, MaxParts)
	case cfg.Parts > 1 && cfg.Signer != nil:
		return fail("a signing publisher publishes versions of one part (parts are not signed)")
	case len(cfg.PartServers) > 0 && cfg.Parts < 2:
		return fail("%d part servers for versions of one part: they carry parts 1 and on", len(cfg.PartServers))
	}
	if err := checkPartServers(cfg.PartServers); err != nil {
		return fail("%v", err)
	}
	cfg.Parts = max(cfg.Parts, 1)
	// The window, not the library, bounds what is pending: leave it room.
	maxPending := cfg.MaxInflightBytes/int64(cfg.ChunkBytes) + 2
	newJS := func(nc *nats.Conn) (jetstream.JetStream, error) {
		return jetstream.New(nc,
			jetstream.WithPublishAsyncTimeout(cfg.PublishTimeout),
			jetstream.WithPublishAsyncMaxPending(int(min(maxPending, 1<<30))),
			jetstream.WithDefaultTimeout(cfg.PublishTimeout))
	}
	js, err := newJS(nc)
	if err != nil {
		return fail("jetstream: %v", err)
	}
	p := &Publisher{nc: nc, js: js, cfg: cfg, log: log.With(zap.String("model", cfg.Model)), protocol: ProtocolVersion,
		outcomes: map[uint64]map[string]Status{}, conns: []*partConn{{nc: nc, js: js}}}
	for i := 1; i < cfg.Parts; i++ {
		opts := partOptions(liveOptions(nc), cfg.PartServers, i)
		opts.Name = strings.TrimSpace(nc.Opts.Name + " refit-part-" + strconv.Itoa(i))
		pc, err := opts.Connect()
		if err == nil {
			var pjs jetstream.JetStream
			if pjs, err = newJS(pc); err == nil {
				p.conns = append(p.conns, &partConn{nc: pc, js: pjs, own: true})
				continue
			}
			pc.Close()
		}
		p.closeConns()
		return fail("connection for part %d: %v", i, err)
	}
	// Statuses are not stored: listen from the start.
	if p.statusSub, err = nc.Subscribe(StatusSubject(cfg.Model), p.noteStatus); err != nil {
		p.closeConns()
		return fail("subscribe to %s: %v", StatusSubject(cfg.Model), err)
	}
	if cfg.Parts > 1 {
		p.flow = newFlowGate()
		if p.flowSub, err = nc.Subscribe(FlowSubject(cfg.Model), p.flow.note); err != nil {
			p.statusSub.Unsubscribe()
			p.closeConns()
			return fail("subscribe to %s: %v", FlowSubject(cfg.Model), err)
		}
	}
	return p, nil
}

// closeConns closes the connections the Publisher made.
func (p *Publisher) closeConns() {
	for _, c := range p.conns {
		if c.own {
			c.nc.Close()
		}
	}
}

// ErrFullVersionNeeded refuses a partial version where PROTOCOL.md ("After
// a status other than applied") says the next version must be full.
var ErrFullVersionNeeded = errors.New("a full version is needed")

// keptOutcomes is how many of its versions a Publisher keeps statuses of.
const keptOutcomes = 4

// noteStatus records a worker's status on a version this Publisher
// announced; it runs on the subscription's goroutine.
func (p *Publisher) noteStatus(msg *nats.Msg) {
	s, err := ParseStatus(msg.Data)
	if err != nil {
		return
	}
	p.statusMu.Lock()
	defer p.statusMu.Unlock()
	if m := p.outcomes[s.Version]; m != nil {
		m[s.Worker] = s
	}
}

// expectStatuses starts recording statuses on version, forgetting those of
// all but the newest keptOutcomes versions.
func (p *Publisher) expectStatuses(version uint64) {
	p.statusMu.Lock()
	defer p.statusMu.Unlock()
	if p.outcomes[version] == nil {
		p.outcomes[version] = map[string]Status{}
	}
	for len(p.outcomes) > keptOutcomes {
		delete(p.outcomes, slices.Min(slices.Collect(maps.Keys(p.outcomes))))
	}
}

// Close stops recording the workers' statuses and closes the connections
// the Publisher made for Parts. Publish of a version of one part still
// works, without the check that needs the statuses. It is idempotent;
// closing the connection does as much for the statuses.
func (p *Publisher) Close() error {
	p.closeConns()
	for _, sub := range []*nats.Subscription{p.statusSub, p.flowSub} {
		if sub == nil {
			continue
		}
		if err := sub.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrBadSubscription) && !errors.Is(err, nats.ErrConnectionClosed) {
			return fmt.Errorf("refit: publisher of model %s: %w", p.cfg.Model, err)
		}
	}
	return nil
}

// fullNeeded says why the version after prev (the newest manifest) must be
// full, nil if a partial one will do (PROTOCOL.md, "After a status other
// than applied"): announced, the bucket's announcement, is newer than prev
// (an attempt that never completed, which workers that received part of it
// rejected), or a worker's status on prev, seen by this Publisher, was not
// applied.
func (p *Publisher) fullNeeded(prev, announced uint64) error {
	if announced > prev {
		return fmt.Errorf("%w: version %d was announced and never completed (the newest manifest is version %d): "+
			"the workers that received part of it rejected it", ErrFullVersionNeeded, announced, prev)
	}
	p.statusMu.Lock()
	defer p.statusMu.Unlock()
	got := p.outcomes[prev]
	var bad []string
	for _, w := range slices.Sorted(maps.Keys(got)) {
		if s := got[w]; s.State != StateApplied {
			why := s.State
			if s.Reason != "" {
				why += ": " + s.Reason
			}
			bad = append(bad, fmt.Sprintf("%s (%s)", w, why))
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("%w: version %d was not applied by %d of the %d workers that reported on it: %s",
			ErrFullVersionNeeded, prev, len(bad), len(got), listSome(bad, 5))
	}
	return nil
}

// FullVersionNeeded returns an error wrapping ErrFullVersionNeeded, saying
// why, when the next version must be full (PROTOCOL.md, "After a status
// other than applied"): a trainer may call it before it builds a partial
// version. It counts the statuses this Publisher saw on its own versions,
// so wait for the workers' statuses first (Statuses). nil: a partial
// version will do.
func (p *Publisher) FullVersionNeeded(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var kv jetstream.KeyValue
	err := p.retry(ctx, "look up bucket "+BucketName(p.cfg.Model), func(ctx context.Context) (err error) {
		kv, err = p.js.KeyValue(ctx, BucketName(p.cfg.Model))
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			kv, err = nil, nil
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("refit: model %s: %w", p.cfg.Model, err)
	}
	if kv == nil {
		return nil // nothing published yet
	}
	prev, _, err := p.previous(ctx, kv)
	if err != nil {
		return fmt.Errorf("refit: model %s: %w", p.cfg.Model, err)
	}
	announced, err := p.lastAnnounced(ctx, kv)
	if err != nil {
		return fmt.Errorf("refit: model %s: %w", p.cfg.Model, err)
	}
	if err := p.fullNeeded(prev, announced); err != nil {
		return fmt.Errorf("refit: model %s: %w", p.cfg.Model, err)
	}
	return nil
}

// Config returns the configuration with its defaults filled in.
func (p *Publisher) Config() PublisherConfig { return p.cfg }

// Publish publishes the safetensors stream of size bytes that src holds as
// version of the model, following PROTOCOL.md: it creates or updates the
// stream and the bucket, writes the announcement, publishes the chunks
// asynchronously with at most MaxInflightBytes unacknowledged, writes the
// manifest once JetStream has acknowledged every chunk, and then purges the
// versions older than the previous one. full says whether the stream holds
// every tensor of the model (see Source.Full).
//
// The stream's header is checked first (ParseHeader; every tensor BF16).
// version must be newer than the bucket's manifest, its subject must be
// empty and it must not be the bucket's announcement (a version number is
// used once: workers reject one they have seen; NextVersion gives the
// number to use). A partial version is refused, with an error wrapping
// ErrFullVersionNeeded, after a version announced and never completed, or
// when a worker's last status on the previous version that this Publisher
// published was not applied (PROTOCOL.md, "After a status other than
// applied"; FullVersionNeeded says it beforehand).
//
// A chunk whose publish fails or times out is published again, with the
// same Nats-Msg-Id, with backoff, until ctx ends, and so is everything
// after it: every chunk but the first carries Nats-Expected-Last-Msg-Id
// (the previous chunk's id), so the stream stores the chunks in order and
// exactly once even across a server restart. Errors that will not go away
// by themselves (a JetStream API error with a 4xx code, a closed
// connection, a message over max_payload) end the publish at once. src
// must not change while Publish runs.
func (p *Publisher) Publish(ctx context.Context, version uint64, src io.ReaderAt, size int64, full bool) (Manifest, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	m, err := p.publish(ctx, version, src, size, full, nil)
	if err != nil {
		return Manifest{}, fmt.Errorf("refit: publish version %d: %w", version, err)
	}
	return m, nil
}

// PublishDelta publishes src, a partial version holding delta tensors
// (DeltaDType: the elements that changed since base, PROTOCOL.md "Delta
// tensors"; DeltaSource makes such a stream) and possibly whole ones, as
// version, a delta on version base. It is Publish of a partial version,
// refused unless base is the newest version published: the version every
// partial version is a delta on, and the weights a worker must serve to
// apply it (a worker that serves another answers needs_full). So a trainer
// that computed the delta against the weights it published as base learns
// here, before anything is announced, that another version came between.
func (p *Publisher) PublishDelta(ctx context.Context, version, base uint64, src io.ReaderAt, size int64) (Manifest, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	m, err := p.publish(ctx, version, src, size, false, &base)
	if err != nil {
		return Manifest{}, fmt.Errorf("refit: publish version %d: %w", version, err)
	}
	return m, nil
}

// NewestVersion returns the newest version published (0 when none): the
// base of the next partial version. A signing publisher counts only the
// manifests signed by its own key.
func (p *Publisher) NewestVersion(ctx context.Context) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var kv jetstream.KeyValue
	err := p.retry(ctx, "look up bucket "+BucketName(p.cfg.Model), func(ctx context.Context) (err error) {
		kv, err = p.js.KeyValue(ctx, BucketName(p.cfg.Model))
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			kv, err = nil, nil
		}
		return err
	})
	if err != nil || kv == nil {
		return 0, err
	}
	v, _, err := p.previous(ctx, kv)
	if err != nil {
		return 0, fmt.Errorf("refit: model %s: %w", p.cfg.Model, err)
	}
	return v, nil
}

// publish publishes a version; deltaBase is the base a delta version was
// computed against (nil: no delta tensors allowed).
func (p *Publisher) publish(ctx context.Context, version uint64, src io.ReaderAt, size int64, full bool, deltaBase *uint64) (Manifest, error) {
	start := time.Now()
	model := p.cfg.Model
	switch {
	case version == 0:
		return Manifest{}, errors.New("versions start at 1")
	case size <= 8 || size > MaxStreamBytes:
		return Manifest{}, fmt.Errorf("stream of %d bytes: want 9 to %d", size, MaxStreamBytes)
	}
	hdr, headerSum, err := readHeader(src, size)
	if err != nil {
		return Manifest{}, err
	}
	if n := hdr.deltaTensors(); n > 0 && deltaBase == nil {
		return Manifest{}, fmt.Errorf("%d delta tensors (%s): publish them with PublishDelta, which checks their base", n, DeltaDType)
	}
	chunkBytes := int64(p.cfg.ChunkBytes)
	nChunks := (size + chunkBytes - 1) / chunkBytes
	if nChunks > 1<<31-1 {
		return Manifest{}, fmt.Errorf("%d chunks of %d bytes: too many", nChunks, chunkBytes)
	}
	m := Manifest{
		Announce: Announce{Protocol: p.protocol, Model: model, Version: version, Full: full,
			Subject: VersionSubject(model, version), TotalBytes: size, ChunkBytes: p.cfg.ChunkBytes, Chunks: int(nChunks)},
		HeaderBytes: int(hdr.Len),
		Tensors:     len(hdr.Tensors),
	}
	// A version of parts (protocol 3): the top-level fields are part 0's.
	var parts []*partSource
	if p.cfg.Parts > 1 && p.protocol == ProtocolVersion {
		if parts, err = splitParts(src, hdr, p.cfg.Parts); err != nil {
			return Manifest{}, err
		}
	}
	proto := ProtocolParts // of a version in parts
	if p.cfg.LiveFirst {
		proto = ProtocolLive
	}
	for i, ps := range parts {
		n := (ps.size + chunkBytes - 1) / chunkBytes
		if n > 1<<31-1 {
			return Manifest{}, fmt.Errorf("part %d: %d chunks of %d bytes: too many", i, n, chunkBytes)
		}
		m.Parts = append(m.Parts, Part{Subject: storedSubject(proto, model, version, i), TotalBytes: ps.size, Chunks: int(n),
			HeaderBytes: len(ps.head) - 8, Tensors: ps.tensors})
	}
	if len(parts) > 0 {
		m.Protocol, m.Subject, m.TotalBytes, m.Chunks = proto, m.Parts[0].Subject, m.Parts[0].TotalBytes, m.Parts[0].Chunks
		m.HeaderBytes, m.Tensors = m.Parts[0].HeaderBytes, m.Parts[0].Tensors
	}
	if p.cfg.Signer != nil {
		if p.protocol != ProtocolVersion {
			return Manifest{}, fmt.Errorf("protocol %d versions cannot be signed", p.protocol)
		}
		m.HeaderSHA256 = headerSum
	}
	if err := m.Announce.check("announce"); err != nil {
		return Manifest{}, err // cannot happen with the checks above; kept as the contract's guard
	}

	stream, kv, err := p.ensure(ctx)
	if err != nil {
		return Manifest{}, err
	}
	prev, unsignedPrev, err := p.previous(ctx, kv)
	if err != nil {
		return Manifest{}, err
	}
	if version <= prev {
		return Manifest{}, fmt.Errorf("not newer than version %d, the newest published", prev)
	}
	announced, err := p.lastAnnounced(ctx, kv)
	if err != nil {
		return Manifest{}, err
	}
	if !full {
		if p.cfg.Signer != nil && prev == 0 && unsignedPrev {
			return Manifest{}, fmt.Errorf("the bucket holds no manifest signed by %s to base a partial version on: publish a full version", p.cfg.Signer.PublicKey())
		}
		if err := p.fullNeeded(prev, announced); err != nil {
			return Manifest{}, fmt.Errorf("%w: publish a full version", err)
		}
		m.Base = prev // a partial version is a delta on the newest one published
		if deltaBase != nil && *deltaBase != prev {
			return Manifest{}, fmt.Errorf("a delta on version %d, but the newest version published is %d: compute the delta against that version's weights, or publish a full version", *deltaBase, prev)
		}
	}
	streams := []jetstream.Stream{stream}
	for i := 1; i < len(parts); i++ {
		ps, err := p.ensurePartStream(ctx, i)
		if err != nil {
			return Manifest{}, err
		}
		streams = append(streams, ps)
	}
	for i, st := range streams {
		subjects, err := p.subjects(ctx, st, i)
		if err != nil {
			return Manifest{}, err
		}
		if subj := storedSubject(m.Protocol, model, version, i); subjects[subj] > 0 {
			return Manifest{}, fmt.Errorf("subject %s already holds %d chunks (an earlier attempt?): publish a newer version", subj, subjects[subj])
		}
	}
	if version == announced {
		return Manifest{}, fmt.Errorf("version %d was announced already (an attempt that did not finish?): workers that saw it take the number as used; publish a newer version", version)
	}

	p.expectStatuses(version)
	log := p.log.With(zap.Uint64("version", version))
	log.Info("refit: publishing", zap.Int64("bytes", size), zap.Int("parts", max(len(parts), 1)), zap.Int("chunks", m.Chunks),
		zap.Int("chunk_bytes", m.ChunkBytes), zap.Int("tensors", m.Tensors), zap.Bool("full", full), zap.Uint64("previous", prev))
	if p.cfg.Signer != nil {
		if err := p.cfg.Signer.SignAnnounce(&m.Announce); err != nil {
			return Manifest{}, err
		}
	}
	if err := p.put(ctx, kv, KeyAnnounce, m.Announce); err != nil {
		return Manifest{}, err
	}
	// The announcement's signature is its own: the manifest is signed below.
	m.Announce.SignedBy, m.Announce.Signature = "", ""
	var sum, streamSum string
	if len(parts) == 0 {
		if sum, streamSum, err = p.sendChunks(ctx, log, version, src, size); err != nil {
			return Manifest{}, err
		}
	} else {
		if m.Protocol == ProtocolLive {
			if err := p.sendLive(ctx, log, kv, m, parts); err != nil {
				return Manifest{}, err
			}
			if p.afterLive != nil {
				p.afterLive(version)
			}
		}
		if err := p.sendParts(ctx, log, m.Protocol, version, parts, m.Parts); err != nil {
			return Manifest{}, err
		}
		sum = m.Parts[0].ChunkTableSHA256
	}
	if p.protocol == Protocol1 {
		m.SHA256 = sum
	} else {
		m.ChunkTableSHA256 = sum
	}
	m.PublishedAt = time.Now().UTC()
	if p.cfg.Signer != nil {
		m.StreamSHA256 = streamSum
		if err := p.cfg.Signer.SignManifest(&m); err != nil {
			return Manifest{}, err
		}
	}
	if err := p.put(ctx, kv, KeyManifest, m); err != nil {
		return Manifest{}, err
	}
	elapsed := time.Since(start)
	log.Info("refit: published", zap.Duration("took", elapsed),
		zap.Float64("mib_per_s", float64(size)/(1<<20)/max(elapsed.Seconds(), 1e-9)), zap.String("digest", sum))

	// Retention is housekeeping: the version is out, so a failure is only
	// logged.
	for i, st := range streams {
		if err := p.purgeOld(ctx, st, i, version, prev); err != nil {
			log.Warn("refit: purge old versions", zap.Int("part", i), zap.Error(err))
		}
	}
	if err := p.purgeOtherParts(ctx, len(streams), version, prev); err != nil {
		log.Warn("refit: purge old versions of parts", zap.Error(err))
	}
	return m, nil
}

// purgeOtherParts purges, in the streams of the parts from on that this
// Publisher may have used (up to its Parts), the versions older than prev:
// parts that older versions left there (a version of fewer tensors than
// Parts is split into fewer parts) would otherwise stay until a version of
// that many parts comes. A stream that does not exist is skipped.
func (p *Publisher) purgeOtherParts(ctx context.Context, from int, version, prev uint64) error {
	for i := from; i < p.cfg.Parts; i++ {
		name := PartStreamName(p.cfg.Model, i)
		var st jetstream.Stream
		err := p.retry(ctx, "look up stream "+name, func(ctx context.Context) (err error) {
			st, err = p.partJS(i).Stream(ctx, name)
			if errors.Is(err, jetstream.ErrStreamNotFound) {
				st, err = nil, nil
			}
			return err
		})
		if err != nil {
			return err
		}
		if st == nil {
			continue
		}
		if err := p.purgeOld(ctx, st, i, version, prev); err != nil {
			return err
		}
	}
	return nil
}

// sendParts publishes the parts at once, each over its connection, and
// fills in their chunk tables' digests. The first to fail stops the
// others.
func (p *Publisher) sendParts(ctx context.Context, log *zap.Logger, proto int, version uint64, parts []*partSource, out []Part) error {
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if proto == ProtocolParts {
		// Workers follow these chunks live as they are stored: the pass
		// keeps within a window of them as a live-first one does.
		p.flow.start(version)
		defer func() {
			if left := p.flow.left(); len(left) > 0 {
				slices.Sort(left)
				log.Warn("refit: the parts went on without workers that stopped reporting (they read the rest from the streams)",
					zap.Strings("worker_parts", left))
			}
		}()
	}
	errs := make([]error, len(parts))
	var wg sync.WaitGroup
	for i, ps := range parts {
		wg.Go(func() {
			sum, _, err := p.sendPart(pctx, log.With(zap.Int("part", i)), proto, i, version, ps, ps.size)
			switch {
			case err != nil:
				errs[i] = fmt.Errorf("part %d: %w", i, err)
				cancel()
			case out[i].ChunkTableSHA256 != "" && out[i].ChunkTableSHA256 != sum:
				// Sent live already: the stream must hold what the seal
				// promised.
				errs[i] = fmt.Errorf("part %d: its chunk table's digest was %s sent live and %s stored: the source changed while it was published", i, out[i].ChunkTableSHA256, sum)
				cancel()
			default:
				out[i].ChunkTableSHA256 = sum
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	return errors.Join(errs...)
}

// sendLive sends the parts of version m (protocol 4) live, all at once,
// fills in m's parts' chunk table digests and writes the seal: m as its
// manifest will be, stamped now. Workers that received every chunk commit
// on it. A live pass that fails (but for ctx) is logged and leaves the
// version unsealed: the stored pass that follows is then all there is,
// and workers wait for the manifest.
func (p *Publisher) sendLive(ctx context.Context, log *zap.Logger, kv jetstream.KeyValue, m Manifest, parts []*partSource) error {
	start := time.Now()
	p.flow.start(m.Version)
	sums := make([]string, len(parts))
	errs := make([]error, len(parts))
	var wg sync.WaitGroup
	for i, ps := range parts {
		wg.Go(func() {
			sums[i], errs[i] = p.sendPartLive(ctx, i, m.Version, ps, ps.size)
			if errs[i] != nil {
				errs[i] = fmt.Errorf("part %d: %w", i, errs[i])
			}
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := errors.Join(errs...); err != nil {
		log.Warn("refit: live pass failed; the version goes to the streams unsealed", zap.Error(err))
		return nil
	}
	if left := p.flow.left(); len(left) > 0 {
		slices.Sort(left)
		log.Warn("refit: the live pass went on without workers that stopped reporting (they read the rest from the streams)",
			zap.Strings("worker_parts", left))
	}
	for i, sum := range sums {
		m.Parts[i].ChunkTableSHA256 = sum // m.Parts is the caller's: the stored pass checks against them
	}
	seal := m
	seal.Parts = slices.Clone(m.Parts)
	seal.ChunkTableSHA256, seal.PublishedAt = sums[0], time.Now().UTC()
	if err := p.put(ctx, kv, KeySealed, seal); err != nil {
		return err
	}
	var bytes int64
	for _, pt := range m.Parts {
		bytes += pt.TotalBytes
	}
	log.Info("refit: sealed", zap.Duration("live_pass", time.Since(start)),
		zap.Float64("mib_per_s", float64(bytes)/(1<<20)/max(time.Since(start).Seconds(), 1e-9)))
	return nil
}

// sendPartLive publishes part of a live-first version over core NATS on
// its live subject, every chunk once, in order, and returns the digest of
// its chunk table once the server has them all (a flush). Nothing is
// acknowledged or resent: a worker that misses a chunk reads the rest of
// the part from its stream once the stored pass has put it there.
func (p *Publisher) sendPartLive(ctx context.Context, part int, version uint64, src io.ReaderAt, size int64) (string, error) {
	pc := p.conns[part]
	subject := LiveSubject(p.cfg.Model, version, part)
	chunkBytes := int64(p.cfg.ChunkBytes)
	nChunks := int((size + chunkBytes - 1) / chunkBytes)
	var buf []byte
	if k := len(pc.free); k > 0 && int64(cap(pc.free[k-1])) >= chunkBytes {
		buf = pc.free[k-1][:chunkBytes] // back to the pool as it is: it is never taken from it
	} else {
		buf = make([]byte, chunkBytes)
		defer func() { pc.free = append(pc.free, buf) }()
	}
	table := NewChunkTable()
	window := int(max(p.cfg.FlowWindow/chunkBytes, 1))
	first := time.Now()
	for seq := range nChunks {
		if err := p.flow.wait(ctx, part, seq, window, p.cfg.FlowTimeout, first); err != nil {
			return "", err
		}
		off := int64(seq) * chunkBytes
		b := buf[:min(chunkBytes, size-off)]
		if err := readFull(src, b, off); err != nil {
			return "", fmt.Errorf("read chunk %d: %w", seq, err)
		}
		crc := CRC32C(b)
		h := Chunk{Protocol: ProtocolLive, Version: version, Seq: seq, Offset: off, Total: size, Chunks: nChunks, CRC: crc}.Header()
		// The client copies b into its buffer before it returns.
		if err := pc.nc.PublishMsg(&nats.Msg{Subject: subject, Header: h, Data: b}); err != nil {
			return "", fmt.Errorf("chunk %d of %d: %w", seq, nChunks, err)
		}
		table.Add(off, len(b), crc)
	}
	fctx, cancel := context.WithTimeout(ctx, p.cfg.PublishTimeout)
	defer cancel()
	if err := pc.nc.FlushWithContext(fctx); err != nil {
		return "", fmt.Errorf("flush: %w", err)
	}
	return table.Sum(), nil
}

// partJS is the JetStream of part i's connection: its server's, with
// PartServers (the main one for a part past the Publisher's Parts).
func (p *Publisher) partJS(i int) jetstream.JetStream {
	if i < len(p.conns) {
		return p.conns[i].js
	}
	return p.js
}

// ensurePartStream creates or updates the stream of part i >= 1, through
// the part's connection (on its server, with PartServers).
func (p *Publisher) ensurePartStream(ctx context.Context, i int) (jetstream.Stream, error) {
	js := p.partJS(i)
	want := p.streamConfig()
	want.Name, want.Subjects = PartStreamName(p.cfg.Model, i), []string{PartStreamSubjects(p.cfg.Model, i), PartStoredSubjects(p.cfg.Model, i)}
	want.Description = fmt.Sprintf("refit versions of model %s, part %d (PROTOCOL.md)", p.cfg.Model, i)
	var stream jetstream.Stream
	err := p.retry(ctx, "look up stream "+want.Name, func(ctx context.Context) (err error) {
		stream, err = js.Stream(ctx, want.Name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			stream, err = nil, nil
		}
		return err
	})
	if err != nil || (stream != nil && sameStreamSettings(stream.CachedInfo().Config, want)) {
		return stream, err
	}
	err = p.retry(ctx, "create or update stream "+want.Name, func(ctx context.Context) (err error) {
		stream, err = js.CreateOrUpdateStream(ctx, want)
		return err
	})
	return stream, err
}

// readHeader reads and checks the safetensors header at the start of src.
// sum is the hex SHA-256 of the length and the header (the announcement's
// header_sha256).
func readHeader(src io.ReaderAt, size int64) (h Header, sum string, err error) {
	var lenBuf [8]byte
	if err := readFull(src, lenBuf[:], 0); err != nil {
		return Header{}, "", fmt.Errorf("read the header length: %w", err)
	}
	n, _, err := HeaderLen(lenBuf[:])
	if err != nil {
		return Header{}, "", err
	}
	if 8+n > size {
		return Header{}, "", fmt.Errorf("%w: safetensors header of %d bytes in a stream of %d", ErrProtocol, n, size)
	}
	js := make([]byte, n)
	if err := readFull(src, js, 8); err != nil {
		return Header{}, "", fmt.Errorf("read the header: %w", err)
	}
	h, err = ParseHeader(js, size)
	if err != nil {
		return Header{}, "", err
	}
	d := sha256.New()
	d.Write(lenBuf[:])
	d.Write(js)
	sum = hex.EncodeToString(d.Sum(nil))
	var bad []string
	for _, t := range h.Tensors {
		if t.DType != "BF16" && t.DType != DeltaDType {
			bad = append(bad, fmt.Sprintf("%s (%s)", t.Name, t.DType))
		}
	}
	if len(bad) > 0 {
		slices.SortFunc(bad, naturalCompare)
		return Header{}, "", fmt.Errorf("%d tensors are not BF16: %s", len(bad), listSome(bad, 10))
	}
	return h, sum, nil
}

// readFull fills p from src at off.
func readFull(src io.ReaderAt, p []byte, off int64) error {
	n, err := src.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("bytes %d..%d: %w", off, off+int64(len(p)), err)
}

// listSome joins up to n items and counts the rest.
func listSome(items []string, n int) string {
	if len(items) <= n {
		return strings.Join(items, ", ")
	}
	return strings.Join(items[:n], ", ") + fmt.Sprintf(" and %d more", len(items)-n)
}

// ensure returns the model's stream and bucket, creating or updating them
// where they are missing or their settings are not these. It looks first
// (two read-only requests): an update rewrites the stream's metadata even
// when nothing changes, which cost 2-3 ms of every version on file storage,
// before its first chunk (docs/REFIT.md, "Throughput").
func (p *Publisher) ensure(ctx context.Context) (jetstream.Stream, jetstream.KeyValue, error) {
	model := p.cfg.Model
	want := p.streamConfig()
	var stream jetstream.Stream
	err := p.retry(ctx, "look up stream "+StreamName(model), func(ctx context.Context) (err error) {
		stream, err = p.js.Stream(ctx, StreamName(model))
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			stream, err = nil, nil
		}
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	// Stream and bucket share their storage and replicas: settings that
	// changed for one are updated on both.
	update := stream == nil || !sameStreamSettings(stream.CachedInfo().Config, want)
	if update {
		err := p.retry(ctx, "create or update stream "+StreamName(model), func(ctx context.Context) (err error) {
			stream, err = p.js.CreateOrUpdateStream(ctx, want)
			return err
		})
		if err != nil {
			return nil, nil, err
		}
	}
	var kv jetstream.KeyValue
	if !update {
		err := p.retry(ctx, "look up bucket "+BucketName(model), func(ctx context.Context) (err error) {
			kv, err = p.js.KeyValue(ctx, BucketName(model))
			if errors.Is(err, jetstream.ErrBucketNotFound) {
				kv, err = nil, nil
			}
			return err
		})
		if err != nil {
			return nil, nil, err
		}
	}
	if kv == nil {
		err := p.retry(ctx, "create or update bucket "+BucketName(model), func(ctx context.Context) (err error) {
			kv, err = p.js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
				Bucket:      BucketName(model),
				Description: "refit announcement and manifest of model " + model + " (PROTOCOL.md)",
				History:     2, // the manifests of the two versions kept (PROTOCOL.md)
				Storage:     p.cfg.Storage,
				Replicas:    p.cfg.Replicas,
			})
			return err
		})
		if err != nil {
			return nil, nil, err
		}
	}
	return stream, kv, nil
}

// streamConfig is the model's stream as PROTOCOL.md has it.
func (p *Publisher) streamConfig() jetstream.StreamConfig {
	model := p.cfg.Model
	return jetstream.StreamConfig{
		Name:        StreamName(model),
		Description: "refit versions of model " + model + " (PROTOCOL.md)",
		Subjects:    []string{StreamSubjects(model), PartStoredSubjects(model, 0)},
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		Storage:     p.cfg.Storage,
		Replicas:    p.cfg.Replicas,
		MaxMsgSize:  int32(min(p.nc.MaxPayload(), 1<<31-1)),
		MaxBytes:    cmp.Or(p.cfg.MaxStreamBytes, -1),
	}
}

// sameStreamSettings reports whether a stream's settings are the ones
// streamConfig sets (the server fills in the rest).
func sameStreamSettings(have, want jetstream.StreamConfig) bool {
	return slices.Equal(have.Subjects, want.Subjects) && have.Description == want.Description &&
		have.Retention == want.Retention && have.Discard == want.Discard && have.Storage == want.Storage &&
		have.Replicas == want.Replicas && have.MaxMsgSize == want.MaxMsgSize && have.MaxBytes == want.MaxBytes
}

// previous returns the version of the bucket's manifest, 0 if none.
//
// A signing publisher counts only manifests signed by its own key, the
// newest of the bucket's history: a manifest anyone else wrote (a bogus
// version 2^64-1, say) must not stop it from publishing, nor be the base
// of its partial versions. unsigned then says the bucket held manifests,
// none of them signed by this key.
func (p *Publisher) previous(ctx context.Context, kv jetstream.KeyValue) (prev uint64, unsigned bool, err error) {
	if p.cfg.Signer != nil {
		return p.previousSigned(ctx, kv)
	}
	err = p.retry(ctx, "read the manifest", func(ctx context.Context) error {
		e, err := kv.Get(ctx, KeyManifest)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		m, err := ParseManifest(e.Value())
		if err != nil {
			// Not ours to judge: the version rule is then the workers'.
			p.log.Warn("refit: the bucket's manifest does not parse; ignoring it", zap.Error(err))
			return nil
		}
		prev = m.Version
		return nil
	})
	return prev, false, err
}

// lastAnnounced returns the version of the bucket's announcement, 0 if
// none. One that does not parse counts by the version it names, as
// workers count it. A signing publisher counts only its own.
func (p *Publisher) lastAnnounced(ctx context.Context, kv jetstream.KeyValue) (uint64, error) {
	var v uint64
	err := p.retry(ctx, "read the announcement", func(ctx context.Context) error {
		v = 0
		e, err := kv.Get(ctx, KeyAnnounce)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		v, _ = p.versionOf(e)
		return nil
	})
	return v, err
}

// versionOf returns the version an announce or manifest entry counts for
// in this publisher's numbering (PROTOCOL.md, "Version numbers"): its
// version; for one that does not parse, the version it names if any; for a
// signing publisher, only one signed by its own key. own says the entry
// was signed by this publisher's key.
func (p *Publisher) versionOf(e jetstream.KeyValueEntry) (v uint64, own bool) {
	if e.Operation() != jetstream.KeyValuePut {
		return 0, false
	}
	var auth error
	var a Announce
	var err error
	switch e.Key() {
	case KeyAnnounce:
		a, err = ParseAnnounce(e.Value())
		if err == nil && p.cfg.Signer != nil {
			auth = p.ownTrust().VerifyAnnounce(a)
		}
	case KeyManifest:
		var m Manifest
		m, err = ParseManifest(e.Value())
		a = m.Announce
		if err == nil && p.cfg.Signer != nil {
			auth = p.ownTrust().VerifyManifest(m)
		}
	default:
		return 0, false
	}
	switch {
	case p.cfg.Signer != nil:
		if err != nil || auth != nil {
			return 0, false
		}
		return a.Version, true
	case err != nil:
		v, _, _ := probeVersion(e.Value())
		return v, false
	}
	return a.Version, false
}

// ownTrust is a Trust of the publisher's own key.
func (p *Publisher) ownTrust() *Trust {
	t, err := NewTrust(p.cfg.Signer.PublicKey())
	if err != nil {
		panic(err) // a Signer's public key is a valid one
	}
	return t
}

// NextVersion returns the number the next version should carry
// (PROTOCOL.md, "Version numbers"): one above the highest version of the
// bucket's announcements and manifests (both keys' history) and of the
// stream's subjects that hold messages; 1 when there is none. A signing
// publisher counts only announcements and manifests signed by its own key
// (the subjects, whoever published there: the NATS permissions decide who
// may). It creates nothing; it fails when no number is left above the
// highest.
func (p *Publisher) NextVersion(ctx context.Context) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	v, err := p.nextVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("refit: next version of model %s: %w", p.cfg.Model, err)
	}
	return v, nil
}

func (p *Publisher) nextVersion(ctx context.Context) (uint64, error) {
	model := p.cfg.Model
	var subjects map[string]uint64
	err := p.retry(ctx, "look up stream "+StreamName(model), func(ctx context.Context) error {
		stream, err := p.js.Stream(ctx, StreamName(model))
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			subjects = nil
			return nil
		}
		if err != nil {
			return err
		}
		info, err := stream.Info(ctx, jetstream.WithSubjectFilter(partSubjectsFilter(model, 0)))
		if err != nil {
			return err
		}
		subjects = info.State.Subjects
		return nil
	})
	if err != nil {
		return 0, err
	}
	var highest uint64
	for _, key := range []string{KeyAnnounce, KeyManifest} {
		err := p.retry(ctx, "read the history of "+key, func(ctx context.Context) error {
			kv, err := p.js.KeyValue(ctx, BucketName(model))
			if errors.Is(err, jetstream.ErrBucketNotFound) {
				return nil
			}
			if err != nil {
				return err
			}
			hist, err := kv.History(ctx, key)
			if errors.Is(err, jetstream.ErrKeyNotFound) {
				return nil
			}
			if err != nil {
				return err
			}
			for _, e := range hist {
				if v, _ := p.versionOf(e); v > highest {
					highest = v
				}
			}
			return nil
		})
		if err != nil {
			return 0, err
		}
	}
	for subj, n := range subjects {
		if v, ok := versionOfStoredSubject(model, 0, subj); ok && n > 0 && v > highest {
			highest = v
		}
	}
	if highest == math.MaxUint64 {
		return 0, fmt.Errorf("no version number left above %d", highest)
	}
	return highest + 1, nil
}

// previousSigned is previous for a signing publisher.
func (p *Publisher) previousSigned(ctx context.Context, kv jetstream.KeyValue) (prev uint64, unsigned bool, err error) {
	own, err := NewTrust(p.cfg.Signer.PublicKey())
	if err != nil {
		return 0, false, err
	}
	err = p.retry(ctx, "read the manifest's history", func(ctx context.Context) error {
		prev, unsigned = 0, false
		hist, err := kv.History(ctx, KeyManifest)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		for i := len(hist) - 1; i >= 0; i-- {
			if hist[i].Operation() != jetstream.KeyValuePut {
				continue
			}
			m, err := ParseManifest(hist[i].Value())
			if err == nil {
				err = own.VerifyManifest(m)
			}
			if err != nil {
				unsigned = true
				p.log.Warn("refit: ignoring a manifest not signed by this publisher's key", zap.Uint64("version", m.Version), zap.Error(err))
				continue
			}
			prev, unsigned = m.Version, false
			return nil
		}
		return nil
	})
	return prev, unsigned, err
}

// subjects returns the message count of every version subject in the
// stream of part.
func (p *Publisher) subjects(ctx context.Context, stream jetstream.Stream, part int) (map[string]uint64, error) {
	var subjects map[string]uint64
	err := p.retry(ctx, "list the stream's subjects", func(ctx context.Context) error {
		info, err := stream.Info(ctx, jetstream.WithSubjectFilter(partSubjectsFilter(p.cfg.Model, part)))
		if err != nil {
			return err
		}
		subjects = info.State.Subjects
		return nil
	})
	return subjects, err
}

// put writes v as JSON under key.
func (p *Publisher) put(ctx context.Context, kv jetstream.KeyValue, key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode %s: %w", key, err)
	}
	return p.retry(ctx, "write "+key, func(ctx context.Context) error {
		_, err := kv.Put(ctx, key, b)
		return err
	})
}

// purgeOld purges the subjects of every version below version but prev,
// so that the stream keeps the newest two complete versions.
func (p *Publisher) purgeOld(ctx context.Context, stream jetstream.Stream, part int, version, prev uint64) error {
	subjects, err := p.subjects(ctx, stream, part)
	if err != nil {
		return err
	}
	var old []string
	for subj := range subjects {
		v, ok := versionOfStoredSubject(p.cfg.Model, part, subj)
		if ok && v < version && v != prev {
			old = append(old, subj)
		}
	}
	slices.Sort(old)
	for _, subj := range old {
		err := p.retry(ctx, "purge "+subj, func(ctx context.Context) error {
			return stream.Purge(ctx, jetstream.WithPurgeSubject(subj))
		})
		if err != nil {
			return err
		}
		p.log.Info("refit: purged an old version", zap.String("subject", subj), zap.Uint64("messages", subjects[subj]))
	}
	return nil
}

// retry runs op, each attempt bounded by PublishTimeout, until it succeeds,
// fails for good (not transient), or ctx ends.
func (p *Publisher) retry(ctx context.Context, what string, op func(context.Context) error) error {
	wait := retryMin
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, p.cfg.PublishTimeout)
		err := op(actx)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%s: %w (last error: %v)", what, ctx.Err(), err)
		}
		if !transient(err) {
			return fmt.Errorf("%s: %w", what, err)
		}
		p.log.Warn("refit: retrying", zap.String("op", what), zap.Int("attempt", attempt), zap.Error(err))
		if serr := sleepCtx(ctx, wait); serr != nil {
			return fmt.Errorf("%s: %w (last error: %v)", what, serr, err)
		}
		wait = min(2*wait, retryMax)
	}
}

// transient reports whether err may go away by itself, so that the
// operation is worth retrying: anything but a JetStream API error with a
// 4xx code (except the stream's "wrong last msg ID" answer to a chunk sent
// after a lost one) and errors of the request itself. Timeouts, a lost or
// restarting server (including the connection's own write errors) and a
// JetStream that is not ready yet are transient.
func transient(err error) bool {
	var apiErr *jetstream.APIError
	var jsErr jetstream.JetStreamError
	switch {
	case errors.As(err, &apiErr):
	case errors.As(err, &jsErr) && jsErr.APIError() != nil:
		apiErr = jsErr.APIError()
	}
	if apiErr != nil {
		return apiErr.Code >= 500 || apiErr.ErrorCode == errCodeWrongLastMsgID || apiErr.Code == 0
	}
	for _, permanent := range []error{
		nats.ErrConnectionClosed, nats.ErrConnectionDraining, nats.ErrInvalidConnection,
		nats.ErrBadSubject, nats.ErrMaxPayload, nats.ErrInvalidMsg, nats.ErrHeadersNotSupported,
		nats.ErrAuthorization, nats.ErrAuthExpired, nats.ErrAuthRevoked, nats.ErrPermissionViolation,
		jetstream.ErrInvalidOption, jetstream.ErrAsyncPublishReplySubjectSet,
	} {
		if errors.Is(err, permanent) {
			return false
		}
	}
	return true
}

// errCodeWrongLastMsgID is JetStream's error code for a message whose
// Nats-Expected-Last-Msg-Id is not the stream's last message id.
const errCodeWrongLastMsgID jetstream.ErrorCode = 10070

// sleepCtx sleeps for d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// inflightChunk is a chunk published and not yet acknowledged.
type inflightChunk struct {
	seq int
	buf []byte
	crc uint32
	fut jetstream.PubAckFuture
}

// sendChunks publishes the chunks of src on the version's subject within
// the byte window and returns the manifest's digest once every chunk is
// acknowledged: the chunk table's SHA-256 (protocol 2), or the stream's
// (protocol 1), as tableSum; streamSum is the stream's SHA-256 of a signed
// protocol-2 version, empty otherwise.
//
// The window is a FIFO of published chunks. A chunk is published when it
// fits in the window; otherwise the oldest is awaited. When the oldest
// fails, every later chunk in flight is awaited too (each ends with an ack,
// an error or the ack timeout), and publishing resumes at the failed chunk:
// chunks the stream did store are acknowledged again as duplicates.
func (p *Publisher) sendChunks(ctx context.Context, log *zap.Logger, version uint64, src io.ReaderAt, size int64) (tableSum, streamSum string, err error) {
	return p.sendPart(ctx, log, p.protocol, 0, version, src, size)
}

// sendPart publishes part (0: the version's only part, or its first) of
// a version in protocol proto over the part's connection, as sendChunks
// says.
func (p *Publisher) sendPart(ctx context.Context, log *zap.Logger, proto, part int, version uint64, src io.ReaderAt, size int64) (tableSum, streamSum string, err error) {
	model := p.cfg.Model
	pc := p.conns[part]
	subject := storedSubject(proto, model, version, part)
	chunkBytes := int64(p.cfg.ChunkBytes)
	nChunks := int((size + chunkBytes - 1) / chunkBytes)
	chunkLen := func(seq int) int { return int(min(chunkBytes, size-int64(seq)*chunkBytes)) }

	// Protocol 2's digest is the chunk table's SHA-256, entries added as
	// chunks are acknowledged (in order, each once: a failure rewinds to
	// the oldest unacknowledged chunk).
	table := NewChunkTable()
	// Protocol 1's SHA-256 of the whole stream is computed beside the
	// chunks, by its own goroutine reading src (io.ReaderAt allows
	// concurrent reads). sendChunks owns the goroutine: it is stopped and
	// awaited on return.
	var hashed chan hashResult
	if p.protocol == Protocol1 || p.cfg.Signer != nil {
		hctx, stopHash := context.WithCancel(ctx)
		hashed = make(chan hashResult, 1)
		go func() { hashed <- p.hashSource(hctx, src, size) }()
		defer func() {
			stopHash()
			<-hashed // the sum, or its refill below once taken
		}()
	}

	var (
		next     int // next chunk to publish
		queue    []inflightChunk
		inflight int64
		wait     = retryMin
		retries  int
	)
	// Buffers come from the Publisher's pool and go back to it when their
	// chunk is acknowledged (not before: the library may publish a chunk
	// again by itself until then). Fresh memory for every chunk costs a page
	// fault every 4 KiB, several microseconds each on the development VM:
	// page faults were a large share of a version's CPU time.
	free := pc.free
	defer func() { pc.free = free }()
	// fail handles a failed chunk: it awaits the other chunks in flight
	// (each ends with an ack, an error or the ack timeout), backs off and
	// rewinds to the oldest chunk not acknowledged in order.
	fail := func(seq int, err error, others []inflightChunk) error {
		if !transient(err) {
			return fmt.Errorf("chunk %d of %d: %w", seq, nChunks, err)
		}
		retries++
		log.Warn("refit: chunk failed; publishing again from the oldest unacknowledged one", zap.Int("seq", seq),
			zap.Int("in_flight", len(queue)), zap.Int("retries", retries), zap.Error(err))
		for _, c := range others {
			select {
			case <-c.fut.Ok():
			case <-c.fut.Err():
			case <-ctx.Done():
				return fmt.Errorf("chunk %d of %d: %w (last error: %v)", seq, nChunks, ctx.Err(), err)
			}
		}
		next = seq
		if len(queue) > 0 {
			next = queue[0].seq
		}
		queue, inflight = queue[:0], 0
		if serr := sleepCtx(ctx, wait); serr != nil {
			return fmt.Errorf("chunk %d of %d: %w (last error: %v)", seq, nChunks, serr, err)
		}
		wait = min(2*wait, retryMax)
		return nil
	}

	// Parts of protocol 3 keep within the flow window of the workers that
	// follow them live (sendParts; a Publisher of parts has a flow gate).
	paced := proto == ProtocolParts
	window, first := int(max(p.cfg.FlowWindow/chunkBytes, 1)), time.Now()
	for acked := 0; acked < nChunks; {
		if next < nChunks && inflight+int64(chunkLen(next)) <= p.cfg.MaxInflightBytes {
			if paced {
				if err := p.flow.wait(ctx, part, next, window, p.cfg.FlowTimeout, first); err != nil {
					return "", "", err
				}
			}
			n := chunkLen(next)
			var buf []byte
			if k := len(free); k > 0 && cap(free[k-1]) >= n {
				buf, free = free[k-1][:n], free[:k-1]
			} else {
				buf = make([]byte, n, chunkBytes)
			}
			off := int64(next) * chunkBytes
			if err := readFull(src, buf, off); err != nil {
				return "", "", fmt.Errorf("read chunk %d: %w", next, err)
			}
			crc := CRC32C(buf)
			h := Chunk{Protocol: proto, Version: version, Seq: next, Offset: off, Total: size, Chunks: nChunks, CRC: crc}.Header()
			h.Set(jetstream.MsgIDHeader, PartMsgID(model, version, part, next))
			if next > 0 {
				h.Set(jetstream.ExpectedLastMsgIDHeader, PartMsgID(model, version, part, next-1))
			}
			fut, err := pc.js.PublishMsgAsync(&nats.Msg{Subject: subject, Header: h, Data: buf})
			if err != nil {
				// Not sent: nothing of it is in flight.
				if err := fail(next, err, queue); err != nil {
					return "", "", err
				}
				continue
			}
			queue = append(queue, inflightChunk{seq: next, buf: buf, crc: crc, fut: fut})
			inflight += int64(n)
			if p.onInflight != nil {
				p.onInflight(inflight)
			}
			next++
			continue
		}
		c := queue[0]
		select {
		case <-c.fut.Ok():
			queue = queue[1:]
			inflight -= int64(len(c.buf))
			free = append(free, c.buf) // acknowledged: the library holds it no more
			table.Add(int64(c.seq)*chunkBytes, len(c.buf), c.crc)
			acked = c.seq + 1
			wait = retryMin
		case err := <-c.fut.Err():
			if err := fail(c.seq, err, queue[1:]); err != nil {
				return "", "", err
			}
		case <-ctx.Done():
			return "", "", fmt.Errorf("chunk %d of %d: %w", c.seq, nChunks, ctx.Err())
		}
	}
	if retries > 0 {
		log.Info("refit: all chunks stored after retries", zap.Int("retries", retries))
	}
	if p.protocol != Protocol1 {
		tableSum = table.Sum()
	}
	if hashed == nil {
		return tableSum, "", nil
	}
	var h hashResult
	select {
	case h = <-hashed:
		hashed <- h // for the deferred wait
	case <-ctx.Done():
		return "", "", fmt.Errorf("hash the stream: %w", ctx.Err())
	}
	if h.err != nil {
		return "", "", fmt.Errorf("hash the stream: %w", h.err)
	}
	if p.protocol == Protocol1 {
		return h.sum, "", nil
	}
	return tableSum, h.sum, nil
}

// hashResult is the outcome of hashSource.
type hashResult struct {
	sum string
	err error
}

// hashSource returns the hex SHA-256 of src's first size bytes.
func (p *Publisher) hashSource(ctx context.Context, src io.ReaderAt, size int64) hashResult {
	const block = 1 << 20
	buf := make([]byte, block)
	d := sha256.New()
	for off := int64(0); off < size; off += block {
		if err := ctx.Err(); err != nil {
			return hashResult{err: err}
		}
		b := buf[:min(block, size-off)]
		if err := readFull(src, b, off); err != nil {
			return hashResult{err: err}
		}
		d.Write(b)
	}
	return hashResult{sum: hex.EncodeToString(d.Sum(nil))}
}
