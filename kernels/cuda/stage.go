package cuda

import (
	"encoding/binary"
	"fmt"

	drv "github.com/rollout-worker/rollout-worker/internal/cuda"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// The refit path's staged deltas (kernels.DeltaStager): like Stage, they
// run on the copy stream, overlapping the ops on the compute stream, may be
// called from any goroutine, are never captured, and return once the
// device has written the bytes.

var _ kernels.DeltaStager = (*Backend)(nil)

// minStagingBytes is the least StagingBytes: one delta span of the largest
// size, its index list and values (32 + 4*32768 + 2*65536 bytes), must fit
// one staging buffer.
const minStagingBytes = 1 << 20

// spanBytes is the size of one span's description on the device.
const spanBytes = 4 * kernels.DeltaSpanWords

// StageScatterBF16 applies a sparse BF16 delta from host memory. The spans
// are checked on the host first (a bad one is an error of the call, and
// nothing is written). Then, batch by batch, the spans that fit one staging
// buffer, their words and their values are packed into a pinned buffer,
// copied to its device scratch buffer and scattered by model_scatter_bf16,
// all on the copy stream; the two pinned buffers alternate, so packing the
// next batch overlaps the copy and the scatter of the last.
func (be *Backend) StageScatterBF16(a kernels.HostScatterBF16) error {
	be.stageMu.Lock()
	defer be.stageMu.Unlock()
	if a.Dst == nil {
		return fmt.Errorf("cuda: stage scatter bf16: dst is missing")
	}
	if al, ok := a.Dst.Owner().(*allocation); !ok || al.be != be {
		return fmt.Errorf("cuda: stage scatter bf16: dst %v: %w", a.Dst, kernels.ErrForeignBuffer)
	}
	if err := a.Validate(); err != nil {
		return fmt.Errorf("cuda: stage scatter bf16: %w", err)
	}
	if len(a.Spans) == 0 {
		return nil
	}
	dst := ptr(a.Dst).Add(2 * a.Offset)
	i := 0
	for first := 0; first < len(a.Spans); {
		// The spans that fit one staging buffer: their descriptions, then
		// their words, then their values.
		n, words, values := 0, 0, 0
		for first+n < len(a.Spans) {
			s := a.Spans[first+n]
			if (n+1)*spanBytes+4*(words+s.MaskWords())+2*(values+int(s.Count)) > be.staging {
				break
			}
			n, words, values = n+1, words+s.MaskWords(), values+int(s.Count)
		}
		if n == 0 { // cannot happen: minStagingBytes holds the largest span
			return fmt.Errorf("cuda: stage scatter bf16: span %d does not fit a staging buffer of %d bytes", first, be.staging)
		}
		if err := be.outsideCapture(func(*drv.Ctx) error {
			if be.busy[i] {
				be.busy[i] = false
				return be.events[i].Sync()
			}
			return nil
		}); err != nil {
			return fmt.Errorf("cuda: stage scatter bf16: %w", err)
		}
		// The owner thread never reads pinned[i] while it is not busy.
		buf := be.pinned[i]
		descs, wordsAt := buf[:0], n*spanBytes
		valuesAt := wordsAt + 4*words
		w, v := 0, 0
		for _, s := range a.Spans[first : first+n] {
			copy(buf[wordsAt+4*w:], a.Masks[4*int(s.Mask):][:4*s.MaskWords()])
			copy(buf[valuesAt+2*v:], a.Values[2*int(s.Value):][:2*int(s.Count)])
			s.Mask, s.Value = int32(w), int32(v)
			for _, x := range s.Words() {
				descs = binary.LittleEndian.AppendUint32(descs, uint32(x))
			}
			w, v = w+s.MaskWords(), v+int(s.Count)
		}
		size := valuesAt + 2*values
		sc := be.scratch[i]
		if err := be.outsideCapture(func(c *drv.Ctx) error {
			if err := be.own("stage scatter bf16", "dst", a.Dst); err != nil {
				return err
			}
			if err := c.HtoDAsync(sc, buf[:size], be.copyS); err != nil {
				return err
			}
			be.busy[i] = true
			if err := be.events[i].Record(be.copyS); err != nil {
				return err
			}
			return be.launchOn(be.copyS, kScatterBF16, drv.Dim3{X: n}, drv.Dim3{X: scatterThreads}, 0,
				be.stageErr, dst, int64(a.Len), sc, sc.Add(wordsAt), int64(words), sc.Add(valuesAt), int64(values))
		}); err != nil {
			return fmt.Errorf("cuda: stage scatter bf16: %w", err)
		}
		first, i = first+n, 1-i
	}
	return be.stageWait("stage scatter bf16")
}

// StageCopy copies n bytes of src at srcOff into dst at dstOff, device to
// device on the copy stream.
func (be *Backend) StageCopy(dst *kernels.Buffer, dstOff int, src *kernels.Buffer, srcOff, n int) error {
	be.stageMu.Lock()
	defer be.stageMu.Unlock()
	for _, o := range []struct {
		name string
		b    *kernels.Buffer
		off  int
	}{{"dst", dst, dstOff}, {"src", src, srcOff}} {
		if o.b == nil {
			return fmt.Errorf("cuda: stage copy: %s is missing", o.name)
		}
		if a, ok := o.b.Owner().(*allocation); !ok || a.be != be {
			return fmt.Errorf("cuda: stage copy: %s %v: %w", o.name, o.b, kernels.ErrForeignBuffer)
		}
		if err := span("stage copy", o.b, o.off, n); err != nil {
			return err
		}
	}
	if err := be.outsideCapture(func(c *drv.Ctx) error {
		if err := be.own("stage copy", "dst", dst); err != nil {
			return err
		}
		if err := be.own("stage copy", "src", src); err != nil {
			return err
		}
		return c.DtoDAsync(ptr(dst).Add(dstOff), ptr(src).Add(srcOff), n, be.copyS)
	}); err != nil {
		return fmt.Errorf("cuda: stage copy: %w", err)
	}
	return be.stageWait("stage copy")
}

// stageWait waits for the copy stream's work and reports (and clears) the
// first error its kernels recorded.
func (be *Backend) stageWait(op string) error {
	return be.outsideCapture(func(c *drv.Ctx) error {
		be.busy = [2]bool{}
		if err := c.DtoHAsync(be.stageErrHost, be.stageErr, be.copyS); err != nil {
			return fmt.Errorf("cuda: %s: %w", op, err)
		}
		if err := be.copyS.Sync(); err != nil {
			return fmt.Errorf("cuda: %s: %w", op, err)
		}
		if binary.LittleEndian.Uint32(be.stageErrHost) == 0 {
			return nil
		}
		err := wordError(be.stageErrHost)
		clear(be.stageErrHost)
		if cerr := c.HtoDAsync(be.stageErr, be.stageErrHost, be.copyS); cerr != nil {
			return fmt.Errorf("cuda: %s: %w (clearing the error word: %w)", op, err, cerr)
		}
		if cerr := be.copyS.Sync(); cerr != nil {
			return fmt.Errorf("cuda: %s: %w (clearing the error word: %w)", op, err, cerr)
		}
		return err
	})
}

// StageAmax writes each matrix's largest |value| of src (BF16 [E, N, K])
// into dst (F32 [E]) on the copy stream, after every byte staged so far
// (kernels.AmaxStager): quant_amax, as Quantize's first pass, so that a
// Quantize given dst as its Amax gives the bits it gives without. It
// returns without waiting; StageSync waits.
func (be *Backend) StageAmax(dst, src *kernels.Buffer) error {
	be.stageMu.Lock()
	defer be.stageMu.Unlock()
	mats, per, err := kernels.ValidateAmax(dst, src)
	if err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	for _, o := range []struct {
		name string
		b    *kernels.Buffer
	}{{"dst", dst}, {"src", src}} {
		if a, ok := o.b.Owner().(*allocation); !ok || a.be != be {
			return fmt.Errorf("cuda: stage amax: %s %v: %w", o.name, o.b, kernels.ErrForeignBuffer)
		}
	}
	if mats == 0 {
		return nil
	}
	return be.outsideCapture(func(*drv.Ctx) error {
		if err := be.own("stage amax", "dst", dst); err != nil {
			return err
		}
		if err := be.own("stage amax", "src", src); err != nil {
			return err
		}
		if err := be.launchOn(be.copyS, kFillU32, drv.Dim3{X: (mats + 255) / 256}, drv.Dim3{X: 256}, 0, ptr(dst), int32(mats), uint32(0)); err != nil {
			return fmt.Errorf("cuda: stage amax: %w", err)
		}
		blocks := max(min((per/8+256*4-1)/(256*4), 1024), 1)
		vec := aligned16(src, src.Dim(2))
		for m0 := 0; m0 < mats; m0 += 65535 { // a grid's y dimension stops at 65535
			n := min(65535, mats-m0)
			if err := be.launchOn(be.copyS, kQuantAmax, drv.Dim3{X: blocks, Y: n}, drv.Dim3{X: 256}, 0,
				ptr(src).Add(2*m0*per), ptr(dst).Add(4*m0), int64(per), vec); err != nil {
				return fmt.Errorf("cuda: stage amax: %w", err)
			}
		}
		return nil
	})
}
