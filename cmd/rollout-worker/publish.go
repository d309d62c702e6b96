package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/rollout-worker/rollout-worker/refit"
)

const publishUsage = `Usage: rollout-worker publish --nats-url URL --model-id ID --version N|next
       --from DIR|FILE.safetensors [--only REGEX] [--base DIR|FILE.safetensors [--base-version B]]
       [--wait-workers K --timeout D]
       [--sign-key SEEDFILE] [--nats-creds FILE | --nats-nkey FILE] [--tls-ca FILE ...]

Publish a weight version to the rollout workers over NATS JetStream
(refit/PROTOCOL.md): the BF16 tensors of a checkpoint, a model directory
(model.safetensors, or the shards of model.safetensors.index.json) or one
safetensors file, as one safetensors stream in chunks on refit.ID.v.N.
Every published tensor must be BF16. --from (and --base) may also name a
synthetic checkpoint, synthetic:PRESET[?layers=N&seed=S&steps=F1,F2,...]:
the preset's tensors with values generated as they are read, each training
step changing the fraction Fi of the elements (refit.SyntheticPrefix), to
load-test the refit path at a real model's size without a checkpoint.

Without --only the version is full: every tensor of the checkpoint, which
must then be the whole model. With --only only the tensors whose names
match REGEX (a Go regexp, unanchored) go out, as a partial version (full if
REGEX happens to match every tensor); the workers keep the other tensors.
When the next version must be full (an earlier version was announced and
never completed: refit/PROTOCOL.md, "After a status other than applied"),
--only is overridden: every tensor goes out, and the output says why.

With --base, the version is a delta on the newest version published (or
--base-version B, which must be it), whose weights --base holds (a
checkpoint of the same form as --from): only the tensors of --from (those
--only selects) that differ from --base go out, each as the BF16 elements
that changed, by index list or bitmap, whichever is smaller, or whole where
that is smaller (refit/PROTOCOL.md, "Delta tensors"). Workers that serve
another version answer needs_full. When the next version must be full, the
whole checkpoint goes out instead, and the output says why.

N must be newer than the last published version, and not the number of an
attempt that did not finish. --version next takes one above the highest
version in the stream and the bucket (refit/PROTOCOL.md, "Version
numbers"): what a publisher that restarts should use. The manifest is printed
once JetStream has stored every chunk. With --wait-workers K the command
then waits up to --timeout for K workers' statuses, prints them with
per-layer timings, and fails unless every one applied the version.

With --sign-key the announcement and the manifest are signed with that nkey
seed (refit/PROTOCOL.md, "Signatures"): workers started with --refit-trust
apply only versions signed by a key they trust.

Flags:
`

func runPublish(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("publish", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), publishUsage)
		fs.PrintDefaults()
	}
	url := fs.String("nats-url", nats.DefaultURL, "NATS server `URL`(s), comma-separated")
	var nf natsFlags
	nf.registerAuth(fs)
	signKey := fs.String("sign-key", "", "sign the version with the nkey seed in this `file` (as nk -gen user writes it, or a NATS credentials file)")
	model := fs.String("model-id", "", "model `id`, [A-Za-z0-9_-]{1,64} (required)")
	var version versionFlag
	fs.Var(&version, "version", "version `number`, > 0 and newer than the last published, or next: one above the highest in the stream and bucket (required)")
	from := fs.String("from", "", "model `directory` or .safetensors file (required)")
	only := fs.String("only", "", "publish only tensors whose name matches this Go `regexp` (a partial version)")
	base := fs.String("base", "", "publish a delta against the checkpoint in this `directory` or .safetensors file: the weights of the newest version published")
	var baseVersion versionFlag
	fs.Var(&baseVersion, "base-version", "the version `number` --base holds (default: the newest version published); the delta is refused if another version is newer")
	waitWorkers := fs.Int("wait-workers", 0, "after publishing, wait for this many workers' statuses")
	timeout := fs.Duration("timeout", 5*time.Minute, "how long --wait-workers waits for the statuses")
	chunkBytes := fs.Int("chunk-bytes", 0, "chunk size in bytes, at most min(4 MiB, the server's max_payload - 4 KiB) (default min(1 MiB, the server's max_payload - 4 KiB))")
	inflight := fs.Int64("max-inflight-bytes", refit.DefaultMaxInflightBytes, "unacknowledged chunk bytes at most")
	storage := fs.String("storage", "file", "JetStream storage of the stream and bucket: file or memory")
	parts := partsFlag{auto: true}
	fs.Var(&parts, "parts", "split the version into this many parts, published at once over a NATS connection each (refit/PROTOCOL.md, \"Parts\"; workers follow up to serve --refit-live-parts of them live from the start); auto: one a 2 GiB of the version, at most one a four cores, at least one a server, at most 16 (refit.AutoParts)")
	partServers := fs.String("part-servers", "", "comma-separated NATS server `URLs` that carry parts 1 and on (part i on the ((i-1) mod n)th; part 0 and the announcements stay on --nats-url), so that a version's bytes cross several servers; workers need the same list (serve --refit-part-servers)")
	liveFirst := fs.Bool("live-first", false, "send a version of parts live first (refit/PROTOCOL.md, \"Live first\"; protocol 4): every part over core NATS, then the seal on which workers that received it all commit, then the same chunks into the streams and the manifest; workers must follow every part live from their start (serve --refit-live-parts at least --parts)")
	streamMax := fs.Int64("stream-max-bytes", 0, "cap the stream at this many bytes, the oldest chunks dropped first (0: keep the newest two versions whole)")
	cpuProfile := fs.String("cpu-profile", "", "write a CPU profile of the whole command (Go's pprof format) to this `file`")
	verbose := fs.Bool("v", false, "log progress (retries and warnings are always logged)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}

	switch {
	case *model == "":
		return usageErrorf("--model-id is required")
	case !refit.ValidModelID(*model):
		return usageErrorf("--model-id %q: want 1 to 64 of [A-Za-z0-9_-]", *model)
	case !version.next && version.n == 0:
		return usageErrorf("--version is required and must be at least 1 (or next)")
	case *from == "":
		return usageErrorf("--from is required")
	case *waitWorkers < 0:
		return usageErrorf("--wait-workers must not be negative, not %d", *waitWorkers)
	case *waitWorkers > 0 && *timeout <= 0:
		return usageErrorf("--timeout must be positive, not %v", *timeout)
	case *chunkBytes < 0:
		return usageErrorf("--chunk-bytes must not be negative, not %d", *chunkBytes)
	case *inflight <= 0:
		return usageErrorf("--max-inflight-bytes must be positive, not %d", *inflight)
	case !parts.auto && (parts.n < 1 || parts.n > refit.MaxParts):
		return usageErrorf("--parts %d: want 1 to %d, or auto", parts.n, refit.MaxParts)
	case !parts.auto && parts.n > 1 && *signKey != "":
		return usageErrorf("--parts %d with --sign-key: signed versions come in one part", parts.n)
	case *partServers != "" && *signKey != "":
		return usageErrorf("--part-servers with --sign-key: signed versions come in one part")
	case *partServers != "" && !parts.auto && parts.n < 2:
		return usageErrorf("--part-servers with --parts %d: the part servers carry parts 1 and on", parts.n)
	case *liveFirst && *signKey != "":
		return usageErrorf("--live-first with --sign-key: signed versions come in one part")
	case *liveFirst && !parts.auto && parts.n < 2:
		return usageErrorf("--live-first with --parts %d: versions in parts are sent live first, a version of one part is not", parts.n)
	case *streamMax != 0 && *streamMax < *inflight:
		return usageErrorf("--stream-max-bytes %d: want 0 or at least --max-inflight-bytes (%d)", *streamMax, *inflight)
	case baseVersion.next:
		return usageErrorf("--base-version takes a number")
	case baseVersion.set && *base == "":
		return usageErrorf("--base-version needs --base")
	}
	cfg := refit.PublisherConfig{Model: *model, MaxInflightBytes: *inflight, ChunkBytes: *chunkBytes, MaxStreamBytes: *streamMax, Parts: parts.n,
		PartServers: splitList(*partServers), LiveFirst: *liveFirst}
	switch *storage {
	case "file":
		cfg.Storage = jetstream.FileStorage
	case "memory":
		cfg.Storage = jetstream.MemoryStorage
	default:
		return usageErrorf("--storage %q: want file or memory", *storage)
	}
	if *signKey != "" {
		s, err := refit.LoadSigner(*signKey)
		if err != nil {
			return fmt.Errorf("--sign-key: %w", err)
		}
		cfg.Signer = s
	}
	nf.url = *url
	natsOpts, err := nf.options("rollout-worker publish")
	if err != nil {
		return err
	}
	var re *regexp.Regexp
	if *only != "" {
		if re, err = regexp.Compile(*only); err != nil {
			return usageErrorf("--only: %v", err)
		}
	}

	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return fmt.Errorf("--cpu-profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("--cpu-profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}

	level := zapcore.WarnLevel
	if *verbose {
		level = zapcore.InfoLevel
	}
	log := zap.New(zapcore.NewCore(zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig()), zapcore.AddSync(stderr), level))
	defer log.Sync()

	var delta *refit.DeltaSource
	if *base != "" {
		// Both checkpoints are read once here, side by side, to size the
		// delta: before anything is announced.
		if delta, err = refit.OpenDelta(*from, *base, re); err != nil {
			return err
		}
		defer delta.Close()
	}
	src, err := refit.OpenSource(*from, re)
	if err != nil {
		return err
	}
	defer src.Close()
	if parts.auto {
		size := src.Size()
		if delta != nil {
			size = delta.Size()
		}
		cfg.Parts = 1
		if cfg.Signer == nil {
			cfg.Parts = refit.AutoParts(size, runtime.NumCPU(), len(cfg.PartServers))
		}
	}

	// Reconnects without end: Publish retries until ctx ends (Ctrl-C).
	nc, err := nats.Connect(nf.url, append(natsOpts, nats.Timeout(5*time.Second))...)
	if err != nil {
		return fmt.Errorf("connect to NATS at %s: %w", redactURL(nf.url), err)
	}
	defer nc.Close()

	pub, err := refit.NewPublisher(nc, cfg, log)
	if err != nil {
		return err
	}
	v := version.n
	if version.next {
		if v, err = pub.NextVersion(ctx); err != nil {
			return err
		}
	}
	if !src.Full() || delta != nil {
		// After a version some worker did not apply, the next is full
		// (refit/PROTOCOL.md): the checkpoint holds every tensor.
		switch err := pub.FullVersionNeeded(ctx); {
		case errors.Is(err, refit.ErrFullVersionNeeded):
			what := "not only those --only selects"
			if delta != nil {
				what = "not a delta on " + *base
			}
			fmt.Fprintf(stdout, "%v\n  publishing every tensor of %s, %s\n", err, *from, what)
			delta = nil
			if src, err = refit.OpenSource(*from, nil); err != nil {
				return err
			}
			defer src.Close()
		case err != nil:
			return err
		}
	}
	var onVersion uint64
	if delta != nil {
		onVersion = baseVersion.n
		if !baseVersion.set {
			if onVersion, err = pub.NewestVersion(ctx); err != nil {
				return err
			}
		}
	}
	var statuses *refit.StatusCollector
	if *waitWorkers > 0 {
		// Statuses are not stored: listen before the version goes out.
		if statuses, err = pub.Statuses(ctx, v); err != nil {
			return err
		}
		defer statuses.Close()
	}

	start := time.Now()
	var m refit.Manifest
	if delta != nil {
		m, err = pub.PublishDelta(ctx, v, onVersion, delta, delta.Size())
	} else {
		m, err = pub.Publish(ctx, v, src, src.Size(), src.Full())
	}
	if err != nil {
		return err
	}
	writeManifestSummary(stdout, m, time.Since(start))
	if delta != nil {
		writeDeltaSummary(stdout, m, delta.Stats())
	}
	if statuses == nil {
		return nil
	}

	wctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	got, werr := statuses.Wait(wctx, *waitWorkers)
	if len(got) > 0 {
		fmt.Fprintln(stdout)
		if err := refit.FormatStatuses(stdout, got); err != nil {
			return err
		}
	}
	if werr != nil {
		return werr
	}
	var failed []string
	for _, s := range got {
		if s.State != refit.StateApplied {
			failed = append(failed, fmt.Sprintf("%s %s", s.Worker, s.State))
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("version %d: %d of %d workers did not apply it: %s (the next version must be full: publish without --only)",
			m.Version, len(failed), len(got), strings.Join(failed, ", "))
	}
	return nil
}

// versionFlag is --version: a number, or "next" for the publisher's next
// version (refit.Publisher.NextVersion). set says it was given.
// partsFlag is --parts: a count, or auto (chosen from the version's size).
type partsFlag struct {
	n    int
	auto bool
}

func (f *partsFlag) String() string {
	if f.auto {
		return "auto"
	}
	return strconv.Itoa(f.n)
}

func (f *partsFlag) Set(s string) error {
	if s == "auto" {
		f.n, f.auto = 0, true
		return nil
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return errors.New("want a number of parts, or auto")
	}
	f.n, f.auto = n, false
	return nil
}

type versionFlag struct {
	n    uint64
	next bool
	set  bool
}

func (f *versionFlag) String() string {
	if f.next {
		return "next"
	}
	if f.n == 0 {
		return ""
	}
	return strconv.FormatUint(f.n, 10)
}

func (f *versionFlag) Set(s string) error {
	if s == "next" {
		f.n, f.next, f.set = 0, true, true
		return nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return errors.New("want a number from 1 to 18446744073709551615, or next")
	}
	f.n, f.next, f.set = n, false, true
	return nil
}

// writeDeltaSummary prints what a delta version held.
func writeDeltaSummary(w io.Writer, m refit.Manifest, st refit.DeltaStats) {
	fmt.Fprintf(w, "  a delta on version %d: %d of %d tensors changed (%d sent as deltas, %d whole), %d of %d elements\n",
		m.Base, st.Changed, st.Tensors, st.DeltaTensors, st.Changed-st.DeltaTensors, st.ChangedElements, st.Elements)
	fmt.Fprintf(w, "  %d bytes, %.2f%% of the %d bytes of the same tensors whole\n",
		st.Bytes, 100*float64(st.Bytes)/float64(max(st.FullBytes, 1)), st.FullBytes)
}

// writeManifestSummary prints what was published.
func writeManifestSummary(w io.Writer, m refit.Manifest, took time.Duration) {
	kind := "partial"
	if m.Full {
		kind = "full"
	}
	rate := float64(m.TotalBytes) / (1 << 20) / max(took.Seconds(), 1e-9)
	fmt.Fprintf(w, "published %s version %d of model %s on %s\n", kind, m.Version, m.Model, m.Subject)
	fmt.Fprintf(w, "  %d tensors, %d bytes (header %d) in %d chunks of %d bytes, %.2fs (%.1f MiB/s)\n",
		m.Tensors, m.TotalBytes, m.HeaderBytes, m.Chunks, m.ChunkBytes, took.Seconds(), rate)
	if m.Protocol == refit.Protocol1 {
		fmt.Fprintf(w, "  sha256 %s\n", m.SHA256)
	} else {
		fmt.Fprintf(w, "  chunk table sha256 %s\n", m.ChunkTableSHA256)
	}
	if m.SignedBy != "" {
		fmt.Fprintf(w, "  signed by %s (stream sha256 %s)\n", m.SignedBy, m.StreamSHA256)
	}
}
