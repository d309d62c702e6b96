package worker

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/kernels/cpu/cputest"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
)

// TestRefitFailureFailsTheWorker: when the refit receiver stops on its own
// (here: a commit fails on the device after the weights changed), the
// worker is failed: Failed closes, Err names the receiver, Ready is false.
func TestRefitFailureFailsTheWorker(t *testing.T) {
	base, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	be := &cputest.RequantFault{Backend: base}
	cfg := testConfig()
	cfg.Backend = be
	nc := startNATS(t)
	w, err := New(context.Background(), nc, cfg, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}

	mc, err := policy.Preset(cfg.Preset)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := policy.WriteRandomModel(dir, mc, 2); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(dir, policy.SingleFileName))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	p, err := refit.NewPublisher(nc, refit.PublisherConfig{Model: cfg.ModelID}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	be.Armed.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := p.Publish(ctx, 1, f, fi.Size(), true); err != nil {
		t.Fatal(err)
	}
	select {
	case <-w.Failed():
	case <-ctx.Done():
		t.Fatal("the worker did not fail after its refit receiver stopped")
	}
	if err := w.Err(); err == nil || !strings.Contains(err.Error(), "refit receiver") || !strings.Contains(err.Error(), "injected device fault") {
		t.Fatalf("Err() = %v, want the refit receiver's failure", err)
	}
	if w.Ready() {
		t.Fatal("a failed worker reports ready")
	}
}
