package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/rollout-worker/rollout-worker/rollout"
)

const generateUsage = `Usage: rollout-worker generate --nats-url URL --prompt 1,2,3 [flags]

Request rollouts from the workers serving a model and print the samples and
the summary as JSON: {"samples": [...], "summary": {...}}.

Flags:
`

// parseIDs reads a comma-separated list of token ids.
func parseIDs(flagName, s string) ([]int32, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []int32
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.ParseInt(strings.TrimSpace(f), 10, 32)
		if err != nil {
			return nil, usageErrorf("--%s: %q is not a token id", flagName, f)
		}
		out = append(out, int32(v))
	}
	return out, nil
}

func runGenerate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("generate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), generateUsage)
		fs.PrintDefaults()
	}
	var nf natsFlags
	nf.register(fs)
	model := fs.String("model-id", "tiny", "model id (subjects rollout.<id>.*)")
	prompt := fs.String("prompt", "", "prompt token ids, comma-separated (required)")
	n := fs.Int("n", 1, "samples")
	seed := fs.Int64("seed", -1, "sampling seed (-1: the worker picks one and reports it)")
	temperature := fs.Float64("temperature", 1, "temperature (0: greedy)")
	topP := fs.Float64("top-p", 1, "top-p")
	topK := fs.Int("top-k", 0, "top-k (0: all)")
	maxTokens := fs.Int("max-tokens", 32, "tokens to generate per sample")
	stop := fs.String("stop", "", "stop token ids, comma-separated")
	logprobs := fs.Bool("logprobs", true, "return per-token logprobs")
	routed := fs.Bool("routed-experts", false, "return the routed experts of each token")
	minVersion := fs.Uint64("min-version", 0, "minimum policy version")
	timeout := fs.Duration("timeout", time.Minute, "give up after this long")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := envFlags(fs); err != nil {
		return err
	}
	if nf.url == "" {
		return usageErrorf("--nats-url is required")
	}
	req := rollout.GenerateRequest{Schema: rollout.Schema, N: *n, Temperature: float32(*temperature), TopP: float32(*topP),
		TopK: *topK, MaxTokens: *maxTokens, ReturnLogprobs: *logprobs, ReturnRoutedExperts: *routed, MinPolicyVersion: *minVersion}
	var err error
	if req.Prompt, err = parseIDs("prompt", *prompt); err != nil {
		return err
	}
	if req.Stop, err = parseIDs("stop", *stop); err != nil {
		return err
	}
	if *seed >= 0 {
		s := uint64(*seed)
		req.Seed = &s
	}
	opts, err := nf.options("rollout-worker generate")
	if err != nil {
		return err
	}
	nc, err := nats.Connect(nf.url, opts...)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", redactURL(nf.url), err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	samples, summary, err := rollout.NewClient(nc, *model).GenerateAll(ctx, req)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		Samples []rollout.SampleReply `json:"samples"`
		Summary rollout.Summary       `json:"summary"`
	}{samples, summary})
}
