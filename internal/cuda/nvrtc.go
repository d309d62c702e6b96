package cuda

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"time"
	"unsafe"
)

// Program is CUDA C++ source to compile with NVRTC.
type Program struct {
	Name    string   // file name used in diagnostics, e.g. "gemm.cu"; default "kernel.cu"
	Source  string   // kernels must be extern "C" to be found by name
	Options []string // extra NVRTC options, appended after the defaults
}

// Compiled is the result of Compiler.Compile.
type Compiled struct {
	Cubin   []byte        // ELF image for Ctx.LoadModule
	Key     string        // cache key: hex sha256, see CacheKey
	Cached  bool          // read from the on-disk cache, not compiled
	Log     string        // NVRTC's log (warnings); empty on a cache hit
	Elapsed time.Duration // time spent compiling or reading the cache
	// CacheErr is a failure to write the cache (the compile itself worked).
	CacheErr error
}

// Compiler compiles CUDA C++ to cubins for one arch with NVRTC, caching
// the results on disk. It needs no device context and is safe for
// concurrent use.
type Compiler struct {
	lib      *nvrtcLib
	arch     string
	include  string
	cacheDir string // "" when off
}

// NewCompiler loads NVRTC as cfg says (LibNVRTC, IncludeDir, CacheDir, with
// the same environment defaults as Open) for target arch, e.g. "sm_90a".
// A Device's Compiler uses the device's arch.
func NewCompiler(cfg Config, arch string) (*Compiler, error) {
	cfg, nvrtc := cfg.resolved()
	return newCompiler(cfg, nvrtc, arch)
}

func newCompiler(cfg Config, nvrtc []string, arch string) (*Compiler, error) {
	lib, err := loadNVRTC(nvrtc)
	if err != nil {
		return nil, err
	}
	c := &Compiler{lib: lib, arch: arch, include: cfg.IncludeDir}
	if cfg.CacheDir != CacheOff {
		c.cacheDir = cfg.CacheDir
	}
	return c, nil
}

// Arch is the --gpu-architecture the compiler targets.
func (c *Compiler) Arch() string { return c.arch }

// Version is NVRTC's version (nvrtcVersion), e.g. 13, 0.
func (c *Compiler) Version() (major, minor int) { return c.lib.major, c.lib.minor }

// CacheDir is the cubin cache directory, "" when the cache is off.
func (c *Compiler) CacheDir() string { return c.cacheDir }

// Options returns the full option list for a program with extra options.
func (c *Compiler) Options(extra ...string) []string {
	return CompileOptions(c.arch, c.include, extra...)
}

// CompileOptions builds NVRTC's options: the target arch, C++17, the CUDA
// include directory (NVRTC searches none by itself; omitted when empty),
// IEEE-conformant float math (no --use_fast_math: results must match the
// CPU reference), then extra in order.
func CompileOptions(arch, includeDir string, extra ...string) []string {
	opts := []string{
		"--gpu-architecture=" + arch,
		"--std=c++17",
		"--ftz=false",
		"--prec-div=true",
		"--prec-sqrt=true",
	}
	if includeDir != "" {
		opts = append(opts, "-I"+includeDir)
	}
	return append(opts, extra...)
}

// CacheKey identifies a compilation: sha256 over NVRTC's version, the arch,
// the options and the source, each length-prefixed so no two different
// inputs share a key. Headers reached through -I are not hashed: the include
// directory's path is (in the options), and its content is assumed to change
// only with the CUDA version.
func CacheKey(source string, options []string, arch string, nvrtcMajor, nvrtcMinor int) string {
	h := sha256.New()
	put := func(s string) {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	put("rollout-worker/cubin/v1")
	put(fmt.Sprintf("nvrtc %d.%d", nvrtcMajor, nvrtcMinor))
	put(arch)
	put(fmt.Sprint(len(options)))
	for _, o := range options {
		put(o)
	}
	put(source)
	return hex.EncodeToString(h.Sum(nil))
}

// Compile returns the cubin for p, from the cache when an identical
// compilation was cached before, else compiled by NVRTC (and then cached).
// A compilation error is a *CompileError holding NVRTC's log.
func (c *Compiler) Compile(p Program) (*Compiled, error) {
	t0 := time.Now()
	if p.Name == "" {
		p.Name = "kernel.cu"
	}
	opts := c.Options(p.Options...)
	key := CacheKey(p.Source, opts, c.arch, c.lib.major, c.lib.minor)
	if c.cacheDir != "" {
		if cubin, ok := cacheGet(c.cacheDir, key); ok {
			return &Compiled{Cubin: cubin, Key: key, Cached: true, Elapsed: time.Since(t0)}, nil
		}
	}
	cubin, log, err := c.lib.compile(p.Name, p.Source, opts)
	if err != nil {
		return nil, err
	}
	out := &Compiled{Cubin: cubin, Key: key, Log: log}
	if c.cacheDir != "" {
		out.CacheErr = cachePut(c.cacheDir, key, cubin)
	}
	out.Elapsed = time.Since(t0)
	return out, nil
}

// compile runs one NVRTC compilation.
func (l *nvrtcLib) compile(name, source string, opts []string) (cubin []byte, log string, err error) {
	src, cname := cString(source), cString(name)
	var prog uintptr
	if r := ccall(l.nvrtcCreateProgram, uintptr(unsafe.Pointer(&prog)), uintptr(unsafe.Pointer(&src[0])),
		uintptr(unsafe.Pointer(&cname[0])), 0, 0, 0); r != Success {
		return nil, "", l.err("nvrtcCreateProgram", r, name)
	}
	defer func() { ccall(l.nvrtcDestroyProgram, uintptr(unsafe.Pointer(&prog))) }()

	// The option array holds Go pointers that C reads: pin what they point to.
	var pin runtime.Pinner
	defer pin.Unpin()
	copts := make([]*byte, len(opts)+1)
	for i, o := range opts {
		b := cString(o)
		pin.Pin(&b[0])
		copts[i] = &b[0]
	}
	pin.Pin(&copts[0])
	r := ccall(l.nvrtcCompileProgram, prog, uintptr(len(opts)), uintptr(unsafe.Pointer(&copts[0])))
	log, logErr := l.log(prog)
	if r != Success {
		return nil, log, &CompileError{Name: name, Err: l.err("nvrtcCompileProgram", r, name), Log: log}
	}
	if logErr != nil {
		return nil, "", logErr
	}
	var size uintptr
	if r := ccall(l.nvrtcGetCUBINSize, prog, uintptr(unsafe.Pointer(&size))); r != Success {
		return nil, log, l.err("nvrtcGetCUBINSize", r, name)
	}
	if size == 0 {
		return nil, log, fmt.Errorf("cuda: compile %s: NVRTC produced no cubin (is the arch a real sm_ target?)", name)
	}
	cubin = make([]byte, size)
	if r := ccall(l.nvrtcGetCUBIN, prog, uintptr(unsafe.Pointer(&cubin[0]))); r != Success {
		return nil, log, l.err("nvrtcGetCUBIN", r, name)
	}
	return cubin, log, nil
}

func (l *nvrtcLib) log(prog uintptr) (string, error) {
	var size uintptr
	if r := ccall(l.nvrtcGetProgramLogSize, prog, uintptr(unsafe.Pointer(&size))); r != Success {
		return "", l.err("nvrtcGetProgramLogSize", r)
	}
	if size <= 1 {
		return "", nil
	}
	buf := make([]byte, size)
	if r := ccall(l.nvrtcGetProgramLog, prog, uintptr(unsafe.Pointer(&buf[0]))); r != Success {
		return "", l.err("nvrtcGetProgramLog", r)
	}
	return goString(&buf[0]), nil
}

// cacheGet reads dir/key.cubin; anything but a readable ELF image is a miss.
func cacheGet(dir, key string) ([]byte, bool) {
	b, err := os.ReadFile(filepath.Join(dir, key+".cubin"))
	if err != nil || !isELF(b) {
		return nil, false
	}
	return b, true
}

// cachePut writes dir/key.cubin atomically: a temporary file in dir,
// synced, then renamed over the final name, so readers see all or nothing.
func cachePut(dir, key string, cubin []byte) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("cuda: cubin cache: %w", err)
	}
	f, err := os.CreateTemp(dir, key+".*.tmp")
	if err != nil {
		return fmt.Errorf("cuda: cubin cache: %w", err)
	}
	_, werr := f.Write(cubin)
	serr := f.Sync()
	cerr := f.Close()
	if err := errors.Join(werr, serr, cerr); err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("cuda: cubin cache: %w", err)
	}
	if err := os.Rename(f.Name(), filepath.Join(dir, key+".cubin")); err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("cuda: cubin cache: %w", err)
	}
	return nil
}
