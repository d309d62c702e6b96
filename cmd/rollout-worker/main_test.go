package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/stfile"
)

// TestRun drives the same entry point as main and checks exit statuses and
// where usage text goes.
func TestRun(t *testing.T) {
	in := writeInput(t, randomBF16("w", 1, 4, 32))
	out := filepath.Join(t.TempDir(), "out.safetensors")
	tests := []struct {
		name       string
		args       []string
		code       int
		stdout     []string // substrings
		stderr     []string
		noStdout   bool
		checkWrote bool
	}{
		{name: "no arguments", args: nil, code: 2, stderr: []string{"Usage:", "quantize", "help <command>"}, noStdout: true},
		{name: "help", args: []string{"help"}, code: 0, stdout: []string{"Usage:", "quantize", "NVFP4"}},
		{name: "--help", args: []string{"--help"}, code: 0, stdout: []string{"quantize"}},
		{name: "help quantize", args: []string{"help", "quantize"}, code: 0,
			stdout: []string{"rollout-worker quantize", "-mode", "-layout", "-match", "T.block_scales", "swizzled"}},
		{name: "help unknown", args: []string{"help", "frobnicate"}, code: 2, stderr: []string{`unknown command "frobnicate"`}},
		{name: "help too many", args: []string{"help", "a", "b"}, code: 2, stderr: []string{"usage: rollout-worker help"}},
		{name: "unknown command", args: []string{"frobnicate"}, code: 2, stderr: []string{`unknown command "frobnicate"`, "quantize"}},
		{name: "quantize -h", args: []string{"quantize", "-h"}, code: 0, stderr: []string{"-in", "-out"}, noStdout: true},
		{name: "unknown flag", args: []string{"quantize", "--bogus"}, code: 2,
			stderr: []string{"flag provided but not defined: -bogus", "help quantize"}},
		{name: "missing --in", args: []string{"quantize", "--out", out}, code: 2, stderr: []string{"--in is required"}},
		{name: "missing --out", args: []string{"quantize", "--in", in}, code: 2, stderr: []string{"--out is required"}},
		{name: "positional argument", args: []string{"quantize", "--in", in, "--out", out, "extra"}, code: 2,
			stderr: []string{`unexpected argument "extra"`}},
		{name: "bad workers", args: []string{"quantize", "--in", in, "--out", out, "--workers", "0"}, code: 2,
			stderr: []string{"--workers"}},
		{name: "quantize ok", args: []string{"quantize", "--in", in, "--out", out, "--mode", "per-token", "--layout", "swizzled"},
			code: 0, stderr: []string{"1 tensors (1 matrices)", "per-token", "swizzled", "256 bytes BF16 in"}, noStdout: true, checkWrote: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run(context.Background(), tc.args, &stdout, &stderr)
			if code != tc.code {
				t.Errorf("exit status %d, want %d", code, tc.code)
			}
			for _, s := range tc.stdout {
				if !strings.Contains(stdout.String(), s) {
					t.Errorf("stdout lacks %q:\n%s", s, &stdout)
				}
			}
			for _, s := range tc.stderr {
				if !strings.Contains(stderr.String(), s) {
					t.Errorf("stderr lacks %q:\n%s", s, &stderr)
				}
			}
			if tc.noStdout && stdout.Len() != 0 {
				t.Errorf("unexpected stdout:\n%s", &stdout)
			}
			if tc.checkWrote {
				f, err := stfile.Open(out)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				if got := f.Names(); len(got) != 3 {
					t.Errorf("output tensors %q", got)
				}
			}
		})
	}
}
