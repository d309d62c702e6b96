package policy

import (
	"strings"
	"testing"

	"github.com/rollout-worker/rollout-worker/kernels"
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
		wantPages int
		wantErr   string
	}{
		{"half of 100 pages", memBackend{testBackend(t), 100 * perPage}, 0.5, 50, ""},
		{"all of it", memBackend{testBackend(t), 37*perPage + 5}, 1, 37, ""},
		{"too little", memBackend{testBackend(t), perPage - 1}, 1, 0, "holds no KV page"},
		{"no memory report", testBackend(t), 0.9, 0, "needs a backend that reports its memory"},
		{"fraction out of range", memBackend{testBackend(t), 100 * perPage}, 1.5, 0, "kv memory fraction"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := testOptions()
			opts.KVPages, opts.KVMemoryFraction = 0, tc.fraction
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
