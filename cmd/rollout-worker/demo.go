package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/natsembed"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
	"github.com/rollout-worker/rollout-worker/refit"
	"github.com/rollout-worker/rollout-worker/rollout"
	"github.com/rollout-worker/rollout-worker/worker"
)

const demoUsage = `Usage: rollout-worker demo [flags]

The whole loop in one process, on the embedded defaults: an embedded NATS
server, a worker (the CPU backend, a random model of --preset, the NVFP4
recipe), a trainer publishing a new weight version every --refit-every
(perturbed weights; every third version only the experts), and a driver
requesting rollouts continuously. It shows live progress and ends with the
per-layer refit timing table, rollouts/s, tokens/s and the policy versions
each rollout saw.

Flags:
`

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), demoUsage)
		fs.PrintDefaults()
	}
	duration := fs.Duration("duration", 20*time.Second, "how long the driver requests rollouts")
	refitEvery := fs.Duration("refit-every", 3*time.Second, "how often the trainer publishes a version")
	clients := fs.Int("clients", 4, "concurrent driver clients")
	preset := fs.String("preset", "tiny", "random model preset: "+strings.Join(policy.PresetNames(), ", "))
	layers := fs.Int("layers", 0, "cut the preset to its first `N` decoder layers (0: all)")
	recipeName := fs.String("recipe", "nvfp4", "MoE recipe: bf16, nvfp4 or unit_scale")
	device := fs.String("device", "auto", "compute device: auto, cpu or cuda")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	recipe, err := recipeFlag(*recipeName)
	if err == nil && recipe == moe.RecipePerTensor {
		err = usageErrorf("--recipe per_tensor needs input scales (serve --input-scales); the demo takes bf16, nvfp4 or unit_scale")
	}
	if err != nil {
		return err
	}
	if *clients < 1 || *duration <= 0 || *refitEvery <= 0 {
		return usageErrorf("--clients, --duration and --refit-every must be positive")
	}
	const modelID, seed = "demo", 1
	pc, err := policy.PresetLayers(*preset, *layers)
	if err != nil {
		return usageErrorf("--preset: %v", err)
	}
	start := time.Now()
	srv, err := natsembed.Start(natsembed.Config{})
	if err != nil {
		return err
	}
	defer srv.Shutdown()
	fmt.Fprintf(stdout, "embedded NATS server %s (JetStream on)\n", srv.URL())
	connect := func(name string) (*nats.Conn, error) {
		return nats.Connect(srv.URL(), nats.Name(name), nats.MaxReconnects(-1))
	}
	wnc, err := connect("demo worker")
	if err != nil {
		return err
	}
	defer wnc.Close()
	w, err := worker.New(ctx, wnc, worker.Config{Preset: *preset, Layers: *layers, Seed: seed, Recipe: recipe, Device: *device, ModelID: modelID,
		WorkerID: "demo-worker", KVPages: 1024, PageSize: 16, MaxBatchTokens: 256, MaxSeqs: 64, Graphs: true,
		Limits: rollout.Limits{MaxQueue: 64}}, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, w.Close()) }()
	if err := w.Start(); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "worker ready: %s preset (%s, %d layers, %d experts top-%d), recipe %s\n",
		*preset, pc.Architecture, pc.Layers, pc.Experts, pc.TopK, recipe)

	// The trainer starts from the weights the worker loaded.
	tdir, err := os.MkdirTemp("", "rollout-worker-demo-trainer-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tdir)
	if err := policy.WriteRandomModel(tdir, pc, seed); err != nil {
		return err
	}
	base, err := os.ReadFile(filepath.Join(tdir, "model.safetensors"))
	if err != nil {
		return err
	}
	tnc, err := connect("demo trainer")
	if err != nil {
		return err
	}
	defer tnc.Close()
	pub, err := refit.NewPublisher(tnc, refit.PublisherConfig{Model: modelID, Storage: 1 /* memory */}, nil)
	if err != nil {
		return err
	}
	dnc, err := connect("demo driver")
	if err != nil {
		return err
	}
	defer dnc.Close()
	client := rollout.NewClient(dnc, modelID)

	runCtx, stop := context.WithTimeout(ctx, *duration)
	defer stop()
	var (
		rollouts, tokens atomic.Int64
		mu               sync.Mutex
		spans            = map[int]int{}    // rollouts by the number of versions they saw
		seen             = map[uint64]int{} // rollouts by their last version
		statuses         []refit.Status
		wg               sync.WaitGroup
		trainerErr       error
	)
	wg.Add(1)
	go func() { // the trainer
		defer wg.Done()
		tick := time.NewTicker(*refitEvery)
		defer tick.Stop()
		for v := uint64(1); ; v++ {
			select {
			case <-runCtx.Done():
				return
			case <-tick.C:
			}
			src, err := version(tdir, base, v)
			if err != nil {
				trainerErr = err
				return
			}
			col, err := pub.Statuses(runCtx, v)
			if err != nil {
				src.Close()
				trainerErr = err
				return
			}
			_, err = pub.Publish(runCtx, v, src, src.Size(), src.Full())
			src.Close()
			if err != nil {
				col.Close()
				if runCtx.Err() == nil {
					trainerErr = err
				}
				return
			}
			got, err := col.Wait(runCtx, 1)
			col.Close()
			if err != nil {
				return
			}
			mu.Lock()
			statuses = append(statuses, got...)
			mu.Unlock()
		}
	}()
	for c := range *clients {
		wg.Add(1)
		go func() { // a driver client
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(c), 9))
			for i := 0; runCtx.Err() == nil; i++ {
				prompt := make([]int32, 4+r.IntN(28))
				for j := range prompt {
					prompt[j] = int32(r.IntN(pc.VocabSize))
				}
				seed := uint64(c*1_000_000 + i)
				samples, _, err := client.GenerateAll(runCtx, rollout.GenerateRequest{Schema: rollout.Schema, Prompt: prompt, N: 4,
					Temperature: 1, MaxTokens: 16 + r.IntN(48), Seed: &seed})
				if err != nil {
					continue // the run ends (ctx) or the worker is busy: try again
				}
				mu.Lock()
				for _, s := range samples {
					rollouts.Add(1)
					tokens.Add(int64(len(s.Tokens)))
					if len(s.Versions) > 0 {
						spans[len(slices.Compact(slices.Clone(s.Versions)))]++
						seen[s.Versions[len(s.Versions)-1]]++
					}
				}
				mu.Unlock()
			}
		}()
	}
	// Live progress, once a second.
	tick := time.NewTicker(time.Second)
	runStart := time.Now()
progress:
	for {
		select {
		case <-runCtx.Done():
			break progress
		case <-tick.C:
			el := time.Since(runStart).Seconds()
			fmt.Fprintf(stdout, "[%4.1fs] policy version %d | rollouts %d (%.1f/s) | tokens %d (%.0f/s)\n", el, w.Version(),
				rollouts.Load(), float64(rollouts.Load())/el, tokens.Load(), float64(tokens.Load())/el)
		}
	}
	tick.Stop()
	wg.Wait()
	elapsed := time.Since(runStart)
	if trainerErr != nil {
		return fmt.Errorf("trainer: %w", trainerErr)
	}

	fmt.Fprintf(stdout, "\n== refit: %d versions published, last status per layer ==\n", len(statuses))
	if len(statuses) > 0 {
		if err := refit.FormatStatuses(stdout, statuses[len(statuses)-1:]); err != nil {
			return err
		}
		var commit, receive float64
		applied := 0
		for _, s := range statuses {
			if s.State == refit.StateApplied {
				applied++
				commit += s.PhasesMS["commit"]
				receive += s.PhasesMS["receive"]
			}
		}
		fmt.Fprintf(stdout, "applied %d of %d; mean receive %.1f ms, mean commit (generation pause) %.1f ms\n",
			applied, len(statuses), receive/float64(max(applied, 1)), commit/float64(max(applied, 1)))
	}
	fmt.Fprintf(stdout, "\n== rollouts ==\n%d rollouts, %d tokens in %.1fs: %.1f rollouts/s, %.0f tokens/s\n",
		rollouts.Load(), tokens.Load(), elapsed.Seconds(), float64(rollouts.Load())/elapsed.Seconds(), float64(tokens.Load())/elapsed.Seconds())
	var parts []string
	for k := range spans {
		parts = append(parts, fmt.Sprintf("%d saw %d version(s)", spans[k], k))
	}
	sort.Strings(parts)
	fmt.Fprintf(stdout, "versions per rollout: %s\n", strings.Join(parts, ", "))
	var vs []uint64
	for v := range seen {
		vs = append(vs, v)
	}
	slices.Sort(vs)
	parts = parts[:0]
	for _, v := range vs {
		parts = append(parts, fmt.Sprintf("v%d: %d", v, seen[v]))
	}
	fmt.Fprintf(stdout, "rollouts by the version they ended under: %s\n", strings.Join(parts, ", "))
	if st, ok := w.GraphStats(); ok {
		fmt.Fprintf(stdout, "decode graphs on %s: %d captured, %d replays, %d recaptures across the refits\n",
			w.Backend(), st.Captures, st.Replays, st.Recaptures)
	}

	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.Drain(dctx); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "demo done in %.1fs\n", time.Since(start).Seconds())
	return nil
}

// perturb nudges every BF16 value of the safetensors stream base by a
// seeded 1% noise, in place: version v of the trainer's weights.
func perturb(base []byte, v uint64) error {
	n := binary.LittleEndian.Uint64(base)
	h, err := refit.ParseHeader(base[8:8+n], int64(len(base)))
	if err != nil {
		return err
	}
	r := rand.New(rand.NewPCG(v, 5))
	data := base[h.DataStart():]
	for i := 0; i+1 < len(data); i += 2 {
		x := bf16.ToFloat32(binary.LittleEndian.Uint16(data[i:]))
		binary.LittleEndian.PutUint16(data[i:], bf16.FromFloat32(x*(1+0.01*float32(r.NormFloat64()))))
	}
	return nil
}

// version writes version v of the trainer's weights and opens it for
// publishing: all tensors, or, every third version, only the experts (a
// partial version).
func version(dir string, weights []byte, v uint64) (*refit.Source, error) {
	if err := perturb(weights, v); err != nil {
		return nil, err
	}
	path := filepath.Join(dir, fmt.Sprintf("v%d.safetensors", v))
	if err := os.WriteFile(path, weights, 0o644); err != nil {
		return nil, err
	}
	var only *regexp.Regexp
	if v%3 == 0 {
		only = regexp.MustCompile(`\.mlp\.experts\.`)
	}
	return refit.OpenSource(path, only)
}
