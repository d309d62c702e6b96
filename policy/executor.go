package policy

import (
	"errors"
	"fmt"

	"github.com/rollout-worker/rollout-worker/policy/sched"
)

// Executor runs the steps the scheduler plans on a model. Launch starts a
// step: it does the plan's page copies, stages every per-step input in one
// upload, and runs the forward pass and sampling (replayed from a captured
// graph when the step is decode-only and a graph runner is set, eager
// otherwise). Wait returns the oldest launched step's results: its tokens
// and logprobs, the routed experts when some owner asked, or its error,
// device errors included. Up to two steps may be launched before the first
// is waited for, in which case the second may take its decode inputs from
// the first's sampled tokens on the device (Plan.Feed).
//
// A step's results are only valid until the next Wait.
type Executor interface {
	Launch(p *sched.Plan) error
	Wait() (*sched.Results, error)
}

// modelExecutor runs steps on a Model synchronously: Launch runs the whole
// step, Wait hands over what it produced. On a backend whose ops complete
// as they are issued (the CPU) nothing would overlap anyway; on a device it
// is the executor that waits for every step before planning the next.
type modelExecutor struct {
	m      *Model
	graphs StepRunner
	slots  [2]execSlot
	first  int    // the slot of the oldest launched step
	queued int    // steps launched and not yet waited for
	raw    []byte // download scratch
}

// execSlot holds one launched step's results, in buffers allocated once.
type execSlot struct {
	res     sched.Results
	tokens  []int32
	lps     []float32
	routing [][]int32 // [layer][MaxTokens*k]
	err     error
}

func newModelExecutor(m *Model, graphs StepRunner) *modelExecutor {
	o := m.opts
	x := &modelExecutor{m: m, graphs: graphs, raw: make([]byte, 4*max(o.MaxLogitRows, o.MaxTokens*m.cfg.TopK))}
	for i := range x.slots {
		sl := &x.slots[i]
		sl.tokens, sl.lps = make([]int32, o.MaxLogitRows), make([]float32, o.MaxLogitRows)
		sl.routing = make([][]int32, len(m.layers))
	}
	return x
}

func (x *modelExecutor) Launch(p *sched.Plan) error {
	if x.queued == len(x.slots) {
		return errors.New("policy: executor: two steps are already launched")
	}
	sl := &x.slots[(x.first+x.queued)%len(x.slots)]
	x.queued++
	sl.err = x.run(p, sl)
	return nil
}

func (x *modelExecutor) Wait() (*sched.Results, error) {
	if x.queued == 0 {
		return nil, errors.New("policy: executor: no step launched")
	}
	sl := &x.slots[x.first]
	x.first = (x.first + 1) % len(x.slots)
	x.queued--
	if sl.err != nil {
		return nil, sl.err
	}
	return &sl.res, nil
}

// run runs one step and reads its results back.
func (x *modelExecutor) run(p *sched.Plan, sl *execSlot) error {
	m := x.m
	for _, c := range p.Copies {
		if err := m.CopyPage(c.Dst, c.Src); err != nil {
			return err
		}
	}
	T, L := len(p.Tokens), len(p.LogitRows)
	padded, graph := T, false
	if p.DecodeOnly && x.graphs != nil {
		if b, err := x.graphs.Pad(T); err == nil { // else larger than the largest bucket: run it eagerly
			padded, graph = b, true
		}
	}
	sh, err := m.stagePlan(p, padded)
	if err != nil {
		return err
	}
	if p.Fed {
		if err := m.feed(sh.T); err != nil {
			return err
		}
	}
	if graph {
		err = x.graphs.Run(padded)
	} else {
		err = m.Forward(sh, true)
	}
	if err != nil {
		return err
	}
	// Index errors a device kernel recorded are reported now, for this step.
	if err := m.be.Sync(); err != nil {
		return fmt.Errorf("policy: step %d: %w", p.Step, err)
	}
	sl.res = sched.Results{Tokens: sl.tokens[:L], LogProbs: sl.lps[:L], Graph: graph}
	if L > 0 {
		if err := m.samplesInto(sl.res.Tokens, sl.res.LogProbs, x.raw[:4*L]); err != nil {
			return err
		}
	}
	if p.Routing {
		n := T * m.cfg.TopK
		for i := range sl.routing {
			if cap(sl.routing[i]) < n {
				sl.routing[i] = make([]int32, m.opts.MaxTokens*m.cfg.TopK)
			}
			sl.routing[i] = sl.routing[i][:n]
		}
		if err := m.routingInto(sl.routing, x.raw[:4*n]); err != nil {
			return err
		}
		sl.res.Routing = sl.routing
	}
	return nil
}
