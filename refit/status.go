package refit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
)

// StatusCollector gathers the workers' statuses for one version from the
// model's status subject. Statuses are core NATS messages, not stored: a
// collector sees only those sent after it was made, so make it before
// publishing the version.
type StatusCollector struct {
	version uint64
	sub     *nats.Subscription
	log     *zap.Logger

	mu     sync.Mutex
	got    map[string]Status // by worker; a later status replaces an earlier one
	notify chan struct{}     // one pending wake-up for Wait
}

// Statuses subscribes to the model's status subject and collects the
// statuses for version until Close. It returns once the server has the
// subscription (waiting at most PublishTimeout for it).
func (p *Publisher) Statuses(ctx context.Context, version uint64) (*StatusCollector, error) {
	c := &StatusCollector{version: version, log: p.log.With(zap.Uint64("version", version)),
		got: map[string]Status{}, notify: make(chan struct{}, 1)}
	sub, err := p.nc.Subscribe(StatusSubject(p.cfg.Model), c.handle)
	if err != nil {
		return nil, fmt.Errorf("refit: statuses of version %d: subscribe: %w", version, err)
	}
	fctx, cancel := context.WithTimeout(ctx, p.cfg.PublishTimeout) // a flush needs a deadline
	defer cancel()
	if err := p.nc.FlushWithContext(fctx); err != nil {
		sub.Unsubscribe()
		return nil, fmt.Errorf("refit: statuses of version %d: subscribe: %w", version, err)
	}
	c.sub = sub
	return c, nil
}

// WaitStatuses collects k statuses for version, as StatusCollector.Wait,
// from a collector made now: it sees only statuses sent after the call.
// To wait for a version about to be published, use Statuses before Publish.
func (p *Publisher) WaitStatuses(ctx context.Context, version uint64, k int) ([]Status, error) {
	c, err := p.Statuses(ctx, version)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	return c.Wait(ctx, k)
}

// handle runs on the subscription's goroutine.
func (c *StatusCollector) handle(msg *nats.Msg) {
	s, err := ParseStatus(msg.Data)
	if err == nil && s.Worker == "" {
		err = fmt.Errorf("%w: status without a worker", ErrProtocol)
	}
	if err != nil {
		c.log.Warn("refit: ignoring a malformed status", zap.Error(err))
		return
	}
	if s.Version != c.version {
		return
	}
	c.mu.Lock()
	c.got[s.Worker] = s
	c.mu.Unlock()
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

// Collected returns the statuses collected so far, by worker id.
func (c *StatusCollector) Collected() []Status {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]Status, 0, len(c.got))
	for _, w := range slices.Sorted(maps.Keys(c.got)) {
		out = append(out, c.got[w])
	}
	return out
}

// Wait returns the statuses of the first k workers to report on the
// version (one per worker id, the latest if a worker reported twice; more
// than k if more reported meanwhile), sorted by worker id. When ctx ends
// first it returns what it has and an error naming who answered.
func (c *StatusCollector) Wait(ctx context.Context, k int) ([]Status, error) {
	for {
		got := c.Collected()
		if len(got) >= k {
			return got, nil
		}
		select {
		case <-c.notify:
		case <-ctx.Done():
			got = c.Collected()
			if len(got) >= k {
				return got, nil
			}
			who := make([]string, len(got))
			for i, s := range got {
				who[i] = s.Worker + " " + s.State
			}
			answered := "none"
			if len(who) > 0 {
				answered = strings.Join(who, ", ")
			}
			return got, fmt.Errorf("refit: statuses of version %d: %d of %d workers answered (%s): %w",
				c.version, len(got), k, answered, ctx.Err())
		}
	}
}

// Close unsubscribes. It is idempotent.
func (c *StatusCollector) Close() error {
	if err := c.sub.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrBadSubscription) && !errors.Is(err, nats.ErrConnectionClosed) {
		return fmt.Errorf("refit: statuses of version %d: unsubscribe: %w", c.version, err)
	}
	return nil
}

// phaseOrder is the order FormatStatuses prints the phases in; others
// follow by name.
var phaseOrder = []string{"receive", "copy", "requantize", "commit"}

// FormatStatuses writes a report of statuses: per worker its state, the
// phase totals, where its chunks came from and a table of per-layer
// receive, copy and requantize times in milliseconds, with a row of their
// sums.
func FormatStatuses(w io.Writer, statuses []Status) error {
	var b strings.Builder
	for i, s := range statuses {
		if i > 0 {
			b.WriteByte('\n')
		}
		fmt.Fprintf(&b, "worker %s: %s version %d (serving %d), %d bytes\n", s.Worker, s.State, s.Version, s.CurrentVersion, s.Bytes)
		if s.Reason != "" {
			fmt.Fprintf(&b, "  reason: %s\n", s.Reason)
		}
		if len(s.PhasesMS) > 0 {
			names := slices.Clone(phaseOrder)
			for _, n := range slices.Sorted(maps.Keys(s.PhasesMS)) {
				if !slices.Contains(phaseOrder, n) {
					names = append(names, n)
				}
			}
			var parts []string
			for _, n := range names {
				if v, ok := s.PhasesMS[n]; ok {
					parts = append(parts, fmt.Sprintf("%s %.1f ms", n, v))
				}
			}
			fmt.Fprintf(&b, "  phases: %s\n", strings.Join(parts, ", "))
		}
		if c := s.Chunks; c != nil {
			fmt.Fprintf(&b, "  chunks: %d live, %d from the streams\n", c.Live, c.Stream)
		}
		if len(s.Layers) == 0 {
			continue
		}
		tw := tabwriter.NewWriter(&b, 0, 8, 2, ' ', tabwriter.AlignRight)
		fmt.Fprint(tw, "  layer\treceive ms\tcopy ms\trequantize ms\t\n")
		var rx, cp, rq float64
		for _, l := range s.Layers {
			fmt.Fprintf(tw, "  %d\t%.1f\t%.1f\t%.1f\t\n", l.Layer, l.ReceiveMS, l.CopyMS, l.RequantizeMS)
			rx, cp, rq = rx+l.ReceiveMS, cp+l.CopyMS, rq+l.RequantizeMS
		}
		fmt.Fprintf(tw, "  sum\t%.1f\t%.1f\t%.1f\t\n", rx, cp, rq)
		tw.Flush()
	}
	_, err := io.WriteString(w, b.String())
	return err
}
