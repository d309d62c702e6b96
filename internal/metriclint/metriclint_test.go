package metriclint

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/cudagraph"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
	"github.com/rollout-worker/rollout-worker/rollout"
)

// prefix starts the name of every metric the project defines.
const prefix = "rollout_worker_"

// foreignPrefixes start the names of the client library's Go and process
// collectors, which serve registers next to ours: not ours to name.
var foreignPrefixes = []string{"go_", "process_"}

// recorder is a registry that remembers what was registered on it, so the
// test can give every labelled metric a child: a vector without children
// gathers nothing, and promlint would never see its name.
type recorder struct {
	*prometheus.Registry
	collectors []prometheus.Collector
}

func (r *recorder) Register(c prometheus.Collector) error {
	if err := r.Registry.Register(c); err != nil {
		return err
	}
	r.collectors = append(r.collectors, c)
	return nil
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// labelValues calls get with 0, 1, 2, ... empty label values until it
// accepts them, creating one child of the vector get belongs to.
func labelValues(get func(...string) error) error {
	var err error
	for n := range 16 {
		if err = get(make([]string, n)...); err == nil {
			return nil
		}
	}
	return fmt.Errorf("no label count from 0 to 15 fits: %w", err)
}

// fillVectors gives every vector registered on r one child.
func (r *recorder) fillVectors() error {
	var errs []error
	for _, c := range r.collectors {
		var err error
		switch v := c.(type) {
		case *prometheus.CounterVec:
			err = labelValues(func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err })
		case *prometheus.GaugeVec:
			err = labelValues(func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err })
		case *prometheus.HistogramVec:
			err = labelValues(func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err })
		case *prometheus.SummaryVec:
			err = labelValues(func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err })
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%T: %w", c, err))
		}
	}
	return errors.Join(errs...)
}

// registerAll registers every metric set of the project on r, each through
// its own constructor, plus the Go and process collectors serve adds.
// Registration fails on two metrics of one name.
func registerAll(t *testing.T, r *recorder) {
	t.Helper()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	if _, err := policy.NewEngineMetrics(r); err != nil {
		t.Fatalf("policy.NewEngineMetrics: %v", err)
	}
	if _, err := cudagraph.NewMetrics(r); err != nil {
		t.Fatalf("cudagraph.NewMetrics: %v", err)
	}

	// refit's and rollout's metrics come with a receiver and a service,
	// which need a model and a NATS connection.
	pc, err := policy.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := policy.WriteRandomModel(dir, pc, 1); err != nil {
		t.Fatal(err)
	}
	be, err := cpu.New(cpu.Config{Workers: 1}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	m, err := policy.LoadModel(be, dir, policy.ModelOptions{Recipe: moe.RecipePerToken, MaxTokens: 64, MaxSeqs: 8,
		MaxLogitRows: 64, KVPages: 64, PageSize: 8})
	if err != nil {
		t.Fatalf("policy.LoadModel: %v", err)
	}
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Errorf("closing the model: %v", err)
		}
	})
	eng := policy.NewEngine(m, policy.EngineConfig{})
	srv := refittest.StartServer(t)
	nc := refittest.Connect(t, srv.URL())

	recv, err := refit.NewReceiver(nc, m, eng, refit.ReceiverConfig{Model: "lint", Worker: "lint-1"}, zap.NewNop(), r)
	if err != nil {
		t.Fatalf("refit.NewReceiver: %v", err)
	}
	t.Cleanup(func() {
		if err := recv.Close(); err != nil {
			t.Errorf("closing the refit receiver: %v", err)
		}
	})
	svc, err := rollout.NewService(nc, eng, rollout.Config{Model: "lint", Worker: "lint-1"}.WithModel(m), zap.NewNop(), r)
	if err != nil {
		t.Fatalf("rollout.NewService: %v", err)
	}
	t.Cleanup(func() {
		if err := svc.Stop(); err != nil {
			t.Errorf("stopping the rollout service: %v", err)
		}
	})
}

func TestMetricNames(t *testing.T) {
	r := &recorder{Registry: prometheus.NewRegistry()}
	registerAll(t, r)
	if err := r.fillVectors(); err != nil {
		t.Fatalf("giving every labelled metric a child: %v", err)
	}

	problems, err := testutil.GatherAndLint(r)
	if err != nil {
		t.Fatalf("gathering: %v", err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}

	mfs, err := r.Gather()
	if err != nil {
		t.Fatalf("gathering: %v", err)
	}
	ours := 0
	for _, mf := range mfs {
		name := mf.GetName()
		switch {
		case strings.HasPrefix(name, prefix):
			ours++
		case hasAnyPrefix(name, foreignPrefixes):
		default:
			t.Errorf("metric %s does not start with the project's prefix %q", name, prefix)
		}
	}
	if ours == 0 {
		t.Errorf("no metric starting with %q was gathered: the registration above registered nothing of ours", prefix)
	}
	t.Logf("%d metrics of ours linted", ours)
}

func hasAnyPrefix(s string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// TestLintSeesVectors: a labelled metric without children still reaches
// promlint, whatever its label count, and a bad name is reported.
func TestLintSeesVectors(t *testing.T) {
	tests := []struct {
		name     string
		metric   string
		labels   []string
		wantLint string // "" for none
	}{
		{name: "no labels", metric: "x_total", labels: nil},
		{name: "one label", metric: "x_total", labels: []string{"bucket"}},
		{name: "three labels", metric: "x_total", labels: []string{"a", "b", "c"}},
		{name: "counter without _total", metric: "x_requests", labels: []string{"code"}, wantLint: `counter metrics should have "_total" suffix`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &recorder{Registry: prometheus.NewRegistry()}
			r.MustRegister(prometheus.NewCounterVec(prometheus.CounterOpts{Name: tt.metric, Help: "x"}, tt.labels))
			if err := r.fillVectors(); err != nil {
				t.Fatalf("fillVectors: %v", err)
			}
			problems, err := testutil.GatherAndLint(r)
			if err != nil {
				t.Fatal(err)
			}
			var texts []string
			for _, p := range problems {
				texts = append(texts, p.Metric+": "+p.Text)
			}
			got := strings.Join(texts, "; ")
			switch {
			case tt.wantLint == "" && got != "":
				t.Errorf("lint problems %q, want none", got)
			case tt.wantLint != "" && !strings.Contains(got, tt.wantLint):
				t.Errorf("lint problems %q, want one containing %q", got, tt.wantLint)
			}
		})
	}
}
