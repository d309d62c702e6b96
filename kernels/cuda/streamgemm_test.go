package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

// TestStreamedGemm times the grouped GEMM kernels the host picks from
// (streamed, and for NVFP4 tiled) side by side on the expert shapes of the
// DeepSeek-V3 MoE layer (hidden 7168, intermediate 2048) and checks that
// each agrees with the streamed one. Each case spreads its rows over
// `touched` experts of 32 resident ones and rotates between 4 disjoint
// expert sets where 32 allow it, so the weights come from memory, not from
// the 60 MB L2. The bandwidth printed counts the weight and activation
// bytes read.
func TestStreamedGemm(t *testing.T) {
	be := gpu(t)
	if testing.Short() {
		t.Skip("-short: 3 GB of weights")
	}
	const E, H, I, iters = 32, 7168, 2048, 50
	r := rand.New(rand.NewPCG(31, 32))
	up := func(data []byte, dt kernels.DType, shape ...int) *kernels.Buffer {
		return uploaded(t, be, data, dt, shape...)
	}
	// Weights: a global scale a matrix; activations: one a row.
	randFP4 := func(mats, rows, k int) kernels.NVFP4 {
		if mats > 0 {
			return randNVFP4(t, be, r, []int{mats, rows}, k, mats)
		}
		return randNVFP4(t, be, r, []int{rows}, k, rows)
	}

	randBF16 := func(shape ...int) *kernels.Buffer {
		n := 1
		for _, d := range shape {
			n *= d
		}
		b := make([]byte, 2*n)
		for i := 0; i < n; i++ {
			v := uint16(0x3C00 | r.Uint32()&0x80FF) // +-(1..2) * 2^-7
			b[2*i], b[2*i+1] = byte(v), byte(v>>8)
		}
		return up(b, kernels.BF16, shape...)
	}
	fp4W := map[string]kernels.NVFP4{"fc1_relu2": randFP4(E, I, H), "fc1_swiglu": randFP4(E, 2*I, H), "fc2": randFP4(E, H, I)}
	bf16W := map[string]*kernels.Buffer{"fc1_relu2": randBF16(E, I, H), "fc2": randBF16(E, H, I)}
	defer func(tile, tile8, ws, ws192, j int) {
		be.fp4TileRows, be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows, be.streamJ = tile, tile8, ws, ws192, j
	}(be.fp4TileRows, be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows, be.streamJ)
	for _, c := range []struct {
		w             string
		act           kernels.Activation
		rows, touched int
	}{
		{"fc1_relu2", kernels.ReLU2, 1, 8}, {"fc2", kernels.Identity, 1, 8}, {"fc1_swiglu", kernels.SwiGLU, 1, 8},
		{"fc1_relu2", kernels.ReLU2, 2, 32}, {"fc2", kernels.Identity, 2, 32},
		{"fc1_relu2", kernels.ReLU2, 4, 32}, {"fc2", kernels.Identity, 4, 32},
		{"fc1_relu2", kernels.ReLU2, 16, 32}, {"fc2", kernels.Identity, 16, 32}, {"fc1_swiglu", kernels.SwiGLU, 16, 32},
		{"fc1_relu2", kernels.ReLU2, 24, 32}, {"fc2", kernels.Identity, 24, 32},
		{"fc1_relu2", kernels.ReLU2, 32, 32}, {"fc2", kernels.Identity, 32, 32},
		{"fc1_relu2", kernels.ReLU2, 64, 32}, {"fc2", kernels.Identity, 64, 32},
		{"fc1_relu2", kernels.ReLU2, 128, 32}, {"fc2", kernels.Identity, 128, 32}, {"fc1_swiglu", kernels.SwiGLU, 128, 32},
	} {
		for _, recipe := range []string{"nvfp4", "bf16"} {
			if recipe == "bf16" && bf16W[c.w] == nil {
				continue
			}
			t.Run(fmt.Sprintf("%s_%s_rows%d_experts%d", recipe, c.w, c.rows, c.touched), func(t *testing.T) {
				var W, A kernels.Operand
				var n, k int
				R := c.rows * c.touched
				bytesPer := 2.0
				if recipe == "nvfp4" {
					W.Q = fp4W[c.w]
					n, k = W.Q.Packed.Dim(1), 2*W.Q.Packed.Dim(2)
					A.Q = randFP4(0, R, k)
					bytesPer = 0.5 + 1.0/16
				} else {
					W.BF16 = bf16W[c.w]
					n, k = W.BF16.Dim(1), W.BF16.Dim(2)
					A.BF16 = randBF16(R, k)
				}
				outN := n
				if c.act == kernels.SwiGLU {
					outN = n / 2
				}
				sets := max(1, min(4, E/c.touched))
				var offs []*kernels.Buffer
				for s := range sets {
					o := make([]int32, E+1)
					for e := range E {
						o[e+1] = o[e]
						if e >= s*c.touched && e < (s+1)*c.touched {
							o[e+1] += int32(c.rows)
						}
					}
					offs = append(offs, up(kernels.Int32Bytes(o), kernels.I32, E+1))
				}
				run := func(out *kernels.Buffer, i int) error {
					return be.GroupedGemm(kernels.GroupedGemmArgs{A: A, W: W, Offsets: offs[i%sets], Act: c.act, Out: out})
				}
				bytesRead := float64(c.touched*n*k+R*k) * bytesPer
				// The variants: streamed (as picked, the reference the others
				// are checked against, and with one and two n8 tiles a warp
				// where it has 16-row tiles), tiled (NVFP4: 16 and 8 warps, and
				// warp-specialised on wgmma where the device has it).
				type variant struct {
					name     string
					tileRows int
					tile8    int
					ws       int
					ws192    int
					j        int
				}
				never := math.MaxInt32
				variants := []variant{{"streamed", never, 0, never, never, 0}}
				if c.rows <= 8 && c.act != kernels.SwiGLU {
					variants = append(variants, variant{"streamed_j1", never, 0, never, never, 1},
						variant{"streamed_j2", never, 0, never, never, 2})
				}
				if recipe == "nvfp4" {
					variants = append(variants, variant{"tiled", 0, never, never, never, 0}, variant{"tiled8", 0, 0, never, never, 0})
					if be.hasWGMMA() {
						variants = append(variants, variant{"tiledws", 0, 0, 0, never, 0}, variant{"tiledws192", 0, 0, 0, 0, 0})
					}
				}
				outs := make([][]byte, len(variants))
				times := make([]float64, len(variants))
				for p, v := range variants {
					be.fp4TileRows, be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows, be.streamJ = v.tileRows, v.tile8, v.ws, v.ws192, v.j
					out := moetest.Alloc(t, be, kernels.BF16, R, outN)
					i := 0
					d, err := be.Time(iters, func() error { i++; return run(out, i) })
					if err != nil {
						t.Fatal(err)
					}
					if err := run(out, 0); err != nil { // the checked output: expert set 0
						t.Fatal(err)
					}
					outs[p] = make([]byte, out.Size())
					if err := be.Download(outs[p], out, 0); err != nil {
						t.Fatal(err)
					}
					times[p] = d.Seconds()
				}
				line := fmt.Sprintf("%s %s rows/expert %d, %d experts, %dx%d:", recipe, c.w, c.rows, c.touched, n, k)
				for p, v := range variants {
					line += fmt.Sprintf(" %s %.1f us (%.2f TB/s)", v.name, times[p]*1e6, bytesRead/times[p]/1e12)
				}
				t.Log(line)
				val := func(b []byte, i int) float64 { return float64(bf16.ToFloat32(uint16(b[i]) | uint16(b[i+1])<<8)) }
				ref := outs[0]
				var maxAbs float64
				for i := 0; i < len(ref); i += 2 {
					maxAbs = max(maxAbs, math.Abs(val(ref, i)))
				}
				for p := 1; p < len(variants); p++ {
					for i := 0; i < len(ref); i += 2 {
						a, b := val(outs[p], i), val(ref, i)
						if math.Abs(a-b) > math.Ldexp(math.Abs(b), -7)+math.Ldexp(maxAbs, -12) || math.IsNaN(a) != math.IsNaN(b) {
							t.Fatalf("out[%d,%d]: %s %g, streamed %g (max %g)", i/2/outN, i/2%outN, variants[p].name, a, b, maxAbs)
						}
					}
				}
			})
		}
	}
}

// TestStreamSmemFits checks, without a GPU, that the shared memory of every
// streamed kernel and of the tiled one (the host's figure plus the kernel's
// static arrays) fits in the 227 KiB an sm_90 block may opt in to, so no
// tile shape can fail at launch on an H100 or H200, and that four NVFP4
// 16-row blocks fit in one SM.
func TestStreamSmemFits(t *testing.T) {
	// static: the largest static shared arrays ptxas reports for these
	// kernels (the tiled ones: 3104 bytes; the streamed NVFP4 ones 2592:
	// the scale table, the row sources, the schedule).
	const optin, static = 227 << 10, 3104
	for _, fp4 := range []bool{true, false} {
		for _, bm := range []int{16, 32, 64} {
			for _, j := range []int{1, 2, 4} {
				if j == 4 && !(fp4 && bm == 32) {
					continue // only the NVFP4 32-row kernels take four n8 tiles a warp
				}
				if got := streamSmem(fp4, bm, j) + static; got > optin {
					t.Errorf("fp4=%v, %d-row tile, %d n8 tiles a warp: %d bytes of shared memory, more than %d", fp4, bm, j, got, optin)
				}
			}
		}
	}
	if got := tileSmem + static; got > optin {
		t.Errorf("tiled kernel: %d bytes of shared memory, more than %d", got, optin)
	}
	// gemm_fp4_ws and gemm_fp4_ws192: ptxas reports 4096 bytes of static
	// arrays for both on sm_90a (the 1024-byte alignment of the dynamic
	// ring pads them).
	const staticWS = 4096
	if got := wsSmem + staticWS; got > optin {
		t.Errorf("warp-specialised tiled kernel: %d bytes of shared memory, more than %d", got, optin)
	}
	if got := wsSmem192 + staticWS; got > optin {
		t.Errorf("warp-specialised tiled kernel, 192 rows: %d bytes of shared memory, more than %d", got, optin)
	}
	// NVFP4 16-row tiles keep a shorter ring so that four blocks fit in
	// an SM's 228 KiB (each block also takes 1 KiB the driver reserves;
	// ptxas reports 2592 bytes of static arrays).
	const perSM, reserved, static16 = 228 << 10, 1 << 10, 2592
	if got := 4 * (streamSmem(true, 16, 2) + static16 + reserved); got > perSM {
		t.Errorf("NVFP4 16-row tile: four blocks take %d bytes of shared memory, more than an SM's %d", got, perSM)
	}
	// The NVFP4 32-row kernels with four n8 tiles a warp: two blocks an SM
	// (g5_minb, src/gemm_stream.cu).
	if got := 2 * (streamSmem(true, 32, 4) + static16 + reserved); got > perSM {
		t.Errorf("NVFP4 32-row tile, four n8 tiles a warp: two blocks take %d bytes of shared memory, more than an SM's %d", got, perSM)
	}
	// The NVFP4 8-row kernels with the most chunks they stage: three
	// blocks an SM (g5_minb).
	if got := 3 * (streamM8Smem(2, streamM8Chunks) + static16 + reserved); got > perSM {
		t.Errorf("NVFP4 8-row tile, %d chunks staged: three blocks take %d bytes of shared memory, more than an SM's %d", streamM8Chunks, got, perSM)
	}
}

// TestGroupedGemmInvariance checks batch invariance across the NVFP4
// kernels the host picks by batch: each expert's first sorted row gathers
// the same activation row in a batch of 1 row per expert (streamed, 16-row
// tiles), 12 and 20 (streamed, 32-row tiles of four n8 tiles a warp, one
// or both m16 tiles), 80 (streamed, 64-row tiles) and 160 (tiled, two 128-row tiles,
// the second partial, with 16 and with 8 warps, and on sm_90a warp-specialised
// on wgmma), and with the tiled kernels forced at 1 row per expert; its
// output must not change by a bit. K 2048 (FC2's at the DeepSeek-V3 layer
// shapes) and 4096 take the warp-specialised tiles' cp.async path (K a
// multiple of 128), without and with the K split; the others their
// register path.
// K 2048, 2096 and 2112 run in one block, 4096, 7200 and 7232 split over a cluster
// (splitK); all but 2048 and 4096 end in a partial chunk. 2096 and 7200 (K not a
// multiple of 64) read the weights' block scales from global memory where
// they are used, 2112 and 7232 copy them with the codes, the last chunk's
// partly zero-filled; squared ReLU and SwiGLU.
func TestGroupedGemmInvariance(t *testing.T) {
	be := gpu(t)
	defer func(tile, tile8, ws, ws192, j, m8 int) {
		be.fp4TileRows, be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows, be.streamJ, be.streamM8Rows = tile, tile8, ws, ws192, j, m8
	}(be.fp4TileRows, be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows, be.streamJ, be.streamM8Rows)
	r := rand.New(rand.NewPCG(51, 52))
	const E, N = 4, 256
	// 2096: rows of half 16-byte units; 8256: a block's half of K (33
	// chunks) is past G5_ROWCH (32), so one row per expert takes the
	// 8-row staging instead of the ROW path (src/gemm_stream.cu g5_gemm).
	for _, K := range []int{2048, 2048 + 48, 2048 + 64, 4096, 7168 + 32, 7168 + 64, 8192 + 64} {
		if splitK(K) != (K >= 4096) {
			t.Fatalf("K %d: splitK %v, the cases assume a split from 4096", K, splitK(K))
		}
		bytesOf := func(n int, f func() byte) []byte {
			b := make([]byte, n)
			for i := range b {
				b[i] = f()
			}
			return b
		}
		up := func(data []byte, dt kernels.DType, shape ...int) *kernels.Buffer {
			return uploaded(t, be, data, dt, shape...)
		}
		scale := func() byte { return byte(0x28 + r.IntN(0x20)) }
		code := func() byte { return byte(r.Uint32()) }
		const Ta = 96
		W := kernels.Operand{Q: kernels.NVFP4{Packed: up(bytesOf(E*N*K/2, code), kernels.U8, E, N, K/2),
			Scales: up(bytesOf(E*N*K/16, scale), kernels.U8, E, N, K/16), Scale: up(kernels.Float32Bytes([]float32{1, 0.5, 2, 0.25}), kernels.F32, E)}}
		ascale := make([]float32, Ta)
		for i := range ascale {
			ascale[i] = 1 / float32(1+i%7)
		}
		A := kernels.Operand{Q: kernels.NVFP4{Packed: up(bytesOf(Ta*K/2, code), kernels.U8, Ta, K/2),
			Scales: up(bytesOf(Ta*K/16, scale), kernels.U8, Ta, K/16), Scale: up(kernels.Float32Bytes(ascale), kernels.F32, Ta)}}
		for _, act := range []kernels.Activation{kernels.ReLU2, kernels.SwiGLU} {
			outN := N
			if act == kernels.SwiGLU {
				outN = N / 2
			}
			run := func(perExpert, tileRows, tile8Rows, wsRows, ws192Rows, j, m8 int) [][]byte {
				be.fp4TileRows, be.fp4Tile8Rows, be.fp4WSRows, be.fp4WS192Rows, be.streamJ, be.streamM8Rows = tileRows, tile8Rows, wsRows, ws192Rows, j, m8
				R := E * perExpert
				offs, gather := make([]int32, E+1), make([]int32, R)
				for e := range E {
					offs[e+1] = offs[e] + int32(perExpert)
					for j := range perExpert {
						gather[e*perExpert+j] = int32((e*7 + j*13) % Ta) // row e*7 first
					}
				}
				out := moetest.Alloc(t, be, kernels.BF16, R, outN)
				if err := be.GroupedGemm(kernels.GroupedGemmArgs{A: A, Gather: up(kernels.Int32Bytes(gather), kernels.I32, R), W: W,
					Offsets: up(kernels.Int32Bytes(offs), kernels.I32, E+1), Act: act, Out: out}); err != nil {
					t.Fatal(err)
				}
				got := make([]byte, out.Size())
				if err := be.Download(got, out, 0); err != nil {
					t.Fatal(err)
				}
				rows := make([][]byte, E)
				for e := range E {
					rows[e] = got[e*perExpert*outN*2:][:outN*2]
				}
				return rows
			}
			never := math.MaxInt32
			alone := run(1, never, 0, never, never, 0, 0)
			type kase struct {
				name                                     string
				perExpert, tile, tile8, ws, ws192, j, m8 int
			}
			cases := []kase{
				// 8-row tiles (two n8 tiles a warp forced: E = 4 launches few
				// blocks) where a block's K range fits streamM8Chunks: K 2048,
				// 2096, 2112 and 4096 (split).
				{"streamed 8-row tiles, 1 row per expert", 1, never, 0, never, never, 2, 8},
				{"streamed 8-row tiles, 5 rows per expert", 5, never, 0, never, never, 2, 8},
				{"streamed 8-row tiles, 12 rows per expert (two tiles)", 12, never, 0, never, never, 2, 16},
				// 1 row per expert: j = 1 by the launch's size (8 or 16 blocks), or forced.
				{"streamed with two n8 tiles a warp, 1 row per expert", 1, never, 0, never, never, 2, 0},
				{"streamed with one n8 tile a warp, 1 row per expert", 1, never, 0, never, never, 1, 0},
				{"streamed, 3 rows per expert (8-row staging)", 3, never, 0, never, never, 0, 0},
				{"streamed, 12 rows per expert (32-row tiles, four n8 tiles a warp, one m16 tile)", 12, never, 0, never, never, 0, 0},
				{"streamed, 20 rows per expert (32-row tiles, four n8 tiles a warp)", 20, never, 0, never, never, 0, 0},
				{"streamed, 80 rows per expert", 80, never, 0, never, never, 0, 0},
				{"tiled with 16 warps, 160 rows per expert", 160, defaultTileRows, never, never, never, 0, 0},
				{"tiled, 1 row per expert", 1, 0, never, never, never, 0, 0}, // 0: every batch tiled
				{"tiled with 8 warps, 160 rows per expert", 160, defaultTileRows, defaultTile8Rows, never, never, 0, 0},
			}
			if be.hasWGMMA() {
				cases = append(cases,
					kase{"warp-specialised wgmma tile, 160 rows per expert (two tiles)", 160, defaultTileRows, defaultTile8Rows, defaultWSRows, never, 0, 0},
					kase{"warp-specialised wgmma tile, 1 row per expert", 1, 0, 0, 0, never, 0, 0},
					kase{"warp-specialised wgmma 192-row tile, 160 rows per expert", 160, defaultTileRows, defaultTile8Rows, defaultWSRows, defaultWS192Rows, 0, 0},
					kase{"warp-specialised wgmma 192-row tile, 1 row per expert", 1, 0, 0, 0, 0, 0, 0})
			}
			for _, c := range cases {
				if c.tile == defaultTileRows && c.perExpert <= defaultTileRows || c.tile8 == defaultTile8Rows && c.perExpert <= defaultTile8Rows ||
					c.ws == defaultWSRows && c.perExpert <= defaultWSRows || c.ws192 == defaultWS192Rows && c.perExpert <= defaultWS192Rows {
					t.Fatalf("%s: at or below the default thresholds (%d, %d, %d, %d): not the kernel named", c.name, defaultTileRows,
						defaultTile8Rows, defaultWSRows, defaultWS192Rows)
				}
				got := run(c.perExpert, c.tile, c.tile8, c.ws, c.ws192, c.j, c.m8)
				for e := range E {
					if string(alone[e]) != string(got[e]) {
						t.Errorf("K %d, %v, expert %d: the row's output differs between 1 row per expert (streamed) and %s", K, act, e, c.name)
					}
				}
			}
		}
	}
}

// TestStreamPlan checks, without a GPU, which streamed kernel and grid the
// host picks at the DeepSeek-V3 MoE layer shapes (hidden 7168,
// intermediate 2048, 256 experts, top-8) on an H200's 132 SMs: one n8 tile
// a warp (_j1) only for the one-token layer's non-SwiGLU GEMMs, 8-row
// tiles where asked for and a block's K range fits, and that every kernel
// it names is in the registry.
func TestStreamPlan(t *testing.T) {
	reg := kernelRegistry()
	const H, I, E, K, sms = 7168, 2048, 256, 8, 132
	fc1 := func(T, outN int) kernels.GroupedGemmShape {
		return kernels.GroupedGemmShape{R: T * K, E: E, N: I, K: H, Kp: H, OutN: outN}
	}
	fc2 := func(T int) kernels.GroupedGemmShape {
		return kernels.GroupedGemmShape{R: T * K, E: E, N: H, K: I, Kp: I, OutN: H}
	}
	for _, c := range []struct {
		name  string
		fp4   bool
		act   kernels.Activation
		s     kernels.GroupedGemmShape
		j     int
		kern  string
		grid  drv.Dim3
		fewer bool // less shared memory than the kernel with two n8 tiles a warp
		m8    int  // average rows per expert up to which 8-row tiles are asked for
	}{
		{"1 token NVFP4 FC1", true, kernels.ReLU2, fc1(1, I), 0, "gemm_fp4_stream_m16_ks2_j1", drv.Dim3{X: 8, Y: 32, Z: 2}, true, 0},
		{"1 token NVFP4 FC2", true, kernels.Identity, fc2(1), 0, "gemm_fp4_stream_m16_j1", drv.Dim3{X: 8, Y: 112, Z: 1}, true, 0},
		{"1 token BF16 FC1", false, kernels.ReLU2, fc1(1, I), 0, "gemm_bf16_stream_m16_j1", drv.Dim3{X: 8, Y: 32, Z: 1}, true, 0},
		{"1 token BF16 FC2", false, kernels.Identity, fc2(1), 0, "gemm_bf16_stream_m16_j1", drv.Dim3{X: 8, Y: 112, Z: 1}, true, 0},
		{"1 token NVFP4 FC1 SwiGLU", true, kernels.SwiGLU, fc1(1, I), 0, "gemm_fp4_stream_m16_swiglu_ks2", drv.Dim3{X: 8, Y: 32, Z: 2}, false, 0},
		{"1 token NVFP4 FC1, two tiles forced", true, kernels.ReLU2, fc1(1, I), 2, "gemm_fp4_stream_m16_ks2", drv.Dim3{X: 8, Y: 16, Z: 2}, false, 0},
		{"8 tokens NVFP4 FC1", true, kernels.ReLU2, fc1(8, I), 0, "gemm_fp4_stream_m16_ks2", drv.Dim3{X: 68, Y: 16, Z: 2}, false, 0},
		{"8 tokens BF16 FC1", false, kernels.ReLU2, fc1(8, I), 0, "gemm_bf16_stream_m16", drv.Dim3{X: 68, Y: 16, Z: 1}, false, 0},
		{"8 tokens NVFP4 FC2, one tile forced", true, kernels.Identity, fc2(8), 1, "gemm_fp4_stream_m16_j1", drv.Dim3{X: 68, Y: 112, Z: 1}, true, 0},
		{"512 tokens NVFP4 FC1", true, kernels.ReLU2, fc1(512, I), 0, "gemm_fp4_stream_m32_ks2_j4", drv.Dim3{X: 384, Y: 8, Z: 2}, false, 0},
		{"512 tokens NVFP4 FC1 SwiGLU", true, kernels.SwiGLU, fc1(512, I), 0, "gemm_fp4_stream_m32_swiglu_ks2_j4", drv.Dim3{X: 384, Y: 16, Z: 2}, false, 0},
		{"512 tokens NVFP4 FC2", true, kernels.Identity, fc2(512), 0, "gemm_fp4_stream_m32_j4", drv.Dim3{X: 384, Y: 28, Z: 1}, false, 0},
		{"512 tokens BF16 FC2", false, kernels.Identity, fc2(512), 0, "gemm_bf16_stream_m32", drv.Dim3{X: 384, Y: 56, Z: 1}, false, 0},
		{"8 tokens NVFP4 FC2, 8-row tiles", true, kernels.Identity, fc2(8), 0, "gemm_fp4_stream_m8", drv.Dim3{X: 72, Y: 56, Z: 1}, false, 4},
		{"8 tokens NVFP4 FC1 SwiGLU, K range too long for 8-row tiles", true, kernels.SwiGLU, fc1(8, I), 0, "gemm_fp4_stream_m16_swiglu_ks2", drv.Dim3{X: 68, Y: 32, Z: 2}, false, 4},
		{"1 token NVFP4 FC2, few blocks: one n8 tile a warp", true, kernels.Identity, fc2(1), 0, "gemm_fp4_stream_m16_j1", drv.Dim3{X: 8, Y: 112, Z: 1}, true, 4},
		{"64 tokens NVFP4 FC2, above the 8-row tiles' rows", true, kernels.Identity, fc2(64), 0, "gemm_fp4_stream_m16", drv.Dim3{X: 288, Y: 56, Z: 1}, false, 1},
		{"Qwen3-30B-A3B, 64 tokens NVFP4 FC1 SwiGLU, 8-row tiles", true, kernels.SwiGLU, kernels.GroupedGemmShape{R: 512, E: 128, N: 1536, K: 2048, Kp: 2048, OutN: 768},
			0, "gemm_fp4_stream_m8_swiglu", drv.Dim3{X: 192, Y: 12, Z: 1}, false, 4},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := streamPlan(c.fp4, c.act, c.s, sms, c.j, c.m8)
			k := specOf(t, reg, p.kernel)
			if k.name != c.kern || p.grid != c.grid {
				t.Errorf("%s grid %+v, want %s grid %+v", k.name, p.grid, c.kern, c.grid)
			}
			if err := k.check(archWGMMA, p.grid, drv.Dim3{X: 256}, p.smem, 227<<10); err != nil {
				t.Error(err)
			}
			two := streamPlan(c.fp4, c.act, c.s, sms, 2, c.m8)
			if got := p.smem < two.smem; got != c.fewer {
				t.Errorf("shared memory %d, with two tiles a warp %d: less = %v, want %v", p.smem, two.smem, got, c.fewer)
			}
		})
	}
}

// TestTilePlan checks, without a GPU, which tiled NVFP4 kernel and grid
// the host picks: on sm_90a (the default thresholds) the warp-specialised
// kernel above 48 rows per expert, with 192-row tiles above 104, elsewhere
// (no wgmma) the 8-warp tile above 96 and 16 warps below.
func TestTilePlan(t *testing.T) {
	reg := kernelRegistry()
	const H, I, E, K = 7168, 2048, 256, 8
	fc1 := func(T, n, outN int) kernels.GroupedGemmShape {
		return kernels.GroupedGemmShape{R: T * K, E: E, N: n, K: H, Kp: H, OutN: outN}
	}
	fc2 := func(T int) kernels.GroupedGemmShape {
		return kernels.GroupedGemmShape{R: T * K, E: E, N: H, K: I, Kp: I, OutN: H}
	}
	never := math.MaxInt32
	for _, c := range []struct {
		name    string
		act     kernels.Activation
		s       kernels.GroupedGemmShape
		wsRows  int
		ws192   int
		kern    string
		grid    drv.Dim3
		threads int
		smem    int
	}{
		{"4096 tokens FC1, sm_90a", kernels.ReLU2, fc1(4096, I, I), defaultWSRows, defaultWS192Rows, "gemm_fp4_ws192_ks2", drv.Dim3{X: 426, Y: 16, Z: 2}, 640, wsSmem192},
		{"4096 tokens FC1 SwiGLU, sm_90a", kernels.SwiGLU, fc1(4096, 2*I, I), defaultWSRows, defaultWS192Rows, "gemm_fp4_ws192_swiglu_ks2", drv.Dim3{X: 426, Y: 32, Z: 2}, 640, wsSmem192},
		{"4096 tokens FC2, sm_90a", kernels.Identity, fc2(4096), defaultWSRows, defaultWS192Rows, "gemm_fp4_ws192", drv.Dim3{X: 426, Y: 56, Z: 1}, 640, wsSmem192},
		{"4096 tokens FC2, 128-row tiles", kernels.Identity, fc2(4096), defaultWSRows, never, "gemm_fp4_ws", drv.Dim3{X: 512, Y: 56, Z: 1}, 512, wsSmem},
		{"4096 tokens FC1 SwiGLU, 128-row tiles", kernels.SwiGLU, fc1(4096, 2*I, I), defaultWSRows, never, "gemm_fp4_ws_swiglu_ks2", drv.Dim3{X: 512, Y: 32, Z: 2}, 512, wsSmem},
		{"3584 tokens FC2, sm_90a (112 rows per expert)", kernels.Identity, fc2(3584), defaultWSRows, defaultWS192Rows, "gemm_fp4_ws192", drv.Dim3{X: 149 + 256, Y: 56, Z: 1}, 640, wsSmem192},
		{"3328 tokens FC2, sm_90a (104 rows per expert)", kernels.Identity, fc2(3328), defaultWSRows, defaultWS192Rows, "gemm_fp4_ws", drv.Dim3{X: 208 + 256, Y: 56, Z: 1}, 512, wsSmem},
		{"2048 tokens FC2, sm_90a (64 rows per expert)", kernels.Identity, fc2(2048), defaultWSRows, defaultWS192Rows, "gemm_fp4_ws", drv.Dim3{X: 384, Y: 56, Z: 1}, 512, wsSmem},
		{"1024 tokens FC2, sm_90a (32 rows per expert)", kernels.Identity, fc2(1024), defaultWSRows, defaultWS192Rows, "gemm_fp4_tile", drv.Dim3{X: 320, Y: 56, Z: 1}, 512, tileSmem},
		{"4096 tokens FC1, no wgmma", kernels.ReLU2, fc1(4096, I, I), never, never, "gemm_fp4_tile_w8_ks2", drv.Dim3{X: 512, Y: 16, Z: 2}, 256, tileSmem},
		{"2048 tokens FC2, no wgmma", kernels.Identity, fc2(2048), never, never, "gemm_fp4_tile", drv.Dim3{X: 384, Y: 56, Z: 1}, 512, tileSmem},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := tilePlan(c.act, c.s, defaultTile8Rows, c.wsRows, c.ws192)
			k := specOf(t, reg, p.kernel)
			if k.name != c.kern || p.grid != c.grid || p.threads != c.threads || p.smem != c.smem {
				t.Errorf("%s grid %+v, %d threads, %d bytes; want %s grid %+v, %d threads, %d bytes", k.name, p.grid, p.threads, p.smem,
					c.kern, c.grid, c.threads, c.smem)
			}
			if err := k.check(archWGMMA, p.grid, drv.Dim3{X: p.threads}, p.smem, 227<<10); err != nil {
				t.Error(err)
			}
		})
	}
}

// TestStreamedGemmDecode times the streamed NVFP4 expert GEMMs with 16-row
// tiles (staging activations chunk by chunk) and with 8-row tiles (staging
// a tile's whole K range at once) side by side at the Qwen3-30B-A3B expert
// shapes (hidden 2048, intermediate 768, SwiGLU, 128 experts, top-8) for
// decode batches routed at random, and checks that both give the same bits.
// The weights (214 MB for FC1) do not fit the L2.
func TestStreamedGemmDecode(t *testing.T) {
	be := gpu(t)
	defer func(j, m8 int) { be.streamJ, be.streamM8Rows = j, m8 }(be.streamJ, be.streamM8Rows)
	const E, H, I, topK, iters = 128, 2048, 768, 8, 50
	r := rand.New(rand.NewPCG(61, 62))

	gemms := []struct {
		name string
		act  kernels.Activation
		w    kernels.NVFP4
		n, k int
	}{
		{"fc1", kernels.SwiGLU, randNVFP4(t, be, r, []int{E, 2 * I}, H, E), 2 * I, H},
		{"fc2", kernels.Identity, randNVFP4(t, be, r, []int{E, H}, I, E), H, I},
	}
	for _, T := range []int{1, 8, 32, 64, 128} {
		R := T * topK
		byExpert := make([][]int32, E)
		for tok := range T {
			for _, e := range r.Perm(E)[:topK] {
				byExpert[e] = append(byExpert[e], int32(tok))
			}
		}
		offs, gather := make([]int32, E+1), make([]int32, 0, R)
		most := 0
		for e := range E {
			gather = append(gather, byExpert[e]...)
			offs[e+1] = offs[e] + int32(len(byExpert[e]))
			most = max(most, len(byExpert[e]))
		}
		offsets, gath := uploaded(t, be, kernels.Int32Bytes(offs), kernels.I32, E+1), uploaded(t, be, kernels.Int32Bytes(gather), kernels.I32, R)
		for _, g := range gemms {
			A := randNVFP4(t, be, r, []int{T}, g.k, T)
			outN := g.n
			if g.act == kernels.SwiGLU {
				outN /= 2
			}
			var outs [2][]byte
			var times [2]float64
			for v, m8 := range []int{0, 8} {
				be.streamJ, be.streamM8Rows = 0, m8
				out := moetest.Alloc(t, be, kernels.BF16, R, outN)
				args := kernels.GroupedGemmArgs{A: kernels.Operand{Q: A}, Gather: gath, W: kernels.Operand{Q: g.w}, Offsets: offsets, Act: g.act, Out: out}
				d, err := be.Time(iters, func() error { return be.GroupedGemm(args) })
				if err != nil {
					t.Fatal(err)
				}
				outs[v] = make([]byte, out.Size())
				if err := be.Download(outs[v], out, 0); err != nil {
					t.Fatal(err)
				}
				times[v] = d.Seconds()
			}
			hit := 0
			for e := range E {
				if offs[e+1] > offs[e] {
					hit++
				}
			}
			bytes := float64(hit*g.n*g.k) * (0.5 + 1.0/16)
			t.Logf("%d tokens %s (%d experts hit, at most %d rows): 16-row tiles %.1f us (%.2f TB/s), 8-row tiles %.1f us (%.2f TB/s), 8-row / 16-row %.3f",
				T, g.name, hit, most, times[0]*1e6, bytes/times[0]/1e12, times[1]*1e6, bytes/times[1]/1e12, times[1]/times[0])
			if string(outs[0]) != string(outs[1]) {
				t.Errorf("%d tokens %s: the 8-row tiles' output differs from the 16-row tiles'", T, g.name)
			}
		}
	}
}

// uploaded is a buffer of dt and shape holding data.
func uploaded(t testing.TB, be *Backend, data []byte, dt kernels.DType, shape ...int) *kernels.Buffer {
	t.Helper()
	b := moetest.Alloc(t, be, dt, shape...)
	if err := be.Upload(b, 0, data); err != nil {
		t.Fatal(err)
	}
	return b
}

// randNVFP4 is an NVFP4 operand of lead rows (or matrices of rows) of k
// elements: random codes, block scales 2^-2 .. 2^2 and scales global
// scales of about 2^-8 (one a matrix of weights, one a row of
// activations).
func randNVFP4(t testing.TB, be *Backend, r *rand.Rand, lead []int, k, scales int) kernels.NVFP4 {
	t.Helper()
	n := k
	for _, d := range lead {
		n *= d
	}
	packed, sf := make([]byte, n/2), make([]byte, n/16)
	for i := range packed {
		packed[i] = byte(r.Uint32())
	}
	for i := range sf {
		sf[i] = byte(0x28 + r.IntN(0x20)) // E4M3 2^-2 .. 2^2
	}
	sc := make([]float32, scales)
	for i := range sc {
		sc[i] = float32(math.Ldexp(1+r.Float64(), -8))
	}
	return kernels.NVFP4{
		Packed: uploaded(t, be, packed, kernels.U8, append(slices.Clone(lead), k/2)...),
		Scales: uploaded(t, be, sf, kernels.U8, append(slices.Clone(lead), k/16)...),
		Scale:  uploaded(t, be, kernels.Float32Bytes(sc), kernels.F32, scales),
	}
}
