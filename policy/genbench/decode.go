package genbench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

// The ceiling the decode floor is computed against: the device copy
// bandwidth measured on an H200 (bytes read plus written per second).
const H200Bandwidth = 4.3e12

// DecodeConfig is a sweep of decode steps over batch sizes and contexts.
type DecodeConfig struct {
	Batches  []int // sequences decoding together
	Contexts []int // tokens each sequence already holds in the KV cache
	Warmup   int   // untimed steps before each point
	Steps    int   // timed steps per point
	Seed     uint64
}

// DecodePoint is one (batch, context) of a sweep on one model.
type DecodePoint struct {
	Recipe  moe.Recipe
	Batch   int
	Context int
	// Step is the mean wall-clock time of a decode step as the engine runs
	// it: stage the inputs, replay the step's graph (forward and sampling),
	// download the sampled tokens and logprobs.
	Step time.Duration
	// Device is the mean device time of the step's graph alone, measured by
	// events around back-to-back replays (0 where the backend cannot time).
	Device time.Duration
	// Floor is what the step cannot beat: the bytes it must read (weights it
	// touches and the KV cache) at the device's copy bandwidth.
	Floor      time.Duration
	FloorBytes float64
	// Groups is the device time of each group of ops of the step (see
	// policy.Model.SetMarker), from a copy of the step's graph with a mark
	// at every group (nil where the backend cannot profile).
	Groups map[string]time.Duration
}

// GroupOrder lists the groups of a step's breakdown in the order a forward
// pass runs them.
func GroupOrder() []string {
	return []string{"embed", "norms", "projections", "attention", "router", "experts", "lm_head", "sampling"}
}

// TokensPerSecond is the batch's generated tokens per second of steps.
func (p DecodePoint) TokensPerSecond() float64 { return float64(p.Batch) / p.Step.Seconds() }

// VsFloor is the step time over its floor.
func (p DecodePoint) VsFloor() float64 { return p.Step.Seconds() / p.Floor.Seconds() }

// Idle is the fraction of a step the device spends waiting for the host:
// 1 - device time / step time (0 where the device time is unknown).
func (p DecodePoint) Idle() float64 {
	if p.Device <= 0 {
		return 0
	}
	return max(0, 1-p.Device.Seconds()/p.Step.Seconds())
}

// DecodeFloor is the floor of one decode step of batch sequences at context
// tokens each on a model of cfg under recipe: every weight the step reads
// (attention and router projections of every layer, the experts the batch
// is expected to touch, in NVFP4 or BF16, and the LM head) plus the KV
// cache it reads, at the H200's copy bandwidth. Experts touched for uniform
// top-k routing: E (1 - (1 - k/E)^batch).
func DecodeFloor(cfg policy.Config, recipe moe.Recipe, batch, context int) (bytes float64, floor time.Duration) {
	H, D := float64(cfg.Hidden), float64(cfg.HeadDim)
	attn := 2 * (H*float64(cfg.Heads)*D*2 + 2*H*float64(cfg.KVHeads)*D) // q, o; k, v (BF16)
	router := 2 * float64(cfg.Experts) * H
	i1 := float64(cfg.MoEIntermediate)
	if cfg.Activation == moe.SwiGLU {
		i1 *= 2
	}
	perExpert := (i1*H + H*float64(cfg.MoEIntermediate)) * 2
	if recipe != moe.RecipeBF16 {
		perExpert = (i1*H + H*float64(cfg.MoEIntermediate)) * (0.5 + 1.0/16) // E2M1 codes and E4M3 block scales
	}
	e, k := float64(cfg.Experts), float64(cfg.TopK)
	touched := e * (1 - math.Pow(1-k/e, float64(batch)))
	lmHead := 2 * float64(cfg.VocabSize) * H
	kv := float64(batch) * float64(context) * float64(cfg.Layers) * 2 * float64(cfg.KVHeads) * D * 2
	bytes = float64(cfg.Layers)*(attn+router+touched*perExpert) + lmHead + kv
	return bytes, time.Duration(bytes / H200Bandwidth * 1e9)
}

// timer is implemented by backends that can time enqueued work on the
// device (the CUDA backend, with events).
type timer interface {
	Time(n int, fn func() error) (time.Duration, error)
}

// Decode measures decode steps of m at every (context, batch) of cfg,
// through graphs. Each point runs batch sequences whose KV cache already
// holds context tokens (the cache's contents do not change the work a step
// does, so no prefill runs): its own pages, tokens drawn from the seed,
// temperature 1. m's KV cache must hold batch x ceil((context + warmup +
// steps) / page size) pages for the largest point.
func Decode(ctx context.Context, m *policy.Model, graphs *policy.Graphs, cfg DecodeConfig) ([]DecodePoint, error) {
	if cfg.Steps < 1 || cfg.Warmup < 0 || len(cfg.Batches) == 0 || len(cfg.Contexts) == 0 {
		return nil, errors.New("genbench: decode: want batches, contexts and at least one step")
	}
	o, c := m.Options(), m.Config()
	var out []DecodePoint
	for _, ctxLen := range cfg.Contexts {
		for _, b := range cfg.Batches {
			if err := ctx.Err(); err != nil {
				return out, err
			}
			pages := (ctxLen + cfg.Warmup + cfg.Steps + o.PageSize - 1) / o.PageSize
			switch {
			case b < 1 || b > o.MaxSeqs:
				return out, fmt.Errorf("genbench: decode: batch %d, the model takes 1..%d sequences a step", b, o.MaxSeqs)
			case ctxLen < 1 || ctxLen+cfg.Warmup+cfg.Steps > c.MaxPositions:
				return out, fmt.Errorf("genbench: decode: context %d + %d steps exceeds the model's %d positions", ctxLen, cfg.Warmup+cfg.Steps, c.MaxPositions)
			case b*pages > o.KVPages:
				return out, fmt.Errorf("genbench: decode: batch %d at context %d needs %d KV pages, the cache has %d", b, ctxLen, b*pages, o.KVPages)
			}
			p, err := decodePoint(m, graphs, cfg, b, ctxLen, pages)
			if err != nil {
				return out, fmt.Errorf("genbench: decode: batch %d, context %d: %w", b, ctxLen, err)
			}
			out = append(out, p)
		}
	}
	return out, nil
}

func decodePoint(m *policy.Model, graphs *policy.Graphs, cfg DecodeConfig, batch, ctxLen, pages int) (DecodePoint, error) {
	ps := m.Options().PageSize
	r := rand.New(rand.NewPCG(cfg.Seed, uint64(batch)<<32|uint64(ctxLen)))
	vocab := m.Config().VocabSize
	tables := make([][]int32, batch)
	last := make([]int32, batch)
	for i := range tables {
		tables[i] = make([]int32, pages)
		for j := range tables[i] {
			tables[i][j] = int32(i*pages + j)
		}
		last[i] = int32(r.IntN(vocab))
	}
	padded, err := graphs.Pad(batch)
	if err != nil {
		return DecodePoint{}, err
	}
	// build stages step s: every sequence's token at position ctxLen + s.
	build := func(s int) policy.StepInput {
		var in policy.StepInput
		in.QueryStart = append(in.QueryStart, 0)
		pos := ctxLen + s
		for i := range batch {
			in.Tokens = append(in.Tokens, last[i])
			in.Positions = append(in.Positions, int32(pos))
			in.Slots = append(in.Slots, tables[i][pos/ps]*int32(ps)+int32(pos%ps))
			in.SeqLens = append(in.SeqLens, int32(pos+1))
			in.QueryStart = append(in.QueryStart, int32(i+1))
			in.PageTable = append(in.PageTable, tables[i])
			in.LogitRows = append(in.LogitRows, int32(i))
			in.Sampling = append(in.Sampling, policy.SampleRow{Temperature: 1, TopP: 1, Seed: cfg.Seed, SampleID: int32(i), Position: int32(pos + 1)})
		}
		in.Pad(padded)
		return in
	}
	step := func(s int) error {
		in := build(s)
		if _, err := m.Stage(in); err != nil {
			return err
		}
		if err := graphs.Run(padded); err != nil {
			return err
		}
		tokens, _, err := m.Samples(batch)
		if err != nil {
			return err
		}
		copy(last, tokens)
		return nil
	}
	for s := range cfg.Warmup {
		if err := step(s); err != nil {
			return DecodePoint{}, err
		}
	}
	start := time.Now()
	for s := range cfg.Steps {
		if err := step(cfg.Warmup + s); err != nil {
			return DecodePoint{}, err
		}
	}
	p := DecodePoint{Recipe: m.Options().Recipe, Batch: batch, Context: ctxLen, Step: time.Since(start) / time.Duration(cfg.Steps)}
	if t, ok := m.Backend().(timer); ok {
		// The last step's inputs stay staged: replaying them rewrites the
		// same KV slots, so every replay does the same work.
		if p.Device, err = t.Time(cfg.Steps, func() error { return graphs.Run(padded) }); err != nil {
			return DecodePoint{}, err
		}
	}
	if _, ok := m.Backend().(kernels.Profiler); ok {
		if p.Groups, err = profileStep(m, build(cfg.Warmup+cfg.Steps-1), cfg.Steps); err != nil {
			return DecodePoint{}, err
		}
	}
	p.FloorBytes, p.Floor = DecodeFloor(m.Config(), p.Recipe, batch, ctxLen)
	return p, nil
}

// profileStep captures in's step (forward and sampling) once more with a
// mark at every group of ops, launches that graph runs times and returns
// the mean device time of each group.
func profileStep(m *policy.Model, in policy.StepInput, runs int) (_ map[string]time.Duration, err error) {
	be := m.Backend()
	pr, ok1 := be.(kernels.Profiler)
	cp, ok2 := be.(kernels.Capturer)
	if !ok1 || !ok2 {
		return nil, fmt.Errorf("profile: the %s backend cannot capture and time marked work", be.Name())
	}
	prof, err := pr.NewProfile()
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, prof.Close()) }()
	sh, err := m.Stage(in)
	if err != nil {
		return nil, err
	}
	if err := cp.BeginCapture(); err != nil {
		return nil, err
	}
	m.SetMarker(prof)
	ferr := m.Forward(sh, true)
	m.SetMarker(nil)
	g, err := cp.EndCapture()
	if err := errors.Join(ferr, err); err != nil {
		return nil, fmt.Errorf("profile: capture: %w", err)
	}
	defer func() { err = errors.Join(err, g.Destroy()) }()
	sum := map[string]time.Duration{}
	for range runs {
		if err := g.Launch(); err != nil {
			return nil, err
		}
		if err := be.Sync(); err != nil {
			return nil, err
		}
		groups, err := prof.Groups()
		if err != nil {
			return nil, err
		}
		for k, d := range groups {
			sum[k] += d
		}
	}
	for k := range sum {
		sum[k] /= time.Duration(runs)
	}
	return sum, nil
}

// DecodeKVPages is the KV pages a sweep needs at its largest point.
func DecodeKVPages(cfg DecodeConfig, pageSize int) int {
	need := 0
	for _, c := range cfg.Contexts {
		pages := (c + cfg.Warmup + cfg.Steps + pageSize - 1) / pageSize
		need = max(need, pages*slices.Max(cfg.Batches))
	}
	return need
}
