package cuda

import (
	"fmt"
	"regexp"
	"strings"
	"testing"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// TestRegistry checks, without a GPU, that every kernel has one entry (key,
// host name and name expression each unique), that its entry point is a
// __global__ function of its unit, and that a launch matching the entry
// passes the check.
func TestRegistry(t *testing.T) {
	reg := kernelRegistry()
	keys, names, exprs := map[any]bool{}, map[string]bool{}, map[string]bool{}
	for _, k := range reg {
		if keys[k.key] || names[k.name] || exprs[k.expr] {
			t.Errorf("%s: key %+v, name or expression %q registered twice", k.name, k.key, k.expr)
		}
		keys[k.key], names[k.name], exprs[k.expr] = true, true, true
		src, err := sources.ReadFile("src/" + k.unit)
		if err != nil {
			t.Fatalf("%s: unit %s: %v", k.name, k.unit, err)
		}
		entry := strings.TrimPrefix(k.expr, "rw::")
		if i := strings.Index(entry, "<"); i >= 0 {
			entry = entry[:i]
		}
		if !regexp.MustCompile(`__global__ void (__launch_bounds__\([^)]*\)\s*)?(__cluster_dims__\([^)]*\)\s*)?\s*` + entry + `\(`).Match(src) {
			t.Errorf("%s: no __global__ %s in %s", k.name, entry, k.unit)
		}
		threads := k.threads
		if threads == 0 {
			threads = k.maxThreads
		}
		smem := k.smem
		if smem == smemPerLaunch {
			smem = 1024
		}
		if err := k.check(archWGMMA, drv.Dim3{X: 1, Y: 1, Z: max(k.clusterZ, 1)}, drv.Dim3{X: threads}, smem, 227<<10); err != nil {
			t.Error(err)
		}
	}
}

// TestLaunchCheck: a launch that does not match its kernel's entry is an
// error naming the kernel and what differs.
func TestLaunchCheck(t *testing.T) {
	reg := kernelRegistry()
	stream := specOf(t, reg, streamKernel{fp4: true, bm: 16, j: 2, ks2: true})
	ws := specOf(t, reg, wsKernel{rows: 128})
	rows := specOf(t, reg, kQuantRows)
	for _, c := range []struct {
		k     *kernelSpec
		arch  string
		grid  drv.Dim3
		block int
		smem  int
		want  string
	}{
		{stream, "sm_90a", drv.Dim3{X: 1, Z: 2}, 128, stream.smem, "gemm_fp4_stream_m16_ks2: block of 128 threads, the kernel is built for 256"},
		{stream, "sm_90a", drv.Dim3{X: 1, Z: 2}, 256, stream.smem + 16, fmt.Sprintf("gemm_fp4_stream_m16_ks2: %d bytes of dynamic shared memory, the kernel is built for %d", stream.smem+16, stream.smem)},
		{stream, "sm_90a", drv.Dim3{X: 1, Z: 1}, 256, stream.smem, "gemm_fp4_stream_m16_ks2: grid z 1 is not a multiple of its cluster's 2 blocks"},
		{ws, "sm_100a", drv.Dim3{X: 1}, 512, wsSmem, "gemm_fp4_ws: the kernel needs sm_90a, the device is sm_100a"},
		{rows, "sm_90a", drv.Dim3{X: 1}, 512, 0, "quant_rows: block of 512 threads, the kernel takes 1 to 256"},
	} {
		err := c.k.check(c.arch, c.grid, drv.Dim3{X: c.block}, c.smem, 227<<10)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("check: %v, want %q", err, c.want)
		}
	}
}

// TestPrograms: for sm_90a every registered kernel is in exactly one
// program, whose name expressions and headers it carries; other targets
// leave out the wgmma unit only.
func TestPrograms(t *testing.T) {
	reg := kernelRegistry()
	for _, arch := range []string{"sm_90a", "sm_100a"} {
		ps, err := programs(arch, reg)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]int{}
		for _, p := range ps {
			hs := map[string]bool{}
			for _, h := range p.prog.Headers {
				hs[h.Name] = true
			}
			for _, name := range includes(p.prog.Source) {
				if !hs[name] {
					t.Errorf("%s: includes %s, which it is not given", p.label, name)
				}
			}
			if len(p.prog.NameExpressions) != len(p.kernels) {
				t.Errorf("%s: %d name expressions for %d kernels", p.label, len(p.prog.NameExpressions), len(p.kernels))
			}
			for _, k := range p.kernels {
				seen[k.name]++
			}
		}
		for _, k := range reg {
			want := 1
			if k.minArch != "" && k.minArch != arch {
				want = 0
			}
			if seen[k.name] != want {
				t.Errorf("%s: %s is in %d programs, want %d", arch, k.name, seen[k.name], want)
			}
		}
	}
}

// TestErrorsHeader: the kernels' error constants come from the one table,
// each code and name once, and every constant a unit uses is in it.
func TestErrorsHeader(t *testing.T) {
	h := errorsHeader()
	codes, names := map[int32]bool{}, map[string]bool{}
	for _, e := range deviceErrors() {
		if codes[e.code] || names[e.name] {
			t.Errorf("error %d %s defined twice", e.code, e.name)
		}
		codes[e.code], names[e.name] = true, true
		if !strings.Contains(h, fmt.Sprintf("constexpr int %s = %d;", e.name, e.code)) {
			t.Errorf("errors.cuh lacks %s = %d", e.name, e.code)
		}
		if e.format(1, 2, 3) == "" {
			t.Errorf("error %s has no message", e.name)
		}
	}
	files, err := sources.ReadDir("src")
	if err != nil {
		t.Fatal(err)
	}
	used := regexp.MustCompile(`\bE_[A-Z_]+\b`)
	for _, f := range files {
		b, err := sources.ReadFile("src/" + f.Name())
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range used.FindAllString(string(b), -1) {
			if !names[n] {
				t.Errorf("%s uses %s, which errors.go does not define", f.Name(), n)
			}
		}
	}
}

// TestScatterConstants: model_scatter_bf16's constants are the host's (a
// span's words and largest length, the block size), and the largest span
// fits one staging buffer of the least size.
func TestScatterConstants(t *testing.T) {
	src, err := sources.ReadFile("src/model.cu")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int{"MODEL_SPAN_WORDS": kernels.DeltaSpanWords, "MODEL_SPAN_ELEMS": kernels.DeltaSpanElems,
		"MODEL_SCATTER_THREADS": scatterThreads} {
		if !strings.Contains(string(src), fmt.Sprintf("constexpr int %s = %d;", name, want)) {
			t.Errorf("model.cu: %s is not %d", name, want)
		}
	}
	if largest := spanBytes + 4*(kernels.DeltaSpanElems/2) + 2*kernels.DeltaSpanElems; largest > minStagingBytes {
		t.Errorf("the largest span takes %d bytes, more than the least staging buffer, %d", largest, minStagingBytes)
	}
}
