package cuda

import (
	"encoding/binary"
	"fmt"
	"math"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
)

// The device error word. A kernel that meets an out-of-range index read
// from a buffer skips the affected row and records the first such error in
// four int32s: a code and three values. Sync reads it, clears it and turns
// it into an error naming the op and the entry (kernels/doc.go). The codes
// are those of src/common.cuh.
const errWordBytes = 16

// devErrors formats each code's three values. Values that are FP32 bit
// patterns are printed as floats.
var devErrors = map[int32]func(a, b, c int32) string{
	1: func(a, b, c int32) string {
		return fmt.Sprintf("permute: assignment %d names expert %d of %d", a, b, c)
	},
	2: func(a, b, c int32) string {
		return fmt.Sprintf("grouped gemm: offsets run from %d to %d, out has %d rows", a, b, c)
	},
	3: func(a, b, c int32) string {
		return fmt.Sprintf("grouped gemm: sorted row %d gathers row %d of %d", a, b, c)
	},
	4: func(a, b, c int32) string {
		return fmt.Sprintf("grouped gemm: offsets decrease at expert %d (%d > %d)", a, b, c)
	},
	5: func(a, b, c int32) string {
		return fmt.Sprintf("finalize: assignment %d names slot %d, rows has %d", a, b, c)
	},
	6: func(a, b, c int32) string { return fmt.Sprintf("embed: token %d has id %d, vocabulary is %d", a, b, c) },
	7: func(a, b, c int32) string {
		return fmt.Sprintf("rope: token %d is at position %d, the tables hold %d", a, b, c)
	},
	8: func(a, b, c int32) string {
		return fmt.Sprintf("kv write: token %d names slot %d, the cache has %d", a, b, c)
	},
	9: func(a, b, c int32) string {
		return fmt.Sprintf("attention: query start of sequence %d is %d, q has %d rows", a, b, c)
	},
	10: func(a, b, c int32) string {
		return fmt.Sprintf("attention: sequence %d has %d queries but length %d", a, b, c)
	},
	11: func(a, b, c int32) string {
		return fmt.Sprintf("attention: sequence %d has length %d, its page table row holds %d", a, b, c)
	},
	12: func(a, b, c int32) string {
		return fmt.Sprintf("attention: sequence %d: page table entry %d is page %d, outside the cache", a, b, c)
	},
	13: func(a, b, c int32) string {
		return fmt.Sprintf("sample: row %d: temperature %v: want 0 (greedy) or a positive finite value", a, f32(b))
	},
	14: func(a, b, c int32) string { return fmt.Sprintf("sample: row %d: top p %v: want (0, 1]", a, f32(b)) },
	15: func(a, b, c int32) string {
		return fmt.Sprintf("sample: row %d: top k %d: want 0 (all) up to the vocabulary, %d", a, b, c)
	},
	19: func(a, b, c int32) string {
		return fmt.Sprintf("logprobs: row %d: token %d, vocabulary is %d", a, b, c)
	},
	20: func(a, b, c int32) string { return fmt.Sprintf("logprobs: row %d: logit %d is %v", a, b, f32(c)) },
	21: func(a, b, c int32) string { return fmt.Sprintf("logprobs: row %d: every logit is -Inf", a) },
	22: func(a, b, c int32) string {
		return fmt.Sprintf("attention: query start decreases at sequence %d (%d > %d)", a, b, c)
	},
	23: func(a, b, c int32) string {
		return fmt.Sprintf("grouped gemm: scatter: sorted row %d names token %d of %d", a, b, c)
	},
	24: func(a, b, c int32) string {
		return fmt.Sprintf("grouped gemm: scatter: sorted row %d is none of token %d's %d slots", a, b, c)
	},
}

func f32(bits int32) float32 { return math.Float32frombits(uint32(bits)) }

// takeError reads and clears the error word (owner thread, after a
// stream synchronisation).
func (be *Backend) takeError(c *drv.Ctx) error {
	var w [errWordBytes]byte
	if err := c.DtoH(w[:], be.errw); err != nil {
		return err
	}
	code := int32(binary.LittleEndian.Uint32(w[0:]))
	if code == 0 {
		return nil
	}
	if err := c.Memset8(be.errw, 0, errWordBytes); err != nil {
		return err
	}
	a, b, cc := int32(binary.LittleEndian.Uint32(w[4:])), int32(binary.LittleEndian.Uint32(w[8:])), int32(binary.LittleEndian.Uint32(w[12:]))
	if f, ok := devErrors[code]; ok {
		return fmt.Errorf("cuda: %s", f(a, b, cc))
	}
	return fmt.Errorf("cuda: kernel error code %d (%d, %d, %d)", code, a, b, cc)
}
