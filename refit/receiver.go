package refit

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

// Engine is where a version is committed: between two generation steps.
type Engine interface {
	AtBoundary(ctx context.Context, fn func() error) error
	SetVersion(v uint64) // called inside AtBoundary
}

// ReceiverConfig configures a worker's receiver.
type ReceiverConfig struct {
	Model  string // model id
	Worker string // worker id in status reports
	// Version is the version of the weights loaded at start (0: none yet).
	Version uint64
	// MaxBytes bounds the bytes a part's stream consumer pulls ahead
	// (default 64 MiB). A consumer pulls at most 16 MiB and at least four
	// of the version's chunks ahead whatever it says (pullBytes).
	MaxBytes int
	// LivePendingBytes bounds the live chunks of a part waiting to be read
	// (default DefaultLivePendingBytes); beyond it the server's deliveries
	// are dropped and the worker fetches what it misses from the stream.
	LivePendingBytes int
	// ChunkTimeout rejects a version whose chunks (or manifest) stop
	// arriving for this long: the publisher died (default 30 s).
	ChunkTimeout time.Duration
	// LiveIdle is how long the live path may go quiet before the receiver
	// looks for a lost chunk, and fetches the rest of the version from the
	// stream if it finds one (default DefaultLiveIdle, at most
	// ChunkTimeout; chunkFeed.liveLost).
	LiveIdle time.Duration
	// Trust, when set, makes the receiver apply only versions whose
	// announcement and manifest are signed by one of its keys
	// (PROTOCOL.md, "Signatures"); others are rejected, with a status that
	// says why, before they change anything a later version is checked
	// against. A signed version is trusted for its number.
	Trust *Trust
	// MaxVersionStep bounds, without Trust, how far above the version
	// served a version may be numbered (default DefaultMaxVersionStep):
	// one further above is rejected before it changes anything, so an
	// unauthenticated client cannot use up the version numbers in one go.
	MaxVersionStep uint64
	// LiveParts is how many parts of a version (PROTOCOL.md, "Parts") the
	// receiver follows live from the start, each on a connection of its
	// own (default 1). A version of more parts subscribes to the rest when
	// it is announced and reads what it missed of them from their streams.
	LiveParts int
	// PartServers are the NATS servers that carry parts 1 and on of a
	// version, as the publisher's PublisherConfig.PartServers: part i >= 1
	// is followed live and read from its stream over connections to
	// PartServers[(i-1) mod len]. Empty: every part on nc's server.
	PartServers []string
}

// DefaultMaxVersionStep is ReceiverConfig.MaxVersionStep's default.
const DefaultMaxVersionStep = 1 << 20

// ErrVersionJump rejects a version numbered more than MaxVersionStep above
// the one served, on a receiver without Trust.
var ErrVersionJump = errors.New("refit: version number too far ahead")

// Receiver is the worker side of the refit protocol. Run owns it: every
// field below mu is touched only by Run's goroutine; Status and
// CurrentVersion may be called from anywhere.
type Receiver struct {
	cfg ReceiverConfig
	nc  *nats.Conn
	// liveOpts are nc's options as NewReceiver found them, for the live
	// chunks' own connection: read once, before anything else may install
	// handlers on nc, and without nc's callbacks, which belong to nc.
	liveOpts nats.Options
	js       jetstream.JetStream
	m        *policy.Model
	eng      Engine
	stager   kernels.Stager
	// deltas applies delta tensors (nil: the backend cannot, and versions
	// holding them are rejected).
	deltas  kernels.DeltaStager
	log     *zap.Logger
	metrics *metrics

	// Staging mirrors of the live buffers that a version may not write in
	// place (everything but the expert stacks, and those too when the
	// recipe reads them), allocated once.
	staging map[*kernels.Buffer]*kernels.Buffer
	direct  bool // expert tensors are written straight into the stacks
	// The model's tensors under their canonical names, resolved once:
	// resolving every name of every version (a regexp each) was a
	// millisecond of the first chunk's time.
	targets []policy.Target
	byName  map[string]policy.Target

	mu      sync.Mutex
	current uint64
	last    Status

	seen  map[uint64]bool   // version numbers received (applied or rejected)
	revs  map[string]uint64 // the last bucket revision handled, per key
	dirty []span            // stack ranges a rejected version overwrote

	live *liveSub // Run's live subscription to the version subjects
	// lives[i] is Run's live subscription to part i's subjects (lives[0]
	// is live), made at Run's start for LiveParts parts and when a version
	// of more parts is announced.
	lives []*liveSub
	// partConns are the connections that the streams of parts 1 and on
	// are read over, one a part, made when first needed and closed when
	// Run returns.
	partMu    sync.Mutex
	partConns map[int]partStreamConn

	received atomic.Int64 // bytes of the version being received
	// sealed is the newest live-first version whose seal the version
	// watch has seen: its live pass is over (chunkFeed.nextLive).
	sealed     atomic.Uint64
	reports    atomic.Int64  // statuses reported so far
	chunkDelay time.Duration // tests: a slow worker
	// reportBytes, when set (by tests), replaces FlowReportBytes;
	// negative: no reports.
	reportBytes int
	// liveHook, when set (by tests), sees every live chunk of the version
	// being received before it is parsed and checked: it may change it (as
	// the wire might) or drop it (as a slow or reconnecting worker misses
	// some).
	liveHook func(msg *nats.Msg) (drop bool)
	// liveReady is closed once Run has its live subscription (tests).
	liveReady chan struct{}
}

// receivedBytes returns the bytes received of the current version.
func (r *Receiver) receivedBytes() int64 { return r.received.Load() }

// span is a byte range of a live buffer.
type span struct {
	buf      *kernels.Buffer
	off, len int
	name     string
}

func (s span) covers(o span) bool {
	return s.buf == o.buf && s.off <= o.off && o.off+o.len <= s.off+s.len
}

// NewReceiver prepares a receiver for the model m, committing through eng.
// It allocates the staging buffers, so call it at start, before the engine
// runs. reg may be nil.
func NewReceiver(nc *nats.Conn, m *policy.Model, eng Engine, cfg ReceiverConfig, log *zap.Logger, reg prometheus.Registerer) (*Receiver, error) {
	if !ValidModelID(cfg.Model) {
		return nil, fmt.Errorf("refit: receiver: model id %q: want [A-Za-z0-9_-]+", cfg.Model)
	}
	if cfg.Worker == "" {
		return nil, fmt.Errorf("refit: receiver: empty worker id")
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = 64 << 20
	}
	// A pull must fit at least one whole chunk with its headers, or nothing
	// is ever delivered.
	cfg.MaxBytes = max(cfg.MaxBytes, MaxChunkBytes+64<<10)
	if cfg.ChunkTimeout <= 0 {
		cfg.ChunkTimeout = 30 * time.Second
	}
	if cfg.LiveIdle <= 0 {
		cfg.LiveIdle = DefaultLiveIdle
	}
	cfg.LiveIdle = min(cfg.LiveIdle, cfg.ChunkTimeout)
	if cfg.MaxVersionStep == 0 {
		cfg.MaxVersionStep = DefaultMaxVersionStep
	}
	if cfg.LivePendingBytes < 0 {
		return nil, fmt.Errorf("refit: receiver: live pending bytes %d: want 0 (the default) or more", cfg.LivePendingBytes)
	}
	if cfg.LiveParts < 0 || cfg.LiveParts > MaxParts {
		return nil, fmt.Errorf("refit: receiver: live parts %d: want 0 to %d", cfg.LiveParts, MaxParts)
	}
	if err := checkPartServers(cfg.PartServers); err != nil {
		return nil, fmt.Errorf("refit: receiver: %w", err)
	}
	if log == nil {
		log = zap.NewNop()
	}
	st, ok := m.Backend().(kernels.Stager)
	if !ok {
		return nil, fmt.Errorf("refit: receiver: backend %s cannot stage bytes from another goroutine", m.Backend().Name())
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("refit: receiver: %w", err)
	}
	met, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	ds, _ := st.(kernels.DeltaStager)
	r := &Receiver{cfg: cfg, nc: nc, liveOpts: liveOptions(nc), js: js, m: m, eng: eng, stager: st, deltas: ds, log: log, metrics: met,
		staging: map[*kernels.Buffer]*kernels.Buffer{}, direct: m.Options().Recipe != moe.RecipeBF16,
		current: cfg.Version, seen: map[uint64]bool{}, revs: map[string]uint64{}, liveReady: make(chan struct{})}
	targets, err := m.Tensors()
	if err != nil {
		return nil, err
	}
	r.targets, r.byName = targets, make(map[string]policy.Target, len(targets))
	for _, t := range targets {
		r.byName[t.Name] = t
	}
	for _, t := range targets {
		if (t.IsExpert() && r.direct) || r.staging[t.Buffer] != nil {
			continue
		}
		b, err := m.Backend().Alloc(t.Buffer.DType(), t.Buffer.Shape()...)
		if err != nil {
			r.Close()
			return nil, fmt.Errorf("refit: receiver: staging for %s: %w", t.Name, err)
		}
		r.staging[t.Buffer] = b
	}
	met.version.Set(float64(cfg.Version))
	return r, nil
}

// Close frees the staging buffers. Call it after Run returned.
func (r *Receiver) Close() error {
	var errs []error
	for live, b := range r.staging {
		errs = append(errs, r.m.Backend().Free(b))
		delete(r.staging, live)
	}
	return errors.Join(errs...)
}

// CurrentVersion returns the version being served.
func (r *Receiver) CurrentVersion() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.current
}

// LastStatus returns the report on the last version handled.
func (r *Receiver) LastStatus() Status {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last
}

// Run receives versions until ctx is done. It first catches up with the
// newest published version (late join), then follows announcements.
func (r *Receiver) Run(ctx context.Context) error {
	// The live subscription comes first, before the bucket is even there:
	// a chunk of a version announced after it cannot be published before
	// it, and chunks published while the worker still waits for the bucket
	// or reads its current values wait in it (up to MaxBytes).
	live, err := r.subscribeLive(ctx, 0)
	if err != nil {
		return err
	}
	r.live, r.lives = live, []*liveSub{live}
	defer func() {
		for _, l := range r.lives {
			l.close()
		}
		r.live, r.lives = nil, nil
		r.closePartConns()
	}()
	// The other parts' subscriptions are a fast path: one that cannot be
	// made now (its subjects not permitted, say) is tried again when a
	// version of that many parts comes, and the part is read from its
	// stream meanwhile.
	for len(r.lives) < r.cfg.LiveParts {
		l, err := r.trySubscribeLive(ctx, len(r.lives))
		if err != nil {
			r.log.Warn("refit: no live subscription for a part", zap.Int("part", len(r.lives)), zap.Error(err))
			break
		}
		r.lives = append(r.lives, l)
	}
	select {
	case <-r.liveReady: // an earlier Run
	default:
		close(r.liveReady)
	}
	kv, err := r.bucket(ctx)
	if err != nil {
		return err
	}
	// Watch first, so nothing published while catching up is missed: the
	// watcher delivers the current values, a nil marker, then updates.
	w, err := kv.WatchAll(ctx)
	if err != nil {
		return fmt.Errorf("refit: receiver: watch %s: %w", BucketName(r.cfg.Model), err)
	}
	defer w.Stop()
	var initial []jetstream.KeyValueEntry
	for caughtUp := false; ; {
		var e jetstream.KeyValueEntry
		select {
		case <-ctx.Done():
			return nil
		case u, ok := <-w.Updates():
			if !ok {
				return fmt.Errorf("refit: receiver: watcher of %s closed", BucketName(r.cfg.Model))
			}
			e = u
		}
		if !caughtUp {
			if e != nil {
				initial = append(initial, e)
				continue
			}
			caughtUp = true
			for _, e := range initial {
				r.revs[e.Key()] = e.Revision()
			}
			if err := r.catchUp(ctx, kv, initial); err != nil {
				return err
			}
			continue
		}
		if e == nil || e.Operation() != jetstream.KeyValuePut || e.Revision() <= r.revs[e.Key()] {
			continue // a replay (after a reconnect, say) of an entry already handled
		}
		r.revs[e.Key()] = e.Revision()
		a, ok, complete, auth, bad := r.announcement(e)
		if bad != nil {
			r.rejectMalformed(e.Key(), e.Value(), bad)
			continue
		}
		if !ok {
			continue
		}
		if err := r.handle(ctx, kv, a, !complete, auth); errors.Is(err, errFatal) {
			return err
		}
	}
}

// announcement reads a version to handle from an announce or manifest
// entry; a manifest counts only if its version was not seen (its
// announcement was missed, during a reconnect say). complete says the
// version is wholly in the stream already (a manifest): its chunks are
// read from there, not waited for live. auth is why the entry's signature
// is not accepted (nil without Trust). bad is why the entry is malformed
// (it does not parse, or names another model): see rejectMalformed.
func (r *Receiver) announcement(e jetstream.KeyValueEntry) (a Announce, ok, complete bool, auth, bad error) {
	switch e.Key() {
	case KeyAnnounce:
		a, err := r.parseAnnounce(e.Value())
		if err != nil {
			return a, false, false, nil, err
		}
		return a, true, false, r.authAnnounce(a), nil
	case KeyManifest:
		m, err := r.parseManifest(e.Value())
		if err != nil {
			return Announce{}, false, false, nil, err
		}
		// A manifest counts only for a version whose announcement was
		// missed; at or below the current version it is old news.
		return m.Announce, !r.seen[m.Version] && m.Version > r.current, true, r.authManifest(m), nil
	}
	return Announce{}, false, false, nil, nil
}

// parseAnnounce is ParseAnnounce, and the announcement must be of this
// receiver's model.
func (r *Receiver) parseAnnounce(b []byte) (Announce, error) {
	a, err := ParseAnnounce(b)
	if err == nil && a.Model != r.cfg.Model {
		err = fmt.Errorf("%w: announce: model %q in the bucket of model %q", ErrProtocol, a.Model, r.cfg.Model)
	}
	return a, err
}

// parseManifest is ParseManifest, and the manifest must be of this
// receiver's model.
func (r *Receiver) parseManifest(b []byte) (Manifest, error) {
	m, err := ParseManifest(b)
	if err == nil && m.Model != r.cfg.Model {
		err = fmt.Errorf("%w: manifest: model %q in the bucket of model %q", ErrProtocol, m.Model, r.cfg.Model)
	}
	return m, err
}

// rejectMalformed answers a malformed announcement or manifest (one that
// does not parse, or names another model) with a rejected status for the
// version it names, the parse error as the reason (PROTOCOL.md, "Status"),
// unless that version was handled already or is not newer than the one
// served. One from which no version number can be read gets no status
// (there is no version to report on): it is logged.
//
// Without Trust the number then counts as seen: the version is rejected
// whole, and a later entry of that number is a duplicate. With Trust it
// does not, as for an unsigned version: anyone may have written the entry.
func (r *Receiver) rejectMalformed(key string, value []byte, perr error) {
	v, protocol, ok := probeVersion(value)
	switch {
	case !ok:
		r.log.Warn("refit: a malformed "+key+" that names no version; no status to send", zap.Error(perr))
		return
	case v <= r.current || r.seen[v]:
		r.log.Warn("refit: a malformed "+key+" of a version already handled", zap.Uint64("version", v), zap.Error(perr))
		return
	}
	if r.cfg.Trust == nil && v-r.current <= r.cfg.MaxVersionStep {
		r.seen[v] = true
	}
	r.report(Status{Protocol: protocol, Worker: r.cfg.Worker, Version: v}, fmt.Errorf("version %d: malformed %s: %w", v, key, perr))
}

// namesVersion reports whether a malformed announcement or manifest names
// version v (see probeVersion).
func namesVersion(b []byte, v uint64) bool {
	pv, _, ok := probeVersion(b)
	return ok && pv == v
}

// probeVersion reads the version number and protocol of a malformed
// announcement or manifest, as far as they can be read: ok is false when
// no positive integer "version" can. An unknown protocol reads as the
// newest.
func probeVersion(b []byte) (v uint64, protocol int, ok bool) {
	var p struct {
		Protocol json.RawMessage `json:"protocol"`
		Version  json.RawMessage `json:"version"`
	}
	if json.Unmarshal(b, &p) != nil {
		return 0, 0, false
	}
	v, err := strconv.ParseUint(string(p.Version), 10, 64)
	if err != nil || v == 0 {
		return 0, 0, false
	}
	protocol = ProtocolVersion
	if string(p.Protocol) == "1" {
		protocol = Protocol1
	}
	return v, protocol, true
}

// authAnnounce checks an announcement's signature; nil without Trust.
func (r *Receiver) authAnnounce(a Announce) error {
	if r.cfg.Trust == nil {
		return nil
	}
	return r.cfg.Trust.VerifyAnnounce(a)
}

// authManifest checks a manifest's signature; nil without Trust.
func (r *Receiver) authManifest(m Manifest) error {
	if r.cfg.Trust == nil {
		return nil
	}
	return r.cfg.Trust.VerifyManifest(m)
}

// bucket waits for the model's bucket to exist, polling every 10 ms at
// first (a worker started just before the first version should not miss
// its start), then backing off to 200 ms.
func (r *Receiver) bucket(ctx context.Context) (jetstream.KeyValue, error) {
	wait := 10 * time.Millisecond
	for {
		kv, err := r.js.KeyValue(ctx, BucketName(r.cfg.Model))
		if err == nil {
			return kv, nil
		}
		if !errors.Is(err, jetstream.ErrBucketNotFound) && ctx.Err() == nil {
			r.log.Warn("refit: waiting for the bucket", zap.String("bucket", BucketName(r.cfg.Model)), zap.Error(err))
		}
		if err := sleepCtx(ctx, wait); err != nil {
			return nil, err
		}
		wait = min(2*wait, 200*time.Millisecond)
	}
}

// catchUp applies, from the bucket's current values, the newest complete
// version when it is newer than the loaded one: directly if it is full,
// after the previous version if that is needed, full and still in the
// stream, else the worker needs a full version. Then a version still being
// published is received too.
func (r *Receiver) catchUp(ctx context.Context, kv jetstream.KeyValue, initial []jetstream.KeyValueEntry) error {
	var m *Manifest
	var ann *Announce
	for _, e := range initial {
		if e.Operation() != jetstream.KeyValuePut {
			continue
		}
		switch e.Key() {
		case KeyManifest:
			if x, err := r.parseManifest(e.Value()); err == nil {
				m = &x
			} else {
				r.rejectMalformed(e.Key(), e.Value(), err)
			}
		case KeyAnnounce:
			if x, err := r.parseAnnounce(e.Value()); err == nil {
				ann = &x
			} else {
				r.rejectMalformed(e.Key(), e.Value(), err)
			}
		}
	}
	if m != nil && r.authManifest(*m) != nil {
		// Not signed by a trusted key: the version to catch up with is the
		// newest one of the bucket's history that is (if any), and the
		// bogus one is rejected as it would be live.
		if err := r.handle(ctx, kv, m.Announce, false, r.authManifest(*m)); errors.Is(err, errFatal) {
			return err
		}
		m = r.newestTrusted(ctx, kv)
	}
	if m != nil && m.Version > r.current {
		if err := r.catchUpTo(ctx, kv, *m); err != nil {
			return err
		}
	}
	if ann != nil && ann.Version > r.current && !r.seen[ann.Version] {
		// Live first: chunks published before this worker subscribed show
		// as a gap, which sends it to the stream at once.
		if err := r.handle(ctx, kv, *ann, true, r.authAnnounce(*ann)); errors.Is(err, errFatal) {
			return err
		}
	}
	return nil
}

// catchUpTo applies version m, first its base when m is partial and this
// worker does not serve that base. Only fatal errors are returned.
func (r *Receiver) catchUpTo(ctx context.Context, kv jetstream.KeyValue, m Manifest) error {
	auth := r.authManifest(m)
	if auth == nil && !m.Full && m.Base != r.current {
		if base, ok := r.oldManifest(ctx, kv, m.Base); ok && (base.Full || base.Base == r.current) {
			if err := r.handle(ctx, kv, base.Announce, false, nil); errors.Is(err, errFatal) {
				return err
			}
		}
	}
	if err := r.handle(ctx, kv, m.Announce, false, auth); errors.Is(err, errFatal) {
		return err
	}
	return nil
}

// handle receives and commits one version, or rejects it, and reports.
// live says to take its chunks from the live subscription while it keeps
// up (a version being published now), rather than from the stream alone.
// auth is why the version's signature is not accepted (nil: accepted, or
// no Trust).
//
// A version rejected for its signature or its number (auth, a jump past
// MaxVersionStep) is rejected before anything else: it is not marked seen
// and writes nothing, so that the same number, published properly, is
// still applied.
func (r *Receiver) handle(ctx context.Context, kv jetstream.KeyValue, a Announce, live bool, auth error) error {
	// Reported in the version's protocol, which its publisher reads.
	st := Status{Protocol: a.Protocol, Worker: r.cfg.Worker, Version: a.Version}
	var err error
	switch {
	case auth != nil:
		err = fmt.Errorf("version %d rejected: %w", a.Version, auth)
	case r.cfg.Trust == nil && a.Version > r.current && a.Version-r.current > r.cfg.MaxVersionStep:
		err = fmt.Errorf("%w: version %d is more than %d above version %d, the one served (number versions consecutively, or sign them and give the workers a trust file)",
			ErrVersionJump, a.Version, r.cfg.MaxVersionStep, r.current)
	case a.Version <= r.current || r.seen[a.Version]:
		err = fmt.Errorf("duplicate or older version %d (serving %d)", a.Version, r.current)
	case !a.Full && a.Base != r.current:
		r.seen[a.Version] = true
		err = fmt.Errorf("%w: version %d is a delta on version %d, this worker serves %d", errNeedsFull, a.Version, a.Base, r.current)
	default:
		r.seen[a.Version] = true
		err = r.receive(ctx, kv, a, live, &st)
		if errors.Is(err, errLiveDigest) {
			// Live bytes that pass every chunk check but not the manifest's
			// digest (a publisher that sent a chunk twice with different
			// bytes, say): the stream, not the live path, has the last word.
			r.log.Warn("refit: digest mismatch on live chunks; receiving the version again from the stream",
				zap.Uint64("version", a.Version), zap.Error(err))
			st = Status{Protocol: a.Protocol, Worker: r.cfg.Worker, Version: a.Version}
			err = r.receive(ctx, kv, a, false, &st)
		}
	}
	if ctx.Err() != nil && err != nil {
		return err // shutting down: not the version's fault
	}
	r.report(st, err)
	return err
}

// report logs, counts and publishes the outcome of a version.
func (r *Receiver) report(st Status, err error) {
	st.CurrentVersion = r.current
	switch {
	case err == nil:
		st.State = StateApplied
	case errors.Is(err, errNeedsFull):
		st.State, st.Reason = StateNeedsFull, err.Error()
	case errors.Is(err, errFatal):
		st.State, st.Reason = StateRejected, err.Error()
		r.log.Error("refit: commit failed after changing weights: stopping the worker so it restarts and catches up", zap.Error(err))
	default:
		st.State, st.Reason = StateRejected, err.Error()
	}
	if err != nil {
		// As PROTOCOL.md ("Status") has it: bytes, phases, layers and
		// chunk sources are an applied version's.
		st.Bytes, st.PhasesMS, st.Layers, st.Chunks = 0, nil, nil, nil
	}
	r.metrics.versions.WithLabelValues(st.State).Inc()
	if st.Chunks != nil {
		r.metrics.chunks.WithLabelValues("live").Add(float64(st.Chunks.Live))
		r.metrics.chunks.WithLabelValues("stream").Add(float64(st.Chunks.Stream))
	}
	r.mu.Lock()
	r.last = st
	r.mu.Unlock()
	r.reports.Add(1)
	fields := []zap.Field{zap.Uint64("version", st.Version), zap.String("state", st.State), zap.Uint64("serving", r.current),
		zap.Any("phases_ms", st.PhasesMS), zap.Any("chunks", st.Chunks)}
	if err != nil {
		r.log.Warn("refit: version not applied", append(fields, zap.String("reason", st.Reason))...)
	} else {
		r.log.Info("refit: version applied", append(fields, zap.Int64("bytes", st.Bytes), zap.Any("layers", st.Layers))...)
	}
	b, merr := jsonMarshal(st)
	if merr == nil {
		merr = r.nc.Publish(StatusSubject(r.cfg.Model), b)
	}
	if merr != nil {
		r.log.Warn("refit: publish status", zap.Error(merr))
	}
}

var (
	errNeedsFull = errors.New("needs a full version")
	// errLiveDigest marks a digest mismatch of a version some of whose
	// chunks came live: it is received again from the stream alone.
	errLiveDigest = errors.New("live chunks")
	// errFatal marks a commit that failed after it had changed live
	// weights: the worker must stop rather than serve two versions.
	errFatal = errors.New("fatal")
)

// write is one tensor of the version: where its bytes go.
type write struct {
	info   TensorInfo
	target policy.Target
	dst    *kernels.Buffer // live (direct) or staging
	layer  int
	// Times its first and last byte arrived.
	first, last time.Time
	carry       byte // the low byte of an element split across chunks

	// A delta tensor (DeltaDType): its records' decoder; whether the live
	// tensor was copied into its staging buffer, as the base the records
	// patch (staged tensors only); whether a record changed an element;
	// and, of an expert tensor, which of its experts changed.
	delta   *deltaDecoder
	copied  bool
	changed bool
	experts []bool
}

// isDelta reports whether the tensor comes as a delta on the weights
// served.
func (w *write) isDelta() bool { return w.delta != nil }

// rewrites reports whether the version writes every byte of the tensor:
// a whole tensor does, a delta tensor does not.
func (w *write) rewrites() bool { return w.delta == nil }

// plan checks a parsed header against the model and decides where each
// tensor goes. It reports every problem at once.
func (r *Receiver) plan(h Header) ([]*write, error) {
	ws, err := r.planTensors(h)
	if err != nil {
		return nil, err
	}
	if err := r.checkWrites(ws); err != nil {
		return nil, err
	}
	return ws, nil
}

// planTensors maps a header's tensors to the model's: every name known,
// BF16 (or delta) of the right shape.
func (r *Receiver) planTensors(h Header) ([]*write, error) {
	var problems []string
	var ws []*write
	for _, t := range h.Tensors {
		tg, ok := r.byName[t.Name]
		var err error
		if !ok { // another naming the model knows (fused experts, Mixtral's)
			tg, err = r.m.Resolve(t.Name)
		}
		switch {
		case err != nil:
			problems = append(problems, fmt.Sprintf("unknown tensor %q", t.Name))
			continue
		case t.DType == DeltaDType && r.deltas == nil:
			problems = append(problems, fmt.Sprintf("tensor %q: a delta tensor, and backend %s cannot apply deltas", t.Name, r.m.Backend().Name()))
			continue
		case t.DType != "BF16" && t.DType != DeltaDType:
			problems = append(problems, fmt.Sprintf("tensor %q: dtype %s, want BF16 (or %s)", t.Name, t.DType, DeltaDType))
			continue
		case !slices.Equal(t.Shape, tg.Shape):
			problems = append(problems, fmt.Sprintf("tensor %q: shape %v, want %v", t.Name, t.Shape, tg.Shape))
			continue
		}
		w := &write{info: t, target: tg, dst: tg.Buffer, layer: tg.Layer}
		if s := r.staging[tg.Buffer]; s != nil {
			w.dst = s
		}
		if t.DType == DeltaDType {
			w.delta = newDeltaDecoder(int64(tg.Size() / 2))
		}
		ws = append(ws, w)
	}
	if len(problems) > 0 {
		if len(problems) > 10 {
			problems = append(problems[:10], fmt.Sprintf("and %d more", len(problems)-10))
		}
		return nil, errors.New(strings.Join(problems, "; "))
	}
	return ws, nil
}

// checkWrites checks the writes of a whole version: no two write the same
// weights, and every dirty range is rewritten.
func (r *Receiver) checkWrites(ws []*write) error {
	// Two tensors writing the same bytes (per-expert and fused, say) would
	// make the result depend on their order.
	spans := make([]span, len(ws))
	for i, w := range ws {
		spans[i] = span{w.target.Buffer, w.target.Offset, w.target.Size(), w.info.Name}
	}
	sort.Slice(spans, func(i, j int) bool {
		return spans[i].buf.Addr()+uintptr(spans[i].off) < spans[j].buf.Addr()+uintptr(spans[j].off)
	})
	for i := 1; i < len(spans); i++ {
		p, s := spans[i-1], spans[i]
		if p.buf == s.buf && s.off < p.off+p.len {
			return fmt.Errorf("tensors %q and %q write the same weights", p.name, s.name)
		}
	}
	// Dirty stack ranges must all be rewritten by this version: by whole
	// tensors, as a delta tensor patches what the stacks hold.
	var missing []string // distinct tensors
	seen := map[string]bool{}
	for _, d := range r.dirty {
		if !seen[d.name] && !slices.ContainsFunc(ws, func(w *write) bool {
			return w.rewrites() && w.dst == w.target.Buffer && span{w.target.Buffer, w.target.Offset, w.target.Size(), ""}.covers(d)
		}) {
			seen[d.name] = true
			missing = append(missing, d.name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %d tensors left dirty by a rejected version are not rewritten (first: %s)", errNeedsFull, len(missing), missing[0])
	}
	return nil
}

// addDirty records stack ranges a rejected version wrote. A range already
// dirty (the same tensor written by two rejected versions, or by one
// received twice) is recorded once, and one that covers ranges already
// recorded replaces them: r.dirty holds no range covered by another.
func (r *Receiver) addDirty(wrote []span) {
	for _, w := range wrote {
		if slices.ContainsFunc(r.dirty, func(d span) bool { return d.covers(w) }) {
			continue
		}
		r.dirty = slices.DeleteFunc(r.dirty, func(d span) bool { return w.covers(d) })
		r.dirty = append(r.dirty, w)
	}
}

// isFull reports whether a version's tensors cover every weight of the
// model. The spans written are sorted per buffer: plan rejected overlaps,
// so the one starting last at or before a weight is the only one that can
// cover it (a search, where a scan of every tensor per weight was
// quadratic in the tensors).
func (r *Receiver) isFull(ws []*write) bool {
	written := map[*kernels.Buffer][]span{}
	for _, w := range ws {
		written[w.target.Buffer] = append(written[w.target.Buffer], span{w.target.Buffer, w.target.Offset, w.target.Size(), ""})
	}
	for _, s := range written {
		slices.SortFunc(s, func(a, b span) int { return cmp.Or(cmp.Compare(a.off, b.off), cmp.Compare(a.len, b.len)) })
	}
	for _, t := range r.targets {
		s := written[t.Buffer]
		i := sort.Search(len(s), func(i int) bool { return s[i].off > t.Offset }) - 1
		if i < 0 || !s[i].covers(span{t.Buffer, t.Offset, t.Size(), t.Name}) {
			return false
		}
	}
	return true
}

// receive streams version a into its destinations, validates it and
// commits it. live says to read chunks from the live subscription while it
// keeps up; the stream is the fallback (and, without live, the source).
func (r *Receiver) receive(ctx context.Context, kv jetstream.KeyValue, a Announce, live bool, st *Status) (err error) {
	recvStart := time.Now()
	// Watch the bucket from the start: the manifest's arrival after the
	// last chunk wakes the worker at once rather than at the next poll,
	// and a newer version announced before this one completed ends it at
	// once (versionWatch).
	mw, err := kv.WatchAll(ctx)
	if err != nil {
		return fmt.Errorf("version %d: watch the bucket: %w", a.Version, err)
	}
	defer mw.Stop()
	vw := &versionWatch{r: r, kv: kv, updates: mw.Updates(), v: a.Version, sealable: a.Protocol == ProtocolLive}
	r.received.Store(0)
	parts := a.PartList()
	res := make([]partRecv, len(parts))
	defer func() {
		for _, p := range res {
			if p.digest != nil {
				p.digest.close()
			}
			if err != nil && len(p.wrote) > 0 {
				r.addDirty(p.wrote)
			}
		}
	}()
	if len(parts) == 1 {
		var ls *liveSub
		if live {
			ls = r.live
		}
		if err := r.receivePart(ctx, a, 0, ls, vw, nil, &res[0]); err != nil {
			return err
		}
	} else if err := r.receiveParts(ctx, a, parts, live, vw, res); err != nil {
		return err
	}

	// Every byte is in: the manifest must vouch for them.
	m, err := r.awaitManifest(ctx, kv, vw, a.Version)
	if err != nil {
		return err
	}
	if m.Full != a.Full || m.Base != a.Base {
		return fmt.Errorf("version %d: announced full=%v base=%d, the manifest says full=%v base=%d", a.Version, a.Full, a.Base, m.Full, m.Base)
	}
	if m.Model != a.Model || m.HeaderSHA256 != a.HeaderSHA256 {
		return fmt.Errorf("version %d: announced model %s header sha256 %q, the manifest says model %s header sha256 %q",
			a.Version, a.Model, a.HeaderSHA256, m.Model, m.HeaderSHA256)
	}
	var fromNet, fromJS int
	for _, p := range res {
		fromNet, fromJS = fromNet+p.fromNet, fromJS+p.fromJS
	}
	st.Chunks = &ChunkSources{Live: fromNet, Stream: fromJS}
	if m.Protocol != a.Protocol {
		return fmt.Errorf("version %d: announced in protocol %d, the manifest is protocol %d", a.Version, a.Protocol, m.Protocol)
	}
	if m.ChunkBytes != a.ChunkBytes {
		return fmt.Errorf("version %d: %w: manifest chunk_bytes %d, announced %d", a.Version, ErrProtocol, m.ChunkBytes, a.ChunkBytes)
	}
	if len(m.Parts) != len(a.Parts) {
		return fmt.Errorf("version %d: %w: manifest of %d parts, announced %d", a.Version, ErrProtocol, len(m.PartList()), len(parts))
	}
	var total int64
	for i, p := range res {
		mp := Part{TotalBytes: m.TotalBytes, Chunks: m.Chunks, HeaderBytes: m.HeaderBytes, Tensors: m.Tensors, ChunkTableSHA256: m.Digest()}
		if len(m.Parts) > 0 {
			mp = m.Parts[i]
		}
		what := fmt.Sprintf("version %d", a.Version)
		if len(parts) > 1 {
			what = fmt.Sprintf("version %d, part %d", a.Version, i)
		}
		field, sum := "chunk table sha256", p.table.Sum()
		streamSum, wantStream := "", ""
		switch {
		case a.Protocol == Protocol1:
			field, sum = "sha256", p.digest.sum()
		case p.digest != nil:
			streamSum, wantStream = p.digest.sum(), m.StreamSHA256
		}
		if sum != mp.ChunkTableSHA256 || streamSum != wantStream || mp.TotalBytes != p.total || mp.Chunks != p.chunks {
			err := fmt.Errorf("%s: %s %s over %d bytes in %d chunks, the manifest says %s over %d in %d",
				what, field, sum, p.total, p.chunks, mp.ChunkTableSHA256, mp.TotalBytes, mp.Chunks)
			if streamSum != wantStream {
				err = fmt.Errorf("%s: stream sha256 %s, the signed manifest says %s", what, streamSum, wantStream)
			}
			if fromNet > 0 {
				return fmt.Errorf("%w: %w", errLiveDigest, err)
			}
			return err
		}
		// The manifest's account of the stream must be the stream's.
		switch {
		case mp.HeaderBytes != int(p.hdr.Len):
			return fmt.Errorf("%s: %w: manifest header_bytes %d, the stream's header is %d bytes", what, ErrProtocol, mp.HeaderBytes, p.hdr.Len)
		case mp.Tensors != len(p.hdr.Tensors):
			return fmt.Errorf("%s: %w: manifest tensors %d, the stream's header holds %d", what, ErrProtocol, mp.Tensors, len(p.hdr.Tensors))
		}
		total += p.total
	}
	st.Bytes = total
	receiveDone := time.Now()
	r.log.Debug("refit: version received", zap.Uint64("version", a.Version), zap.Int("parts", len(parts)), zap.Int("live_chunks", fromNet),
		zap.Int("stored_chunks", fromJS), zap.Duration("took", receiveDone.Sub(recvStart)))
	var ws []*write
	var wrote []span
	for _, p := range res {
		ws, wrote = append(ws, p.ws...), append(wrote, p.wrote...)
	}
	layers := r.receiveTimings(ws)
	if err := r.commit(ctx, a.Version, ws, layers, st); err != nil {
		return err
	}
	// The stacks now hold committed weights: nothing written is dirty, and
	// earlier dirt this version rewrote is clean again.
	r.dirty = slices.DeleteFunc(r.dirty, func(d span) bool {
		return slices.ContainsFunc(wrote, func(w span) bool { return w.covers(d) })
	})
	for i := range res {
		res[i].wrote = nil
	}
	st.PhasesMS["receive"] = ms(receiveDone.Sub(recvStart))
	r.metrics.phase.WithLabelValues("receive").Observe(receiveDone.Sub(recvStart).Seconds())
	return nil
}

// partRecv is one part of a version as received.
type partRecv struct {
	hdr    Header
	ws     []*write
	wrote  []span // stack ranges written in place
	table  *ChunkTable
	digest *digester // the whole stream's SHA-256: protocol 1, or a signed version
	total  int64
	chunks int

	fromNet, fromJS int
}

// partsPlan holds back the parts of a version from writing until every
// part's header is planned and the version's writes are checked as a
// whole (no weights written twice, dirty ranges rewritten, a full
// version's coverage): a bad header of any part rejects the version
// before anything is written.
type partsPlan struct {
	r    *Receiver
	full bool
	mu   sync.Mutex
	ws   [][]*write
	left int
	err  error
	done chan struct{}
}

// ready hands in part i's writes and waits for the check of them all.
func (pp *partsPlan) ready(ctx context.Context, i int, ws []*write) error {
	pp.mu.Lock()
	pp.ws[i] = ws
	pp.left--
	if pp.left == 0 {
		var all []*write
		for _, w := range pp.ws {
			all = append(all, w...)
		}
		pp.err = pp.r.checkWrites(all)
		if pp.err == nil && pp.full && !pp.r.isFull(all) {
			pp.err = errors.New("its parts do not cover every weight of a full version")
		}
		close(pp.done)
	}
	pp.mu.Unlock()
	select {
	case <-pp.done:
		return pp.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// receiveParts receives the parts of a protocol-3 version at once, each
// from its own live subscription (made now for parts past those Run
// holds) or its own stream. The first part to fail stops the others.
func (r *Receiver) receiveParts(ctx context.Context, a Announce, parts []Part, live bool, vw *versionWatch, res []partRecv) error {
	lives := make([]*liveSub, len(parts))
	if live {
		for len(r.lives) < len(parts) {
			l, err := r.trySubscribeLive(ctx, len(r.lives))
			if err != nil {
				r.log.Warn("refit: no live subscription for a part; it is read from its stream", zap.Int("part", len(r.lives)), zap.Error(err))
				break
			}
			r.lives = append(r.lives, l)
		}
		copy(lives, r.lives)
	}
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// One goroutine follows the bucket for all parts (a part that is done
	// early must not leave the others deaf to a newer version): a newer
	// version announced before this one completes stops every part.
	var superseded error
	stopWatch, watchDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(watchDone)
		for {
			select {
			case <-stopWatch:
				return
			case <-pctx.Done():
				return
			case e, ok := <-vw.updates:
				if !ok {
					vw.updates = nil
					return
				}
				if err := vw.note(pctx, e); err != nil {
					superseded = err
					cancel()
					return
				}
			}
		}
	}()
	pp := &partsPlan{r: r, full: a.Full, ws: make([][]*write, len(parts)), left: len(parts), done: make(chan struct{})}
	errs := make([]error, len(parts))
	var wg sync.WaitGroup
	for i, p := range parts {
		pa := a
		pa.Subject, pa.TotalBytes, pa.Chunks = p.Subject, p.TotalBytes, p.Chunks
		wg.Go(func() {
			if err := r.receivePart(pctx, pa, i, lives[i], nil, pp, &res[i]); err != nil {
				errs[i] = err
				cancel()
			}
		})
	}
	wg.Wait()
	close(stopWatch)
	<-watchDone
	// The part that failed first says why; the others only stopped.
	for _, err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	if superseded != nil {
		return superseded
	}
	return errors.Join(errs...)
}

// partStreamConn is a connection to a part server and its JetStream.
type partStreamConn struct {
	nc *nats.Conn
	js jetstream.JetStream
}

// partJS returns the JetStream that part's stream is read through: part
// 0's, the receiver's own; part i >= 1's, one on a connection of the
// part's own (to its part server, with PartServers), made on first use.
// A connection a part: the stream consumers of several parts on one
// connection share the server's outbound allowance for one client, and
// pulled in small windows a consumer could stall (docs/REFIT.md, "The
// receiver"). where names the part's server for errors ("" for the
// receiver's own).
func (r *Receiver) partJS(part int) (js jetstream.JetStream, where string, err error) {
	if part < 1 {
		return r.js, "", nil
	}
	if len(r.cfg.PartServers) > 0 {
		where = " on part server " + redactedURL(r.cfg.PartServers[(part-1)%len(r.cfg.PartServers)])
	}
	r.partMu.Lock()
	defer r.partMu.Unlock()
	if c, ok := r.partConns[part]; ok {
		return c.js, where, nil
	}
	opts := partOptions(r.liveOpts, r.cfg.PartServers, part)
	opts.Name = strings.TrimSpace(r.nc.Opts.Name + " refit-part-stream-" + strconv.Itoa(part))
	nc, err := opts.Connect()
	if err != nil {
		return nil, where, fmt.Errorf("connect for part %d's stream%s: %w", part, where, err)
	}
	if js, err = jetstream.New(nc); err != nil {
		nc.Close()
		return nil, where, fmt.Errorf("part %d's stream%s: %w", part, where, err)
	}
	if r.partConns == nil {
		r.partConns = map[int]partStreamConn{}
	}
	r.partConns[part] = partStreamConn{nc: nc, js: js}
	return js, where, nil
}

// closePartConns closes the connections partJS made.
func (r *Receiver) closePartConns() {
	r.partMu.Lock()
	defer r.partMu.Unlock()
	for _, c := range r.partConns {
		c.nc.Close()
	}
	r.partConns = nil
}

// receivePart receives part i of version a (a's subject, bytes and chunks
// are the part's): live from ls while it keeps up, else from the part's
// stream; it checks every chunk, plans the part's header (with pp, the
// version's other parts too), and writes the bytes to their tensors.
func (r *Receiver) receivePart(ctx context.Context, a Announce, part int, ls *liveSub, vw *versionWatch, pp *partsPlan, res *partRecv) (err error) {
	feed := r.newFeed(a, part, ls)
	feed.watch = vw
	feed.follow()
	defer func() {
		feed.close()
		res.fromNet, res.fromJS = feed.fromNet, feed.fromJS
	}()
	// The digest the manifest is checked against: the chunk table's
	// SHA-256 (protocol 2; the entries come from chunks whose CRC-32C was
	// checked against their payload), or for a protocol-1 version the
	// SHA-256 of the whole stream, on a goroutine of its own.
	res.table = NewChunkTable()
	// A signed version's manifest also carries the whole stream's SHA-256
	// (the chunk table binds chunks only by CRC-32C, which can be forged).
	signed := r.cfg.Trust != nil
	if a.Protocol == Protocol1 || signed {
		res.digest = newDigester(8) // receive closes it
	}
	var batch deltaBatch
	var (
		prefix   []byte // the stream's first bytes, until the header is parsed
		parsed   bool   // the header is parsed and planned
		received int64
		total    int64 = -1
		chunks   int
		next     int
	)
	for total < 0 || received < total {
		c, err := feed.next(ctx, expect{seq: next, offset: received, total: total, chunks: chunks})
		if err != nil {
			return err
		}
		if r.chunkDelay > 0 {
			time.Sleep(r.chunkDelay)
		}
		data := c.data
		total, chunks = c.Total, c.Chunks
		next++
		res.table.Add(c.Offset, len(data), c.CRC)
		if res.digest != nil {
			if err := res.digest.write(ctx, data); err != nil {
				return err
			}
		}
		now := time.Now()
		chunkStart := received
		received += int64(len(data))
		r.received.Add(int64(len(data)))
		if !parsed {
			// The header is read in place when the first chunk holds it
			// whole (the usual case): copying a whole chunk into fresh
			// memory costs a page fault every 4 KiB.
			head := data
			if len(prefix) > 0 || int64(len(data)) < 8 {
				prefix = append(prefix, data...)
				head = prefix
			}
			n, ok, err := HeaderLen(head)
			if err != nil {
				return fmt.Errorf("version %d: %w", a.Version, err)
			}
			if !ok || int64(len(head)) < 8+n {
				if len(prefix) == 0 {
					prefix = append(prefix, data...)
				}
				continue
			}
			if signed {
				// Before anything is written: the header decides where
				// the bytes go.
				if sum := sha256.Sum256(head[:8+n]); hex.EncodeToString(sum[:]) != a.HeaderSHA256 {
					return fmt.Errorf("version %d: header sha256 %x, the signed announcement says %s", a.Version, sum, a.HeaderSHA256)
				}
			}
			if res.hdr, err = ParseHeader(head[8:8+n], total); err != nil {
				return fmt.Errorf("version %d: %w", a.Version, err)
			}
			if n := res.hdr.deltaTensors(); a.Full && n > 0 {
				return fmt.Errorf("version %d: %w: announced full, it holds %d delta tensors (%s), which need their base", a.Version, ErrProtocol, n, DeltaDType)
			}
			if pp == nil {
				res.ws, err = r.plan(res.hdr)
			} else if res.ws, err = r.planTensors(res.hdr); err == nil {
				err = pp.ready(ctx, part, res.ws)
			}
			switch {
			case errors.Is(err, errNeedsFull) || errors.Is(err, context.Canceled):
				return err
			case err != nil:
				return fmt.Errorf("version %d rejected: %w", a.Version, err)
			}
			parsed = true
			if a.Full && pp == nil && !r.isFull(res.ws) {
				return fmt.Errorf("version %d is announced full but does not cover every weight", a.Version)
			}
			// The data bytes that came with the header.
			data, chunkStart = head[8+n:], 8+n
			prefix = nil
			if len(data) == 0 {
				continue
			}
		}
		if err := r.scatter(res.ws, res.hdr, chunkStart, data, now, &res.wrote, &batch); err != nil {
			return fmt.Errorf("version %d: %w", a.Version, err)
		}
	}
	if !parsed {
		return fmt.Errorf("version %d: stream ended inside its header", a.Version)
	}
	if next != chunks {
		return fmt.Errorf("version %d: %d chunks carried all %d bytes, the headers said %d", a.Version, next, total, chunks)
	}
	res.total, res.chunks = total, chunks
	return nil
}

// scatter writes the data bytes [at, at+len(data)) of the stream into the
// tensors they belong to, checking every complete BF16 value for NaN/Inf.
func (r *Receiver) scatter(ws []*write, h Header, at int64, data []byte, now time.Time, wrote *[]span, b *deltaBatch) error {
	ds := h.DataStart()
	// The first tensor overlapping the chunk (ws is in data order).
	i := sort.Search(len(ws), func(i int) bool { return ds+ws[i].info.End > at })
	for ; i < len(ws) && len(data) > 0; i++ {
		w := ws[i]
		begin := ds + w.info.Begin
		lo := at - begin // offset inside the tensor
		n := min(int64(len(data)), ds+w.info.End-at)
		part := data[:n]
		if w.isDelta() {
			if err := r.scatterDelta(w, part, lo+n == w.info.End-w.info.Begin, wrote, b); err != nil {
				return fmt.Errorf("tensor %q: %w", w.info.Name, err)
			}
		} else {
			if err := checkFinite(w, lo, part); err != nil {
				return err
			}
			if err := r.stager.Stage(w.dst, w.target.Offset+int(lo), part); err != nil {
				return fmt.Errorf("tensor %q: %w", w.info.Name, err)
			}
			if w.first.IsZero() && w.dst == w.target.Buffer {
				*wrote = append(*wrote, span{w.target.Buffer, w.target.Offset, w.target.Size(), w.info.Name})
			}
		}
		if w.first.IsZero() {
			w.first = now
		}
		w.last = now
		data, at = data[n:], at+n
	}
	return r.flushDeltas(b)
}

// scatterDelta decodes the next bytes part of delta tensor w (last: its
// bytes end with part) and writes the records completed: into the stacks
// in place (recording the tensor as written, so that it is dirty if the
// version is rejected), or into the tensor's staging buffer, which first
// gets the served tensor, the base the records patch. The records of a
// chunk go to the backend in batches, one per destination buffer.
func (r *Receiver) scatterDelta(w *write, part []byte, last bool, wrote *[]span, b *deltaBatch) error {
	first := int64(w.target.Offset / 2)
	err := w.delta.feed(part, func(rec deltaRecord, region int64) error {
		if rec.count == 0 {
			return nil
		}
		if !w.changed {
			w.changed = true
			if w.dst == w.target.Buffer {
				*wrote = append(*wrote, span{w.target.Buffer, w.target.Offset, w.target.Size(), w.info.Name})
			} else if !w.copied {
				if err := r.deltas.StageCopy(w.dst, w.target.Offset, w.target.Buffer, w.target.Offset, w.target.Size()); err != nil {
					return err
				}
				w.copied = true
			}
		}
		n := regionLen(w.delta.n, region)
		if w.target.IsExpert() {
			w.markExperts(rec, region, n)
		}
		if b.dst != w.dst {
			if err := r.flushDeltas(b); err != nil {
				return err
			}
			b.dst = w.dst
		}
		var sp kernels.DeltaSpan
		sp, b.masks, b.values = rec.span(first, region, n, b.masks, b.values)
		b.spans = append(b.spans, sp)
		return nil
	})
	if err != nil {
		return err
	}
	if last {
		if err := w.delta.done(); err != nil {
			return fmt.Errorf("%w: %v", ErrProtocol, err)
		}
	}
	return nil
}

// markExperts records which experts of expert tensor w the record of
// region (n elements) changes.
func (w *write) markExperts(rec deltaRecord, region int64, n int) {
	count := int64(w.target.Experts[1] - w.target.Experts[0])
	per := max(w.delta.n/count, 1) // elements an expert
	if w.experts == nil {
		w.experts = make([]bool, count)
	}
	lo := region * DeltaRegionElems
	for e := lo / per; e < count && e*per < lo+int64(n); e++ {
		a, b := max(lo, e*per)-lo, min(lo+int64(n), (e+1)*per)-lo
		if !w.experts[e] && rec.changedIn(int(a), int(b)) {
			w.experts[e] = true
		}
	}
}

// deltaBatch gathers delta records for one buffer, to be written in one
// call of the backend.
type deltaBatch struct {
	dst           *kernels.Buffer
	spans         []kernels.DeltaSpan
	masks, values []byte
}

func (b *deltaBatch) reset() {
	b.dst, b.spans, b.masks, b.values = nil, b.spans[:0], b.masks[:0], b.values[:0]
}

// flushDeltas writes the records gathered.
func (r *Receiver) flushDeltas(b *deltaBatch) error {
	if len(b.spans) == 0 {
		b.reset()
		return nil
	}
	err := r.deltas.StageScatterBF16(kernels.HostScatterBF16{Dst: b.dst, Len: b.dst.Len(), Spans: b.spans, Masks: b.masks, Values: b.values})
	b.reset()
	return err
}

// checkFinite rejects a NaN or Inf among the BF16 values of part, which
// starts lo bytes into tensor w. A value split across chunks is completed
// with the byte carried from the previous chunk.
func checkFinite(w *write, lo int64, part []byte) error {
	j := 0
	if lo%2 == 1 { // finish the value whose low byte came last time
		if bad(w.carry, part[0]) {
			return fmt.Errorf("tensor %q: value %d is NaN or Inf", w.info.Name, lo/2)
		}
		j = 1
	}
	if i := bf16.FirstNonFinite(part[j:]); i >= 0 {
		return fmt.Errorf("tensor %q: value %d is NaN or Inf", w.info.Name, (lo+int64(j))/2+int64(i))
	}
	if (len(part)-j)%2 == 1 { // the low byte of a value the next chunk completes
		w.carry = part[len(part)-1]
	}
	return nil
}

// bad reports whether a little-endian BF16 value is NaN or Inf: all eight
// exponent bits set.
func bad(lo, hi byte) bool { return hi&0x7f == 0x7f && lo&0x80 != 0 }

// versionWatch follows the bucket while version v is received
// (PROTOCOL.md, "Worker behaviour"): a newer version that this worker
// would take, announced (or completed) while v's manifest is not in the
// bucket, means v's publisher stopped before completing it, so v is
// superseded at once rather than after ChunkTimeout of silence. A v whose
// manifest is in the bucket is complete in the stream: a slow worker reads
// it to the end whatever comes after it.
type versionWatch struct {
	r       *Receiver
	kv      jetstream.KeyValue
	updates <-chan jetstream.KeyValueEntry // the bucket's values, then its updates; nil once closed
	v       uint64
	// complete says v's manifest is in the bucket; manifest is that
	// manifest when the watch delivered it (and it is accepted).
	complete bool
	manifest *Manifest
	// sealable says v is live first: its seal does as its manifest.
	sealable bool
}

// note handles an entry of the watch: it returns an error when v is
// superseded.
func (vw *versionWatch) note(ctx context.Context, e jetstream.KeyValueEntry) error {
	if e == nil || e.Operation() != jetstream.KeyValuePut {
		return nil
	}
	r := vw.r
	var a Announce
	var auth error
	switch e.Key() {
	case KeyAnnounce:
		x, err := r.parseAnnounce(e.Value())
		if err != nil {
			return nil
		}
		a, auth = x, r.authAnnounce(x)
	case KeyManifest:
		m, err := r.parseManifest(e.Value())
		if err != nil {
			return nil
		}
		auth = r.authManifest(m)
		if m.Version == vw.v && auth == nil {
			vw.complete, vw.manifest = true, &m
			return nil
		}
		a = m.Announce
	case KeySealed:
		// Not complete in the stream yet, but enough to commit on once
		// every chunk is in.
		if m, err := r.parseManifest(e.Value()); err == nil && vw.sealOf(m) && r.authManifest(m) == nil && vw.manifest == nil {
			vw.manifest = &m
			r.sealed.Store(m.Version)
		}
		return nil
	default:
		return nil
	}
	if a.Version <= vw.v || !r.wouldTake(a, auth) {
		return nil
	}
	return vw.supersededBy(ctx, a.Version)
}

// sealOf reports whether m, the bucket's seal, is v's and may stand for
// its manifest: v is live first.
func (vw *versionWatch) sealOf(m Manifest) bool {
	return vw.sealable && m.Version == vw.v && m.Protocol == ProtocolLive
}

// supersededBy returns the error that ends v, newer having come, unless
// v's manifest is in the bucket.
func (vw *versionWatch) supersededBy(ctx context.Context, newer uint64) error {
	if vw.complete {
		return nil
	}
	if m, ok := vw.r.manifestOf(ctx, vw.kv, vw.v); ok {
		vw.complete, vw.manifest = true, m
		return nil
	}
	return fmt.Errorf("version %d: superseded by version %d, announced before this one completed (its publisher stopped?)", vw.v, newer)
}

// manifestOf looks for version v's (accepted) manifest in the bucket: its
// value, then its history.
func (r *Receiver) manifestOf(ctx context.Context, kv jetstream.KeyValue, v uint64) (*Manifest, bool) {
	if e, err := kv.Get(ctx, KeyManifest); err == nil {
		if m, err := ParseManifest(e.Value()); err == nil && m.Version == v && r.authManifest(m) == nil {
			return &m, true
		}
	}
	if m, ok := r.oldManifest(ctx, kv, v); ok {
		return &m, true
	}
	return nil, false
}

// wouldTake reports whether this worker would receive version a (auth:
// its signature check) were it announced now: a newer version, of its
// model, not seen, properly signed or within MaxVersionStep.
func (r *Receiver) wouldTake(a Announce, auth error) bool {
	return auth == nil && a.Model == r.cfg.Model && a.Version > r.current && !r.seen[a.Version] &&
		(r.cfg.Trust != nil || a.Version-r.current <= r.cfg.MaxVersionStep)
}

// awaitManifest waits for the manifest of version v: it reads the
// bucket, and again whenever the watch vw (made before the version's
// chunks were read) sees a change, with a slow poll as a backstop. A
// newer version announced meanwhile ends the wait (versionWatch).
func (r *Receiver) awaitManifest(ctx context.Context, kv jetstream.KeyValue, vw *versionWatch, v uint64) (Manifest, error) {
	if vw.manifest != nil {
		return *vw.manifest, nil // delivered while the chunks came
	}
	deadline := time.NewTimer(r.cfg.ChunkTimeout)
	defer deadline.Stop()
	poll := time.NewTicker(100 * time.Millisecond)
	defer poll.Stop()
	updates := vw.updates
	// Without Trust, the manifest is taken as it comes. With it, one whose
	// signature is not accepted is passed over, as if not yet written (its
	// writer might otherwise reject a signed version by writing a bogus
	// manifest while it is received): the wait goes on, and its error is
	// the reason given if no accepted one comes.
	var authErr error
	accepted := func(m Manifest) bool {
		if err := r.authManifest(m); err != nil {
			if authErr == nil || authErr.Error() != err.Error() {
				r.log.Warn("refit: ignoring a manifest", zap.Uint64("version", v), zap.Error(err))
			}
			authErr = err
			return false
		}
		return true
	}
	for {
		// A live-first version's seal, its manifest before its chunks are
		// stored, will do as well.
		if vw.sealable {
			if e, err := kv.Get(ctx, KeySealed); err == nil {
				if m, err := ParseManifest(e.Value()); err == nil && vw.sealOf(m) && accepted(m) {
					return m, nil
				}
			}
		}
		e, err := kv.Get(ctx, KeyManifest)
		if err == nil {
			m, perr := ParseManifest(e.Value())
			switch {
			case perr != nil && r.cfg.Trust == nil && namesVersion(e.Value(), v):
				return m, fmt.Errorf("version %d: %w", v, perr)
			case perr != nil:
				// Another version's (a stale one, or one the watch loop
				// answers later), or one that names none: not this
				// version's manifest, which may be in the history. With
				// Trust, a malformed manifest is passed over whatever it
				// names.
				if r.cfg.Trust != nil && authErr == nil {
					authErr = perr
				}
				if old, ok := r.oldManifest(ctx, kv, v); ok {
					return old, nil
				}
			case !accepted(m):
				// Written over this version's manifest, perhaps: look in
				// the history.
				if old, ok := r.oldManifest(ctx, kv, v); ok {
					return old, nil
				}
			case m.Version == v:
				return m, nil
			case m.Version > v:
				// Catching up on an older version: its manifest is in the
				// bucket's history.
				if old, ok := r.oldManifest(ctx, kv, v); ok {
					return old, nil
				}
				// A newer version completed while this one has no manifest:
				// this one's publisher stopped (the watch may not have
				// delivered the newer announcement yet).
				if err := vw.supersededBy(ctx, m.Version); err != nil {
					return m, err
				}
				if vw.manifest != nil {
					return *vw.manifest, nil
				}
				return m, fmt.Errorf("version %d: the manifest moved on to version %d without it", v, m.Version)
			}
		} else if !errors.Is(err, jetstream.ErrKeyNotFound) && ctx.Err() == nil {
			r.log.Warn("refit: read manifest", zap.Error(err))
		}
		select {
		case <-ctx.Done():
			return Manifest{}, ctx.Err()
		case <-deadline.C:
			if authErr != nil {
				return Manifest{}, fmt.Errorf("version %d: all bytes in, but no acceptable manifest after %v: %w", v, r.cfg.ChunkTimeout, authErr)
			}
			return Manifest{}, fmt.Errorf("version %d: all bytes in, but no manifest after %v (publisher gone?)", v, r.cfg.ChunkTimeout)
		case e, ok := <-updates:
			if !ok {
				updates, vw.updates = nil, nil // the watcher stopped: the poll goes on
				continue
			}
			if e == nil {
				continue // the end of the bucket's current values
			}
			// The usual case: the manifest of this version, in hand (one
			// round trip less at the end of every version).
			if e.Key() == KeyManifest {
				if m, err := ParseManifest(e.Value()); err == nil && m.Version == v && accepted(m) {
					return m, nil
				}
			}
			if err := vw.note(ctx, e); err != nil {
				return Manifest{}, err
			}
			if vw.manifest != nil {
				return *vw.manifest, nil // its seal (versionWatch.note)
			}
		case <-poll.C:
		}
	}
}

// newestTrusted returns the newest manifest of the bucket's history signed
// by a trusted key, nil if none.
func (r *Receiver) newestTrusted(ctx context.Context, kv jetstream.KeyValue) *Manifest {
	hist, err := kv.History(ctx, KeyManifest)
	if err != nil {
		return nil
	}
	for i := len(hist) - 1; i >= 0; i-- {
		if m, err := ParseManifest(hist[i].Value()); err == nil && r.authManifest(m) == nil {
			return &m
		}
	}
	return nil
}

// oldManifest looks for version v's manifest in the bucket's history.
func (r *Receiver) oldManifest(ctx context.Context, kv jetstream.KeyValue, v uint64) (Manifest, bool) {
	hist, err := kv.History(ctx, KeyManifest)
	if err != nil {
		return Manifest{}, false
	}
	for _, e := range hist {
		if m, err := ParseManifest(e.Value()); err == nil && m.Version == v && r.authManifest(m) == nil {
			return m, true
		}
	}
	return Manifest{}, false
}

// receiveTimings returns, per decoder layer, the span from its first to its
// last byte received (layer -1, the embeddings and head, is reported as
// layer -1).
func (r *Receiver) receiveTimings(ws []*write) map[int]*LayerTiming {
	first, last := map[int]time.Time{}, map[int]time.Time{}
	for _, w := range ws {
		if w.first.IsZero() {
			continue // an empty tensor
		}
		if f, ok := first[w.layer]; !ok || w.first.Before(f) {
			first[w.layer] = w.first
		}
		if w.last.After(last[w.layer]) {
			last[w.layer] = w.last
		}
	}
	out := map[int]*LayerTiming{}
	for _, w := range ws {
		if out[w.layer] == nil {
			out[w.layer] = &LayerTiming{Layer: w.layer}
		}
	}
	for l, f := range first {
		if !f.IsZero() {
			out[l].ReceiveMS = ms(last[l].Sub(f))
		}
	}
	return out
}

// commit copies staged tensors into the live buffers, requantizes the
// touched experts in place and moves the version, at a step boundary.
func (r *Receiver) commit(ctx context.Context, v uint64, ws []*write, layers map[int]*LayerTiming, st *Status) error {
	// The experts to requantize: every one of a whole expert tensor, and
	// those whose BF16 values a delta tensor changed.
	experts := map[int][]int{}
	for _, w := range ws {
		if w.target.IsExpert() {
			for e := w.target.Experts[0]; e < w.target.Experts[1]; e++ {
				if w.isDelta() && (w.experts == nil || !w.experts[e-w.target.Experts[0]]) {
					continue
				}
				experts[w.layer] = append(experts[w.layer], e)
			}
		}
	}
	// The experts' amax, measured on the staging path after their bytes
	// (off the op stream, while generation runs), so that the commit's
	// requantization reads each matrix once: for the layers whose expert
	// tensors were all written in place (a staged one is final only after
	// the commit's copy).
	hints := map[int]moe.AmaxHint{}
	staged := map[int]bool{}
	for _, w := range ws {
		if w.target.IsExpert() && w.dst != w.target.Buffer {
			staged[w.layer] = true
		}
	}
	for layer, es := range experts {
		if staged[layer] {
			continue
		}
		h, err := r.m.MoE(layer).StageAmax(slices.Compact(slices.Sorted(slices.Values(es)))...)
		if err != nil {
			return fmt.Errorf("version %d: layer %d: %w", v, layer, err)
		}
		hints[layer] = h
	}
	// Staged bytes may still be on their way to the device: wait for them
	// before the commit reads them (a failed copy rejects the version with
	// the live weights untouched).
	if err := r.stager.StageSync(); err != nil {
		return fmt.Errorf("version %d: staging: %w", v, err)
	}
	var copyTotal, quantTotal time.Duration
	var pause time.Duration
	changed := false // live weights were touched: a failure from here on is fatal
	err := r.eng.AtBoundary(ctx, func() error {
		start := time.Now()
		be := r.m.Backend()
		changed = true
		// The staged tensors' copies, a layer's in one call (hundreds of
		// them, each crossing to the device's thread when one at a time),
		// then the requantizations, all back to back: one Sync at the end.
		// With a profiler each layer's copy and requantization time is
		// the device's, from events; otherwise (a backend whose ops finish
		// as they are issued) the host's clock.
		var prof kernels.Profile
		if p, ok := be.(kernels.Profiler); ok {
			var err error
			if prof, err = p.NewProfile(); err == nil {
				defer prof.Close()
				err = prof.Mark("start")
			}
			if err != nil { // nothing is changed yet: time on the host instead
				r.log.Warn("refit: no device timing of the commit", zap.Error(err))
				prof = nil
			}
		}
		timed := func(group string, d *float64, total *time.Duration, op func() error) error {
			if prof != nil {
				if err := prof.Mark(group); err != nil {
					return err
				}
				return op()
			}
			t0 := time.Now()
			err := op()
			*d += ms(time.Since(t0))
			*total += time.Since(t0)
			return err
		}
		byLayer := map[int][2][]*kernels.Buffer{}
		var order []int
		for _, w := range ws {
			if w.dst == w.target.Buffer || (w.isDelta() && !w.changed) {
				continue // written in place, or a delta that changed nothing
			}
			dst, err := w.target.Buffer.ByteRange(w.target.Offset, w.target.Size())
			if err != nil {
				return err
			}
			src, err := w.dst.ByteRange(w.target.Offset, w.target.Size())
			if err != nil {
				return err
			}
			p, ok := byLayer[w.layer]
			if !ok {
				order = append(order, w.layer)
			}
			byLayer[w.layer] = [2][]*kernels.Buffer{append(p[0], dst), append(p[1], src)}
		}
		for _, layer := range order {
			p := byLayer[layer]
			if err := timed(fmt.Sprintf("copy %d", layer), &layers[layer].CopyMS, &copyTotal, func() error { return kernels.CopyAll(be, p[0], p[1]) }); err != nil {
				return fmt.Errorf("copy layer %d: %w", layer, err)
			}
		}
		qlayers := slices.Sorted(maps.Keys(experts))
		for _, layer := range qlayers {
			es := slices.Compact(slices.Sorted(slices.Values(experts[layer])))
			if err := timed(fmt.Sprintf("requantize %d", layer), &layers[layer].RequantizeMS, &quantTotal, func() error { return r.m.MoE(layer).RequantizeHinted(hints[layer], es...) }); err != nil {
				return fmt.Errorf("requantize layer %d: %w", layer, err)
			}
		}
		if prof != nil {
			if err := prof.Mark("end"); err != nil {
				return err
			}
		}
		if err := be.Sync(); err != nil {
			return err
		}
		if prof != nil {
			groups, err := prof.Groups()
			if err != nil {
				return err
			}
			for _, layer := range order {
				d := groups[fmt.Sprintf("copy %d", layer)]
				layers[layer].CopyMS += ms(d)
				copyTotal += d
			}
			for _, layer := range qlayers {
				d := groups[fmt.Sprintf("requantize %d", layer)]
				layers[layer].RequantizeMS += ms(d)
				quantTotal += d
			}
		}
		r.eng.SetVersion(v)
		r.mu.Lock()
		r.current = v
		r.mu.Unlock()
		pause = time.Since(start)
		return nil
	})
	if err != nil {
		if changed {
			return fmt.Errorf("%w: version %d: commit: %w", errFatal, v, err)
		}
		return fmt.Errorf("version %d: commit: %w", v, err)
	}
	st.PhasesMS = map[string]float64{"copy": ms(copyTotal), "requantize": ms(quantTotal), "commit": ms(pause)}
	for _, l := range layers {
		st.Layers = append(st.Layers, *l)
		for phase, d := range map[string]float64{"receive": l.ReceiveMS, "copy": l.CopyMS, "requantize": l.RequantizeMS} {
			r.metrics.layer.WithLabelValues(phase).Observe(d / 1e3)
		}
	}
	sort.Slice(st.Layers, func(i, j int) bool { return st.Layers[i].Layer < st.Layers[j].Layer })
	r.metrics.phase.WithLabelValues("copy").Observe(copyTotal.Seconds())
	r.metrics.phase.WithLabelValues("requantize").Observe(quantTotal.Seconds())
	r.metrics.phase.WithLabelValues("commit").Observe(pause.Seconds())
	r.metrics.version.Set(float64(v))
	return nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }
