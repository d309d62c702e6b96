//go:build linux

package main

import (
	"bytes"
	"context"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestBenchRefitTransfer runs `bench refit --mode transfer` on the tiny
// preset: a worker and a publisher in processes of their own (this test
// binary, running the commands), a full version and two deltas applied,
// each in three parts over two NATS server processes, and a row for each with its rate,
// commit, the publisher's peak RSS and the chunks read back from the streams.
func TestBenchRefitTransfer(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts a worker and three publishers")
	}
	t.Setenv(rssEnv, "1") // the children run the commands, not the tests
	var out, errOut bytes.Buffer
	err := run(context.Background(), []string{"bench", "refit", "--mode", "transfer", "--preset", "tiny", "--device", "cpu",
		"--deltas", "0.05,0.2", "--storage", "memory", "--stream-max-bytes", "67108864", "--parts", "3", "--servers", "2"}, &out, &errOut)
	if err != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", err, out.String(), errOut.String())
	}
	t.Logf("\n%s", out.String())
	row := regexp.MustCompile(`(?m)^(\d+)\s+(full|delta 5%|delta 20%)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+(\d+|-)\s+([\d.]+/[\d.]+/[\d.]+|-)\s+(\d+)/(\d+)$`)
	rows := row.FindAllStringSubmatch(out.String(), -1)
	if len(rows) != 3 {
		t.Fatalf("want rows for the full version and two deltas, got %d", len(rows))
	}
	for i, r := range rows {
		if v, _ := strconv.Atoi(r[1]); v != i+1 {
			t.Errorf("row %d is version %s", i, r[1])
		}
		mb, _ := strconv.ParseFloat(r[3], 64)
		secs, _ := strconv.ParseFloat(r[5], 64)
		if mb <= 0 || secs <= 0 {
			t.Errorf("%s: %s MB in %s s", r[2], r[3], r[5])
		}
		if r[9] == "-" {
			t.Errorf("%s: no publisher RSS", r[2])
		}
		if _, ok := processCPU(os.Getpid()); ok && r[10] == "-" {
			t.Errorf("%s: no cores busy, where process CPU times can be read", r[2])
		}
		stream, _ := strconv.Atoi(r[11])
		all, _ := strconv.Atoi(r[12])
		if all == 0 || stream > all {
			t.Errorf("%s: %d of %d chunks from the streams", r[2], stream, all)
		}
	}
	full, _ := strconv.ParseFloat(rows[0][3], 64)
	d5, _ := strconv.ParseFloat(rows[1][3], 64)
	if d5 >= full/2 {
		t.Errorf("a 5%% delta of %.2f MB against a full version of %.2f MB", d5, full)
	}
	for _, want := range []string{"2 NATS server processes", "core NATS, one connection to another", "core NATS, 3 pairs of connections at once",
		"worker peak RSS: ", "per layer, version 1"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
}
