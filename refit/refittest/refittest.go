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
	"strings"
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

// WithCluster makes the server a member of the named cluster: it listens
// for routes on a free loopback port and routes to the given route URLs
// (nats-route://127.0.0.1:PORT of the members started before it).
func WithCluster(name string, routes ...string) Option {
	return func(o *server.Options) {
		o.Cluster.Name = name
		o.Cluster.Host = "127.0.0.1"
		o.Cluster.Port = server.RANDOM_PORT
		o.Routes = server.RoutesFromStr(strings.Join(routes, ","))
	}
}

// WithName sets the server's name (members of a cluster need distinct ones).
func WithName(name string) Option {
	return func(o *server.Options) { o.ServerName = name }
}

// RouteURL is the server's route URL, for WithCluster of the next member
// ("" when it is not in a cluster).
func (s *Server) RouteURL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv == nil || s.opts.Cluster.Name == "" {
		return ""
	}
	addr := s.srv.ClusterAddr()
	if addr == nil {
		return ""
	}
	return fmt.Sprintf("nats-route://127.0.0.1:%d", addr.Port)
}

// Traffic is what a server has carried since it started: messages and
// bytes in from and out to its connections (clients and routes alike).
type Traffic struct {
	InMsgs, OutMsgs, InBytes, OutBytes int64
}

// Traffic returns the server's counters (zero while it is shut down).
func (s *Server) Traffic() (Traffic, error) {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	if srv == nil {
		return Traffic{}, nil
	}
	v, err := srv.Varz(nil)
	if err != nil {
		return Traffic{}, fmt.Errorf("refittest: varz: %w", err)
	}
	return Traffic{InMsgs: v.InMsgs, OutMsgs: v.OutMsgs, InBytes: v.InBytes, OutBytes: v.OutBytes}, nil
}

// StartCluster starts n servers in one cluster with JetStream, each routed
// to those started before it, and waits until every one sees the others
// and JetStream has a meta leader. Shutdowns are registered with t.Cleanup.
func StartCluster(t testing.TB, name string, n int, opts ...Option) []*Server {
	t.Helper()
	var servers []*Server
	var routes []string
	for i := range n {
		o := append([]Option{WithName(fmt.Sprintf("%s-%d", name, i+1)), WithCluster(name, routes...)}, opts...)
		s := StartServer(t, o...)
		servers = append(servers, s)
		routes = append(routes, s.RouteURL())
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, s := range servers {
		for {
			s.mu.Lock()
			srv := s.srv
			s.mu.Unlock()
			if srv.NumRoutes() >= n-1 && srv.JetStreamIsClustered() && srv.JetStreamIsCurrent() {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("refittest: cluster %s not formed after 30s (%s has %d routes)", name, srv.Name(), srv.NumRoutes())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return servers
}
