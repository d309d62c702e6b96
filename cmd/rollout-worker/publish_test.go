package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/policy"
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

// TestPublishCommandDelta: publish --base sends the tensors that differ
// from the base checkpoint as delta tensors (or whole, where that is
// smaller), as a delta on the newest version published; --base-version
// must name that version.
func TestPublishCommandDelta(t *testing.T) {
	srv := refittest.StartServer(t)
	dir, tensors := pubtModel(t)
	// Two tensors change: three elements of one, every element of another.
	next := slices.Clone(tensors)
	next[0].Data = slices.Clone(tensors[0].Data)
	for _, i := range []int{1, 100, 511} {
		next[0].Data[2*i] ^= 0x01
	}
	next[3].Data = slices.Clone(tensors[3].Data)
	for i := 0; i < len(next[3].Data); i += 2 {
		next[3].Data[i] ^= 0x01
	}
	nextDir := t.TempDir()
	if err := stfile.Write(filepath.Join(nextDir, "model.safetensors"), next, nil); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "m", "--version", "1", "--from", dir)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	code, stdout, stderr = pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "m", "--version", "2", "--from", nextDir,
		"--base", dir, "--base-version", "7")
	if code != 1 || !strings.Contains(stderr, "a delta on version 7, but the newest version published is 1") {
		t.Fatalf("wrong --base-version: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	code, stdout, stderr = pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "m", "--version", "next", "--from", nextDir,
		"--base", filepath.Join(dir, "model.safetensors"), "--chunk-bytes", "100")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	data, m := pubtVersion(t, srv.URL(), "m", 2)
	if m.Full || m.Base != 1 || m.Tensors != 2 || m.TotalBytes != int64(len(data)) {
		t.Fatalf("manifest %+v", m)
	}
	n := binary.LittleEndian.Uint64(data)
	h, err := refit.ParseHeader(data[8:8+n], int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ti := range h.Tensors {
		got = append(got, ti.Name+" "+ti.DType)
	}
	if want := []string{tensors[0].Name + " " + refit.DeltaDType, tensors[3].Name + " BF16"}; !slices.Equal(got, want) {
		t.Errorf("tensors %q, want %q", got, want)
	}
	for _, want := range []string{
		"published partial version 2 of model m",
		"a delta on version 1: 2 of 5 tensors changed (1 sent as deltas, 1 whole), 1027 of 2592 elements",
		fmt.Sprintf("%d bytes, ", len(data)),
	} {
		if !strings.Contains(stdout, want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout)
		}
	}
	code, _, stderr = pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "m", "--version", "3", "--from", nextDir, "--base-version", "2")
	if code != 2 || !strings.Contains(stderr, "--base-version needs --base") {
		t.Errorf("--base-version alone: exit %d\nstderr:\n%s", code, stderr)
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
		!strings.Contains(stderr, "the next version must be full") || !strings.Contains(stdout, "reason: test says no") {
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
		{"parts not a number", []string{"--model-id", "m", "--version", "1", "--from", dir, "--parts", "many"}, 2,
			[]string{"want a number of parts, or auto"}},
		{"parts 0", []string{"--model-id", "m", "--version", "1", "--from", dir, "--parts", "0"}, 2, []string{"--parts 0: want 1 to 16, or auto"}},
		{"parts 17", []string{"--model-id", "m", "--version", "1", "--from", dir, "--parts", "17"}, 2, []string{"--parts 17"}},
		{"part servers, one part", []string{"--model-id", "m", "--version", "1", "--from", dir, "--parts", "1", "--part-servers", srv.URL()}, 2,
			[]string{"--part-servers with --parts 1"}},
		{"bad part server", []string{"--model-id", "m", "--version", "1", "--from", dir, "--only", "norm", "--part-servers", "nats://"}, 1,
			[]string{"want a server URL"}},
		{"live first, one part", []string{"--model-id", "m", "--version", "1", "--from", dir, "--parts", "1", "--live-first"}, 2,
			[]string{"--live-first with --parts 1"}},
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

func TestRedactURL(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
		{"nats://alice:s3cret@nats.example:4222", "nats://alice:xxxxx@nats.example:4222"},
		{"tls://alice:p%40ss:w0rd@h:4222/x?y=1", "tls://alice:xxxxx@h:4222/x?y=1"},
		{"nats://t0ken@h:4222", "nats://xxxxx@h:4222"},
		{"nats://a:b@h1:4222,nats://c:d@h2:4222, nats://h3", "nats://a:xxxxx@h1:4222,nats://c:xxxxx@h2:4222, nats://h3"},
		{"connect to nats://u:pw@h: nats: Authorization Violation", "connect to nats://u:xxxxx@h: nats: Authorization Violation"},
		{"127.0.0.1:4222", "127.0.0.1:4222"},
		{"nats://:pw@h", "nats://:xxxxx@h"},
		{"", ""},
	} {
		if got := redactURL(tc.in); got != tc.want {
			t.Errorf("redactURL(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// pubtSecureServer starts nats-server with JetStream for two users: one by
// nkey (the seed's file is returned) and alice, by password.
func pubtSecureServer(t *testing.T) (url string, nkeySeedFile string) {
	t.Helper()
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := kp.PublicKey()
	seed, _ := kp.Seed()
	nkeySeedFile = filepath.Join(t.TempDir(), "user.nk")
	if err := os.WriteFile(nkeySeedFile, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	opts := &server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, NoLog: true, NoSigs: true, JetStream: true,
		StoreDir: t.TempDir(), Nkeys: []*server.NkeyUser{{Nkey: pub}}, Users: []*server.User{{Username: "alice", Password: "s3cret-pw"}}}
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
	return "nats://" + srv.Addr().String(), nkeySeedFile
}

// TestPublishCommandSecured: publish reaches a server that requires
// authentication with --nats-nkey (or a password in the URL), and never
// prints the password of a URL it failed to connect to.
func TestPublishCommandSecured(t *testing.T) {
	url, seedFile := pubtSecureServer(t)
	dir, _ := pubtModel(t)
	alice := strings.Replace(url, "nats://", "nats://alice:s3cret-pw@", 1)
	wrong := strings.Replace(url, "nats://", "nats://alice:wr0ng-pw@", 1)
	for _, tc := range []struct {
		name    string
		args    []string
		code    int
		want    string // in stdout (exit 0) or stderr
		secrets []string
	}{
		{"nkey", []string{"--nats-url", url, "--nats-nkey", seedFile, "--version", "1"}, 0, "published full version 1", nil},
		{"password", []string{"--nats-url", alice, "--version", "2"}, 0, "published full version 2", nil},
		{"no credentials", []string{"--nats-url", url, "--version", "3"}, 1, "connect to NATS at " + url, nil},
		{"wrong password", []string{"--nats-url", wrong, "--version", "3"}, 1, "nats://alice:xxxxx@", []string{"wr0ng-pw"}},
		{"wrong passwords, two servers", []string{"--nats-url", wrong + "," + strings.Replace(wrong, "wr0ng-pw", "an0ther-pw", 1), "--version", "3"}, 1,
			"nats://alice:xxxxx@", []string{"wr0ng-pw", "an0ther-pw"}},
		{"tls cert without key", []string{"--nats-url", url, "--tls-cert", seedFile, "--version", "3"}, 2, "--tls-cert and --tls-key go together", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"publish", "--model-id", "m", "--from", dir, "--storage", "memory"}, tc.args...)
			code, stdout, stderr := pubtRun(t, args...)
			out := stderr
			if tc.code == 0 {
				out = stdout
			}
			if code != tc.code || !strings.Contains(out, tc.want) {
				t.Fatalf("exit %d (want %d), want %q in\nstdout:\n%s\nstderr:\n%s", code, tc.code, tc.want, stdout, stderr)
			}
			for _, s := range tc.secrets {
				if strings.Contains(stdout+stderr, s) {
					t.Fatalf("output shows the password %q:\n%s%s", s, stdout, stderr)
				}
			}
		})
	}
}

// TestCommandsRedactCredentials: serve and generate, refused by a server
// for a wrong password, name the server in their error without the
// password, for one URL and for a list.
func TestCommandsRedactCredentials(t *testing.T) {
	url, _ := pubtSecureServer(t)
	wrong := strings.Replace(url, "nats://", "nats://alice:wr0ng-pw@", 1)
	two := wrong + "," + strings.Replace(wrong, "wr0ng-pw", "an0ther-pw", 1)
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"serve", []string{"serve", "--preset", "tiny", "--nats-url", wrong, "--http-addr", "127.0.0.1:0"}},
		{"serve, two servers", []string{"serve", "--preset", "tiny", "--nats-url", two, "--http-addr", "127.0.0.1:0"}},
		{"generate", []string{"generate", "--nats-url", wrong, "--prompt", "1,2,3"}},
		{"generate, two servers", []string{"generate", "--nats-url", two, "--prompt", "1,2,3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := pubtRun(t, tc.args...)
			if code != 1 || !strings.Contains(stderr, "nats://alice:xxxxx@127.0.0.1:") {
				t.Fatalf("exit %d, want 1 and the redacted URL in\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
			}
			for _, pw := range []string{"wr0ng-pw", "an0ther-pw"} {
				if strings.Contains(stdout+stderr, pw) {
					t.Fatalf("output shows the password %q:\n%s%s", pw, stdout, stderr)
				}
			}
		})
	}
}

// pubtSyncBuffer is a bytes.Buffer for output written by another goroutine.
type pubtSyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *pubtSyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *pubtSyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// TestPublishSignedToServe: a worker started with --refit-trust applies a
// version published with --sign-key of a trusted key, and rejects an
// unsigned one and one signed by another key, saying why.
func TestPublishSignedToServe(t *testing.T) {
	url := refittest.StartServer(t).URL()
	cfg, err := policy.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := policy.WriteRandomModel(dir, cfg, 7); err != nil {
		t.Fatal(err)
	}
	keyFile := func(name string) (seedFile, pub string) {
		kp, err := nkeys.CreateUser()
		if err != nil {
			t.Fatal(err)
		}
		seed, _ := kp.Seed()
		pub, _ = kp.PublicKey()
		seedFile = filepath.Join(t.TempDir(), name+".nk")
		if err := os.WriteFile(seedFile, append(seed, '\n'), 0o600); err != nil {
			t.Fatal(err)
		}
		return seedFile, pub
	}
	trusted, trustedPub := keyFile("trusted")
	other, _ := keyFile("other")
	trustFile := filepath.Join(t.TempDir(), "trust")
	if err := os.WriteFile(trustFile, []byte("# the trainer\n"+trustedPub+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var stdout, stderr pubtSyncBuffer
	go func() {
		done <- runServe(ctx, []string{"--nats-url", url, "--preset", "tiny", "--model-id", "tiny", "--device", "cpu", "--worker-id", "w-1",
			"--http-addr", "", "--log-format", "json", "--refit-trust", trustFile}, &stdout, &stderr)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v\n%s", err, stderr.String())
		}
	})
	publishArgs := func(v string, extra ...string) []string {
		return append([]string{"publish", "--nats-url", url, "--model-id", "tiny", "--from", dir, "--version", v,
			"--wait-workers", "1", "--timeout", "30s"}, extra...)
	}
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"unsigned", publishArgs("1"), 1, "unsigned version"},
		{"untrusted key", publishArgs("2", "--sign-key", other), 1, "signed by an untrusted key"},
		{"trusted key", publishArgs("3", "--sign-key", trusted), 0, "signed by " + trustedPub},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := pubtRun(t, tc.args...)
			if code != tc.code || !strings.Contains(out, tc.want) {
				t.Fatalf("exit %d (want %d), want %q in\nstdout:\n%s\nstderr:\n%s\nserve:\n%s", code, tc.code, tc.want, out, errOut, stderr.String())
			}
		})
	}
	if !strings.Contains(stderr.String(), trustedPub) {
		t.Errorf("serve does not log its trusted key:\n%s", stderr.String())
	}
}

// TestPublishCommandNextVersion: --version next numbers the version one
// above the highest in the stream and the bucket, past an attempt that
// died after its announcement (refit/PROTOCOL.md, "Version numbers").
func TestPublishCommandNextVersion(t *testing.T) {
	srv := refittest.StartServer(t)
	dir, _ := pubtModel(t)
	run := func(want string) {
		t.Helper()
		code, stdout, stderr := pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "next", "--from", dir)
		if code != 0 || !strings.Contains(stdout, want) {
			t.Fatalf("exit %d, want %q\nstdout:\n%s\nstderr:\n%s", code, want, stdout, stderr)
		}
	}
	run("published full version 1 of model tiny")
	run("published full version 2 of model tiny")
	// A publisher died after announcing version 3 and storing a chunk.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	js, _ := jetstream.New(refittest.Connect(t, srv.URL()))
	kv, err := js.KeyValue(ctx, refit.BucketName("tiny"))
	if err != nil {
		t.Fatal(err)
	}
	a, _ := json.Marshal(refit.Announce{Protocol: refit.ProtocolVersion, Model: "tiny", Version: 3, Full: true,
		Subject: refit.VersionSubject("tiny", 3), TotalBytes: 100, ChunkBytes: 100, Chunks: 1})
	if _, err := kv.Put(ctx, refit.KeyAnnounce, a); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, refit.VersionSubject("tiny", 3), make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	run("published full version 4 of model tiny")
	code, _, stderr := pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "nxt", "--from", dir)
	if code != 2 || !strings.Contains(stderr, `invalid value "nxt" for flag -version: want a number`) {
		t.Errorf("--version nxt: exit %d, stderr:\n%s", code, stderr)
	}
}

// TestPublishCommandFullAfterUnfinished: after a version announced and never
// completed, publish --only publishes the whole checkpoint, saying why
// (refit/PROTOCOL.md, "After a status other than applied"); a worker that
// did not apply the version makes the command say the next must be full.
func TestPublishCommandFullAfterUnfinished(t *testing.T) {
	srv := refittest.StartServer(t)
	dir, _ := pubtModel(t)
	code, stdout, stderr := pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "1", "--from", dir)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	// A publisher died after announcing version 2.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	js, _ := jetstream.New(refittest.Connect(t, srv.URL()))
	kv, err := js.KeyValue(ctx, refit.BucketName("tiny"))
	if err != nil {
		t.Fatal(err)
	}
	a, _ := json.Marshal(refit.Announce{Protocol: refit.ProtocolVersion, Model: "tiny", Version: 2, Full: false, Base: 1,
		Subject: refit.VersionSubject("tiny", 2), TotalBytes: 100, ChunkBytes: 100, Chunks: 1})
	if _, err := kv.Put(ctx, refit.KeyAnnounce, a); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr = pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "next", "--from", dir,
		"--only", `layers\.0\.mlp\.experts`)
	if code != 0 || !strings.Contains(stdout, "a full version is needed: version 2 was announced and never completed") ||
		!strings.Contains(stdout, "publishing every tensor of "+dir) || !strings.Contains(stdout, "published full version 3") ||
		!strings.Contains(stdout, "5 tensors") {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	// Complete now: --only publishes a partial version again.
	code, stdout, stderr = pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "next", "--from", dir,
		"--only", `layers\.0\.mlp\.experts`)
	if code != 0 || !strings.Contains(stdout, "published partial version 4") || strings.Contains(stdout, "full version is needed") {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
}

// TestPublishCommandPartServers: with --part-servers and --parts auto (the
// default) a small version goes in one part a server, part 1 in its stream
// on the part server and nowhere else.
func TestPublishCommandPartServers(t *testing.T) {
	srv, other := refittest.StartServer(t), refittest.StartServer(t)
	dir, _ := pubtModel(t)
	code, stdout, stderr := pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "1",
		"--from", filepath.Join(dir, "model.safetensors"), "--part-servers", other.URL())
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	name := refit.PartStreamName("tiny", 1)
	for _, s := range []struct {
		url  string
		want bool
	}{{other.URL(), true}, {srv.URL(), false}} {
		js, err := jetstream.New(refittest.Connect(t, s.url))
		if err != nil {
			t.Fatal(err)
		}
		st, err := js.Stream(context.Background(), name)
		switch {
		case s.want && err != nil:
			t.Errorf("%s on the part server: %v", name, err)
		case s.want && st.CachedInfo().State.Msgs == 0:
			t.Errorf("%s on the part server holds no chunk", name)
		case !s.want && !errors.Is(err, jetstream.ErrStreamNotFound):
			t.Errorf("%s on the main server: %v, want not found", name, err)
		}
	}
}

// TestPublishCommandLiveFirst: publish --live-first sends a version of
// parts live first (protocol 4): sealed, then stored on the stored
// subjects, the manifest last.
func TestPublishCommandLiveFirst(t *testing.T) {
	srv := refittest.StartServer(t)
	dir, _ := pubtModel(t)
	code, stdout, stderr := pubtRun(t, "publish", "--nats-url", srv.URL(), "--model-id", "tiny", "--version", "1",
		"--from", filepath.Join(dir, "model.safetensors"), "--parts", "2", "--live-first")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	js, err := jetstream.New(refittest.Connect(t, srv.URL()))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(context.Background(), refit.BucketName("tiny"))
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{refit.KeySealed, refit.KeyManifest} {
		e, err := kv.Get(context.Background(), key)
		if err != nil {
			t.Fatalf("%s: %v", key, err)
		}
		m, err := refit.ParseManifest(e.Value())
		if err != nil || m.Protocol != refit.ProtocolLive || len(m.Parts) != 2 || m.Subject != refit.StoredSubject("tiny", 1, 0) {
			t.Fatalf("%s: %+v, %v; want protocol %d in 2 parts on %s", key, m, err, refit.ProtocolLive, refit.StoredSubject("tiny", 1, 0))
		}
	}
	st, err := js.Stream(context.Background(), refit.PartStreamName("tiny", 1))
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(context.Background(), jetstream.WithSubjectFilter(refit.StoredSubject("tiny", 1, 1)))
	if err != nil || info.State.Subjects[refit.StoredSubject("tiny", 1, 1)] == 0 {
		t.Fatalf("part 1's stored subject: %+v, %v", info.State.Subjects, err)
	}
}
