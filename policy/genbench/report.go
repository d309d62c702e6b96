package genbench

import (
	"encoding/csv"
	"fmt"
	"io"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/rollout-worker/rollout-worker/internal/plot"
	"github.com/rollout-worker/rollout-worker/moe"
)

// recipeName is how reports name a recipe: BF16, NVFP4 (per_token, the
// recipe the targets mean), or the recipe's own name.
func recipeName(r moe.Recipe) string {
	switch r {
	case moe.RecipeBF16:
		return "BF16"
	case moe.RecipePerToken:
		return "NVFP4"
	}
	return string(r)
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// DecodeTable writes one row per (context, batch, recipe): step time, its
// floor and the ratio, tokens/s, the device time and the idle fraction, and
// where the same run measured the BF16 recipe too, the speedup over it.
func DecodeTable(w io.Writer, points []DecodePoint) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "context\tbatch\trecipe\tstep ms\tfloor ms\tx floor\ttokens/s\tdevice ms\tidle\tvs BF16\t")
	bf16 := map[[2]int]DecodePoint{}
	for _, p := range points {
		if p.Recipe == moe.RecipeBF16 {
			bf16[[2]int{p.Context, p.Batch}] = p
		}
	}
	for _, p := range sortedPoints(points) {
		dev, idle := "-", "-"
		if p.Device > 0 {
			dev, idle = fmt.Sprintf("%.3f", ms(p.Device)), fmt.Sprintf("%.0f%%", 100*p.Idle())
		}
		vs := "-"
		if b, ok := bf16[[2]int{p.Context, p.Batch}]; ok && p.Recipe != moe.RecipeBF16 {
			vs = fmt.Sprintf("%.2fx", p.TokensPerSecond()/b.TokensPerSecond())
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%.3f\t%.3f\t%.1f\t%.0f\t%s\t%s\t%s\t\n", p.Context, p.Batch, recipeName(p.Recipe),
			ms(p.Step), ms(p.Floor), p.VsFloor(), p.TokensPerSecond(), dev, idle, vs)
	}
	return tw.Flush()
}

// BreakdownTable writes, for every point that has one, the device time of
// each group of ops of a step, in ms and as a share of their sum.
func BreakdownTable(w io.Writer, points []DecodePoint) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "context\tbatch\trecipe\t")
	for _, g := range GroupOrder() {
		fmt.Fprintf(tw, "%s\t", g)
	}
	fmt.Fprintln(tw, "sum ms\t")
	for _, p := range sortedPoints(points) {
		if p.Groups == nil {
			continue
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t", p.Context, p.Batch, recipeName(p.Recipe))
		writeGroups(tw, p.Groups, 3)
	}
	return tw.Flush()
}

// writeGroups writes a breakdown row's cells: each group of GroupOrder in
// ms (prec decimals) with its share of their sum, then the sum.
func writeGroups(w io.Writer, groups map[string]time.Duration, prec int) {
	var total time.Duration
	for _, d := range groups {
		total += d
	}
	for _, g := range GroupOrder() {
		d := groups[g]
		fmt.Fprintf(w, "%.*f (%.0f%%)\t", prec, ms(d), 100*d.Seconds()/max(total.Seconds(), 1e-12))
	}
	fmt.Fprintf(w, "%.*f\t\n", prec, ms(total))
}

// DecodeCSV writes the points with a header row.
func DecodeCSV(w io.Writer, points []DecodePoint) error {
	cw := csv.NewWriter(w)
	header := []string{"recipe", "batch", "context", "step_us", "device_us", "floor_us", "floor_bytes", "x_floor", "tokens_per_s", "idle"}
	for _, g := range GroupOrder() {
		header = append(header, g+"_us")
	}
	rows := [][]string{header}
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
	us := func(d time.Duration) string { return f(float64(d.Nanoseconds()) / 1e3) }
	for _, p := range sortedPoints(points) {
		row := []string{string(p.Recipe), strconv.Itoa(p.Batch), strconv.Itoa(p.Context),
			us(p.Step), us(p.Device), us(p.Floor), f(p.FloorBytes), f(p.VsFloor()), f(p.TokensPerSecond()), f(p.Idle())}
		for _, g := range GroupOrder() {
			if p.Groups == nil {
				row = append(row, "")
			} else {
				row = append(row, us(p.Groups[g]))
			}
		}
		rows = append(rows, row)
	}
	if err := cw.WriteAll(rows); err != nil {
		return fmt.Errorf("genbench: csv: %w", err)
	}
	return nil
}

// DecodeChart draws step time against batch size: one line per recipe and
// context, and the floor of each context dashed.
func DecodeChart(title string, points []DecodePoint) plot.Chart {
	c := plot.Chart{Title: title, XLabel: "sequences per step (log scale)", YLabel: "decode step, ms (log scale)"}
	type key struct {
		recipe  moe.Recipe
		context int
	}
	lines := map[key]*plot.Series{}
	floors := map[int]*plot.Series{}
	var order []key
	var ctxs []int
	for _, p := range sortedPoints(points) {
		k := key{p.Recipe, p.Context}
		if lines[k] == nil {
			lines[k] = &plot.Series{Name: fmt.Sprintf("%s, context %d", recipeName(p.Recipe), p.Context)}
			order = append(order, k)
		}
		lines[k].Points = append(lines[k].Points, [2]float64{float64(p.Batch), ms(p.Step)})
		if p.Recipe != moe.RecipeBF16 {
			if floors[p.Context] == nil {
				floors[p.Context] = &plot.Series{Name: fmt.Sprintf("NVFP4 floor, context %d", p.Context), Dashed: true}
				ctxs = append(ctxs, p.Context)
			}
			floors[p.Context].Points = append(floors[p.Context].Points, [2]float64{float64(p.Batch), ms(p.Floor)})
		}
		if !slices.Contains(c.XTicks, float64(p.Batch)) {
			c.XTicks = append(c.XTicks, float64(p.Batch))
		}
	}
	for _, k := range order {
		c.Series = append(c.Series, *lines[k])
	}
	for _, ctx := range ctxs {
		c.Series = append(c.Series, *floors[ctx])
	}
	return c
}

// sortedPoints orders points by context, batch, then NVFP4 before BF16.
func sortedPoints(points []DecodePoint) []DecodePoint {
	out := slices.Clone(points)
	slices.SortStableFunc(out, func(a, b DecodePoint) int {
		switch {
		case a.Context != b.Context:
			return a.Context - b.Context
		case a.Batch != b.Batch:
			return a.Batch - b.Batch
		case a.Recipe == b.Recipe:
			return 0
		case a.Recipe == moe.RecipeBF16:
			return 1
		}
		return -1
	})
	return out
}
