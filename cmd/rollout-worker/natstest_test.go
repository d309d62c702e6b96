package main

import (
	"context"
	"errors"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/internal/natsembed"
	"github.com/rollout-worker/rollout-worker/worker"
)

// testNATS starts an embedded NATS server for the test and returns its URL
// and a function that opens named connections to it; all are closed when
// the test ends.
func testNATS(t *testing.T) (url string, connect func(name string) *nats.Conn) {
	t.Helper()
	srv, err := natsembed.Start(natsembed.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv.URL(), func(name string) *nats.Conn {
		t.Helper()
		nc, err := nats.Connect(srv.URL(), nats.Name(name))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
}

// startTestWorker builds and starts a worker on nc; the caller closes it.
func startTestWorker(t *testing.T, nc *nats.Conn, cfg worker.Config, log *zap.Logger, reg prometheus.Registerer) (*worker.Worker, error) {
	t.Helper()
	w, err := worker.New(context.Background(), nc, cfg, log, reg)
	if err != nil {
		return nil, err
	}
	if err := w.Start(); err != nil {
		return nil, errors.Join(err, w.Close())
	}
	return w, nil
}
