package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/policy"
)

// Engine is what the service needs of a *policy.Engine.
type Engine interface {
	Submit(req policy.Request) (*policy.Handle, error)
	Score(ctx context.Context, seqs [][]int32) ([][]float32, error)
	Stats() policy.EngineStats
	AtBoundary(ctx context.Context, fn func() error) error
	// Version is read only inside AtBoundary (the loop goroutine), and only
	// when Config.CurrentVersion is nil.
	Version() uint64
}

// Limits bound what one request may ask for. Zero values take defaults
// (see Config).
type Limits struct {
	MaxPromptTokens   int `json:"max_prompt_tokens"`
	MaxTokens         int `json:"max_tokens"`
	MaxN              int `json:"max_n"`
	MaxQueue          int `json:"max_queue"` // admitted, unfinished generate and score requests
	MaxScoreSequences int `json:"max_score_sequences"`
	// MaxWaitingVersion bounds the generate requests admitted and waiting
	// for their min_policy_version, a part of MaxQueue: beyond it such a
	// request gets 503 "overloaded" while others are still admitted.
	// Without Config.CurrentVersion, a request counts as waiting while its
	// version is read, even if the version is served already.
	MaxWaitingVersion int `json:"max_waiting_version"`
}

// Config configures a Service.
type Config struct {
	Model  string // model id: the subject token of rollout.<model>.*
	Worker string // worker id, reported in summaries and status
	// QueueGroup is the NATS queue group of the endpoints (default
	// "rollout"): workers of a model in one group share its requests.
	QueueGroup string
	// Limits: defaults MaxPromptTokens and MaxTokens 4096 (Context-1 when
	// Context is known), MaxN 64 (StepSeqs when known), MaxQueue 256,
	// MaxScoreSequences 64, MaxWaitingVersion MaxQueue/4 (at least 1).
	// Limits beyond what the model can do (MaxPromptTokens or MaxTokens
	// past Context-1, MaxN past StepSeqs, MaxWaitingVersion past MaxQueue)
	// are clamped to it, so that status advertises only what works.
	Limits Limits
	// Vocab is the vocabulary size: token ids are checked against it before
	// the engine sees them. Required.
	Vocab int
	// Context is the model's max positions (0: checked by the engine only).
	Context int
	// StepSeqs is the most samples one engine step carries: the engine
	// refuses a request with a larger n (0: unknown).
	StepSeqs int
	// KVPages and Recipe are reported by status.
	KVPages int
	Recipe  string
	// MaxWaitVersion bounds a min_policy_version wait (default 30 s).
	MaxWaitVersion time.Duration
	// CurrentVersion, if set, returns the served policy version from any
	// goroutine (refit.Receiver.CurrentVersion). Without it the service
	// reads Engine.Version inside Engine.AtBoundary, which waits for the
	// current step to end.
	CurrentVersion func() uint64
	// Heartbeat is how often a generate stream that sent nothing else gets
	// a heartbeat message (default 5 s; negative: never).
	Heartbeat time.Duration
	// ClientGone is how long the reply subject of a generate request may
	// have no subscriber before the request is aborted: its client went
	// away (default 3 s; negative: never checked). See cancel.go.
	ClientGone time.Duration
	// AbortGrace is how long Drain and Stop wait, after aborting, for the
	// engine to return the aborted samples before they send the remaining
	// summaries themselves (default 5 s).
	AbortGrace time.Duration
	// Release is the version the micro service announces (default Release).
	Release string
}

// WithModel fills the fields a model determines (Vocab, Context,
// StepSeqs, KVPages, Recipe).
func (c Config) WithModel(m *policy.Model) Config {
	mc, o := m.Config(), m.Options()
	c.Vocab, c.Context, c.KVPages, c.Recipe = mc.VocabSize, mc.MaxPositions, o.KVPages, string(o.Recipe)
	c.StepSeqs = min(o.MaxSeqs, o.MaxLogitRows)
	return c
}

func (c *Config) defaults() error {
	if !validModelID(c.Model) {
		return fmt.Errorf("rollout: service: model id %q: want [A-Za-z0-9_-]+", c.Model)
	}
	if c.Worker == "" {
		return errors.New("rollout: service: empty worker id")
	}
	if c.Vocab <= 0 {
		return fmt.Errorf("rollout: service: vocabulary size %d: want > 0", c.Vocab)
	}
	if c.QueueGroup == "" {
		c.QueueGroup = "rollout"
	}
	l := &c.Limits
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	if l.MaxPromptTokens < 0 || l.MaxTokens < 0 || l.MaxN < 0 || l.MaxQueue < 0 || l.MaxScoreSequences < 0 || l.MaxWaitingVersion < 0 {
		return fmt.Errorf("rollout: service: negative limit in %+v", *l)
	}
	if c.Context < 0 || c.StepSeqs < 0 {
		return fmt.Errorf("rollout: service: context %d, step sequences %d: want >= 0", c.Context, c.StepSeqs)
	}
	lengths, n := 4096, 64
	if c.Context > 1 {
		lengths = c.Context - 1 // a prompt of one token leaves Context-1 to generate
	}
	if c.StepSeqs > 0 {
		n = c.StepSeqs
	}
	def(&l.MaxPromptTokens, lengths)
	def(&l.MaxTokens, lengths)
	def(&l.MaxN, n)
	def(&l.MaxQueue, 256)
	def(&l.MaxScoreSequences, 64)
	def(&l.MaxWaitingVersion, max(1, l.MaxQueue/4))
	if c.Context > 1 {
		l.MaxPromptTokens, l.MaxTokens = min(l.MaxPromptTokens, lengths), min(l.MaxTokens, lengths)
	}
	if c.StepSeqs > 0 {
		l.MaxN = min(l.MaxN, n)
	}
	l.MaxWaitingVersion = min(l.MaxWaitingVersion, l.MaxQueue)
	if c.MaxWaitVersion <= 0 {
		c.MaxWaitVersion = 30 * time.Second
	}
	if c.Heartbeat == 0 {
		c.Heartbeat = 5 * time.Second
	}
	if c.AbortGrace <= 0 {
		c.AbortGrace = 5 * time.Second
	}
	if c.ClientGone == 0 {
		c.ClientGone = 3 * time.Second
	}
	if c.Release == "" {
		c.Release = Release
	}
	return nil
}

// Service serves a model's generate, score and status endpoints as the
// NATS micro service "rollout-worker". See the package documentation for
// who owns which goroutine.
type Service struct {
	nc  *nats.Conn
	eng Engine
	cfg Config
	log *zap.Logger
	met *metrics
	svc micro.Service

	// abortCtx ends when in-flight work must be aborted (Drain's deadline,
	// Stop); every job watches it.
	abortCtx context.Context
	abort    context.CancelFunc

	// probes is the prefix of the reply subjects the service publishes its
	// stream messages with ("" when ClientGone is off), probeSub its
	// subscription to them (cancel.go).
	probes   string
	probeSub *nats.Subscription

	mu       sync.Mutex
	draining bool
	jobs     map[*job]struct{} // admitted and not finished: the queue
	byKey    map[uint64]*job   // the same jobs, by job.key
	lastKey  uint64
	wg       sync.WaitGroup // one per admitted job's goroutine
	idle     chan struct{}  // closed once draining and every job has ended
	stopped  chan struct{}  // closed when shutdown is complete

	stopOnce sync.Once
	stopErr  error
}

// NewService registers the micro service on nc and starts serving. nc
// stays the caller's: the service never closes it. log and reg may be nil.
func NewService(nc *nats.Conn, eng Engine, cfg Config, log *zap.Logger, reg prometheus.Registerer) (*Service, error) {
	asked := cfg.Limits
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if log == nil {
		log = zap.NewNop()
	}
	met, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	s := &Service{nc: nc, eng: eng, cfg: cfg, log: log.With(zap.String("model", cfg.Model), zap.String("worker", cfg.Worker)),
		met: met, jobs: map[*job]struct{}{}, byKey: map[uint64]*job{}, idle: make(chan struct{}), stopped: make(chan struct{})}
	s.abortCtx, s.abort = context.WithCancel(context.Background())
	s.warnClamped(asked)
	if cfg.ClientGone > 0 {
		if err := s.startProbes(); err != nil {
			s.abort()
			return nil, err
		}
	}
	svc, err := micro.AddService(nc, micro.Config{
		Name:        ServiceName,
		Version:     cfg.Release,
		Description: "RL rollouts: token-in/token-out generation with per-token logprobs and policy versions",
		Metadata:    map[string]string{"model": cfg.Model, "worker": cfg.Worker, "schema": Schema},
		QueueGroup:  cfg.QueueGroup,
		StatsHandler: func(e *micro.Endpoint) any {
			st := s.snapshot()
			return map[string]any{"queue_depth": st.depth, "running": st.running, "waiting_version": st.waiting, "draining": st.draining}
		},
		ErrorHandler: func(_ micro.Service, e *micro.NATSError) {
			s.log.Warn("nats service error", zap.String("subject", e.Subject), zap.String("error", e.Description))
		},
	})
	if err != nil {
		s.abort()
		return nil, errors.Join(fmt.Errorf("rollout: service: %w", err), s.stopProbes())
	}
	s.svc = svc
	g := svc.AddGroup("rollout." + cfg.Model)
	for _, ep := range []struct {
		name string
		h    micro.HandlerFunc
		opts []micro.EndpointOpt
	}{
		{"generate", s.handleGenerate, nil},
		{"score", s.handleScore, nil},
		{"status", s.handleStatus, nil},
		// Every worker must see a cancel: only the one holding the request
		// can abort it.
		{"cancel", s.handleCancel, []micro.EndpointOpt{micro.WithEndpointQueueGroupDisabled()}},
	} {
		opts := append([]micro.EndpointOpt{micro.WithEndpointMetadata(map[string]string{"schema": Schema})}, ep.opts...)
		if err := g.AddEndpoint(ep.name, ep.h, opts...); err != nil {
			s.abort()
			return nil, errors.Join(fmt.Errorf("rollout: service: endpoint %s: %w", ep.name, err), svc.Stop(), s.stopProbes())
		}
	}
	// The endpoints serve once the server has their subscriptions.
	if err := nc.FlushTimeout(5 * time.Second); err != nil {
		s.log.Warn("flush after subscribing failed: endpoints serve once the connection is back", zap.Error(err))
	}
	s.log.Info("rollout service started", zap.String("subject", Subject(cfg.Model, "*")), zap.String("queue_group", cfg.QueueGroup),
		zap.String("release", cfg.Release), zap.Any("limits", cfg.Limits))
	return s, nil
}

// Config returns the configuration with defaults filled in.
func (s *Service) Config() Config { return s.cfg }

// warnClamped logs the configured limits that were lowered to what the
// model can do.
func (s *Service) warnClamped(asked Limits) {
	got := s.cfg.Limits
	for _, l := range []struct {
		name       string
		asked, got int
	}{
		{"max_prompt_tokens", asked.MaxPromptTokens, got.MaxPromptTokens},
		{"max_tokens", asked.MaxTokens, got.MaxTokens},
		{"max_n", asked.MaxN, got.MaxN},
		{"max_waiting_version", asked.MaxWaitingVersion, got.MaxWaitingVersion},
	} {
		if l.asked > l.got {
			s.log.Warn("limit lowered to what the model can do", zap.String("limit", l.name), zap.Int("configured", l.asked),
				zap.Int("limit", l.got), zap.Int("context", s.cfg.Context), zap.Int("step_sequences", s.cfg.StepSeqs))
		}
	}
}

type snapshot struct {
	depth, running, waiting int
	draining                bool
}

func (s *Service) snapshot() snapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	snap := snapshot{depth: len(s.jobs), draining: s.draining}
	for j := range s.jobs {
		switch j.state {
		case stateRunning:
			snap.running++
		case stateWaiting:
			snap.waiting++
		}
	}
	return snap
}

// Job states, for status.
const (
	stateAdmitted = iota
	stateWaiting  // for its min_policy_version
	stateRunning  // in the engine
)

// Causes of a job's cancellation (context.Cause of job.ctx).
var (
	errCancelled  = errors.New("cancelled by the client")
	errClientGone = errors.New("client gone: no subscriber on the reply subject")
)

// job is one admitted request. Its goroutine owns it; the fields above mu
// are set before admission and then only read; mu guards the stream's
// state, which Drain's fallback (forceEnd) and the gone-client check may
// also touch.
type job struct {
	s        *Service
	op       string
	id       string
	reply    string
	received time.Time
	key      uint64 // names the job in its probe subjects; set by admit

	// ctx ends when the job must be aborted: the service's abort (drain
	// deadline, Stop), or cancel with errCancelled or errClientGone.
	ctx    context.Context
	cancel context.CancelCauseFunc

	p     generateParams // generate only
	state int            // guarded by s.mu

	mu        sync.Mutex
	submitted time.Time // to the engine
	done      bool      // the summary (or the error) went out: nothing more is sent
	sent      int       // sample messages
	sentIdx   []bool
	aborted   int
	failure   string // the first failed sample's error
	tokens    int
	last      time.Time // last message sent
	seq       uint64    // messages published: the last one's probe number
	quietSeq  uint64    // the probe number of the last no-responders status
	quietFrom time.Time // since when the reply subject has had no subscriber (zero: it has one)
}

// newJob makes the job of a request that arrived at received.
func (s *Service) newJob(op, id, reply string, received time.Time) *job {
	j := &job{s: s, op: op, id: id, reply: reply, received: received, last: received}
	j.ctx, j.cancel = context.WithCancelCause(s.abortCtx)
	return j
}

// admit reserves a place for a job, or says why there is none; waiting
// admits it as waiting for its min_policy_version, within that bound too.
// The job must be complete: from here Drain's fallback may see it.
func (s *Service) admit(j *job, waiting bool) *Error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.draining:
		return &Error{Op: j.op, ID: j.id, Code: 503, Reason: ReasonDraining, Msg: "worker draining: not admitting requests"}
	case len(s.jobs) >= s.cfg.Limits.MaxQueue:
		return &Error{Op: j.op, ID: j.id, Code: 503, Reason: ReasonOverloaded,
			Msg: fmt.Sprintf("overloaded: %d requests in flight, limit %d", len(s.jobs), s.cfg.Limits.MaxQueue)}
	}
	if waiting {
		n := 0
		for o := range s.jobs {
			if o.state == stateWaiting {
				n++
			}
		}
		if n >= s.cfg.Limits.MaxWaitingVersion {
			return &Error{Op: j.op, ID: j.id, Code: 503, Reason: ReasonOverloaded,
				Msg: fmt.Sprintf("overloaded: %d requests waiting for a policy version, limit max_waiting_version %d", n, s.cfg.Limits.MaxWaitingVersion)}
		}
		j.state = stateWaiting
	}
	s.lastKey++
	j.key = s.lastKey
	s.jobs[j] = struct{}{}
	s.byKey[j.key] = j
	s.wg.Add(1)
	s.met.queue.Set(float64(len(s.jobs)))
	return nil
}

// unqueue frees a job's place in the queue. It is idempotent; the job
// calls it just before its last message, so a client that sends its next
// request on seeing the summary finds the place free.
func (s *Service) unqueue(j *job) {
	s.mu.Lock()
	delete(s.jobs, j)
	delete(s.byKey, j.key)
	s.met.queue.Set(float64(len(s.jobs)))
	s.mu.Unlock()
}

// release ends a job: its goroutine calls it last.
func (s *Service) release(j *job) {
	s.unqueue(j)
	j.cancel(nil)
	s.wg.Done()
}

func (s *Service) setState(j *job, state int) {
	s.mu.Lock()
	j.state = state
	s.mu.Unlock()
}

// replyError answers a request from its handler (micro counts the error).
func (s *Service) replyError(req micro.Request, e *Error) {
	s.met.requests.WithLabelValues(e.Op, e.Reason).Inc()
	s.log.Debug("request refused", zap.String("op", e.Op), zap.String("id", e.ID), zap.Int("code", e.Code), zap.String("error", e.Msg))
	if err := req.Error(strconv.Itoa(e.Code), e.Msg, e.body(), micro.WithHeaders(micro.Headers{"Content-Type": {"application/json"}})); err != nil {
		s.log.Warn("error reply failed", zap.String("op", e.Op), zap.String("id", e.ID), zap.Error(err))
	}
}

// errorMsg is an error reply as a message, for a job's goroutine.
func errorMsg(reply string, e *Error) *nats.Msg {
	return &nats.Msg{Subject: reply, Data: e.body(), Header: nats.Header{
		micro.ErrorHeader: {e.Msg}, micro.ErrorCodeHeader: {strconv.Itoa(e.Code)}, "Content-Type": {"application/json"}}}
}

// noReply drops a request that has no reply subject: nothing can be sent.
func (s *Service) noReply(op string, req micro.Request) bool {
	if req.Reply() != "" {
		return false
	}
	s.met.requests.WithLabelValues(op, resultNoReply).Inc()
	s.log.Warn("request without a reply subject dropped", zap.String("op", op), zap.String("subject", req.Subject()))
	return true
}

// newID names a request that came without an id.
func (s *Service) newID() string { return newID() }

// newSeed draws a seed for a request that has none: 53 bits, so it survives
// any JSON parser (IEEE doubles) on its way back.
func newSeed() uint64 { return rand.Uint64() >> 11 }

// submitError classifies an error from Engine.Submit.
func submitError(id string, err error) *Error {
	if errors.Is(err, policy.ErrStopped) {
		return &Error{Op: "generate", ID: id, Code: 503, Reason: ReasonDraining, Msg: "engine stopped: worker shutting down"}
	}
	return &Error{Op: "generate", ID: id, Code: 400, Reason: ReasonBadRequest, Msg: err.Error()}
}

// handleGenerate runs on the generate subscription's goroutine: it
// validates, admits and starts the request's goroutine, and returns.
func (s *Service) handleGenerate(req micro.Request) {
	received := time.Now()
	if s.noReply("generate", req) {
		return
	}
	p, e := parseGenerate(req.Data(), s.cfg.Limits, s.cfg.Vocab, s.cfg.Context, s.newID, newSeed)
	if e != nil {
		s.replyError(req, e)
		return
	}
	j := s.newJob("generate", p.req.ID, req.Reply(), received)
	j.p, j.sentIdx = p, make([]bool, p.req.N)
	wait := p.minVersion > 0 && !s.versionReached(p.minVersion)
	if e := s.admit(j, wait); e != nil {
		j.cancel(nil)
		s.replyError(req, e)
		return
	}
	if !wait {
		// The common case: submit here, so engine-side refusals are answered
		// (and counted by micro) like any other bad request.
		h, err := s.eng.Submit(p.req)
		if err != nil {
			s.release(j)
			s.replyError(req, submitError(j.id, err))
			return
		}
		j.mu.Lock() // forceEnd may read it
		j.submitted = time.Now()
		j.mu.Unlock()
		s.setState(j, stateRunning)
		go j.stream(h)
		return
	}
	go j.waitAndStream()
}

// versionReached reports whether the served version is known, without
// waiting, to be at least v (only with Config.CurrentVersion).
func (s *Service) versionReached(v uint64) bool {
	return s.cfg.CurrentVersion != nil && s.cfg.CurrentVersion() >= v
}

// waitAndStream waits for the request's min_policy_version, then submits
// and streams.
func (j *job) waitAndStream() {
	s := j.s
	err := j.waitVersion()
	s.setState(j, stateAdmitted)
	if err != nil {
		var e *Error
		if errors.As(err, &e) {
			j.fail(e)
		} else { // aborted (drain deadline, stop, cancel, client gone): the samples end as the engine would end them
			j.abortAll(fmt.Sprintf("aborted while waiting for policy version %d: %v", j.p.minVersion, err))
		}
		s.release(j)
		return
	}
	h, err := s.eng.Submit(j.p.req)
	if err != nil {
		j.fail(submitError(j.id, err))
		s.release(j)
		return
	}
	j.mu.Lock() // forceEnd may read it
	j.submitted = time.Now()
	j.mu.Unlock()
	s.setState(j, stateRunning)
	j.stream(h)
}

// versionPoll is how often a min_policy_version wait reads the version.
const versionPoll = 10 * time.Millisecond

// waitVersion returns nil once the served version reaches the request's
// minimum, an *Error when it does not in time, or the abort's error.
func (j *job) waitVersion() error {
	s := j.s
	wait := s.cfg.MaxWaitVersion
	if j.p.maxWait > 0 {
		wait = min(wait, j.p.maxWait)
	}
	ctx, cancel := context.WithTimeout(j.ctx, wait)
	defer cancel()
	tick := time.NewTicker(versionPoll)
	defer tick.Stop()
	var hb <-chan time.Time
	if p := s.keepalive(); p > 0 {
		t := time.NewTicker(p)
		defer t.Stop()
		hb = t.C
	}
	var last uint64 // the last version read
	var verr error
	for {
		var v uint64
		v, verr = s.version(ctx)
		switch {
		case verr == nil && v >= j.p.minVersion:
			return nil
		case verr == nil:
			last = v
		case errors.Is(verr, policy.ErrStopped):
			return &Error{Op: "generate", ID: j.id, Code: 503, Reason: ReasonDraining, Msg: "engine stopped: worker shutting down"}
		}
		select {
		case <-tick.C:
		case <-hb:
			j.heartbeat()
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			if err := s.abortCtx.Err(); err != nil {
				return errors.New("worker draining")
			}
			if err := context.Cause(j.ctx); err != nil {
				return err
			}
			msg := fmt.Sprintf("policy version %d not reached within %v (serving %d)", j.p.minVersion, wait, last)
			if verr != nil && !errors.Is(verr, context.DeadlineExceeded) {
				msg = fmt.Sprintf("policy version %d not reached within %v (version unreadable: %v)", j.p.minVersion, wait, verr)
			}
			return &Error{Op: "generate", ID: j.id, Code: 503, Reason: ReasonVersionNotReached, Msg: msg}
		}
	}
}

// version returns the policy version being served.
func (s *Service) version(ctx context.Context) (uint64, error) {
	if s.cfg.CurrentVersion != nil {
		return s.cfg.CurrentVersion(), nil
	}
	var v uint64
	err := s.eng.AtBoundary(ctx, func() error {
		v = s.eng.Version()
		return nil
	})
	return v, err
}

// keepalive is the period of a quiet stream's heartbeats: Heartbeat, or
// shorter when the gone-client check needs a message to probe with (0:
// none).
func (s *Service) keepalive() time.Duration {
	p := s.cfg.Heartbeat
	if g := s.cfg.ClientGone; g > 0 && (p <= 0 || g/probesPerGone < p) {
		p = max(g/probesPerGone, time.Millisecond)
	}
	return max(p, 0)
}

// stream forwards the samples of h as they finish, then the summary. An
// abort (Drain's deadline, Stop, a cancel, a gone client) aborts h; the
// engine then ends the unfinished samples with "abort", and they are
// forwarded like the others.
func (j *job) stream(h *policy.Handle) {
	s := j.s
	defer s.release(j)
	abort := j.ctx.Done()
	var hb <-chan time.Time
	if p := s.keepalive(); p > 0 {
		t := time.NewTicker(p)
		defer t.Stop()
		hb = t.C
	}
	for {
		select {
		case smp, ok := <-h.Samples():
			if !ok {
				msg := ""
				if f := j.failureMsg(); f != "" {
					msg = f + "; the request's other samples were aborted"
				} else if j.abortedCount() > 0 {
					switch cause := context.Cause(j.ctx); {
					case s.abortCtx.Err() != nil:
						msg = "worker draining: unfinished samples aborted"
					case errors.Is(cause, errCancelled) || errors.Is(cause, errClientGone):
						msg = cause.Error() + ": unfinished samples aborted"
					default:
						msg = "engine stopped: unfinished samples aborted"
					}
				}
				j.finish(msg)
				return
			}
			j.sendSample(smp)
		case <-abort:
			h.Abort()
			abort = nil
		case <-hb:
			j.heartbeat()
		}
	}
}

func (j *job) failureMsg() string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.failure
}

func (j *job) abortedCount() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.aborted
}

// publish sends one message of the job's stream unless it has ended.
// Call with j.mu held.
func (j *job) publishLocked(m *nats.Msg) bool {
	if j.done {
		return false
	}
	seq := j.seq + 1
	if j.s.probes != "" {
		m.Reply = j.s.probeSubject(j.key, seq)
	}
	if err := j.s.nc.PublishMsg(m); err != nil {
		j.s.log.Warn("reply failed", zap.String("op", j.op), zap.String("id", j.id), zap.Error(err))
		return false
	}
	j.seq = seq
	j.last = time.Now()
	return true
}

func ms(d time.Duration) float64 { return math.Round(float64(d.Microseconds())) / 1e3 }

// sendSample forwards one finished sample. A message over the server's max
// payload drops the routed experts, then the logprobs, then the tokens,
// saying so in its warning, rather than vanish.
func (j *job) sendSample(smp policy.Sample) {
	s := j.s
	r := SampleReply{Type: TypeSample, ID: j.id, Index: smp.Index, Tokens: smp.Tokens, Versions: smp.Versions,
		FinishReason: string(smp.Finish), Seed: j.p.req.Params.Seed, TimeMS: ms(time.Since(j.received)), Error: smp.Err}
	if r.Tokens == nil {
		r.Tokens = []int32{}
	}
	if r.Versions == nil {
		r.Versions = []uint64{}
	}
	if j.p.logprobs {
		r.LogProbs = LogProbs(smp.LogProbs)
		if r.LogProbs == nil {
			r.LogProbs = LogProbs{}
		}
	}
	if j.p.routed {
		r.RoutedExperts = smp.Routed
		if r.RoutedExperts == nil {
			r.RoutedExperts = [][]int32{}
		}
	}
	limit := s.nc.MaxPayload()
	data, err := json.Marshal(r)
	for _, drop := range []struct {
		what string
		has  bool // the message carries it: only what is there is dropped
		f    func()
	}{
		{"routed_experts", r.RoutedExperts != nil, func() { r.RoutedExperts = nil }},
		{"logprobs", r.LogProbs != nil, func() { r.LogProbs = nil }},
		{"tokens and versions", true, func() { r.Tokens, r.Versions = []int32{}, []uint64{} }},
	} {
		if err != nil || limit <= 0 || int64(len(data)) <= limit-512 {
			break
		}
		if !drop.has {
			continue
		}
		r.Warning += fmt.Sprintf("%s omitted: the message of %d bytes exceeds the server's max payload of %d; ", drop.what, len(data), limit)
		drop.f()
		data, err = json.Marshal(r)
	}
	if err != nil {
		s.log.Error("sample encoding failed", zap.String("id", j.id), zap.Error(err))
		return
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if !j.publishLocked(&nats.Msg{Subject: j.reply, Data: data}) {
		return
	}
	j.sent++
	if smp.Index >= 0 && smp.Index < len(j.sentIdx) {
		j.sentIdx[smp.Index] = true
	}
	j.tokens += len(smp.Tokens)
	switch smp.Finish {
	case policy.FinishAbort:
		j.aborted++
	case policy.FinishError:
		if j.failure == "" {
			j.failure = smp.Err
		}
		s.log.Warn("sample failed", zap.String("id", j.id), zap.String("error", smp.Err))
	}
	s.met.samples.WithLabelValues(string(smp.Finish)).Inc()
	s.met.tokens.Add(float64(len(smp.Tokens)))
}

func (j *job) heartbeat() {
	j.mu.Lock()
	defer j.mu.Unlock()
	if time.Since(j.last) < j.s.keepalive()/2 {
		return
	}
	data, _ := json.Marshal(Heartbeat{Type: TypeHeartbeat, ID: j.id, ElapsedMS: ms(time.Since(j.received)), Samples: j.sent})
	j.publishLocked(&nats.Msg{Subject: j.reply, Data: data})
}

// finish sends the summary, once.
func (j *job) finish(errMsg string) {
	s := j.s
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.done {
		return
	}
	now := time.Now()
	queued := j.submitted
	if queued.IsZero() {
		queued = now
	}
	sum := Summary{Type: TypeSummary, ID: j.id, Samples: j.sent, Aborted: j.aborted, GeneratedTokens: j.tokens, Seed: j.p.req.Params.Seed,
		Worker: s.cfg.Worker, QueueMS: ms(queued.Sub(j.received)), TotalMS: ms(now.Sub(j.received)), Error: errMsg}
	data, _ := json.Marshal(sum)
	result := resultOK
	switch {
	case j.failure != "":
		result = resultFailed
	case j.aborted > 0 || j.sent < j.p.req.N:
		result = resultAborted
		switch cause := context.Cause(j.ctx); {
		case j.s.abortCtx.Err() != nil:
		case errors.Is(cause, errCancelled):
			result = resultCancelled
		case errors.Is(cause, errClientGone):
			result = resultClientGone
		}
	}
	s.met.requests.WithLabelValues(j.op, result).Inc()
	s.met.latencies.Observe(now.Sub(j.received).Seconds())
	s.unqueue(j)
	j.publishLocked(&nats.Msg{Subject: j.reply, Data: data})
	j.done = true
	s.log.Debug("request done", zap.String("id", j.id), zap.Int("samples", j.sent), zap.Int("aborted", j.aborted),
		zap.Int("tokens", j.tokens), zap.Duration("total", now.Sub(j.received)))
}

// abortAll ends a request that never reached the engine the way the engine
// ends one: n samples with finish_reason "abort", then the summary.
func (j *job) abortAll(why string) {
	for i := range j.p.req.N {
		j.sendSample(policy.Sample{Index: i, Finish: policy.FinishAbort})
	}
	j.finish(why)
}

// fail ends the job's stream with an error reply, once.
func (j *job) fail(e *Error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.done {
		return
	}
	j.s.met.requests.WithLabelValues(j.op, e.Reason).Inc()
	j.s.unqueue(j)
	j.publishLocked(errorMsg(j.reply, e))
	j.done = true
	j.s.log.Debug("request failed", zap.String("op", j.op), zap.String("id", j.id), zap.Int("code", e.Code), zap.String("error", e.Msg))
}

// forceEnd ends a job whose goroutine is still waiting on the engine after
// the abort grace: the samples not sent yet go out as aborted, then the
// summary; whatever the engine returns later is dropped.
func (j *job) forceEnd() {
	if j.op == "generate" {
		j.mu.Lock()
		var missing []int
		for i, sent := range j.sentIdx {
			if !sent {
				missing = append(missing, i)
			}
		}
		j.mu.Unlock()
		for _, i := range missing {
			j.sendSample(policy.Sample{Index: i, Finish: policy.FinishAbort})
		}
		j.finish(fmt.Sprintf("worker stopped: %d samples not returned by the engine in time, sent as aborted", len(missing)))
		return
	}
	j.fail(&Error{Op: j.op, ID: j.id, Code: 503, Reason: ReasonDraining, Msg: "worker stopped before the request finished"})
}

// handleScore validates and admits a score request and runs it on its own
// goroutine (the engine scores between generation steps).
func (s *Service) handleScore(req micro.Request) {
	received := time.Now()
	if s.noReply("score", req) {
		return
	}
	id, seqs, e := parseScore(req.Data(), s.cfg.Limits, s.cfg.Vocab, s.cfg.Context, s.newID)
	if e != nil {
		s.replyError(req, e)
		return
	}
	j := s.newJob("score", id, req.Reply(), received)
	if e := s.admit(j, false); e != nil {
		j.cancel(nil)
		s.replyError(req, e)
		return
	}
	go j.score(seqs)
}

func (j *job) score(seqs [][]int32) {
	s := j.s
	defer s.release(j)
	lps, err := s.eng.Score(s.abortCtx, seqs)
	if err != nil {
		e := &Error{Op: "score", ID: j.id, Code: 500, Reason: ReasonInternal, Msg: err.Error()}
		switch {
		case s.abortCtx.Err() != nil || errors.Is(err, policy.ErrStopped):
			e.Code, e.Reason, e.Msg = 503, ReasonDraining, "worker draining: score aborted"
		case errors.Is(err, policy.ErrTooLarge):
			e.Code, e.Reason = 400, ReasonBadRequest
		}
		j.fail(e)
		return
	}
	out := ScoreReply{Type: TypeScore, ID: j.id, Worker: s.cfg.Worker, LogProbs: make([]LogProbs, len(lps))}
	for i, l := range lps {
		row := make(LogProbs, 1, len(l)+1)
		row[0] = float32(math.NaN()) // the first token has no context: null
		out.LogProbs[i] = append(row, l...)
	}
	data, err := json.Marshal(out)
	if err != nil {
		j.fail(&Error{Op: "score", ID: j.id, Code: 500, Reason: ReasonInternal, Msg: err.Error()})
		return
	}
	if limit := s.nc.MaxPayload(); limit > 0 && int64(len(data)) > limit {
		j.fail(badRequest("score", j.id, "sequences: the reply of %d bytes exceeds the server's max payload of %d; send fewer tokens per request", len(data), limit))
		return
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.done {
		return
	}
	s.met.requests.WithLabelValues("score", resultOK).Inc()
	s.unqueue(j)
	j.publishLocked(&nats.Msg{Subject: j.reply, Data: data})
	j.done = true
}

// statusTimeout bounds the version read of a status request.
const statusTimeout = 2 * time.Second

// handleStatus answers on the status subscription's goroutine.
func (s *Service) handleStatus(req micro.Request) {
	if s.noReply("status", req) {
		return
	}
	if e := parseStatus(req.Data()); e != nil {
		s.replyError(req, e)
		return
	}
	s.met.requests.WithLabelValues("status", resultOK).Inc()
	if err := req.RespondJSON(s.Status()); err != nil {
		s.log.Warn("status reply failed", zap.Error(err))
	}
}

// Status describes the worker now (what the status endpoint answers).
func (s *Service) Status() StatusReply {
	snap := s.snapshot()
	es := s.eng.Stats()
	st := StatusReply{Type: TypeStatus, Schema: Schema, Release: s.cfg.Release, Model: s.cfg.Model, Worker: s.cfg.Worker,
		QueueDepth: snap.depth, MaxQueue: s.cfg.Limits.MaxQueue, Running: snap.running, WaitingVersion: snap.waiting, Draining: snap.draining,
		KVPagesInUse: es.KVPagesUsed, KVPages: s.cfg.KVPages, Recipe: s.cfg.Recipe, Context: s.cfg.Context, Limits: s.cfg.Limits,
		Steps: es.Steps, Generated: es.Generated}
	ctx, cancel := context.WithTimeout(context.Background(), statusTimeout)
	defer cancel()
	if v, err := s.version(ctx); err != nil {
		st.VersionError = err.Error()
	} else {
		st.Version = &v
	}
	return st
}

// beginDrain stops admitting; the first call starts the watcher that
// closes s.idle once every admitted job has ended.
func (s *Service) beginDrain() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.draining {
		return
	}
	s.draining = true
	// No wg.Add can follow: admit checks draining under s.mu.
	go func() {
		s.wg.Wait()
		close(s.idle)
	}()
}

// Drain stops admitting (new requests get 503 "draining"), lets in-flight
// requests finish until ctx ends, then aborts the rest: their unfinished
// samples come back with finish_reason "abort". Every admitted request gets
// its summary (or its error reply). Then it flushes the connection and
// stops the micro service. Drain and Stop may be called more than once and
// concurrently; the first to reach the end does it, the others wait.
func (s *Service) Drain(ctx context.Context) error {
	s.beginDrain()
	n := s.snapshot().depth
	s.log.Info("draining", zap.Int("in_flight", n))
	select {
	case <-s.idle:
	case <-s.stopped: // a concurrent Stop finished
	case <-ctx.Done():
		s.log.Info("drain deadline: aborting in-flight requests", zap.Int("in_flight", s.snapshot().depth))
		s.abort()
	}
	return s.shutdown()
}

// Stop aborts every in-flight request at once (Drain with an expired
// deadline). It is idempotent.
func (s *Service) Stop() error {
	s.beginDrain()
	s.abort()
	return s.shutdown()
}

// shutdown waits (up to AbortGrace) for the jobs, ends any left with their
// summary, flushes and stops the micro service, once.
func (s *Service) shutdown() error {
	s.stopOnce.Do(func() {
		select {
		case <-s.idle:
		case <-time.After(s.cfg.AbortGrace):
			s.mu.Lock()
			left := make([]*job, 0, len(s.jobs))
			for j := range s.jobs {
				left = append(left, j)
			}
			s.mu.Unlock()
			s.log.Warn("engine did not end aborted requests in time: sending their summaries", zap.Int("requests", len(left)),
				zap.Duration("grace", s.cfg.AbortGrace))
			for _, j := range left {
				j.forceEnd()
			}
		}
		s.abort()
		var errs []error
		if !s.nc.IsClosed() {
			if err := s.nc.FlushTimeout(5 * time.Second); err != nil {
				errs = append(errs, fmt.Errorf("rollout: stop: flush: %w", err))
			}
		}
		if err := s.svc.Stop(); err != nil {
			errs = append(errs, fmt.Errorf("rollout: stop: micro service: %w", err))
		}
		if err := s.stopProbes(); err != nil {
			errs = append(errs, err)
		}
		s.stopErr = errors.Join(errs...)
		close(s.stopped)
		s.log.Info("rollout service stopped")
	})
	return s.stopErr
}
