package refit

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// signedPublisher is a publisher of testModel that signs with s.
func signedPublisher(t *testing.T, url string, s *Signer) *Publisher {
	t.Helper()
	p, err := NewPublisher(refittest.Connect(t, url), PublisherConfig{Model: testModel, ChunkBytes: 64 << 10, Signer: s}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// headerSum is the header_sha256 of a stream.
func headerSum(t testing.TB, stream []byte) string {
	t.Helper()
	n := binary.LittleEndian.Uint64(stream)
	sum := sha256.Sum256(stream[:8+n])
	return hex.EncodeToString(sum[:])
}

// rawPublishSigned publishes version v of stream with its announcement and
// manifest signed by s, while the chunks carry sent (nil: stream, of the
// same length): what a client that may publish chunks but does not hold the
// key could make of a signed version. The manifest's chunk table is sent's
// (as if its CRC-32Cs had been forged to match); its header and stream
// digests are stream's. tamper, when set, changes the announcement and the
// manifest after they were signed.
func rawPublishSigned(t *testing.T, url string, s *Signer, v uint64, stream, sent []byte, full bool, base uint64, chunk int, tamper func(*Announce, *Manifest)) {
	t.Helper()
	if sent == nil {
		sent = stream
	}
	ctx := context.Background()
	p := newPublisher(t, url)
	_, kv, err := p.ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	chunks := (len(stream) + chunk - 1) / chunk
	a := Announce{Protocol: ProtocolVersion, Model: testModel, Version: v, Full: full, Subject: VersionSubject(testModel, v),
		TotalBytes: int64(len(stream)), ChunkBytes: chunk, Chunks: chunks, HeaderSHA256: headerSum(t, stream)}
	if !full {
		a.Base = base
	}
	table := NewChunkTable()
	for seq := range chunks {
		data := sent[seq*chunk : min((seq+1)*chunk, len(sent))]
		table.Add(int64(seq*chunk), len(data), CRC32C(data))
	}
	sum := sha256.Sum256(stream)
	m := Manifest{Announce: a, ChunkTableSHA256: table.Sum(), StreamSHA256: hex.EncodeToString(sum[:]), PublishedAt: time.Now()}
	m.HeaderBytes, m.Tensors = headerCounts(t, stream)
	if err := s.SignAnnounce(&a); err != nil {
		t.Fatal(err)
	}
	if err := s.SignManifest(&m); err != nil {
		t.Fatal(err)
	}
	if tamper != nil {
		tamper(&a, &m)
	}
	put := func(key string, val any) {
		b, _ := json.Marshal(val)
		if _, err := kv.Put(ctx, key, b); err != nil {
			t.Fatal(err)
		}
	}
	put(KeyAnnounce, a)
	js, _ := jetstream.New(p.nc)
	for seq := range chunks {
		data := sent[seq*chunk : min((seq+1)*chunk, len(sent))]
		c := Chunk{Version: v, Seq: seq, Offset: int64(seq * chunk), Total: int64(len(sent)), Chunks: chunks, CRC: CRC32C(data)}
		if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: a.Subject, Header: c.Header(), Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	put(KeyManifest, m)
}

// swapNames returns stream with the names of two tensors of the same shape
// and name length swapped in its header: a valid header of the same size
// that sends each one's bytes to the other.
func swapNames(t *testing.T, stream []byte, x, y string) []byte {
	t.Helper()
	if len(x) != len(y) || !bytes.Contains(stream, []byte(x)) || !bytes.Contains(stream, []byte(y)) {
		t.Fatalf("cannot swap %q and %q", x, y)
	}
	out := bytes.Replace(stream, []byte(x), []byte(strings.Repeat("\x00", len(x))), 1)
	out = bytes.Replace(out, []byte(y), []byte(x), 1)
	return bytes.Replace(out, []byte(strings.Repeat("\x00", len(x))), []byte(y), 1)
}

// TestRefitSigned: a worker with a trust file applies versions signed by a
// trusted key and rejects every other, with a status that says why, before
// it writes anything or records the number; a bogus version numbered 2^64-1
// blocks neither the worker nor the signing publisher.
func TestRefitSigned(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b, c := modelDir(t, 40), modelDir(t, 41), modelDir(t, 42)
	s, other := sgSigner(t), sgSigner(t)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(cfg *ReceiverConfig) {
		cfg.Trust = sgTrust(t, s.PublicKey())
		cfg.ChunkTimeout = time.Second
	})
	fullB := subset(t, b, nil)
	expertsB := subset(t, b, experts)
	down0, down1 := "model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"
	v := uint64(0)
	for _, tc := range []struct {
		name    string
		version uint64 // 0: the next
		publish func(v uint64)
		want    string
	}{
		{"unsigned", 0, func(v uint64) { rawPublish(t, srv.URL(), v, fullB, true, 0, 4096, -1, nil) }, ErrUnsigned.Error()},
		{"unsigned, numbered 2^64-1", math.MaxUint64, func(v uint64) { rawPublish(t, srv.URL(), v, fullB, true, 0, 4096, -1, nil) }, ErrUnsigned.Error()},
		{"untrusted key", 0, func(v uint64) { publish(t, signedPublisher(t, srv.URL(), other), v, fullB, true) }, ErrUntrustedKey.Error()},
		{"fields changed after signing", 0, func(v uint64) {
			rawPublishSigned(t, srv.URL(), s, v, expertsB, nil, false, 0, 4096, func(a *Announce, m *Manifest) { a.Base, m.Base = 1, 1 })
		}, ErrBadSignature.Error()},
		{"header changed", 0, func(v uint64) {
			rawPublishSigned(t, srv.URL(), s, v, expertsB, swapNames(t, expertsB, down0, down1), false, 0, 4096, nil)
		}, "header sha256"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ver := tc.version
			if ver == 0 {
				v++
				ver = v
			}
			tc.publish(ver)
			st := w.waitStatus(t, ver)
			if st.State != StateRejected || !strings.Contains(st.Reason, tc.want) {
				t.Fatalf("status %+v, want a rejection mentioning %q", st, tc.want)
			}
			if st.CurrentVersion != 0 || len(w.r.dirty) != 0 {
				t.Fatalf("after a rejection: serving %d, %d ranges dirty; want 0 and none", st.CurrentVersion, len(w.r.dirty))
			}
			if tc.want != "header sha256" && w.r.seen[ver] {
				t.Fatalf("version %d is recorded as seen: the same number, signed, would be refused", ver)
			}
		})
	}
	servesA(t, w, a)

	// Bytes that are not the ones signed, with a chunk table to match:
	// the stream's SHA-256 catches them before the commit.
	v++
	rawPublishSigned(t, srv.URL(), s, v, expertsB, setBF16(t, expertsB, down0, 5, 3), false, 0, 4096, nil)
	if st := w.waitStatus(t, v); st.State != StateRejected || !strings.Contains(st.Reason, "stream sha256") {
		t.Fatalf("forged chunks: %+v", st)
	}
	servesA(t, w, a)

	// The signing publisher passes over the bogus manifests in the bucket,
	// and the worker applies its version.
	v++
	publish(t, signedPublisher(t, srv.URL(), s), v, subset(t, c, nil), true)
	if st := w.waitStatus(t, v); st.State != StateApplied {
		t.Fatalf("signed version %d: %+v", v, st)
	}
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, c, moe.RecipePerToken)
	sameRollouts(t, "after the signed version", gotS, gotSc, wantS, wantSc)
	// A signed version is trusted for its number.
	big := uint64(1) << 40
	publish(t, signedPublisher(t, srv.URL(), s), big, subset(t, b, experts), false)
	if st := w.waitStatus(t, big); st.State != StateApplied || st.CurrentVersion != big {
		t.Fatalf("signed version %d: %+v", big, st)
	}
}

// TestRefitVersionJump: without a trust file, a version numbered more than
// MaxVersionStep above the one served is rejected before it changes
// anything, so that a bogus version 2^64-1 does not shut out the next real
// one.
func TestRefitVersionJump(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 43), modelDir(t, 44)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	zeros := subset(t, b, nil)
	for _, v := range []uint64{math.MaxUint64, DefaultMaxVersionStep + 1} {
		rawPublish(t, srv.URL(), v, zeros, true, 0, 4096, -1, nil)
		if st := w.waitStatus(t, v); st.State != StateRejected || !strings.Contains(st.Reason, "too far ahead") {
			t.Fatalf("version %d: %+v", v, st)
		}
		if w.r.CurrentVersion() != 0 {
			t.Fatalf("serving %d after version %d was rejected", w.r.CurrentVersion(), v)
		}
	}
	servesA(t, w, a)
	p := newPublisher(t, srv.URL())
	_, kv, err := p.ensure(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(context.Background(), KeyManifest); err != nil { // the publisher would refuse to go below the bogus manifest
		t.Fatal(err)
	}
	publish(t, p, DefaultMaxVersionStep, subset(t, b, nil), true)
	if st := w.waitStatus(t, DefaultMaxVersionStep); st.State != StateApplied {
		t.Fatalf("version %d, at the bound: %+v", uint64(DefaultMaxVersionStep), st)
	}
}

// TestRefitDirtyCountDistinct: a tensor written by several rejected
// versions is counted once in the needs_full reason.
func TestRefitDirtyCountDistinct(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 45), modelDir(t, 46)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	good := subset(t, b, experts)
	n := int(binary.LittleEndian.Uint64(good))
	h, err := ParseHeader(good[8:8+n], int64(len(good)))
	if err != nil {
		t.Fatal(err)
	}
	// A NaN at the start of the last tensor in data order: every other
	// expert tensor is written in place before the version is rejected.
	bad := setBF16(t, good, h.Tensors[len(h.Tensors)-1].Name, 0, float32(math.NaN()))
	for v := uint64(1); v <= 3; v++ {
		rawPublish(t, srv.URL(), v, bad, false, 0, 4096, -1, nil)
		if st := w.waitStatus(t, v); st.State != StateRejected {
			t.Fatalf("version %d: %+v", v, st)
		}
	}
	f, err := modelTensorNames(t, b)
	if err != nil {
		t.Fatal(err)
	}
	rawPublish(t, srv.URL(), 4, subset(t, b, regexp.MustCompile(`^model\.norm\.weight$`)), false, 0, 4096, -1, nil)
	st := w.waitStatus(t, 4)
	if st.State != StateNeedsFull {
		t.Fatalf("partial version over dirty experts: %+v", st)
	}
	got, err := strconv.Atoi(strings.Fields(st.Reason[strings.Index(st.Reason, ": ")+2:])[0])
	if err != nil {
		t.Fatalf("reason %q: %v", st.Reason, err)
	}
	if want := f - 1; got != want {
		t.Fatalf("reason %q: %d tensors dirty, want %d (the distinct expert tensors written, each by 3 rejected versions)", st.Reason, got, want)
	}
}

// modelTensorNames counts the expert tensors of model dir.
func modelTensorNames(t *testing.T, dir string) (int, error) {
	t.Helper()
	s := subset(t, dir, experts)
	n := binary.LittleEndian.Uint64(s)
	h, err := ParseHeader(s[8:8+n], int64(len(s)))
	return len(h.Tensors), err
}

// TestRefitSignedLateJoin: a worker with a trust file that starts after a
// bogus version was written over a signed one catches up with the signed
// one, from the bucket's history.
func TestRefitSignedLateJoin(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 47), modelDir(t, 48)
	s := sgSigner(t)
	publish(t, signedPublisher(t, srv.URL(), s), 1, subset(t, b, nil), true)
	rawPublish(t, srv.URL(), math.MaxUint64, subset(t, a, nil), true, 0, 4096, -1, nil)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(cfg *ReceiverConfig) { cfg.Trust = sgTrust(t, s.PublicKey()) })
	for deadline := time.Now().Add(20 * time.Second); w.r.CurrentVersion() != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("serving %d, want 1 (last status %+v)", w.r.CurrentVersion(), w.r.LastStatus())
		}
	}
	gotS, gotSc := rollouts(t, w.e)
	wantS, wantSc := fresh(t, b, moe.RecipePerToken)
	sameRollouts(t, "late join past a bogus manifest", gotS, gotSc, wantS, wantSc)
}
