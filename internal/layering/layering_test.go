package layering

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/deps.golden from the module's current imports")

const goldenFile = "testdata/deps.golden"

// natsPrefix is the module path prefix of every NATS package.
const natsPrefix = "github.com/nats-io/"

// layer is a set of packages, by pattern (see match).
type layer struct {
	name     string
	patterns []string
}

// layers lists the module's packages from the bottom up. A package may import
// packages of its own layer or of a layer below it, never of a layer above:
// policy -> moe -> kernels -> internal/cuda points one way. Every package of
// the module must be in exactly one layer.
var layers = []layer{
	{"internal libraries", []string{"internal/..."}},
	{"kernels", []string{"kernels/..."}},
	{"moe and cudagraph", []string{"moe/...", "cudagraph/..."}},
	{"policy", []string{"policy/..."}},
	{"refit and rollout", []string{"refit/...", "rollout/..."}},
	{"worker (the composition root)", []string{"worker/..."}},
	{"commands and tools", []string{"cmd/...", "tools/..."}},
}

// rule forbids the packages matching from to depend, directly or through
// other packages, on the packages matching forbid. Patterns are module
// relative ("kernels/..." is kernels and everything under it) except those
// under natsPrefix, which are full import paths.
type rule struct {
	name   string
	from   []string
	except []string // packages of from that the rule does not apply to
	forbid []string
}

// rules are the project's layering rules, asserted on their own so that
// regenerating the golden file cannot accept an import that breaks one.
var rules = []rule{
	{
		name:   "moe must not import policy",
		from:   []string{"moe/..."},
		forbid: []string{"policy/..."},
	},
	{
		name:   "kernels must not import moe or policy",
		from:   []string{"kernels/..."},
		forbid: []string{"moe/...", "policy/..."},
	},
	{
		name:   "internal/cuda imports nothing above it",
		from:   []string{"internal/cuda/..."},
		forbid: []string{"kernels/...", "moe/...", "cudagraph/...", "policy/...", "refit/...", "rollout/...", "worker/...", "cmd/..."},
	},
	{
		name:   "kernels knows nothing of NATS, policies or versions",
		from:   []string{"kernels/..."},
		forbid: []string{natsPrefix + "...", "internal/natsembed/...", "policy/...", "refit/...", "rollout/...", "worker/..."},
	},
	{
		name:   "only refit, rollout, internal/natsembed, worker and cmd/... may import NATS",
		from:   []string{"..."},
		except: []string{"refit/...", "rollout/...", "internal/natsembed/...", "worker/...", "cmd/..."},
		forbid: []string{natsPrefix + "..."},
	},
}

// graph is the module's import graph without test-only imports: module
// packages by their module-relative path ("." for the module's root
// package), NATS packages by their full import path.
type graph struct {
	edges map[string][]string // importer -> imports, sorted
}

// parseList reads the output of
//
//	go list -deps=false -f '{{.ImportPath}}{{range .Imports}} {{.}}{{end}}' ./...
//
// keeping the edges between the module's packages and those to NATS.
func parseList(module string, out []byte) (*graph, error) {
	rel := func(p string) (string, bool) {
		switch {
		case p == module:
			return ".", true
		case strings.HasPrefix(p, module+"/"):
			return strings.TrimPrefix(p, module+"/"), true
		}
		return p, false
	}
	g := &graph{edges: map[string][]string{}}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		from, ok := rel(fields[0])
		if !ok {
			return nil, fmt.Errorf("go list named %q, which is outside module %s", fields[0], module)
		}
		imps := []string{}
		for _, imp := range fields[1:] {
			if r, ok := rel(imp); ok {
				imps = append(imps, r)
			} else if strings.HasPrefix(imp, natsPrefix) {
				imps = append(imps, imp)
			}
		}
		slices.Sort(imps)
		g.edges[from] = slices.Compact(imps)
	}
	return g, nil
}

// packages returns the module's packages, sorted.
func (g *graph) packages() []string {
	var pkgs []string
	for p := range g.edges {
		pkgs = append(pkgs, p)
	}
	slices.Sort(pkgs)
	return pkgs
}

// render writes the graph in the golden file's format.
func (g *graph) render() []byte {
	var b bytes.Buffer
	b.WriteString("# The module's import graph, without test-only imports: first the imports\n")
	b.WriteString("# between its packages, then the packages that import NATS.\n")
	b.WriteString("# Regenerate with: go test ./internal/layering -update\n")
	b.WriteString("\n# package -> module package\n")
	for _, p := range g.packages() {
		for _, imp := range g.edges[p] {
			if !strings.HasPrefix(imp, natsPrefix) {
				fmt.Fprintf(&b, "%s -> %s\n", p, imp)
			}
		}
	}
	b.WriteString("\n# package -> NATS package\n")
	for _, p := range g.packages() {
		for _, imp := range g.edges[p] {
			if strings.HasPrefix(imp, natsPrefix) {
				fmt.Fprintf(&b, "%s -> %s\n", p, imp)
			}
		}
	}
	return b.Bytes()
}

// match reports whether pkg matches pattern: "a/..." matches a and every
// package under it, "..." matches every package, anything else only itself.
func match(pattern, pkg string) bool {
	if pattern == "..." {
		return true
	}
	if base, ok := strings.CutSuffix(pattern, "/..."); ok {
		return pkg == base || strings.HasPrefix(pkg, base+"/")
	}
	return pkg == pattern
}

func matchAny(patterns []string, pkg string) bool {
	return slices.ContainsFunc(patterns, func(p string) bool { return match(p, pkg) })
}

// layerOf returns the index in layers of pkg's layer, or -1.
func layerOf(pkg string) int {
	return slices.IndexFunc(layers, func(l layer) bool { return matchAny(l.patterns, pkg) })
}

// checkLayers returns one message per module package that is in no layer
// and per import that points up the layers.
func checkLayers(g *graph) []string {
	var bad []string
	for _, p := range g.packages() {
		from := layerOf(p)
		if from < 0 {
			bad = append(bad, fmt.Sprintf("package %s is in no layer: add it to layers in internal/layering/layering_test.go", p))
			continue
		}
		for _, imp := range g.edges[p] {
			if strings.HasPrefix(imp, natsPrefix) {
				continue
			}
			if to := layerOf(imp); to > from {
				bad = append(bad, fmt.Sprintf("%s (layer %q) imports %s (layer %q, above it): imports must point down the layers",
					p, layers[from].name, imp, layers[to].name))
			}
		}
	}
	return bad
}

// path returns the shortest chain of imports from pkg to a package matching
// one of patterns, or nil if there is none.
func (g *graph) path(pkg string, patterns []string) []string {
	prev := map[string]string{pkg: ""}
	queue := []string{pkg}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		for _, imp := range g.edges[p] {
			if _, seen := prev[imp]; seen {
				continue
			}
			prev[imp] = p
			if matchAny(patterns, imp) {
				chain := []string{imp}
				for q := p; q != ""; q = prev[q] {
					chain = append(chain, q)
				}
				slices.Reverse(chain)
				return chain
			}
			queue = append(queue, imp)
		}
	}
	return nil
}

// checkRules returns one message per package that breaks a rule, with the
// chain of imports that breaks it.
func checkRules(g *graph, rules []rule) []string {
	var bad []string
	for _, r := range rules {
		for _, p := range g.packages() {
			if !matchAny(r.from, p) || matchAny(r.except, p) {
				continue
			}
			if chain := g.path(p, r.forbid); chain != nil {
				bad = append(bad, fmt.Sprintf("%s: %s", r.name, strings.Join(chain, " -> ")))
			}
		}
	}
	return bad
}

// loadGraph lists the module's packages with the go command.
func loadGraph(t *testing.T) *graph {
	t.Helper()
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("the go command is not on PATH (%v): the import graph comes from go list", err)
	}
	// The graph of the linux/amd64 CGO_ENABLED=0 build the project ships,
	// whatever machine runs the test.
	env := append(os.Environ(), "GOOS=linux", "GOARCH=amd64", "CGO_ENABLED=0", "GOWORK=off")
	run := func(dir string, args ...string) []byte {
		t.Helper()
		cmd := exec.Command(goCmd, args...)
		cmd.Dir = dir
		cmd.Env = env
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, stderr.Bytes())
		}
		return out
	}
	var mod struct{ Path, Dir string }
	if err := json.Unmarshal(run(".", "list", "-m", "-json"), &mod); err != nil {
		t.Fatalf("go list -m -json: %v", err)
	}
	touchSources(t, mod.Dir)
	out := run(mod.Dir, "list", "-deps=false", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", "./...")
	g, err := parseList(mod.Path, out)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// touchSources stats every Go file of the module. The go command caches a
// passing test's result keyed by the files the test itself opened or
// stat'ed, not by those a child go command read; without this a cached pass
// would outlive an edit that changes the imports.
func touchSources(t *testing.T, root string) {
	t.Helper()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != root && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(name, ".go") {
			_, err = os.Stat(path)
		}
		return err
	})
	if err != nil {
		t.Fatalf("walking the module's sources: %v", err)
	}
}

func TestGolden(t *testing.T) {
	got := loadGraph(t).render()
	if *update {
		if err := os.WriteFile(goldenFile, got, 0o644); err != nil {
			t.Fatalf("writing %s: %v", goldenFile, err)
		}
		t.Logf("wrote %s", goldenFile)
		return
	}
	want, err := os.ReadFile(goldenFile)
	if err != nil {
		t.Fatalf("reading %s: %v (create it with: go test ./internal/layering -update)", goldenFile, err)
	}
	if d := diffLines(want, got); d != "" {
		t.Errorf("the import graph differs from %s (- in the golden file, + in the module now):\n%s"+
			"if the change is intended, regenerate it with: go test ./internal/layering -update", goldenFile, d)
	}
}

// diffLines lists the lines only in want (prefixed "-") and only in got
// ("+"), in got's and then want's order; "" if they hold the same lines.
func diffLines(want, got []byte) string {
	w := strings.Split(string(want), "\n")
	g := strings.Split(string(got), "\n")
	var b strings.Builder
	for _, l := range w {
		if !slices.Contains(g, l) {
			fmt.Fprintf(&b, "-%s\n", l)
		}
	}
	for _, l := range g {
		if !slices.Contains(w, l) {
			fmt.Fprintf(&b, "+%s\n", l)
		}
	}
	if b.Len() == 0 && !bytes.Equal(want, got) {
		return "(the same lines in another order or with other blank lines)\n"
	}
	return b.String()
}

func TestLayers(t *testing.T) {
	for _, msg := range checkLayers(loadGraph(t)) {
		t.Error(msg)
	}
}

func TestRules(t *testing.T) {
	for _, msg := range checkRules(loadGraph(t), rules) {
		t.Error(msg)
	}
}

// TestChecksCatchViolations runs the checks on made-up graphs, so a rule that
// stopped matching anything would be noticed.
func TestChecksCatchViolations(t *testing.T) {
	tests := []struct {
		name  string
		edges map[string][]string
		want  []string // substrings, one per expected message, in order
	}{
		{
			name:  "clean",
			edges: map[string][]string{"policy": {"moe"}, "moe": {"kernels"}, "kernels": {"internal/cuda"}, "internal/cuda": nil, "rollout": {natsPrefix + "nats.go", "policy"}},
		},
		{
			name:  "moe imports policy",
			edges: map[string][]string{"moe": {"policy"}, "policy": nil},
			want:  []string{`moe (layer "moe and cudagraph") imports policy`, "moe must not import policy: moe -> policy"},
		},
		{
			name:  "kernels imports moe through a subpackage",
			edges: map[string][]string{"kernels/cpu": {"moe/moebench"}, "moe/moebench": nil},
			want:  []string{"kernels/cpu (layer", "kernels must not import moe or policy: kernels/cpu -> moe/moebench"},
		},
		{
			name:  "internal/cuda imports kernels",
			edges: map[string][]string{"internal/cuda": {"kernels"}, "kernels": nil},
			want:  []string{"internal/cuda (layer", "internal/cuda imports nothing above it: internal/cuda -> kernels"},
		},
		{
			name:  "kernels reaches NATS through internal/natsembed",
			edges: map[string][]string{"kernels/cuda": {"internal/natsembed"}, "internal/natsembed": {natsPrefix + "nats-server/v2/server"}},
			want: []string{
				"kernels knows nothing of NATS, policies or versions: kernels/cuda -> internal/natsembed",
				"may import NATS: kernels/cuda -> internal/natsembed -> " + natsPrefix + "nats-server/v2/server",
			},
		},
		{
			name:  "kernels imports refit",
			edges: map[string][]string{"kernels": {"refit"}, "refit": nil},
			want:  []string{"kernels (layer", "kernels knows nothing of NATS, policies or versions: kernels -> refit"},
		},
		{
			name:  "policy imports NATS",
			edges: map[string][]string{"policy": {natsPrefix + "nats.go"}},
			want:  []string{"only refit, rollout, internal/natsembed, worker and cmd/... may import NATS: policy -> " + natsPrefix + "nats.go"},
		},
		{
			name:  "worker and cmd may import NATS and everything below",
			edges: map[string][]string{"worker": {natsPrefix + "nats.go", "policy", "refit", "rollout", "cudagraph"}, "cmd/rollout-worker": {"worker", natsPrefix + "nats.go/jetstream"}},
		},
		{
			name:  "a package in no layer",
			edges: map[string][]string{"scratch": nil},
			want:  []string{"package scratch is in no layer"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := &graph{edges: tt.edges}
			got := append(checkLayers(g), checkRules(g, rules)...)
			if len(got) != len(tt.want) {
				t.Fatalf("got %d messages, want %d:\n%s", len(got), len(tt.want), strings.Join(got, "\n"))
			}
			for i, w := range tt.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("message %d = %q, want it to contain %q", i, got[i], w)
				}
			}
		})
	}
}

func TestParseList(t *testing.T) {
	const module = "example.com/m"
	out := []byte(`example.com/m fmt
example.com/m/a example.com/m example.com/m/b github.com/nats-io/nats.go go.uber.org/zap
example.com/m/b
`)
	g, err := parseList(module, out)
	if err != nil {
		t.Fatalf("parseList: %v", err)
	}
	want := map[string][]string{".": {}, "a": {".", "b", natsPrefix + "nats.go"}, "b": {}}
	for p, w := range want {
		if got := g.edges[p]; !slices.Equal(got, w) {
			t.Errorf("imports of %s = %q, want %q", p, got, w)
		}
	}
	if len(g.edges) != len(want) {
		t.Errorf("packages = %q, want %d of them", g.packages(), len(want))
	}
	if _, err := parseList(module, []byte("example.org/other fmt\n")); err == nil {
		t.Error("parseList accepted a package outside the module")
	}
}
