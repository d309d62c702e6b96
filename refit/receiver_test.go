package refit

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/stfile"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

const testModel = "tiny"

// modelDir writes a seeded random tiny model and returns its directory.
func modelDir(t testing.TB, seed uint64) string {
	t.Helper()
	cfg, err := policy.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := policy.WriteRandomModel(dir, cfg, seed); err != nil {
		t.Fatal(err)
	}
	return dir
}

// mixDir writes a model whose tensors matching re come from src and the
// rest from base.
func mixDir(t *testing.T, base, src string, re *regexp.Regexp) string {
	t.Helper()
	b, err := stfile.Open(filepath.Join(base, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	s, err := stfile.Open(filepath.Join(src, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var out []stfile.Tensor
	for _, n := range b.Names() {
		from := b
		if re.MatchString(n) {
			from = s
		}
		tn, err := from.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, tn)
	}
	dir := t.TempDir()
	if err := stfile.Write(filepath.Join(dir, "model.safetensors"), out, nil); err != nil {
		t.Fatal(err)
	}
	cfgJSON, err := os.ReadFile(filepath.Join(base, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), cfgJSON, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// subset returns the safetensors bytes of the tensors of dir matching re.
func subset(t testing.TB, dir string, re *regexp.Regexp) []byte {
	t.Helper()
	f, err := stfile.Open(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var ts []stfile.Tensor
	for _, n := range f.Names() {
		if re == nil || re.MatchString(n) {
			tn, err := f.Tensor(n)
			if err != nil {
				t.Fatal(err)
			}
			ts = append(ts, tn)
		}
	}
	return streamOf(t, ts)
}

// streamOf serializes tensors as a safetensors byte stream.
func streamOf(t testing.TB, ts []stfile.Tensor) []byte {
	t.Helper()
	p := filepath.Join(t.TempDir(), "v.safetensors")
	if err := stfile.Write(p, ts, nil); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func testOpts(recipe moe.Recipe) policy.ModelOptions {
	return policy.ModelOptions{Recipe: recipe, MaxTokens: 128, MaxSeqs: 16, MaxLogitRows: 128, KVPages: 256, PageSize: 8}
}

// loadModel loads the checkpoint in dir for recipe; per_tensor models get
// the same fixed input scales every time (a deployment's calibrated ones,
// which a refit does not change).
func loadModel(t testing.TB, dir string, recipe moe.Recipe) *policy.Model {
	t.Helper()
	m, err := policy.LoadModel(testBackend(t), dir, testOpts(recipe))
	if err != nil {
		t.Fatal(err)
	}
	if recipe == moe.RecipePerTensor {
		scales := make([]policy.InputScales, m.Config().Layers)
		for i := range scales {
			scales[i] = policy.InputScales{FC1: 1.0 / 256, FC2: 1.0 / 512}
		}
		if err := m.SetInputScales(scales); err != nil {
			m.Close()
			t.Fatal(err)
		}
	}
	return m
}

// worker is a model, its engine and its receiver, all running.
type worker struct {
	m      *policy.Model
	e      *policy.Engine
	r      *Receiver
	nc     *nats.Conn
	cancel context.CancelFunc
	done   chan error
}

// testBackend returns the backend workers run on: a fresh CPU backend,
// unless TestGPURefit (gpu_test.go) swaps in the CUDA one.
var testBackend = func(t testing.TB) kernels.Backend {
	t.Helper()
	be, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return be
}

func startWorker(t testing.TB, url, dir, id string, recipe moe.Recipe, tune func(*ReceiverConfig)) *worker {
	t.Helper()
	m := loadModel(t, dir, recipe)
	var err error
	w := &worker{m: m, e: policy.NewEngine(m, policy.EngineConfig{}), nc: refittest.Connect(t, url), done: make(chan error, 2)}
	cfg := ReceiverConfig{Model: testModel, Worker: id, ChunkTimeout: 2 * time.Second}
	if tune != nil {
		tune(&cfg)
	}
	if w.r, err = NewReceiver(w.nc, m, w.e, cfg, testLogger(t), nil); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	go func() { w.done <- w.e.Run(ctx) }()
	go func() { w.done <- w.r.Run(ctx) }()
	t.Cleanup(w.stop)
	return w
}

func (w *worker) stop() {
	if w.cancel == nil {
		return
	}
	w.cancel()
	w.cancel = nil
	<-w.done
	<-w.done
	w.r.Close()
	w.m.Close()
}

// waitStatus waits until the worker has handled version v and returns its
// report.
func (w *worker) waitStatus(t *testing.T, v uint64) Status {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if st := w.r.LastStatus(); st.Version == v {
			return st
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("worker: no status for version %d (last %+v)", v, w.r.LastStatus())
	return Status{}
}

// chunks is where the chunks of the version the worker last applied came
// from: live, and read back from the streams.
func (w *worker) chunks(t *testing.T) (live, stored int) {
	t.Helper()
	st := w.r.LastStatus()
	if st.State != StateApplied || st.Chunks == nil {
		t.Fatalf("worker %s: no applied status with chunk sources: %+v", w.r.cfg.Worker, st)
	}
	return st.Chunks.Live, st.Chunks.Stream
}

func newPublisher(t *testing.T, url string) *Publisher {
	t.Helper()
	p, err := NewPublisher(refittest.Connect(t, url), PublisherConfig{Model: testModel, ChunkBytes: 64 << 10}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func publish(t *testing.T, p *Publisher, v uint64, stream []byte, full bool) {
	t.Helper()
	if _, err := p.Publish(context.Background(), v, bytes.NewReader(stream), int64(len(stream)), full); err != nil {
		t.Fatalf("publish version %d: %v", v, err)
	}
}

// rollouts generates a fixed set of rollouts and scores on an engine.
func rollouts(t *testing.T, e *policy.Engine) ([]policy.Sample, [][]float32) {
	t.Helper()
	h, err := e.Submit(policy.Request{ID: "eq", Prompt: []int32{5, 9, 200, 17, 3, 88, 41}, N: 3,
		Params: policy.SamplingParams{Temperature: 1, MaxTokens: 12, Seed: 77}})
	if err != nil {
		t.Fatal(err)
	}
	var out []policy.Sample
	for s := range h.Samples() {
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b policy.Sample) int { return a.Index - b.Index })
	scores, err := e.Score(context.Background(), [][]int32{{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 300, 301}})
	if err != nil {
		t.Fatal(err)
	}
	return out, scores
}

// fresh generates the same rollouts with a worker loaded from dir, no NATS.
func fresh(t *testing.T, dir string, recipe moe.Recipe) ([]policy.Sample, [][]float32) {
	t.Helper()
	m := loadModel(t, dir, recipe)
	defer m.Close()
	e := policy.NewEngine(m, policy.EngineConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	defer func() { cancel(); <-done }()
	return rollouts(t, e)
}

func sameRollouts(t *testing.T, what string, gotS []policy.Sample, gotScores [][]float32, wantS []policy.Sample, wantScores [][]float32) {
	t.Helper()
	for i := range wantS {
		if !slices.Equal(gotS[i].Tokens, wantS[i].Tokens) || !slices.Equal(f32bits(gotS[i].LogProbs), f32bits(wantS[i].LogProbs)) {
			t.Fatalf("%s: sample %d differs: tokens %v vs %v", what, i, gotS[i].Tokens, wantS[i].Tokens)
		}
	}
	if !slices.Equal(f32bits(gotScores[0]), f32bits(wantScores[0])) {
		t.Fatalf("%s: scores differ: %v vs %v", what, gotScores[0], wantScores[0])
	}
}

func f32bits(v []float32) []uint32 {
	out := make([]uint32, len(v))
	for i, x := range v {
		out[i] = math.Float32bits(x)
	}
	return out
}

var experts = regexp.MustCompile(`\.mlp\.experts\.`)

// TestRefitEquivalence: a worker refit from A to B produces bit for bit
// the rollouts and scores of a fresh worker loaded with B: for a full
// version, an experts-only partial version, and two refits in a row, with
// every recipe.
func TestRefitEquivalence(t *testing.T) {
	a, b, c := modelDir(t, 1), modelDir(t, 2), modelDir(t, 3)
	for i, recipe := range []moe.Recipe{moe.RecipePerToken, moe.RecipeBF16, moe.RecipePerTensor, moe.RecipeUnitScale} {
		t.Run(string(recipe), func(t *testing.T) {
			srv := refittest.StartServer(t)
			p := newPublisher(t, srv.URL())
			w := startWorker(t, srv.URL(), a, "w-"+string(recipe), recipe, nil)
			base := uint64(10 * i)

			publish(t, p, base+1, subset(t, b, nil), true) // full: A -> B
			if st := w.waitStatus(t, base+1); st.State != StateApplied {
				t.Fatalf("full version: %+v", st)
			}
			gotS, gotSc := rollouts(t, w.e)
			wantS, wantSc := fresh(t, b, recipe)
			sameRollouts(t, "full refit A->B vs fresh B", gotS, gotSc, wantS, wantSc)

			publish(t, p, base+2, subset(t, c, experts), false) // experts only: B -> B+experts(C)
			st := w.waitStatus(t, base+2)
			if st.State != StateApplied {
				t.Fatalf("experts-only version: %+v", st)
			}
			gotS, gotSc = rollouts(t, w.e)
			wantS, wantSc = fresh(t, mixDir(t, b, c, experts), recipe)
			sameRollouts(t, "two refits (full, then experts only) vs fresh", gotS, gotSc, wantS, wantSc)
			for _, v := range gotS[0].Versions {
				if v != base+2 {
					t.Fatalf("token produced under version %d, want %d", v, base+2)
				}
			}
			if len(st.Layers) == 0 || st.PhasesMS["commit"] <= 0 || st.Bytes == 0 {
				t.Fatalf("status lacks timings: %+v", st)
			}
		})
	}
}

// TestRefitPartialFromStart: an experts-only version applied to a fresh
// worker equals a fresh worker loaded with the mix.
func TestRefitPartialFromStart(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 4), modelDir(t, 5)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	publish(t, newPublisher(t, srv.URL()), 1, subset(t, b, experts), false)
	if st := w.waitStatus(t, 1); st.State != StateApplied {
		t.Fatalf("%+v", st)
	}
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, mixDir(t, a, b, experts), moe.RecipePerToken)
	sameRollouts(t, "experts-only refit vs fresh mix", gotS, gotSc, wantS, wantSc)
}

// TestRefitProtocol1: versions from an older publisher (protocol 1: the
// manifest carries the whole stream's SHA-256) are still applied, and
// reported in protocol 1, which that publisher reads; a protocol-2 version
// follows on the same worker.
func TestRefitProtocol1(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b, c := modelDir(t, 40), modelDir(t, 41), modelDir(t, 42)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	old := newPublisher(t, srv.URL())
	old.protocol = Protocol1
	publish(t, old, 1, subset(t, b, nil), true)
	if st := w.waitStatus(t, 1); st.State != StateApplied || st.Protocol != Protocol1 {
		t.Fatalf("protocol-1 version: %+v", st)
	}
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, b, moe.RecipePerToken)
	sameRollouts(t, "protocol-1 version vs fresh", gotS, gotSc, wantS, wantSc)
	publish(t, newPublisher(t, srv.URL()), 2, subset(t, c, experts), false)
	if st := w.waitStatus(t, 2); st.State != StateApplied || st.Protocol != ProtocolVersion {
		t.Fatalf("protocol-2 version after a protocol-1 one: %+v", st)
	}
	gotS, gotSc = rollouts(t, w.e)
	wantS, wantSc = fresh(t, mixDir(t, b, c, experts), moe.RecipePerToken)
	sameRollouts(t, "protocol-2 experts over a protocol-1 version vs fresh", gotS, gotSc, wantS, wantSc)
}

// rawPublish publishes a version chunk by chunk without the Publisher's
// checks: mutate may change a chunk's payload or headers, and stopAfter >= 0
// stops (a dead publisher) after that many chunks, without a manifest.
// A partial version is announced as a delta on base. The manifest's digest
// is that of the stream as given, before mutate.
func rawPublish(t *testing.T, url string, v uint64, stream []byte, full bool, base uint64, chunk int, stopAfter int, mutate func(seq int, h nats.Header, data []byte) []byte) {
	t.Helper()
	rawPublishProtocol(t, ProtocolVersion, url, v, stream, full, base, chunk, stopAfter, mutate)
}

// rawPublishProtocol is rawPublish in the given protocol (Protocol1 plays
// an older publisher).
func rawPublishProtocol(t *testing.T, protocol int, url string, v uint64, stream []byte, full bool, base uint64, chunk int, stopAfter int, mutate func(seq int, h nats.Header, data []byte) []byte) {
	t.Helper()
	rawPublishWith(t, url, v, stream, full, base, chunk, rawOptions{protocol: protocol, stopAfter: stopAfter, mutate: mutate})
}

// rawOptions are the ways a raw publish departs from a correct one.
type rawOptions struct {
	protocol  int                                              // ProtocolVersion or Protocol1
	stopAfter int                                              // chunks sent before giving up (< 0: all)
	mutate    func(seq int, h nats.Header, data []byte) []byte // chunk payloads as sent
	// announce and manifest edit the JSON written to the bucket.
	announce, manifest []jsonEdit
	noManifest         bool // send the chunks but write no manifest
}

// rawPublishWith publishes version v by hand (announcement, chunks,
// manifest), as o says; see rawPublish.
func rawPublishWith(t *testing.T, url string, v uint64, stream []byte, full bool, base uint64, chunk int, o rawOptions) {
	t.Helper()
	ctx := context.Background()
	p := newPublisher(t, url)
	_, kv, err := p.ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	chunks := (len(stream) + chunk - 1) / chunk
	a := Announce{Protocol: o.protocol, Model: testModel, Version: v, Full: full, Subject: VersionSubject(testModel, v),
		TotalBytes: int64(len(stream)), ChunkBytes: chunk, Chunks: chunks}
	if !full {
		a.Base = base
	}
	if _, err := kv.Put(ctx, KeyAnnounce, editJSON(t, a, o.announce)); err != nil {
		t.Fatal(err)
	}
	js, _ := jetstream.New(p.nc)
	table := NewChunkTable()
	for seq := range chunks {
		if seq == o.stopAfter {
			return
		}
		data := stream[seq*chunk : min((seq+1)*chunk, len(stream))]
		c := Chunk{Protocol: o.protocol, Version: v, Seq: seq, Offset: int64(seq * chunk), Total: int64(len(stream)), Chunks: chunks, CRC: CRC32C(data)}
		table.Add(c.Offset, len(data), c.CRC)
		msg := &nats.Msg{Subject: a.Subject, Header: c.Header(), Data: data}
		if o.mutate != nil {
			msg.Data = o.mutate(seq, msg.Header, slices.Clone(data))
		}
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	if o.noManifest {
		return
	}
	m := Manifest{Announce: a, ChunkTableSHA256: table.Sum(), PublishedAt: time.Now().UTC()}
	m.HeaderBytes, m.Tensors = headerCounts(t, stream)
	if o.protocol == Protocol1 {
		sum := sha256.Sum256(stream)
		m.ChunkTableSHA256, m.SHA256 = "", hex.EncodeToString(sum[:])
	}
	if _, err := kv.Put(ctx, KeyManifest, editJSON(t, m, o.manifest)); err != nil {
		t.Fatal(err)
	}
}

// headerCounts returns the manifest's header_bytes and tensors for stream:
// the distinct names of a header that ParseHeader refuses.
func headerCounts(t testing.TB, stream []byte) (headerBytes, tensors int) {
	t.Helper()
	n := int(binary.LittleEndian.Uint64(stream))
	h, err := ParseHeader(stream[8:8+n], int64(len(stream)))
	if err != nil {
		entries, err := headerEntries(stream[8 : 8+n])
		if err != nil {
			t.Fatal(err)
		}
		delete(entries, "__metadata__")
		return n, len(entries)
	}
	return n, len(h.Tensors)
}

// servesA checks the worker still generates exactly what model dir A does.
func servesA(t *testing.T, w *worker, dirA string) {
	t.Helper()
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, dirA, moe.RecipePerToken)
	sameRollouts(t, "after a rejected version, the worker still serves A", gotS, gotSc, wantS, wantSc)
}

// setBF16 overwrites value i of tensor name in a stream.
func setBF16(t *testing.T, stream []byte, name string, i int, v float32) []byte {
	t.Helper()
	n := int(binary.LittleEndian.Uint64(stream))
	h, err := ParseHeader(stream[8:8+n], int64(len(stream)))
	if err != nil {
		t.Fatal(err)
	}
	for _, tn := range h.Tensors {
		if tn.Name == name {
			out := slices.Clone(stream)
			binary.LittleEndian.PutUint16(out[h.DataStart()+tn.Begin+int64(2*i):], bf16.FromFloat32(v))
			return out
		}
	}
	t.Fatalf("no tensor %q", name)
	return nil
}

// TestRefitRejections: each kind of bad version is rejected whole, with a
// reason, and the worker keeps serving the last committed version.
func TestRefitRejections(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 6), modelDir(t, 7)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(c *ReceiverConfig) { c.ChunkTimeout = 500 * time.Millisecond })
	good := subset(t, b, experts)
	expertName := "model.layers.1.mlp.experts.3.down_proj.weight"
	f, err := stfile.Open(filepath.Join(b, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	norm, err := f.Tensor("model.norm.weight")
	if err != nil {
		t.Fatal(err)
	}
	withTensor := func(extra stfile.Tensor) []byte {
		return streamOf(t, []stfile.Tensor{norm, extra})
	}
	v := uint64(0)
	for _, tc := range []struct {
		name    string
		publish func(v uint64)
		want    string
	}{
		{"corrupted chunk", func(v uint64) {
			rawPublish(t, srv.URL(), v, good, false, 0, 4096, -1, func(seq int, h nats.Header, d []byte) []byte {
				if seq == 3 {
					d[100] ^= 0x40
				}
				return d
			})
		}, "crc32c"},
		{"publisher dies mid-version", func(v uint64) { rawPublish(t, srv.URL(), v, good, false, 0, 4096, 5, nil) }, "no chunk"},
		{"wrong dtype", func(v uint64) {
			rawPublish(t, srv.URL(), v, withTensor(stfile.Tensor{Name: "model.layers.0.input_layernorm.weight", DType: stfile.F32,
				Shape: []uint64{64}, Data: make([]byte, 256)}), false, 0, 4096, -1, nil)
		}, "dtype F32"},
		{"wrong shape", func(v uint64) {
			rawPublish(t, srv.URL(), v, withTensor(stfile.Tensor{Name: "model.layers.0.input_layernorm.weight", DType: stfile.BF16,
				Shape: []uint64{32}, Data: make([]byte, 64)}), false, 0, 4096, -1, nil)
		}, "shape [32]"},
		{"unknown tensor", func(v uint64) {
			rawPublish(t, srv.URL(), v, withTensor(stfile.Tensor{Name: "model.layers.9.input_layernorm.weight", DType: stfile.BF16,
				Shape: []uint64{64}, Data: make([]byte, 128)}), false, 0, 4096, -1, nil)
		}, "unknown tensor"},
		{"NaN", func(v uint64) {
			rawPublish(t, srv.URL(), v, setBF16(t, good, expertName, 77, float32(math.NaN())), false, 0, 4096, -1, nil)
		}, "NaN or Inf"},
		{"Inf", func(v uint64) {
			rawPublish(t, srv.URL(), v, setBF16(t, good, expertName, 5, float32(math.Inf(-1))), false, 0, 4096, -1, nil)
		}, "NaN or Inf"},
		{"announced full, not covering every weight", func(v uint64) {
			rawPublish(t, srv.URL(), v, good, true, 0, 4096, -1, nil)
		}, "announced full but does not cover every weight"},
		{"chunk table mismatch", func(v uint64) {
			rawPublish(t, srv.URL(), v, good, false, 0, 4096, -1, func(seq int, h nats.Header, d []byte) []byte {
				if seq == 2 { // a consistent chunk (good CRC) that differs from the manifest's chunk table
					d[10] ^= 1
					h.Set(HeaderCRC, fmt.Sprintf("%08x", CRC32C(d)))
				}
				return d
			})
		}, "chunk table sha256"},
		{"protocol 1: sha256 mismatch", func(v uint64) {
			rawPublishProtocol(t, Protocol1, srv.URL(), v, good, false, 0, 4096, -1, func(seq int, h nats.Header, d []byte) []byte {
				if seq == 2 {
					d[10] ^= 1
					h.Set(HeaderCRC, fmt.Sprintf("%08x", CRC32C(d)))
				}
				return d
			})
		}, "sha256"},
		{"chunk of another protocol", func(v uint64) {
			rawPublish(t, srv.URL(), v, good, false, 0, 4096, -1, func(seq int, h nats.Header, d []byte) []byte {
				if seq == 2 {
					h.Set(HeaderProtocol, "1")
				}
				return d
			})
		}, "protocol 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v++
			tc.publish(v)
			st := w.waitStatus(t, v)
			if st.State == StateApplied || !strings.Contains(st.Reason, tc.want) {
				t.Fatalf("status %+v, want a rejection mentioning %q", st, tc.want)
			}
			if st.CurrentVersion != 0 {
				t.Fatalf("serving version %d after a rejection, want 0", st.CurrentVersion)
			}
			servesA(t, w, a)
		})
	}
	// Expert bytes of the rejected versions went into the BF16 stacks: a
	// partial version that does not rewrite them cannot be committed...
	v++
	rawPublish(t, srv.URL(), v, streamOf(t, []stfile.Tensor{norm}), false, 0, 4096, -1, nil)
	if st := w.waitStatus(t, v); st.State != StateNeedsFull {
		t.Fatalf("partial version over dirty experts: %+v, want needs_full", st)
	}
	servesA(t, w, a)
	// ...a full version can, and then it is served.
	v++
	rawPublish(t, srv.URL(), v, subset(t, b, nil), true, 0, 4096, -1, nil)
	if st := w.waitStatus(t, v); st.State != StateApplied {
		t.Fatalf("full version after rejections: %+v", st)
	}
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, b, moe.RecipePerToken)
	sameRollouts(t, "full version after rejections vs fresh", gotS, gotSc, wantS, wantSc)
	// A duplicate, and an older, version number.
	for _, old := range []uint64{v, v - 3} {
		n := w.r.reports.Load()
		rawPublish(t, srv.URL(), old, subset(t, a, nil), true, 0, 4096, -1, nil)
		for deadline := time.Now().Add(10 * time.Second); w.r.reports.Load() == n && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		if st := w.r.LastStatus(); st.Version != old || st.State != StateRejected || !strings.Contains(st.Reason, "duplicate or older") {
			t.Fatalf("version %d again: %+v", old, st)
		}
		if w.r.CurrentVersion() != v {
			t.Fatalf("serving %d after a duplicate, want %d", w.r.CurrentVersion(), v)
		}
	}
}

// TestRefitLateJoin: a worker that starts (or restarts) after versions were
// published catches up to the newest one.
func TestRefitLateJoin(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b, c := modelDir(t, 8), modelDir(t, 9), modelDir(t, 10)
	p := newPublisher(t, srv.URL())
	publish(t, p, 1, subset(t, b, nil), true)
	publish(t, p, 2, subset(t, c, experts), false)
	w := startWorker(t, srv.URL(), a, "late", moe.RecipePerToken, nil)
	if st := w.waitStatus(t, 2); st.State != StateApplied {
		t.Fatalf("late join: %+v", st)
	}
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, mixDir(t, b, c, experts), moe.RecipePerToken)
	sameRollouts(t, "late joiner vs fresh B+experts(C)", gotS, gotSc, wantS, wantSc)

	// The worker restarts (a new process: weights from the checkpoint
	// again) and catches up once more.
	w.stop()
	w2 := startWorker(t, srv.URL(), a, "late", moe.RecipePerToken, nil)
	if st := w2.waitStatus(t, 2); st.State != StateApplied {
		t.Fatalf("restarted worker: %+v", st)
	}
	gotS, gotSc = rollouts(t, w2.e)
	sameRollouts(t, "restarted worker vs fresh B+experts(C)", gotS, gotSc, wantS, wantSc)
}

// TestRefitServerRestart: the NATS server restarts while a version is
// streaming; publisher and worker reconnect, and the worker ends up either
// applying the version exactly or rejecting it cleanly (serving A).
func TestRefitServerRestart(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 11), modelDir(t, 12)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(c *ReceiverConfig) { c.ChunkTimeout = 5 * time.Second })
	w.r.chunkDelay = time.Millisecond // ~100 chunks: the transfer takes long enough to restart in
	pub, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: 4 << 10}, nil)
	if err != nil {
		t.Fatal(err)
	}
	stream := subset(t, b, nil)
	done := make(chan error, 1)
	go func() {
		_, err := pub.Publish(context.Background(), 1, bytes.NewReader(stream), int64(len(stream)), true)
		done <- err
	}()
	// Restart once the worker has seen some of the version, but not all:
	// the worker is slowed down so that the restart is mid-transfer.
	for w.r.receivedBytes() == 0 {
		time.Sleep(time.Millisecond)
	}
	if got := w.r.receivedBytes(); got >= int64(len(stream)) {
		t.Fatalf("the worker had all %d bytes before the restart", got)
	}
	if err := srv.Restart(t); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("publish across a restart: %v", err)
	}
	st := w.waitStatus(t, 1)
	switch st.State {
	case StateApplied:
		gotS, gotSc := rollouts(t, w.e)
		wantS, wantSc := fresh(t, b, moe.RecipePerToken)
		sameRollouts(t, "applied across a server restart vs fresh B", gotS, gotSc, wantS, wantSc)
	default:
		t.Logf("rejected across the restart: %s", st.Reason)
		servesA(t, w, a)
	}
	t.Logf("version 1 across a server restart: %s", st.State)
}

// TestRefitSlowWorker: a slow worker does not hold the others back, and
// generation goes on while a version streams in; only the commit pauses it,
// and a rollout spanning the commit shows both versions.
func TestRefitSlowWorker(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 13), modelDir(t, 14)
	fast := startWorker(t, srv.URL(), a, "fast", moe.RecipePerToken, nil)
	slow := startWorker(t, srv.URL(), a, "slow", moe.RecipePerToken, func(c *ReceiverConfig) { c.MaxBytes = 64 << 10 })
	slow.r.chunkDelay = 10 * time.Millisecond
	// Rollouts run on the slow worker back to back, two at a time, while
	// the version streams in: one of them spans the commit.
	stop := make(chan struct{})
	spans := make(chan bool, 1)
	go func() {
		spanned := false
		defer func() { spans <- spanned }()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			h, err := slow.e.Submit(policy.Request{ID: fmt.Sprint("roll", i), Prompt: []int32{1, 2, 3}, N: 2,
				Params: policy.SamplingParams{Temperature: 1, MaxTokens: 300, Seed: uint64(i)}})
			if err != nil {
				return
			}
			for s := range h.Samples() {
				if len(s.Versions) > 0 && s.Versions[0] == 0 && s.Versions[len(s.Versions)-1] == 1 {
					spanned = true
				}
			}
		}
	}()
	p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: 16 << 10}, nil)
	if err != nil {
		t.Fatal(err)
	}
	stream := subset(t, b, nil)
	start := time.Now()
	if _, err := p.Publish(context.Background(), 1, bytes.NewReader(stream), int64(len(stream)), true); err != nil {
		t.Fatal(err)
	}
	fastDone := fast.waitStatus(t, 1)
	fastAt := time.Since(start)
	if slow.r.LastStatus().Version == 1 {
		t.Fatalf("the slow worker finished first (in %v): the test's delay did not bite", fastAt)
	}
	// Tokens are generated while the slow worker's bytes stream in (before
	// its commit).
	genBefore := slow.e.Stats().Generated
	for slow.r.receivedBytes() < int64(len(stream))*3/4 && slow.r.LastStatus().Version != 1 {
		time.Sleep(time.Millisecond)
	}
	genDuring := slow.e.Stats().Generated
	if slow.r.LastStatus().Version == 1 {
		t.Fatal("the slow worker committed before the check")
	}
	slowDone := slow.waitStatus(t, 1)
	slowAt := time.Since(start)
	if fastDone.State != StateApplied || slowDone.State != StateApplied {
		t.Fatalf("fast %+v, slow %+v", fastDone, slowDone)
	}
	if genDuring <= genBefore {
		t.Fatalf("the slow worker generated nothing while receiving (%d tokens, then %d)", genBefore, genDuring)
	}
	close(stop) // the rollout in flight finishes first
	if !<-spans {
		t.Fatal("no rollout spanned the commit with tokens of both versions")
	}
	t.Logf("fast worker applied after %v, slow worker after %v; slow commit paused generation %.2f ms", fastAt, slowAt, slowDone.PhasesMS["commit"])
}

func testLogger(t testing.TB) *zap.Logger {
	if os.Getenv("REFIT_TEST_LOG") == "" {
		return nil
	}
	return zaptest.NewLogger(t)
}

// TestRefitPartialOnWrongBase: a worker that rejected a version answers
// needs_full to the partial version built on it (instead of applying the
// delta to other weights), keeps serving what it served, and recovers with
// the next full version.
func TestRefitPartialOnWrongBase(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b, c := modelDir(t, 15), modelDir(t, 16), modelDir(t, 17)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	p := newPublisher(t, srv.URL())
	// Version 1 (full) reaches the stream complete, but this worker rejects
	// it: its first chunk is corrupted on the wire.
	full := subset(t, b, nil)
	rawPublish(t, srv.URL(), 1, full, true, 0, 4096, -1, func(seq int, h nats.Header, d []byte) []byte {
		if seq == 0 {
			d[20] ^= 1
		}
		return d
	})
	if st := w.waitStatus(t, 1); st.State != StateRejected {
		t.Fatalf("version 1: %+v", st)
	}
	publish(t, p, 2, subset(t, c, experts), false) // a delta on version 1
	if st := w.waitStatus(t, 2); st.State != StateNeedsFull {
		t.Fatalf("partial version on a rejected base: %+v, want needs_full", st)
	}
	servesA(t, w, a)
	publish(t, p, 3, subset(t, c, nil), true)
	if st := w.waitStatus(t, 3); st.State != StateApplied {
		t.Fatalf("full version 3: %+v", st)
	}
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, c, moe.RecipePerToken)
	sameRollouts(t, "after the full version", gotS, gotSc, wantS, wantSc)
}

// TestRefitRejectionBF16: under the bf16 recipe, whose forward reads the
// BF16 expert stacks, a rejected version changes nothing that is served
// (every tensor is staged, none written in place).
func TestRefitRejectionBF16(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 18), modelDir(t, 19)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipeBF16, nil)
	bad := setBF16(t, subset(t, b, nil), "model.norm.weight", 3, float32(math.Inf(1))) // the last tensor in data order
	rawPublish(t, srv.URL(), 1, bad, true, 0, 8192, -1, nil)
	if st := w.waitStatus(t, 1); st.State != StateRejected || !strings.Contains(st.Reason, "NaN or Inf") {
		t.Fatalf("%+v", st)
	}
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, a, moe.RecipeBF16)
	sameRollouts(t, "bf16 worker after a rejected version", gotS, gotSc, wantS, wantSc)
	if len(w.r.dirty) != 0 {
		t.Fatalf("bf16 recipe: %d ranges dirty, want none (everything is staged)", len(w.r.dirty))
	}
}

// TestRefitNoLeakOnRejection: rejecting versions mid-stream leaves no
// goroutine behind.
func TestRefitNoLeakOnRejection(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 20), modelDir(t, 21)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	good := subset(t, b, experts)
	rawPublish(t, srv.URL(), 1, good, false, 0, 2048, -1, nil) // warm up the connection's goroutines
	w.waitStatus(t, 1)
	// The live path misses chunk 1 of every version: the rest, and the
	// rejection, come by the stream's consumer.
	w.r.liveHook = func(msg *nats.Msg) bool { return chunkSeq(msg) == 1 }
	// Versions 4 and 5 are protocol 1, whose SHA-256 has a goroutine.
	for v := uint64(2); v <= 5; v++ {
		protocol := ProtocolVersion
		if v >= 4 {
			protocol = Protocol1
		}
		rawPublishProtocol(t, protocol, srv.URL(), v, setBF16(t, good, "model.layers.0.mlp.experts.0.gate_proj.weight", 1, float32(math.NaN())), false, 1, 2048, -1, nil)
		if st := w.waitStatus(t, v); st.State != StateRejected {
			t.Fatalf("version %d: %+v", v, st)
		}
	}
	// No goroutine may still sit in a rejected version's consume callback
	// (the stream fallback's) or digester.
	var stuck int
	for range 100 {
		buf := make([]byte, 1<<20)
		stack := string(buf[:runtime.Stack(buf, true)])
		stuck = strings.Count(stack, "refit.(*Receiver).receive.func") + strings.Count(stack, "refit.(*chunkFeed).toStream.func") +
			strings.Count(stack, "refit.newDigester.func")
		if stuck == 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%d goroutines still in a rejected version's consume callback or digester", stuck)
}

// TestIsFull: a version is full when its tensors cover every weight, by
// their canonical names or fused per layer, in any mix.
func TestIsFull(t *testing.T) {
	m, err := policy.LoadModel(testBackend(t), modelDir(t, 50), testOpts(moe.RecipePerToken))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	targets, err := m.Tensors()
	if err != nil {
		t.Fatal(err)
	}
	r := &Receiver{targets: targets}
	canonical := func(skip func(name string) bool) []string {
		var names []string
		for _, tg := range targets {
			if skip == nil || !skip(tg.Name) {
				names = append(names, tg.Name)
			}
		}
		return names
	}
	layer0Experts := func(n string) bool { return strings.HasPrefix(n, "model.layers.0.mlp.experts.") }
	fused0 := []string{"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
	for _, tc := range []struct {
		name  string
		names []string
		want  bool
	}{
		{"every canonical name", canonical(nil), true},
		{"no final norm", canonical(func(n string) bool { return n == "model.norm.weight" }), false},
		{"no last expert's down_proj", canonical(func(n string) bool { return n == lastDown(targets) }), false},
		{"layer 0 fused", append(canonical(layer0Experts), fused0...), true},
		{"layer 0 fused, gate_up only", append(canonical(layer0Experts), fused0[0]), false},
		{"experts only", canonical(func(n string) bool { return !strings.Contains(n, ".mlp.experts.") }), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ws []*write
			for _, n := range tc.names {
				tg, err := m.Resolve(n)
				if err != nil {
					t.Fatal(err)
				}
				ws = append(ws, &write{target: tg})
			}
			if got := r.isFull(ws); got != tc.want {
				t.Errorf("isFull of %d tensors = %v, want %v", len(ws), got, tc.want)
			}
		})
	}
}

// lastDown is the name of the last expert down_proj among targets.
func lastDown(targets []policy.Target) string {
	last := ""
	for _, tg := range targets {
		if strings.HasSuffix(tg.Name, ".down_proj.weight") {
			last = tg.Name
		}
	}
	return last
}
