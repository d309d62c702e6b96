package refit

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

// securityDoc holds the permission set that TestPermissions runs.
const securityDoc = "../docs/SECURITY.md"

// permissionsConf returns the nats-server configuration between the
// permissions markers of docs/SECURITY.md, for model testModel.
func permissionsConf(t *testing.T) string {
	t.Helper()
	doc, err := os.ReadFile(securityDoc)
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(doc), "<!-- permissions:begin -->")
	block, _, ok2 := strings.Cut(rest, "<!-- permissions:end -->")
	if !ok || !ok2 {
		t.Fatalf("%s: no permissions block", securityDoc)
	}
	block = strings.TrimSpace(block)
	block = strings.TrimPrefix(block, "```")
	block = strings.TrimSuffix(block, "```")
	return strings.ReplaceAll(block, "MODEL", testModel)
}

// permServer starts nats-server with JetStream and the documented users,
// and returns a URL builder for them.
func permServer(t *testing.T) func(user string) string {
	t.Helper()
	passwords := map[string]string{"trainer": "trainer-pw", "worker": "worker-pw", "driver": "driver-pw"}
	t.Setenv("REFIT_TRAINER_PASSWORD", passwords["trainer"])
	t.Setenv("REFIT_WORKER_PASSWORD", passwords["worker"])
	t.Setenv("ROLLOUT_DRIVER_PASSWORD", passwords["driver"])
	dir := t.TempDir()
	conf := fmt.Sprintf("listen: \"127.0.0.1:-1\"\njetstream { store_dir: %q }\n%s\n", filepath.Join(dir, "js"), permissionsConf(t))
	path := filepath.Join(dir, "nats.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(path)
	if err != nil {
		t.Fatalf("the permissions of %s: %v", securityDoc, err)
	}
	opts.NoLog, opts.NoSigs = true, true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("server not ready")
	}
	addr := srv.Addr().(*net.TCPAddr)
	return func(user string) string {
		return fmt.Sprintf("nats://%s:%s@127.0.0.1:%d", user, passwords[user], addr.Port)
	}
}

// permConn connects as one user and collects the connection's asynchronous
// errors (permission violations).
func permConn(t *testing.T, url string) (*nats.Conn, <-chan error) {
	t.Helper()
	errs := make(chan error, 64)
	nc, err := nats.Connect(url, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		select {
		case errs <- err:
		default:
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc, errs
}

// denied waits for a permission violation on subject.
func denied(t *testing.T, errs <-chan error, what, subject string) {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case err := <-errs:
			if strings.Contains(strings.ToLower(err.Error()), "permissions violation") && strings.Contains(err.Error(), subject) {
				return
			}
		case <-timeout:
			t.Fatalf("%s: no permissions violation for %s", what, subject)
		}
	}
}

// jsPurge purges a stream with the raw API request (a denied client cannot
// look the stream up first).
func jsPurge(ctx context.Context, nc *nats.Conn, stream string) error {
	reply, err := nc.RequestWithContext(ctx, "$JS.API.STREAM.PURGE."+stream, []byte("{}"))
	if err != nil {
		return err
	}
	if !strings.Contains(string(reply.Data), `"success":true`) {
		return fmt.Errorf("purge %s: %s", stream, reply.Data)
	}
	return nil
}

// permWorker is startWorker on a connection of its own whose asynchronous
// errors are collected.
func permWorker(t *testing.T, url, dir, id string, trust *Trust) (*worker, <-chan error) {
	t.Helper()
	m, err := policy.LoadModel(testBackend(t), dir, testOpts(moe.RecipePerToken))
	if err != nil {
		t.Fatal(err)
	}
	nc, errs := permConn(t, url)
	w := &worker{m: m, e: policy.NewEngine(m, policy.EngineConfig{}), nc: nc, done: make(chan error, 2)}
	cfg := ReceiverConfig{Model: testModel, Worker: id, ChunkTimeout: 5 * time.Second, Trust: trust}
	if w.r, err = NewReceiver(nc, m, w.e, cfg, testLogger(t), nil); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	go func() { w.done <- w.e.Run(ctx) }()
	go func() { w.done <- w.r.Run(ctx) }()
	t.Cleanup(w.stop)
	return w, errs
}

// TestPermissions runs the permission set of docs/SECURITY.md: the trainer
// publishes a signed version and a worker applies it, a driver requests
// rollouts from the worker, and neither a driver nor a worker can publish
// a version, write the bucket or purge the stream.
func TestPermissions(t *testing.T) {
	url := permServer(t)
	a, b := modelDir(t, 50), modelDir(t, 51)
	s := sgSigner(t)
	w, wErrs := permWorker(t, url("worker"), a, "w", sgTrust(t, s.PublicKey()))

	trainer, trainerErrs := permConn(t, url("trainer"))
	p, err := NewPublisher(trainer, PublisherConfig{Model: testModel, ChunkBytes: 64 << 10, Signer: s, PublishTimeout: 2 * time.Second}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	statuses, err := p.Statuses(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer statuses.Close()
	stream := subset(t, b, nil)
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := p.Publish(pctx, 1, strings.NewReader(string(stream)), int64(len(stream)), true); err != nil {
		t.Fatalf("trainer: publish: %v", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	got, err := statuses.Wait(wctx, 1)
	if err != nil || got[0].State != StateApplied {
		t.Fatalf("trainer: statuses %+v, %v", got, err)
	}
	if w.r.CurrentVersion() != 1 {
		t.Fatalf("worker serves %d, want 1", w.r.CurrentVersion())
	}
	// A worker that joins late reads the version from the stream; a
	// partial version whose live chunk 1 goes missing is read from the
	// stream too.
	late, lateErrs := permWorker(t, url("worker"), a, "late", sgTrust(t, s.PublicKey()))
	if st := late.waitStatus(t, 1); st.State != StateApplied {
		t.Fatalf("late worker: %+v", st)
	}
	late.r.liveHook = func(msg *nats.Msg) bool { return chunkSeq(msg) == 1 }
	if _, err := p.Publish(pctx, 2, strings.NewReader(string(subset(t, a, experts))), int64(len(subset(t, a, experts))), false); err != nil {
		t.Fatalf("trainer: publish: %v", err)
	}
	for _, x := range []*worker{w, late} {
		if st := x.waitStatus(t, 2); st.State != StateApplied {
			t.Fatalf("version 2: %+v", st)
		}
	}
	if _, n := late.chunks(t); n == 0 {
		t.Fatal("the late worker read no chunk from the stream")
	}
	if n, _ := w.chunks(t); n == 0 {
		t.Fatal("the worker took no chunk of version 2 live: its live subscription is not permitted")
	}
	for who, errs := range map[string]<-chan error{"trainer": trainerErrs, "worker": wErrs, "late worker": lateErrs} {
		select {
		case err := <-errs:
			t.Fatalf("%s: %v", who, err)
		default:
		}
	}

	// The worker serves rollouts; a driver requests them.
	svc, err := w.nc.Subscribe("rollout."+testModel+".echo", func(m *nats.Msg) { m.Respond(append([]byte("echo "), m.Data...)) })
	if err != nil {
		t.Fatal(err)
	}
	defer svc.Unsubscribe()
	if err := w.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	driver, driverErrs := permConn(t, url("driver"))
	if reply, err := driver.Request("rollout."+testModel+".echo", []byte("hi"), 5*time.Second); err != nil || string(reply.Data) != "echo hi" {
		t.Fatalf("driver: request: %v, %v", reply, err)
	}

	worker, workerErrs := permConn(t, url("worker"))
	for _, c := range []struct {
		who  string
		nc   *nats.Conn
		errs <-chan error
	}{{"driver", driver, driverErrs}, {"worker", worker, workerErrs}} {
		t.Run(c.who, func(t *testing.T) {
			// A chunk of a new version, straight on the stream's subject.
			subj := VersionSubject(testModel, 3)
			if err := c.nc.Publish(subj, []byte("bogus")); err != nil {
				t.Fatal(err)
			}
			denied(t, c.errs, "publish a chunk", subj)
			// The bucket's announcement, as a KV put does it.
			js, err := jetstream.New(c.nc)
			if err != nil {
				t.Fatal(err)
			}
			actx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			key := "$KV." + BucketName(testModel) + "." + KeyAnnounce
			if _, err := js.Publish(actx, key, []byte(`{"version":18446744073709551615}`)); err == nil {
				t.Fatal("wrote the bucket's announcement")
			}
			denied(t, c.errs, "write the bucket", key)
			// Purge the stream, create another on the refit subjects.
			pctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			if err := jsPurge(pctx, c.nc, StreamName(testModel)); err == nil {
				t.Fatal("purged the stream")
			}
			denied(t, c.errs, "purge the stream", "$JS.API.STREAM.PURGE."+StreamName(testModel))
			cctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			if _, err := js.CreateStream(cctx, jetstream.StreamConfig{Name: "EVIL", Subjects: []string{"refit.>"}}); err == nil {
				t.Fatal("created a stream")
			}
			denied(t, c.errs, "create a stream", "$JS.API.STREAM.CREATE.EVIL")
		})
	}

	// Nothing of it reached the stream or the bucket.
	js, err := jetstream.New(trainer)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(ctx, StreamName(testModel))
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(StreamSubjects(testModel)))
	if err != nil {
		t.Fatal(err)
	}
	if n := info.State.Subjects[VersionSubject(testModel, 3)]; n != 0 {
		t.Fatalf("%d messages on version 3's subject", n)
	}
	kv, err := js.KeyValue(ctx, BucketName(testModel))
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(ctx, KeyAnnounce)
	if err != nil {
		t.Fatal(err)
	}
	if an, err := ParseAnnounce(e.Value()); err != nil || an.Version != 2 {
		t.Fatalf("the announcement is now %s (%v)", e.Value(), err)
	}
	if w.r.CurrentVersion() != 2 {
		t.Fatalf("worker serves %d, want 2", w.r.CurrentVersion())
	}
}
