package refit

import (
	"errors"
	"fmt"
	"io"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
)

// DeltaSource is the stream of a delta version (PROTOCOL.md, "Delta
// tensors"): the tensors of a new checkpoint that differ from a base
// checkpoint, each as a delta tensor (the changed BF16 elements, region by
// region, by an index list or a bitmap, whichever is smaller) or, where
// that would not be smaller, as its whole BF16 bytes. Tensors that did not
// change are left out. It is an io.ReaderAt for Publisher.PublishDelta.
//
// Nothing is held whole: NewDelta reads both checkpoints side by side once
// (in regions of 65536 elements, pread into two 128 KiB buffers) to size
// every region's record, keeping 8 bytes a region; ReadAt encodes the
// records of the bytes asked for again from both checkpoints (but for
// regions that did not change, whose records are known), so the bytes are
// the same however often a chunk is read. Neither checkpoint may change
// until Close.
type DeltaSource struct {
	next, base *Source
	head       []byte
	size       int64
	segs       []deltaSeg // the tensors, in stream order
	stats      DeltaStats
	scratch    sync.Pool // *deltaScratch
}

// deltaSeg is one tensor of a DeltaSource's stream.
type deltaSeg struct {
	off        int64 // stream offset of its bytes
	size       int64
	next, base int  // its index in next and in base
	delta      bool // records; otherwise next's BF16 bytes
	elems      int64
	// at[r] is the offset of region r's record in the tensor's bytes; one
	// entry more than the regions holds the size.
	at []int64
}

// DeltaStats describes a delta version.
type DeltaStats struct {
	Tensors         int   // tensors of the new checkpoint considered
	Changed         int   // of them, those that changed: in the stream
	DeltaTensors    int   // of those, sent as delta tensors (the rest whole)
	Elements        int64 // BF16 elements of the tensors considered
	ChangedElements int64 // of them, those whose bits changed
	// FullBytes is the size of the stream of every tensor considered, as
	// a full (or partial) version carries them; Bytes this stream's.
	FullBytes, Bytes int64
}

// deltaScratch holds one region of each side, its encoded record and the
// encoder's scratch.
type deltaScratch struct {
	old, new, rec, work []byte
}

// OpenDelta opens the checkpoint at path and the one at base (a directory
// or safetensors file each, as OpenSource takes) and assembles the delta
// of path's tensors matching only (all if nil) against base's tensors of
// the same names. Close closes both.
func OpenDelta(path, base string, only *regexp.Regexp) (*DeltaSource, error) {
	next, err := OpenSource(path, only)
	if err != nil {
		return nil, err
	}
	b, err := OpenSource(base, nil)
	if err != nil {
		return nil, errors.Join(err, next.Close())
	}
	d, err := NewDelta(next, b)
	if err != nil {
		return nil, errors.Join(err, next.Close(), b.Close())
	}
	return d, nil
}

// NewDelta assembles the delta of every tensor of next against the tensor
// of the same name in base, which must have the same shape (and be BF16,
// as every tensor of a Source is). Close closes both sources.
func NewDelta(next, base *Source) (*DeltaSource, error) {
	d := &DeltaSource{next: next, base: base}
	d.scratch.New = func() any {
		return &deltaScratch{old: make([]byte, 2*DeltaRegionElems), new: make([]byte, 2*DeltaRegionElems)}
	}
	byName := make(map[string]int, len(base.tensors))
	for i, t := range base.tensors {
		byName[t.name] = i
	}
	// The tensors to compare, then the sizing pass over them: tensors in
	// parallel, each region by region.
	var problems []string
	var segs []deltaSeg
	for i, t := range next.tensors {
		bi, ok := byName[t.name]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("%s is not in the base checkpoint", t.name))
		case !slices.Equal(base.tensors[bi].shape, t.shape):
			problems = append(problems, fmt.Sprintf("%s: shape %v, the base's is %v", t.name, t.shape, base.tensors[bi].shape))
		default:
			segs = append(segs, deltaSeg{next: i, base: bi, elems: t.size / 2})
		}
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("refit: delta of %s on %s: %s", next.path, base.path, listSome(problems, 10))
	}
	changed := make([]int64, len(segs))
	errs := make([]error, len(segs))
	var nextSeg atomic.Int64
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(segs)) {
		wg.Go(func() {
			sc := d.scratch.Get().(*deltaScratch)
			defer d.scratch.Put(sc)
			for {
				i := int(nextSeg.Add(1) - 1)
				if i >= len(segs) {
					return
				}
				changed[i], errs[i] = d.size1(sc, &segs[i])
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	var entries []headerOut
	var at int64
	for i, seg := range segs {
		t := next.tensors[seg.next]
		d.stats.Tensors++
		d.stats.Elements += seg.elems
		if changed[i] == 0 {
			continue
		}
		d.stats.Changed++
		d.stats.ChangedElements += changed[i]
		seg.size = 2 * seg.elems
		dtype := "BF16"
		if end := seg.at[len(seg.at)-1]; end < seg.size {
			seg.delta, seg.size, dtype = true, end, DeltaDType
			d.stats.DeltaTensors++
		} else {
			seg.at = nil
		}
		seg.off = at
		at += seg.size
		d.segs = append(d.segs, seg)
		entries = append(entries, headerOut{name: t.name, dtype: dtype, shape: t.shape, size: seg.size})
	}
	head, err := versionHeader(entries)
	if err != nil {
		return nil, fmt.Errorf("refit: delta of %s on %s: %w", next.path, base.path, err)
	}
	d.head = head
	for i := range d.segs {
		d.segs[i].off += int64(len(head))
	}
	d.size = int64(len(head)) + at
	d.stats.FullBytes, d.stats.Bytes = next.Size(), d.size
	if d.size > MaxStreamBytes {
		return nil, fmt.Errorf("refit: delta of %s on %s: a stream of %d bytes: at most %d go in a version", next.path, base.path, d.size, MaxStreamBytes)
	}
	return d, nil
}

// size1 sizes the records of seg's regions (seg.at) and returns the
// number of elements that changed.
func (d *DeltaSource) size1(sc *deltaScratch, seg *deltaSeg) (changed int64, err error) {
	regions := deltaRegions(seg.elems)
	seg.at = make([]int64, regions+1)
	for r := range regions {
		old, new, err := d.region(sc, *seg, r)
		if err != nil {
			return 0, err
		}
		// The count of the bitmap the encoder builds; the bitmap itself is
		// scratch here.
		nb := bitmapBytes(len(new) / 2)
		sc.work = slices.Grow(sc.work[:0], nb)[:nb]
		k := changedBitmap(sc.work, old, new)
		size, _ := DeltaRecordSize(len(new)/2, k)
		seg.at[r+1] = seg.at[r] + int64(size)
		changed += int64(k)
	}
	return changed, nil
}

// region returns region r of seg's tensor in both checkpoints: in place
// where a checkpoint lends its bytes (Source.viewTensor), else read into
// sc.
func (d *DeltaSource) region(sc *deltaScratch, seg deltaSeg, r int64) (old, new []byte, err error) {
	n := regionLen(seg.elems, r)
	off := 2 * r * DeltaRegionElems
	if old, err = d.base.viewTensor(seg.base, sc.old[:2*n], off); err != nil {
		return nil, nil, err
	}
	new, err = d.next.viewTensor(seg.next, sc.new[:2*n], off)
	return old, new, err
}

// Size is the stream's length in bytes.
func (d *DeltaSource) Size() int64 { return d.size }

// Stats describes the delta.
func (d *DeltaSource) Stats() DeltaStats { return d.stats }

// Names returns the names of the tensors in the stream (those that
// changed), in stream order.
func (d *DeltaSource) Names() []string {
	out := make([]string, len(d.segs))
	for i, s := range d.segs {
		out[i] = d.next.tensors[s.next].name
	}
	return out
}

// ReadAt reads stream bytes at off (io.ReaderAt), encoding the records it
// covers: the regions (and whole tensors) the range spans are encoded in
// parallel, one goroutine a core, each into its own part of p, since a
// chunk of a sparse delta stands for tens of megabytes of both
// checkpoints. It may be called concurrently, until Close.
func (d *DeltaSource) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("refit: delta source: read at negative offset %d", off)
	}
	n := 0
	if off < int64(len(d.head)) {
		n = copy(p, d.head[off:])
	}
	// The pieces of the range: whole-tensor spans and delta regions, each
	// with the part of p it fills.
	var jobs []deltaJob
	end := off + int64(len(p))
	i := sort.Search(len(d.segs), func(i int) bool { return d.segs[i].off+d.segs[i].size > off+int64(n) })
	for ; i < len(d.segs) && d.segs[i].off < end; i++ {
		seg := &d.segs[i]
		lo, hi := max(off, seg.off)-seg.off, min(end, seg.off+seg.size)-seg.off // the range in the tensor's bytes
		if !seg.delta {
			jobs = append(jobs, deltaJob{seg: seg, r: -1, from: lo, dst: p[seg.off+lo-off : seg.off+hi-off]})
			continue
		}
		for r := int64(sort.Search(len(seg.at)-1, func(r int) bool { return seg.at[r+1] > lo })); r+1 < int64(len(seg.at)) && seg.at[r] < hi; r++ {
			a, b := max(lo, seg.at[r]), min(hi, seg.at[r+1])
			jobs = append(jobs, deltaJob{seg: seg, r: r, from: a - seg.at[r], dst: p[seg.off+a-off : seg.off+b-off]})
		}
	}
	covered := n
	for _, j := range jobs {
		covered += len(j.dst)
	}
	if err := d.runJobs(jobs); err != nil {
		return 0, err
	}
	if covered < len(p) {
		return covered, io.EOF
	}
	return covered, nil
}

// deltaJob is a piece of a ReadAt: region r of seg's records (r < 0: the
// tensor's BF16 bytes), from byte from of the record (of the tensor) on,
// into dst.
type deltaJob struct {
	seg  *deltaSeg
	r    int64
	from int64
	dst  []byte
}

// runJobs runs the jobs, in parallel when there are several.
func (d *DeltaSource) runJobs(jobs []deltaJob) error {
	workers := min(runtime.GOMAXPROCS(0), len(jobs))
	if workers <= 1 {
		sc := d.scratch.Get().(*deltaScratch)
		defer d.scratch.Put(sc)
		for _, j := range jobs {
			if err := d.job(sc, j); err != nil {
				return err
			}
		}
		return nil
	}
	var next atomic.Int64
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			sc := d.scratch.Get().(*deltaScratch)
			defer d.scratch.Put(sc)
			for {
				i := int(next.Add(1) - 1)
				if i >= len(jobs) {
					return
				}
				if err := d.job(sc, jobs[i]); err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// job fills j.dst.
func (d *DeltaSource) job(sc *deltaScratch, j deltaJob) error {
	seg := j.seg
	if j.r < 0 {
		return d.next.readTensor(seg.next, j.dst, j.from)
	}
	if seg.at[j.r+1]-seg.at[j.r] == deltaRecordHeader {
		// Nothing changed (the sizing pass counted): the record is its
		// header, an empty index list, and neither side is read.
		clear(j.dst)
		return nil
	}
	old, new, err := d.region(sc, *seg, j.r)
	if err != nil {
		return err
	}
	sc.rec, _, sc.work = appendDeltaRecord(sc.rec[:0], old, new, sc.work)
	if int64(len(sc.rec)) != seg.at[j.r+1]-seg.at[j.r] {
		return fmt.Errorf("refit: delta source: tensor %s: region %d encodes to %d bytes, %d when the delta was assembled: a checkpoint changed",
			d.next.tensors[seg.next].name, j.r, len(sc.rec), seg.at[j.r+1]-seg.at[j.r])
	}
	copy(j.dst, sc.rec[j.from:])
	return nil
}

// Close closes both checkpoints. It is idempotent.
func (d *DeltaSource) Close() error {
	return errors.Join(d.next.Close(), d.base.Close())
}
