package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/kernels/kernelstest"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/moe/moebench"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

// One backend serves the whole test binary: opening the device and loading
// the module once keeps the suite fast. Tests free what they allocate.
var (
	sharedOnce sync.Once
	shared     *Backend
	sharedErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if shared != nil {
		shared.Close()
	}
	os.Exit(code)
}

// gpu returns the shared backend, or skips the test when there is no GPU.
func gpu(t testing.TB) *Backend {
	t.Helper()
	sharedOnce.Do(func() { shared, sharedErr = New(Config{}, nil) })
	if errors.Is(sharedErr, drv.ErrNoDevice) {
		t.Skip("no CUDA device: " + sharedErr.Error())
	}
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return shared
}

// graphTime returns one launch's share of a graph that holds launches
// calls of run (run(i) for the i-th), replayed replays times after one
// untimed replay: kernel times without the host's enqueue.
func graphTime(t *testing.T, be *Backend, launches, replays int, run func(i int) error) time.Duration {
	t.Helper()
	if err := run(0); err != nil { // warm, and fail outside the capture
		t.Fatal(err)
	}
	if err := be.BeginCapture(); err != nil {
		t.Fatal(err)
	}
	for i := range launches {
		if err := run(i); err != nil {
			t.Fatal(err)
		}
	}
	g, err := be.EndCapture()
	if err != nil {
		t.Fatal(err)
	}
	defer g.Destroy()
	if err := g.Launch(); err != nil {
		t.Fatal(err)
	}
	dt, err := be.Time(replays, g.Launch)
	if err != nil {
		t.Fatal(err)
	}
	return dt / time.Duration(launches)
}

func TestNoDeviceError(t *testing.T) {
	_, err := New(Config{Driver: drv.Config{LibCUDA: "libcuda-does-not-exist.so"}}, nil)
	if !errors.Is(err, drv.ErrNoDevice) {
		t.Fatalf("New with a missing driver: %v, want ErrNoDevice", err)
	}
}

func TestConformance(t *testing.T) {
	gpu(t)
	kernelstest.Run(t, func(t *testing.T) kernels.Backend { return gpu(t) })
}

// TestConformanceTiled runs the suite with every NVFP4 grouped GEMM on the
// tiled kernel (by default it takes only batches of many rows per expert),
// in each of its variants: 16 warps, 8 warps, and warp-specialised on
// wgmma (128- and 192-row tiles) where the device has it.
func TestConformanceTiled(t *testing.T) {
	be := gpu(t)
	defer func(tile, tile8, ws, ws192 int) {
		be.fp4TileRows, be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows = tile, tile8, ws, ws192
	}(be.fp4TileRows, be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows)
	be.fp4TileRows = 0
	never := math.MaxInt32
	variants := []struct {
		name             string
		tile8, ws, ws192 int
	}{{"w16", never, never, never}, {"w8", 0, never, never}, {"ws", never, 0, never}, {"ws192", never, never, 0}}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			if (v.ws == 0 || v.ws192 == 0) && !be.hasWGMMA() {
				t.Skipf("no wgmma on %s (%s): gemm_fp4_ws needs sm_90a", be.info.Name, be.info.Arch)
			}
			be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows = v.tile8, v.ws, v.ws192
			kernelstest.Run(t, func(t *testing.T) kernels.Backend { return gpu(t) })
		})
	}
}

func TestForeign(t *testing.T) {
	be := gpu(t)
	other, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kernelstest.Foreign(t, be, other)
	kernelstest.Foreign(t, other, be)
}

func TestMoE(t *testing.T) {
	gpu(t)
	moetest.Run(t, func(t testing.TB) kernels.Backend { return gpu(t) })
}

// TestQuantizeAllBF16 quantizes every finite BF16 value, shuffled into rows
// of 272 (17 blocks, so blocks mix magnitudes), on the GPU and with the CPU
// backend, in both modes, with and without padding: bit for bit.
func TestQuantizeAllBF16(t *testing.T) {
	be := gpu(t)
	ref, err := cpu.New(cpu.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var vals []uint16
	for h := range 1 << 16 {
		if h&0x7f80 != 0x7f80 { // not Inf or NaN
			vals = append(vals, uint16(h))
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	r.Shuffle(len(vals), func(i, j int) { vals[i], vals[j] = vals[j], vals[i] })
	const k = 272
	rows := len(vals) / k
	vals = vals[:rows*k]
	// Some rows of tiny values only, where block scales underflow.
	for i := range 16 {
		for j := range k {
			vals[i*k+j] = uint16(r.IntN(0x0200)) | uint16(r.IntN(2))<<15
		}
	}
	src := kernels.Uint16Bytes(vals)
	for _, mode := range []kernels.QuantMode{kernels.PerRow, kernels.PerMatrix} {
		testQuantizeAll(t, be, ref, mode, "default", src, vals, rows, k)
	}
}

// testQuantizeAll quantizes vals (rows of k) on be and ref in mode, with
// kp = k and a padded kp, and compares the copies bit for bit.
func testQuantizeAll(t *testing.T, be, ref kernels.Backend, mode kernels.QuantMode, path string, src []byte, vals []uint16, rows, k int) {
	t.Helper()
	for _, kp := range []int{k, k + 48} {
		var outs [2][3][]byte
		for i, b := range []kernels.Backend{be, ref} {
			shape := []int{rows, k}
			lead := []int{rows}
			nscale := rows
			if mode == kernels.PerMatrix {
				shape = []int{rows / 41, 41, k} // 41 rows per matrix
				lead = []int{rows / 41, 41}
				nscale = rows / 41
			}
			n := 1
			for _, d := range shape {
				n *= d
			}
			s := moetest.Alloc(t, b, kernels.BF16, shape...)
			if err := b.Upload(s, 0, src[:2*n]); err != nil {
				t.Fatal(err)
			}
			q := kernels.NVFP4{
				Packed: moetest.Alloc(t, b, kernels.U8, append(lead, kp/2)...),
				Scales: moetest.Alloc(t, b, kernels.U8, append(lead, kp/16)...),
				Scale:  moetest.Alloc(t, b, kernels.F32, nscale),
			}
			if err := b.Quantize(kernels.QuantizeArgs{Src: s, Dst: q, Mode: mode}); err != nil {
				t.Fatal(err)
			}
			if err := b.Sync(); err != nil {
				t.Fatal(err)
			}
			for j, buf := range []*kernels.Buffer{q.Packed, q.Scales, q.Scale} {
				outs[i][j] = make([]byte, buf.Size())
				if err := b.Download(outs[i][j], buf, 0); err != nil {
					t.Fatal(err)
				}
			}
		}
		for j, name := range []string{"packed", "scales", "scale"} {
			if !bytes.Equal(outs[0][j], outs[1][j]) {
				i := 0
				for outs[0][j][i] == outs[1][j][i] {
					i++
				}
				t.Errorf("%s (%s) kp=%d: %s differ first at byte %d: gpu %#02x, cpu %#02x", mode, path, kp, name, i, outs[0][j][i], outs[1][j][i])
			}
		}
		t.Logf("%s (%s) kp=%d: %d values, packed/scales/scale equal to the CPU", mode, path, kp, len(vals))
	}
}

// TestPDLKernels checks, without a GPU, that every kernel the registry
// launches with programmatic stream serialization (pdl) touches no global
// memory before pdl_wait but for what no kernel of the chain writes: the
// plain kernels and dispatch_r begin with pdl_enter (after shared-memory
// declarations at most); the narrow dense GEMMs read only weights before
// it; the streamed GEMMs
// wait in g5_gemm before any of their pointer parameters is used and
// trigger in g5_tail after the chunk loop; and kernels without a wait are
// not marked.
func TestPDLKernels(t *testing.T) {
	unit := func(name string) string {
		t.Helper()
		b, err := sources.ReadFile("src/" + name)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	// first returns the first statement after from in src that is not a
	// shared-memory declaration.
	first := func(src, from string) string {
		t.Helper()
		i := strings.Index(src, from)
		if i < 0 {
			t.Fatalf("no %q in the kernel source", from)
		}
		rest := src[i+len(from):]
		rest = rest[strings.Index(rest, "{")+1:]
		for _, st := range strings.Split(rest, ";") {
			st = strings.Join(strings.Fields(st), " ")
			if !strings.HasPrefix(st, "__shared__") && !strings.HasPrefix(st, "extern __shared__") {
				return st
			}
		}
		return ""
	}
	reg := kernelRegistry()
	for i := range reg {
		k := &reg[i]
		_, streamed := k.key.(streamKernel)
		switch {
		case streamed:
			if !k.pdl {
				t.Errorf("%s: a streamed GEMM without pdl", k.name)
			}
		case k.pdl:
			entry := strings.TrimPrefix(k.expr, "rw::")
			if j := strings.Index(entry, "<"); j >= 0 {
				entry = entry[:j]
			}
			got := first(unit(k.unit), " "+entry+"(")
			if strings.HasPrefix(got, "gn_gemm<") {
				continue // the narrow dense GEMMs: gn_gemm waits, checked below
			}
			if got != "pdl_enter()" {
				t.Errorf("%s: begins with %q, not pdl_enter()", k.name, got)
			}
		}
	}
	// The narrow dense GEMMs load their weights before the wait: gn_gemm
	// reads no activation (ar), writes nothing (part, out) and adds nothing
	// before its first pdl_enter, and enters after its loop where a warp had
	// no slice. Comments are left out of the check.
	{
		src := regexp.MustCompile(`//[^\n]*`).ReplaceAllString(unit("gemm_dense.cu"), "")
		i := strings.Index(src, "__device__ __forceinline__ void gn_gemm(")
		if i < 0 {
			t.Fatal("no gn_gemm in gemm_dense.cu")
		}
		body := src[i:]
		body = body[:strings.Index(body, "\n}\n")]
		w := strings.Index(body, "pdl_enter();")
		if w < 0 {
			t.Fatal("gn_gemm never calls pdl_enter")
		}
		for _, use := range []string{"gn_ld8(ar", "part[", "out)", "mma16816("} {
			if strings.Contains(body[:w], use) {
				t.Errorf("gn_gemm uses %q before its pdl_enter", use)
			}
		}
		late, store := strings.Index(body, "if (!waited) pdl_enter();"), strings.Index(body, "part[")
		if late < 0 || late > store {
			t.Error("gn_gemm does not wait, before its stores, where a warp had no slice")
		}
	}
	for _, key := range []any{kGemmNarrow, kGemmNarrow8, kGemmNarrow8Short, kGemmNarrowWide, kQuantRows, kFinalize, dispatchKernel{1}, dispatchKernel{8},
		streamKernel{fp4: true, bm: 16, j: 1, ks2: true}, streamKernel{bm: 64, j: 2, swiglu: true}} {
		if k := specOf(t, reg, key); !k.pdl {
			t.Errorf("%s: pdl = false", k.name)
		}
	}
	for _, key := range []any{tileKernel{16, false, true}, wsKernel{128, false, false}, kRoute, routeKernel{8}, kPermute,
		kFinalizeScattered, kGroupedGemm, stagedKernel{64, false}} {
		if k := specOf(t, reg, key); k.pdl {
			t.Errorf("%s: pdl = true: it does not wait (pdl_wait)", k.name)
		}
	}
	// The streamed GEMMs: nothing before g5_gemm's wait names a pointer
	// parameter, and g5_tail triggers after its chunk loop.
	src := unit("gemm_stream.cu")
	body := func(from string) string {
		t.Helper()
		i := strings.Index(src, from)
		if i < 0 {
			t.Fatalf("no %q in the kernel source", from)
		}
		return src[i:]
	}
	g5 := body("__device__ __forceinline__ void g5_gemm(")
	g5 = g5[strings.Index(g5, "{")+1:]
	before, _, ok := strings.Cut(g5, "pdl_wait();")
	if !ok {
		t.Fatal("g5_gemm: no pdl_wait()")
	}
	for _, param := range []string{"err", "A", "aSF", "aScale", "gather", "W", "wSF", "wScale", "offsets", "out", "sacc", "stok", "swt", "sslots"} {
		if regexp.MustCompile(`\b` + param + `\b`).MatchString(before) {
			t.Errorf("g5_gemm: %s is used before pdl_wait()", param)
		}
	}
	tail := body("__device__ __forceinline__ void g5_tail(")
	tail = tail[:strings.Index(tail, "\n}\n")]
	if loop, trig := strings.LastIndex(tail, "chunk(c, u);"), strings.Index(tail, "pdl_trigger();"); loop < 0 || trig < loop {
		t.Errorf("g5_tail: pdl_trigger() at %d, not after the chunk loop (%d)", trig, loop)
	}
	// The stream kernels run nothing but stream_body.
	for _, entry := range []string{"gemm_stream(", "gemm_stream_ks2("} {
		if got := first(src, " "+entry); !strings.HasPrefix(got, "stream_body<T, ") && !strings.HasPrefix(got, "static_assert") {
			t.Errorf("%s: begins with %q, not stream_body", entry, got)
		}
	}
}

// specOf returns the registry's entry for key.
func specOf(t *testing.T, reg []kernelSpec, key any) *kernelSpec {
	t.Helper()
	for i := range reg {
		if reg[i].key == key {
			return &reg[i]
		}
	}
	t.Fatalf("no kernel %+v in the registry", key)
	return nil
}

// TestPDLSameBits runs an MoE layer (hidden 4096, so FC1 splits K over a
// cluster pair, intermediate 768, 32 experts, top-8) at 1, 8 and 40 tokens (dispatch in one kernel up to 32, the
// separate kernels above), both recipes and activations, with the MoE
// kernels launched after the ones before them have finished (pdl off) and
// allowed to start early (pdl on), eagerly and replayed from a captured
// graph: the outputs must be the same bits.
func TestPDLSameBits(t *testing.T) {
	be := gpu(t)
	defer func(p bool) { be.pdl = p }(be.pdl)
	for _, act := range []moe.Activation{moe.ReLU2, moe.SwiGLU} {
		for _, recipe := range []moe.Recipe{moe.RecipePerToken, moe.RecipeBF16} {
			cfg := moe.Config{Hidden: 4096, Intermediate: 768, Experts: 32, TopK: 8, Activation: act, Scoring: moe.Softmax,
				MaxTokens: 40, Recipe: recipe}
			w := moebench.RandomWeightsFast(cfg, 7)
			l := moetest.NewLayer(t, be, cfg, w)
			for _, T := range []int{1, 8, 40} {
				t.Run(fmt.Sprintf("%s_%s_T%d", act, recipe, T), func(t *testing.T) {
					x := moebench.RandomBF16(rand.New(rand.NewPCG(uint64(T), 9)), T*cfg.Hidden, 1)
					be.pdl = false
					ref := moetest.Forward(t, be, l, x)
					be.pdl = true
					if got := moetest.Forward(t, be, l, x); !bytes.Equal(got, ref) {
						t.Fatal("eager, pdl on: the output differs from pdl off")
					}
					in := moetest.Alloc(t, be, kernels.BF16, T, cfg.Hidden)
					out := moetest.Alloc(t, be, kernels.BF16, T, cfg.Hidden)
					if err := be.Upload(in, 0, x); err != nil {
						t.Fatal(err)
					}
					if err := be.BeginCapture(); err != nil {
						t.Fatal(err)
					}
					if err := l.Forward(out, in); err != nil {
						t.Fatal(err)
					}
					g, err := be.EndCapture()
					if err != nil {
						t.Fatal(err)
					}
					defer g.Destroy()
					for rep := range 3 {
						if err := be.Zero(out); err != nil {
							t.Fatal(err)
						}
						if err := g.Launch(); err != nil {
							t.Fatal(err)
						}
						got := make([]byte, out.Size())
						if err := be.Download(got, out, 0); err != nil {
							t.Fatal(err)
						}
						if !bytes.Equal(got, ref) {
							t.Fatalf("graph replay %d, pdl on: the output differs from pdl off", rep)
						}
					}
				})
			}
		}
	}
}

// TestProfileEager marks ops issued outside any capture (the refit
// commit's copies and requantizations): the device times come back.
func TestProfileEager(t *testing.T) {
	be := gpu(t)
	p, err := be.NewProfile()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	a, b := moetest.Alloc(t, be, kernels.BF16, 1<<22), moetest.Alloc(t, be, kernels.BF16, 1<<22)
	for _, g := range []string{"copy", "copy again"} {
		if err := p.Mark(g); err != nil {
			t.Fatal(err)
		}
		if err := kernels.CopyAll(be, []*kernels.Buffer{a, b}, []*kernels.Buffer{b, a}); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Mark("end"); err != nil {
		t.Fatal(err)
	}
	if err := be.Sync(); err != nil {
		t.Fatal(err)
	}
	groups, err := p.Groups()
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range []string{"copy", "copy again"} {
		if groups[g] <= 0 {
			t.Errorf("group %q: %v", g, groups[g])
		}
	}
	t.Logf("%v", groups)
}
