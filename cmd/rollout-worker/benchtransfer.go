package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/rollout-worker/rollout-worker/internal/natsembed"
	"github.com/rollout-worker/rollout-worker/refit"
)

// transferConfig is a `bench refit --mode transfer` run.
type transferConfig struct {
	preset, device, recipe, natsURL, storage, logDir  string
	layers, parts, servers, liveParts, profileSeconds int
	seed                                              uint64
	partServers                                       []string // the servers of parts 1 and on (--servers)
	deltas                                            []float64
	streamMax, coreBytes                              int64
	timeout                                           time.Duration
	profilePublishers, serversInProcess, liveFirst    bool
}

// transferResult is one version of the run.
type transferResult struct {
	version      uint64
	kind         string
	status       refit.Status
	prepare      time.Duration // publish started -> announced (opening, the delta's sizing pass)
	transfer     time.Duration // announced -> the worker's status (committed)
	publisherRSS int64         // bytes, 0 if unknown
	cores        string        // cores busy over the transfer: publisher/servers/worker (cores)
}

// runTransferBench publishes a synthetic full version and deltas to a
// worker, each in processes of their own, on one NATS server, and times
// them against core NATS over the same server.
func runTransferBench(ctx context.Context, c transferConfig, stdout io.Writer) error {
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("bench refit: %w", err)
	}
	logDir := c.logDir
	if logDir == "" {
		if logDir, err = os.MkdirTemp("", "rollout-worker-bench-refit-"); err != nil {
			return fmt.Errorf("bench refit: %w", err)
		}
		defer os.RemoveAll(logDir)
	} else if err := os.MkdirAll(logDir, 0o755); err != nil {
		return fmt.Errorf("bench refit: %w", err)
	}
	url, where := c.natsURL, "server at "+redactURL(c.natsURL)
	cpu := &cpuGroups{}
	if url == "" {
		// --servers 0: one server embedded here; N: N servers, processes of
		// their own unless --servers-in-process.
		var urls []string
		for i := range max(c.servers, 1) {
			if c.servers > 0 && !c.serversInProcess {
				srv, err := startNATSProcess(self, logDir, i)
				if err != nil {
					return err
				}
				defer srv.stop()
				urls = append(urls, srv.url)
				cpu.servers = append(cpu.servers, srv.cmd.Process.Pid)
				continue
			}
			srv, err := natsembed.Start(natsembed.Config{})
			if err != nil {
				return fmt.Errorf("bench refit: %w", err)
			}
			defer srv.Shutdown()
			urls = append(urls, srv.URL())
			cpu.servers = []int{os.Getpid()} // and this process's own small share
		}
		url, c.partServers = urls[0], urls[1:]
		switch {
		case c.servers == 0:
			where = "embedded server"
		case c.serversInProcess:
			where = fmt.Sprintf("%d servers embedded in this process", len(urls))
		default:
			where = fmt.Sprintf("%d NATS server processes (rollout-worker nats)", len(urls))
		}
	}
	nc, err := nats.Connect(url, nats.Name("bench refit"))
	if err != nil {
		return fmt.Errorf("bench refit: connect to %s: %w", redactURL(url), err)
	}
	defer nc.Close()

	full := refit.SyntheticSpec{Preset: c.preset, Layers: c.layers, Seed: c.seed}
	src, err := refit.OpenSource(full.String(), nil)
	if err != nil {
		return fmt.Errorf("bench refit: %w", err)
	}
	versionBytes := src.Size()
	src.Close()
	layersDesc := "all layers"
	if c.layers > 0 {
		layersDesc = fmt.Sprintf("%d layers", c.layers)
	}
	fmt.Fprintf(stdout, "refit transfer: %s (%s), device %s, recipe %s, %s, %s storage, %d part(s) a version; a full version is %.1f MB\n",
		c.preset, layersDesc, c.device, c.recipe, where, c.storage, max(c.parts, 1), float64(versionBytes)/1e6)

	if c.coreBytes == 0 {
		c.coreBytes = min(versionBytes, 4<<30)
	}
	coreRate, dropped, err := coreNATSRate(ctx, []string{url}, c.coreBytes)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "core NATS, one connection to another, 1 MiB messages: %.2f GB/s (%.3f GB%s)\n", coreRate/1e9, float64(c.coreBytes)/1e9, droppedNote(dropped))
	if c.parts > 1 {
		// What the parts' connections carry together: a publisher and a
		// subscriber connection for each part, on the part's server, all
		// sending at once. The refit is compared with this.
		pairs := make([]string, c.parts)
		for i := range pairs {
			pairs[i] = partServer(url, c.partServers, i)
		}
		if coreRate, dropped, err = coreNATSRate(ctx, pairs, c.coreBytes); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "core NATS, %d pairs of connections at once (the parts' servers), 1 MiB messages: %.2f GB/s (%.3f GB%s)\n",
			c.parts, coreRate/1e9, float64(c.coreBytes)/1e9, droppedNote(dropped))
	}

	model := "bench-" + strings.ReplaceAll(c.preset, ".", "-")
	worker, err := startBenchWorker(ctx, self, c, url, model, logDir)
	if err != nil {
		return err
	}
	cpu.worker = worker.cmd.Process.Pid
	defer func() {
		if worker != nil {
			worker.stop()
		}
	}()

	// Rows go out as versions complete: a run cut short keeps what it
	// measured.
	fmt.Fprintf(stdout, "\n%-8s %-10s %10s %9s %11s %7s %8s %9s %8s %10s %11s %15s %13s\n", "version", "kind", "stream MB", "prepare s",
		"pub->commit s", "GB/s", "vs core", "commit ms", "copy ms", "requant ms", "pub RSS MiB", "cores p/s/w", "from streams")
	var results []transferResult
	var steps []float64
	prev := full
	for i := 0; i <= len(c.deltas); i++ {
		next, kind := full, "full"
		if i > 0 {
			steps = append(steps, c.deltas[i-1])
			next.Steps = append([]float64(nil), steps...)
			kind = fmt.Sprintf("delta %g%%", 100*c.deltas[i-1])
		}
		var prof chan error
		if i == 0 && c.profileSeconds > 0 {
			prof = make(chan error, 1)
			go func() { prof <- worker.profile(ctx, c.profileSeconds, filepath.Join(logDir, "worker-cpu.pprof")) }()
		}
		r, err := publishTimed(ctx, self, c, url, model, next, prev, i > 0, nc, logDir, cpu)
		if prof != nil {
			if perr := <-prof; perr != nil {
				fmt.Fprintf(stdout, "(no worker profile: %v)\n", perr)
			} else {
				fmt.Fprintf(stdout, "(worker CPU profile of the first %d s of version 1: %s)\n", c.profileSeconds, filepath.Join(logDir, "worker-cpu.pprof"))
			}
		}
		if err != nil {
			return err
		}
		r.kind = kind
		results = append(results, r)
		if r.status.State != refit.StateApplied {
			return fmt.Errorf("bench refit: version %d (%s): worker answered %s: %s", r.version, kind, r.status.State, r.status.Reason)
		}
		rate := float64(r.status.Bytes) / r.transfer.Seconds()
		// The chunks the worker read back from the streams: a part it
		// fell behind on live (0 when every chunk came live).
		fromStreams := "-"
		if ch := r.status.Chunks; ch != nil {
			fromStreams = fmt.Sprintf("%d/%d", ch.Stream, ch.Live+ch.Stream)
		}
		fmt.Fprintf(stdout, "%-8d %-10s %10.3f %9.2f %11.3f %7.3f %8.2f %9.1f %8.1f %10.1f %11s %15s %13s\n", r.version, r.kind,
			float64(r.status.Bytes)/1e6, r.prepare.Seconds(), r.transfer.Seconds(), rate/1e9, rate/coreRate,
			r.status.PhasesMS["commit"], r.status.PhasesMS["copy"], r.status.PhasesMS["requantize"], mib(r.publisherRSS), r.cores, fromStreams)
		prev = next
	}
	workerRSS, werr := worker.stop()
	worker = nil
	if werr != nil {
		return werr
	}
	fmt.Fprintf(stdout, "worker peak RSS: %s MiB\n", mib(workerRSS))
	if len(results) > 0 && len(results[0].status.Layers) > 0 {
		fmt.Fprintf(stdout, "\nper layer, version %d (ms): layer receive copy requantize\n", results[0].version)
		for _, l := range results[0].status.Layers {
			fmt.Fprintf(stdout, "  %5d %9.1f %6.2f %10.2f\n", l.Layer, l.ReceiveMS, l.CopyMS, l.RequantizeMS)
		}
	}
	return nil
}

func mib(b int64) string {
	if b <= 0 {
		return "-"
	}
	return strconv.FormatFloat(float64(b)/(1<<20), 'f', 0, 64)
}

// natsProcess is a `rollout-worker nats` process of a transfer run.
type natsProcess struct {
	cmd  *exec.Cmd
	log  *os.File
	url  string
	done chan error
}

// startNATSProcess starts server i as a process of its own (its output in
// logDir) and waits for the URL it prints.
func startNATSProcess(self, logDir string, i int) (*natsProcess, error) {
	log, err := os.Create(filepath.Join(logDir, fmt.Sprintf("nats-%d.log", i)))
	if err != nil {
		return nil, fmt.Errorf("bench refit: %w", err)
	}
	cmd := exec.Command(self, "nats", "--port", "0")
	cmd.Stderr = log
	out, err := cmd.StdoutPipe()
	if err != nil {
		log.Close()
		return nil, fmt.Errorf("bench refit: %w", err)
	}
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("bench refit: start NATS server %d: %w", i, err)
	}
	p := &natsProcess{cmd: cmd, log: log, done: make(chan error, 1)}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		io.Copy(log, out) // whatever else it prints, until it exits
		p.done <- cmd.Wait()
	}()
	select {
	case line, ok := <-lines:
		if u, found := strings.CutPrefix(line, "nats server listening on "); ok && found {
			p.url = u
			return p, nil
		}
		p.stop()
		return nil, fmt.Errorf("bench refit: NATS server %d printed %q, not its URL (log: %s)", i, line, log.Name())
	case <-time.After(30 * time.Second):
		p.stop()
		return nil, fmt.Errorf("bench refit: NATS server %d did not start in 30 s (log: %s)", i, log.Name())
	}
}

// stop interrupts the server and waits for it (killing it after 10 s).
func (p *natsProcess) stop() {
	p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
	p.log.Close()
}

// droppedNote says how many core-NATS messages slow subscribers lost.
func droppedNote(n int) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("; %d messages of 1 MiB dropped by slow subscribers, the rate is of those delivered", n)
}

// partServer is the server part i goes over: the first for part 0, or
// every part without part servers, else the part servers in turn.
func partServer(url string, partServers []string, i int) string {
	if i == 0 || len(partServers) == 0 {
		return url
	}
	return partServers[(i-1)%len(partServers)]
}

// coreNATSRate sends n bytes in 1 MiB core-NATS messages over as many
// pairs of connections as urls, all at once, pair i on server urls[i]
// (from a publishing connection to a subscribing one, a subject a pair),
// and returns bytes a second: the bytes that arrived over the time until
// the last one did. Core NATS drops what a slow subscriber cannot take
// (on a host whose cores are all busy); dropped counts those messages, and
// the rate is of what the subscribers got.
func coreNATSRate(ctx context.Context, urls []string, n int64) (rate float64, dropped int, err error) {
	const msg = 1 << 20
	count := int((n + msg - 1) / msg)
	per := (count + len(urls) - 1) / len(urls)
	type pair struct {
		pub, sub *nats.Conn
		subject  string
		count    int
		got      atomic.Int64
		last     atomic.Int64 // unix nanoseconds of the last message
	}
	pairs := make([]*pair, 0, len(urls))
	defer func() {
		for _, p := range pairs {
			p.pub.Close()
			p.sub.Close()
		}
	}()
	fail := func(err error) (float64, int, error) { return 0, 0, fmt.Errorf("bench refit: core NATS: %w", err) }
	total := 0
	for i, url := range urls {
		k := min(per, count-total)
		if k <= 0 {
			break
		}
		total += k
		pub, err := nats.Connect(url, nats.Name("bench refit core publisher"))
		if err != nil {
			return fail(err)
		}
		sub, err := nats.Connect(url, nats.Name("bench refit core subscriber"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
		if err != nil {
			pub.Close()
			return fail(err)
		}
		p := &pair{pub: pub, sub: sub, subject: "bench.refit.core." + strconv.Itoa(i), count: k}
		pairs = append(pairs, p)
		s, err := sub.Subscribe(p.subject, func(*nats.Msg) {
			p.got.Add(1)
			p.last.Store(time.Now().UnixNano())
		})
		if err != nil {
			return fail(err)
		}
		if err := s.SetPendingLimits(-1, 1<<30); err != nil {
			return fail(err)
		}
		if err := sub.Flush(); err != nil {
			return fail(err)
		}
	}
	payload := bytes.Repeat([]byte{0x3c}, msg)
	start := time.Now()
	errs := make([]error, len(pairs))
	var wg sync.WaitGroup
	for i, p := range pairs {
		wg.Go(func() {
			for range p.count {
				if err := p.pub.Publish(p.subject, payload); err != nil {
					errs[i] = err
					return
				}
			}
			errs[i] = p.pub.Flush()
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fail(err)
	}
	// Wait until every message is in, or none has come for a second.
	received := func() (got int64, last int64) {
		for _, p := range pairs {
			got += p.got.Load()
			last = max(last, p.last.Load())
		}
		return got, last
	}
	for {
		got, last := received()
		if got == int64(total) || (last > 0 && time.Since(time.Unix(0, last)) > time.Second) {
			break
		}
		if last == 0 && time.Since(start) > time.Minute {
			return fail(errors.New("no message arrived in a minute"))
		}
		select {
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	got, last := received()
	return float64(got*msg) / time.Unix(0, last).Sub(start).Seconds(), total - int(got), nil
}

// benchWorker is the `serve` process of a transfer run.
type benchWorker struct {
	cmd  *exec.Cmd
	log  *os.File
	done chan error
	rss  *rssWatch
	addr string // its /metrics, /readyz and (--pprof) /debug/pprof/
}

// profile writes a CPU profile of the worker over the next seconds to
// path: started with the first version, it shows where the worker's
// receive spends its time.
func (w *benchWorker) profile(ctx context.Context, seconds int, path string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", w.addr, seconds), nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("bench refit: worker profile: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("bench refit: worker profile: %s", resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("bench refit: worker profile: %w", err)
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("bench refit: worker profile: %w", err)
	}
	return f.Close()
}

// startBenchWorker starts `serve` on the preset and waits until it is
// ready.
func startBenchWorker(ctx context.Context, self string, c transferConfig, url, model, logDir string) (*benchWorker, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("bench refit: %w", err)
	}
	addr := l.Addr().String()
	l.Close()
	log, err := os.Create(filepath.Join(logDir, "worker.log"))
	if err != nil {
		return nil, fmt.Errorf("bench refit: %w", err)
	}
	args := []string{"serve", "--preset", c.preset, "--layers", strconv.Itoa(c.layers), "--device", c.device,
		"--recipe", c.recipe, "--nats-url", url, "--model-id", model, "--worker-id", "bench-worker",
		"--http-addr", addr, "--log-format", "json", "--refit-live-parts", strconv.Itoa(c.liveParts)}
	if len(c.partServers) > 0 {
		args = append(args, "--refit-part-servers", strings.Join(c.partServers, ","))
	}
	if c.profileSeconds > 0 {
		args = append(args, "--pprof")
	}
	cmd := exec.Command(self, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("bench refit: start the worker: %w", err)
	}
	w := &benchWorker{cmd: cmd, log: log, done: make(chan error, 1), rss: watchRSS(cmd.Process.Pid), addr: addr}
	go func() { w.done <- cmd.Wait() }()
	deadline := time.Now().Add(c.timeout)
	for {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return w, nil
			}
		}
		select {
		case err := <-w.done:
			w.rss.Stop()
			w.log.Close()
			return nil, fmt.Errorf("bench refit: the worker exited before it was ready (%v); its log: %s", err, log.Name())
		case <-ctx.Done():
			w.stop()
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			w.stop()
			return nil, fmt.Errorf("bench refit: the worker was not ready after %v; its log: %s", c.timeout, log.Name())
		}
	}
}

// stop asks the worker to drain and exit, and returns its peak RSS.
func (w *benchWorker) stop() (int64, error) {
	defer w.log.Close()
	peak := w.rss.Stop()
	_ = w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-w.done:
	case <-time.After(2 * time.Minute):
		_ = w.cmd.Process.Kill()
		<-w.done
		return 0, errors.New("bench refit: the worker did not stop within 2 minutes of SIGTERM; killed")
	}
	return peak, nil
}

// publishTimed runs `publish` for one version and times it by the
// announcement and the worker's status, both seen on core NATS.
func publishTimed(ctx context.Context, self string, c transferConfig, url, model string, next, base refit.SyntheticSpec,
	delta bool, nc *nats.Conn, logDir string, cpu *cpuGroups) (transferResult, error) {
	var res transferResult
	type seen struct {
		at   time.Time
		data []byte
		cpu  cpuSnap
	}
	announced := make(chan cpuSnap, 4)
	statuses := make(chan seen, 16)
	as, err := nc.Subscribe("$KV."+refit.BucketName(model)+".announce", func(*nats.Msg) {
		select {
		case announced <- cpu.snap():
		default:
		}
	})
	if err != nil {
		return res, fmt.Errorf("bench refit: %w", err)
	}
	defer as.Unsubscribe()
	ss, err := nc.Subscribe(refit.StatusSubject(model), func(m *nats.Msg) {
		select {
		case statuses <- seen{time.Now(), m.Data, cpu.snap()}:
		default:
		}
	})
	if err != nil {
		return res, fmt.Errorf("bench refit: %w", err)
	}
	defer ss.Unsubscribe()
	if err := nc.Flush(); err != nil {
		return res, fmt.Errorf("bench refit: %w", err)
	}

	args := []string{"publish", "--nats-url", url, "--model-id", model, "--version", "next", "--from", next.String(),
		"--storage", c.storage, "--wait-workers", "1", "--timeout", c.timeout.String()}
	if delta {
		args = append(args, "--base", base.String())
	}
	if c.streamMax > 0 {
		args = append(args, "--stream-max-bytes", strconv.FormatInt(c.streamMax, 10))
	}
	args = append(args, "--parts", strconv.Itoa(max(c.parts, 1)))
	if c.liveFirst {
		args = append(args, "--live-first")
	}
	if len(c.partServers) > 0 {
		args = append(args, "--part-servers", strings.Join(c.partServers, ","))
	}
	if c.profilePublishers {
		// One a version: the full one is step 0, each delta a step more.
		args = append(args, "--cpu-profile", filepath.Join(logDir, fmt.Sprintf("publish-step%d-cpu.pprof", len(next.Steps))))
	}
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, self, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	runErr := cmd.Start()
	if runErr == nil {
		cpu.setPublisher(cmd.Process.Pid)
		rss := watchRSS(cmd.Process.Pid)
		runErr = cmd.Wait()
		res.publisherRSS = rss.Stop()
	}
	if err := os.WriteFile(filepath.Join(logDir, fmt.Sprintf("publish-%d.log", start.UnixNano())), out.Bytes(), 0o644); err != nil {
		return res, fmt.Errorf("bench refit: %w", err)
	}
	if runErr != nil {
		return res, fmt.Errorf("bench refit: publish %s: %w\n%s", next, runErr, out.String())
	}
	var ann cpuSnap
	select {
	case ann = <-announced:
	default:
		return res, errors.New("bench refit: the version's announcement was not seen")
	}
	// publish --wait-workers returned after the status: it is here, or
	// on its way on this connection.
	timeout := time.After(5 * time.Second)
	for {
		select {
		case sn := <-statuses:
			st, err := refit.ParseStatus(sn.data)
			if err != nil || st.Worker != "bench-worker" {
				continue
			}
			res.status, res.version = st, st.Version
			res.prepare, res.transfer = ann.at.Sub(start), sn.at.Sub(ann.at)
			res.cores = cores(ann, sn.cpu)
			return res, nil
		case <-timeout:
			return res, errors.New("bench refit: publish returned, but the worker's status was not seen")
		}
	}
}
