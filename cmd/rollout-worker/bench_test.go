package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestBenchMoE(t *testing.T) {
	dir := t.TempDir()
	csv, plot := filepath.Join(dir, "moe.csv"), filepath.Join(dir, "moe.svg")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "moe", "--device", "cpu", "--tokens", "1,5", "--hidden", "64", "--intermediate", "40",
		"--experts", "4", "--top-k", "2", "--iters", "2", "--recipes", "nvfp4,bf16,weight_only,per_tensor,unit_scale", "--csv", csv, "--plot", plot}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr.String())
	}
	table := stdout.String()
	for _, want := range []string{"tokens", "experts", "floor (us)", "nvfp4 (us)", "bf16 (us)", "weight_only (us)",
		"nvfp4 vs floor", "nvfp4 vs bf16", "weight_only vs bf16", "nvfp4 cos min", "per_tensor (us)", "per_tensor cos mean",
		"unit_scale vs bf16"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	if lines := strings.Split(strings.TrimSpace(table), "\n"); len(lines) != 3 {
		t.Errorf("table has %d lines, want a header and 2 rows:\n%s", len(lines), table)
	}
	if !strings.Contains(stderr.String(), "timing: graphs+wall") {
		t.Errorf("stderr does not say how it timed:\n%s", stderr.String())
	}
	raw, err := os.ReadFile(csv)
	if err != nil {
		t.Fatal(err)
	}
	rows := strings.Split(strings.TrimSpace(string(raw)), "\n")
	header := strings.Split(rows[0], ",")
	if len(rows) != 3 || header[0] != "tokens" || header[6] != "nvfp4_us" || header[7] != "bf16_us" {
		t.Fatalf("csv:\n%s", raw)
	}
	col := func(row []string, name string) string {
		for i, h := range header {
			if h == name {
				return row[i]
			}
		}
		t.Fatalf("csv has no column %q", name)
		return ""
	}
	for _, r := range rows[1:] {
		f := strings.Split(r, ",")
		if len(f) != len(header) {
			t.Fatalf("row %q has %d fields, header %d", r, len(f), len(header))
		}
		for _, c := range []string{"nvfp4_us", "bf16_us", "weight_only_us", "per_tensor_us", "unit_scale_us"} {
			if v := col(f, c); v == "" || v == "0.000" {
				t.Errorf("no time measured for %s: %s", c, r)
			}
		}
		if col(f, "timing") != "graphs+wall" {
			t.Errorf("timing %q", col(f, "timing"))
		}
	}
	svg, err := os.ReadFile(plot)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(svg, []byte("<svg")) || bytes.Count(svg, []byte("<polyline")) != 6 {
		t.Errorf("plot is not an SVG with 5 recipes and the floor:\n%.300s", svg)
	}
}

// TestBenchMoEFinalize runs both finalizes: the atomic one alone, and side
// by side with the deterministic one (its columns, with a time each).
func TestBenchMoEFinalize(t *testing.T) {
	tiny := []string{"bench", "moe", "--device", "cpu", "--hidden", "64", "--intermediate", "32", "--experts", "4", "--topk", "2",
		"--tokens", "1,5", "--iters", "2", "--warmup", "0"}
	for _, tc := range []struct {
		flag string
		want []string
	}{
		{"--batch-invariant=false", []string{"atomic finalize (not batch invariant)"}},
		{"--compare-finalize", []string{"side by side", "nvfp4 atomic (us)", "nvfp4 det/atomic", "bf16 det/atomic"}},
	} {
		t.Run(tc.flag, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := run(context.Background(), append(append([]string(nil), tiny...), tc.flag), &stdout, &stderr); code != 0 {
				t.Fatalf("exit %d, stderr:\n%s", code, stderr.String())
			}
			all := stdout.String() + stderr.String()
			for _, w := range tc.want {
				if !strings.Contains(all, w) {
					t.Errorf("output lacks %q:\n%s", w, all)
				}
			}
			if tc.flag == "--compare-finalize" {
				// Every row has an atomic time and a ratio, not a dash.
				for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n")[1:] {
					if f := strings.Fields(line); len(f) < 4 || f[len(f)-1] == "-" || !strings.HasSuffix(f[len(f)-1], "x") {
						t.Errorf("row without a finalize comparison: %q", line)
					}
				}
			}
		})
	}
}

func TestBenchRefit(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "refit", "--device", "cpu", "--hidden", "72", "--intermediate", "40",
		"--experts", "3", "--activation", "swiglu", "--iters", "2"}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr.String())
	}
	for _, want := range []string{"requantize 3 experts (hidden 72, intermediate 40, swiglu) on cpu", "mean of 2, wall clock",
		"floor", "x the floor", "bit-exact against internal/nvfp4.QuantizeStack on the host, at the same addresses"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, stdout.String())
		}
	}
}

func TestBenchMoEDefaults(t *testing.T) {
	for _, tc := range []struct {
		backend string
		want    moeDefaults
	}{
		{"cuda", moeDefaults{tokens: []int{1, 8, 32, 128, 512, 4096}, hidden: 7168, inter: 2048, experts: 256, topK: 8, iters: 50}},
		{"cpu", moeDefaults{tokens: []int{1, 8, 32, 128}, hidden: 1024, inter: 512, experts: 16, topK: 4, iters: 10}},
	} {
		if got := benchMoEDefaults(tc.backend); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: defaults %+v, want %+v", tc.backend, got, tc.want)
		}
	}
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"help", "bench"}, []string{"bench moe|refit|generate", "tokens\n1,8,32,128,512,4096", "Usage: rollout-worker bench refit"}},
		{[]string{"bench", "moe", "-h"}, []string{"-batch-invariant", "default 7168 on cuda, 1024 on cpu", "-top-k", "-plot"}},
		{[]string{"bench", "refit", "-h"}, []string{"-hidden int", "(default 2688)", "default 20 on cuda, 3 on cpu"}},
	} {
		var out bytes.Buffer
		if code := run(context.Background(), tc.args, &out, &out); code != 0 {
			t.Errorf("%v: exit %d", tc.args, code)
		}
		for _, want := range tc.want {
			if !strings.Contains(out.String(), want) {
				t.Errorf("%v: usage lacks %q:\n%s", tc.args, want, out.String())
			}
		}
	}
}

func TestBenchErrors(t *testing.T) {
	tiny := []string{"--device", "cpu", "--hidden", "32", "--intermediate", "16", "--experts", "4", "--topk", "2", "--tokens", "1", "--iters", "1"}
	moeArgs := func(extra ...string) []string { return append(append([]string{"bench", "moe"}, tiny...), extra...) }
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"no benchmark", []string{"bench"}, 2, "want a benchmark name"},
		{"unknown benchmark", []string{"bench", "attention"}, 2, "want a benchmark name"},
		{"bad tokens", []string{"bench", "moe", "--tokens", "1,0"}, 2, `"0" is not a positive batch size`},
		{"tokens not a number", []string{"bench", "moe", "--tokens", "1,eight"}, 2, `"eight" is not a positive batch size`},
		{"unknown recipe", []string{"bench", "moe", "--recipes", "nvfp4,fp8"}, 2, `unknown recipe "fp8"`},
		{"recipe twice", []string{"bench", "moe", "--recipes", "nvfp4,per_token,bf16"}, 2, "nvfp4 listed twice"},
		{"no bf16 reference", moeArgs("--recipes", "nvfp4"), 1, "must include"},
		{"bad activation", []string{"bench", "moe", "--activation", "gelu"}, 2, `--activation "gelu": want relu2 or swiglu`},
		{"bad scoring", []string{"bench", "moe", "--scoring", "argmax"}, 2, `--scoring "argmax"`},
		{"zero hidden", []string{"bench", "moe", "--hidden", "0"}, 2, "--hidden 0: want a positive number"},
		{"zero top-k", []string{"bench", "moe", "--topk", "0"}, 2, "--top-k 0: want a positive number"},
		{"bad device", []string{"bench", "moe", "--device", "tpu"}, 2, `--device "tpu"`},
		{"compare without the deterministic finalize", moeArgs("--batch-invariant=false", "--compare-finalize"), 2, "leave --batch-invariant at true"},
		{"top-k above experts", moeArgs("--topk", "5"), 1, "top-5 of 4 experts"},
		{"refit bad activation", []string{"bench", "refit", "--activation", "gelu"}, 2, `--activation "gelu"`},
		{"refit no experts", []string{"bench", "refit", "--experts", "0"}, 2, "--experts 0: want a positive number"},
		{"refit zero iters", []string{"bench", "refit", "--iters", "0"}, 2, "--iters 0: want a positive number"},
		{"refit positional", []string{"bench", "refit", "extra"}, 2, `unexpected argument "extra"`},
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
	code := run(context.Background(), []string{"bench", "generate", "--mode", "rollouts", "--preset", "tiny", "--requests", "3", "--n", "2",
		"--prompt-len", "5", "--max-tokens", "7"}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr.String())
	}
	if out := stdout.String(); !strings.Contains(out, "rollouts 6, generated tokens 42") || !strings.Contains(out, "tokens/s") {
		t.Fatalf("output %q", out)
	}
}

// TestBenchGenerateSteps: the decode-step sweep measures every point for
// both recipes in one run and writes its table, CSV and chart.
func TestBenchGenerateSteps(t *testing.T) {
	dir := t.TempDir()
	csvPath, plotPath := filepath.Join(dir, "d.csv"), filepath.Join(dir, "d.svg")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "generate", "--preset", "tiny", "--device", "cpu", "--batches", "1,4",
		"--contexts", "8", "--steps", "2", "--warmup", "1", "--csv", csvPath, "--plot", plotPath}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{"x floor", "NVFP4", "BF16", "vs BF16"} {
		if !strings.Contains(out, want) {
			t.Fatalf("table lacks %q:\n%s", want, out)
		}
	}
	data, err := os.ReadFile(csvPath)
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Count(string(data), "\n"); lines != 5 {
		t.Fatalf("csv has %d lines, want a header and 4 points:\n%s", lines, data)
	}
	if svg, err := os.ReadFile(plotPath); err != nil || !strings.Contains(string(svg), "<svg") {
		t.Fatalf("chart: %v", err)
	}
	code = run(context.Background(), []string{"bench", "generate", "--preset", "tiny", "--device", "cpu", "--batches", "1,x"}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), `--batches: "x"`) {
		t.Fatalf("bad --batches: exit %d, stderr %q", code, stderr.String())
	}
	stderr.Reset()
	code = run(context.Background(), []string{"bench", "generate", "--preset", "tiny", "--recipe", "nvfp4"}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), "--recipe applies to --mode rollouts, not steps") {
		t.Fatalf("a rollouts flag in steps mode: exit %d, stderr %q", code, stderr.String())
	}
}
