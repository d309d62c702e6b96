package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/rollout-worker/rollout-worker/internal/natsembed"
)

const natsUsage = `Usage: rollout-worker nats [flags]

Runs a NATS server with JetStream, the one serve embeds, on 127.0.0.1 until
interrupted: for a host without nats-server, and for spreading a weight
version's parts over several servers' cores (publish --part-servers, serve
--refit-part-servers; bench refit --servers runs them so). Its first line
on stdout is "nats server listening on URL".

Flags:
`

// maxNATSPayload is the largest max_payload NATS accepts.
const maxNATSPayload = 64 << 20

func runNATS(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("nats", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), natsUsage)
		fs.PrintDefaults()
	}
	port := fs.Int("port", 4222, "client `port` on 127.0.0.1 (0: a free one)")
	storeDir := fs.String("store-dir", "", "JetStream `directory` (empty: a temporary one, removed at exit)")
	maxPayload := fs.Int("max-payload", natsembed.DefaultMaxPayload, "largest message in `bytes`")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	switch {
	case *port < 0 || *port > 65535:
		return usageErrorf("--port %d: want 0 to 65535", *port)
	case *maxPayload < 1 || *maxPayload > maxNATSPayload:
		return usageErrorf("--max-payload %d: want 1 to %d", *maxPayload, maxNATSPayload)
	}
	srv, err := natsembed.Start(natsembed.Config{Port: *port, StoreDir: *storeDir, MaxPayload: int32(*maxPayload)})
	if err != nil {
		return err
	}
	defer srv.Shutdown()
	fmt.Fprintf(stdout, "nats server listening on %s\n", srv.URL())
	<-ctx.Done()
	return nil
}
