package cuda

// GPU tests: they open the real device and skip, saying why, when there is
// none. Build them for the GPU machine with
//
//	CGO_ENABLED=0 go test -c -o .gpu/cuda.test ./internal/cuda

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
)

var gpu struct {
	once sync.Once
	d    *Device
	err  error
}

// device opens the package's one Device, or skips the test without one.
func device(t *testing.T) *Device {
	t.Helper()
	gpu.once.Do(func() { gpu.d, gpu.err = Open(Config{}) })
	if gpu.err != nil {
		if errors.Is(gpu.err, ErrNoDevice) {
			t.Skip("no CUDA device: " + gpu.err.Error())
		}
		t.Fatalf("Open: %v", gpu.err)
	}
	return gpu.d
}

func TestMain(m *testing.M) {
	code := m.Run()
	if gpu.d != nil {
		if err := gpu.d.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "Device.Close:", err)
			if code == 0 {
				code = 1
			}
		}
	}
	os.Exit(code)
}

// compiler returns an NVRTC compiler for the device with the cache off
// (dir "") or in dir.
func compiler(t *testing.T, d *Device, dir string) *Compiler {
	t.Helper()
	if dir == "" {
		dir = CacheOff
	}
	c, err := NewCompiler(Config{CacheDir: dir}, d.Info().Arch)
	if err != nil {
		t.Fatalf("NewCompiler: %v", err)
	}
	return c
}

const testKernels = `
#include <cuda_bf16.h>

extern "C" __global__ void vadd(const float* a, const float* b, float* c, int n) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) c[i] = a[i] + b[i];
}

// BF16 round trip: round to nearest even, then widen.
extern "C" __global__ void to_bf16(const float* x, __nv_bfloat16* y, float* back, int n) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) {
		__nv_bfloat16 h = __float2bfloat16_rn(x[i]);
		y[i] = h;
		back[i] = __bfloat162float(h);
	}
}

// y = a*x + b, then z = y*w: the two kernels of the captured graph.
extern "C" __global__ void axpb(const float* x, float* y, float a, float b, int n) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) y[i] = a * x[i] + b;
}
extern "C" __global__ void mul(const float* y, const float* w, float* z, int n) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) z[i] = y[i] * w[i];
}

// A struct passed by value (RawArg).
struct Scale { int n; float s; long long add; };
extern "C" __global__ void scale(Scale p, float* x) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < p.n) x[i] = x[i] * p.s + (float)p.add;
}

// Reverses n floats through dynamic shared memory (one block).
extern "C" __global__ void reverse_shared(const float* x, float* y, int n) {
	extern __shared__ float sh[];
	for (int i = threadIdx.x; i < n; i += blockDim.x) sh[i] = x[i];
	__syncthreads();
	for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = sh[n - 1 - i];
}

// Busy work for event timing.
extern "C" __global__ void spin(float* x, int iters) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	float v = x[i];
	for (int k = 0; k < iters; k++) v = v * 0.999f + 0.001f;
	x[i] = v;
}
`

func f32bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, f := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(f))
	}
	return b
}

func bytesf32(b []byte) []float32 {
	v := make([]float32, len(b)/4)
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return v
}

func do(t *testing.T, d *Device, fn func(*Ctx) error) {
	t.Helper()
	if err := d.Do(fn); err != nil {
		t.Fatal(err)
	}
}

func TestGPUInfo(t *testing.T) {
	d := device(t)
	in := d.Info()
	t.Logf("device %d: %s, compute capability %d.%d (%s), %d SMs, %.1f GiB, L2 %d MiB, shared opt-in %d KiB, driver %d",
		in.Ordinal, in.Name, in.Major, in.Minor, in.Arch, in.SMs, float64(in.TotalMem)/(1<<30),
		in.L2Bytes>>20, in.SharedOptin>>10, in.DriverVersion)
	if in.Name == "" || in.Major < 3 || in.SMs <= 0 || in.TotalMem <= 0 || in.SharedOptin < 48<<10 {
		t.Errorf("implausible info %+v", in)
	}
	c := compiler(t, d, "")
	maj, minor := c.Version()
	t.Logf("NVRTC %d.%d, options %q", maj, minor, c.Options())
}

func TestGPUMemory(t *testing.T) {
	d := device(t)
	const n = 1<<20 + 3
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(rand.Uint32())
	}
	do(t, d, func(c *Ctx) error {
		a, err := c.Alloc(n)
		if err != nil {
			return err
		}
		defer c.Free(a)
		b, err := c.Alloc(n)
		if err != nil {
			return err
		}
		defer c.Free(b)
		if err := c.HtoD(a, src); err != nil {
			return err
		}
		if err := c.DtoD(b, a, n); err != nil {
			return err
		}
		got := make([]byte, n)
		if err := c.DtoH(got, b); err != nil {
			return err
		}
		if !bytes.Equal(got, src) {
			t.Error("HtoD, DtoD, DtoH: bytes differ")
		}
		if err := c.Memset8(b.Add(100), 0xab, 1000); err != nil {
			return err
		}
		if err := c.DtoH(got, b); err != nil {
			return err
		}
		want := append([]byte(nil), src...)
		for i := 100; i < 1100; i++ {
			want[i] = 0xab
		}
		if !bytes.Equal(got, want) {
			t.Error("Memset8: bytes differ")
		}
		// A real driver error, formatted; out of memory does not poison the context.
		_, err = c.Alloc(1 << 50)
		t.Logf("Alloc(1<<50): %v", err)
		var e *Error
		if !errors.As(err, &e) || e.Name != "CUDA_ERROR_OUT_OF_MEMORY" ||
			err.Error() != "cuda: cuMemAlloc_v2(1125899906842624): CUDA_ERROR_OUT_OF_MEMORY (out of memory)" {
			t.Errorf("Alloc(1<<50): %v", err)
		}
		return c.Synchronize()
	})
}

func TestGPUPinned(t *testing.T) {
	d := device(t)
	const n = 4 << 20
	do(t, d, func(c *Ctx) error {
		h1, err := c.HostAlloc(n)
		if err != nil {
			return err
		}
		h2, err := c.HostAlloc(n)
		if err != nil {
			return err
		}
		for i := range h1 {
			h1[i] = byte(i * 7)
		}
		dp, err := c.Alloc(n)
		if err != nil {
			return err
		}
		defer c.Free(dp)
		s, err := c.NewStream()
		if err != nil {
			return err
		}
		defer s.Destroy()
		if err := c.HtoDAsync(dp, h1, s); err != nil {
			return err
		}
		if err := c.DtoHAsync(h2[1000:], dp.Add(1000), s); err != nil { // a sub-slice is pinned too
			return err
		}
		if err := s.Sync(); err != nil {
			return err
		}
		if !bytes.Equal(h1[1000:], h2[1000:]) {
			t.Error("pinned round trip: bytes differ")
		}
		// Device to device on the stream, then back.
		dp2, err := c.Alloc(n)
		if err != nil {
			return err
		}
		defer c.Free(dp2)
		if err := c.DtoDAsync(dp2, dp, n, s); err != nil {
			return err
		}
		clear(h2)
		if err := c.DtoHAsync(h2, dp2, s); err != nil {
			return err
		}
		if err := s.Sync(); err != nil {
			return err
		}
		if !bytes.Equal(h1, h2) {
			t.Error("DtoDAsync: bytes differ")
		}
		if err := c.HtoDAsync(dp, make([]byte, 16), s); err != errNotPinned {
			t.Errorf("async copy from Go memory: %v", err)
		}
		if err := c.FreeHost(h1[1:]); err == nil {
			t.Error("FreeHost of an interior slice accepted")
		}
		if err := c.FreeHost(h1); err != nil {
			return err
		}
		return c.FreeHost(h2)
	})
}

// load compiles the test kernels and loads them.
func load(t *testing.T, d *Device, comp *Compiler) *Module {
	t.Helper()
	out, err := comp.Compile(Program{Name: "test_kernels.cu", Source: testKernels})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("compiled %d-byte cubin for %s in %v (cached %v)", len(out.Cubin), comp.Arch(), out.Elapsed, out.Cached)
	var m *Module
	do(t, d, func(c *Ctx) error {
		m, err = c.LoadModule(out.Cubin)
		return err
	})
	return m
}

func fn(t *testing.T, d *Device, m *Module, name string) *Function {
	t.Helper()
	var f *Function
	do(t, d, func(*Ctx) error {
		var err error
		f, err = m.Function(name)
		return err
	})
	return f
}

func TestGPUCompileAndLaunch(t *testing.T) {
	d := device(t)
	m := load(t, d, compiler(t, d, ""))
	vadd, tobf, scale, rev := fn(t, d, m, "vadd"), fn(t, d, m, "to_bf16"), fn(t, d, m, "scale"), fn(t, d, m, "reverse_shared")

	// Vector add.
	const n = 100003
	a, b := make([]float32, n), make([]float32, n)
	for i := range a {
		a[i], b[i] = rand.Float32()*100-50, rand.Float32()*100-50
	}
	// BF16 conversion: specials, halfway cases, subnormals, overflow.
	xs := []float32{0, float32(math.Copysign(0, -1)), 1, -1, 1.00390625, 1.01171875, 1.0078125,
		float32(math.Inf(1)), float32(math.Inf(-1)), math.MaxFloat32, -math.MaxFloat32,
		math.SmallestNonzeroFloat32, 1e-39, -1e-39, 3.4e38, 65504, 0.1, -0.3}
	for i := 0; i < 4096; i++ {
		xs = append(xs, math.Float32frombits(rand.Uint32()&^0x7f800000|uint32(rand.IntN(255))<<23)) // any finite
	}
	nb := len(xs)
	do(t, d, func(c *Ctx) error {
		da, _ := c.Alloc(4 * n)
		db, _ := c.Alloc(4 * n)
		dc, err := c.Alloc(4 * n)
		if err != nil {
			return err
		}
		defer func() { c.Free(da); c.Free(db); c.Free(dc) }()
		c.HtoD(da, f32bytes(a))
		c.HtoD(db, f32bytes(b))
		if err := vadd.Launch(Dim3{X: (n + 255) / 256}, Dim3{X: 256}, 0, nil, da, db, dc, int32(n)); err != nil {
			return err
		}
		out := make([]byte, 4*n)
		if err := c.DtoH(out, dc); err != nil {
			return err
		}
		for i, v := range bytesf32(out) {
			if v != a[i]+b[i] {
				t.Errorf("vadd[%d] = %v, want %v", i, v, a[i]+b[i])
				break
			}
		}

		// A by-value struct: n, s, add with C layout {int32, float32, int64}.
		raw := make([]byte, 16)
		binary.LittleEndian.PutUint32(raw[0:], uint32(n))
		binary.LittleEndian.PutUint32(raw[4:], math.Float32bits(2))
		binary.LittleEndian.PutUint64(raw[8:], 3)
		if err := scale.Launch(Dim3{X: (n + 255) / 256}, Dim3{X: 256}, 0, nil, RawArg(raw), dc); err != nil {
			return err
		}
		if err := c.DtoH(out, dc); err != nil {
			return err
		}
		for i, v := range bytesf32(out) {
			if want := (a[i]+b[i])*2 + 3; v != want {
				t.Errorf("scale[%d] = %v, want %v", i, v, want)
				break
			}
		}

		dx, _ := c.Alloc(4 * nb)
		dy, _ := c.Alloc(2 * nb)
		dback, err := c.Alloc(4 * nb)
		if err != nil {
			return err
		}
		defer func() { c.Free(dx); c.Free(dy); c.Free(dback) }()
		c.HtoD(dx, f32bytes(xs))
		if err := tobf.Launch(Dim3{X: (nb + 127) / 128}, Dim3{X: 128}, 0, nil, dx, dy, dback, int32(nb)); err != nil {
			return err
		}
		hy, hback := make([]byte, 2*nb), make([]byte, 4*nb)
		if err := c.DtoH(hy, dy); err != nil {
			return err
		}
		if err := c.DtoH(hback, dback); err != nil {
			return err
		}
		back := bytesf32(hback)
		bad := 0
		for i, x := range xs {
			got := binary.LittleEndian.Uint16(hy[2*i:])
			if want := bf16.FromFloat32(x); got != want || math.Float32bits(back[i]) != math.Float32bits(bf16.ToFloat32(want)) {
				if bad++; bad <= 5 {
					t.Errorf("bf16(%g = %#08x) = %#04x / %g, want %#04x", x, math.Float32bits(x), got, back[i], want)
				}
			}
		}
		t.Logf("BF16 round trip: %d values, %d mismatches against internal/bf16", nb, bad)

		// More than 48 KiB of dynamic shared memory needs the opt-in.
		shared := c.Info().SharedOptin
		nr := shared / 4
		if err := rev.SetMaxDynamicShared(shared); err != nil {
			return err
		}
		xr := make([]float32, nr)
		for i := range xr {
			xr[i] = float32(i)
		}
		dr, _ := c.Alloc(4 * nr)
		dr2, err := c.Alloc(4 * nr)
		if err != nil {
			return err
		}
		defer func() { c.Free(dr); c.Free(dr2) }()
		c.HtoD(dr, f32bytes(xr))
		if err := rev.Launch(Dim3{X: 1}, Dim3{X: 1024}, shared, nil, dr, dr2, int32(nr)); err != nil {
			return err
		}
		hr := make([]byte, 4*nr)
		if err := c.DtoH(hr, dr2); err != nil {
			return err
		}
		for i, v := range bytesf32(hr) {
			if v != float32(nr-1-i) {
				t.Errorf("reverse_shared[%d] = %v", i, v)
				break
			}
		}
		t.Logf("reverse_shared used %d KiB of dynamic shared memory", shared>>10)

		if err := vadd.Launch(Dim3{X: 1}, Dim3{X: 256}, 0, nil, da, db, dc, n); err == nil {
			t.Error("Go int argument accepted")
		}
		return c.Synchronize()
	})
	do(t, d, func(*Ctx) error { return m.Unload() })
}

func TestGPUCompileErrors(t *testing.T) {
	d := device(t)
	_, err := compiler(t, d, "").Compile(Program{Name: "bad.cu", Source: "extern \"C\" __global__ void k() { int x = ; }"})
	var ce *CompileError
	if !errors.As(err, &ce) || !strings.Contains(ce.Log, "error") || !strings.Contains(err.Error(), "NVRTC_ERROR_COMPILATION") {
		t.Errorf("syntax error: %v", err)
	}
	t.Logf("syntax error reported as: %v", err)
	// Without the include directory NVRTC cannot find cuda_bf16.h.
	noInc, err := NewCompiler(Config{CacheDir: CacheOff, IncludeDir: "/nonexistent/include"}, d.Info().Arch)
	if err != nil {
		t.Fatal(err)
	}
	_, err = noInc.Compile(Program{Name: "bf16.cu", Source: testKernels})
	if !errors.As(err, &ce) || !strings.Contains(ce.Log, "cuda_bf16.h") {
		t.Errorf("missing include directory: %v", err)
	}
	t.Logf("missing -I reported as: %.300s", err)
}

func TestGPUEvents(t *testing.T) {
	d := device(t)
	m := load(t, d, compiler(t, d, ""))
	spin := fn(t, d, m, "spin")
	do(t, d, func(c *Ctx) error {
		const threads = 132 * 1024
		x, err := c.Alloc(4 * threads)
		if err != nil {
			return err
		}
		defer c.Free(x)
		if err := c.Memset8(x, 0, 4*threads); err != nil {
			return err
		}
		e0, err := c.NewEvent()
		if err != nil {
			return err
		}
		defer e0.Destroy()
		e1, err := c.NewEvent()
		if err != nil {
			return err
		}
		defer e1.Destroy()
		var times []time.Duration
		for _, iters := range []int32{1000, 10000, 100000} {
			if err := e0.Record(nil); err != nil {
				return err
			}
			if err := spin.Launch(Dim3{X: threads / 256}, Dim3{X: 256}, 0, nil, x, iters); err != nil {
				return err
			}
			if err := e1.Record(nil); err != nil {
				return err
			}
			if err := e1.Sync(); err != nil {
				return err
			}
			el, err := c.Elapsed(e0, e1)
			if err != nil {
				return err
			}
			times = append(times, el)
		}
		t.Logf("spin 1e3, 1e4, 1e5 iterations: %v", times)
		if times[0] <= 0 || times[2] <= times[0] {
			t.Errorf("implausible event times %v", times)
		}
		return nil
	})
}

func TestGPUGraph(t *testing.T) {
	d := device(t)
	m := load(t, d, compiler(t, d, ""))
	axpb, mul := fn(t, d, m, "axpb"), fn(t, d, m, "mul")
	const n = 1 << 16
	do(t, d, func(c *Ctx) error {
		var bufs [4]DevicePtr
		for i := range bufs {
			p, err := c.Alloc(4 * n)
			if err != nil {
				return err
			}
			defer c.Free(p)
			bufs[i] = p
		}
		x, w, y, z := bufs[0], bufs[1], bufs[2], bufs[3]
		if err := c.Memset8(z, 0, 4*n); err != nil {
			return err
		}
		s, err := c.NewStream()
		if err != nil {
			return err
		}
		defer s.Destroy()

		if err := s.BeginCapture(); err != nil {
			return err
		}
		grid, block := Dim3{X: n / 256}, Dim3{X: 256}
		if err := axpb.Launch(grid, block, 0, s, x, y, float32(2), float32(1), int32(n)); err != nil {
			return err
		}
		if err := mul.Launch(grid, block, 0, s, y, w, z, int32(n)); err != nil {
			return err
		}
		if err := c.HtoD(x, make([]byte, 4)); !errors.Is(err, ErrCapturing) {
			t.Errorf("HtoD during capture: %v", err)
		}
		g, err := s.EndCapture()
		if err != nil {
			return err
		}
		defer g.Destroy()

		// Capturing ran nothing.
		hz := make([]byte, 4*n)
		if err := c.DtoH(hz, z); err != nil {
			return err
		}
		if !bytes.Equal(hz, make([]byte, 4*n)) {
			t.Error("capture executed the kernels")
		}

		e0, _ := c.NewEvent()
		e1, _ := c.NewEvent()
		defer e0.Destroy()
		defer e1.Destroy()
		for rep := 0; rep < 3; rep++ {
			hx, hw := make([]float32, n), make([]float32, n)
			for i := range hx {
				hx[i] = float32((i*7+rep*13)%1000 - 500)
				hw[i] = float32((i*3+rep*5)%64 - 32)
			}
			// New inputs go into the captured buffers.
			if err := c.HtoD(x, f32bytes(hx)); err != nil {
				return err
			}
			if err := c.HtoD(w, f32bytes(hw)); err != nil {
				return err
			}
			e0.Record(s)
			if err := g.Launch(s); err != nil {
				return err
			}
			e1.Record(s)
			if err := s.Sync(); err != nil {
				return err
			}
			el, _ := c.Elapsed(e0, e1)
			if err := c.DtoH(hz, z); err != nil {
				return err
			}
			bad := 0
			for i, v := range bytesf32(hz) {
				if want := (2*hx[i] + 1) * hw[i]; v != want {
					if bad++; bad <= 3 {
						t.Errorf("launch %d: z[%d] = %v, want %v", rep, i, v, want)
					}
				}
			}
			t.Logf("graph launch %d: %d/%d outputs right, %v on device", rep, n-bad, n, el)
		}
		return nil
	})
}

func TestGPUCubinCache(t *testing.T) {
	d := device(t)
	dir := filepath.Join(t.TempDir(), "cubin")
	comp := compiler(t, d, dir)
	p := Program{Name: "test_kernels.cu", Source: testKernels, Options: []string{"-lineinfo"}}
	first, err := comp.Compile(p)
	if err != nil {
		t.Fatal(err)
	}
	second, err := comp.Compile(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first compile %v (cached %v), second %v (cached %v), key %s", first.Elapsed, first.Cached, second.Elapsed, second.Cached, first.Key[:16])
	if first.Cached || first.CacheErr != nil || !second.Cached || first.Key != second.Key || !bytes.Equal(first.Cubin, second.Cubin) {
		t.Errorf("cache: first cached=%v err=%v, second cached=%v, same key %v, same bytes %v",
			first.Cached, first.CacheErr, second.Cached, first.Key == second.Key, bytes.Equal(first.Cubin, second.Cubin))
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("cache dir holds %d entries", len(ents))
	}
	// Other options are another entry.
	third, err := comp.Compile(Program{Name: p.Name, Source: p.Source})
	if err != nil {
		t.Fatal(err)
	}
	if third.Cached || third.Key == first.Key {
		t.Error("different options hit the same entry")
	}
	// The cached cubin loads and its kernels are there.
	do(t, d, func(c *Ctx) error {
		m, err := c.LoadModule(second.Cubin)
		if err != nil {
			return err
		}
		defer m.Unload()
		_, err = m.Function("vadd")
		return err
	})
}

func TestGPUOwnership(t *testing.T) {
	d := device(t)
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := d.Do(func(c *Ctx) error {
				p, err := c.Alloc(4096)
				if err != nil {
					return err
				}
				defer c.Free(p)
				if err := c.Memset8(p, byte(g), 4096); err != nil {
					return err
				}
				b := make([]byte, 4096)
				if err := c.DtoH(b, p); err != nil {
					return err
				}
				if !bytes.Equal(b, bytes.Repeat([]byte{byte(g)}, 4096)) {
					return fmt.Errorf("goroutine %d: wrong bytes", g)
				}
				return nil
			})
			if err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	var leaked *Ctx
	do(t, d, func(c *Ctx) error { leaked = c; return nil })
	if _, err := leaked.Alloc(16); !errors.Is(err, ErrWrongThread) {
		t.Errorf("Ctx used outside Do: %v", err)
	}
	if err := d.Do(func(*Ctx) error { panic("boom") }); err == nil {
		t.Error("panic not reported")
	}
	do(t, d, func(c *Ctx) error { return c.Synchronize() }) // still usable
}

// TestGPUHeadersAndNameExpressions compiles programs that include a header
// by name and define templated kernels in a namespace, found by their name
// expressions: several at once (CompileAll), from the cache the second
// time with the same lowered names, and launched.
func TestGPUHeadersAndNameExpressions(t *testing.T) {
	d := device(t)
	dir := filepath.Join(t.TempDir(), "cubin")
	comp := compiler(t, d, dir)
	hdr := Header{Name: "scale.cuh", Source: "namespace ns { template <int S> struct Scale { static constexpr int V = S; }; }\n"}
	src := `#include "scale.cuh"
namespace ns {
template <class T> __global__ void scale(int *p, int n) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) p[i] *= T::V;
}
}
`
	exprs := []string{"ns::scale<ns::Scale<2>>", "ns::scale<ns::Scale<3>>"}
	progs := []Program{
		{Name: "scale.cu", Source: src, Headers: []Header{hdr}, NameExpressions: exprs[:1]},
		{Name: "scale.cu", Source: src, Headers: []Header{hdr}, NameExpressions: exprs[1:]},
	}
	first, err := comp.CompileAll(progs, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	again, err := comp.CompileAll(progs, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range progs {
		e := progs[i].NameExpressions[0]
		if first[i].Cached || !again[i].Cached || first[i].Key == first[1-i].Key || again[i].Lowered[e] != first[i].Lowered[e] || first[i].Lowered[e] == "" {
			t.Fatalf("program %d: cached %v then %v, lowered %q then %q", i, first[i].Cached, again[i].Cached, first[i].Lowered[e], again[i].Lowered[e])
		}
	}
	do(t, d, func(c *Ctx) error {
		p, err := c.Alloc(4)
		if err != nil {
			return err
		}
		defer c.Free(p)
		if err := c.HtoD(p, []byte{1, 0, 0, 0}); err != nil {
			return err
		}
		for i, out := range again {
			m, err := c.LoadModule(out.Cubin)
			if err != nil {
				return err
			}
			defer m.Unload()
			f, err := m.Function(out.Lowered[progs[i].NameExpressions[0]])
			if err != nil {
				return err
			}
			if err := f.Launch(Dim3{X: 1}, Dim3{X: 32}, 0, nil, p, int32(1)); err != nil {
				return err
			}
		}
		got := make([]byte, 4)
		if err := c.DtoH(got, p); err != nil {
			return err
		}
		if got[0] != 6 {
			return fmt.Errorf("1 * 2 * 3 = %d", got[0])
		}
		return nil
	})
}
