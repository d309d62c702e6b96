// Command rollout-worker is the rollout worker's command-line entry point.
//
// Usage:
//
//	rollout-worker <command> [flags]
//	rollout-worker help [command]
//
// Each subcommand is one entry in the commands table below; its work lives in
// functions that return errors, and main only maps them to exit codes: 0 on
// success, 1 when the command fails, 2 for usage errors.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"text/tabwriter"
)

// A command is one subcommand. run parses args (the arguments after the
// command name) with its own flag.FlagSet via parseFlags, writes its usage and
// diagnostics to stderr, and returns nil, flag.ErrHelp (after printing usage
// for -h), a *usageError for bad invocations, or any other error for a failed
// run. It must not call os.Exit and must stop early when ctx is done.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

// commands lists the subcommands in the order help shows them. Add new ones
// here.
var commands = []command{
	{"demo", "the whole loop in one process: NATS, a worker, a trainer refitting it, a driver (the README's main command)", runDemo},
	{"quantize", "quantize BF16 tensors of a safetensors file to NVFP4", runQuantize},
	{"bench", "benchmarks: the MoE layer (NVFP4 recipes against BF16), requantization, generation", runBench},
	{"init-model", "write a model directory with seeded random weights (presets tiny, small, ...)", runInitModel},
	{"serve", "run a rollout worker: engine, refit receiver and rollout service over NATS", runServe},
	{"generate", "request rollouts from the workers of a model and print them as JSON", runGenerate},
	{"score", "score token sequences with a model (teacher-forced logprobs)", runScore},
	{"calibrate", "measure the per_tensor recipe's activation scales over token sequences", runCalibrate},
	{"publish", "publish a weight version (all or some BF16 tensors) to the workers over NATS", runPublish},
	{"nats", "run a NATS server with JetStream (the one serve embeds) on 127.0.0.1", runNATS},
	{"kernels", "kernels warm: compile the CUDA kernels into the cubin cache (for a container image)", runKernels},
}

func lookup(name string) *command {
	for i := range commands {
		if commands[i].name == name {
			return &commands[i]
		}
	}
	return nil
}

// usageError is a bad invocation: exit status 2. reported means the flag
// package already printed the message and the usage.
type usageError struct {
	err      error
	reported bool
}

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

func usageErrorf(format string, args ...any) error {
	return &usageError{err: fmt.Errorf(format, args...)}
}

// parseFlags parses args with fs (which must use flag.ContinueOnError) and
// rejects positional arguments. Its errors follow the command contract.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return flag.ErrHelp
		}
		return &usageError{err: err, reported: true}
	}
	if fs.NArg() > 0 {
		return usageErrorf("unexpected argument %q", fs.Arg(0))
	}
	return nil
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run executes the command line args (without the program name) and returns
// the process exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "help", "-h", "-help", "--help":
		return help(ctx, args[1:], stdout, stderr)
	}
	cmd := lookup(args[0])
	if cmd == nil {
		fmt.Fprintf(stderr, "rollout-worker: unknown command %q\n\n", args[0])
		usage(stderr)
		return 2
	}
	return exitCode(cmd.name, cmd.run(ctx, args[1:], stdout, stderr), stderr)
}

// exitCode reports err on stderr and maps it to an exit status.
func exitCode(name string, err error, stderr io.Writer) int {
	var ue *usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &ue):
		if !ue.reported {
			fmt.Fprintf(stderr, "rollout-worker %s: %v\n", name, err)
		}
		fmt.Fprintf(stderr, "Run 'rollout-worker help %s' for usage.\n", name)
		return 2
	default:
		fmt.Fprintf(stderr, "rollout-worker %s: %v\n", name, err)
		return 1
	}
}

// help prints the command list, or one command's flags, to stdout.
func help(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	switch len(args) {
	case 0:
		usage(stdout)
		return 0
	case 1:
		cmd := lookup(args[0])
		if cmd == nil {
			fmt.Fprintf(stderr, "rollout-worker help: unknown command %q\n\n", args[0])
			usage(stderr)
			return 2
		}
		// -h makes the command print its usage and return flag.ErrHelp.
		return exitCode(cmd.name, cmd.run(ctx, []string{"-h"}, stdout, stdout), stderr)
	default:
		fmt.Fprintln(stderr, "usage: rollout-worker help [command]")
		return 2
	}
}

func usage(w io.Writer) {
	fmt.Fprint(w, "Usage:\n\n\trollout-worker <command> [flags]\n\nThe commands are:\n\n")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	for _, c := range commands {
		fmt.Fprintf(tw, "\t%s\t%s\n", c.name, c.summary)
	}
	tw.Flush()
	fmt.Fprint(w, "\nUse \"rollout-worker help <command>\" for more information about a command.\n")
}
