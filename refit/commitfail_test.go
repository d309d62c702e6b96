package refit

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/kernels/cpu/cputest"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// TestRefitCommitFailureIsFatal: a commit that fails after the live weights
// changed cannot be rolled back, so the version is rejected as fatal and
// the receiver stops with the error (the worker then fails and restarts).
func TestRefitCommitFailureIsFatal(t *testing.T) {
	base, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	be := &cputest.RequantFault{Backend: base}
	prev := testBackend
	testBackend = func(testing.TB) kernels.Backend { return be }
	t.Cleanup(func() { testBackend = prev })

	srv := refittest.StartServer(t)
	a, b := modelDir(t, 81), modelDir(t, 82)
	statuses := watchStatuses(t, srv.URL())
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	be.Armed.Store(true)
	publish(t, newPublisher(t, srv.URL()), 1, subset(t, b, nil), true)

	st := statuses.wait(t, "w", 1)
	if st.State != StateRejected || !strings.Contains(st.Reason, "fatal") || !strings.Contains(st.Reason, "commit") ||
		!strings.Contains(st.Reason, "injected device fault") {
		t.Fatalf("version 1: %+v, want rejected as a fatal commit failure", st)
	}
	select {
	case err := <-w.done:
		if !errors.Is(err, errFatal) || !strings.Contains(err.Error(), "injected device fault") {
			t.Fatalf("the receiver stopped with %v, want the fatal commit error", err)
		}
		w.done <- err // stop reads both loops' results
	case <-time.After(10 * time.Second):
		t.Fatal("the receiver did not stop after a fatal commit failure")
	}
}
