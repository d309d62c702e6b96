package cuda

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"unsafe"
)

func TestErrorFormat(t *testing.T) {
	err := newError(nil, "cuMemAlloc_v2", ErrorOutOfMemory, 1073741824)
	want := "cuda: cuMemAlloc_v2(1073741824): CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
	if err.Error() != want {
		t.Errorf("got  %q\nwant %q", err.Error(), want)
	}
	// A nil driver (library not loaded) names codes from the built-in table.
	var d *driver
	err2 := d.err("cuMemcpyDtoD_v2", 700, DevicePtr(0x7f0000001000), DevicePtr(0x10), 64)
	want = "cuda: cuMemcpyDtoD_v2(0x7f0000001000, 0x10, 64): CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)"
	if err2.Error() != want {
		t.Errorf("got  %q\nwant %q", err2.Error(), want)
	}
	if got := newError(nil, "cuFoo", 12345).Error(); got != "cuda: cuFoo(): CUresult(12345)" {
		t.Errorf("unknown code: %q", got)
	}
	// The driver's own names win when it has them.
	namer := func(Result) (string, string) { return "CUDA_ERROR_X", "x happened" }
	if got := newError(namer, "cuBar", 2, "a").Error(); got != "cuda: cuBar(a): CUDA_ERROR_X (x happened)" {
		t.Errorf("namer: %q", got)
	}
	var e *Error
	if !errors.As(err2, &e) || e.Code != 700 || e.Call != "cuMemcpyDtoD_v2" {
		t.Errorf("errors.As: %#v", e)
	}
}

func TestCompileErrorFormat(t *testing.T) {
	var l *nvrtcLib // not loaded: names come from the table
	err := &CompileError{Name: "bad.cu", Err: l.err("nvrtcCompileProgram", 6, "bad.cu"),
		Log: "bad.cu(1): error: expected an expression\n\n1 error detected.\n"}
	want := "cuda: compile bad.cu: nvrtcCompileProgram(bad.cu): NVRTC_ERROR_COMPILATION\n" +
		"bad.cu(1): error: expected an expression\n\n1 error detected."
	if err.Error() != want {
		t.Errorf("got  %q\nwant %q", err.Error(), want)
	}
	var e *Error
	if !errors.As(err, &e) || e.Code != 6 {
		t.Errorf("errors.As: %v", e)
	}
}

func TestErrorIsNoDevice(t *testing.T) {
	for _, c := range []struct {
		call string
		r    Result
		want bool
	}{
		{"cuInit", ErrorNoDevice, true},
		{"cuInit", ErrorStubLibrary, true},
		{"cuInit", ErrorSystemDriverMismatch, true},
		{"cuMemAlloc_v2", ErrorOutOfMemory, false},
		{"cuLaunchKernel", 700, false},
		{"nvrtcCompileProgram", ErrorNoDevice, false}, // nvrtcResult 100 is not a CUresult
	} {
		if got := errors.Is(newError(nil, c.call, c.r), ErrNoDevice); got != c.want {
			t.Errorf("%s %d: errors.Is(ErrNoDevice) = %v", c.call, c.r, got)
		}
	}
}

func TestLibraryMissing(t *testing.T) {
	_, err := Open(Config{LibCUDA: "/nonexistent/libcuda.so.1"})
	if err == nil {
		t.Fatal("Open with a missing library succeeded")
	}
	if !errors.Is(err, ErrNoDevice) {
		t.Errorf("error does not match ErrNoDevice: %v", err)
	}
	if !strings.HasPrefix(err.Error(), "cuda: dlopen /nonexistent/libcuda.so.1: ") {
		t.Errorf("message: %q", err.Error())
	}
	t.Log(err)

	_, err = NewCompiler(Config{LibNVRTC: "/nonexistent/libnvrtc.so"}, "sm_90a")
	if err == nil || !strings.Contains(err.Error(), "dlopen /nonexistent/libnvrtc.so") {
		t.Errorf("NewCompiler with a missing library: %v", err)
	}
}

func TestConfigResolved(t *testing.T) {
	t.Setenv(EnvLibCUDA, "")
	t.Setenv(EnvLibNVRTC, "")
	t.Setenv(EnvIncludeDir, "")
	t.Setenv(EnvCacheDir, "")
	t.Setenv("XDG_CACHE_HOME", "/tmp/xdg")
	r, nv := Config{}.resolved()
	if r.LibCUDA != "libcuda.so.1" || r.IncludeDir != "/usr/local/cuda/include" ||
		r.CacheDir != "/tmp/xdg/rollout-worker/cubin" || !reflect.DeepEqual(nv, []string{"libnvrtc.so", "libnvrtc.so.13"}) {
		t.Errorf("defaults: %+v %v", r, nv)
	}
	t.Setenv(EnvLibCUDA, "/opt/a/libcuda.so.1")
	t.Setenv(EnvLibNVRTC, "/opt/a/libnvrtc.so.13")
	t.Setenv(EnvIncludeDir, "/opt/a/include")
	t.Setenv(EnvCacheDir, CacheOff)
	r, nv = Config{}.resolved()
	if r.LibCUDA != "/opt/a/libcuda.so.1" || r.IncludeDir != "/opt/a/include" || r.CacheDir != CacheOff ||
		!reflect.DeepEqual(nv, []string{"/opt/a/libnvrtc.so.13"}) {
		t.Errorf("environment: %+v %v", r, nv)
	}
	r, nv = Config{LibCUDA: "x", LibNVRTC: "y", IncludeDir: "z", CacheDir: "w", Ordinal: 3}.resolved()
	if r.LibCUDA != "x" || r.IncludeDir != "z" || r.CacheDir != "w" || r.Ordinal != 3 || !reflect.DeepEqual(nv, []string{"y"}) {
		t.Errorf("explicit fields must win: %+v %v", r, nv)
	}
}

func TestCompileOptions(t *testing.T) {
	got := CompileOptions("sm_90a", "/usr/local/cuda/include", "-lineinfo", "-DN=4")
	want := []string{"--gpu-architecture=sm_90a", "--std=c++17", "--ftz=false", "--prec-div=true",
		"--prec-sqrt=true", "-I/usr/local/cuda/include", "-lineinfo", "-DN=4"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got  %q\nwant %q", got, want)
	}
	for _, o := range got {
		if strings.Contains(o, "fast") {
			t.Errorf("fast math option %q", o)
		}
	}
	if got := CompileOptions("sm_80", ""); len(got) != 5 {
		t.Errorf("empty include dir must add no -I: %q", got)
	}
}

func TestArchFor(t *testing.T) {
	for _, c := range []struct {
		major, minor int
		want         string
	}{{9, 0, "sm_90a"}, {10, 0, "sm_100a"}, {8, 9, "sm_89"}, {8, 0, "sm_80"}} {
		if got := ArchFor(c.major, c.minor); got != c.want {
			t.Errorf("ArchFor(%d, %d) = %q, want %q", c.major, c.minor, got, c.want)
		}
	}
}

func TestCacheKey(t *testing.T) {
	opts := CompileOptions("sm_90a", "/usr/local/cuda/include")
	k := CacheKey("src", opts, "sm_90a", 13, 0)
	if len(k) != 64 {
		t.Fatalf("key %q", k)
	}
	if k2 := CacheKey("src", append([]string(nil), opts...), "sm_90a", 13, 0); k2 != k {
		t.Errorf("not deterministic: %s %s", k, k2)
	}
	seen := map[string]string{k: "base"}
	for name, k2 := range map[string]string{
		"source":  CacheKey("src ", opts, "sm_90a", 13, 0),
		"options": CacheKey("src", append(opts[:len(opts):len(opts)], "-lineinfo"), "sm_90a", 13, 0),
		"arch":    CacheKey("src", opts, "sm_100a", 13, 0),
		"major":   CacheKey("src", opts, "sm_90a", 12, 0),
		"minor":   CacheKey("src", opts, "sm_90a", 13, 1),
		// Boundaries between fields are unambiguous.
		"split1": CacheKey("c", []string{"a", "b"}, "x", 1, 0),
		"split2": CacheKey("c", []string{"ab"}, "x", 1, 0),
		"split3": CacheKey("bc", []string{"a"}, "x", 1, 0),
	} {
		if prev, dup := seen[k2]; dup {
			t.Errorf("changing %s gives the key of %s", name, prev)
		}
		seen[k2] = name
	}
}

func fakeCubin(n int) []byte {
	b := make([]byte, n)
	copy(b, "\x7fELF")
	for i := 4; i < n; i++ {
		b[i] = byte(i)
	}
	return b
}

func TestCacheRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "b") // created on first put
	key := CacheKey("src", nil, "sm_90a", 13, 0)
	if _, _, ok := cacheGet(dir, key, nil); ok {
		t.Fatal("hit in an empty cache")
	}
	want := fakeCubin(4096)
	if err := cachePut(dir, key, want, nil); err != nil {
		t.Fatal(err)
	}
	got, _, ok := cacheGet(dir, key, nil)
	if !ok || !reflect.DeepEqual(got, want) {
		t.Fatalf("read back %d bytes, ok=%v", len(got), ok)
	}
	if err := cachePut(dir, key, fakeCubin(100), nil); err != nil { // overwrite
		t.Fatal(err)
	}
	if got, _, _ := cacheGet(dir, key, nil); len(got) != 100 {
		t.Errorf("overwrite: %d bytes", len(got))
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 || ents[0].Name() != key+".cubin" {
		t.Errorf("cache dir holds %v, want only %s.cubin (no temporary files)", ents, key)
	}
	// Anything but an ELF image is a miss.
	if err := os.WriteFile(filepath.Join(dir, key+".cubin"), []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := cacheGet(dir, key, nil); ok {
		t.Error("a corrupt cache file was a hit")
	}
}

// TestCacheLoweredNames: a program's lowered names are cached beside its
// cubin; a cubin without them, or without one of the program's
// expressions, is a miss.
func TestCacheLoweredNames(t *testing.T) {
	dir := t.TempDir()
	p := Program{Name: "k.cu", Source: "src", Headers: []Header{{Name: "h.cuh", Source: "h"}}, NameExpressions: []string{"ns::k<1>"}}
	key := ProgramKey(p, nil, "sm_90a", 13, 0)
	if key == CacheKey(p.Source, nil, "sm_90a", 13, 0) {
		t.Fatal("headers and name expressions do not change the key")
	}
	other := p
	other.Headers = []Header{{Name: "h.cuh", Source: "h2"}}
	if ProgramKey(other, nil, "sm_90a", 13, 0) == key {
		t.Error("a header's content does not change the key")
	}
	if err := os.WriteFile(filepath.Join(dir, key+".cubin"), fakeCubin(64), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := cacheGet(dir, key, p.NameExpressions); ok {
		t.Error("a cubin without its names was a hit")
	}
	want := map[string]string{"ns::k<1>": "_ZN2ns1kILi1EEEvv"}
	if err := cachePut(dir, key, fakeCubin(64), want); err != nil {
		t.Fatal(err)
	}
	_, got, ok := cacheGet(dir, key, p.NameExpressions)
	if !ok || !reflect.DeepEqual(got, want) {
		t.Fatalf("names %v, ok=%v; want %v", got, ok, want)
	}
	if _, _, ok := cacheGet(dir, key, []string{"ns::k<1>", "ns::k<2>"}); ok {
		t.Error("a cache entry without one of the expressions was a hit")
	}
}

func TestPackArgs(t *testing.T) {
	raw := RawArg{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	st, offs, err := packArgs([]any{DevicePtr(0x1234), int32(-1), float32(1.5), raw, uint16(0x3f80), true, int64(-2)})
	if err != nil {
		t.Fatal(err)
	}
	if want := []int{0, 1, 2, 3, 5, 6, 7}; !reflect.DeepEqual(offs, want) {
		t.Fatalf("offsets %v, want %v", offs, want)
	}
	if st[0] != 0x1234 || st[1] != 0xffffffff || st[2] != uint64(math.Float32bits(1.5)) ||
		st[5] != 0x3f80 || st[6] != 1 || st[7] != math.MaxUint64-1 {
		t.Errorf("storage %#x", st)
	}
	rb := unsafe.Slice((*byte)(unsafe.Pointer(&st[3])), 16)
	if !reflect.DeepEqual([]byte(rb[:12]), []byte(raw)) || rb[12] != 0 {
		t.Errorf("raw %v", rb)
	}
	for _, bad := range []any{int(1), uint(1), "s", []float32{1}, RawArg{}} {
		if _, _, err := packArgs([]any{bad}); err == nil {
			t.Errorf("%T accepted", bad)
		}
	}
	if st, offs, err := packArgs(nil); err != nil || len(offs) != 0 || len(st) != 1 {
		t.Errorf("no args: %v %v %v", st, offs, err)
	}
}

func TestDim3(t *testing.T) {
	x, y, z, ok := Dim3{X: 7}.norm()
	if x != 7 || y != 1 || z != 1 || !ok {
		t.Errorf("Dim3{7}: %d %d %d %v", x, y, z, ok)
	}
	if _, _, _, ok := (Dim3{X: -1}).norm(); ok {
		t.Error("negative dimension accepted")
	}
}

// The owner loop, with a fake context: serialisation, panics, Close.
func TestDeviceLoop(t *testing.T) {
	if _, err := start(func() (*Ctx, error) { return nil, errors.New("init failed") }); err == nil || err.Error() != "init failed" {
		t.Fatalf("init error: %v", err)
	}
	d, err := start(func() (*Ctx, error) { return &Ctx{}, nil })
	if err != nil {
		t.Fatal(err)
	}
	counter := 0 // unsynchronised: only the owner touches it (go test -race checks)
	var wg sync.WaitGroup
	for i := 0; i < 64; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := d.Do(func(*Ctx) error { counter++; return nil }); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	var n int
	want := errors.New("fn error")
	if err := d.Do(func(*Ctx) error { n = counter; return want }); err != want {
		t.Errorf("Do returned %v, want fn's error", err)
	}
	if n != 64 {
		t.Errorf("counter %d", n)
	}
	if err := d.Do(func(*Ctx) error { panic("boom") }); err == nil || !strings.Contains(err.Error(), "panic in Device.Do: boom") {
		t.Errorf("panic: %v", err)
	}
	// Every call runs on the same locked OS thread.
	tids := map[int]bool{}
	for i := 0; i < 10; i++ {
		d.Do(func(*Ctx) error { tids[gettid()] = true; return nil })
	}
	if len(tids) != 1 {
		t.Errorf("Do ran on %d threads", len(tids))
	}
	// A Ctx used outside Do is refused before reaching the driver.
	var leaked *Ctx
	d.Do(func(c *Ctx) error { leaked = c; return nil })
	leaked.drv = &driver{} // pretend it is open; no symbol is ever called
	if _, err := leaked.Alloc(16); !errors.Is(err, ErrWrongThread) {
		t.Errorf("leaked Ctx: %v", err)
	}
	leaked.drv = nil
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := d.Do(func(*Ctx) error { return nil }); !errors.Is(err, ErrClosed) {
		t.Errorf("Do after Close: %v", err)
	}
}

// TestLaunchConfigLayout checks the Go mirrors of cuda.h's CUlaunchConfig
// (7 unsigned ints, a stream, an attribute pointer, a count: 56 bytes on
// 64-bit hosts) and CUlaunchAttribute (an id padded to 8 bytes and a
// 64-byte union) that cuLaunchKernelEx reads.
func TestLaunchConfigLayout(t *testing.T) {
	var cfg launchConfig
	var attr launchAttr
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof CUlaunchConfig", unsafe.Sizeof(cfg), 56},
		{"offsetof hStream", unsafe.Offsetof(cfg.stream), 32},
		{"offsetof attrs", unsafe.Offsetof(cfg.attrs), 40},
		{"offsetof numAttrs", unsafe.Offsetof(cfg.numAttrs), 48},
		{"sizeof CUlaunchAttribute", unsafe.Sizeof(attr), 72},
		{"offsetof value", unsafe.Offsetof(attr.value), 8},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
}
