package moebench

// The floors the benchmarks report their times against (docs/PERF.md,
// "Floors"): what the H200 could not beat even with perfect kernels,
// from its measured copy bandwidth and dense BF16 throughput.

import (
	"math"
	"time"

	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/moe"
)

// The measured H200 ceilings (docs/PERF.md): device copy
// bandwidth counting bytes read plus written, and dense BF16 GEMM throughput.
const (
	H200Bandwidth = 4.3e12 // bytes/s
	H200BF16FLOPs = 790e12 // FLOP/s
)

// nvfp4BytesPerWeight is what one weight of an NVFP4 copy costs to read: a
// 4-bit code plus its share of the E4M3 scale of its 16-element block.
const nvfp4BytesPerWeight = 0.5 + 1.0/nvfp4.BlockSize

// ExpectedTouched is the expected number of distinct experts that T tokens
// route to when each picks k of E uniformly: E * (1 - (1 - k/E)^T). Each
// token misses a given expert with probability 1 - k/E.
func ExpectedTouched(experts, topK, tokens int) float64 {
	e := float64(experts)
	return e * (1 - math.Pow(1-float64(topK)/e, float64(tokens)))
}

// Floor is the lower bound on one MoE forward of T tokens.
type Floor struct {
	Touched float64       // expected experts touched
	Bytes   float64       // NVFP4 weights of the touched experts + activations in and out
	FLOPs   float64       // both expert GEMMs over the T*k routed rows
	Time    time.Duration // max(Bytes / bandwidth, FLOPs / throughput)
	Compute bool          // the FLOP term is the larger one
}

// ForwardFloor is the NVFP4 MoE layer floor of docs/PERF.md for T tokens
// through a layer of shape cfg: the router and the small ops are left out
// (they are a rounding error at these shapes), the weights are counted at
// their padded K because that is what the kernels read.
func ForwardFloor(cfg moe.Config, T int) Floor {
	H, I := cfg.Hidden, cfg.Intermediate
	i1 := I
	if cfg.Activation == moe.SwiGLU {
		i1 = 2 * I
	}
	perExpert := float64(i1*nvfp4.PaddedK(H)+H*nvfp4.PaddedK(I)) * nvfp4BytesPerWeight
	f := Floor{Touched: ExpectedTouched(cfg.Experts, cfg.TopK, T)}
	f.Bytes = f.Touched*perExpert + 2*float64(T*H*2) // BF16 activations in and out
	f.FLOPs = 2 * float64(T) * float64(cfg.TopK) * float64(i1*H+H*I)
	mem, comp := f.Bytes/H200Bandwidth, f.FLOPs/H200BF16FLOPs
	f.Compute = comp > mem
	f.Time = seconds(max(mem, comp))
	return f
}

// RequantizeFloor is the requantization floor of docs/PERF.md for a
// whole layer of shape cfg: every BF16 weight of FC1 and FC2 read once, and
// every NVFP4 copy written once (codes, block scales and the per-expert
// FP32 alphas).
func RequantizeFloor(cfg moe.Config) (read, written float64, floor time.Duration) {
	E, H, I := cfg.Experts, cfg.Hidden, cfg.Intermediate
	i1 := I
	if cfg.Activation == moe.SwiGLU {
		i1 = 2 * I
	}
	read = 2 * float64(E) * float64(i1*H+H*I)
	written = float64(E)*float64(i1*nvfp4.PaddedK(H)+H*nvfp4.PaddedK(I))*nvfp4BytesPerWeight + 2*4*float64(E)
	return read, written, seconds((read + written) / H200Bandwidth)
}

func seconds(s float64) time.Duration { return time.Duration(math.Round(s * 1e9)) }
