package cuda

import (
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/moe/moebench"
	"github.com/rollout-worker/rollout-worker/moe/moetest"
)

// TestOutputDigests logs a digest of the outputs of MoE layers (both
// recipes and activations, 1 to 640 tokens: every grouped GEMM the host
// picks, with and without the K split, K a multiple of 128 and not), of
// their requantized weights and of dense GEMMs (narrow and generic), to
// compare two builds bit for bit: copy this file into the other tree and
// diff the DIGEST lines. It checks nothing itself.
func TestOutputDigests(t *testing.T) {
	be := gpu(t)
	digest := func(b []byte) string { s := sha256.Sum256(b); return fmt.Sprintf("%x", s[:8]) }
	download := func(b *kernels.Buffer) []byte {
		t.Helper()
		d := make([]byte, b.Size())
		if err := be.Download(d, b, 0); err != nil {
			t.Fatal(err)
		}
		return d
	}
	for _, shape := range [][2]int{{4096, 768}, {2688, 1856}} {
		for _, act := range []moe.Activation{moe.ReLU2, moe.SwiGLU} {
			for _, recipe := range []moe.Recipe{moe.RecipePerToken, moe.RecipeBF16} {
				cfg := moe.Config{Hidden: shape[0], Intermediate: shape[1], Experts: 32, TopK: 8, Activation: act, Scoring: moe.Softmax,
					MaxTokens: 640, Recipe: recipe}
				l := moetest.NewLayer(t, be, cfg, moebench.RandomWeightsFast(cfg, 7))
				var q []byte
				fc1, fc2 := l.Quantized()
				for _, b := range []*kernels.Buffer{fc1.Packed, fc1.Scales, fc1.Scale, fc2.Packed, fc2.Scales, fc2.Scale} {
					if b != nil {
						q = append(q, download(b)...)
					}
				}
				t.Logf("DIGEST requant H%d I%d %s %s %s", shape[0], shape[1], act, recipe, digest(q))
				for _, T := range []int{1, 3, 8, 40, 100, 160, 256, 400, 640} {
					x := moebench.RandomBF16(rand.New(rand.NewPCG(uint64(T), 9)), T*cfg.Hidden, 1)
					t.Logf("DIGEST moe H%d I%d %s %s T%d %s", shape[0], shape[1], act, recipe, T, digest(moetest.Forward(t, be, l, x)))
				}
			}
		}
	}
	r := rand.New(rand.NewPCG(3, 4))
	for _, s := range [][3]int{{1, 256, 7168}, {5, 256, 7168}, {40, 256, 7168}, {3, 2048, 1024}, {70, 1536, 1000}, {9, 33, 130}} {
		m, n, k := s[0], s[1], s[2]
		a, w := moetest.Alloc(t, be, kernels.BF16, m, k), moetest.Alloc(t, be, kernels.BF16, n, k)
		if err := be.Upload(a, 0, moebench.RandomBF16(r, m*k, 1)); err != nil {
			t.Fatal(err)
		}
		if err := be.Upload(w, 0, moebench.RandomBF16(r, n*k, 0.05)); err != nil {
			t.Fatal(err)
		}
		for _, dt := range []kernels.DType{kernels.F32, kernels.BF16} {
			out := moetest.Alloc(t, be, dt, m, n)
			if err := be.Gemm(out, a, w); err != nil {
				t.Fatal(err)
			}
			t.Logf("DIGEST gemm %dx%dx%d %v %s", m, n, k, dt, digest(download(out)))
		}
	}
}
