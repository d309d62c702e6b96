package refit

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"hash/crc32"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// ptTensor is a tensor of random bytes from seed.
func ptTensor(name string, dt stfile.DType, seed uint64, shape ...uint64) stfile.Tensor {
	n := uint64(dt.Size())
	for _, d := range shape {
		n *= d
	}
	data := make([]byte, n)
	rng := rand.New(rand.NewPCG(seed, 0xf00d))
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	return stfile.Tensor{Name: name, DType: dt, Shape: shape, Data: data}
}

// ptFile writes tensors to a safetensors file and returns its path.
func ptFile(t testing.TB, dir string, tensors ...stfile.Tensor) string {
	t.Helper()
	path := filepath.Join(dir, "model.safetensors")
	if err := stfile.Write(path, tensors, map[string]string{"format": "pt"}); err != nil {
		t.Fatal(err)
	}
	return path
}

// ptStream is a safetensors stream of BF16 tensors of about kib KiB.
func ptStream(t testing.TB, seed uint64, kib int) []byte {
	t.Helper()
	tensors := []stfile.Tensor{ptTensor("model.norm.weight", stfile.BF16, seed, 64)}
	for i := 0; len(tensors)*16 < kib; i++ {
		tensors = append(tensors, ptTensor("model.layers."+string(rune('a'+i%26))+".w"+string(rune('0'+i/26)), stfile.BF16, seed+uint64(i)+1, 64, 128))
	}
	b, err := os.ReadFile(ptFile(t, t.TempDir(), tensors...))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ptSetup starts a server and a publisher for model "tiny".
func ptSetup(t *testing.T, cfg PublisherConfig, log *zap.Logger, opts ...refittest.Option) (*refittest.Server, *nats.Conn, *Publisher) {
	t.Helper()
	srv := refittest.StartServer(t, opts...)
	nc := refittest.Connect(t, srv.URL())
	if cfg.Model == "" {
		cfg.Model = "tiny"
	}
	p, err := NewPublisher(nc, cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	return srv, nc, p
}

func ptContext(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// ptReadVersion reads version v back from the stream with a plain consumer,
// checks every chunk and returns the stream bytes and chunk headers.
func ptReadVersion(t *testing.T, nc *nats.Conn, model string, v uint64) ([]byte, []Chunk) {
	t.Helper()
	ctx := ptContext(t, 10*time.Second)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, StreamName(model))
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(VersionSubject(model, v)))
	if err != nil {
		t.Fatal(err)
	}
	want := int(info.State.Subjects[VersionSubject(model, v)])
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{VersionSubject(model, v)}})
	if err != nil {
		t.Fatal(err)
	}
	var (
		data   []byte
		chunks []Chunk
	)
	for len(chunks) < want {
		batch, err := cons.Fetch(want-len(chunks), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for msg := range batch.Messages() {
			n++
			c, err := ParseChunk(msg.Headers(), len(msg.Data()))
			if err != nil {
				t.Fatalf("chunk %d: %v", len(chunks), err)
			}
			if err := c.Verify(msg.Data()); err != nil {
				t.Fatal(err)
			}
			if c.Seq != len(chunks) || c.Offset != int64(len(data)) || c.Version != v {
				t.Fatalf("chunk %+v after %d chunks and %d bytes", c, len(chunks), len(data))
			}
			if got, want := msg.Headers().Get(jetstream.MsgIDHeader), MsgID(model, v, c.Seq); got != want {
				t.Errorf("chunk %d: Nats-Msg-Id %q, want %q", c.Seq, got, want)
			}
			chunks = append(chunks, c)
			data = append(data, msg.Data()...)
		}
		if err := batch.Error(); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			t.Fatalf("no chunks after %d of %d", len(chunks), want)
		}
	}
	return data, chunks
}

// ptBucketValue reads key of the model's bucket.
func ptBucketValue(t *testing.T, nc *nats.Conn, model, key string) []byte {
	t.Helper()
	ctx := ptContext(t, 5*time.Second)
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, BucketName(model))
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(ctx, key)
	if err != nil {
		t.Fatalf("%s: %v", key, err)
	}
	return e.Value()
}

// ptCheckVersion checks that version m is in the stream and the bucket,
// complete and equal to src.
func ptCheckVersion(t *testing.T, nc *nats.Conn, m Manifest, src []byte, chunkBytes int) {
	t.Helper()
	data, chunks := ptReadVersion(t, nc, m.Model, m.Version)
	if !bytes.Equal(data, src) {
		t.Fatalf("the stream holds %d bytes that differ from the %d published", len(data), len(src))
	}
	wantChunks := (len(src) + chunkBytes - 1) / chunkBytes
	if len(chunks) != wantChunks {
		t.Fatalf("%d chunks, want %d", len(chunks), wantChunks)
	}
	for _, c := range chunks {
		if c.Total != int64(len(src)) || c.Chunks != wantChunks {
			t.Fatalf("chunk %+v", c)
		}
	}
	// The digest, computed here from PROTOCOL.md's definition: protocol 2
	// hashes the chunk table (offset u64, length u32, CRC-32C u32, each
	// little-endian), protocol 1 the whole stream.
	var table []byte
	for off := 0; off < len(src); off += chunkBytes {
		c := src[off:min(off+chunkBytes, len(src))]
		table = binary.LittleEndian.AppendUint64(table, uint64(off))
		table = binary.LittleEndian.AppendUint32(table, uint32(len(c)))
		table = binary.LittleEndian.AppendUint32(table, crc32.Checksum(c, crc32.MakeTable(crc32.Castagnoli)))
	}
	sum := sha256.Sum256(table)
	if m.Protocol == Protocol1 {
		sum = sha256.Sum256(src)
	}
	a, err := ParseAnnounce(ptBucketValue(t, nc, m.Model, KeyAnnounce))
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseManifest(ptBucketValue(t, nc, m.Model, KeyManifest))
	if err != nil {
		t.Fatal(err)
	}
	h, _, err := readHeader(bytes.NewReader(src), int64(len(src)))
	if err != nil {
		t.Fatal(err)
	}
	want := Announce{Protocol: m.Protocol, Model: m.Model, Version: m.Version, Full: m.Full, Subject: VersionSubject(m.Model, m.Version),
		TotalBytes: int64(len(src)), ChunkBytes: chunkBytes, Chunks: wantChunks}
	switch {
	case !reflect.DeepEqual(a, want):
		t.Errorf("announce %+v, want %+v", a, want)
	case !reflect.DeepEqual(got.Announce, want):
		t.Errorf("manifest %+v, want %+v", got.Announce, want)
	case got.Digest() != hex.EncodeToString(sum[:]):
		t.Errorf("manifest of protocol %d: digest %s, want %x", got.Protocol, got.Digest(), sum)
	case got.HeaderBytes != int(h.Len) || got.Tensors != len(h.Tensors) || got.Tensors < 2:
		t.Errorf("manifest header %d bytes, %d tensors; want %d, %d", got.HeaderBytes, got.Tensors, h.Len, len(h.Tensors))
	case time.Since(got.PublishedAt) > time.Minute || got.PublishedAt.After(time.Now()):
		t.Errorf("published at %v", got.PublishedAt)
	case got.SHA256 != m.SHA256 || got.ChunkTableSHA256 != m.ChunkTableSHA256 || !got.PublishedAt.Equal(m.PublishedAt):
		t.Errorf("Publish returned %+v, the bucket holds %+v", m, got)
	}
}

func TestPublishRoundTrip(t *testing.T) {
	const chunk, window = 1000, 8000
	_, nc, p := ptSetup(t, PublisherConfig{ChunkBytes: chunk, MaxInflightBytes: window}, nil)
	var peak int64
	p.onInflight = func(b int64) { peak = max(peak, b) } // Publish's goroutine only
	src := ptStream(t, 1, 60)
	if len(src)%chunk == 0 {
		t.Fatal("want a short last chunk")
	}
	m, err := p.Publish(ptContext(t, 10*time.Second), 3, bytes.NewReader(src), int64(len(src)), true)
	if err != nil {
		t.Fatal(err)
	}
	if m.Protocol != ProtocolVersion || m.ChunkTableSHA256 == "" || m.SHA256 != "" {
		t.Errorf("manifest %+v: want protocol %d with a chunk table digest only", m, ProtocolVersion)
	}
	ptCheckVersion(t, nc, m, src, chunk)
	if peak > window || peak <= 2*chunk {
		t.Errorf("peak unacknowledged bytes %d: want more than two chunks (pipelined) and at most %d", peak, window)
	}
	// As an older publisher: protocol 1, the stream's SHA-256.
	p.protocol = Protocol1
	if m, err = p.Publish(ptContext(t, 10*time.Second), 4, bytes.NewReader(src), int64(len(src)), true); err != nil {
		t.Fatal(err)
	}
	if m.Protocol != Protocol1 || m.SHA256 == "" || m.ChunkTableSHA256 != "" {
		t.Errorf("manifest %+v: want protocol 1 with a stream digest only", m)
	}
	ptCheckVersion(t, nc, m, src, chunk)

	// The stream's settings are the protocol's.
	js, _ := jetstream.New(nc)
	stream, err := js.Stream(ptContext(t, 5*time.Second), StreamName("tiny"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := stream.CachedInfo().Config
	if cfg.Retention != jetstream.LimitsPolicy || cfg.Discard != jetstream.DiscardOld || cfg.Storage != jetstream.FileStorage ||
		!slices.Equal(cfg.Subjects, []string{"refit.tiny.v.*", "refit.tiny.s.*"}) || cfg.MaxMsgSize != int32(nc.MaxPayload()) {
		t.Errorf("stream config %+v", cfg)
	}
}

// TestPublishEnsure: the stream and the bucket are made again when they
// went missing between two versions, and settings changed behind the
// publisher's back are put back.
func TestPublishEnsure(t *testing.T) {
	_, nc, p := ptSetup(t, PublisherConfig{ChunkBytes: 1000}, nil)
	ctx := ptContext(t, 10*time.Second)
	js, _ := jetstream.New(nc)
	src := ptStream(t, 3, 40)
	publish := func(v uint64) {
		t.Helper()
		m, err := p.Publish(ctx, v, bytes.NewReader(src), int64(len(src)), true)
		if err != nil {
			t.Fatalf("version %d: %v", v, err)
		}
		ptCheckVersion(t, nc, m, src, 1000)
	}
	publish(1)
	for _, tc := range []struct {
		name   string
		change func() error
	}{
		{"bucket deleted", func() error { return js.DeleteKeyValue(ctx, BucketName("tiny")) }},
		{"stream deleted", func() error { return js.DeleteStream(ctx, StreamName("tiny")) }},
		{"stream settings changed", func() error {
			cfg := p.streamConfig()
			cfg.Description, cfg.MaxMsgSize = "someone else's", 2000
			_, err := js.UpdateStream(ctx, cfg)
			return err
		}},
	} {
		if err := tc.change(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		v := uint64(2)
		if m, err := ParseManifest(ptBucketValueOrNil(t, nc, "tiny", KeyManifest)); err == nil {
			v = m.Version + 1
		}
		publish(v)
		s, err := js.Stream(ctx, StreamName("tiny"))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !sameStreamSettings(s.CachedInfo().Config, p.streamConfig()) {
			t.Errorf("%s: stream settings %+v after a publish", tc.name, s.CachedInfo().Config)
		}
	}
}

// ptBucketValueOrNil reads key of the model's bucket, nil if it is not
// there.
func ptBucketValueOrNil(t *testing.T, nc *nats.Conn, model, key string) []byte {
	t.Helper()
	ctx := ptContext(t, 5*time.Second)
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, BucketName(model))
	if err != nil {
		return nil
	}
	e, err := kv.Get(ctx, key)
	if err != nil {
		return nil
	}
	return e.Value()
}

func TestPublishWindowDefaults(t *testing.T) {
	srv := refittest.StartServer(t, refittest.WithMaxPayload(64<<10))
	nc := refittest.Connect(t, srv.URL())
	p, err := NewPublisher(nc, PublisherConfig{Model: "m", MaxInflightBytes: 200 << 10}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Config().ChunkBytes; got != 60<<10 {
		t.Errorf("chunk bytes %d, want max_payload - 4 KiB = %d", got, 60<<10)
	}
	// On a server with room for more, chunks are DefaultChunkBytes.
	big, err := NewPublisher(refittest.Connect(t, refittest.StartServer(t, refittest.WithMaxPayload(8<<20)).URL()), PublisherConfig{Model: "m"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := big.Config().ChunkBytes; got != DefaultChunkBytes {
		t.Errorf("chunk bytes %d under a max_payload of 8 MiB, want %d", got, DefaultChunkBytes)
	}
	if got := p.Config().PublishTimeout; got != DefaultPublishTimeout {
		t.Errorf("publish timeout %v", got)
	}
	var peak int64
	p.onInflight = func(b int64) { peak = max(peak, b) }
	src := ptStream(t, 2, 600)
	m, err := p.Publish(ptContext(t, 10*time.Second), 1, bytes.NewReader(src), int64(len(src)), false)
	if err != nil {
		t.Fatal(err)
	}
	ptCheckVersion(t, nc, m, src, 60<<10)
	if peak > 200<<10 {
		t.Errorf("peak unacknowledged bytes %d over the window of %d", peak, 200<<10)
	}
}

func TestNewPublisherRejects(t *testing.T) {
	srv := refittest.StartServer(t, refittest.WithMaxPayload(8<<10))
	nc := refittest.Connect(t, srv.URL())
	tests := []struct {
		name string
		cfg  PublisherConfig
		want string
	}{
		{"bad model", PublisherConfig{Model: "a.b"}, "invalid model id"},
		{"empty model", PublisherConfig{}, "invalid model id"},
		{"chunk over max_payload", PublisherConfig{Model: "m", ChunkBytes: 5 << 10}, "chunk bytes 5120: want 1 to 4096"},
		{"negative chunk", PublisherConfig{Model: "m", ChunkBytes: -1}, "chunk bytes -1"},
		{"window under a chunk", PublisherConfig{Model: "m", ChunkBytes: 4096, MaxInflightBytes: 4095}, "less than one chunk"},
		{"storage", PublisherConfig{Model: "m", Storage: 7}, "storage"},
		{"replicas", PublisherConfig{Model: "m", Replicas: -1}, "replicas"},
		{"timeout", PublisherConfig{Model: "m", PublishTimeout: -time.Second}, "timeout"},
		{"stream cap under the window", PublisherConfig{Model: "m", MaxInflightBytes: 1 << 20, MaxStreamBytes: 1 << 19}, "max stream bytes 524288"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewPublisher(nc, tc.cfg, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "refit: new publisher") {
				t.Errorf("got %v, want an error naming %q", err, tc.want)
			}
		})
	}
	if _, err := NewPublisher(nil, PublisherConfig{Model: "m"}, nil); err == nil {
		t.Error("no connection: no error")
	}
	tiny := refittest.StartServer(t, refittest.WithMaxPayload(4<<10))
	if _, err := NewPublisher(refittest.Connect(t, tiny.URL()), PublisherConfig{Model: "m"}, nil); err == nil ||
		!strings.Contains(err.Error(), "leaves no room") {
		t.Errorf("max_payload 4 KiB: %v", err)
	}
}

func TestPublishRejects(t *testing.T) {
	_, nc, p := ptSetup(t, PublisherConfig{ChunkBytes: 1000}, nil)
	ctx := ptContext(t, 10*time.Second)
	good := ptStream(t, 3, 4)
	f32, err := os.ReadFile(ptFile(t, t.TempDir(), ptTensor("a", stfile.BF16, 1, 8), ptTensor("b.scale", stfile.F32, 2, 4),
		ptTensor("c.idx", stfile.I64, 3, 2)))
	if err != nil {
		t.Fatal(err)
	}
	gap := bytes.Clone(good)
	gap = gap[:len(gap)-1] // the header promises one byte more

	tests := []struct {
		name    string
		version uint64
		src     []byte
		size    int64
		want    string
	}{
		{"version 0", 0, good, int64(len(good)), "version 0: versions start at 1"},
		{"tiny stream", 1, good, 8, "stream of 8 bytes"},
		{"size past the source", 1, good, int64(len(good)) + 100, "cover"},
		{"truncated", 1, gap, int64(len(gap)), "cover"},
		{"garbage", 1, []byte("not a safetensors stream at all"), 31, "safetensors header"},
		{"not BF16", 1, f32, int64(len(f32)), "2 tensors are not BF16: b.scale (F32), c.idx (I64)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := p.Publish(ctx, tc.version, bytes.NewReader(tc.src), tc.size, true)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error naming %q", err, tc.want)
			}
			if !strings.HasPrefix(err.Error(), "refit: publish version ") {
				t.Errorf("error %q does not name the operation", err)
			}
		})
	}
	// None of them created anything: the checks come first.
	js, _ := jetstream.New(nc)
	if _, err := js.Stream(ctx, StreamName("tiny")); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("stream after rejected publishes: %v", err)
	}

	// Version rules: newer than the manifest, and an unused subject.
	if _, err := p.Publish(ctx, 5, bytes.NewReader(good), int64(len(good)), true); err != nil {
		t.Fatal(err)
	}
	for _, v := range []uint64{4, 5} {
		if _, err := p.Publish(ctx, v, bytes.NewReader(good), int64(len(good)), true); err == nil || !strings.Contains(err.Error(), "not newer than version 5") {
			t.Errorf("version %d after 5: %v", v, err)
		}
	}
	if _, err := js.Publish(ctx, VersionSubject("tiny", 6), []byte("left over")); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Publish(ctx, 6, bytes.NewReader(good), int64(len(good)), true); err == nil || !strings.Contains(err.Error(), "already holds 1 chunks") {
		t.Errorf("version 6 with a used subject: %v", err)
	}
	// A cancelled context ends a publish.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := p.Publish(cctx, 7, bytes.NewReader(good), int64(len(good)), true); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
}

func TestPublishRetention(t *testing.T) {
	const chunk = 1000
	_, nc, p := ptSetup(t, PublisherConfig{ChunkBytes: chunk, Storage: jetstream.MemoryStorage}, nil)
	ctx := ptContext(t, 10*time.Second)
	srcs := map[uint64][]byte{}
	var last Manifest
	for i, v := range []uint64{2, 3, 7} { // versions need not be consecutive
		srcs[v] = ptStream(t, uint64(10+i), 20)
		m, err := p.Publish(ctx, v, bytes.NewReader(srcs[v]), int64(len(srcs[v])), i != 1)
		if err != nil {
			t.Fatal(err)
		}
		last = m
	}
	js, _ := jetstream.New(nc)
	stream, err := js.Stream(ctx, StreamName("tiny"))
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(StreamSubjects("tiny")))
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.Storage != jetstream.MemoryStorage {
		t.Errorf("storage %v", info.Config.Storage)
	}
	subjects := info.State.Subjects
	if len(subjects) != 2 || subjects[VersionSubject("tiny", 2)] != 0 || subjects[VersionSubject("tiny", 3)] == 0 || subjects[VersionSubject("tiny", 7)] == 0 {
		t.Fatalf("subjects %v: want versions 3 and 7 only", subjects)
	}
	ptCheckVersion(t, nc, last, srcs[7], chunk)
	if data, _ := ptReadVersion(t, nc, "tiny", 3); !bytes.Equal(data, srcs[3]) {
		t.Error("version 3 changed")
	}
}

func TestPublishSurvivesRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("restarts a server")
	}
	const chunk = 1000
	core, logs := observer.New(zapcore.WarnLevel)
	srv, nc, p := ptSetup(t, PublisherConfig{ChunkBytes: chunk, MaxInflightBytes: 32 * chunk, PublishTimeout: 2 * time.Second}, zap.New(core))
	ctx := ptContext(t, 20*time.Second)
	src := ptStream(t, 4, 400)

	// At the 100th chunk the server goes down (in another goroutine) and
	// comes back while Publish goes on.
	down := make(chan struct{})
	var wg sync.WaitGroup
	defer wg.Wait()
	calls := 0
	p.onInflight = func(int64) {
		calls++
		if calls != 100 {
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			srv.Shutdown()
			close(down)
			time.Sleep(100 * time.Millisecond)
			srv.Restart(t)
		}()
		<-down
	}
	m, err := p.Publish(ctx, 1, bytes.NewReader(src), int64(len(src)), true)
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if calls < 100 {
		t.Fatalf("only %d chunks published", calls)
	}
	// The window (32 chunks) cannot drain while the server is down, so the
	// restart is mid-transfer by construction; whether chunks in flight
	// failed (and were published again) depends on timing.
	for _, e := range logs.FilterMessageSnippet("chunk failed").All() {
		t.Logf("%s: %v", e.Message, e.ContextMap())
	}
	ptCheckVersion(t, nc, m, src, chunk)
}

func TestWaitStatuses(t *testing.T) {
	_, nc, p := ptSetup(t, PublisherConfig{ChunkBytes: 1000}, nil)
	ctx := ptContext(t, 10*time.Second)
	c, err := p.Statuses(context.Background(), 4) // no deadline needed
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	send := func(s Status) {
		t.Helper()
		s.Protocol = ProtocolVersion
		b, _ := json.Marshal(s)
		if err := nc.Publish(StatusSubject("tiny"), b); err != nil {
			t.Fatal(err)
		}
	}
	send(Status{Worker: "w-2", Version: 4, State: StateRejected, Reason: "bad header", CurrentVersion: 3})
	send(Status{Worker: "w-9", Version: 3, State: StateApplied}) // another version
	send(Status{Version: 4, State: StateApplied})                // no worker id
	if err := nc.Publish(StatusSubject("tiny"), []byte(`{"protocol":1,"state":"meh"}`)); err != nil {
		t.Fatal(err)
	}
	if got, err := c.Wait(ctx, 1); err != nil || len(got) != 1 {
		t.Fatalf("w-2's status: %+v, %v", got, err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	got, err := c.Wait(short, 2)
	cancel()
	if err == nil || !strings.Contains(err.Error(), "1 of 2 workers answered (w-2 rejected)") || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("timeout: %v", err)
	}
	if len(got) != 1 || got[0].Worker != "w-2" {
		t.Errorf("timeout returned %+v", got)
	}

	send(Status{Worker: "w-1", Version: 4, State: StateNeedsFull, CurrentVersion: 3})
	send(Status{Worker: "w-1", Version: 4, State: StateApplied, CurrentVersion: 4, Bytes: 123,
		PhasesMS: map[string]float64{"receive": 10, "copy": 1, "requantize": 2, "commit": 3.5, "validate": 0.5},
		Layers:   []LayerTiming{{Layer: 0, ReceiveMS: 4, CopyMS: 0.5, RequantizeMS: 1}, {Layer: 1, ReceiveMS: 5, CopyMS: 0.5, RequantizeMS: 1}},
		Chunks:   &ChunkSources{Live: 90, Stream: 5}})
	// Wait until w-1's second status is in (it replaces the first).
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, err = c.Wait(ctx, 2)
		if err != nil {
			t.Fatal(err)
		}
		if got[0].State == StateApplied || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if len(got) != 2 || got[0].Worker != "w-1" || got[0].State != StateApplied || got[1].Worker != "w-2" {
		t.Fatalf("statuses %+v", got)
	}

	var out bytes.Buffer
	if err := FormatStatuses(&out, got); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"worker w-1: applied version 4 (serving 4), 123 bytes",
		"phases: receive 10.0 ms, copy 1.0 ms, requantize 2.0 ms, commit 3.5 ms, validate 0.5 ms\n  chunks: 90 live, 5 from the streams",
		"layer  receive ms  copy ms  requantize ms",
		"sum         9.0      1.0            2.0",
		"worker w-2: rejected version 4 (serving 3), 0 bytes\n  reason: bad header",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, &out)
		}
	}
	if err := c.Close(); err != nil {
		t.Error(err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
}

// TestWaitStatusesFakeWorkers publishes a version to workers that answer
// when they see its manifest.
func TestWaitStatusesFakeWorkers(t *testing.T) {
	srv, _, p := ptSetup(t, PublisherConfig{ChunkBytes: 1000}, nil)
	ctx := ptContext(t, 10*time.Second)
	c, err := p.Statuses(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, w := range []string{"w-a", "w-b", "w-c"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ptFakeWorker(wctx, t, refittest.Connect(t, srv.URL()), "tiny", w)
		}()
	}
	defer wg.Wait()
	defer stop()

	src := ptStream(t, 5, 8)
	if _, err := p.Publish(ctx, 1, bytes.NewReader(src), int64(len(src)), true); err != nil {
		t.Fatal(err)
	}
	got, err := c.Wait(ctx, 3)
	if err != nil {
		t.Fatal(err)
	}
	for i, w := range []string{"w-a", "w-b", "w-c"} {
		if got[i].Worker != w || got[i].State != StateApplied || got[i].Bytes != int64(len(src)) {
			t.Errorf("status %d: %+v", i, got[i])
		}
	}
}

// ptFakeWorker polls the manifest and reports every new version applied.
func ptFakeWorker(ctx context.Context, t *testing.T, nc *nats.Conn, model, worker string) {
	js, err := jetstream.New(nc)
	if err != nil {
		t.Error(err)
		return
	}
	var current uint64
	for ctx.Err() == nil {
		time.Sleep(5 * time.Millisecond)
		kv, err := js.KeyValue(ctx, BucketName(model))
		if err != nil {
			continue
		}
		e, err := kv.Get(ctx, KeyManifest)
		if err != nil {
			continue
		}
		m, err := ParseManifest(e.Value())
		if err != nil || m.Version <= current {
			continue
		}
		current = m.Version
		b, _ := json.Marshal(Status{Protocol: ProtocolVersion, Worker: worker, Version: m.Version, State: StateApplied,
			CurrentVersion: current, Bytes: m.TotalBytes, PhasesMS: map[string]float64{"receive": 1}})
		if err := nc.Publish(StatusSubject(model), b); err != nil {
			t.Error(err)
		}
	}
}

func TestPublishGivesUpWithContext(t *testing.T) {
	srv, _, p := ptSetup(t, PublisherConfig{ChunkBytes: 1000, MaxInflightBytes: 4000, PublishTimeout: 200 * time.Millisecond}, nil)
	src := ptStream(t, 6, 60)
	// The server goes away for good in the middle of the transfer, and
	// the context ends 300 ms later.
	ctx, cancel := context.WithCancel(ptContext(t, 10*time.Second))
	defer cancel()
	var stopped time.Time
	calls := 0
	p.onInflight = func(int64) {
		if calls++; calls == 20 {
			srv.Shutdown()
			stopped = time.Now()
			time.AfterFunc(300*time.Millisecond, cancel)
		}
	}
	_, err := p.Publish(ctx, 1, bytes.NewReader(src), int64(len(src)), true)
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "refit: publish version 1: chunk ") {
		t.Errorf("got %v, want the context's error naming a chunk", err)
	}
	if d := time.Since(stopped); d > 3*time.Second {
		t.Errorf("gave up %v after the server stopped", d)
	}
	// Before the stream: the JetStream calls give up too.
	_, err = p.Publish(ptContext(t, 300*time.Millisecond), 2, bytes.NewReader(src), int64(len(src)), true)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "look up stream") {
		t.Errorf("server down: %v", err)
	}
}

func TestTransient(t *testing.T) {
	_, nc, _ := ptSetup(t, PublisherConfig{}, nil)
	ctx := ptContext(t, 5*time.Second)
	js, _ := jetstream.New(nc)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	// The stream's answer to a chunk whose predecessor is missing.
	_, wrongLast := js.Publish(ctx, "t.1", []byte("x"), jetstream.WithMsgID("m.1.1"), jetstream.WithExpectLastMsgID("m.1.0"))
	if wrongLast == nil {
		t.Fatal("the stream took a message out of order")
	}
	_, tooBig := js.Publish(ctx, "t.1", make([]byte, nc.MaxPayload()+1))
	_, noStream := js.Stream(ctx, "NOPE")
	_, badConfig := js.CreateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}, Storage: jetstream.MemoryStorage})
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{wrongLast, true},
		{context.DeadlineExceeded, true},
		{nats.ErrTimeout, true},
		{nats.ErrNoResponders, true},
		{nats.ErrDisconnected, true},
		{jetstream.ErrNoStreamResponse, true},
		{jetstream.ErrAsyncPublishTimeout, true},
		{jetstream.ErrJetStreamNotEnabled, true},
		{&net.OpError{Op: "write", Err: syscall.ECONNRESET}, true},
		{tooBig, false},
		{noStream, false},
		{badConfig, false},
		{nats.ErrConnectionClosed, false},
		{nats.ErrBadSubject, false},
	} {
		if tc.err == nil {
			t.Fatalf("no error where one was expected (want transient %v)", tc.want)
		}
		if got := transient(tc.err); got != tc.want {
			t.Errorf("transient(%v) = %v", tc.err, got)
		}
	}
}

// TestStreamCap: a publisher with MaxStreamBytes caps the stream (discard
// old) and publishes a version larger than the cap.
func TestStreamCap(t *testing.T) {
	srv := refittest.StartServer(t)
	nc := refittest.Connect(t, srv.URL())
	const capBytes = 128 << 10
	p, err := NewPublisher(nc, PublisherConfig{Model: testModel, ChunkBytes: 4 << 10, MaxInflightBytes: 64 << 10, MaxStreamBytes: capBytes}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	stream := subset(t, modelDir(t, 71), nil)
	if len(stream) <= 2*capBytes {
		t.Fatalf("a version of %d bytes does not exceed the cap of %d", len(stream), capBytes)
	}
	publish(t, p, 1, stream, true)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(context.Background(), StreamName(testModel))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.MaxBytes != capBytes || info.State.Bytes > capBytes || info.State.Msgs == 0 {
		t.Fatalf("stream max_bytes %d holding %d bytes in %d messages, want the cap %d", info.Config.MaxBytes, info.State.Bytes, info.State.Msgs, capBytes)
	}
}
