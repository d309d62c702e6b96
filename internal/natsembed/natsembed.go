// Package natsembed runs a NATS server inside the process: JetStream on,
// listening on loopback only. `rollout-worker serve` without --nats-url and
// `rollout-worker demo` use it, so one binary needs no deployment.
//
// The caller owns the Server: Shutdown stops it and waits for it; it is
// idempotent.
package natsembed

import (
	"fmt"
	"net"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// DefaultMaxPayload is the embedded server's max_payload unless Config
// says otherwise: 8 MiB rather than the NATS default of 1 MiB, so that a
// publisher may send refit chunks of more than 1 MiB (up to
// refit.MaxChunkBytes). The Go publisher's default chunk is 1 MiB whatever
// the server allows: taken live, smaller chunks pipeline better
// (docs/REFIT.md, "Throughput").
const DefaultMaxPayload = 8 << 20

// Config configures an embedded server.
type Config struct {
	Port       int    // 0: a free port
	StoreDir   string // JetStream files; "" makes a temporary directory, removed on Shutdown
	MaxPayload int32  // 0: DefaultMaxPayload
}

// Server is a running embedded server.
type Server struct {
	srv     *server.Server
	url     string
	tempDir string
}

// Start starts a server on 127.0.0.1 and waits until it accepts clients.
func Start(cfg Config) (*Server, error) {
	s := &Server{}
	if cfg.StoreDir == "" {
		dir, err := os.MkdirTemp("", "rollout-worker-nats-")
		if err != nil {
			return nil, fmt.Errorf("natsembed: %w", err)
		}
		cfg.StoreDir, s.tempDir = dir, dir
	}
	if cfg.MaxPayload == 0 {
		cfg.MaxPayload = DefaultMaxPayload
	}
	port := cfg.Port
	if port == 0 {
		port = server.RANDOM_PORT
	}
	opts := &server.Options{ServerName: "rollout-worker-embedded", Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true,
		MaxPayload: cfg.MaxPayload, JetStream: true, StoreDir: cfg.StoreDir}
	srv, err := server.NewServer(opts)
	if err != nil {
		s.cleanup()
		return nil, fmt.Errorf("natsembed: %w", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		s.cleanup()
		return nil, fmt.Errorf("natsembed: server not ready after 10s")
	}
	addr, ok := srv.Addr().(*net.TCPAddr)
	if !ok {
		srv.Shutdown()
		s.cleanup()
		return nil, fmt.Errorf("natsembed: server listens on %v", srv.Addr())
	}
	s.srv, s.url = srv, fmt.Sprintf("nats://127.0.0.1:%d", addr.Port)
	return s, nil
}

// URL is the client URL.
func (s *Server) URL() string { return s.url }

// StoreDir is the JetStream directory.
func (s *Server) StoreDir() string { return s.srv.JetStreamConfig().StoreDir }

// Shutdown stops the server and waits for it.
func (s *Server) Shutdown() {
	if s.srv == nil {
		return
	}
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
	s.srv = nil
	s.cleanup()
}

func (s *Server) cleanup() {
	if s.tempDir != "" {
		os.RemoveAll(s.tempDir)
		s.tempDir = ""
	}
}
