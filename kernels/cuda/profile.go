package cuda

import (
	"errors"
	"fmt"
	"time"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// profile marks points of the compute stream with events. Each Mark creates
// an event and records it (as an event record node when capturing), so a
// captured graph carries its marks and every launch re-records them.
type profile struct {
	be     *Backend
	events []*drv.Event
	groups []string // groups[i]: the ops from events[i] to events[i+1]
	closed bool
}

// NewProfile returns an empty profile on the backend's compute stream.
func (be *Backend) NewProfile() (kernels.Profile, error) { return &profile{be: be}, nil }

func (p *profile) Mark(group string) error {
	if p.closed {
		return errors.New("cuda: profile: closed")
	}
	return p.be.dev.Do(func(c *drv.Ctx) error {
		ev, err := c.NewEvent()
		if err != nil {
			return fmt.Errorf("cuda: profile: %w", err)
		}
		// Inside a capture the record becomes a graph node (external, so
		// the graph records it); outside, the driver refuses that flag.
		record := ev.Record
		if p.be.cap != nil {
			record = ev.RecordExternal
		}
		if err := record(p.be.stream); err != nil {
			return errors.Join(fmt.Errorf("cuda: profile: %w", err), ev.Destroy())
		}
		p.events = append(p.events, ev)
		p.groups = append(p.groups, group)
		return nil
	})
}

func (p *profile) Groups() (map[string]time.Duration, error) {
	out := map[string]time.Duration{}
	err := p.be.dev.Do(func(c *drv.Ctx) error {
		for i := 1; i < len(p.events); i++ {
			d, err := c.Elapsed(p.events[i-1], p.events[i])
			if err != nil {
				return fmt.Errorf("cuda: profile: %s: %w", p.groups[i-1], err)
			}
			out[p.groups[i-1]] += d
		}
		return nil
	})
	return out, err
}

func (p *profile) Close() error {
	if p.closed {
		return nil
	}
	p.closed = true
	return p.be.dev.Do(func(*drv.Ctx) error {
		var errs []error
		for _, ev := range p.events {
			errs = append(errs, ev.Destroy())
		}
		p.events = nil
		return errors.Join(errs...)
	})
}
