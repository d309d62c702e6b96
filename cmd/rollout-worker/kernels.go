package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	kcuda "github.com/rollout-worker/rollout-worker/kernels/cuda"
)

const kernelsUsage = `usage: rollout-worker kernels warm [flags]

Compiles every CUDA kernel program the worker uses into the cubin cache, so
that serve on the same architecture, NVRTC version and cache directory
starts without compiling: for baking the cache into a container image.
Prints each program's compile time and whether it was already cached.

The cache directory is --cache-dir, else $` + drv.EnvCacheDir + `, else the
user cache directory's rollout-worker/cubin; serve reads $` + drv.EnvCacheDir + `
(else the same default), so give it the directory warmed here. --arch
compiles for an architecture without a GPU (NVRTC and the CUDA headers are
still needed); by default the present device's.

Flags:
`

// runKernels is "kernels warm".
func runKernels(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kernels", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), kernelsUsage)
		fs.PrintDefaults()
	}
	arch := fs.String("arch", "", "target `architecture`, e.g. sm_90a (default: the present device's)")
	cacheDir := fs.String("cache-dir", "", "cubin cache `directory` (default: $"+drv.EnvCacheDir+", then the user cache directory)")
	jobs := fs.Int("jobs", 0, "programs compiled at once (0: one per CPU)")
	if len(args) == 0 || args[0] != "warm" {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "-help" || args[0] == "--help") {
			fs.Usage()
			return flag.ErrHelp
		}
		return usageErrorf("want the action warm")
	}
	if err := parseFlags(fs, args[1:]); err != nil {
		return err
	}
	if *cacheDir == drv.CacheOff {
		return usageErrorf("--cache-dir %s: warming needs a cache", drv.CacheOff)
	}
	start := time.Now()
	res, err := kcuda.Warm(drv.Config{CacheDir: *cacheDir}, *arch, *jobs)
	if err != nil {
		return fmt.Errorf("warm: %w", err)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROGRAM\tCACHE\tTIME")
	hits := 0
	for _, r := range res {
		state := "miss"
		if r.Cached {
			state, hits = "hit", hits+1
		}
		fmt.Fprintf(tw, "%s\t%s\t%v\n", r.Program, state, r.Elapsed.Round(time.Millisecond))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%d programs, %d already cached, %v\n", len(res), hits, time.Since(start).Round(time.Millisecond))
	return nil
}
