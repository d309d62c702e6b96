package moebench

import (
	"math"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/moe"
)

// deepSeekV3 is the DeepSeek-V3 MoE layer of docs/PERF.md (hidden 7168,
// intermediate 2048, 256 experts, top-8, squared ReLU).
var deepSeekV3 = moe.Config{Hidden: 7168, Intermediate: 2048, Experts: 256, TopK: 8, Activation: moe.ReLU2, Scoring: moe.Softmax}

// TestForwardFloorMatchesTargets checks the floor arithmetic against the
// floor table of docs/PERF.md, which quotes whole microseconds (and whole
// experts): the figures must agree to within their rounding plus 0.1%.
func TestForwardFloorMatchesTargets(t *testing.T) {
	for _, tc := range []struct {
		tokens  int
		touched float64
		floorUS float64
		compute bool
	}{
		{1, 8, 31, false},
		{8, 57, 221, false},
		{32, 163, 628, false},
		{128, 252, 967, false},
		{512, 256, 987, false},
		{4096, 256, 2436, true},
	} {
		f := ForwardFloor(deepSeekV3, tc.tokens)
		if math.Abs(f.Touched-tc.touched) > 0.5 {
			t.Errorf("%d tokens: %.2f experts touched, docs/PERF.md says %.0f", tc.tokens, f.Touched, tc.touched)
		}
		if got := us(f.Time); math.Abs(got-tc.floorUS) > 0.6+tc.floorUS*1e-3 {
			t.Errorf("%d tokens: floor %.2f us, docs/PERF.md says %.0f", tc.tokens, got, tc.floorUS)
		}
		if f.Compute != tc.compute {
			t.Errorf("%d tokens: compute bound %v, want %v", tc.tokens, f.Compute, tc.compute)
		}
	}
}

func TestForwardFloorTerms(t *testing.T) {
	t.Run("SwiGLUDoublesFC1", func(t *testing.T) {
		relu, swiglu := deepSeekV3, deepSeekV3
		swiglu.Activation = moe.SwiGLU
		r, s := ForwardFloor(relu, 1), ForwardFloor(swiglu, 1)
		// FC1 and FC2 are the same size for relu2; SwiGLU adds one more.
		act := 2 * float64(7168*2)
		if got, want := (s.Bytes-act)/(r.Bytes-act), 1.5; math.Abs(got-want) > 1e-12 {
			t.Errorf("SwiGLU / relu2 weight bytes %v, want %v", got, want)
		}
		if got, want := s.FLOPs/r.FLOPs, 1.5; math.Abs(got-want) > 1e-12 {
			t.Errorf("SwiGLU / relu2 FLOPs %v, want %v", got, want)
		}
	})
	t.Run("PaddedK", func(t *testing.T) {
		// K = 20 is read as 32 columns: two blocks of 16.
		c := moe.Config{Hidden: 20, Intermediate: 16, Experts: 1, TopK: 1, Activation: moe.ReLU2}
		f := ForwardFloor(c, 1)
		want := float64(16*32+20*16)*(0.5+1.0/16) + 2*20*2
		if f.Bytes != want {
			t.Errorf("bytes %v, want %v", f.Bytes, want)
		}
	})
	t.Run("EveryExpert", func(t *testing.T) {
		if got := ExpectedTouched(8, 8, 3); got != 8 {
			t.Errorf("top-8 of 8 touches %v experts, want 8", got)
		}
		if got := ExpectedTouched(256, 8, 1); math.Abs(got-8) > 1e-9 {
			t.Errorf("one token touches %v experts, want 8", got)
		}
	})
}

// TestRequantizeFloorMatchesTargets: docs/PERF.md quotes BF16 read
// 639 MB + NVFP4 written 180 MB, floor about 0.19 ms.
func TestRequantizeFloorMatchesTargets(t *testing.T) {
	read, written, floor := RequantizeFloor(moe.Config{Hidden: 2688, Intermediate: 1856, Experts: 32, Activation: moe.ReLU2})
	if math.Round(read/1e6) != 639 || math.Round(written/1e6) != 180 {
		t.Errorf("read %.1f MB, written %.1f MB; docs/PERF.md says 639 and 180", read/1e6, written/1e6)
	}
	if floor < 185*time.Microsecond || floor > 195*time.Microsecond {
		t.Errorf("floor %v, docs/PERF.md says about 0.19 ms", floor)
	}
}
