//go:build linux

package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// rssEnv makes the test binary run the command line it is given instead of
// the tests: how TestPublishRSS runs publish in a process of its own.
const rssEnv = "ROLLOUT_WORKER_TEST_RUN_COMMAND"

func TestMain(m *testing.M) {
	if os.Getenv(rssEnv) == "1" {
		os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// rssCheckpointBytes is the size of the checkpoints TestPublishRSS
// publishes: well above the bound on the publisher's memory.
const rssCheckpointBytes = 40 * 64 << 20 // 2.5 GiB

// rssMaxBytes bounds the publisher's peak resident memory.
const rssMaxBytes = 1 << 30

// sparseCheckpoint writes a checkpoint of 40 BF16 tensors of 64 MiB (2.5
// GiB) as a sparse file: zeros, but for changed values at random places.
func sparseCheckpoint(t *testing.T, path string, seed uint64, changed int) {
	t.Helper()
	const tensors, rows, cols = 40, 4096, 8192
	var js strings.Builder
	js.WriteByte('{')
	for i := range tensors {
		if i > 0 {
			js.WriteByte(',')
		}
		fmt.Fprintf(&js, `"model.layers.%d.mlp.experts.0.down_proj.weight":{"dtype":"BF16","shape":[%d,%d],"data_offsets":[%d,%d]}`,
			i, rows, cols, int64(i)*rows*cols*2, int64(i+1)*rows*cols*2)
	}
	js.WriteByte('}')
	for (8+js.Len())%8 != 0 {
		js.WriteByte(' ')
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	head := binary.LittleEndian.AppendUint64(nil, uint64(js.Len()))
	head = append(head, js.String()...)
	if _, err := f.Write(head); err != nil {
		t.Fatal(err)
	}
	data := int64(tensors) * rows * cols * 2
	if err := f.Truncate(int64(len(head)) + data); err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(seed, seed))
	var v [2]byte
	for range changed {
		binary.LittleEndian.PutUint16(v[:], bf16.FromFloat32(float32(r.NormFloat64())+0.5))
		if _, err := f.WriteAt(v[:], int64(len(head))+2*r.Int64N(data/2)); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := stfile.OpenReader(path); err != nil {
		t.Fatal(err)
	}
}

// TestPublishRSS: the publish command, in a process of its own, publishes
// a 2.5 GiB checkpoint as a full version, then as a delta on another of
// that size (both read side by side in full), each within 1 GiB of peak
// resident memory (its rusage maxrss): the checkpoints are read in chunks
// (pread), never mapped or held whole. The JetStream server is this test's.
// Skipped with -short, under the race detector (its shadow memory is not
// the publisher's) and without 8 GiB of free disk (the server's file store
// takes a copy of the full version).
func TestPublishRSS(t *testing.T) {
	switch {
	case testing.Short():
		t.Skip("-short: publishes 2.5 GiB")
	case raceEnabled:
		t.Skip("the race detector's memory is not the publisher's")
	}
	dir := t.TempDir()
	var fs syscall.Statfs_t
	if err := syscall.Statfs(dir, &fs); err != nil {
		t.Fatal(err)
	}
	if free := int64(fs.Bavail) * int64(fs.Bsize); free < 8<<30 {
		t.Skipf("%d GiB of free disk: want 8", free>>30)
	}
	base, next := filepath.Join(dir, "base.safetensors"), filepath.Join(dir, "next.safetensors")
	sparseCheckpoint(t, base, 1, 1000)
	sparseCheckpoint(t, next, 2, 1000)
	srv := refittest.StartServer(t) // file storage, in a directory of the test
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"full", []string{"--version", "1", "--from", base}, "published full version 1"},
		{"delta", []string{"--version", "2", "--from", next, "--base", base}, "a delta on version 1"},
	} {
		cmd := exec.Command(exe, append([]string{"publish", "--nats-url", srv.URL(), "--model-id", "rss"}, c.args...)...)
		cmd.Env = append(os.Environ(), rssEnv+"=1")
		start := time.Now()
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", c.name, err, out)
		}
		if !strings.Contains(string(out), c.want) {
			t.Fatalf("%s: output lacks %q:\n%s", c.name, c.want, out)
		}
		rss := cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss << 10 // KiB on Linux
		t.Logf("%s: peak RSS %d MiB publishing a %.1f GiB checkpoint, %.1fs\n%s", c.name, rss>>20,
			float64(rssCheckpointBytes)/(1<<30), time.Since(start).Seconds(), out)
		if rss > rssMaxBytes {
			t.Errorf("%s: peak RSS %d MiB, want at most %d", c.name, rss>>20, rssMaxBytes>>20)
		}
	}
}
