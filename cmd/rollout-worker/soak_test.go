package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
	"github.com/rollout-worker/rollout-worker/rollout"
)

// soakFor turns TestSoak on: go test ./cmd/rollout-worker -run TestSoak -soak 2m -v
var (
	soakFor   = flag.Duration("soak", 0, "TestSoak: how long the clients run (0 skips the soak test)")
	soakChaos = flag.Duration("soak-chaos", 8*time.Second, "TestSoak: time between faults (nats-server killed, worker stopped or killed)")
)

// TestSoak runs a standalone nats-server (JetStream on disk) and a worker
// process (`serve`, CPU backend), 16 clients sending requests one after the
// other, and a trainer publishing a full weight version every second, while
// faults come every --soak-chaos in turn: nats-server killed (SIGKILL) and
// restarted on the same port and store; the worker drained (SIGTERM) and
// restarted; the worker killed (SIGKILL) and restarted. Clients retry a
// request until it completes (an attempt cut short is dropped whole), each
// asking for at least the newest version the trainer saw applied.
//
// Reported, and required to be zero: lost requests (never completed),
// duplicated samples (an index twice in one reply), mixed-version replies
// (a token produced under a version older than the request's minimum or
// never published, or versions going back within a sample); and every
// drained worker exits 0.
func TestSoak(t *testing.T) {
	if *soakFor <= 0 {
		t.Skip("soak test off: run it with -soak DURATION, e.g. go test ./cmd/rollout-worker -run TestSoak -soak 2m -v")
	}
	const (
		model   = "soak"
		preset  = "tiny"
		seed    = 1
		clients = 16
	)
	dir := t.TempDir()
	bin := buildBinary(t)
	natsBin := filepath.Join(dir, "nats-server")
	if out, err := exec.Command("go", "build", "-o", natsBin, "github.com/nats-io/nats-server/v2").CombinedOutput(); err != nil {
		t.Fatalf("build nats-server: %v\n%s", err, out)
	}
	port := freePort(t)
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	natsArgs := []string{"-a", "127.0.0.1", "-p", strconv.Itoa(port), "-js", "-sd", filepath.Join(dir, "js")}
	srv := startProc(t, "nats-server", natsBin, natsArgs...)
	waitNATS(t, url)

	var workerSeq atomic.Int32
	startWorkerProc := func() *proc {
		id := fmt.Sprintf("soak-w%d", workerSeq.Add(1))
		p := startProc(t, id, bin, "serve", "--nats-url", url, "--preset", preset, "--seed", strconv.Itoa(seed), "--device", "cpu",
			"--model-id", model, "--worker-id", id, "--http-addr", "", "--log-format", "json", "--drain-timeout", "5s",
			"--kv-pages", "2048", "--max-n", "4", "--max-tokens", "64", "--max-prompt-tokens", "64", "--max-queue", "64")
		if err := p.waitLine("ready", 60*time.Second); err != nil {
			t.Fatalf("%s: %v\n%s", id, err, p.output())
		}
		return p
	}
	var wmu sync.Mutex
	w := startWorkerProc()
	currentWorker := func() *proc { wmu.Lock(); defer wmu.Unlock(); return w }

	connect := func(name string) *nats.Conn {
		nc, err := nats.Connect(url, nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond),
			nats.ReconnectBufSize(-1))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
	tr := newSoakTrainer(t, connect("trainer"), model, preset, seed)
	client := rollout.NewClient(connect("driver"), model)
	client.IdleTimeout = 7 * time.Second // > the 5 s heartbeat: a dead worker is noticed, a slow one is not

	runCtx, stop := context.WithTimeout(context.Background(), *soakFor)
	defer stop()
	var (
		wg                             sync.WaitGroup
		minVersion, published          atomic.Uint64
		completed, retries, lost       atomic.Int64
		dup, mixed, samples, tokens    atomic.Int64
		mu                             sync.Mutex
		faults                         []string
		drainExits, badExits, restarts int
	)
	report := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		faults = append(faults, fmt.Sprintf(format, args...))
	}

	wg.Add(1)
	go func() { // the trainer: a full version every second, retried through outages
		defer wg.Done()
		for v := uint64(1); runCtx.Err() == nil; {
			// A version counts as published from its first byte: one whose
			// publish failed mid-way (nats-server killed) may still reach a
			// worker complete from the stream, and it is retried as it is.
			published.Store(v)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			applied, err := tr.publish(ctx, v)
			cancel()
			if applied {
				minVersion.Store(v)
			}
			if err == nil || applied {
				v++
			}
			select {
			case <-runCtx.Done():
			case <-time.After(time.Second):
			}
		}
	}()

	wg.Add(1)
	go func() { // faults, in turn
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-runCtx.Done():
				return
			case <-time.After(*soakChaos):
			}
			switch i % 3 {
			case 0:
				if err := srv.signal(syscall.SIGKILL, 5*time.Second); err != nil {
					report("kill nats-server: %v", err)
				}
				time.Sleep(500 * time.Millisecond)
				srv = startProc(t, "nats-server", natsBin, natsArgs...)
				report("nats-server killed and restarted")
			case 1, 2:
				sig, what := syscall.SIGTERM, "drained"
				if i%3 == 2 {
					sig, what = syscall.SIGKILL, "killed"
				}
				old := currentWorker()
				err := old.signal(sig, 20*time.Second)
				mu.Lock()
				switch {
				case sig == syscall.SIGTERM && err == nil:
					drainExits++
				case sig == syscall.SIGTERM:
					badExits++
				}
				mu.Unlock()
				if sig == syscall.SIGTERM && err != nil {
					report("%s: SIGTERM: %v\n%s", old.name, err, old.output())
				}
				nw := startWorkerProc()
				wmu.Lock()
				w = nw
				restarts++
				wmu.Unlock()
				report("worker %s %s, %s started", old.name, what, nw.name)
			}
		}
	}()

	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(c), 77))
			for i := 0; runCtx.Err() == nil; i++ {
				prompt := make([]int32, 4+rng.IntN(29))
				for j := range prompt {
					prompt[j] = int32(2 + rng.IntN(500))
				}
				n, maxTokens, s := 1+rng.IntN(4), 4+rng.IntN(29), uint64(c)<<32|uint64(i)
				minV := minVersion.Load()
				deadline := time.Now().Add(90 * time.Second)
				for attempt := 0; ; attempt++ {
					r := &rolloutAttempt{client: c, seq: i, attempt: attempt, id: fmt.Sprintf("c%d-r%d-a%d", c, i, attempt), n: n, maxTokens: maxTokens, seed: s}
					ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
					r.samples, r.sum, r.err = client.GenerateAll(ctx, rollout.GenerateRequest{ID: r.id, Prompt: prompt, N: n,
						Temperature: 1, MaxTokens: maxTokens, Seed: &s, MinPolicyVersion: minV, MaxWaitMS: 20000})
					cancel()
					if r.err == nil && r.sum.Aborted == 0 {
						if err := checkRollout(r); err != nil {
							if strings.Contains(err.Error(), "twice") {
								dup.Add(1)
							}
							report("%s: %v", r.id, err)
						}
						if err := checkVersions(r, minV, published.Load()); err != nil {
							mixed.Add(1)
							report("%s: %v", r.id, err)
						}
						completed.Add(1)
						samples.Add(int64(len(r.samples)))
						tokens.Add(int64(r.sum.GeneratedTokens))
						break
					}
					if time.Now().After(deadline) {
						lost.Add(1)
						report("%s: never completed: %v", r.id, r.err)
						break
					}
					retries.Add(1)
					time.Sleep(200 * time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	final := currentWorker()
	if err := final.signal(syscall.SIGTERM, 20*time.Second); err != nil {
		t.Errorf("final drain: %v\n%s", err, final.output())
	} else {
		drainExits++
	}
	srv.signal(syscall.SIGTERM, 5*time.Second)

	t.Logf("soak: %v, %d clients, faults every %v: %d worker restarts, nats-server restarts every third fault", *soakFor, clients, *soakChaos, restarts)
	t.Logf("requests: %d completed (%d samples, %d tokens), %d retried attempts; lost %d, duplicated %d, mixed-version %d",
		completed.Load(), samples.Load(), tokens.Load(), retries.Load(), lost.Load(), dup.Load(), mixed.Load())
	t.Logf("versions: %d published, %d confirmed applied; drained workers exiting 0: %d, otherwise: %d",
		published.Load(), minVersion.Load(), drainExits, badExits)
	for _, f := range faults {
		t.Log(f)
	}
	if lost.Load()+dup.Load()+mixed.Load() > 0 || badExits > 0 {
		t.Errorf("lost %d, duplicated %d, mixed-version %d, drained workers exiting non-zero %d: want all 0",
			lost.Load(), dup.Load(), mixed.Load(), badExits)
	}
	if completed.Load() == 0 || minVersion.Load() == 0 {
		t.Errorf("%d requests completed, version %d applied: the soak did no work", completed.Load(), minVersion.Load())
	}
}

// checkVersions: every token of r was produced under a published version no
// older than the request's minimum, and versions never go back in a sample.
func checkVersions(r *rolloutAttempt, min, published uint64) error {
	for _, s := range r.samples {
		for i, v := range s.Versions {
			switch {
			case v < min:
				return fmt.Errorf("sample %d token %d: version %d, the request asked for at least %d", s.Index, i, v, min)
			case v > published:
				return fmt.Errorf("sample %d token %d: version %d was never published (newest %d)", s.Index, i, v, published)
			case i > 0 && v < s.Versions[i-1]:
				return fmt.Errorf("sample %d: versions go back: %v", s.Index, s.Versions)
			}
		}
	}
	return nil
}

// soakTrainer publishes full versions of the preset's weights, each a
// perturbation of the last.
type soakTrainer struct {
	dir     string
	weights []byte
	pub     *refit.Publisher
	wrote   uint64 // newest version written to dir
}

func newSoakTrainer(t *testing.T, nc *nats.Conn, model, preset string, seed uint64) *soakTrainer {
	t.Helper()
	pc, err := policy.Preset(preset)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := policy.WriteRandomModel(dir, pc, seed); err != nil {
		t.Fatal(err)
	}
	weights, err := os.ReadFile(filepath.Join(dir, policy.SingleFileName))
	if err != nil {
		t.Fatal(err)
	}
	pub, err := refit.NewPublisher(nc, refit.PublisherConfig{Model: model, Storage: jetstream.FileStorage}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &soakTrainer{dir: dir, weights: weights, pub: pub}
}

// publish publishes version v (written once, republished as it is on a
// retry) and reports whether a worker applied it.
func (tr *soakTrainer) publish(ctx context.Context, v uint64) (applied bool, err error) {
	path := filepath.Join(tr.dir, fmt.Sprintf("v%d.safetensors", v))
	if tr.wrote < v {
		if err := perturb(tr.weights, v); err != nil {
			return false, err
		}
		if err := os.WriteFile(path, tr.weights, 0o644); err != nil {
			return false, err
		}
		tr.wrote = v
	}
	src, err := refit.OpenSource(path, nil)
	if err != nil {
		return false, err
	}
	defer src.Close()
	col, err := tr.pub.Statuses(ctx, v)
	if err != nil {
		return false, err
	}
	defer col.Close()
	if _, err := tr.pub.Publish(ctx, v, src, src.Size(), src.Full()); err != nil {
		return false, err
	}
	statuses, err := col.Wait(ctx, 1)
	for _, s := range statuses {
		applied = applied || s.State == refit.StateApplied && s.Version == v
	}
	return applied, err
}

// proc is a child process whose output is kept.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
	mu   sync.Mutex
	out  strings.Builder
	seen chan string // stdout lines until someone stops reading
}

func startProc(t *testing.T, name, bin string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, cmd: exec.Command(bin, args...), done: make(chan struct{}), seen: make(chan string, 64)}
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stderr = writerFunc(func(b []byte) (int, error) {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.out.Len() < 1<<20 {
			p.out.Write(b)
		}
		return len(b), nil
	})
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case p.seen <- sc.Text():
			default:
			}
		}
		io.Copy(io.Discard, stdout)
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() { p.signal(syscall.SIGKILL, 5*time.Second) })
	return p
}

// waitLine waits for a stdout line containing s.
func (p *proc) waitLine(s string, timeout time.Duration) error {
	deadline := time.After(timeout)
	for {
		select {
		case l := <-p.seen:
			if strings.Contains(l, s) {
				return nil
			}
		case <-p.done:
			return fmt.Errorf("exited before %q: %v", s, p.err)
		case <-deadline:
			return fmt.Errorf("no %q within %v", s, timeout)
		}
	}
}

// signal sends sig and waits for the exit; for SIGTERM a non-zero exit is
// an error.
func (p *proc) signal(sig syscall.Signal, timeout time.Duration) error {
	select {
	case <-p.done:
		return nil
	default:
	}
	if err := p.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s did not exit within %v of %v", p.name, timeout, sig)
	}
	if sig == syscall.SIGTERM && p.err != nil {
		return fmt.Errorf("%s: exit after SIGTERM: %w", p.name, p.err)
	}
	return nil
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// waitNATS waits until a server answers at url.
func waitNATS(t *testing.T, url string) {
	t.Helper()
	for end := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		nc, err := nats.Connect(url)
		if err == nil {
			nc.Close()
			return
		}
		if time.Now().After(end) {
			t.Fatalf("nats-server at %s: %v", url, err)
		}
	}
}
