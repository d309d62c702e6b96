package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
	"github.com/rollout-worker/rollout-worker/rollout"
	"github.com/rollout-worker/rollout-worker/worker"
)

// rolloutAttempt is one attempt of one generate request, as a client saw it.
type rolloutAttempt struct {
	client, seq, attempt int
	id                   string
	n, maxTokens         int
	seed                 uint64
	start, end           time.Time
	samples              []rollout.SampleReply
	sum                  rollout.Summary
	err                  error
}

// explicitRefusal reports whether err is a refusal a client retries: the
// worker said draining or overloaded, or no worker was there at all.
func explicitRefusal(err error) bool {
	return errors.Is(err, rollout.ErrDraining) || errors.Is(err, rollout.ErrOverloaded) || errors.Is(err, nats.ErrNoResponders)
}

// checkRollout checks one completed generate request: n samples, indices
// 0..n-1 once each, every one with a finish reason and its tokens within
// max_tokens, and a summary that counts them (aborted ones included).
func checkRollout(r *rolloutAttempt, workers ...string) error {
	if r.sum.Type != rollout.TypeSummary || r.sum.ID != r.id {
		return fmt.Errorf("summary %+v: want type summary, id %q", r.sum, r.id)
	}
	if len(workers) > 0 {
		known := false
		for _, w := range workers {
			known = known || r.sum.Worker == w
		}
		if !known {
			return fmt.Errorf("summary from worker %q: want one of %v", r.sum.Worker, workers)
		}
	}
	if r.sum.Samples != r.n || len(r.samples) != r.n {
		return fmt.Errorf("%d sample messages, summary says %d: want n = %d", len(r.samples), r.sum.Samples, r.n)
	}
	seen := make([]bool, r.n)
	aborted, tokens := 0, 0
	for _, s := range r.samples {
		if s.Type != rollout.TypeSample || s.ID != r.id {
			return fmt.Errorf("sample %d: type %q id %q", s.Index, s.Type, s.ID)
		}
		if s.Index < 0 || s.Index >= r.n {
			return fmt.Errorf("sample index %d out of [0, %d)", s.Index, r.n)
		}
		if seen[s.Index] {
			return fmt.Errorf("sample index %d sent twice", s.Index)
		}
		seen[s.Index] = true
		if s.Seed != r.seed {
			return fmt.Errorf("sample %d: seed %d, want %d", s.Index, s.Seed, r.seed)
		}
		if len(s.Versions) != len(s.Tokens) {
			return fmt.Errorf("sample %d: %d tokens, %d versions", s.Index, len(s.Tokens), len(s.Versions))
		}
		for i := 1; i < len(s.Versions); i++ {
			if s.Versions[i] < s.Versions[i-1] {
				return fmt.Errorf("sample %d: versions go back: %v", s.Index, s.Versions)
			}
		}
		switch s.FinishReason {
		case rollout.FinishAbort:
			aborted++
			if len(s.Tokens) > r.maxTokens {
				return fmt.Errorf("aborted sample %d: %d tokens > max_tokens %d", s.Index, len(s.Tokens), r.maxTokens)
			}
		case rollout.FinishLength:
			if len(s.Tokens) != r.maxTokens {
				return fmt.Errorf("sample %d: finish length with %d tokens, max_tokens %d", s.Index, len(s.Tokens), r.maxTokens)
			}
		case rollout.FinishStop:
			if len(s.Tokens) == 0 || len(s.Tokens) > r.maxTokens {
				return fmt.Errorf("sample %d: finish stop with %d tokens, max_tokens %d", s.Index, len(s.Tokens), r.maxTokens)
			}
		default:
			return fmt.Errorf("sample %d: finish reason %q", s.Index, s.FinishReason)
		}
		tokens += len(s.Tokens)
	}
	if r.sum.Aborted != aborted {
		return fmt.Errorf("summary counts %d aborted, the samples %d", r.sum.Aborted, aborted)
	}
	if r.sum.GeneratedTokens != tokens {
		return fmt.Errorf("summary counts %d tokens, the samples %d", r.sum.GeneratedTokens, tokens)
	}
	if r.sum.Seed != r.seed {
		return fmt.Errorf("summary seed %d, want %d", r.sum.Seed, r.seed)
	}
	return nil
}

// testTrainer publishes perturbed versions of a preset's seeded random
// weights (those the workers load), as demo's trainer does.
type testTrainer struct {
	dir  string
	base []byte
	pub  *refit.Publisher
}

func newTestTrainer(t *testing.T, nc *nats.Conn, model, preset string, seed uint64) *testTrainer {
	t.Helper()
	pc, err := policy.Preset(preset)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := policy.WriteRandomModel(dir, pc, seed); err != nil {
		t.Fatal(err)
	}
	base, err := os.ReadFile(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	pub, err := refit.NewPublisher(nc, refit.PublisherConfig{Model: model, Storage: jetstream.MemoryStorage}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &testTrainer{dir: dir, base: base, pub: pub}
}

// publish publishes version v (experts only when v%3 == 0) and waits for
// k workers' statuses of it.
func (tr *testTrainer) publish(ctx context.Context, v uint64, k int) (statuses []refit.Status, full bool, err error) {
	src, err := version(tr.dir, tr.base, v)
	if err != nil {
		return nil, false, err
	}
	defer src.Close()
	col, err := tr.pub.Statuses(ctx, v)
	if err != nil {
		return nil, false, err
	}
	defer col.Close()
	if _, err := tr.pub.Publish(ctx, v, src, src.Size(), src.Full()); err != nil {
		return nil, src.Full(), err
	}
	statuses, err = col.Wait(ctx, k)
	return statuses, src.Full(), err
}

// checkApplied checks that every worker of want applied version v.
func checkApplied(statuses []refit.Status, v uint64, want ...string) error {
	if len(statuses) != len(want) {
		return fmt.Errorf("version %d: %d statuses %+v, want %d", v, len(statuses), statuses, len(want))
	}
	got := map[string]refit.Status{}
	for _, s := range statuses {
		got[s.Worker] = s
	}
	for _, w := range want {
		s, ok := got[w]
		switch {
		case !ok:
			return fmt.Errorf("version %d: no status from %s (got %+v)", v, w, statuses)
		case s.State != refit.StateApplied || s.Version != v || s.CurrentVersion != v:
			return fmt.Errorf("version %d: worker %s: %s version %d serving %d (%s), want applied", v, w, s.State, s.Version,
				s.CurrentVersion, s.Reason)
		}
	}
	return nil
}

func TestScaleOut(t *testing.T) {
	const (
		model   = "scale"
		preset  = "tiny"
		seed    = 1
		clients = 8
		n       = 2
		w1, w2  = "scale-w1", "scale-w2"
	)
	testStart := time.Now()
	pc, err := policy.Preset(preset)
	if err != nil {
		t.Fatal(err)
	}
	_, connect := testNATS(t)
	start := func(id string) (*worker.Worker, *nats.Conn) {
		nc := connect(id)
		w, err := startTestWorker(t, nc, worker.Config{Preset: preset, Seed: seed, Recipe: moe.RecipePerToken, Device: "cpu",
			ModelID: model, WorkerID: id, KVPages: 256, PageSize: 16, MaxBatchTokens: 256, MaxSeqs: 16, Graphs: true,
			Limits: rollout.Limits{MaxQueue: 64, MaxN: 4, MaxTokens: 64}}, zap.NewNop(), prometheus.NewRegistry())
		if err != nil {
			t.Fatalf("start worker %s: %v", id, err)
		}
		t.Cleanup(func() {
			if err := w.Close(); err != nil {
				t.Errorf("close worker %s: %v", id, err)
			}
		})
		return w, nc
	}
	wp1, nc1 := start(w1)
	wp2, _ := start(w2)
	t.Logf("two workers ready in %v", time.Since(testStart).Round(time.Millisecond))
	tr := newTestTrainer(t, connect("trainer"), model, preset, seed)
	client := rollout.NewClient(connect("driver"), model)
	client.IdleTimeout = 8 * time.Second // > the 5 s heartbeat: a lost reply shows as ErrTimeout, within the test

	// The clients: continuous generate requests, retried on explicit refusals.
	var (
		mu      sync.Mutex
		results []*rolloutAttempt
		stop    = make(chan struct{})
		wg      sync.WaitGroup
		pending atomic.Int64 // attempts sent and not ended
	)
	stopped := func() bool {
		select {
		case <-stop:
			return true
		default:
			return false
		}
	}
	count := func(pred func(*rolloutAttempt) bool) int {
		mu.Lock()
		defer mu.Unlock()
		k := 0
		for _, r := range results {
			if pred(r) {
				k++
			}
		}
		return k
	}
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(c), 77))
			for i := 0; !stopped(); i++ {
				prompt := make([]int32, 4+rng.IntN(13))
				for j := range prompt {
					prompt[j] = int32(rng.IntN(pc.VocabSize))
				}
				seed := uint64(c*1_000_000 + i)
				maxTokens := 4 + rng.IntN(45)
				for attempt := 0; attempt < 100; attempt++ {
					r := &rolloutAttempt{client: c, seq: i, attempt: attempt, id: fmt.Sprintf("c%d-r%d-a%d", c, i, attempt), n: n,
						maxTokens: maxTokens, seed: seed, start: time.Now()}
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					pending.Add(1)
					r.samples, r.sum, r.err = client.GenerateAll(ctx, rollout.GenerateRequest{ID: r.id, Prompt: prompt, N: n,
						Temperature: 1, MaxTokens: maxTokens, Seed: &seed})
					cancel()
					r.end = time.Now()
					pending.Add(-1)
					mu.Lock()
					results = append(results, r)
					mu.Unlock()
					if r.err == nil || !explicitRefusal(r.err) {
						break
					}
					time.Sleep(5 * time.Millisecond)
				}
			}
		}()
	}
	stopClients := func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}
	defer stopClients()

	// (a) Three versions while the clients run; both workers apply each.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var allApplied time.Time
	for v := uint64(1); v <= 3; v++ {
		time.Sleep(300 * time.Millisecond)
		pctx, pcancel := context.WithTimeout(ctx, 8*time.Second)
		statuses, full, err := tr.publish(pctx, v, 2)
		pcancel()
		if err != nil {
			t.Fatalf("version %d: %v", v, err)
		}
		if err := checkApplied(statuses, v, w1, w2); err != nil {
			t.Fatal(err)
		}
		t.Logf("version %d (full %v) applied by both workers at %v", v, full, time.Since(testStart).Round(time.Millisecond))
	}
	allApplied = time.Now()

	// (b) Both workers answer, in meaningful numbers.
	// Up to 30 s: a loaded host (the race detector, other tests) answers
	// slowly; the loop ends as soon as both have answered 20.
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if count(func(r *rolloutAttempt) bool { return r.err == nil && r.sum.Worker == w1 }) >= 20 &&
			count(func(r *rolloutAttempt) bool { return r.err == nil && r.sum.Worker == w2 }) >= 20 {
			break
		}
	}
	before1 := count(func(r *rolloutAttempt) bool { return r.err == nil && r.sum.Worker == w1 })
	before2 := count(func(r *rolloutAttempt) bool { return r.err == nil && r.sum.Worker == w2 })
	t.Logf("before the stop: %d requests answered by %s, %d by %s", before1, w1, before2, w2)
	if total := before1 + before2; before1 < 10 || before2 < 10 || before1*5 < total || before2*5 < total {
		t.Errorf("requests not spread: %s answered %d, %s %d", w1, before1, w2, before2)
	}
	select {
	case <-wp1.Failed():
		t.Fatalf("%s failed: %v", w1, wp1.Err())
	case <-wp2.Failed():
		t.Fatalf("%s failed: %v", w2, wp2.Err())
	default:
	}

	// (c) Stop w1 mid-load, as rollout/doc.go says a serve command does on
	// SIGTERM: drain the service with a short deadline, stop the engine
	// (close), then drain the connection. The clients go on.
	// Mid-load: wait (briefly) until w1 holds admitted requests.
	for end := time.Now().Add(time.Second); wp1.Status().QueueDepth < 2 && time.Now().Before(end); {
		time.Sleep(time.Millisecond)
	}
	inFlight, atW1 := pending.Load(), wp1.Status().QueueDepth
	stopBegin := time.Now()
	dctx, dcancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	derr := wp1.Drain(dctx)
	dcancel()
	if derr != nil {
		t.Errorf("drain %s: %v", w1, derr)
	}
	if err := wp1.Close(); err != nil {
		t.Errorf("close %s: %v", w1, err)
	}
	if err := stopConn(nc1, 5*time.Second); err != nil {
		t.Errorf("%s: %v", w1, err)
	}
	stopDone := time.Now()
	t.Logf("%s stopped in %v (%d requests in flight at the stop, %d admitted by %s)", w1, stopDone.Sub(stopBegin).Round(time.Millisecond),
		inFlight, atW1, w1)
	time.Sleep(1500 * time.Millisecond)
	stopClients()
	select {
	case <-wp2.Failed():
		t.Fatalf("%s failed: %v", w2, wp2.Err())
	default:
	}

	// Every attempt ended with a complete summary or an explicit refusal;
	// nothing was lost or sent twice.
	mu.Lock()
	defer mu.Unlock()
	var (
		ok, refused, draining, noResp, overloaded, abortedSamples, abortedReqs int
		w1After, w2After, newAfter                                             int
		byWorker                                                               = map[string]int{}
		ids                                                                    = map[string]bool{}
	)
	for _, r := range results {
		if ids[r.id] {
			t.Errorf("%s: request id twice in the results", r.id)
		}
		ids[r.id] = true
		if r.err != nil {
			if !explicitRefusal(r.err) {
				t.Errorf("%s: not a complete rollout nor an explicit refusal: %v (%d samples before it)", r.id, r.err, len(r.samples))
				continue
			}
			if len(r.samples) > 0 {
				t.Errorf("%s: refused (%v) after %d samples", r.id, r.err, len(r.samples))
			}
			refused++
			switch {
			case errors.Is(r.err, rollout.ErrDraining):
				draining++
			case errors.Is(r.err, rollout.ErrOverloaded):
				overloaded++
			default:
				noResp++
			}
			continue
		}
		if err := checkRollout(r, w1, w2); err != nil {
			t.Errorf("%s: %v", r.id, err)
			continue
		}
		ok++
		byWorker[r.sum.Worker]++
		if r.sum.Aborted > 0 {
			abortedReqs++
			abortedSamples += r.sum.Aborted
			if r.sum.Worker != w1 {
				t.Errorf("%s: %d samples aborted by %s, which was not stopped", r.id, r.sum.Aborted, r.sum.Worker)
			}
		}
		if r.end.After(stopBegin) {
			if r.sum.Worker == w1 {
				w1After++
			} else {
				w2After++
			}
		}
		if r.start.After(stopDone) {
			newAfter++
			if r.sum.Worker != w2 {
				t.Errorf("%s: sent after %s stopped, answered by %s", r.id, w1, r.sum.Worker)
			}
		}
		// A request sent once both workers served version 3 is generated by
		// version 3 only.
		if r.start.After(allApplied) {
			for _, s := range r.samples {
				for _, v := range s.Versions {
					if v != 3 {
						t.Errorf("%s (from %s): sent after both workers applied version 3, sample %d has versions %v",
							r.id, r.sum.Worker, s.Index, s.Versions)
						break
					}
				}
			}
		}
	}
	if overloaded > 0 {
		t.Errorf("%d overloaded refusals with max_queue 64 for %d clients", overloaded, clients)
	}
	if atW1 > 0 && w1After == 0 {
		t.Errorf("%s held %d requests at the stop, and answered none of them after it", w1, atW1)
	}
	if newAfter == 0 {
		t.Errorf("no request was sent and answered after %s stopped", w1)
	}
	var lastW1 time.Time
	for _, r := range results {
		if r.err == nil && r.sum.Worker == w1 && r.end.After(lastW1) {
			lastW1 = r.end
		}
	}
	t.Logf("last %s answer %v after the stop began", w1, lastW1.Sub(stopBegin))
	t.Logf("%d attempts: %d complete (%v), %d refused (%d draining, %d no responders, %d overloaded); "+
		"%d requests with %d aborted samples; ended after the stop began: %d from %s, %d from %s; %d sent after the stop, all to %s; test %v",
		len(results), ok, byWorker, refused, draining, noResp, overloaded, abortedReqs, abortedSamples,
		w1After, w1, w2After, w2, newAfter, w2, time.Since(testStart).Round(time.Millisecond))
}
