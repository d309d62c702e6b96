package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/cudagraph"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
	"github.com/rollout-worker/rollout-worker/rollout"
)

// workerConfig is everything a worker process is made of.
type workerConfig struct {
	ModelDir string // a Hugging Face model directory, or
	Preset   string // a random model of this preset
	Seed     uint64 // of the random model
	Recipe   moe.Recipe
	Device   string

	ModelID, WorkerID string
	Limits            rollout.Limits

	KVPages, PageSize, MaxBatchTokens, MaxSeqs int
	KVMemoryFraction                           float64 // with KVPages 0
	Graphs                                     bool
}

// workerProc is one running worker: model, engine, refit receiver and rollout
// service. startWorker starts its goroutines; drain and close end them.
type workerProc struct {
	log    *zap.Logger
	m      *policy.Model
	graphs *policy.Graphs
	eng    *policy.Engine
	recv   *refit.Receiver
	svc    *rollout.Service

	cancel context.CancelFunc
	wg     sync.WaitGroup
	errs   chan error
	tmpDir string
	// closeBackend releases the compute device after the model.
	closeBackend func() error
	once         sync.Once
	ready        chan struct{}
}

// startWorker loads the model and starts the engine loop, the refit
// receiver and the rollout service on nc.
func startWorker(nc *nats.Conn, cfg workerConfig, log *zap.Logger, reg prometheus.Registerer) (_ *workerProc, err error) {
	w := &workerProc{log: log, errs: make(chan error, 2), ready: make(chan struct{})}
	defer func() {
		if err != nil {
			err = errors.Join(err, w.close())
		}
	}()
	be, closeBackend, err := newBackend(cfg.Device, log.Named("backend"))
	if err != nil {
		return nil, err
	}
	w.closeBackend = closeBackend
	dir := cfg.ModelDir
	if dir == "" {
		pc, err := policy.Preset(cfg.Preset)
		if err != nil {
			return nil, err
		}
		if w.tmpDir, err = os.MkdirTemp("", "rollout-worker-model-"); err != nil {
			return nil, err
		}
		if err := policy.WriteRandomModel(w.tmpDir, pc, cfg.Seed); err != nil {
			return nil, err
		}
		dir = w.tmpDir
	}
	mc, err := policy.LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	maxLen := mc.MaxPositions
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
	if w.m, err = policy.LoadModel(be, dir, opts); err != nil {
		return nil, err
	}
	log.Info("model loaded", zap.String("dir", dir), zap.String("architecture", mc.Architecture), zap.Int("layers", mc.Layers),
		zap.Int("experts", mc.Experts), zap.String("recipe", string(cfg.Recipe)), zap.String("backend", be.Name()),
		zap.Int("kv_pages", w.m.Options().KVPages), zap.Int("page_size", cfg.PageSize), zap.Int("context", maxLen))
	em, err := policy.NewEngineMetrics(reg)
	if err != nil {
		return nil, err
	}
	ecfg := policy.EngineConfig{Metrics: em}
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
	if w.recv, err = refit.NewReceiver(nc, w.m, w.eng, refit.ReceiverConfig{Model: cfg.ModelID, Worker: cfg.WorkerID}, log.Named("refit"), reg); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	w.wg.Add(2)
	go func() {
		defer w.wg.Done()
		if err := w.eng.Run(ctx); err != nil {
			log.Error("engine stopped", zap.Error(err))
			w.errs <- err
		}
	}()
	go func() {
		defer w.wg.Done()
		if err := w.recv.Run(ctx); err != nil && ctx.Err() == nil {
			log.Error("refit receiver stopped", zap.Error(err))
			w.errs <- err
		}
	}()
	w.svc, err = rollout.NewService(nc, w.eng, rollout.Config{Model: cfg.ModelID, Worker: cfg.WorkerID, Limits: cfg.Limits,
		Vocab: mc.VocabSize, Context: maxLen, KVPages: w.m.Options().KVPages, Recipe: string(cfg.Recipe),
		CurrentVersion: w.eng.Version}, log.Named("rollout"), reg)
	if err != nil {
		return nil, err
	}
	close(w.ready)
	return w, nil
}

// Ready reports whether the worker serves requests.
func (w *workerProc) Ready() bool {
	select {
	case <-w.ready:
		return w.svc != nil
	default:
		return false
	}
}

// Failed delivers an error if the engine loop or the receiver stops on its
// own.
func (w *workerProc) Failed() <-chan error { return w.errs }

// drain stops admitting requests, lets in-flight ones finish until ctx ends,
// then aborts the rest; every admitted request gets its final reply.
func (w *workerProc) drain(ctx context.Context) error {
	if w.svc == nil {
		return nil
	}
	return w.svc.Drain(ctx)
}

// close stops everything and frees the model. It is idempotent.
func (w *workerProc) close() error {
	var errs []error
	w.once.Do(func() {
		if w.svc != nil {
			w.svc.Stop()
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
		if w.tmpDir != "" {
			errs = append(errs, os.RemoveAll(w.tmpDir))
		}
	})
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("worker: close: %w", err)
	}
	return nil
}

// stopConn drains nc and waits until it is closed. Draining, not closing:
// the micro service's Stop drains its subscriptions without waiting, so
// requests the server delivered just before are still queued in the client;
// nc.Drain lets the handlers answer them ("draining") before it closes.
// Flush then Close drops them: their clients hear nothing.
func stopConn(nc *nats.Conn, timeout time.Duration) error {
	if err := nc.Drain(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		return fmt.Errorf("drain connection: %w", err)
	}
	for end := time.Now().Add(timeout); !nc.IsClosed(); time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			nc.Close()
			return fmt.Errorf("connection not drained in %v", timeout)
		}
	}
	return nil
}
