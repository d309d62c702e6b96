package moebench

// The benchmark's reports: a table for the terminal, the same rows as CSV,
// and an SVG chart of latency against batch size. All three are pure
// functions of the results so they can be checked against golden files.

import (
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/rollout-worker/rollout-worker/moe"
)

// arranged is the results as the reports lay them out: one row per batch
// size (in the order measured), one column group per recipe.
type arranged struct {
	recipes   []moe.Recipe // in the order measured
	quantized []moe.Recipe // recipes other than bf16: the ones compared
	tokens    []int
	floors    map[int]Floor
	byKey     map[key]Result
	timing    string
	atomic    bool // some result has AtomicMean: the finalize comparison's columns are shown
}

type key struct {
	tokens int
	recipe moe.Recipe
}

func arrange(results []Result) arranged {
	a := arranged{floors: map[int]Floor{}, byKey: map[key]Result{}}
	for _, r := range results {
		if !slices.Contains(a.recipes, r.Recipe) {
			a.recipes = append(a.recipes, r.Recipe)
			if r.Recipe != moe.RecipeBF16 {
				a.quantized = append(a.quantized, r.Recipe)
			}
		}
		if !slices.Contains(a.tokens, r.Tokens) {
			a.tokens = append(a.tokens, r.Tokens)
		}
		a.floors[r.Tokens] = r.Floor
		a.byKey[key{r.Tokens, r.Recipe}] = r
		if a.timing == "" {
			a.timing = r.Timing
		}
		a.atomic = a.atomic || r.AtomicMean > 0
	}
	return a
}

// finalizeCost returns a recipe's time with the deterministic finalize over
// its time with the atomic one (1.05: the deterministic one costs 5%).
func (a arranged) finalizeCost(T int, rc moe.Recipe) (atomic time.Duration, cost float64, ok bool) {
	r, found := a.byKey[key{T, rc}]
	if !found || r.AtomicMean <= 0 || r.Mean <= 0 {
		return 0, 0, false
	}
	return r.AtomicMean, float64(r.Mean) / float64(r.AtomicMean), true
}

// ratios returns a recipe's time over the floor and the BF16 recipe's time
// over its time (its speed-up); ok is false when either is unknown.
func (a arranged) ratios(T int, rc moe.Recipe) (vsFloor, vsBF16 float64, okFloor, okBF16 bool) {
	r, ok := a.byKey[key{T, rc}]
	if !ok || r.Mean <= 0 {
		return 0, 0, false, false
	}
	if f := a.floors[T].Time; f > 0 {
		vsFloor, okFloor = float64(r.Mean)/float64(f), true
	}
	if b, ok := a.byKey[key{T, moe.RecipeBF16}]; ok && b.Mean > 0 {
		vsBF16, okBF16 = float64(b.Mean)/float64(r.Mean), true
	}
	return vsFloor, vsBF16, okFloor, okBF16
}

func bound(f Floor) string {
	if f.Compute {
		return "compute"
	}
	return "memory"
}

// Table writes one row per batch size: the expected experts touched, the
// NVFP4 floor and what bounds it, each recipe's mean time, and for each
// NVFP4 recipe its time over the floor, its speed-up over BF16 (BF16 time
// over its time) and its per-token cosine to BF16.
func Table(w io.Writer, results []Result) error {
	a := arrange(results)
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "tokens\texperts\tfloor (us)\tbound\t")
	for _, rc := range a.recipes {
		fmt.Fprintf(tw, "%s (us)\t", RecipeName(rc))
	}
	for _, rc := range a.quantized {
		n := RecipeName(rc)
		fmt.Fprintf(tw, "%s vs floor\t%s vs bf16\t%s cos mean\t%s cos min\t", n, n, n, n)
	}
	if a.atomic {
		for _, rc := range a.recipes {
			n := RecipeName(rc)
			fmt.Fprintf(tw, "%s atomic (us)\t%s det/atomic\t", n, n)
		}
	}
	fmt.Fprintln(tw)
	dash := func(ok bool, format string, v float64) string {
		if !ok {
			return "-"
		}
		return fmt.Sprintf(format, v)
	}
	for _, T := range a.tokens {
		f := a.floors[T]
		fmt.Fprintf(tw, "%d\t%.1f\t%s\t%s\t", T, f.Touched, fmtUS(f.Time), bound(f))
		for _, rc := range a.recipes {
			r, ok := a.byKey[key{T, rc}]
			if ok {
				fmt.Fprintf(tw, "%s\t", fmtUS(r.Mean))
			} else {
				fmt.Fprint(tw, "-\t")
			}
		}
		for _, rc := range a.quantized {
			r, ok := a.byKey[key{T, rc}]
			vf, vb, okf, okb := a.ratios(T, rc)
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t", dash(okf, "%.2fx", vf), dash(okb, "%.2fx", vb),
				dash(ok, "%.4f", r.CosMean), dash(ok, "%.4f", r.CosMin))
		}
		if a.atomic {
			for _, rc := range a.recipes {
				at, c, ok := a.finalizeCost(T, rc)
				if ok {
					fmt.Fprintf(tw, "%s\t%.3fx\t", fmtUS(at), c)
				} else {
					fmt.Fprint(tw, "-\t-\t")
				}
			}
		}
		fmt.Fprintln(tw)
	}
	return tw.Flush()
}

// CSV writes the rows of Table as comma-separated values with a header,
// unrounded (times in microseconds, ratios as plain factors), plus the
// floor's bytes and FLOPs and how the times were measured.
func CSV(w io.Writer, results []Result) error {
	a := arrange(results)
	var b strings.Builder
	b.WriteString("tokens,experts_touched,floor_us,floor_bound,floor_bytes,floor_flops")
	for _, rc := range a.recipes {
		fmt.Fprintf(&b, ",%s_us", RecipeName(rc))
	}
	for _, rc := range a.quantized {
		n := RecipeName(rc)
		fmt.Fprintf(&b, ",%s_vs_floor,%s_vs_bf16,%s_cos_mean,%s_cos_min", n, n, n, n)
	}
	if a.atomic {
		for _, rc := range a.recipes {
			n := RecipeName(rc)
			fmt.Fprintf(&b, ",%s_atomic_us,%s_det_vs_atomic", n, n)
		}
	}
	b.WriteString(",timing\n")
	opt := func(ok bool, format string, v float64) string {
		if !ok {
			return ""
		}
		return fmt.Sprintf(format, v)
	}
	for _, T := range a.tokens {
		f := a.floors[T]
		fmt.Fprintf(&b, "%d,%.3f,%.3f,%s,%.0f,%.0f", T, f.Touched, us(f.Time), bound(f), f.Bytes, f.FLOPs)
		for _, rc := range a.recipes {
			r, ok := a.byKey[key{T, rc}]
			fmt.Fprintf(&b, ",%s", opt(ok, "%.3f", us(r.Mean)))
		}
		for _, rc := range a.quantized {
			r, ok := a.byKey[key{T, rc}]
			vf, vb, okf, okb := a.ratios(T, rc)
			fmt.Fprintf(&b, ",%s,%s,%s,%s", opt(okf, "%.4f", vf), opt(okb, "%.4f", vb),
				opt(ok, "%.6f", r.CosMean), opt(ok, "%.6f", r.CosMin))
		}
		if a.atomic {
			for _, rc := range a.recipes {
				at, c, ok := a.finalizeCost(T, rc)
				fmt.Fprintf(&b, ",%s,%s", opt(ok, "%.3f", us(at)), opt(ok, "%.4f", c))
			}
		}
		fmt.Fprintf(&b, ",%s\n", a.timing)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// The chart's geometry, in SVG user units.
const (
	plotW, plotH     = 760, 480
	marginL, marginR = 80, 170 // the legend sits in the right margin
	marginT, marginB = 50, 60
)

// seriesColors are distinguishable for the common kinds of colour blindness
// (Okabe-Ito); the floor is drawn dashed in black.
var seriesColors = []string{"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9"}

// SVG writes a log-log line chart of mean latency against tokens per batch:
// one line per recipe and a dashed line for the NVFP4 floor.
func SVG(w io.Writer, title string, results []Result) error {
	a := arrange(results)
	if len(a.tokens) == 0 {
		return fmt.Errorf("moebench: plot: no results")
	}
	type series struct {
		name, color, dash string
		pts               [][2]float64 // tokens, microseconds
	}
	var all []series
	for i, rc := range a.recipes {
		s := series{name: RecipeName(rc), color: seriesColors[i%len(seriesColors)]}
		for _, T := range a.tokens {
			if r, ok := a.byKey[key{T, rc}]; ok && r.Mean > 0 {
				s.pts = append(s.pts, [2]float64{float64(T), us(r.Mean)})
			}
		}
		all = append(all, s)
	}
	fl := series{name: "NVFP4 floor", color: "#000000", dash: "6,4"}
	for _, T := range a.tokens {
		if f := a.floors[T].Time; f > 0 {
			fl.pts = append(fl.pts, [2]float64{float64(T), us(f)})
		}
	}
	all = append(all, fl)

	// Axis ranges: the x axis pads the measured batch sizes by half a step
	// of 1.5x on each side; the y axis spans whole decades.
	xs := slices.Clone(a.tokens)
	slices.Sort(xs)
	xlo, xhi := math.Log10(float64(xs[0])/1.5), math.Log10(float64(xs[len(xs)-1])*1.5)
	ylo, yhi := math.Inf(1), math.Inf(-1)
	for _, s := range all {
		for _, p := range s.pts {
			ylo, yhi = min(ylo, math.Log10(p[1])), max(yhi, math.Log10(p[1]))
		}
	}
	if math.IsInf(ylo, 0) {
		ylo, yhi = 0, 1
	}
	ylo, yhi = math.Floor(ylo), math.Ceil(yhi)
	if yhi <= ylo {
		yhi = ylo + 1
	}
	iw, ih := float64(plotW-marginL-marginR), float64(plotH-marginT-marginB)
	px := func(t float64) float64 { return marginL + (math.Log10(t)-xlo)/(xhi-xlo)*iw }
	py := func(v float64) float64 { return marginT + (yhi-math.Log10(v))/(yhi-ylo)*ih }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		plotW, plotH, plotW, plotH)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="#ffffff"/>`+"\n", plotW, plotH)
	fmt.Fprintf(&b, `<text x="%d" y="24" text-anchor="middle" font-size="14">%s</text>`+"\n", (plotW-marginR+marginL)/2, escape(title))
	// Grid and ticks: every measured batch size on x; decades on y, with 2
	// and 5 in between when the chart spans few decades.
	for _, T := range xs {
		x := px(float64(T))
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%.1f" stroke="#dddddd"/>`+"\n", x, marginT, x, marginT+ih)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%d</text>`+"\n", x, marginT+ih+18, T)
	}
	mult := []float64{1}
	if yhi-ylo <= 3 {
		mult = []float64{1, 2, 5}
	}
	for e := ylo; e <= yhi; e++ {
		for _, m := range mult {
			v := m * math.Pow(10, e)
			if math.Log10(v) > yhi+1e-9 {
				break
			}
			y := py(v)
			stroke := "#dddddd"
			if m != 1 {
				stroke = "#f0f0f0"
			}
			fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s"/>`+"\n", marginL, y, marginL+iw, y, stroke)
			fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", marginL-6, y+4, tickLabel(v))
		}
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%.1f" fill="none" stroke="#000000"/>`+"\n", marginL, marginT, iw, ih)
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">tokens per batch (log scale)</text>`+"\n", marginL+iw/2, plotH-15)
	fmt.Fprintf(&b, `<text x="18" y="%.1f" text-anchor="middle" transform="rotate(-90 18 %.1f)">latency per forward, µs (log scale)</text>`+"\n",
		marginT+ih/2, marginT+ih/2)
	for i, s := range all {
		if len(s.pts) > 0 {
			var pts []string
			for _, p := range s.pts {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(p[0]), py(p[1])))
			}
			dash := ""
			if s.dash != "" {
				dash = fmt.Sprintf(` stroke-dasharray="%s"`, s.dash)
			}
			fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"%s/>`+"\n", strings.Join(pts, " "), s.color, dash)
			for _, p := range s.pts {
				fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", px(p[0]), py(p[1]), s.color)
			}
		}
		ly := marginT + 10 + 22*i
		lx := plotW - marginR + 16
		dash := ""
		if s.dash != "" {
			dash = fmt.Sprintf(` stroke-dasharray="%s"`, s.dash)
		}
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>`+"\n", lx, ly, lx+28, ly, s.color, dash)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", lx+36, ly+4, escape(s.name))
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// tickLabel writes a tick value without a trailing ".0" or an exponent.
func tickLabel(v float64) string {
	if v >= 1 {
		return fmt.Sprintf("%.0f", v)
	}
	return strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.3f", v), "0"), ".")
}

func escape(s string) string {
	var b strings.Builder
	xml.EscapeText(&b, []byte(s))
	return b.String()
}

// RefitResult is one measurement of a whole layer's requantization.
type RefitResult struct {
	Layer   moe.Config    // the shape measured
	Iters   int           // requantizations timed
	Mean    time.Duration // per requantization of the whole layer
	Read    float64       // BF16 bytes read
	Written float64       // NVFP4 bytes written
	Floor   time.Duration // Read + Written at the H200's copy bandwidth
	Timing  string        // "events" or "wall"
	// BitExact: every NVFP4 copy (codes, block scales, alphas) equals
	// internal/nvfp4.QuantizeStack of the BF16 weights on the host.
	BitExact bool
	// SameAddresses: the copies are where they were before the timed
	// requantizations (the refit contract: captured graphs keep reading
	// the right memory).
	SameAddresses bool
	Mismatch      string // the first difference, when not BitExact or not SameAddresses
}

// Report writes the refit measurement: the time, the floor and their ratio,
// and the result of the checks.
func (r RefitResult) Report(w io.Writer, backend string) error {
	c := r.Layer
	ratio := 0.0
	if r.Floor > 0 {
		ratio = float64(r.Mean) / float64(r.Floor)
	}
	check := "bit-exact against internal/nvfp4.QuantizeStack on the host, at the same addresses"
	if !r.BitExact || !r.SameAddresses {
		check = "FAILED: " + r.Mismatch
	}
	timing := map[string]string{"events": "device events", "wall": "wall clock between syncs"}[r.Timing]
	if timing == "" {
		timing = r.Timing
	}
	_, err := fmt.Fprintf(w, `requantize %d experts (hidden %d, intermediate %d, %s) on %s
  time   %s us per layer (mean of %d, %s)
  floor  %s us (%.1f MB BF16 read + %.1f MB NVFP4 written at %.1f TB/s)
  ratio  %.2fx the floor
  copies %s
`, c.Experts, c.Hidden, c.Intermediate, c.Activation, backend, fmtUS(r.Mean), r.Iters, timing,
		fmtUS(r.Floor), r.Read/1e6, r.Written/1e6, H200Bandwidth/1e12, ratio, check)
	return err
}

// fmtUS formats a duration in microseconds: one decimal, or three below
// 1 us (the floors of the small shapes the CPU runs).
func fmtUS(d time.Duration) string {
	if v := us(d); v < 1 {
		return fmt.Sprintf("%.3f", v)
	}
	return fmt.Sprintf("%.1f", us(d))
}
