package cuda

import (
	"embed"
	"fmt"
	"path"
	"regexp"
	"slices"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
)

//go:embed src/*.cuh src/*.cu
var sources embed.FS

// unitSpec is a compile unit: a .cu file of src/ that NVRTC compiles with
// the headers it includes.
type unitSpec struct {
	file    string
	minArch string // "": every target
	// perKernel: one NVRTC program per kernel variant, so that the unit's
	// variants compile in parallel (units whose kernels are all templates:
	// a program instantiates only the kernels its name expressions name).
	perKernel bool
}

// compileUnits lists the units in the order CompileAll starts their
// programs: the longest first, so that the last to finish starts early.
// The units of many kernels in one program (dispatch, model, generic) are
// each longer than one GEMM variant; then the GEMM variants, heaviest
// family first.
func compileUnits() []unitSpec {
	return []unitSpec{
		{file: "dispatch.cu"},
		{file: "model.cu"},
		{file: "attention.cu", perKernel: true},
		{file: "gemm_generic.cu"},
		{file: "gemm_ws.cu", minArch: archWGMMA, perKernel: true},
		{file: "gemm_stream.cu", perKernel: true},
		{file: "gemm_tile.cu", perKernel: true},
		{file: "gemm_dense.cu"},
		{file: "quantize.cu"},
	}
}

// errorsHeaderName is the header errorsHeader generates.
const errorsHeaderName = "errors.cuh"

// includes returns the names text includes with #include "name".
func includes(text string) []string {
	var names []string
	for _, m := range regexp.MustCompile(`(?m)^#include "([^"]+)"`).FindAllStringSubmatch(text, -1) {
		names = append(names, m[1])
	}
	return names
}

// headerText returns header name's content: errors.cuh from the error
// table, the others from src/.
func headerText(name string) (string, error) {
	if name == errorsHeaderName {
		return errorsHeader(), nil
	}
	b, err := sources.ReadFile(path.Join("src", name))
	if err != nil {
		return "", fmt.Errorf("cuda: kernel header %s: %w", name, err)
	}
	return string(b), nil
}

// unitHeaders returns the headers source includes, directly or through
// other headers, sorted by name.
func unitHeaders(source string) ([]drv.Header, error) {
	seen := map[string]bool{}
	var hs []drv.Header
	var walk func(text string) error
	walk = func(text string) error {
		for _, name := range includes(text) {
			if seen[name] {
				continue
			}
			seen[name] = true
			h, err := headerText(name)
			if err != nil {
				return err
			}
			hs = append(hs, drv.Header{Name: name, Source: h})
			if err := walk(h); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(source); err != nil {
		return nil, err
	}
	slices.SortFunc(hs, func(a, b drv.Header) int {
		if a.Name < b.Name {
			return -1
		}
		if a.Name > b.Name {
			return 1
		}
		return 0
	})
	return hs, nil
}

// program is an NVRTC program of the backend and the kernels it holds.
type program struct {
	prog    drv.Program
	label   string // unit, and the kernel for per-kernel programs
	kernels []*kernelSpec
}

// programs returns the NVRTC programs that build the registry's kernels for
// arch: per unit one program, or one per kernel variant; units (and
// kernels) that need another arch are left out.
func programs(arch string, reg []kernelSpec) ([]program, error) {
	var out []program
	for _, u := range compileUnits() {
		if u.minArch != "" && u.minArch != arch {
			continue
		}
		src, err := sources.ReadFile(path.Join("src", u.file))
		if err != nil {
			return nil, fmt.Errorf("cuda: kernel unit %s: %w", u.file, err)
		}
		hs, err := unitHeaders(string(src))
		if err != nil {
			return nil, err
		}
		var ks []*kernelSpec
		for i := range reg {
			if k := &reg[i]; k.unit == u.file && (k.minArch == "" || k.minArch == arch) {
				ks = append(ks, k)
			}
		}
		if len(ks) == 0 {
			return nil, fmt.Errorf("cuda: kernel unit %s: no kernel in the registry", u.file)
		}
		mk := func(label string, ks []*kernelSpec) program {
			p := program{label: label, kernels: ks,
				prog: drv.Program{Name: u.file, Source: string(src), Headers: hs}}
			for _, k := range ks {
				p.prog.NameExpressions = append(p.prog.NameExpressions, k.expr)
			}
			return p
		}
		if !u.perKernel {
			out = append(out, mk(u.file, ks))
			continue
		}
		for _, k := range ks {
			out = append(out, mk(u.file+":"+k.name, []*kernelSpec{k}))
		}
	}
	return out, nil
}

// Programs returns the NVRTC programs of every kernel the backend launches
// on arch (e.g. "sm_90a"), as New compiles them: for filling the cubin
// cache ahead of time (Warm) and for checking the sources without NVRTC
// (tools/cudasyntax).
func Programs(arch string) ([]drv.Program, error) {
	ps, err := programs(arch, kernelRegistry())
	if err != nil {
		return nil, err
	}
	out := make([]drv.Program, len(ps))
	for i, p := range ps {
		out[i] = p.prog
	}
	return out, nil
}
