package main

import (
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/rollout-worker/rollout-worker/internal/natsembed"
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
