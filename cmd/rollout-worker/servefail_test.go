package main

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/rollout"
)

// faultyBackend is the CPU backend with two faults a test turns on: a Gemm
// that fails (a device error in the middle of an engine step), and then a
// Free that waits for a gate (so the test sees the worker while it drains).
type faultyBackend struct {
	*cpu.Backend
	failGemm atomic.Bool
	gate     chan struct{} // Free waits until it is closed
}

func (b *faultyBackend) Gemm(dst, a, w *kernels.Buffer) error {
	if b.failGemm.Load() {
		return errors.New("injected device fault")
	}
	return b.Backend.Gemm(dst, a, w)
}

func (b *faultyBackend) Free(buf *kernels.Buffer) error {
	if b.failGemm.Load() {
		select {
		case <-b.gate:
		case <-time.After(20 * time.Second):
		}
	}
	return b.Backend.Free(buf)
}

// TestServeExitsOnEngineFailure: when the engine loop stops on its own,
// serve fails /readyz, ends the request in flight with its final reply and
// returns the engine's error, which run maps to exit status 1.
func TestServeExitsOnEngineFailure(t *testing.T) {
	base, err := cpu.New(cpu.Config{}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	be := &faultyBackend{Backend: base, gate: make(chan struct{})}
	gateOpen := false
	openGate := func() {
		if !gateOpen {
			gateOpen = true
			close(be.gate)
		}
	}
	t.Cleanup(openGate)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	httpAddr := ln.Addr().String()
	ln.Close()
	url, connect := testNATS(t)

	done := make(chan error, 1)
	var stdout, stderr pubtSyncBuffer
	go func() {
		done <- serve(context.Background(), []string{"--nats-url", url, "--preset", "tiny", "--model-id", "tiny", "--device", "cpu",
			"--http-addr", httpAddr, "--log-format", "json", "--drain-timeout", "2s"}, &stdout, &stderr, be)
	}()
	readyz := func() int {
		resp, err := http.Get("http://" + httpAddr + "/readyz")
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for end := time.Now().Add(20 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
			select {
			case err := <-done:
				t.Fatalf("%s: serve returned %v; log:\n%s", what, err, stderr.String())
			default:
			}
			if time.Now().After(end) {
				t.Fatalf("%s: not after 20 s; serve's log:\n%s", what, stderr.String())
			}
		}
	}
	waitFor("/readyz 200", func() bool { return readyz() == http.StatusOK })

	be.failGemm.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	seed := uint64(3)
	st, err := rollout.NewClient(connect("driver"), "tiny").Generate(ctx, rollout.GenerateRequest{Schema: rollout.Schema,
		Prompt: []int32{1, 2, 3}, N: 2, Temperature: 1, MaxTokens: 8, Seed: &seed})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	aborted := 0
	for {
		smp, err := st.Next(ctx)
		if err != nil {
			if !errors.Is(err, io.EOF) {
				t.Fatalf("the request in flight got no final reply: %v", err)
			}
			break
		}
		if smp.FinishReason == rollout.FinishAbort {
			aborted++
		}
	}
	sum, ok := st.Summary()
	if !ok || aborted != 2 || !strings.Contains(sum.Error, "engine stopped") {
		t.Errorf("summary %+v (ok %v) after %d aborted samples, want 2 aborted and an \"engine stopped\" error", sum, ok, aborted)
	}

	// The worker is failed and drains; the model's buffers wait for the gate.
	waitFor("/readyz 503 while the failed worker drains", func() bool { return readyz() == http.StatusServiceUnavailable })
	openGate()
	select {
	case err = <-done:
	case <-time.After(20 * time.Second):
		t.Fatalf("serve did not return after the engine failed; log:\n%s", stderr.String())
	}
	if err == nil || !strings.Contains(err.Error(), "injected device fault") {
		t.Fatalf("serve returned %v, want the engine's error", err)
	}
	if code := exitCode("serve", err, &strings.Builder{}); code != 1 {
		t.Fatalf("exit status %d, want 1", code)
	}
	if !strings.Contains(stderr.String(), "worker failed; draining") {
		t.Errorf("serve's log does not say the worker failed:\n%s", stderr.String())
	}
}
