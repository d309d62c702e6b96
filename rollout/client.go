package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// Client sends requests to a model's workers (any worker of the queue
// group answers each request). It is safe for concurrent use; set its
// fields before the first call.
type Client struct {
	nc    *nats.Conn
	model string
	// IdleTimeout fails a generate stream with ErrTimeout when nothing
	// (sample, heartbeat, summary) arrives for this long (default 30 s;
	// workers send a heartbeat every 5 s by default).
	IdleTimeout time.Duration
	// RequestTimeout bounds Score and Status when their context has no
	// deadline (default 30 s).
	RequestTimeout time.Duration
}

// NewClient returns a client of the workers serving model. nc stays the
// caller's.
func NewClient(nc *nats.Conn, model string) *Client {
	return &Client{nc: nc, model: model, IdleTimeout: 30 * time.Second, RequestTimeout: 30 * time.Second}
}

// Stream is one generate request's replies. Next and Summary are for one
// goroutine; Close may be called from any.
type Stream struct {
	c        *Client
	ctx      context.Context // Generate's: the request's lifetime
	id       string
	inbox    string // the request's reply subject
	sub      *nats.Subscription
	summary  *Summary
	err      error       // terminal: io.EOF after the summary
	ended    atomic.Bool // the summary or an error reply came: no worker holds the request
	once     sync.Once
	closeErr error
	unwatch  func() bool // stops the watch of Generate's ctx
}

// Generate sends req and returns the stream of its replies. An empty
// Schema is set to "rollout.v1", an empty ID to a random one; when req
// waits for a policy version without its own bound, ctx's deadline bounds
// the wait on the worker too. The request lives as long as ctx: when ctx
// ends before the stream does, the stream is closed, which cancels the
// request on the worker. The stream must be read to its end or closed.
func (c *Client) Generate(ctx context.Context, req GenerateRequest) (*Stream, error) {
	if req.Schema == "" {
		req.Schema = Schema
	}
	if req.ID == "" {
		req.ID = newID()
	}
	if dl, ok := ctx.Deadline(); ok && req.MinPolicyVersion > 0 && req.MaxWaitMS == 0 {
		req.MaxWaitMS = max(1, time.Until(dl).Milliseconds())
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("rollout: generate %q: %w", req.ID, err)
	}
	data, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("rollout: generate %q: %w", req.ID, err)
	}
	inbox := c.nc.NewInbox()
	sub, err := c.nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("rollout: generate %q: subscribe: %w", req.ID, err)
	}
	if err := c.nc.PublishMsg(&nats.Msg{Subject: Subject(c.model, "generate"), Reply: inbox, Data: data}); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("rollout: generate %q: publish: %w", req.ID, err)
	}
	st := &Stream{c: c, ctx: ctx, id: req.ID, inbox: inbox, sub: sub}
	st.unwatch = context.AfterFunc(ctx, func() { _ = st.Close() })
	return st, nil
}

// ID is the request's id.
func (s *Stream) ID() string { return s.id }

// Next returns the next sample, in the order they finish. After the last
// it returns io.EOF, and Summary holds the summary. An error reply is
// returned as an *Error (errors.Is: ErrBadRequest, ErrOverloaded,
// ErrDraining, ErrVersionNotReached, ErrInternal); no worker at all as
// nats.ErrNoResponders; silence for IdleTimeout as ErrTimeout. These end
// the stream: Next returns the same error again. ctx's own end does not.
func (s *Stream) Next(ctx context.Context) (SampleReply, error) {
	if s.err != nil {
		return SampleReply{}, s.err
	}
	idle := s.c.IdleTimeout
	if idle <= 0 {
		idle = 30 * time.Second
	}
	for {
		mctx, cancel := context.WithTimeout(ctx, idle)
		msg, err := s.sub.NextMsgWithContext(mctx)
		cancel()
		if err != nil {
			if cerr := ctx.Err(); cerr != nil {
				return SampleReply{}, fmt.Errorf("rollout: generate %q: %w", s.id, cerr)
			}
			if cerr := s.ctx.Err(); cerr != nil { // the request's context ended: Close cancelled it
				return SampleReply{}, s.end(fmt.Errorf("rollout: generate %q: cancelled: %w", s.id, cerr))
			}
			if errors.Is(err, context.DeadlineExceeded) {
				err = fmt.Errorf("rollout: generate %q: nothing for %v: %w", s.id, idle, ErrTimeout)
			} else {
				err = fmt.Errorf("rollout: generate %q: %w", s.id, err)
			}
			return SampleReply{}, s.end(err)
		}
		if err := s.c.replyError(msg, "generate", s.id); err != nil {
			s.ended.Store(true) // refused, or no worker at all: nothing to cancel
			return SampleReply{}, s.end(err)
		}
		var head struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal(msg.Data, &head); err != nil {
			return SampleReply{}, s.end(fmt.Errorf("rollout: generate %q: malformed reply: %w", s.id, err))
		}
		switch head.Type {
		case TypeSample:
			var r SampleReply
			if err := json.Unmarshal(msg.Data, &r); err != nil {
				return SampleReply{}, s.end(fmt.Errorf("rollout: generate %q: malformed sample: %w", s.id, err))
			}
			return r, nil
		case TypeSummary:
			var sum Summary
			if err := json.Unmarshal(msg.Data, &sum); err != nil {
				return SampleReply{}, s.end(fmt.Errorf("rollout: generate %q: malformed summary: %w", s.id, err))
			}
			s.summary = &sum
			s.ended.Store(true)
			return SampleReply{}, s.end(io.EOF)
		default: // heartbeat, or a type this client does not know
		}
	}
}

// end makes err the stream's terminal error and unsubscribes.
func (s *Stream) end(err error) error {
	s.err = err
	_ = s.Close()
	return err
}

// Summary returns the summary once Next has returned io.EOF.
func (s *Stream) Summary() (Summary, bool) {
	if s.summary == nil {
		return Summary{}, false
	}
	return *s.summary, true
}

// Close stops receiving the stream's replies. Unless the stream has ended
// (its summary or an error reply arrived), it first publishes a cancel of
// the request (SCHEMA.md): the worker aborts its unfinished samples. A
// cancel that is lost is made up for by the worker's own check: a request
// whose reply subject nobody subscribes to is aborted within seconds. It
// is idempotent and safe from any goroutine.
func (s *Stream) Close() error {
	s.once.Do(func() {
		if s.unwatch != nil {
			s.unwatch()
		}
		var errs []error
		if !s.ended.Load() {
			if err := s.c.cancel(s.id, s.inbox); err != nil {
				errs = append(errs, err)
			}
		}
		if err := s.sub.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) && !errors.Is(err, nats.ErrBadSubscription) {
			errs = append(errs, fmt.Errorf("rollout: generate %q: unsubscribe: %w", s.id, err))
		}
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// cancel publishes the cancel of the generate request with id and reply
// subject inbox to every worker of the model, without waiting for an
// answer.
func (c *Client) cancel(id, inbox string) error {
	data, err := json.Marshal(CancelRequest{Schema: Schema, ID: id, Inbox: inbox})
	if err != nil {
		return fmt.Errorf("rollout: cancel %q: %w", id, err)
	}
	if err := c.nc.Publish(Subject(c.model, "cancel"), data); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		return fmt.Errorf("rollout: cancel %q: publish: %w", id, err)
	}
	return nil
}

// GenerateAll sends req and collects its samples, ordered by index, and
// its summary. On error it returns what arrived before it.
func (c *Client) GenerateAll(ctx context.Context, req GenerateRequest) ([]SampleReply, Summary, error) {
	st, err := c.Generate(ctx, req)
	if err != nil {
		return nil, Summary{}, err
	}
	defer st.Close()
	var out []SampleReply
	for {
		r, err := st.Next(ctx)
		if err == io.EOF {
			break
		}
		if err != nil {
			return out, Summary{}, err
		}
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b SampleReply) int { return a.Index - b.Index })
	sum, _ := st.Summary()
	return out, sum, nil
}

// Score returns, for each sequence, one logprob per token: log p(token_i
// | tokens before i) at temperature 1, and NaN for the first token.
func (c *Client) Score(ctx context.Context, seqs [][]int32) ([][]float32, error) {
	id := newID()
	data, err := json.Marshal(ScoreRequest{Schema: Schema, ID: id, Sequences: seqs})
	if err != nil {
		return nil, fmt.Errorf("rollout: score: %w", err)
	}
	var r ScoreReply
	if err := c.request(ctx, "score", id, data, &r); err != nil {
		return nil, err
	}
	if len(r.LogProbs) != len(seqs) {
		return nil, fmt.Errorf("rollout: score %q: %d rows for %d sequences", id, len(r.LogProbs), len(seqs))
	}
	out := make([][]float32, len(r.LogProbs))
	for i, l := range r.LogProbs {
		out[i] = l
	}
	return out, nil
}

// Status asks one worker of the queue group for its status (the $SRV.STATS
// control subject reaches every worker).
func (c *Client) Status(ctx context.Context) (StatusReply, error) {
	data, _ := json.Marshal(StatusRequest{Schema: Schema})
	var r StatusReply
	err := c.request(ctx, "status", "", data, &r)
	return r, err
}

func (c *Client) request(ctx context.Context, op, id string, data []byte, out any) error {
	if _, ok := ctx.Deadline(); !ok {
		t := c.RequestTimeout
		if t <= 0 {
			t = 30 * time.Second
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, t)
		defer cancel()
	}
	msg, err := c.nc.RequestMsgWithContext(ctx, &nats.Msg{Subject: Subject(c.model, op), Data: data})
	if err != nil {
		return fmt.Errorf("rollout: %s %s: %w", op, Subject(c.model, op), err)
	}
	if err := c.replyError(msg, op, id); err != nil {
		return err
	}
	if err := json.Unmarshal(msg.Data, out); err != nil {
		return fmt.Errorf("rollout: %s: malformed reply: %w", op, err)
	}
	return nil
}

// replyError returns the error a reply carries: a micro error reply as an
// *Error, a no-responders status as nats.ErrNoResponders.
func (c *Client) replyError(msg *nats.Msg, op, id string) error {
	if len(msg.Data) == 0 && msg.Header.Get("Status") == "503" {
		return fmt.Errorf("rollout: %s %q: no worker serves %s: %w", op, id, Subject(c.model, op), nats.ErrNoResponders)
	}
	code := msg.Header.Get(micro.ErrorCodeHeader)
	if code == "" {
		return nil
	}
	e := &Error{Op: op, ID: id, Reason: ReasonInternal, Msg: msg.Header.Get(micro.ErrorHeader)}
	e.Code, _ = strconv.Atoi(code)
	var body ErrorReply
	if json.Unmarshal(msg.Data, &body) == nil && body.Type == TypeError {
		if body.ID != "" {
			e.ID = body.ID
		}
		if body.Reason != "" {
			e.Reason = body.Reason
		}
		if body.Error != "" {
			e.Msg = body.Error
		}
	} else {
		switch e.Code {
		case 400:
			e.Reason = ReasonBadRequest
		case 503:
			e.Reason = ReasonOverloaded
		}
	}
	return e
}
