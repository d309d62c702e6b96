package policy

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/moe"
)

// TestRandomModelMatchesWrittenModel: a model initialised in memory holds,
// byte for byte, the weights of the checkpoint WriteRandomModel writes for
// the same preset and seed, NVFP4 copies included, for both expert
// activations.
func TestRandomModelMatchesWrittenModel(t *testing.T) {
	for _, tc := range []struct {
		preset string
		act    moe.Activation
	}{{"tiny", moe.SwiGLU}, {"tiny", moe.ReLU2}, {"tiny-mixtral", moe.SwiGLU}} {
		t.Run(tc.preset+"/"+string(tc.act), func(t *testing.T) {
			cfg, err := Preset(tc.preset)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Activation = tc.act
			opts := testOptions()
			opts.Recipe = moe.RecipePerToken
			dir := t.TempDir()
			if err := WriteRandomModel(dir, cfg, 11); err != nil {
				t.Fatal(err)
			}
			loaded, err := LoadModel(testBackend(t), dir, opts)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { loaded.Close() })
			inMem, err := NewRandomModel(context.Background(), testBackend(t), cfg, opts, 11)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { inMem.Close() })
			targets, err := loaded.Tensors()
			if err != nil {
				t.Fatal(err)
			}
			for _, tg := range targets {
				other, err := inMem.Resolve(tg.Name)
				if err != nil {
					t.Fatal(err)
				}
				a, b := make([]byte, tg.Size()), make([]byte, other.Size())
				if err := loaded.Backend().Download(a, tg.Buffer, tg.Offset); err != nil {
					t.Fatal(err)
				}
				if err := inMem.Backend().Download(b, other.Buffer, other.Offset); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(a, b) {
					t.Fatalf("%s differs between the written and the in-memory model", tg.Name)
				}
			}
			req := Request{ID: "r", Prompt: []int32{5, 6, 7, 8}, N: 2, Params: SamplingParams{Temperature: 1, TopP: 1, MaxTokens: 6, Seed: 3}}
			a := generate(t, startEngine(t, loaded, EngineConfig{}), req)
			b := generate(t, startEngine(t, inMem, EngineConfig{}), req)
			if err := sameSamples(a, b); err != nil {
				t.Fatalf("rollouts differ (NVFP4 copies?): %v", err)
			}
		})
	}
}

func TestRandomInitCancelled(t *testing.T) {
	cfg, err := Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = NewRandomModel(ctx, testBackend(t), cfg, testOptions(), 1)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("init under a cancelled context: %v, want context.Canceled", err)
	}
}

func TestPresetLayers(t *testing.T) {
	for _, tc := range []struct {
		name    string
		layers  int
		want    int
		wantErr bool
	}{
		{"qwen3-30b-a3b", 0, 48, false},
		{"qwen3-30b-a3b", 1, 1, false},
		{"qwen3-30b-a3b-relu2", 12, 12, false},
		{"qwen3-30b-a3b", 49, 0, true},
		{"tiny", -1, 0, true},
		{"nope", 1, 0, true},
	} {
		c, err := PresetLayers(tc.name, tc.layers)
		if (err != nil) != tc.wantErr || err == nil && c.Layers != tc.want {
			t.Errorf("PresetLayers(%q, %d) = %d layers, %v; want %d layers, error %v", tc.name, tc.layers, c.Layers, err, tc.want, tc.wantErr)
		}
	}
	c, err := Preset("qwen3-30b-a3b")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	experts, other := c.WeightBytes()
	if total := float64(experts+other) / 1e9; total < 60 || total > 62 {
		t.Fatalf("qwen3-30b-a3b: %.1f GB of BF16 weights, want about 61", total)
	}
	r, _ := Preset("qwen3-30b-a3b-relu2")
	if r.Activation != moe.ReLU2 || c.Activation != moe.SwiGLU {
		t.Fatalf("activations %s / %s, want swiglu / relu2", c.Activation, r.Activation)
	}
}

// TestRandomData checks the random tensors' values: ones for norm weights;
// for matrices, the same bytes for the same (seed, name) and others for
// another seed or name, a mean near 0 and a deviation near std, tails at
// most the table's last quantile (about 4.3 std), and every length, the
// ones that do not fill a 64-bit draw included.
func TestRandomData(t *testing.T) {
	for _, tc := range []struct {
		name  string
		shape []int
		std   float64
	}{
		{"norm.weight", []int{7}, 0},
		{"a.weight", []int{256, 512}, 1},
		{"b.weight", []int{3, 333}, 0.05},
		{"c.weight", []int{1}, 0.5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := randomSpec{tc.name, tc.shape, tc.std}
			data := randomData(9, s)
			n := 1
			for _, d := range tc.shape {
				n *= d
			}
			if len(data) != 2*n {
				t.Fatalf("%d bytes for %d elements", len(data), n)
			}
			if !bytes.Equal(data, randomData(9, s)) {
				t.Fatal("two draws of the same seed and name differ")
			}
			var sum, sq, worst float64
			for i := range n {
				v := float64(bf16.ToFloat32(binary.LittleEndian.Uint16(data[2*i:])))
				if tc.std == 0 && v != 1 {
					t.Fatalf("element %d = %v, want 1", i, v)
				}
				sum += v
				sq += v * v
				worst = max(worst, math.Abs(v))
			}
			if tc.std == 0 {
				return
			}
			if n > 1 && (bytes.Equal(data, randomData(10, s)) || bytes.Equal(data, randomData(9, randomSpec{tc.name + "x", tc.shape, tc.std}))) {
				t.Error("another seed or name draws the same bytes")
			}
			if worst > 4.4*tc.std {
				t.Errorf("largest |value| %v, more than 4.4 std (%v)", worst, tc.std)
			}
			if n < 1000 {
				return
			}
			mean, dev := sum/float64(n), math.Sqrt(sq/float64(n)-sum*sum/float64(n)/float64(n))
			if math.Abs(mean) > 5*tc.std/math.Sqrt(float64(n)) || math.Abs(dev/tc.std-1) > 0.01 {
				t.Errorf("mean %v, deviation %v over %d elements; want about 0 and %v", mean, dev, n, tc.std)
			}
		})
	}
}
