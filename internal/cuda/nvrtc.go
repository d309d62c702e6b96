package cuda

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
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
	Name   string // file name used in diagnostics, e.g. "gemm.cu"; default "kernel.cu"
	Source string // kernels are found by name: extern "C", or by a name expression
	// Headers are the files the source may #include "name" besides those
	// under the include directory (nvrtcCreateProgram's headers and
	// includeNames). They are part of the cache key.
	Headers []Header
	// NameExpressions name the kernels to instantiate and find by their
	// lowered (mangled) names, e.g. "ns::kernel<ns::Tile<2>>"
	// (nvrtcAddNameExpression); Compiled.Lowered maps each to its name in
	// the cubin. They are part of the cache key, and the lowered names are
	// cached with the cubin.
	NameExpressions []string
	Options         []string // extra NVRTC options, appended after the defaults
}

// Header is a file a Program includes by name.
type Header struct {
	Name   string // as the source writes it in #include "name"
	Source string
}

// Compiled is the result of Compiler.Compile.
type Compiled struct {
	Cubin []byte // ELF image for Ctx.LoadModule
	// Lowered maps each of the program's name expressions to the kernel's
	// name in the cubin (for Module.Function).
	Lowered map[string]string
	Key     string        // cache key: hex sha256, see ProgramKey
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

// ProgramKey identifies the compilation of p with options: CacheKey of its
// source when it has no headers and no name expressions, else a sha256
// over that key, each header's name and content and each name expression,
// length-prefixed.
func ProgramKey(p Program, options []string, arch string, nvrtcMajor, nvrtcMinor int) string {
	base := CacheKey(p.Source, options, arch, nvrtcMajor, nvrtcMinor)
	if len(p.Headers) == 0 && len(p.NameExpressions) == 0 {
		return base
	}
	h := sha256.New()
	put := func(s string) {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	put("rollout-worker/program/v1")
	put(base)
	put(fmt.Sprint(len(p.Headers)))
	for _, hd := range p.Headers {
		put(hd.Name)
		put(hd.Source)
	}
	put(fmt.Sprint(len(p.NameExpressions)))
	for _, e := range p.NameExpressions {
		put(e)
	}
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
	key := ProgramKey(p, opts, c.arch, c.lib.major, c.lib.minor)
	if c.cacheDir != "" {
		if cubin, lowered, ok := cacheGet(c.cacheDir, key, p.NameExpressions); ok {
			return &Compiled{Cubin: cubin, Lowered: lowered, Key: key, Cached: true, Elapsed: time.Since(t0)}, nil
		}
	}
	cubin, lowered, log, err := c.lib.compile(p, opts)
	if err != nil {
		return nil, err
	}
	out := &Compiled{Cubin: cubin, Lowered: lowered, Key: key, Log: log}
	if c.cacheDir != "" {
		out.CacheErr = cachePut(c.cacheDir, key, cubin, lowered)
	}
	out.Elapsed = time.Since(t0)
	return out, nil
}

// compile runs one NVRTC compilation of p with opts.
func (l *nvrtcLib) compile(p Program, opts []string) (cubin []byte, lowered map[string]string, log string, err error) {
	name := p.Name
	// Every array below holds Go pointers that C reads: pin what they
	// point to for the whole compilation.
	var pin runtime.Pinner
	defer pin.Unpin()
	cstr := func(s string) *byte {
		b := cString(s)
		pin.Pin(&b[0])
		return &b[0]
	}
	src, cname := cstr(p.Source), cstr(name)
	var hdrs, incs uintptr
	if n := len(p.Headers); n > 0 {
		hs, is := make([]*byte, n), make([]*byte, n)
		for i, h := range p.Headers {
			hs[i], is[i] = cstr(h.Source), cstr(h.Name)
		}
		pin.Pin(&hs[0])
		pin.Pin(&is[0])
		hdrs, incs = uintptr(unsafe.Pointer(&hs[0])), uintptr(unsafe.Pointer(&is[0]))
	}
	var prog uintptr
	if r := ccall(l.nvrtcCreateProgram, uintptr(unsafe.Pointer(&prog)), uintptr(unsafe.Pointer(src)),
		uintptr(unsafe.Pointer(cname)), uintptr(len(p.Headers)), hdrs, incs); r != Success {
		return nil, nil, "", l.err("nvrtcCreateProgram", r, name)
	}
	defer func() { ccall(l.nvrtcDestroyProgram, uintptr(unsafe.Pointer(&prog))) }()
	for _, e := range p.NameExpressions {
		if r := ccall(l.nvrtcAddNameExpression, prog, uintptr(unsafe.Pointer(cstr(e)))); r != Success {
			return nil, nil, "", l.err("nvrtcAddNameExpression", r, name, e)
		}
	}
	copts := make([]*byte, len(opts)+1)
	for i, o := range opts {
		copts[i] = cstr(o)
	}
	pin.Pin(&copts[0])
	r := ccall(l.nvrtcCompileProgram, prog, uintptr(len(opts)), uintptr(unsafe.Pointer(&copts[0])))
	log, logErr := l.log(prog)
	if r != Success {
		return nil, nil, log, &CompileError{Name: name, Err: l.err("nvrtcCompileProgram", r, name), Log: log}
	}
	if logErr != nil {
		return nil, nil, "", logErr
	}
	if len(p.NameExpressions) > 0 {
		lowered = make(map[string]string, len(p.NameExpressions))
		for _, e := range p.NameExpressions {
			var low *byte
			if r := ccall(l.nvrtcGetLoweredName, prog, uintptr(unsafe.Pointer(cstr(e))), uintptr(unsafe.Pointer(&low))); r != Success {
				return nil, nil, log, l.err("nvrtcGetLoweredName", r, name, e)
			}
			lowered[e] = goString(low) // owned by the program: copied before it is destroyed
		}
	}
	var size uintptr
	if r := ccall(l.nvrtcGetCUBINSize, prog, uintptr(unsafe.Pointer(&size))); r != Success {
		return nil, nil, log, l.err("nvrtcGetCUBINSize", r, name)
	}
	if size == 0 {
		return nil, nil, log, fmt.Errorf("cuda: compile %s: NVRTC produced no cubin (is the arch a real sm_ target?)", name)
	}
	cubin = make([]byte, size)
	if r := ccall(l.nvrtcGetCUBIN, prog, uintptr(unsafe.Pointer(&cubin[0]))); r != Success {
		return nil, nil, log, l.err("nvrtcGetCUBIN", r, name)
	}
	return cubin, lowered, log, nil
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

// cacheGet reads dir/key.cubin and, for a program with name expressions,
// the lowered names in dir/key.names (JSON); anything but a readable ELF
// image with every expression's name is a miss.
func cacheGet(dir, key string, exprs []string) ([]byte, map[string]string, bool) {
	b, err := os.ReadFile(filepath.Join(dir, key+".cubin"))
	if err != nil || !isELF(b) {
		return nil, nil, false
	}
	if len(exprs) == 0 {
		return b, nil, true
	}
	nb, err := os.ReadFile(filepath.Join(dir, key+".names"))
	if err != nil {
		return nil, nil, false
	}
	var lowered map[string]string
	if json.Unmarshal(nb, &lowered) != nil {
		return nil, nil, false
	}
	for _, e := range exprs {
		if lowered[e] == "" {
			return nil, nil, false
		}
	}
	return b, lowered, true
}

// cachePut writes the lowered names (if any) to dir/key.names, then the
// cubin to dir/key.cubin, each atomically, so that a cubin in the cache
// always has its names.
func cachePut(dir, key string, cubin []byte, lowered map[string]string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("cuda: cubin cache: %w", err)
	}
	if len(lowered) > 0 {
		nb, err := json.Marshal(lowered)
		if err != nil {
			return fmt.Errorf("cuda: cubin cache: %w", err)
		}
		if err := writeAtomic(dir, key+".names", nb); err != nil {
			return err
		}
	}
	return writeAtomic(dir, key+".cubin", cubin)
}

// writeAtomic writes dir/name by a temporary file in dir, synced, then
// renamed over the final name, so readers see all or nothing.
func writeAtomic(dir, name string, data []byte) error {
	f, err := os.CreateTemp(dir, name+".*.tmp")
	if err != nil {
		return fmt.Errorf("cuda: cubin cache: %w", err)
	}
	_, werr := f.Write(data)
	serr := f.Sync()
	cerr := f.Close()
	if err := errors.Join(werr, serr, cerr); err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("cuda: cubin cache: %w", err)
	}
	if err := os.Rename(f.Name(), filepath.Join(dir, name)); err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("cuda: cubin cache: %w", err)
	}
	return nil
}
