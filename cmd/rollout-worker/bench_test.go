package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestBenchMoE(t *testing.T) {
	csv := filepath.Join(t.TempDir(), "moe.csv")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "moe", "--tokens", "1,5", "--hidden", "64", "--intermediate", "40",
		"--experts", "4", "--topk", "2", "--iters", "2", "--recipes", "bf16,per_token,weight_only", "--csv", csv}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr.String())
	}
	table := stdout.String()
	for _, want := range []string{"tokens", "bf16 (ms)", "per_token (ms)", "bf16/per_token", "bf16/weight_only", "cos min"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	if lines := strings.Split(strings.TrimSpace(table), "\n"); len(lines) != 3 {
		t.Errorf("table has %d lines, want a header and 2 rows:\n%s", len(lines), table)
	}
	raw, err := os.ReadFile(csv)
	if err != nil {
		t.Fatal(err)
	}
	rows := strings.Split(strings.TrimSpace(string(raw)), "\n")
	if len(rows) != 1+2*3 || rows[0] != "tokens,recipe,mean_us,cos_mean,cos_min" {
		t.Fatalf("csv:\n%s", raw)
	}
	for _, r := range rows[1:] {
		f := strings.Split(r, ",")
		if f[1] == "bf16" && (f[3] != "1.000000" || f[4] != "1.000000") {
			t.Errorf("bf16 against itself: %s", r)
		}
		if f[2] == "0.000" {
			t.Errorf("no time measured: %s", r)
		}
	}
}

func TestBenchErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"no benchmark", []string{"bench"}, 2, "want a benchmark name"},
		{"unknown benchmark", []string{"bench", "refit"}, 2, "want a benchmark name"},
		{"bad tokens", []string{"bench", "moe", "--tokens", "1,0"}, 2, `"0" is not a positive batch size`},
		{"no bf16 reference", []string{"bench", "moe", "--recipes", "per_token", "--hidden", "32"}, 1, "must include"},
		{"bad activation", []string{"bench", "moe", "--activation", "gelu", "--hidden", "32"}, 1, "unknown activation"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := run(context.Background(), tc.args, &stdout, &stderr); code != tc.code || !strings.Contains(stderr.String(), tc.want) {
				t.Fatalf("exit %d (want %d), stderr %q (want %q)", code, tc.code, stderr.String(), tc.want)
			}
		})
	}
}

func TestBenchGenerate(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "generate", "--preset", "tiny", "--requests", "3", "--n", "2",
		"--prompt-len", "5", "--max-tokens", "7"}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr.String())
	}
	if out := stdout.String(); !strings.Contains(out, "rollouts 6, generated tokens 42") || !strings.Contains(out, "tokens/s") {
		t.Fatalf("output %q", out)
	}
}
