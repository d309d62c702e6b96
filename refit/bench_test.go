package refit

import (
	"bytes"
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/rollout-worker/rollout-worker/internal/natsembed"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// rawNATS measures core-NATS throughput on loopback: size bytes as 1 MiB
// messages from one connection to a subscriber on another, timed from the
// first publish to the last byte received.
func rawNATS(b testing.TB, url string, size int) float64 {
	b.Helper()
	pub, sub := refittest.Connect(b, url), refittest.Connect(b, url)
	const msg = 1 << 20
	payload := make([]byte, msg-4096) // what fits a 1 MiB max_payload with headers
	n := (size + len(payload) - 1) / len(payload)
	var got atomic.Int64
	done := make(chan struct{})
	s, err := sub.Subscribe("bench.raw", func(m *nats.Msg) {
		if got.Add(int64(len(m.Data))) >= int64(n*len(payload)) {
			close(done)
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Unsubscribe()
	if err := sub.Flush(); err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	for range n {
		if err := pub.Publish("bench.raw", payload); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-done:
	case <-time.After(time.Minute):
		b.Fatalf("raw NATS: %d of %d bytes after a minute", got.Load(), n*len(payload))
	}
	return float64(n*len(payload)) / time.Since(start).Seconds() / 1e6
}

// benchSetup starts the benchmarks' server (max_payload 8 MiB, as the
// embedded server of `serve` has: the publisher's default chunks fit it,
// and the core-NATS side sends 1 MiB messages) and writes a random "small"
// model to dir; stream is a full version of it.
func benchSetup(b *testing.B) (srv *refittest.Server, dir string, stream []byte) {
	b.Helper()
	srv = refittest.StartServer(b, refittest.WithMaxPayload(natsembed.DefaultMaxPayload))
	cfg, err := policy.Preset("small")
	if err != nil {
		b.Fatal(err)
	}
	dir = b.TempDir()
	if err := policy.WriteRandomModel(dir, cfg, 1); err != nil {
		b.Fatal(err)
	}
	return srv, dir, subset(b, dir, nil)
}

// BenchmarkRefitThroughput publishes full versions of the "small" preset
// (18 MB) to one worker and reports the throughput into the worker's
// resident buffers (from the start of Publish to the last byte written and
// verified) and end to end (to the commit), next to raw core-NATS
// throughput of 1 MiB messages measured in the same run, and the ratio.
// The server's max_payload is the embedded server's (8 MiB) and the
// publisher has its defaults (1 MiB chunks); docs/REFIT.md ("Throughput")
// has the numbers.
func BenchmarkRefitThroughput(b *testing.B) {
	for _, storage := range []string{"file", "memory"} {
		b.Run(storage, func(b *testing.B) {
			srv, dir, stream := benchSetup(b)
			w := startWorker(b, srv.URL(), dir, "bench", moe.RecipePerToken, nil)
			pcfg := PublisherConfig{Model: testModel}
			if storage == "memory" {
				pcfg.Storage = 1 // jetstream.MemoryStorage
			}
			p, err := NewPublisher(refittest.Connect(b, srv.URL()), pcfg, nil)
			if err != nil {
				b.Fatal(err)
			}
			var v uint64
			var total, commit time.Duration
			var rawSum float64
			for b.Loop() {
				// Side by side: the same bytes over core NATS, then as a
				// version, in every iteration.
				rawSum += rawNATS(b, srv.URL(), len(stream))
				v++
				start := time.Now()
				if _, err := p.Publish(context.Background(), v, bytes.NewReader(stream), int64(len(stream)), true); err != nil {
					b.Fatal(err)
				}
				for w.r.LastStatus().Version != v {
					time.Sleep(100 * time.Microsecond)
				}
				total += time.Since(start)
				st := w.r.LastStatus()
				if st.State != StateApplied {
					b.Fatalf("version %d: %+v", v, st)
				}
				commit += time.Duration(st.PhasesMS["commit"] * float64(time.Millisecond))
			}
			raw := rawSum / float64(v) // mean of the per-iteration rates
			bytes := float64(len(stream)) * float64(v)
			// Into the resident buffers: publish start to the last byte
			// written and verified (the commit, a CPU requantization of
			// every expert here, excluded); and end to end.
			into := bytes / (total - commit).Seconds() / 1e6
			e2e := bytes / total.Seconds() / 1e6
			b.ReportMetric(into, "refit-MB/s")
			b.ReportMetric(e2e, "with-commit-MB/s")
			b.ReportMetric(raw, "nats-MB/s")
			b.ReportMetric(into/raw, "ratio")
			b.Logf("%s storage: %d bytes a version; into buffers %.0f MB/s (%.0f with the commit), raw core NATS %.0f MB/s: ratio %.2f; last phases %v",
				storage, len(stream), into, e2e, raw, into/raw, w.r.LastStatus().PhasesMS)
		})
	}
}

// BenchmarkJetStreamLive is the floor under BenchmarkRefitThroughput: the
// same bytes as bare JetStream publishes of the publisher's chunk size
// (asynchronous, no headers, no refit work on either side), timed from the
// first publish to the last byte at a core-NATS subscriber of the stream's
// subjects (the refit worker's live path), next to raw core NATS measured
// in the same iteration. A refit cannot beat its ratio: storing and
// acknowledging each message costs the server this much before any refit
// work (docs/REFIT.md, "Throughput").
func BenchmarkJetStreamLive(b *testing.B) {
	for _, storage := range []jetstream.StorageType{jetstream.FileStorage, jetstream.MemoryStorage} {
		b.Run(strings.ToLower(storage.String()), func(b *testing.B) {
			srv, _, version := benchSetup(b)
			size := len(version) // a refit version's bytes
			pub, sub := refittest.Connect(b, srv.URL()), refittest.Connect(b, srv.URL())
			js, err := jetstream.New(pub)
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			stream, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "FLOOR", Subjects: []string{"floor.*"},
				Storage: storage, MaxMsgSize: natsembed.DefaultMaxPayload})
			if err != nil {
				b.Fatal(err)
			}
			payload := make([]byte, DefaultChunkBytes)
			n := (size + len(payload) - 1) / len(payload)
			var got atomic.Int64
			done := make(chan struct{}, 1)
			s, err := sub.Subscribe("floor.*", func(m *nats.Msg) {
				if got.Add(int64(len(m.Data))) == int64(n*len(payload)) {
					done <- struct{}{}
				}
			})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Unsubscribe()
			if err := s.SetPendingLimits(-1, 256<<20); err != nil {
				b.Fatal(err)
			}
			if err := sub.Flush(); err != nil {
				b.Fatal(err)
			}
			var total time.Duration
			var rawSum float64
			iters := 0
			for b.Loop() {
				rawSum += rawNATS(b, srv.URL(), size)
				iters++
				got.Store(0)
				subject := "floor." + strconv.Itoa(iters)
				start := time.Now()
				futs := make([]jetstream.PubAckFuture, 0, n)
				for range n {
					f, err := js.PublishMsgAsync(&nats.Msg{Subject: subject, Data: payload})
					if err != nil {
						b.Fatal(err)
					}
					futs = append(futs, f)
				}
				select {
				case <-done:
				case <-time.After(time.Minute):
					b.Fatalf("%d of %d bytes after a minute", got.Load(), n*len(payload))
				}
				total += time.Since(start)
				for _, f := range futs {
					select {
					case <-f.Ok():
					case err := <-f.Err():
						b.Fatal(err)
					}
				}
				if err := stream.Purge(ctx); err != nil {
					b.Fatal(err)
				}
			}
			live := float64(n*len(payload)) * float64(iters) / total.Seconds() / 1e6
			raw := rawSum / float64(iters)
			b.ReportMetric(live, "js-live-MB/s")
			b.ReportMetric(raw, "nats-MB/s")
			b.ReportMetric(live/raw, "ratio")
		})
	}
}
