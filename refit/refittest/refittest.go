// Package refittest runs an embedded NATS server with JetStream for the
// tests of package refit and of the commands that use it.
//
// StartServer listens on 127.0.0.1 at a free port and keeps its JetStream
// store under t.TempDir(). Restart shuts the server down and starts it
// again on the same port and store directory, so file-stored streams (and
// KV buckets) survive: that is how tests interrupt a transfer. Every server
// is shut down by t.Cleanup; Connect's connections are closed before it
// (cleanups run last-in first-out).
package refittest

import (
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// DefaultMaxPayload is the server's max_payload unless WithMaxPayload says
// otherwise (the NATS default, 1 MiB).
const DefaultMaxPayload = 1 << 20

// readyTimeout bounds how long a starting server may take to accept clients.
const readyTimeout = 10 * time.Second

// Option configures StartServer.
type Option func(*server.Options)

// WithMaxPayload sets the server's max_payload in bytes.
func WithMaxPayload(n int32) Option {
	return func(o *server.Options) { o.MaxPayload = n }
}

// WithJetStreamLimits caps the JetStream memory and file storage, in bytes
// (0 keeps the server's default).
func WithJetStreamLimits(memory, file int64) Option {
	return func(o *server.Options) {
		if memory > 0 {
			o.JetStreamMaxMemory = memory
		}
		if file > 0 {
			o.JetStreamMaxStore = file
		}
	}
}

// Server is an embedded NATS server with JetStream enabled.
type Server struct {
	mu   sync.Mutex
	opts server.Options // Port is the bound port once started
	srv  *server.Server // nil while shut down
}

// StartServer starts a server for the test and registers its shutdown with
// t.Cleanup.
func StartServer(t testing.TB, opts ...Option) *Server {
	t.Helper()
	s := &Server{opts: server.Options{
		ServerName: "refittest",
		Host:       "127.0.0.1",
		Port:       server.RANDOM_PORT,
		NoLog:      true,
		NoSigs:     true,
		MaxPayload: DefaultMaxPayload,
		JetStream:  true,
		StoreDir:   t.TempDir(),
		// No HTTP monitoring, cluster, gateway or leaf listeners: their
		// zero values leave them off.
	}}
	for _, o := range opts {
		o(&s.opts)
	}
	t.Cleanup(s.Shutdown)
	if err := s.start(); err != nil {
		t.Fatalf("refittest: %v", err)
	}
	return s
}

// start starts a server with s.opts and records the port it bound.
func (s *Server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv != nil {
		return fmt.Errorf("server already running at port %d", s.opts.Port)
	}
	opts := s.opts // NewServer keeps and mutates its options
	srv, err := server.NewServer(&opts)
	if err != nil {
		return fmt.Errorf("new server: %w", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(readyTimeout) {
		srv.Shutdown()
		srv.WaitForShutdown()
		return fmt.Errorf("server on %s:%d not ready after %v", s.opts.Host, s.opts.Port, readyTimeout)
	}
	addr, ok := srv.Addr().(*net.TCPAddr)
	if !ok {
		srv.Shutdown()
		srv.WaitForShutdown()
		return fmt.Errorf("server listens on %v, not TCP", srv.Addr())
	}
	s.opts.Port = addr.Port // Restart binds the same port again
	s.srv = srv
	return nil
}

// URL is the client URL, nats://127.0.0.1:PORT. It stays the same across
// Restart.
func (s *Server) URL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprintf("nats://%s:%d", s.opts.Host, s.opts.Port)
}

// StoreDir is the JetStream store directory.
func (s *Server) StoreDir() string { return s.opts.StoreDir }

// MaxPayload is the server's max_payload.
func (s *Server) MaxPayload() int32 { return s.opts.MaxPayload }

// Restart shuts the server down (waiting until it has stopped and flushed
// its store) and starts it again on the same port and store directory.
// Clients made by Connect reconnect by themselves. It may be called from
// any goroutine; t.Fatalf is only reported, not called, off the test's own
// goroutine, so Restart returns an error as well.
func (s *Server) Restart(t testing.TB) error {
	t.Helper()
	s.Shutdown()
	if err := s.start(); err != nil {
		err = fmt.Errorf("refittest: restart: %w", err)
		t.Error(err)
		return err
	}
	return nil
}

// Shutdown stops the server and waits until it has. It is idempotent.
func (s *Server) Shutdown() {
	s.mu.Lock()
	srv := s.srv
	s.srv = nil
	s.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
}

// Connect connects to url with settings for tests: unlimited reconnects,
// a short reconnect wait and no jitter, a reconnect buffer large enough for
// the tests' transfers, and asynchronous errors (a server going away)
// dropped rather than printed. The connection is closed by t.Cleanup.
func Connect(t testing.TB, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	all := append([]nats.Option{
		nats.Name("refittest"),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(20 * time.Millisecond),
		nats.ReconnectJitter(0, 0),
		nats.Timeout(2 * time.Second),
		nats.ReconnectBufSize(64 << 20),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}),
	}, opts...)
	nc, err := nats.Connect(url, all...)
	if err != nil {
		t.Fatalf("refittest: connect %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}
