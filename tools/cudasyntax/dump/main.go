// Command dump writes the CUDA backend's compile units as NVRTC gets them
// into a directory, for tools/cudasyntax/check.sh: the headers under
// include/, each unit, and for each unit a file that includes it and takes
// the address of every kernel its programs name (the NVRTC name
// expressions), so that the host compiler instantiates every template
// kernel the backend launches.
//
// Usage: go run ./tools/cudasyntax/dump DIR
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/rollout-worker/rollout-worker/kernels/cuda"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: dump DIR")
		os.Exit(2)
	}
	if err := dump(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "dump:", err)
		os.Exit(1)
	}
}

func dump(dir string) error {
	// sm_90a: every unit, the wgmma one included.
	progs, err := cuda.Programs("sm_90a")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "include"), 0o755); err != nil {
		return err
	}
	exprs := map[string][]string{}
	var order []string
	for _, p := range progs {
		if _, ok := exprs[p.Name]; !ok {
			order = append(order, p.Name)
			if err := os.WriteFile(filepath.Join(dir, p.Name), []byte(p.Source), 0o644); err != nil {
				return err
			}
			for _, h := range p.Headers {
				if err := os.WriteFile(filepath.Join(dir, "include", h.Name), []byte(h.Source), 0o644); err != nil {
					return err
				}
			}
		}
		exprs[p.Name] = append(exprs[p.Name], p.NameExpressions...)
	}
	for _, unit := range order {
		var b strings.Builder
		fmt.Fprintf(&b, "#include %q\n", unit)
		for i, e := range exprs[unit] {
			fmt.Fprintf(&b, "static auto *const kernel%d = &%s;\n", i, e)
		}
		if err := os.WriteFile(filepath.Join(dir, unit+".inst.cpp"), []byte(b.String()), 0o644); err != nil {
			return err
		}
	}
	return nil
}
