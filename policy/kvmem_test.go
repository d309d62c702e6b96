package policy

import (
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
	"github.com/rollout-worker/rollout-worker/moe"
)

// memBackend is a CPU backend that reports a fixed amount of free memory.
type memBackend struct {
	kernels.Backend
	free int64
}

func (b memBackend) MemInfo() (free, total int64, err error) { return b.free, 2 * b.free, nil }

func TestKVPagesFromMemory(t *testing.T) {
	cfg := testConfig()
	perPage := int64(2*cfg.Layers) * int64(8*cfg.KVHeads*cfg.HeadDim) * 2 // page size 8
	for _, tc := range []struct {
		name      string
		be        kernels.Backend
		fraction  float64
		reserve   int64
		wantPages int
		wantErr   string
	}{
		{"half of 100 pages", memBackend{testBackend(t), 100 * perPage}, 0.5, 0, 50, ""},
		{"all of it", memBackend{testBackend(t), 37*perPage + 5}, 1, 0, 37, ""},
		{"half of what the reserve leaves", memBackend{testBackend(t), 100 * perPage}, 0.5, 20 * perPage, 40, ""},
		{"too little", memBackend{testBackend(t), perPage - 1}, 1, 0, 0, "holds no KV page"},
		{"reserve takes it all", memBackend{testBackend(t), 100 * perPage}, 1, 100 * perPage, 0, "holds no KV page"},
		{"no memory report", testBackend(t), 0.9, 0, 0, "needs a backend that reports its memory"},
		{"fraction out of range", memBackend{testBackend(t), 100 * perPage}, 1.5, 0, 0, "kv memory fraction"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := testOptions()
			opts.KVPages, opts.KVMemoryFraction, opts.KVReserveBytes = 0, tc.fraction, tc.reserve
			m, err := NewModel(tc.be, cfg, opts)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("NewModel: %v, want an error containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Close() })
			if got := m.Options().KVPages; got != tc.wantPages {
				t.Fatalf("KV pages %d, want %d", got, tc.wantPages)
			}
			if got := m.layers[0].kv.K.Dim(0); got != tc.wantPages {
				t.Fatalf("layer 0's cache has %d pages, want %d", got, tc.wantPages)
			}
		})
	}
}

// TestWeightBytes: the sizes Config.WeightBytes predicts are those of the
// tensors a model of that config holds.
func TestWeightBytes(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Config)
	}{
		{"swiglu, qk norm, untied", func(*Config) {}},
		{"relu2, tied, no qk norm", func(c *Config) {
			c.Activation, c.TieEmbeddings, c.QKNorm = moe.ReLU2, true, false
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig()
			tc.edit(&cfg)
			m, err := NewModel(testBackend(t), cfg, testOptions())
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			targets, err := m.Tensors()
			if err != nil {
				t.Fatal(err)
			}
			var experts, other int64
			for _, tg := range targets {
				if tg.IsExpert() {
					experts += int64(tg.Size())
				} else {
					other += int64(tg.Size())
				}
			}
			if e, o := cfg.WeightBytes(); e != experts || o != other {
				t.Fatalf("WeightBytes() = %d experts, %d other; the model's tensors: %d, %d", e, o, experts, other)
			}
		})
	}
}
