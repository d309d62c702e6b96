package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/rollout-worker/rollout-worker/rollout"
)

// buildBinary builds the command once per test run.
func buildBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "rollout-worker")
	cmd := exec.Command("go", "build", "-o", bin, ".") // the test's own build settings: its cache serves
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// TestServeDrainsOnSIGTERM starts `serve` as a real process with its
// embedded NATS server, drives it through the client, sends SIGTERM under
// load, and checks that every admitted request got its final reply
// (complete, or with aborted samples): none lost, none duplicated.
func TestServeDrainsOnSIGTERM(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := buildBinary(t)
	cmd := exec.Command(bin, "serve", "--http-addr", "", "--log-format", "json", "--drain-timeout", "100ms", "--model-id", "sig")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	lines := bufio.NewScanner(stdout)
	var url string
	for lines.Scan() {
		l := lines.Text()
		if u, ok := strings.CutPrefix(l, "embedded NATS server: "); ok {
			url = u
		}
		if strings.HasPrefix(l, "worker ") && strings.Contains(l, "ready") {
			break
		}
	}
	if url == "" {
		t.Fatalf("serve printed no NATS URL; stderr:\n%s", stderr.String())
	}
	go io.Copy(io.Discard, stdout)
	// Reconnects on: the embedded server dies with the process, and a closed
	// connection makes NextMsg drop replies that had already arrived (the
	// last summaries, read by a client goroutine slower than the exit);
	// a reconnecting one still hands them out.
	nc, err := nats.Connect(url, nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	client := rollout.NewClient(nc, "sig")
	client.IdleTimeout = 10 * time.Second

	type outcome struct {
		admitted, complete, aborted, refused, dup, missing int
	}
	var mu sync.Mutex
	var total outcome
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				seed := uint64(c*1000 + i)
				n := 1 + i%3
				s, err := client.Generate(ctx, rollout.GenerateRequest{Schema: rollout.Schema, Prompt: []int32{1, 2, 3, int32(c)}, N: n,
					Temperature: 1, MaxTokens: 20 + ((c+i)%4)*330, Seed: &seed}) // short ones finish, long ones (up to 1010 of the context of 1024) are cut by the drain
				if err != nil {
					mu.Lock()
					total.refused++
					mu.Unlock()
					return
				}
				seen := map[int]bool{}
				var o outcome
				for {
					smp, err := s.Next(ctx)
					if errors.Is(err, io.EOF) {
						break
					}
					if err != nil {
						if len(seen) == 0 { // refused before admission (draining)
							o.refused++
						} else {
							o.missing++ // admitted, but no final reply
						}
						break
					}
					if seen[smp.Index] {
						o.dup++
					}
					seen[smp.Index] = true
					if smp.FinishReason == rollout.FinishAbort {
						o.aborted++
					}
				}
				if sum, ok := s.Summary(); ok {
					o.admitted++
					if sum.Samples != n || len(seen) != n {
						o.missing++
					} else {
						o.complete++
					}
				}
				s.Close()
				mu.Lock()
				total.admitted += o.admitted
				total.complete += o.complete
				total.aborted += o.aborted
				total.refused += o.refused
				total.dup += o.dup
				total.missing += o.missing
				mu.Unlock()
				if o.refused > 0 {
					return
				}
			}
		}()
	}
	// Under load: every fourth client started with a long request (1010
	// tokens), so once a few short ones are complete the long ones are
	// still running and the drain has something to cut, on any machine.
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		mu.Lock()
		complete := total.complete
		mu.Unlock()
		if complete >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d requests complete after 20 s; stderr:\n%s", complete, stderr.String())
		}
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var exitErr error
	select {
	case exitErr = <-done:
	case <-time.After(20 * time.Second):
		t.Fatalf("serve did not exit after SIGTERM; stderr:\n%s", stderr.String())
	}
	close(stop)
	// Streams that had their replies read them from the client's buffers;
	// a request sent after the server died waits for nothing: after a grace
	// period, closing the connection ends it (refused: no sample seen).
	waited := make(chan struct{})
	go func() { wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(5 * time.Second):
		nc.Close()
		<-waited
	}
	t.Logf("admitted %d, complete %d, aborted samples %d, refused %d", total.admitted, total.complete, total.aborted, total.refused)
	if exitErr != nil {
		t.Fatalf("serve exited with %v; stderr:\n%s", exitErr, stderr.String())
	}
	if total.admitted == 0 || total.aborted == 0 || total.missing != 0 || total.dup != 0 {
		t.Fatalf("admitted %d requests (%d samples aborted by the drain): %d without their full final reply, %d duplicated samples",
			total.admitted, total.aborted, total.missing, total.dup)
	}
	if !strings.Contains(stderr.String(), `"draining"`) {
		t.Fatalf("no drain in the log:\n%s", stderr.String())
	}
}
