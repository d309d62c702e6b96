package moebench

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync"

	"github.com/rollout-worker/rollout-worker/internal/nvfp4"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
)

// RefitConfig is one requantization benchmark (docs/PERF.md).
type RefitConfig struct {
	// Layer is the shape and activation. The recipe is always the NVFP4
	// one (per_token), MaxTokens 1 (no forward runs); TopK 0 means
	// min(8, Experts) and an empty Scoring means softmax: neither matters
	// to requantization.
	Layer moe.Config
	Iters int // requantizations timed; the mean is reported
	Seed  uint64
}

// RunRefit builds one NVFP4 layer with random weights, times
// Layer.Requantize of the whole layer, then checks that the copies did not
// move and equal the host reference bit for bit. A failed check is reported
// in the result, not as an error: the caller prints it and decides.
func RunRefit(ctx context.Context, be kernels.Backend, cfg RefitConfig) (res RefitResult, err error) {
	if cfg.Iters < 1 {
		return res, fmt.Errorf("moebench: refit: %d iterations", cfg.Iters)
	}
	lc := cfg.Layer
	lc.Recipe, lc.MaxTokens = moe.RecipePerToken, 1
	if lc.TopK == 0 {
		lc.TopK = min(8, lc.Experts)
	}
	if lc.Scoring == "" {
		lc.Scoring = moe.Softmax
	}
	l, err := moe.New(be, lc)
	if err != nil {
		return res, fmt.Errorf("moebench: refit: %w", err)
	}
	defer func() { err = errors.Join(err, l.Close()) }()
	w := RandomWeightsFast(lc, cfg.Seed)
	if err := Load(be, l, w); err != nil { // uploads, then one requantization (the warm-up)
		return res, fmt.Errorf("moebench: refit: load: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return res, err
	}
	fc1q, fc2q := l.Quantized()
	copies := []*kernels.Buffer{fc1q.Packed, fc1q.Scales, fc1q.Scale, fc2q.Packed, fc2q.Scales, fc2q.Scale}
	addrs := make([]uintptr, len(copies))
	for i, b := range copies {
		addrs[i] = b.Addr()
	}
	res.Layer, res.Iters = l.Config(), cfg.Iters
	res.Read, res.Written, res.Floor = RequantizeFloor(lc)
	res.Mean, res.Timing, err = measure(be, cfg.Iters, func() error { return l.Requantize() })
	if err != nil {
		return res, fmt.Errorf("moebench: refit: requantize: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return res, err
	}
	// The Buffer values cannot change, but a backend that reallocated
	// behind them would: compare with what Quantized returns now.
	fc1q, fc2q = l.Quantized()
	res.SameAddresses = true
	for i, b := range []*kernels.Buffer{fc1q.Packed, fc1q.Scales, fc1q.Scale, fc2q.Packed, fc2q.Scales, fc2q.Scale} {
		if b.Addr() != addrs[i] {
			res.SameAddresses = false
			res.Mismatch = fmt.Sprintf("copy %v moved from %#x to %#x", b, addrs[i], b.Addr())
			return res, nil
		}
	}
	E, H, I, I1 := lc.Experts, lc.Hidden, lc.Intermediate, lc.Intermediate
	if lc.Activation == moe.SwiGLU {
		I1 = 2 * I
	}
	res.BitExact = true
	for _, m := range []struct {
		name    string
		q       kernels.NVFP4
		src     []byte
		rows, k int
	}{{"fc1", fc1q, w.FC1, I1, H}, {"fc2", fc2q, w.FC2, H, I}} {
		packed, scales, alphas, err := hostQuantize(m.src, E, m.rows, m.k)
		if err != nil {
			return res, fmt.Errorf("moebench: refit: host reference of %s: %w", m.name, err)
		}
		for _, c := range []struct {
			what string
			b    *kernels.Buffer
			want []byte
		}{{"codes", m.q.Packed, packed}, {"block scales", m.q.Scales, scales}, {"alphas", m.q.Scale, alphas}} {
			got := make([]byte, c.b.Size())
			if err := be.Download(got, c.b, 0); err != nil {
				return res, fmt.Errorf("moebench: refit: download %s %s: %w", m.name, c.what, err)
			}
			if i := firstDiff(got, c.want); i >= 0 {
				res.BitExact = false
				res.Mismatch = fmt.Sprintf("%s %s differ from internal/nvfp4: %d bytes, want %d", m.name, c.what, len(got), len(c.want))
				if i < len(got) && i < len(c.want) {
					res.Mismatch = fmt.Sprintf("%s %s differ from internal/nvfp4 first at byte %d of %d (%#02x, want %#02x)",
						m.name, c.what, i, len(got), got[i], c.want[i])
				}
				return res, nil
			}
		}
	}
	return res, nil
}

// hostQuantize is internal/nvfp4.QuantizeStack of a BF16 stack, one expert
// per call on all cores: each expert's global scale depends on that expert
// alone, so this is the same computation, minutes faster at 32 x 5M weights.
func hostQuantize(src []byte, mats, rows, k int) (packed, scales, alphas []byte, err error) {
	kp := nvfp4.PaddedK(k)
	mp, ms, mv := rows*kp/2, rows*kp/nvfp4.BlockSize, rows*k
	if len(src) != 2*mats*mv {
		return nil, nil, nil, fmt.Errorf("%d bytes for %d matrices %dx%d", len(src), mats, rows, k)
	}
	packed, scales = make([]byte, mats*mp), make([]byte, mats*ms)
	a := make([]float32, mats)
	errs := make([]error, mats)
	next := make(chan int, mats)
	for m := range mats {
		next <- m
	}
	close(next)
	var wg sync.WaitGroup
	for range min(mats, runtime.GOMAXPROCS(0)) {
		wg.Go(func() {
			vals := make([]uint16, mv)
			for m := range next {
				for i := range vals {
					vals[i] = binary.LittleEndian.Uint16(src[2*(m*mv+i):])
				}
				errs[m] = nvfp4.QuantizeStack(packed[m*mp:(m+1)*mp], scales[m*ms:(m+1)*ms], a[m:m+1], vals, 1, rows, k)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, nil, nil, err
	}
	return packed, scales, kernels.Float32Bytes(a), nil
}

// firstDiff returns the index of the first byte where a and b differ, or -1.
func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
