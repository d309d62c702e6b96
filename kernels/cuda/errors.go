package cuda

import (
	"encoding/binary"
	"fmt"
	"math"
	"strings"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
)

// The device error word. A kernel that meets an out-of-range index read
// from a buffer skips the affected row and records the first such error in
// four int32s: a code and three values. Sync reads it, clears it and turns
// it into an error naming the op and the entry (kernels/doc.go). The codes
// are deviceErrors'; the kernels get them as errors.cuh (errorsHeader).
const errWordBytes = 16

// devError is one code of the device error word: its number, the name the
// kernels use (errors.cuh), and how its three values read. Values that are
// FP32 bit patterns are printed as floats.
type devError struct {
	code   int32
	name   string
	format func(a, b, c int32) string
}

// deviceErrors is the one table of device error codes: errorsHeader writes
// the kernels' constants from it and takeError the messages.
func deviceErrors() []devError {
	return []devError{
		{1, "E_PERMUTE_EXPERT", func(a, b, c int32) string {
			return fmt.Sprintf("permute: assignment %d names expert %d of %d", a, b, c)
		}},
		{2, "E_GG_OFFSETS", func(a, b, c int32) string {
			return fmt.Sprintf("grouped gemm: offsets run from %d to %d, out has %d rows", a, b, c)
		}},
		{3, "E_GG_GATHER", func(a, b, c int32) string {
			return fmt.Sprintf("grouped gemm: sorted row %d gathers row %d of %d", a, b, c)
		}},
		{4, "E_GG_DECREASE", func(a, b, c int32) string {
			return fmt.Sprintf("grouped gemm: offsets decrease at expert %d (%d > %d)", a, b, c)
		}},
		{5, "E_FIN_SLOT", func(a, b, c int32) string {
			return fmt.Sprintf("finalize: assignment %d names slot %d, rows has %d", a, b, c)
		}},
		{6, "E_EMBED_ID", func(a, b, c int32) string { return fmt.Sprintf("embed: token %d has id %d, vocabulary is %d", a, b, c) }},
		{7, "E_ROPE_POS", func(a, b, c int32) string {
			return fmt.Sprintf("rope: token %d is at position %d, the tables hold %d", a, b, c)
		}},
		{8, "E_KV_SLOT", func(a, b, c int32) string {
			return fmt.Sprintf("kv write: token %d names slot %d, the cache has %d", a, b, c)
		}},
		{9, "E_ATT_QSTART", func(a, b, c int32) string {
			return fmt.Sprintf("attention: query start of sequence %d is %d, q has %d rows", a, b, c)
		}},
		{10, "E_ATT_QUERIES", func(a, b, c int32) string {
			return fmt.Sprintf("attention: sequence %d has %d queries but length %d", a, b, c)
		}},
		{11, "E_ATT_LEN", func(a, b, c int32) string {
			return fmt.Sprintf("attention: sequence %d has length %d, its page table row holds %d", a, b, c)
		}},
		{12, "E_ATT_PAGE", func(a, b, c int32) string {
			return fmt.Sprintf("attention: sequence %d: page table entry %d is page %d, outside the cache", a, b, c)
		}},
		{13, "E_SAMPLE_TEMP", func(a, b, c int32) string {
			return fmt.Sprintf("sample: row %d: temperature %v: want 0 (greedy) or a positive finite value", a, f32(b))
		}},
		{14, "E_SAMPLE_TOPP", func(a, b, c int32) string { return fmt.Sprintf("sample: row %d: top p %v: want (0, 1]", a, f32(b)) }},
		{15, "E_SAMPLE_TOPK", func(a, b, c int32) string {
			return fmt.Sprintf("sample: row %d: top k %d: want 0 (all) up to the vocabulary, %d", a, b, c)
		}},
		{19, "E_LOGPROBS_TOKEN", func(a, b, c int32) string {
			return fmt.Sprintf("logprobs: row %d: token %d, vocabulary is %d", a, b, c)
		}},
		{20, "E_LOGPROBS_LOGIT", func(a, b, c int32) string { return fmt.Sprintf("logprobs: row %d: logit %d is %v", a, b, f32(c)) }},
		{21, "E_LOGPROBS_ALLNEG", func(a, b, c int32) string { return fmt.Sprintf("logprobs: row %d: every logit is -Inf", a) }},
		{22, "E_ATT_DECREASE", func(a, b, c int32) string {
			return fmt.Sprintf("attention: query start decreases at sequence %d (%d > %d)", a, b, c)
		}},
		{23, "E_SCATTER_TOKEN", func(a, b, c int32) string {
			return fmt.Sprintf("grouped gemm: scatter: sorted row %d names token %d of %d", a, b, c)
		}},
		{24, "E_SCATTER_SLOT", func(a, b, c int32) string {
			return fmt.Sprintf("grouped gemm: scatter: sorted row %d is none of token %d's %d slots", a, b, c)
		}},
		{25, "E_DELTA_SPAN", func(a, b, c int32) string {
			return fmt.Sprintf("scatter bf16: span %d of %d elements and %d values lies outside the region, the masks or the values, or has an unknown form", a, b, c)
		}},
		{26, "E_DELTA_INDEX", func(a, b, c int32) string {
			return fmt.Sprintf("scatter bf16: span %d: index %d is %d, not above the one before it or not below the span's length", a, b, c)
		}},
		{27, "E_DELTA_BITMAP", func(a, b, c int32) string {
			return fmt.Sprintf("scatter bf16: span %d: its bitmap marks %d elements (or some past its length), it has %d values", a, b, c)
		}},
	}
}

func f32(bits int32) float32 { return math.Float32frombits(uint32(bits)) }

// takeError reads and clears the error word (owner thread, after a
// stream synchronisation).
func (be *Backend) takeError(c *drv.Ctx) error {
	var w [errWordBytes]byte
	if err := c.DtoH(w[:], be.errw); err != nil {
		return err
	}
	if binary.LittleEndian.Uint32(w[0:]) == 0 {
		return nil
	}
	if err := c.Memset8(be.errw, 0, errWordBytes); err != nil {
		return err
	}
	return wordError(w[:])
}

// wordError turns the bytes of an error word that holds an error into the
// error it names.
func wordError(w []byte) error {
	code := int32(binary.LittleEndian.Uint32(w[0:]))
	a, b, cc := int32(binary.LittleEndian.Uint32(w[4:])), int32(binary.LittleEndian.Uint32(w[8:])), int32(binary.LittleEndian.Uint32(w[12:]))
	for _, e := range deviceErrors() {
		if e.code == code {
			return fmt.Errorf("cuda: %s", e.format(a, b, cc))
		}
	}
	return fmt.Errorf("cuda: kernel error code %d (%d, %d, %d)", code, a, b, cc)
}

// errorsHeader is errors.cuh as NVRTC gets it: a constant for each device
// error code and report, which records the first error since the last Sync.
func errorsHeader() string {
	var b strings.Builder
	b.WriteString(`// The device error word (kernels/cuda/errors.go writes this header from its
// table of codes).
#ifndef RW_ERRORS_CUH
#define RW_ERRORS_CUH

namespace rw {

`)
	for _, e := range deviceErrors() {
		fmt.Fprintf(&b, "constexpr int %s = %d;\n", e.name, e.code)
	}
	b.WriteString(`
// report records the first error since the last Sync: err[0] = code, then
// three values. Later errors are dropped.
__device__ __forceinline__ void report(int *err, int code, int a, int b, int c) {
    if (atomicCAS(err, 0, code) == 0) {
        err[1] = a;
        err[2] = b;
        err[3] = c;
        __threadfence();
    }
}

} // namespace rw

#endif // RW_ERRORS_CUH
`)
	return b.String()
}
