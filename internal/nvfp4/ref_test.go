package nvfp4

// Independent slow reference for the NVFP4 recipe of docs/NVFP4.md, written
// from the document only. Nothing here calls the codec under test: E4M3 and
// E2M1 values are enumerated from their bit definitions, encoding is "nearest
// value by exact float64 distance, ties to the even code", and the quantizer
// follows the pseudo-code of sections 3 and 4 one float32 operation at a time.

import (
	"fmt"
	"math"
	"runtime"
	"sort"
	"sync"
	"testing"
)

// refCode is one finite non-negative value of a small float format.
type refCode struct {
	v    float64
	code uint8
}

// refE4M3Table holds every finite non-negative float8_e4m3fn value (codes
// 0x00..0x7E; 0x7F is NaN) in ascending order, built from the bit
// definition: bias 7, exponent field 0 is subnormal (m * 2^-9).
var refE4M3Table = func() []refCode {
	var tab []refCode
	for c := 0; c < 0x7f; c++ {
		e, m := c>>3, c&7
		var v float64
		if e == 0 {
			v = math.Ldexp(float64(m), -9) // 0.m * 2^(1-7)
		} else {
			v = math.Ldexp(1+float64(m)/8, e-7)
		}
		tab = append(tab, refCode{v, uint8(c)})
	}
	sort.Slice(tab, func(i, j int) bool { return tab[i].v < tab[j].v })
	return tab
}()

// refE4M3Values maps a positive code (0x00..0x7E) to its value.
var refE4M3Values = func() (vals [0x7f]float64) {
	for _, rc := range refE4M3Table {
		vals[rc.code] = rc.v
	}
	return vals
}()

// refE2M1Table holds the eight non-negative E2M1 values, codes 0..7, from the
// bit definition: bits 2..1 exponent with bias 1, bit 0 mantissa, exponent 0
// subnormal (m * 0.5).
var refE2M1Table = func() []refCode {
	var tab []refCode
	for c := 0; c < 8; c++ {
		e, m := c>>1, c&1
		var v float64
		if e == 0 {
			v = float64(m) * 0.5
		} else {
			v = math.Ldexp(1+float64(m)/2, e-1)
		}
		tab = append(tab, refCode{v, uint8(c)})
	}
	sort.Slice(tab, func(i, j int) bool { return tab[i].v < tab[j].v })
	return tab
}()

// refPick chooses between the two neighbours lo <= a < hi by exact distance,
// ties to the even code (code LSB 0).
//
// The float64 differences are exact wherever it matters: a is a float32, the
// table values have at most 4 significant bits, and near any midpoint (>= 2^-10
// for E4M3, >= 0.25 for E2M1) both operands are within 2^53 ulps of each
// other. Far from a midpoint a rounded difference cannot change the order
// (rounding is monotonic), so the answer is still exact.
func refPick(a float64, lo, hi refCode) uint8 {
	dl, dh := a-lo.v, hi.v-a
	switch {
	case dl < dh:
		return lo.code
	case dh < dl:
		return hi.code
	case lo.code&1 == 0:
		return lo.code
	default:
		return hi.code
	}
}

// refNearest returns the code of the table value nearest to a >= 0; above the
// largest value it saturates to the largest code (satfinite).
func refNearest(tab []refCode, a float64) uint8 {
	i := sort.Search(len(tab), func(i int) bool { return tab[i].v > a })
	if i == len(tab) {
		return tab[len(tab)-1].code
	}
	return refPick(a, tab[i-1], tab[i]) // i >= 1 because tab[0].v == 0 <= a
}

// refE4M3Encode is the reference float32 -> float8_e4m3fn conversion:
// nearest, ties to even, saturating finite values and infinities at 448,
// NaN -> 0x7F with the input's sign, the sign bit kept otherwise.
func refE4M3Encode(x float32) uint8 {
	sign := uint8(math.Float32bits(x)>>24) & 0x80
	if x != x {
		return sign | 0x7f
	}
	return sign | refNearest(refE4M3Table, math.Abs(float64(x)))
}

// refE4M3Value is the float32 value of a non-NaN E4M3 byte.
func refE4M3Value(b uint8) float32 {
	v := float32(refE4M3Values[b&0x7f]) // exact: at most 4 significant bits
	if b&0x80 != 0 {
		return -v
	}
	return v
}

// refE2M1Encode is the reference E2M1 encoder: nearest, ties to the even
// code, saturating at 6, sign kept (a negative value that rounds to 0 is 8).
// NaN is outside the contract; it is mapped to the largest code of its sign
// only so that the function is total.
func refE2M1Encode(x float32) uint8 {
	sign := uint8(math.Float32bits(x)>>28) & 8
	if x != x {
		return sign | 7
	}
	return sign | refNearest(refE2M1Table, math.Abs(float64(x)))
}

// refBF16 widens a BF16 bit pattern (the upper half of a binary32).
func refBF16(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// refInv6 is RN32(1/6); TestRefConstants checks it is 0x3E2AAAAB.
var refInv6 = float32(1.0 / 6.0)

// refEncodeScale implements S_enc = amax == 0 ? 1 : min(RN(G/amax), FLT_MAX),
// 1 when that is 0, and S_dec = RN(1/S_enc), in float32.
func refEncodeScale(amax float32) (sEnc, sDec float32) {
	if amax == 0 {
		sEnc = 1
	} else {
		var g float32 = 2688
		sEnc = g / amax
		if sEnc > math.MaxFloat32 {
			sEnc = math.MaxFloat32
		}
		if sEnc == 0 {
			sEnc = 1
		}
	}
	var one float32 = 1
	return sEnc, one / sEnc
}

// refAmax is max |x| over BF16 values, compared as float32 values.
func refAmax(src []uint16) float32 {
	var m float32
	for _, h := range src {
		if a := float32(math.Abs(float64(refBF16(h)))); a > m {
			m = a
		}
	}
	return m
}

// refBlock is the reference result for one block, with the intermediates.
type refBlock struct {
	vmax, sdb, enc float32
	sf             uint8
}

// refQuantizeRow quantizes row (len(row) <= kp, zero padded to kp) with the
// recipe of docs/NVFP4.md section 3, one float32 step at a time.
func refQuantizeRow(row []uint16, kp int, sEnc, sDec float32) (packed, scales []byte, blocks []refBlock) {
	x := make([]float32, kp)
	for i, h := range row {
		x[i] = refBF16(h)
	}
	packed = make([]byte, kp/2)
	scales = make([]byte, kp/16)
	sEncInv6 := sEnc * refInv6 // RN(S_enc * INV6)
	for b := range scales {
		blk := x[16*b : 16*b+16]
		var vmax float32
		for _, v := range blk {
			if a := float32(math.Abs(float64(v))); a > vmax {
				vmax = a
			}
		}
		sdb := vmax * sEncInv6 // RN(vmax * RN(S_enc*INV6))
		if sdb > math.MaxFloat32 {
			sdb = math.MaxFloat32
		}
		sf := refE4M3Encode(sdb)
		den := refE4M3Value(sf) * sDec // RN(f32(sf) * S_dec)
		var one float32 = 1
		enc := one / den // RN(1 / ...); +Inf when den == 0
		if enc > math.MaxFloat32 {
			enc = math.MaxFloat32
		}
		scales[b] = sf
		for i, v := range blk {
			q := refE2M1Encode(v * enc) // e2m1_rne_sat(RN(x_i * enc))
			packed[8*b+i/2] |= q << (4 * (i % 2))
		}
		blocks = append(blocks, refBlock{vmax: vmax, sdb: sdb, enc: enc, sf: sf})
	}
	return packed, scales, blocks
}

// refQuantized is a reference-quantized matrix.
type refQuantized struct {
	packed, scales []byte
	sEnc, sDec     []float32 // one per row (per-row) or one for the matrix
	blocks         []refBlock
}

// refQuantize quantizes a rows x k BF16 matrix into rows x kp, with one
// global scale (perRow false, section 3) or one per row (section 4).
func refQuantize(src []uint16, rows, k, kp int, perRow bool) refQuantized {
	var q refQuantized
	if !perRow {
		e, d := refEncodeScale(refAmax(src))
		q.sEnc, q.sDec = []float32{e}, []float32{d}
	}
	for r := range rows {
		row := src[r*k : (r+1)*k]
		sEnc, sDec := float32(0), float32(0)
		if perRow {
			sEnc, sDec = refEncodeScale(refAmax(row))
			q.sEnc, q.sDec = append(q.sEnc, sEnc), append(q.sDec, sDec)
		} else {
			sEnc, sDec = q.sEnc[0], q.sDec[0]
		}
		p, s, blk := refQuantizeRow(row, kp, sEnc, sDec)
		q.packed = append(q.packed, p...)
		q.scales = append(q.scales, s...)
		q.blocks = append(q.blocks, blk...)
	}
	return q
}

// maxReports bounds the failures one worker (or one comparison) prints.
const maxReports = 4

// failLog collects failures without flooding the test output.
type failLog struct {
	n    int
	msgs []string
}

func (l *failLog) add(format string, args ...any) {
	l.n++
	if len(l.msgs) < maxReports {
		l.msgs = append(l.msgs, fmt.Sprintf(format, args...))
	}
}

func (l *failLog) report(t *testing.T, what string) {
	t.Helper()
	for _, m := range l.msgs {
		t.Errorf("%s: %s", what, m)
	}
	if l.n > len(l.msgs) {
		t.Errorf("%s: ... and %d more failures", what, l.n-len(l.msgs))
	}
}

// parallelBits runs work over the float32 bit patterns lo, lo+stride, ... < hi,
// split into runtime.NumCPU() contiguous ascending ranges, one goroutine each
// with its own failure log. work receives the first pattern, the number of
// patterns and the stride. It returns the number of patterns checked.
func parallelBits(t *testing.T, what string, lo, hi, stride uint32, work func(first uint32, n int, stride uint32, log *failLog)) int {
	t.Helper()
	total := int((uint64(hi) - uint64(lo) + uint64(stride) - 1) / uint64(stride))
	workers := runtime.NumCPU()
	logs := make([]failLog, workers)
	var wg sync.WaitGroup
	for w := range workers {
		a, b := total*w/workers, total*(w+1)/workers
		if a == b {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			work(lo+uint32(a)*stride, b-a, stride, &logs[w])
		}()
	}
	wg.Wait()
	for w := range logs {
		logs[w].report(t, fmt.Sprintf("%s (worker %d)", what, w))
	}
	return total
}

// fbits formats a float32 with its bit pattern.
func fbits(f float32) string { return fmt.Sprintf("%g (0x%08X)", f, math.Float32bits(f)) }

// TestRefConstants pins the reference's own building blocks to the numbers
// docs/NVFP4.md states, so that the reference cannot drift with the codec.
func TestRefConstants(t *testing.T) {
	if got := math.Float32bits(refInv6); got != 0x3E2AAAAB {
		t.Errorf("RN32(1/6) = 0x%08X, want 0x3E2AAAAB", got)
	}
	if got := math.Float32bits(Inv6); got != 0x3E2AAAAB {
		t.Errorf("Inv6 = 0x%08X, want 0x3E2AAAAB", got)
	}
	var g, one float32 = 2688, 1
	if got := math.Float32bits(one / g); got != 0x39C30C31 || math.Float32bits(PerTokenGlobal) != 0x39C30C31 {
		t.Errorf("RN32(1/2688) = 0x%08X, PerTokenGlobal = 0x%08X, want 0x39C30C31", got, math.Float32bits(PerTokenGlobal))
	}
	consts := []struct {
		name      string
		got, want int
	}{{"G", G, 2688}, {"FP8Max*FP4Max", FP8Max * FP4Max, 2688}, {"BlockSize", BlockSize, 16}}
	for _, c := range consts {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}

	if n := len(refE4M3Table); n != 127 {
		t.Fatalf("E4M3 table has %d finite non-negative values, want 127", n)
	}
	for i := 1; i < len(refE4M3Table); i++ {
		if refE4M3Table[i].v <= refE4M3Table[i-1].v || refE4M3Table[i].code != refE4M3Table[i-1].code+1 {
			t.Fatalf("E4M3 table not strictly increasing with the code at %d", i)
		}
	}
	e4 := []struct {
		code uint8
		v    float64
	}{{0x00, 0}, {0x01, 0x1p-9}, {0x07, 7 * 0x1p-9}, {0x08, 0x1p-6}, {0x38, 1}, {0x7A, 320}, {0x7E, 448}}
	for _, c := range e4 {
		if refE4M3Values[c.code] != c.v {
			t.Errorf("E4M3 table: code 0x%02X = %g, want %g", c.code, refE4M3Values[c.code], c.v)
		}
	}
	e2 := []float64{0, 0.5, 1, 1.5, 2, 3, 4, 6}
	for c, v := range e2 {
		if refE2M1Table[c].v != v || refE2M1Table[c].code != uint8(c) {
			t.Errorf("E2M1 table: entry %d = %+v, want code %d value %g", c, refE2M1Table[c], c, v)
		}
	}

	// The decision points of section 1, and the E4M3 rules of section 1,
	// must fall out of "nearest, ties to even".
	e2cases := []struct {
		x    float32
		want uint8
	}{
		{0.25, 0}, {0.2500001, 1}, {0.75, 2}, {0.7499999, 1}, {1.25, 2}, {1.2500001, 3}, {1.75, 4},
		{2.5, 4}, {2.5000002, 5}, {3.5, 6}, {3.4999998, 5}, {5, 6}, {5.0000005, 7}, {1e30, 7},
		{float32(math.Inf(1)), 7}, {-0.1, 8}, {float32(math.Copysign(0, -1)), 8}, {-5, 14},
	}
	for _, c := range e2cases {
		if got := refE2M1Encode(c.x); got != c.want {
			t.Errorf("refE2M1Encode(%v) = %d, want %d", c.x, got, c.want)
		}
	}
	e4cases := []struct {
		x    float32
		want uint8
	}{
		{0x1p-10, 0}, {math.Nextafter32(0x1p-10, 1), 1}, {3 * 0x1p-10, 2}, {0x1p-6, 0x08},
		{448, 0x7E}, {464, 0x7E}, {500, 0x7E}, {math.MaxFloat32, 0x7E}, {float32(math.Inf(1)), 0x7E},
		{313.6000061, 0x7A}, {-0x1p-11, 0x80}, {-448, 0xFE}, {float32(math.NaN()), 0x7F},
	}
	for _, c := range e4cases {
		if got := refE4M3Encode(c.x); got != c.want {
			t.Errorf("refE4M3Encode(%v) = 0x%02X, want 0x%02X", c.x, got, c.want)
		}
	}
}
