package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/refit"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// pubtModel writes a model directory of BF16 tensors (and, with extra,
// more tensors) and returns it with its tensors.
func pubtModel(t *testing.T, extra ...stfile.Tensor) (string, []stfile.Tensor) {
	t.Helper()
	tensors := append([]stfile.Tensor{
		randomBF16("model.layers.0.mlp.experts.0.down_proj.weight", 1, 16, 32),
		randomBF16("model.layers.0.mlp.experts.1.down_proj.weight", 2, 16, 32),
		randomBF16("model.layers.1.mlp.experts.0.down_proj.weight", 3, 16, 32),
		randomBF16("model.layers.0.self_attn.q_proj.weight", 4, 32, 32),
		randomBF16("model.norm.weight", 5, 1, 32),
	}, extra...)
	dir := t.TempDir()
	if err := stfile.Write(filepath.Join(dir, "model.safetensors"), tensors, map[string]string{"format": "pt"}); err != nil {
		t.Fatal(err)
	}
	return dir, tensors
}

// pubtRun runs the command line and returns its exit status and output.
func pubtRun(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	// Like main's context: cancellable, without a deadline.
	ctx, cancel := context.WithCancel(context.Background())
	defer time.AfterFunc(20*time.Second, cancel).Stop()
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// pubtVersion reads a version back: its stream bytes and manifest.
func pubtVersion(t *testing.T, url, model string, v uint64) ([]byte, refit.Manifest) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	nc := refittest.Connect(t, url)
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, refit.BucketName(model))
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(ctx, refit.KeyManifest)
	if err != nil {
		t.Fatal(err)
	}
	m, err := refit.ParseManifest(e.Value())
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.OrderedConsumer(ctx, refit.StreamName(model), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{refit.VersionSubject(model, v)}})
	if err != nil {
		t.Fatal(err)
	}
	var data []byte
	for seq := 0; seq < m.Chunks; seq++ {
		msg, err := cons.Next(jetstream.FetchMaxWait(2 * time.Second))
		if err != nil {
			t.Fatalf("chunk %d: %v", seq, err)
		}
		c, err := refit.ParseChunk(msg.Headers(), len(msg.Data()))
		if err != nil || c.Seq != seq || c.Verify(msg.Data()) != nil {
			t.Fatalf("chunk %d: %+v, %v", seq, c, err)
		}
		data = append(data, msg.Data()...)
	}
	return data, m
}

// pubtWorker answers every new manifest with a status of state.
func pubtWorker(ctx context.Context, t *testing.T, url, model, worker, state string) {
	nc, err := nats.Connect(url)
	if err != nil {
		t.Error(err)
		return
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	var current uint64
	for ctx.Err() == nil {
		time.Sleep(5 * time.Millisecond)
		kv, err := js.KeyValue(ctx, refit.BucketName(model))
		if err != nil {
			continue
		}
		e, err := kv.Get(ctx, refit.KeyManifest)
		if err != nil {
			continue
		}
		m, err := refit.ParseManifest(e.Value())
		if err != nil || m.Version <= current {
			continue
		}
		current = m.Version
		st := refit.Status{Protocol: m.Protocol, Worker: worker, Version: m.Version, State: state, CurrentVersion: m.Version,
			Bytes: m.TotalBytes, PhasesMS: map[string]float64{"receive": 5, "copy": 1, "requantize": 2, "commit": 3},
			Layers: []refit.LayerTiming{{Layer: 0, ReceiveMS: 2, CopyMS: 0.5, RequantizeMS: 1}, {Layer: 1, ReceiveMS: 3, CopyMS: 0.5, RequantizeMS: 1}}}
		if state != refit.StateApplied {
			st.Reason, st.CurrentVersion = "test says no", m.Version-1
		}
		b, _ := json.Marshal(st)
		if err := nc.Publish(refit.StatusSubject(model), b); err != nil {
			t.Error(err)
		}
		nc.Flush()
	}
}

func TestPublishCommand(t *testing.T) {
	srv := refittest.StartServer(t)
	dir, tensors := pubtModel(t)
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stop()
	for _, w := range []string{"w-1", "w-2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pubtWorker(ctx, t, srv.URL(), "tiny", w, refit.StateApplied)
		}()
	}

	// A partial version: the experts of layer 0, in chunks of 1000 bytes.
	code, stdout, stderr := pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "1",
		"--from", dir, "--only", `layers\.0\.mlp\.experts`, "--chunk-bytes", "1000", "--wait-workers", "2", "--timeout", "10s")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	data, m := pubtVersion(t, srv.URL(), "tiny", 1)
	table := refit.NewChunkTable()
	for off := 0; off < len(data); off += 1000 {
		c := data[off:min(off+1000, len(data))]
		table.Add(int64(off), len(c), refit.CRC32C(c))
	}
	if m.Full || m.Tensors != 2 || m.ChunkBytes != 1000 || m.TotalBytes != int64(len(data)) || m.ChunkTableSHA256 != table.Sum() {
		t.Errorf("manifest %+v for %d bytes", m, len(data))
	}
	f, err := stfile.Open(pubtWriteStream(t, data))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	names := f.Names()
	if len(names) != 2 || names[0] != tensors[0].Name || names[1] != tensors[1].Name {
		t.Errorf("published tensors %q", names)
	}
	for _, i := range []int{0, 1} {
		got, _ := f.Tensor(tensors[i].Name)
		if !bytes.Equal(got.Data, tensors[i].Data) {
			t.Errorf("%s: data differs", tensors[i].Name)
		}
	}
	for _, want := range []string{
		"published partial version 1 of model tiny on refit.tiny.v.1",
		"2 tensors, " + strconv.Itoa(len(data)) + " bytes",
		"in " + strconv.Itoa(m.Chunks) + " chunks of 1000 bytes",
		"chunk table sha256 " + m.ChunkTableSHA256,
		"worker w-1: applied version 1 (serving 1)",
		"worker w-2: applied version 1",
		"phases: receive 5.0 ms, copy 1.0 ms, requantize 2.0 ms, commit 3.0 ms",
		"sum         5.0      1.0            2.0",
	} {
		if !strings.Contains(stdout, want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout)
		}
	}
	if stderr != "" {
		t.Errorf("stderr:\n%s", stderr)
	}

	// A full version, without waiting.
	code, stdout, stderr = pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "2", "--from",
		filepath.Join(dir, "model.safetensors"), "--storage", "file")
	if code != 0 || !strings.Contains(stdout, "published full version 2") || !strings.Contains(stdout, "5 tensors") {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	// An older version is refused.
	code, _, stderr = pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "2", "--from", dir)
	if code != 1 || !strings.Contains(stderr, "refit: publish version 2: not newer than version 2") {
		t.Errorf("republish: exit %d, stderr:\n%s", code, stderr)
	}
}

// pubtWriteStream writes stream bytes to a file, for stfile.Open.
func pubtWriteStream(t *testing.T, data []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "stream.safetensors")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestPublishCommandWorkersFail(t *testing.T) {
	srv := refittest.StartServer(t)
	dir, _ := pubtModel(t)
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stop()
	wg.Add(1)
	go func() {
		defer wg.Done()
		pubtWorker(ctx, t, srv.URL(), "m", "w-1", refit.StateRejected)
	}()
	code, stdout, stderr := pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "m", "--version", "3", "--from", dir,
		"--wait-workers", "1", "--storage", "memory")
	if code != 1 || !strings.Contains(stderr, "version 3: 1 of 1 workers did not apply it: w-1 rejected") ||
		!strings.Contains(stdout, "reason: test says no") {
		t.Errorf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	// Nobody answers for version 4.
	code, stdout, stderr = pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "m2", "--version", "4", "--from", dir,
		"--wait-workers", "1", "--timeout", "100ms")
	if code != 1 || !strings.Contains(stderr, "statuses of version 4: 0 of 1 workers answered (none)") ||
		!strings.Contains(stdout, "published full version 4") {
		t.Errorf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
}

func TestPublishCommandErrors(t *testing.T) {
	srv := refittest.StartServer(t)
	dir, _ := pubtModel(t, stfile.Tensor{Name: "model.layers.0.scale", DType: stfile.F32, Shape: []uint64{2}, Data: make([]byte, 8)})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "nats://" + l.Addr().String()
	l.Close()
	base := []string{"publish", "--nats-url", srv.URL()}
	tests := []struct {
		name string
		args []string
		code int
		want []string
	}{
		{"no model id", []string{"--version", "1", "--from", dir}, 2, []string{"--model-id is required"}},
		{"bad model id", []string{"--model-id", "a.b", "--version", "1", "--from", dir}, 2, []string{`--model-id "a.b"`}},
		{"no version", []string{"--model-id", "m", "--from", dir}, 2, []string{"--version is required and must be at least 1"}},
		{"version 0", []string{"--model-id", "m", "--version", "0", "--from", dir}, 2, []string{"--version"}},
		{"negative version", []string{"--model-id", "m", "--version", "-1", "--from", dir}, 2, []string{"invalid value"}},
		{"no source", []string{"--model-id", "m", "--version", "1"}, 2, []string{"--from is required"}},
		{"bad regexp", []string{"--model-id", "m", "--version", "1", "--from", dir, "--only", "("}, 2, []string{"--only: error parsing regexp"}},
		{"bad storage", []string{"--model-id", "m", "--version", "1", "--from", dir, "--storage", "tape"}, 2, []string{`--storage "tape"`}},
		{"negative workers", []string{"--model-id", "m", "--version", "1", "--from", dir, "--wait-workers", "-1"}, 2, []string{"--wait-workers"}},
		{"zero timeout", []string{"--model-id", "m", "--version", "1", "--from", dir, "--wait-workers", "1", "--timeout", "0s"}, 2, []string{"--timeout"}},
		{"unreadable source", []string{"--model-id", "m", "--version", "1", "--from", filepath.Join(dir, "nope")}, 1,
			[]string{"refit: source", "no such file"}},
		{"no match", []string{"--model-id", "m", "--version", "1", "--from", dir, "--only", "^nothing"}, 1,
			[]string{`no tensor name matches "^nothing" (of 6 tensors)`}},
		{"not BF16", []string{"--model-id", "m", "--version", "1", "--from", dir}, 1,
			[]string{"1 selected tensors are not BF16", "model.layers.0.scale (F32)"}},
		{"chunk too big", []string{"--model-id", "m", "--version", "1", "--from", dir, "--only", "norm", "--chunk-bytes", "5000000"}, 1,
			[]string{"chunk bytes 5000000"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := pubtRun(t, append(base, tc.args...)...)
			if code != tc.code {
				t.Errorf("exit %d, want %d", code, tc.code)
			}
			for _, w := range tc.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr lacks %q:\n%s", w, stderr)
				}
			}
			if stdout != "" {
				t.Errorf("stdout:\n%s", stdout)
			}
		})
	}
	code, _, stderr := pubtRun(t, "publish", "--nats-url", closed, "--model-id", "m", "--version", "1", "--from", dir, "--only", "norm")
	if code != 1 || !strings.Contains(stderr, "connect to NATS at "+closed) {
		t.Errorf("unreachable server: exit %d, stderr:\n%s", code, stderr)
	}
	code, stdout, _ := pubtRun(t, "help", "publish")
	if code != 0 || !strings.Contains(stdout, "rollout-worker publish --nats-url URL") || !strings.Contains(stdout, "-wait-workers") {
		t.Errorf("help publish: exit %d:\n%s", code, stdout)
	}
}
