package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/rollout-worker/rollout-worker/internal/natsembed"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
	"github.com/rollout-worker/rollout-worker/worker"
)

const serveUsage = `Usage: rollout-worker serve [--model DIR | --preset NAME] [flags]

Run a rollout worker: the generation engine, the refit receiver (weight
versions over NATS JetStream, refit/PROTOCOL.md) and the rollout service
(NATS micro service "rollout-worker", rollout/SCHEMA.md). Without
--nats-url it starts an embedded NATS server with JetStream on loopback and
prints its URL. SIGTERM or SIGINT drains: admission stops, in-flight
requests finish (or are aborted after --drain-timeout), every admitted
request gets its final reply, then the process exits.

Every flag can also be set by the environment variable ROLLOUT_WORKER_<FLAG>
(upper case, dashes as underscores), e.g. ROLLOUT_WORKER_NATS_URL; a flag on
the command line wins.

Flags:
`

// envFlags sets every flag not given on the command line from its
// ROLLOUT_WORKER_* environment variable.
func envFlags(fs *flag.FlagSet) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		env := envName(f.Name)
		if v, ok := os.LookupEnv(env); ok && !given[f.Name] && err == nil {
			if e := fs.Set(f.Name, v); e != nil {
				err = usageErrorf("%s=%q: %v", env, v, e)
			}
		}
	})
	return err
}

func envName(flagName string) string {
	return "ROLLOUT_WORKER_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// newLogger logs JSON when stderr is not a terminal, console text when it
// is.
func newLogger(w io.Writer, format string) (*zap.Logger, error) {
	if format == "auto" {
		format = "json"
		if f, ok := w.(*os.File); ok {
			if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
				format = "console"
			}
		}
	}
	var enc zapcore.Encoder
	switch format {
	case "json":
		enc = zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig())
	case "console":
		ec := zap.NewDevelopmentEncoderConfig()
		ec.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05.000")
		enc = zapcore.NewConsoleEncoder(ec)
	default:
		return nil, usageErrorf("--log-format %q: want auto, json or console", format)
	}
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(w), zap.InfoLevel)), nil
}

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return serve(ctx, args, stdout, stderr, nil)
}

// serve is runServe on be when be is not nil (the worker's Config.Backend):
// the tests run serve on a backend that fails on demand.
func serve(ctx context.Context, args []string, stdout, stderr io.Writer, be kernels.Backend) (err error) {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), serveUsage)
		fs.PrintDefaults()
	}
	var nf natsFlags
	nf.register(fs)
	var cfg worker.Config
	fs.StringVar(&cfg.ModelDir, "model", "", "model `directory` (config.json and safetensors)")
	fs.StringVar(&cfg.Preset, "preset", "tiny", "random model preset when --model is not given: "+strings.Join(policy.PresetNames(), ", "))
	fs.IntVar(&cfg.Layers, "layers", 0, "cut the preset to its first `N` decoder layers (0: all)")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed of the random preset model")
	recipeName := fs.String("recipe", "nvfp4", "MoE recipe: bf16, nvfp4, per_tensor (its input scales from --input-scales or the checkpoint) or unit_scale")
	fs.StringVar(&cfg.InputScales, "input-scales", "", "safetensors `file` of the per_tensor recipe's input scales (rollout-worker calibrate writes one)")
	fs.StringVar(&cfg.Device, "device", "auto", "compute device: auto, cpu or cuda")
	fs.StringVar(&cfg.ModelID, "model-id", "", "model id: the refit stream and the rollout subjects (rollout.<id>.*); empty: the preset's name or the model directory's base name")
	host, _ := os.Hostname()
	fs.StringVar(&cfg.WorkerID, "worker-id", fmt.Sprintf("%s-%d", host, os.Getpid()), "worker id in refit statuses and replies")
	fs.IntVar(&cfg.KVPages, "kv-pages", 0, "KV-cache pages; 0: --kv-memory-fraction of the GPU memory left after the weights (2048 on the CPU)")
	fs.Float64Var(&cfg.KVMemoryFraction, "kv-memory-fraction", 0.9, "with --kv-pages 0, the fraction of free GPU memory the KV cache takes")
	fs.BoolVar(&cfg.KVOnDemand, "kv-on-demand", false, "take KV pages as samples grow instead of reserving each request's max_tokens on admission; when the cache runs out the youngest samples are preempted and recomputed (bitwise the same tokens)")
	fs.BoolVar(&cfg.PrefixCache, "prefix-cache", false, "keep the KV pages of prompt prefixes and share them with later requests that start with the same tokens, under the same policy version (a refit drops them)")
	fs.IntVar(&cfg.PageSize, "page-size", 16, "tokens a KV page")
	fs.IntVar(&cfg.MaxBatchTokens, "max-batch-tokens", 512, "tokens one step carries")
	fs.IntVar(&cfg.MaxSeqs, "max-seqs", 64, "sequences one step carries")
	fs.BoolVar(&cfg.Graphs, "graphs", true, "replay decode steps from captured graphs")
	fs.IntVar(&cfg.Limits.MaxPromptTokens, "max-prompt-tokens", 4096, "longest prompt accepted")
	fs.IntVar(&cfg.Limits.MaxTokens, "max-tokens", 4096, "largest max_tokens accepted")
	fs.IntVar(&cfg.Limits.MaxN, "max-n", 64, "largest n accepted")
	fs.IntVar(&cfg.Limits.MaxQueue, "max-queue", 256, "requests admitted at once; more are answered overloaded")
	httpAddr := fs.String("http-addr", "127.0.0.1:9090", "address of /metrics, /healthz and /readyz (empty: none)")
	pprofOn := fs.Bool("pprof", false, "also serve Go's profiles on --http-addr under /debug/pprof/ (CPU, heap, goroutines, traces)")
	drainTimeout := fs.Duration("drain-timeout", 30*time.Second, "how long a drain lets in-flight requests finish before aborting them")
	logFormat := fs.String("log-format", "auto", "log format: auto (JSON unless on a terminal), json or console")
	fs.IntVar(&cfg.RefitLivePendingBytes, "refit-live-pending-bytes", refit.DefaultLivePendingBytes, "bytes of live chunks a part's subscription holds unread before NATS drops them and the part is read from its stream")
	fs.Func("refit-part-servers", "comma-separated NATS server `URLs` that carry parts 1 and on of a weight version, as the publisher's publish --part-servers (empty: every part on --nats-url)", func(v string) error {
		cfg.RefitPartServers = splitList(v)
		return nil
	})
	fs.IntVar(&cfg.RefitLiveParts, "refit-live-parts", 4, "parts of a weight version (publish --parts) followed live from the start, each on a NATS connection of its own; a version of more parts takes the rest from their streams at first")
	trustFile := fs.String("refit-trust", "", "apply only weight versions signed by a public nkey of this `file` (one a line, # comments; refit/PROTOCOL.md, \"Signatures\")")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := envFlags(fs); err != nil {
		return err
	}
	if cfg.Recipe, err = recipeFlag(*recipeName); err != nil {
		return err
	}
	if err := inputScalesFlag(cfg.Recipe, cfg.InputScales); err != nil {
		return err
	}
	if *trustFile != "" {
		if cfg.RefitTrust, err = refit.LoadTrust(*trustFile); err != nil {
			return fmt.Errorf("--refit-trust: %w", err)
		}
	}
	log, err := newLogger(stderr, *logFormat)
	if err != nil {
		return err
	}
	defer log.Sync()
	if cfg.RefitTrust != nil {
		log.Info("refit: applying only versions signed by a trusted key", zap.Strings("keys", cfg.RefitTrust.Keys()))
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	url := nf.url
	if url == "" {
		srv, err := natsembed.Start(natsembed.Config{})
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		url = srv.URL()
		log.Info("embedded NATS server started (JetStream on, loopback only)", zap.String("url", redactURL(url)), zap.String("store", srv.StoreDir()))
		fmt.Fprintf(stdout, "embedded NATS server: %s\n", redactURL(url))
	}
	opts, err := nf.options("rollout-worker " + cfg.WorkerID)
	if err != nil {
		return err
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", redactURL(url), err)
	}
	defer nc.Close()

	var draining atomic.Bool
	var w *worker.Worker
	var ready atomic.Bool // w is started
	if *httpAddr != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.HandleFunc("/healthz", func(rw http.ResponseWriter, _ *http.Request) { fmt.Fprintln(rw, "ok") })
		mux.HandleFunc("/readyz", func(rw http.ResponseWriter, _ *http.Request) {
			if !ready.Load() || !w.Ready() || draining.Load() || !nc.IsConnected() {
				http.Error(rw, "not ready", http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(rw, "ready")
		})
		if *pprofOn {
			mux.HandleFunc("/debug/pprof/", pprof.Index)
			mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
			mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
			mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
			mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		}
		ln, err := net.Listen("tcp", *httpAddr)
		if err != nil {
			return fmt.Errorf("--http-addr: %w", err)
		}
		hs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go hs.Serve(ln)
		defer hs.Close()
		log.Info("http listening", zap.String("addr", ln.Addr().String()))
	}

	cfg.Backend = be
	if w, err = worker.New(ctx, nc, cfg, log, reg); err != nil {
		return err
	}
	if err := w.Start(); err != nil {
		return errors.Join(err, w.Close())
	}
	ready.Store(true)
	id := w.ModelID()
	log.Info("worker ready", zap.String("worker", cfg.WorkerID), zap.String("model_id", id),
		zap.String("subjects", "rollout."+id+".>"))
	fmt.Fprintf(stdout, "worker %s ready: model %s, subjects rollout.%s.*\n", cfg.WorkerID, id, id)

	// A failed worker (its engine loop or refit receiver stopped on its own)
	// drains what it can and exits non-zero, so a supervisor restarts it.
	var failure error
	select {
	case <-ctx.Done():
		log.Info("draining", zap.Duration("timeout", *drainTimeout))
	case <-w.Failed():
		failure = w.Err()
		log.Error("worker failed; draining", zap.Error(failure))
	}
	draining.Store(true)
	dctx, cancel := context.WithTimeout(context.Background(), *drainTimeout)
	defer cancel()
	err = errors.Join(failure, w.Drain(dctx), w.Close())
	// Drain, not close: requests delivered just before the service
	// unsubscribed still get their "draining" reply.
	err = errors.Join(err, stopConn(nc, 5*time.Second))
	log.Info("stopped", zap.Error(err))
	return err
}

// stopConn drains nc and waits until it is closed. Draining, not closing:
// the micro service's Stop drains its subscriptions without waiting, so
// requests the server delivered just before are still queued in the client;
// nc.Drain lets the handlers answer them ("draining") before it closes.
// Flush then Close drops them: their clients hear nothing.
func stopConn(nc *nats.Conn, timeout time.Duration) error {
	if err := nc.Drain(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		return fmt.Errorf("drain connection: %w", err)
	}
	for end := time.Now().Add(timeout); !nc.IsClosed(); time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			nc.Close()
			return fmt.Errorf("connection not drained in %v", timeout)
		}
	}
	return nil
}
