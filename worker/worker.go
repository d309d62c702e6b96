// Package worker is the composition root of a rollout worker: it opens the
// compute backend, loads the model, and wires the generation engine, the
// refit receiver and the rollout service onto one NATS connection.
//
// Lifecycle: New builds everything (nothing runs yet), Start starts the
// engine loop, the receiver and the service, Drain stops admitting requests
// and lets in-flight ones finish, Close stops everything and frees the
// device. If the engine loop or the receiver stops on its own, the worker
// is failed: Failed's channel closes, Err says why and Ready turns false,
// so the process can exit non-zero and a readiness probe can take it out
// of rotation.
package worker

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/cudagraph"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
	"github.com/rollout-worker/rollout-worker/rollout"
)

// ErrNotStarted is returned by Drain before Start.
var ErrNotStarted = errors.New("worker: not started")

// Config is everything a worker is made of.
type Config struct {
	ModelDir string // a Hugging Face model directory, or
	Preset   string // a random model of this preset, initialised in memory
	Layers   int    // the preset's depth cut to this many layers (0: all)
	Seed     uint64 // of the random model
	Recipe   moe.Recipe
	// InputScales is the safetensors file of the per_tensor recipe's
	// input scales (policy.ReadInputScales; rollout-worker calibrate
	// writes one), refused with the other recipes. The per_tensor recipe
	// needs scales from it or from the checkpoint (a ModelOpt NVFP4
	// export's input_scale tensors); the file wins over the checkpoint.
	InputScales string
	Device      string // auto, cpu or cuda (see OpenBackend)

	// Backend, when set, is an open backend the worker runs on instead of
	// opening Device; the worker does not close it. A process that embeds
	// the worker next to other users of the device passes its own.
	Backend kernels.Backend

	ModelID, WorkerID string
	Limits            rollout.Limits

	KVPages, PageSize, MaxBatchTokens, MaxSeqs int
	KVMemoryFraction                           float64 // with KVPages 0
	Graphs                                     bool
	// KVOnDemand: samples take KV pages as they grow, and the youngest
	// are preempted and recomputed when the cache runs out
	// (policy.EngineConfig.KVOnDemand).
	KVOnDemand bool
	// PrefixCache shares the KV pages of prompt prefixes across requests
	// under one policy version (policy.EngineConfig.PrefixCache).
	PrefixCache bool

	// RefitTrust, when set, makes the refit receiver apply only versions
	// signed by one of its keys (refit.ReceiverConfig.Trust).
	RefitTrust *refit.Trust
	// RefitLiveParts is how many parts of a version (refit/PROTOCOL.md,
	// "Parts") the refit receiver follows live from the start (0: 1).
	RefitLiveParts int
	// RefitPartServers are the NATS servers that carry parts 1 and on of a
	// version (refit.ReceiverConfig.PartServers).
	RefitPartServers []string
	// RefitLivePendingBytes bounds what a part's live subscription holds
	// unread (0: refit.DefaultLivePendingBytes).
	RefitLivePendingBytes int
}

// DefaultModelID is the model id a worker serves when none is given: the
// preset's name, or the model directory's base name with every character
// outside [A-Za-z0-9_-] replaced by '_' (at most 64 characters).
func DefaultModelID(cfg Config) string {
	name := cfg.Preset
	if cfg.ModelDir != "" {
		name = filepath.Base(filepath.Clean(cfg.ModelDir))
	}
	id := []byte(name)
	for i, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			id[i] = '_'
		}
	}
	if len(id) > 64 {
		id = id[:64]
	}
	if len(id) == 0 || string(id) == "_" {
		return "model"
	}
	return string(id)
}

// Worker is one worker: model, engine, refit receiver and rollout service.
type Worker struct {
	cfg    Config
	nc     *nats.Conn
	log    *zap.Logger
	reg    prometheus.Registerer
	m      *policy.Model
	graphs *policy.Graphs
	eng    *policy.Engine
	recv   *refit.Receiver
	svc    *rollout.Service
	vocab  int
	ctxLen int

	cancel context.CancelFunc
	wg     sync.WaitGroup
	// closeBackend releases the compute device after the model.
	closeBackend func() error

	started   bool
	closeOnce sync.Once
	failOnce  sync.Once
	failed    chan struct{}
	mu        sync.Mutex
	err       error
}

// New opens the backend, loads the model (or initialises the preset's in
// memory) and builds the engine and the refit receiver on nc. Nothing runs
// until Start; ctx bounds the loading.
func New(ctx context.Context, nc *nats.Conn, cfg Config, log *zap.Logger, reg prometheus.Registerer) (_ *Worker, err error) {
	if log == nil {
		log = zap.NewNop()
	}
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	if cfg.ModelID == "" {
		cfg.ModelID = DefaultModelID(cfg)
	}
	w := &Worker{cfg: cfg, nc: nc, log: log, reg: reg, failed: make(chan struct{})}
	defer func() {
		if err != nil {
			err = errors.Join(err, w.Close())
		}
	}()
	be := cfg.Backend
	if be == nil {
		var closeBackend func() error
		if be, closeBackend, err = OpenBackend(cfg.Device, log.Named("backend")); err != nil {
			return nil, err
		}
		w.closeBackend = closeBackend
	}
	var mc policy.Config
	switch {
	case cfg.InputScales != "" && cfg.Recipe != moe.RecipePerTensor:
		return nil, fmt.Errorf("worker: input scales %q with recipe %s: only the per_tensor recipe takes them", cfg.InputScales, cfg.Recipe)
	case cfg.ModelDir != "" && cfg.Layers != 0:
		return nil, fmt.Errorf("worker: layers %d: a depth cut applies to presets, not to model directories", cfg.Layers)
	case cfg.ModelDir != "":
		mc, err = policy.LoadConfig(cfg.ModelDir)
	default:
		mc, err = policy.PresetLayers(cfg.Preset, cfg.Layers)
	}
	if err != nil {
		return nil, err
	}
	w.vocab, w.ctxLen = mc.VocabSize, mc.MaxPositions
	opts := policy.ModelOptions{Recipe: cfg.Recipe, MaxTokens: cfg.MaxBatchTokens, MaxSeqs: cfg.MaxSeqs,
		MaxLogitRows: max(cfg.MaxBatchTokens, cfg.MaxSeqs), KVPages: cfg.KVPages, PageSize: cfg.PageSize}
	if cfg.KVPages == 0 {
		// The cache takes a fraction of what the device has left, or a
		// fixed default where the backend cannot say (the CPU).
		opts.KVMemoryFraction = cfg.KVMemoryFraction
		if be.Name() == "cpu" {
			opts.KVPages = 2048
		}
		// Kept out of the cache: the refit receiver's staging copies (every
		// tensor but the expert stacks, which NVFP4 recipes write in place;
		// all of them for bf16) and headroom for the decode graphs.
		experts, other := mc.WeightBytes()
		opts.KVReserveBytes = other + 512<<20
		if cfg.Recipe == moe.RecipeBF16 {
			opts.KVReserveBytes += experts
		}
	}
	source := cfg.ModelDir
	if source == "" {
		source = fmt.Sprintf("preset %s, seed %d", cfg.Preset, cfg.Seed)
		w.m, err = policy.NewRandomModel(ctx, be, mc, opts, cfg.Seed)
	} else {
		w.m, err = policy.LoadModel(be, cfg.ModelDir, opts)
	}
	if err != nil {
		return nil, err
	}
	if err := w.m.UseInputScales(cfg.InputScales); err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	log.Info("model loaded", zap.String("source", source), zap.String("architecture", mc.Architecture), zap.Int("layers", mc.Layers),
		zap.Int("experts", mc.Experts), zap.String("recipe", string(cfg.Recipe)), zap.String("backend", be.Name()),
		zap.Int("kv_pages", w.m.Options().KVPages), zap.Int("page_size", cfg.PageSize), zap.Bool("kv_on_demand", cfg.KVOnDemand), zap.Bool("prefix_cache", cfg.PrefixCache),
		zap.Int("context", w.ctxLen))
	em, err := policy.NewEngineMetrics(reg)
	if err != nil {
		return nil, err
	}
	ecfg := policy.EngineConfig{Metrics: em, KVOnDemand: cfg.KVOnDemand, PrefixCache: cfg.PrefixCache}
	if cfg.Graphs {
		gm, err := cudagraph.NewMetrics(reg)
		if err != nil {
			return nil, err
		}
		if w.graphs, err = policy.NewGraphs(w.m, policy.DefaultBuckets(cfg.MaxSeqs), gm); err != nil {
			return nil, err
		}
		ecfg.Graphs = w.graphs
	}
	w.eng = policy.NewEngine(w.m, ecfg)
	if w.recv, err = refit.NewReceiver(nc, w.m, w.eng, refit.ReceiverConfig{Model: cfg.ModelID, Worker: cfg.WorkerID, Trust: cfg.RefitTrust, LiveParts: cfg.RefitLiveParts, PartServers: cfg.RefitPartServers, LivePendingBytes: cfg.RefitLivePendingBytes}, log.Named("refit"), reg); err != nil {
		return nil, err
	}
	return w, nil
}

// Start runs the engine loop and the refit receiver and starts the rollout
// service. Call it once.
func (w *Worker) Start() error {
	if w.started {
		return errors.New("worker: started twice")
	}
	w.started = true
	ctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	w.wg.Add(2)
	go func() {
		defer w.wg.Done()
		if err := w.eng.Run(ctx); err != nil {
			w.fail(fmt.Errorf("engine: %w", err))
		}
	}()
	go func() {
		defer w.wg.Done()
		if err := w.recv.Run(ctx); err != nil && ctx.Err() == nil {
			w.fail(fmt.Errorf("refit receiver: %w", err))
		}
	}()
	svc, err := rollout.NewService(w.nc, w.eng, rollout.Config{Model: w.cfg.ModelID, Worker: w.cfg.WorkerID, Limits: w.cfg.Limits,
		Vocab: w.vocab, Context: w.ctxLen, StepSeqs: min(w.m.Options().MaxSeqs, w.m.Options().MaxLogitRows),
		KVPages: w.m.Options().KVPages, Recipe: string(w.cfg.Recipe),
		CurrentVersion: w.eng.Version}, w.log.Named("rollout"), w.reg)
	if err != nil {
		return err
	}
	w.mu.Lock()
	w.svc = svc
	w.mu.Unlock()
	return nil
}

// fail records the first failure and closes Failed's channel.
func (w *Worker) fail(err error) {
	w.failOnce.Do(func() {
		w.log.Error("worker failed", zap.Error(err))
		w.mu.Lock()
		w.err = err
		w.mu.Unlock()
		close(w.failed)
	})
}

// Failed is closed when the engine loop or the refit receiver stops on its
// own; Err then says why.
func (w *Worker) Failed() <-chan struct{} { return w.failed }

// Err is the failure that closed Failed's channel, or nil.
func (w *Worker) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// Ready reports whether the worker serves requests: started, not failed.
func (w *Worker) Ready() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.svc != nil && w.err == nil
}

// ModelID is the model id the worker serves (rollout.<id>.*, the refit
// stream of that id).
func (w *Worker) ModelID() string { return w.cfg.ModelID }

// Version is the policy version being served.
func (w *Worker) Version() uint64 { return w.eng.Version() }

// Status is the rollout service's status reply (zero before Start).
func (w *Worker) Status() rollout.StatusReply {
	w.mu.Lock()
	svc := w.svc
	w.mu.Unlock()
	if svc == nil {
		return rollout.StatusReply{}
	}
	return svc.Status()
}

// Backend names the compute backend the model runs on.
func (w *Worker) Backend() string { return w.m.Backend().Name() }

// GraphStats reports the decode graphs' captures and replays; ok is false
// when graphs are off.
func (w *Worker) GraphStats() (st cudagraph.Stats, ok bool) {
	if w.graphs == nil {
		return st, false
	}
	return w.graphs.Stats(), true
}

// Drain stops admitting requests, lets in-flight ones finish until ctx ends,
// then aborts the rest; every admitted request gets its final reply.
func (w *Worker) Drain(ctx context.Context) error {
	w.mu.Lock()
	svc := w.svc
	w.mu.Unlock()
	if svc == nil {
		return ErrNotStarted
	}
	return svc.Drain(ctx)
}

// Close stops everything and frees the model and the device. It is
// idempotent.
func (w *Worker) Close() error {
	var errs []error
	w.closeOnce.Do(func() {
		w.mu.Lock()
		svc := w.svc
		w.mu.Unlock()
		if svc != nil {
			svc.Stop()
		}
		if w.cancel != nil {
			w.cancel()
		}
		w.wg.Wait()
		if w.recv != nil {
			errs = append(errs, w.recv.Close())
		}
		if w.graphs != nil {
			errs = append(errs, w.graphs.Close())
		}
		if w.m != nil {
			errs = append(errs, w.m.Close())
		}
		if w.closeBackend != nil {
			errs = append(errs, w.closeBackend())
		}
	})
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("worker: close: %w", err)
	}
	return nil
}
