package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"sync"
	"testing"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/kernels/cpu"
	"github.com/rollout-worker/rollout-worker/kernels/kernelstest"
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

func TestSourceEmbedded(t *testing.T) {
	src, err := Source()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"grouped_gemm(int *err", "__global__ void quant_rows(", "__global__ void permute("} {
		if !bytes.Contains([]byte(src), []byte(want)) {
			t.Errorf("kernel source lacks %q", want)
		}
	}
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
// in both its variants.
func TestConformanceTiled(t *testing.T) {
	be := gpu(t)
	defer func(tile, tile8 int) { be.fp4TileRows, be.fp4Tile8Rows = tile, tile8 }(be.fp4TileRows, be.fp4Tile8Rows)
	be.fp4TileRows = 0
	for _, w8 := range []bool{false, true} {
		t.Run(fmt.Sprintf("w8=%v", w8), func(t *testing.T) {
			be.fp4Tile8Rows = math.MaxInt32
			if w8 {
				be.fp4Tile8Rows = 0
			}
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
// backend, in both modes (per matrix, on every GPU path), with and without
// padding: bit for bit.
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
	// Per matrix, every GPU path: the three kernels and quant_stack.
	type path struct {
		groups int
		ahead  bool
	}
	defGroups, defAhead := be.quantGroups, be.quantAhead
	t.Cleanup(func() { be.quantGroups, be.quantAhead = defGroups, defAhead })
	for _, mode := range []kernels.QuantMode{kernels.PerRow, kernels.PerMatrix} {
		paths := []path{{defGroups, defAhead}}
		if mode == kernels.PerMatrix {
			paths = []path{{0, false}, {4, false}, {4, true}, {8, false}, {8, true}}
		}
		for _, p := range paths {
			be.quantGroups, be.quantAhead = p.groups, p.ahead
			name := "default"
			switch {
			case mode == kernels.PerMatrix && p.groups == 0:
				name = "three kernels"
			case mode == kernels.PerMatrix:
				name = fmt.Sprintf("quant_stack, %d groups, ahead %v", p.groups, p.ahead)
			}
			testQuantizeAll(t, be, ref, mode, name, src, vals, rows, k)
		}
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
