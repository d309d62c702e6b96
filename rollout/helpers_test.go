package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

const testModel = "tiny"

// tinyModelDir writes the tiny preset with seeded random weights under a
// temporary directory of the test.
func tinyModelDir(t testing.TB) string {
	t.Helper()
	cfg, err := policy.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := policy.WriteRandomModel(dir, cfg, 7); err != nil {
		t.Fatal(err)
	}
	return dir
}

// worker is one engine on the CPU backend with its service.
type worker struct {
	eng *policy.Engine
	m   *policy.Model
	svc *Service
	nc  *nats.Conn
	reg *prometheus.Registry
}

// testModelOptions is the memory plan of the tests' workers.
var testModelOptions = policy.ModelOptions{Recipe: moe.RecipeBF16, MaxTokens: 256, MaxSeqs: 64,
	MaxLogitRows: 64, KVPages: 1024, PageSize: 16}

// startWorker loads the model in dir, runs its engine at version 1 and
// serves it on url under cfg (Model, Vocab and the model fields filled in).
// Everything stops when the test ends.
func startWorker(t testing.TB, url, dir string, cfg Config) *worker {
	t.Helper()
	return startWorkerWith(t, url, dir, cfg, testModelOptions)
}

// startWorkerWith is startWorker with the model loaded under opts.
func startWorkerWith(t testing.TB, url, dir string, cfg Config, opts policy.ModelOptions) *worker {
	t.Helper()
	be, err := cpu.New(cpu.Config{Workers: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := policy.LoadModel(be, dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	eng := policy.NewEngine(m, policy.EngineConfig{Version: 1})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("engine: %v", err)
		}
		if err := m.Close(); err != nil {
			t.Error(err)
		}
	})
	nc := refittest.Connect(t, url)
	if cfg.Model == "" {
		cfg.Model = testModel
	}
	if cfg.Worker == "" {
		cfg.Worker = "w1"
	}
	reg := prometheus.NewRegistry()
	svc, err := NewService(nc, eng, cfg.WithModel(m), zap.NewNop(), reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := svc.Stop(); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	return &worker{eng: eng, m: m, svc: svc, nc: nc, reg: reg}
}

// setVersion commits a new policy version at the engine's step boundary,
// as a refit would.
func (w *worker) setVersion(t testing.TB, v uint64) {
	t.Helper()
	if err := w.eng.AtBoundary(context.Background(), func() error { w.eng.SetVersion(v); return nil }); err != nil {
		t.Fatal(err)
	}
}

func (w *worker) counter(t testing.TB, c prometheus.Collector) float64 {
	t.Helper()
	return testutil.ToFloat64(c)
}

// setup starts a server, one worker and a client on a connection of its own.
func setup(t testing.TB, cfg Config) (*worker, *Client) {
	t.Helper()
	srv := refittest.StartServer(t)
	w := startWorker(t, srv.URL(), tinyModelDir(t), cfg)
	return w, NewClient(refittest.Connect(t, srv.URL()), testModel)
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func seed(v uint64) *uint64 { return &v }

func prompt(n int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(2 + (i*37)%500)
	}
	return p
}

// rawRequest sends body to an endpoint and returns the single reply.
func rawRequest(t testing.TB, nc *nats.Conn, endpoint string, body []byte) *nats.Msg {
	t.Helper()
	msg, err := nc.Request(Subject(testModel, endpoint), body, 10*time.Second)
	if err != nil {
		t.Fatalf("%s %s: %v", endpoint, body, err)
	}
	return msg
}

// checkStream reads a whole stream and checks its invariants: exactly n
// samples, indices 0..n-1 once each, a summary that counts them.
func checkStream(t testing.TB, ctx context.Context, st *Stream, n int) ([]SampleReply, Summary) {
	t.Helper()
	var got []SampleReply
	for {
		r, err := st.Next(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Errorf("stream %s: %v", st.ID(), err)
			return got, Summary{}
		}
		got = append(got, r)
	}
	sum, ok := st.Summary()
	if !ok {
		t.Errorf("stream %s: no summary", st.ID())
	}
	slices.SortFunc(got, func(a, b SampleReply) int { return a.Index - b.Index })
	aborted := 0
	for i, r := range got {
		if r.Index != i {
			t.Errorf("stream %s: sample indices %v: want 0..%d once each", st.ID(), indices(got), n-1)
			break
		}
		if r.FinishReason == FinishAbort {
			aborted++
		}
		if len(r.Versions) != len(r.Tokens) {
			t.Errorf("stream %s sample %d: %d versions for %d tokens", st.ID(), i, len(r.Versions), len(r.Tokens))
		}
	}
	if len(got) != n || sum.Samples != n || sum.Aborted != aborted || sum.ID != st.ID() {
		t.Errorf("stream %s: %d samples (%d aborted), summary %+v: want %d samples", st.ID(), len(got), aborted, sum, n)
	}
	return got, sum
}

func indices(rs []SampleReply) []int {
	out := make([]int, len(rs))
	for i, r := range rs {
		out[i] = r.Index
	}
	return out
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func contains(s string, subs ...string) bool {
	for _, x := range subs {
		if !strings.Contains(s, x) {
			return false
		}
	}
	return true
}
