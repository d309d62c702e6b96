package main

import (
	"bufio"
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestNATSCommand: `nats --port 0` prints its URL first, serves clients
// with JetStream on until its context ends, then returns nil; bad flags
// are usage errors.
func TestNATSCommand(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	var errOut strings.Builder
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, []string{"nats", "--port", "0", "--store-dir", t.TempDir()}, pw, &errOut)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("no first line: %v (stderr %q)", err, errOut.String())
	}
	url, ok := strings.CutPrefix(strings.TrimSpace(line), "nats server listening on ")
	if !ok {
		t.Fatalf("first line %q", line)
	}
	go io.Copy(io.Discard, pr)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatalf("JetStream: %v", err)
	}
	cancel()
	select {
	case c := <-code:
		if c != 0 {
			t.Fatalf("exit %d: %s", c, errOut.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the server did not stop")
	}

	for _, args := range [][]string{{"--port", "-1"}, {"--port", "65536"}, {"--max-payload", "0"}, {"--max-payload", "67108865"}, {"extra"}} {
		var out, errb strings.Builder
		if c := run(context.Background(), append([]string{"nats"}, args...), &out, &errb); c != 2 {
			t.Errorf("nats %v: exit %d, want 2 (%s)", args, c, errb.String())
		}
	}
}
