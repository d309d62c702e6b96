package natsembed

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func TestStart(t *testing.T) {
	s, err := Start(Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Shutdown()
	nc, err := nats.Connect(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.AccountInfo(context.Background()); err != nil {
		t.Fatalf("JetStream is not on: %v", err)
	}
	s.Shutdown()
	s.Shutdown() // idempotent
}
