// Package plot draws the benchmarks' charts: log-log line charts as
// self-contained SVG, with no dependency beyond the standard library.
package plot

import (
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
)

// Series is one line of a chart.
type Series struct {
	Name   string
	Color  string // CSS color; empty: a default by position
	Dashed bool
	Points [][2]float64 // x, y; both > 0 (log scales)
}

// Chart is a log-log line chart.
type Chart struct {
	Title, XLabel, YLabel string
	// XTicks are the x values labelled on the axis (typically the measured
	// sizes); empty: the points' x values.
	XTicks []float64
	Series []Series
}

// defaultColor is the color of the i-th series that names none.
func defaultColor(i int) string {
	c := [...]string{"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"}
	return c[i%len(c)]
}

const (
	width, height                          = 900, 520
	marginL, marginR, marginT, marginB int = 80, 220, 40, 60
)

// SVG writes the chart. Points with a non-positive coordinate are left out.
func (c Chart) SVG(w io.Writer) error {
	xs := slices.Clone(c.XTicks)
	if len(xs) == 0 {
		for _, s := range c.Series {
			for _, p := range s.Points {
				xs = append(xs, p[0])
			}
		}
	}
	xs = slices.DeleteFunc(xs, func(x float64) bool { return !(x > 0) })
	slices.Sort(xs)
	xs = slices.Compact(xs)
	if len(xs) == 0 {
		return fmt.Errorf("plot: %q: no points", c.Title)
	}
	// The x axis pads the ticks by half a step of 1.5x on each side; the y
	// axis spans whole decades.
	xlo, xhi := math.Log10(xs[0]/1.5), math.Log10(xs[len(xs)-1]*1.5)
	ylo, yhi := math.Inf(1), math.Inf(-1)
	for _, s := range c.Series {
		for _, p := range s.Points {
			if p[0] > 0 && p[1] > 0 {
				ylo, yhi = min(ylo, math.Log10(p[1])), max(yhi, math.Log10(p[1]))
			}
		}
	}
	if math.IsInf(ylo, 0) {
		ylo, yhi = 0, 1
	}
	ylo, yhi = math.Floor(ylo), math.Ceil(yhi)
	if yhi <= ylo {
		yhi = ylo + 1
	}
	iw, ih := float64(width-marginL-marginR), float64(height-marginT-marginB)
	px := func(x float64) float64 { return float64(marginL) + (math.Log10(x)-xlo)/(xhi-xlo)*iw }
	py := func(y float64) float64 { return float64(marginT) + (yhi-math.Log10(y))/(yhi-ylo)*ih }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="#ffffff"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="24" text-anchor="middle" font-size="14">%s</text>`+"\n", (width-marginR+marginL)/2, escape(c.Title))
	for _, x := range xs {
		X := px(x)
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%.1f" stroke="#dddddd"/>`+"\n", X, marginT, X, float64(marginT)+ih)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", X, float64(marginT)+ih+18, tickLabel(x))
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
			Y := py(v)
			stroke := "#dddddd"
			if m != 1 {
				stroke = "#f0f0f0"
			}
			fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s"/>`+"\n", marginL, Y, float64(marginL)+iw, Y, stroke)
			fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", marginL-6, Y+4, tickLabel(v))
		}
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%.1f" fill="none" stroke="#000000"/>`+"\n", marginL, marginT, iw, ih)
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", float64(marginL)+iw/2, height-15, escape(c.XLabel))
	fmt.Fprintf(&b, `<text x="18" y="%.1f" text-anchor="middle" transform="rotate(-90 18 %.1f)">%s</text>`+"\n",
		float64(marginT)+ih/2, float64(marginT)+ih/2, escape(c.YLabel))
	for i, s := range c.Series {
		color := s.Color
		if color == "" {
			color = defaultColor(i)
		}
		dash := ""
		if s.Dashed {
			dash = ` stroke-dasharray="6,4"`
		}
		var pts []string
		for _, p := range s.Points {
			if p[0] > 0 && p[1] > 0 {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(p[0]), py(p[1])))
			}
		}
		if len(pts) > 0 {
			fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"%s/>`+"\n", strings.Join(pts, " "), color, dash)
			for _, p := range s.Points {
				if p[0] > 0 && p[1] > 0 {
					fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", px(p[0]), py(p[1]), color)
				}
			}
		}
		ly, lx := marginT+10+22*i, width-marginR+16
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>`+"\n", lx, ly, lx+28, ly, color, dash)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", lx+36, ly+4, escape(s.Name))
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
