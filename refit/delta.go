package refit

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"slices"
	"sort"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// Delta tensors (PROTOCOL.md, "Delta tensors"): a partial version may carry
// a tensor as the BF16 elements that changed since its base, region by
// region, each region naming them by an index list or a bitmap, whichever
// is smaller, followed by their new values.

// DeltaDType is the safetensors dtype of a delta tensor: its shape is the
// BF16 tensor's, its bytes the regions' records.
const DeltaDType = "BF16_DELTA"

// DeltaRegionElems is the number of elements of a region of a delta tensor
// (the last region of a tensor holds the rest): an index within a region
// fits 16 bits.
const DeltaRegionElems = 1 << 16

// Forms of a delta record.
const (
	DeltaIndexList = 0 // 16-bit indices of the changed elements
	DeltaBitmap    = 1 // one bit per element of the region
)

// deltaRecordHeader is the size of a record's header: form, three zero
// bytes, count.
const deltaRecordHeader = 8

// deltaRegions returns the number of regions of a tensor of n elements and
// the length of region r.
func deltaRegions(n int64) int64 { return (n + DeltaRegionElems - 1) / DeltaRegionElems }

func regionLen(n, r int64) int { return int(min(DeltaRegionElems, n-r*DeltaRegionElems)) }

// bitmapBytes is the size of the bitmap of a region of n elements: whole
// 32-bit words.
func bitmapBytes(n int) int { return 4 * ((n + 31) / 32) }

// DeltaRecordSize is the size of the record of a region of n elements of
// which k changed, in the smaller form: an index list (8 + 4k bytes) unless
// a bitmap (8 + 4 ceil(n/32) + 2k) is smaller.
func DeltaRecordSize(n, k int) (size int, form int) {
	idx, bm := deltaRecordHeader+4*k, deltaRecordHeader+bitmapBytes(n)+2*k
	if idx <= bm {
		return idx, DeltaIndexList
	}
	return bm, DeltaBitmap
}

// deltaBytesRange returns the least and the most bytes the records of a
// delta tensor of n elements may take: every region unchanged, or every
// element changed in the larger form.
func deltaBytesRange(n int64) (lo, hi int64) {
	regions := deltaRegions(n)
	lo = deltaRecordHeader * regions
	if regions == 0 {
		return 0, 0
	}
	most := func(l int) int64 { return int64(deltaRecordHeader + max(4*l, bitmapBytes(l)+2*l)) }
	return lo, (regions-1)*most(DeltaRegionElems) + most(regionLen(n, regions-1))
}

// deltaRecord is one parsed region of a delta tensor; mask and values alias
// the bytes it was parsed from.
type deltaRecord struct {
	form   int
	count  int
	mask   []byte // the index list (2 bytes an index) or the bitmap
	values []byte
}

// deltaRecordLen reads the header of a record of a region of n elements
// (head holds at least its 8 bytes) and returns the record's size.
func deltaRecordLen(head []byte, n int) (int, error) {
	form, count := int(head[0]), int(binary.LittleEndian.Uint32(head[4:]))
	switch {
	case head[1] != 0 || head[2] != 0 || head[3] != 0:
		return 0, fmt.Errorf("bytes 1-3 of the record header are % x, want zeros", head[1:4])
	case count > n:
		return 0, fmt.Errorf("%d changed elements in a region of %d", count, n)
	case form == DeltaIndexList:
		return deltaRecordHeader + 4*count, nil
	case form == DeltaBitmap:
		return deltaRecordHeader + bitmapBytes(n) + 2*count, nil
	}
	return 0, fmt.Errorf("form %d: want %d (index list) or %d (bitmap)", form, DeltaIndexList, DeltaBitmap)
}

// parseDeltaRecord parses one whole record (b is exactly its bytes, as
// deltaRecordLen sized it) of a region of n elements: the indices strictly
// increasing and below n, or a bitmap with exactly count bits set and none
// at or past n; no value NaN or Inf.
func parseDeltaRecord(b []byte, n int) (deltaRecord, error) {
	size, err := deltaRecordLen(b, n)
	if err != nil {
		return deltaRecord{}, err
	}
	if size != len(b) {
		return deltaRecord{}, fmt.Errorf("a record of %d bytes, want %d", len(b), size)
	}
	rec := deltaRecord{form: int(b[0]), count: int(binary.LittleEndian.Uint32(b[4:]))}
	if rec.form == DeltaIndexList {
		rec.mask = b[deltaRecordHeader : deltaRecordHeader+2*rec.count]
		if i, j, prev := increasingBelow(rec.mask, n); i >= 0 {
			return deltaRecord{}, fmt.Errorf("index %d is %d (after %d): want strictly increasing indices below %d", i, j, prev, n)
		}
	} else {
		rec.mask = b[deltaRecordHeader : deltaRecordHeader+bitmapBytes(n)]
		set := 0
		for w := 0; w < len(rec.mask); w += 4 {
			set += bits.OnesCount32(binary.LittleEndian.Uint32(rec.mask[w:]))
		}
		if tail := n % 32; tail != 0 && binary.LittleEndian.Uint32(rec.mask[len(rec.mask)-4:])>>tail != 0 {
			return deltaRecord{}, fmt.Errorf("the bitmap marks elements past the region's %d", n)
		}
		if set != rec.count {
			return deltaRecord{}, fmt.Errorf("the bitmap marks %d elements, the header says %d", set, rec.count)
		}
	}
	rec.values = b[len(b)-2*rec.count:]
	if i := bf16.FirstNonFinite(rec.values); i >= 0 {
		return deltaRecord{}, fmt.Errorf("value %d is NaN or Inf", i)
	}
	return rec, nil
}

// increasingBelow checks that the little-endian 16-bit indices of list
// strictly increase and stay below n, four at a time. It returns -1, or
// the position of the first index that does not, the index and the one
// before it (-1 for the first).
func increasingBelow(list []byte, n int) (at, idx, prev int) {
	le := binary.LittleEndian
	p, i := -1, 0
	for ; i+8 <= len(list); i += 8 {
		x := le.Uint64(list[i:])
		a, b, c, d := int(x&0xffff), int(x>>16&0xffff), int(x>>32&0xffff), int(x>>48)
		if p < a && a < b && b < c && c < d && d < n {
			p = d
			continue
		}
		break // the element-wise loop below finds which
	}
	for ; i+1 < len(list); i += 2 {
		j := int(le.Uint16(list[i:]))
		if j <= p || j >= n {
			return i / 2, j, p
		}
		p = j
	}
	return -1, 0, 0
}

// changedIn reports whether the record changes an element of [a, b) of its
// region.
func (rec deltaRecord) changedIn(a, b int) bool {
	if rec.count == 0 || a >= b {
		return false
	}
	if rec.form == DeltaIndexList {
		i := sort.Search(rec.count, func(i int) bool { return int(binary.LittleEndian.Uint16(rec.mask[2*i:])) >= a })
		return i < rec.count && int(binary.LittleEndian.Uint16(rec.mask[2*i:])) < b
	}
	for w := a / 32; w*32 < b; w++ {
		word := binary.LittleEndian.Uint32(rec.mask[4*w:])
		if lo := a - 32*w; lo > 0 {
			word &^= 1<<lo - 1
		}
		if hi := b - 32*w; hi < 32 {
			word &= 1<<hi - 1
		}
		if word != 0 {
			return true
		}
	}
	return false
}

// span is the record as a kernels.DeltaSpan of region r of a tensor whose
// first element is first, its words and values appended to masks and
// values.
func (rec deltaRecord) span(first int64, r int64, n int, masks, values []byte) (kernels.DeltaSpan, []byte, []byte) {
	s := kernels.DeltaSpan{Start: first + r*DeltaRegionElems, Len: int32(n), Form: kernels.DeltaIndices, Count: int32(rec.count),
		Mask: int32(len(masks) / 4), Value: int32(len(values) / 2)}
	if rec.form == DeltaBitmap {
		s.Form = kernels.DeltaBitmap
	}
	masks = append(masks, rec.mask...)
	if len(masks)%4 != 0 {
		masks = append(masks, 0, 0) // an odd number of indices
	}
	return s, masks, append(values, rec.values...)
}

// deltaDecoder reads the records of one delta tensor of n elements from
// its bytes as they arrive, in any pieces: a record split across chunks is
// completed from the bytes kept of the first part.
type deltaDecoder struct {
	n       int64 // elements
	regions int64
	next    int64  // the region the next record is of
	pend    []byte // the start of a record split across pieces
}

func newDeltaDecoder(n int64) *deltaDecoder {
	return &deltaDecoder{n: n, regions: deltaRegions(n)}
}

// feed consumes the next bytes of the tensor and calls emit with every
// record completed, and its region; the record's slices are valid only
// during the call.
func (d *deltaDecoder) feed(data []byte, emit func(rec deltaRecord, region int64) error) error {
	for len(data) > 0 {
		if d.next >= d.regions {
			return fmt.Errorf("%w: %d bytes after the last of its %d regions", ErrProtocol, len(data), d.regions)
		}
		n := regionLen(d.n, d.next)
		var rec []byte
		if len(d.pend) == 0 && len(data) >= deltaRecordHeader {
			size, err := deltaRecordLen(data, n)
			if err != nil {
				return fmt.Errorf("%w: region %d: %v", ErrProtocol, d.next, err)
			}
			if len(data) >= size { // the usual case: read in place
				rec, data = data[:size], data[size:]
			}
		}
		if rec == nil {
			// Gather the record: its header first, then the rest.
			need := deltaRecordHeader
			if len(d.pend) >= deltaRecordHeader {
				size, err := deltaRecordLen(d.pend, n)
				if err != nil {
					return fmt.Errorf("%w: region %d: %v", ErrProtocol, d.next, err)
				}
				need = size
			}
			take := min(need-len(d.pend), len(data))
			d.pend, data = append(d.pend, data[:take]...), data[take:]
			if len(d.pend) < need {
				continue
			}
			if need == deltaRecordHeader {
				size, err := deltaRecordLen(d.pend, n)
				if err != nil {
					return fmt.Errorf("%w: region %d: %v", ErrProtocol, d.next, err)
				}
				if size > deltaRecordHeader {
					continue // the rest follows
				}
			}
			rec = d.pend
		}
		r, err := parseDeltaRecord(rec, n)
		if err != nil {
			return fmt.Errorf("%w: region %d: %v", ErrProtocol, d.next, err)
		}
		if err := emit(r, d.next); err != nil {
			return err
		}
		d.next++
		d.pend = d.pend[:0]
	}
	return nil
}

// done checks that the tensor's bytes held every region, whole.
func (d *deltaDecoder) done() error {
	if d.next < d.regions || len(d.pend) > 0 {
		return fmt.Errorf("its bytes end in region %d of %d", d.next, d.regions)
	}
	return nil
}

// appendDeltaRecord appends the record of a region, the smaller form, from
// its elements in the base (old) and in the new version (both little-endian
// BF16, the same length). changed is the number of elements that differ.
// work is scratch for their bitmap and indices (returned, grown as needed).
//
// Finding the changes does not branch on the data: the bitmap comes from
// whole blocks compared at once (changedBitmap), since the changes of a
// trainer's step fall at random and a branch a block or a lane would
// mispredict about as often as not. The indices are then listed from the
// bitmap a 64-bit word at a time, a branch per change (changedIndices).
func appendDeltaRecord(dst, old, new, work []byte) (out []byte, changed int, workOut []byte) {
	n := len(new) / 2
	nb := bitmapBytes(n)
	work = slices.Grow(work[:0], nb+2*n+16)[:nb+2*n+16] // a group's candidates may run 8 bytes past the last index
	bm, pos := work[:nb], work[nb:]
	k := changedBitmap(bm, old, new)
	changedIndices(pos, bm)
	size, form := DeltaRecordSize(n, k)
	at := len(dst)
	dst = slices.Grow(dst, size)[:at+size]
	rec := dst[at:]
	le := binary.LittleEndian
	rec[0], rec[1], rec[2], rec[3] = byte(form), 0, 0, 0
	le.PutUint32(rec[4:], uint32(k))
	vals := rec[deltaRecordHeader:]
	if form == DeltaIndexList {
		vals = vals[copy(vals, pos[:2*k]):]
	} else {
		vals = vals[copy(vals, bm):]
	}
	vals, pos = vals[:2*k], pos[:2*k]
	for j := 0; j+1 < len(pos); j += 2 {
		e := 2 * int(le.Uint16(pos[j:]))
		vals[j], vals[j+1] = new[e], new[e+1]
	}
	return dst, k, work
}

// changedBitmap sets in bm (bitmapBytes of the region, the bitmap form's
// layout: element e is bit e%8 of byte e/8) the BF16 elements that differ
// between old and new, clears the rest, and returns how many differ. Where
// the machine has vector compares (changedBitmapVector) they take the
// elements in whole blocks of 32 and the portable loop the rest.
func changedBitmap(bm, old, new []byte) int {
	i, k := changedBitmapVector(bm, old, new)
	return k + changedBitmapFrom(bm, old, new, i)
}

// changedBitmapFrom is changedBitmap from element i (a multiple of 16) on,
// in portable Go.
func changedBitmapFrom(bm, old, new []byte, i int) int {
	n := len(new) / 2
	le := binary.LittleEndian
	k := 0
	for ; i+16 <= n; i += 16 {
		m := blockMask(diff32(old[2*i:2*i+32], new[2*i:2*i+32]))
		le.PutUint16(bm[i/8:], m)
		k += bits.OnesCount16(m)
	}
	clear(bm[i/8:])
	for ; i < n; i++ {
		if old[2*i] != new[2*i] || old[2*i+1] != new[2*i+1] {
			bm[i/8] |= 1 << (i % 8)
			k++
		}
	}
	return k
}

// changedIndices stores the index of every bit set in bm as a
// little-endian uint16, in increasing order, from pos[0] on.
func changedIndices(pos, bm []byte) {
	le := binary.LittleEndian
	k := 0
	for w := 0; w+8 <= len(bm); w += 8 {
		for m := le.Uint64(bm[w:]); m != 0; m &= m - 1 {
			le.PutUint16(pos[k:], uint16(8*w+bits.TrailingZeros64(m)))
			k += 2
		}
	}
	if w := len(bm) &^ 7; w < len(bm) {
		for m := uint64(le.Uint32(bm[w:])); m != 0; m &= m - 1 {
			le.PutUint16(pos[k:], uint16(8*w+bits.TrailingZeros64(m)))
			k += 2
		}
	}
}

// diff32 XORs 32 bytes of o and w as four little-endian 8-byte words.
func diff32(o, w []byte) (x0, x1, x2, x3 uint64) {
	_, _ = o[31], w[31] // one bounds check each
	le := binary.LittleEndian
	return le.Uint64(o) ^ le.Uint64(w), le.Uint64(o[8:]) ^ le.Uint64(w[8:]), le.Uint64(o[16:]) ^ le.Uint64(w[16:]), le.Uint64(o[24:]) ^ le.Uint64(w[24:])
}

// changedLanes returns bit 15 of each 16-bit lane of x that is not zero:
// adding 0x7fff to a lane's low 15 bits carries into bit 15 exactly when
// one of them is set (and never into the next lane), and bit 15 itself is
// ORed in.
func changedLanes(x uint64) uint64 {
	const low, high = 0x7fff_7fff_7fff_7fff, 0x8000_8000_8000_8000
	return (x&low + low | x) & high
}

// blockMask folds the XORs of 16 elements (four words of four lanes) into
// a 16-bit mask, bit 4j+q for lane q of word j. Lane q's bit of word j is
// first moved to bit 16q+4j; multiplying by 2^(48-15q) for each q then
// puts it at bit 48+4j+q. Every other product lands below bit 48 on a bit
// no other one takes, or past bit 63, so nothing carries into the top 16.
func blockMask(x0, x1, x2, x3 uint64) uint16 {
	const gather = 1<<48 | 1<<33 | 1<<18 | 1<<3
	l := changedLanes(x0)>>15 | changedLanes(x1)>>11 | changedLanes(x2)>>7 | changedLanes(x3)>>3
	return uint16(l * gather >> 48)
}
