package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
	"github.com/rollout-worker/rollout-worker/rollout"
	"github.com/rollout-worker/rollout-worker/worker"
)

// loadDuration is how long TestLoad's clients send requests (5 s under
// -short).
var loadDuration = 30 * time.Second

// TestLoad is the bounded load test of docs/SERVING.md: one worker (CPU
// backend, tiny preset, NVFP4 recipe, graphs on), 32 concurrent clients
// with mixed request sizes, a trainer publishing a version every second
// (every third one experts-only). No sample may be lost or sent twice;
// with limits sized for 32 clients no request may be refused.
func TestLoad(t *testing.T) {
	const (
		model      = "load"
		preset     = "tiny"
		seed       = 1
		clients    = 32
		refitEvery = time.Second
		workerID   = "load-w1"
	)
	duration := loadDuration
	if testing.Short() {
		duration = min(duration, 5*time.Second)
	}
	pc, err := policy.Preset(preset)
	if err != nil {
		t.Fatal(err)
	}
	_, connect := testNATS(t)
	wnc := connect(workerID)
	reg := prometheus.NewRegistry()
	// Limits for 32 clients of up to n = 4: 64 requests may be admitted,
	// 2048 pages of 16 tokens hold 32 x 4 samples of up to 128 tokens 2.5
	// times over; the serve defaults otherwise.
	w, err := startTestWorker(t, wnc, worker.Config{Preset: preset, Seed: seed, Recipe: moe.RecipePerToken, Device: "cpu",
		ModelID: model, WorkerID: workerID, KVPages: 2048, PageSize: 16, MaxBatchTokens: 512, MaxSeqs: 64, Graphs: true,
		Limits: rollout.Limits{MaxQueue: 64, MaxN: 4, MaxTokens: 64, MaxPromptTokens: 64}}, zap.NewNop(), reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := w.Close(); err != nil {
			t.Errorf("close worker: %v", err)
		}
	})
	tr := newTestTrainer(t, connect("trainer"), model, preset, seed)
	client := rollout.NewClient(connect("driver"), model)
	client.IdleTimeout = 10 * time.Second

	runCtx, stop := context.WithTimeout(context.Background(), duration)
	defer stop()
	var (
		mu         sync.Mutex
		attempts   []*rolloutAttempt
		statuses   []refit.Status
		partials   int
		trainerErr error
		wg         sync.WaitGroup
	)
	runStart := time.Now()
	wg.Add(1)
	go func() { // the trainer: a version every second, each waited for
		defer wg.Done()
		tick := time.NewTicker(refitEvery)
		defer tick.Stop()
		for v := uint64(1); ; v++ {
			select {
			case <-runCtx.Done():
				return
			case <-tick.C:
			}
			// Not runCtx: a version begun is seen through.
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			got, full, err := tr.publish(ctx, v, 1)
			cancel()
			if err == nil {
				err = checkApplied(got, v, workerID)
			}
			mu.Lock()
			statuses = append(statuses, got...)
			if !full {
				partials++
			}
			if err != nil {
				trainerErr = err
			}
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	for c := range clients {
		wg.Add(1)
		go func() { // a client: mixed sizes, one request at a time
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(c), 31))
			for i := 0; runCtx.Err() == nil; i++ {
				prompt := make([]int32, 4+rng.IntN(61)) // 4..64
				for j := range prompt {
					prompt[j] = int32(rng.IntN(pc.VocabSize))
				}
				r := &rolloutAttempt{client: c, seq: i, id: fmt.Sprintf("c%d-r%d", c, i), n: 1 + rng.IntN(4), // 1..4
					maxTokens: 8 + rng.IntN(57), seed: uint64(c)<<32 | uint64(i)} // 8..64
				// Not runCtx: a request sent is seen through to its summary.
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				r.start = time.Now()
				r.samples, r.sum, r.err = client.GenerateAll(ctx, rollout.GenerateRequest{ID: r.id, Prompt: prompt, N: r.n,
					Temperature: 1, MaxTokens: r.maxTokens, Seed: &r.seed})
				r.end = time.Now()
				cancel()
				mu.Lock()
				attempts = append(attempts, r)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(runStart)
	select {
	case <-w.Failed():
		t.Fatalf("worker failed: %v", w.Err())
	default:
	}
	st := w.Status()
	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.Drain(dctx); err != nil {
		t.Errorf("drain: %v", err)
	}

	var (
		ok, lost, overloaded, draining, samples, tokens, aborted, multiVersion int
		latencies                                                              []time.Duration
	)
	for _, r := range attempts {
		switch {
		case errors.Is(r.err, rollout.ErrOverloaded):
			overloaded++
			continue
		case errors.Is(r.err, rollout.ErrDraining):
			draining++
			continue
		case r.err != nil:
			lost++
			t.Errorf("%s: no complete rollout: %v (%d samples before it)", r.id, r.err, len(r.samples))
			continue
		}
		if err := checkRollout(r, workerID); err != nil {
			lost++
			t.Errorf("%s: %v", r.id, err)
			continue
		}
		ok++
		latencies = append(latencies, r.end.Sub(r.start))
		samples += len(r.samples)
		tokens += r.sum.GeneratedTokens
		aborted += r.sum.Aborted
		for _, s := range r.samples {
			if len(s.Versions) > 0 && s.Versions[0] != s.Versions[len(s.Versions)-1] {
				multiVersion++
			}
		}
	}
	if overloaded+draining > 0 {
		t.Errorf("%d overloaded and %d draining refusals with limits sized for %d clients", overloaded, draining, clients)
	}
	if aborted > 0 {
		t.Errorf("%d samples aborted without a drain", aborted)
	}
	if trainerErr != nil {
		t.Errorf("trainer: %v", trainerErr)
	}
	applied, commitMS, receiveMS := 0, 0.0, 0.0
	for _, s := range statuses {
		if s.State == refit.StateApplied {
			applied++
			commitMS += s.PhasesMS["commit"]
			receiveMS += s.PhasesMS["receive"]
		}
	}
	if want := max(1, int(duration/refitEvery)/2); applied < want {
		t.Errorf("%d versions applied in %v, want at least %d (one published every %v)", applied, duration, want, refitEvery)
	}
	if ok == 0 {
		t.Fatalf("no request completed in %v", duration)
	}
	slices.Sort(latencies)
	pct := func(p float64) time.Duration { return latencies[min(len(latencies)-1, int(p*float64(len(latencies))))] }
	var graphSteps, eagerSteps float64
	if mfs, err := reg.Gather(); err == nil {
		for _, mf := range mfs {
			if mf.GetName() != "rollout_worker_engine_steps_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "kind" && l.GetValue() == "graph" {
						graphSteps += m.GetCounter().GetValue()
					} else if l.GetName() == "kind" {
						eagerSteps += m.GetCounter().GetValue()
					}
				}
			}
		}
	}
	sec := elapsed.Seconds()
	t.Logf("load: %d clients for %v (run %.1fs), CPU backend, %s preset, recipe %s, graphs on", clients, duration, sec, preset, moe.RecipePerToken)
	t.Logf("requests: %d complete, %d lost or malformed, %d overloaded, %d draining; %d samples (%d aborted), %d tokens",
		ok, lost, overloaded, draining, samples, aborted, tokens)
	t.Logf("throughput: %.1f requests/s, %.1f rollouts/s, %.0f tokens/s", float64(ok)/sec, float64(samples)/sec, float64(tokens)/sec)
	t.Logf("latency (submit to summary): p50 %v, p99 %v, max %v", pct(0.50).Round(time.Millisecond),
		pct(0.99).Round(time.Millisecond), latencies[len(latencies)-1].Round(time.Millisecond))
	t.Logf("refit: %d versions applied (%d experts-only), mean receive %.1f ms, mean commit (generation pause) %.1f ms; "+
		"%d samples spanned more than one version", applied, partials, receiveMS/float64(max(applied, 1)),
		commitMS/float64(max(applied, 1)), multiVersion)
	t.Logf("engine: %d steps (%.0f graph, %.0f eager), %d tokens generated", st.Steps, graphSteps, eagerSteps, st.Generated)
}
