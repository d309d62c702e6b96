package moebench

import (
	"bytes"
	"encoding/xml"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/moe"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/")

// sampleResults are made-up times at the DeepSeek-V3 layer's shapes (the floors are the
// real ones), so the reports are checked on the figures they will show.
func sampleResults() []Result {
	var out []Result
	for i, T := range []int{1, 8, 32, 128, 512, 4096} {
		f := ForwardFloor(deepSeekV3, T)
		nv := time.Duration(float64(f.Time) * (1.1 + 0.05*float64(i)))
		out = append(out,
			Result{Tokens: T, Recipe: moe.RecipePerToken, Mean: nv, CosMean: 0.981 - 0.0001*float64(i), CosMin: 0.962 + 0.001*float64(i), Floor: f, Timing: "graphs+events"},
			Result{Tokens: T, Recipe: moe.RecipeBF16, Mean: 3*nv + time.Duration(i)*time.Microsecond, CosMean: 1, CosMin: 1, Floor: f, Timing: "graphs+events"})
	}
	return out
}

// withAtomic adds made-up atomic-finalize times (CompareFinalize) to
// results: 4% below the deterministic ones, none for bf16 at 4096 tokens
// (a missing measurement shows as "-").
func withAtomic(results []Result) []Result {
	out := append([]Result(nil), results...)
	for i := range out {
		if out[i].Recipe == moe.RecipeBF16 && out[i].Tokens == 4096 {
			continue
		}
		out[i].AtomicMean = out[i].Mean * 100 / 104
	}
	return out
}

// golden compares got with testdata/name, or rewrites it under -update.
func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from the golden file (go test ./moe/moebench -update rewrites it):\ngot:\n%s\nwant:\n%s", name, got, want)
	}
}

func TestReports(t *testing.T) {
	results := sampleResults()
	for _, tc := range []struct {
		golden string
		write  func(io.Writer) error
	}{
		{"table.txt", func(w io.Writer) error { return Table(w, results) }},
		{"moe.csv", func(w io.Writer) error { return CSV(w, results) }},
		{"moe.svg", func(w io.Writer) error {
			return SVG(w, "MoE forward: hidden 7168, intermediate 2048, 256 experts, top-8 <relu2> & co", results)
		}},
		{"table_finalize.txt", func(w io.Writer) error { return Table(w, withAtomic(results)) }},
		{"moe_finalize.csv", func(w io.Writer) error { return CSV(w, withAtomic(results)) }},
		{"refit.txt", func(w io.Writer) error {
			read, written, floor := RequantizeFloor(moe.Config{Hidden: 2688, Intermediate: 1856, Experts: 32})
			r := RefitResult{Layer: moe.Config{Hidden: 2688, Intermediate: 1856, Experts: 32, Activation: moe.ReLU2},
				Iters: 20, Mean: 251 * time.Microsecond, Read: read, Written: written, Floor: floor, Timing: "events",
				BitExact: true, SameAddresses: true}
			return r.Report(w, "cuda")
		}},
	} {
		t.Run(tc.golden, func(t *testing.T) {
			var b bytes.Buffer
			if err := tc.write(&b); err != nil {
				t.Fatal(err)
			}
			golden(t, tc.golden, b.Bytes())
		})
	}
}

func TestTableRows(t *testing.T) {
	var b bytes.Buffer
	if err := Table(&b, sampleResults()); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 7 {
		t.Fatalf("%d lines, want a header and 6 rows:\n%s", len(lines), b.String())
	}
	// The first sample is 1.10x its floor and the BF16 time is 3x it.
	for _, want := range []string{"nvfp4 (us)", "bf16 (us)", "nvfp4 vs floor", "nvfp4 vs bf16", "1.10x", "3.00x", "compute", "57.4"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
}

func TestSVGWellFormed(t *testing.T) {
	for _, tc := range []struct {
		name    string
		results []Result
		lines   int // polylines: recipes plus the floor
	}{
		{"sample results", sampleResults(), 3},
		{"one batch size", sampleResults()[:2], 3},
		{"bf16 only", []Result{{Tokens: 4, Recipe: moe.RecipeBF16, Mean: time.Millisecond, Floor: Floor{Time: time.Microsecond}}}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			if err := SVG(&b, "a & b", tc.results); err != nil {
				t.Fatal(err)
			}
			d := xml.NewDecoder(&b)
			polylines := 0
			for {
				tok, err := d.Token()
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatalf("not well-formed XML: %v", err)
				}
				if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "polyline" {
					polylines++
				}
			}
			if polylines != tc.lines {
				t.Errorf("%d lines drawn, want %d", polylines, tc.lines)
			}
		})
	}
	if err := SVG(io.Discard, "", nil); err == nil {
		t.Error("SVG of no results: no error")
	}
}
