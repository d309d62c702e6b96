package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/policy"
)

func TestInitModel(t *testing.T) {
	base := t.TempDir()
	nonEmpty := filepath.Join(base, "full")
	if err := os.MkdirAll(nonEmpty, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(nonEmpty, "notes.txt"), []byte("keep me"), 0o644); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(base, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		args   []string
		code   int
		stderr []string
		act    moe.Activation // for a written model: the activation it must load with
		arch   string
	}{
		{name: "help", args: []string{"help", "init-model"}, code: 0},
		{name: "missing --out", args: []string{"init-model"}, code: 2, stderr: []string{"--out is required"}},
		{name: "unknown preset", args: []string{"init-model", "--out", filepath.Join(base, "x"), "--preset", "huge"}, code: 2,
			stderr: []string{`unknown preset "huge"`, "tiny"}},
		{name: "bad activation", args: []string{"init-model", "--out", filepath.Join(base, "x"), "--activation", "gelu"}, code: 2,
			stderr: []string{"--activation must be swiglu or relu2"}},
		{name: "non-empty directory", args: []string{"init-model", "--out", nonEmpty}, code: 2,
			stderr: []string{"is not empty", "--force"}},
		{name: "out is a file", args: []string{"init-model", "--out", file}, code: 1, stderr: []string{"not a directory"}},
		{name: "tiny", args: []string{"init-model", "--out", filepath.Join(base, "tiny"), "--seed", "7"}, code: 0,
			stderr: []string{"init-model: wrote", "preset tiny", "seed 7"}, act: moe.SwiGLU, arch: policy.ArchQwen3MoE},
		{name: "tiny-mixtral relu2", args: []string{"init-model", "--out", filepath.Join(base, "a", "b"), "--preset", "tiny-mixtral",
			"--activation", "relu2"}, code: 0, stderr: []string{"relu2 experts"}, act: moe.ReLU2, arch: policy.ArchMixtral},
		{name: "force", args: []string{"init-model", "--out", nonEmpty, "--force"}, code: 0, act: moe.SwiGLU, arch: policy.ArchQwen3MoE},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run(context.Background(), tc.args, &stdout, &stderr)
			if code != tc.code {
				t.Errorf("exit status %d, want %d; stderr:\n%s", code, tc.code, &stderr)
			}
			for _, s := range tc.stderr {
				if !strings.Contains(stderr.String(), s) {
					t.Errorf("stderr lacks %q:\n%s", s, &stderr)
				}
			}
			if tc.act == "" {
				return
			}
			out := tc.args[2]
			be, err := cpu.New(cpu.Config{}, nil)
			if err != nil {
				t.Fatal(err)
			}
			m, err := policy.LoadModel(be, out, policy.ModelOptions{Recipe: moe.RecipeBF16, MaxTokens: 8, MaxSeqs: 1, KVPages: 2, PageSize: 16})
			if err != nil {
				t.Fatalf("the written model does not load: %v", err)
			}
			defer m.Close()
			if c := m.Config(); c.Activation != tc.act || c.Architecture != tc.arch {
				t.Errorf("loaded %s with %s experts, want %s with %s", c.Architecture, c.Activation, tc.arch, tc.act)
			}
		})
	}
	if data, err := os.ReadFile(filepath.Join(nonEmpty, "notes.txt")); err != nil || string(data) != "keep me" {
		t.Errorf("--force touched another file: %q, %v", data, err)
	}

	// The same seed writes the same bytes.
	a, b := filepath.Join(base, "s1"), filepath.Join(base, "s2")
	for _, dir := range []string{a, b} {
		if code := run(context.Background(), []string{"init-model", "--out", dir, "--seed", "3"}, &bytes.Buffer{}, &bytes.Buffer{}); code != 0 {
			t.Fatalf("init-model %s: exit status %d", dir, code)
		}
	}
	for _, name := range []string{"config.json", policy.SingleFileName} {
		x, _ := os.ReadFile(filepath.Join(a, name))
		y, _ := os.ReadFile(filepath.Join(b, name))
		if len(x) == 0 || !bytes.Equal(x, y) {
			t.Errorf("%s differs between two runs with the same seed", name)
		}
	}
}
