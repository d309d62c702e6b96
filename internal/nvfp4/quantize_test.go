package nvfp4

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// matSpec describes a random BF16 test matrix.
type matSpec struct {
	name         string
	rows, k, kp  int // kp 0 means PaddedK(k)
	expLo, expHi int // unbiased exponent range of ordinary elements
	pZeroRow     float64
	pZeroBlock   float64 // a 16-wide block (along k) of +-0
	pTinyBlock   float64 // a block 30..45 binades below expLo: its scale underflows
	pSubBlock    float64 // a block of BF16 subnormals 0x0001..0x007f
	pNegZero     float64 // single -0 elements
	pSubElem     float64 // single BF16 subnormal elements
	onlySub      bool    // every element a subnormal or zero: amax is subnormal
}

func (s matSpec) paddedK() int {
	if s.kp != 0 {
		return s.kp
	}
	return PaddedK(s.k)
}

// randNormal returns a random BF16 with unbiased exponent in [lo, hi] (clamped
// to the normal range), random mantissa and sign.
func randNormal(rng *rand.Rand, lo, hi int) uint16 {
	lo, hi = max(lo, -126), min(hi, 127)
	e := lo + rng.IntN(hi-lo+1)
	return uint16(rng.IntN(2))<<15 | uint16(e+127)<<7 | uint16(rng.IntN(128))
}

// randSub returns a random nonzero BF16 subnormal (0x0001..0x007f), random sign.
func randSub(rng *rand.Rand) uint16 {
	return uint16(rng.IntN(2))<<15 | uint16(1+rng.IntN(127))
}

// genMatrix builds a random row-major rows x k BF16 matrix following s.
func genMatrix(rng *rand.Rand, s matSpec) []uint16 {
	src := make([]uint16, s.rows*s.k)
	for r := range s.rows {
		row := src[r*s.k : (r+1)*s.k]
		if rng.Float64() < s.pZeroRow {
			for i := range row {
				row[i] = uint16(rng.IntN(2)) << 15 // +0 or -0
			}
			continue
		}
		for b := 0; b < s.k; b += BlockSize {
			blk := row[b:min(b+BlockSize, s.k)]
			u := rng.Float64()
			for i := range blk {
				switch {
				case s.onlySub:
					if rng.IntN(8) == 0 {
						blk[i] = 0
					} else {
						blk[i] = randSub(rng)
					}
				case u < s.pZeroBlock:
					blk[i] = uint16(rng.IntN(2)) << 15
				case u < s.pZeroBlock+s.pTinyBlock:
					blk[i] = randNormal(rng, s.expLo-45, s.expLo-30)
				case u < s.pZeroBlock+s.pTinyBlock+s.pSubBlock:
					blk[i] = randSub(rng)
				default:
					v := rng.Float64()
					switch {
					case v < s.pNegZero:
						blk[i] = 0x8000
					case v < s.pNegZero+s.pSubElem:
						blk[i] = randSub(rng)
					default:
						blk[i] = randNormal(rng, s.expLo, s.expHi)
					}
				}
			}
		}
	}
	return src
}

// randomSpecs are the random-matrix shapes and features of the tests.
var randomSpecs = []matSpec{
	{name: "dense 8x64", rows: 8, k: 64, expLo: -4, expHi: 4},
	{name: "k=37 not a multiple of 16", rows: 5, k: 37, expLo: -3, expHi: 3, pNegZero: 0.05},
	{name: "k=8 shorter than a block", rows: 3, k: 8, expLo: -2, expHi: 2},
	{name: "k=1", rows: 2, k: 1, expLo: -2, expHi: 2},
	{name: "k=200 kp=256", rows: 3, k: 200, kp: 256, expLo: -5, expHi: 5, pZeroBlock: 0.1, pTinyBlock: 0.1},
	{name: "k=32 kp=64", rows: 4, k: 32, kp: 64, expLo: -5, expHi: 5},
	{name: "features", rows: 40, k: 160, expLo: -2, expHi: 6, pZeroRow: 0.1, pZeroBlock: 0.1, pTinyBlock: 0.15, pSubBlock: 0.05, pNegZero: 0.05, pSubElem: 0.02},
	{name: "features k=93", rows: 17, k: 93, expLo: 0, expHi: 10, pZeroRow: 0.1, pZeroBlock: 0.1, pTinyBlock: 0.15, pSubBlock: 0.05, pNegZero: 0.05, pSubElem: 0.02},
	{name: "wide dynamic range", rows: 16, k: 64, expLo: -60, expHi: 60, pTinyBlock: 0.1},
	{name: "huge values", rows: 6, k: 48, expLo: 110, expHi: 127},
	{name: "tiny normal amax (S_enc clamps to FLT_MAX)", rows: 6, k: 48, expLo: -126, expHi: -118, pSubElem: 0.1},
	{name: "subnormal amax (G/amax overflows)", rows: 6, k: 48, onlySub: true},
	{name: "all zero", rows: 3, k: 32, expLo: 0, expHi: 0, pZeroRow: 1},
	{name: "single row", rows: 1, k: 300, expLo: -8, expHi: 8, pZeroBlock: 0.1, pTinyBlock: 0.1, pNegZero: 0.05},
}

// quantizeBoth runs QuantizeMatrix and QuantizePerRow on src.
func quantizeBoth(t *testing.T, src []uint16, rows, k, kp int) (global refQuantized, perRow refQuantized) {
	t.Helper()
	global.packed, global.scales = make([]byte, rows*kp/2), make([]byte, rows*kp/16)
	sDec, err := QuantizeMatrix(global.packed, global.scales, src, rows, k)
	if err != nil {
		t.Fatalf("QuantizeMatrix: %v", err)
	}
	global.sDec = []float32{sDec}
	perRow.packed, perRow.scales = make([]byte, rows*kp/2), make([]byte, rows*kp/16)
	perRow.sDec = make([]float32, rows)
	if err := QuantizePerRow(perRow.packed, perRow.scales, perRow.sDec, src, rows, k); err != nil {
		t.Fatalf("QuantizePerRow: %v", err)
	}
	return global, perRow
}

// compareQuantized checks got against the reference bit for bit.
func compareQuantized(t *testing.T, what string, got, want refQuantized, kp int) {
	t.Helper()
	var log failLog
	for i := range want.sDec {
		if math.Float32bits(got.sDec[i]) != math.Float32bits(want.sDec[i]) {
			log.add("scale %d = %s, want %s", i, fbits(got.sDec[i]), fbits(want.sDec[i]))
		}
	}
	for i := range want.scales {
		if got.scales[i] != want.scales[i] {
			b := want.blocks[i]
			log.add("SF[row %d, block %d] = 0x%02X, want 0x%02X (vmax %s, sdb %s)",
				i/(kp/16), i%(kp/16), got.scales[i], want.scales[i], fbits(b.vmax), fbits(b.sdb))
		}
	}
	for i := range want.packed {
		if got.packed[i] != want.packed[i] {
			e := 2 * i % kp
			b := want.blocks[i/8]
			log.add("packed[row %d, elements %d,%d] = 0x%02X, want 0x%02X (SF 0x%02X, enc %s)",
				2*i/kp, e, e+1, got.packed[i], want.packed[i], b.sf, fbits(b.enc))
		}
	}
	log.report(t, what)
}

// featureCount tallies which edge cases the reference met.
type featureCount struct {
	zeroBlock, underflow, subnormalSF, saturatedSF, clampedEnc, zeroRow, negZero int
}

func (f *featureCount) add(src []uint16, k int, q refQuantized, perRow bool) {
	for _, b := range q.blocks {
		switch {
		case b.sf == 0 && b.vmax == 0:
			f.zeroBlock++
		case b.sf == 0:
			f.underflow++
		case b.sf < 0x08:
			f.subnormalSF++
		case b.sf == 0x7E:
			f.saturatedSF++
		}
	}
	for _, e := range q.sEnc {
		if e == math.MaxFloat32 {
			f.clampedEnc++
		}
	}
	if perRow {
		for r := range q.sDec {
			if refAmax(src[r*k:(r+1)*k]) == 0 && q.sDec[r] == 1 {
				f.zeroRow++
			}
		}
	}
	for _, h := range src {
		if h == 0x8000 {
			f.negZero++
		}
	}
}

// TestQuantizeRandomAgainstReference compares QuantizeMatrix and
// QuantizePerRow with the reference quantizer on random matrices.
func TestQuantizeRandomAgainstReference(t *testing.T) {
	var feat featureCount
	for _, spec := range randomSpecs {
		for seed := range uint64(4) {
			rng := rand.New(rand.NewPCG(seed, 0x5eed))
			src := genMatrix(rng, spec)
			kp := spec.paddedK()
			global, perRow := quantizeBoth(t, src, spec.rows, spec.k, kp)
			wantG := refQuantize(src, spec.rows, spec.k, kp, false)
			wantR := refQuantize(src, spec.rows, spec.k, kp, true)
			compareQuantized(t, fmt.Sprintf("%s (global, seed %d)", spec.name, seed), global, wantG, kp)
			compareQuantized(t, fmt.Sprintf("%s (per-row, seed %d)", spec.name, seed), perRow, wantR, kp)
			feat.add(src, spec.k, wantG, false)
			feat.add(src, spec.k, wantR, true)

			// Padding past k holds code 0, and whole padding blocks SF 0.
			for r := range spec.rows {
				codes := unpack(global.packed[r*kp/2 : (r+1)*kp/2])
				for e := spec.k; e < kp; e++ {
					if c := codes[e]; c != 0 {
						t.Errorf("%s: padding element (%d,%d) has code %d", spec.name, r, e, c)
					}
				}
				for b := (spec.k + 15) / 16; b < kp/16; b++ {
					if sf := global.scales[r*kp/16+b]; sf != 0 {
						t.Errorf("%s: padding block (%d,%d) has SF 0x%02X", spec.name, r, b, sf)
					}
				}
			}
		}
	}
	// Make sure the generator really reached the edge cases.
	checks := []struct {
		name string
		n    int
	}{
		{"zero blocks", feat.zeroBlock}, {"underflowing blocks (SF 0, vmax > 0)", feat.underflow},
		{"E4M3-subnormal SF", feat.subnormalSF}, {"SF 0x7E", feat.saturatedSF},
		{"S_enc clamped to FLT_MAX", feat.clampedEnc}, {"zero rows (per-row scale 1)", feat.zeroRow},
		{"-0 elements", feat.negZero},
	}
	for _, c := range checks {
		if c.n == 0 {
			t.Errorf("random matrices never produced %s", c.name)
		}
	}
	t.Logf("features: %+v", feat)
}

// TestQuantizeRowSaturation calls QuantizeRow with an S_enc larger than the
// row's amax implies, so that sdb exceeds 448 (and even overflows).
func TestQuantizeRowSaturation(t *testing.T) {
	cases := []struct {
		name   string
		row    []float32
		sEnc   float32
		wantSF []byte // nil: reference only
	}{
		{"sEnc 1e6", exampleBlock, 1e6, []byte{0x7E}},
		{"sEnc 3000 (sdb just above 448)", exampleBlock, 3000, []byte{0x7E}},
		{"sEnc FLT_MAX, sdb overflows to Inf", []float32{1e30, -3, 1, 0}, math.MaxFloat32, []byte{0x7E}},
		{"sEnc FLT_MAX, ordinary values", exampleBlock, math.MaxFloat32, []byte{0x7E}},
		{"two blocks, one saturating", append(append([]float32{}, exampleBlock...), 1e-3, 2e-3, -4e-3), 1e4, nil},
		{"S_dec subnormal", []float32{1e-30, 2e-30, -3e-30}, 1e36, nil},
	}
	for _, c := range cases {
		var one float32 = 1
		sEnc, sDec := c.sEnc, one/c.sEnc
		src := toBF16Rounded(c.row)
		kp := PaddedK(len(src))
		packed, scales := make([]byte, kp/2), make([]byte, kp/16)
		if err := QuantizeRow(packed, scales, src, sEnc, sDec); err != nil {
			t.Fatal(err)
		}
		wantP, wantS, _ := refQuantizeRow(src, kp, sEnc, sDec)
		checkBytes(t, c.name+": packed", packed, wantP)
		checkBytes(t, c.name+": SF", scales, wantS)
		if c.wantSF != nil {
			checkBytes(t, c.name+": SF (expected)", scales, c.wantSF)
		}
	}
}

// TestUnderflowBlockCodes pins section 3's pseudo-code for a block whose
// scale underflows (SF 0, enc = FLT_MAX): q_i = e2m1(RN(x_i * FLT_MAX)).
// Elements of normal size saturate to +-6 as section 7 says, but BF16
// subnormals and the smallest normals do not: 2^-127 * FLT_MAX ~= 2 -> code 4.
func TestUnderflowBlockCodes(t *testing.T) {
	row := make([]uint16, 32)
	row[0] = 0x447a // 1000: the amax, S_enc = RN(2688/1000)
	blk := []struct {
		h    uint16
		want uint8
	}{
		{0x3a83, 7},  // ~1e-3: saturates to 6
		{0xba83, 15}, // ~-1e-3
		{0x0000, 0},  // +0
		{0x8000, 8},  // -0
		{0x0001, 0},  // 2^-133 * FLT_MAX ~= 0.031
		{0x0010, 1},  // 2^-129 * FLT_MAX ~= 0.49999997
		{0x0040, 4},  // 2^-127 * FLT_MAX ~= 1.9999999
		{0x0060, 5},  // 1.5 * 2^-127 * FLT_MAX ~= 2.9999998
		{0x0080, 6},  // 2^-126 * FLT_MAX ~= 3.9999998
		{0x00a0, 6},  // 1.25 * 2^-126 * FLT_MAX ~= 4.9999995
		{0x80c0, 15}, // -1.5 * 2^-126 * FLT_MAX ~= -5.9999995
		{0x3a00, 7},  // 2^-11
	}
	for i, e := range blk {
		row[16+i] = e.h
	}
	sEnc, sDec := EncodeScale(AmaxBF16(row))
	packed, scales := make([]byte, 16), make([]byte, 2)
	if err := QuantizeRow(packed, scales, row, sEnc, sDec); err != nil {
		t.Fatal(err)
	}
	if scales[1] != 0 {
		t.Fatalf("block 1 SF = 0x%02X, want 0x00 (underflow)", scales[1])
	}
	codes := unpack(packed[8:])
	for i, e := range blk {
		if codes[i] != e.want {
			t.Errorf("element 0x%04x in an underflowed block: code %d, want %d", e.h, codes[i], e.want)
		}
	}
	wantP, wantS, _ := refQuantizeRow(row, 32, sEnc, sDec)
	checkBytes(t, "packed vs reference", packed, wantP)
	checkBytes(t, "SF vs reference", scales, wantS)
}

// toBF16Rounded rounds float32 values to BF16 (nearest even) with its own
// arithmetic, for test inputs that need not be exact.
func toBF16Rounded(xs []float32) []uint16 {
	out := make([]uint16, len(xs))
	for i, x := range xs {
		b := math.Float32bits(x)
		b += 0x7fff + (b>>16)&1
		out[i] = uint16(b >> 16)
	}
	return out
}

// TestQuantizeErrors: geometry errors are reported, not panics.
func TestQuantizeErrors(t *testing.T) {
	cases := []struct {
		name                        string
		rows, k, nPacked, nSc, nSrc int
		nRowScales                  int
	}{
		{"zero rows", 0, 16, 0, 0, 0, 0},
		{"zero k", 2, 0, 16, 2, 0, 2},
		{"negative rows", -1, 16, 8, 1, 16, 1},
		{"packed not split into rows", 3, 16, 25, 3, 48, 3},
		{"kp not a multiple of 16", 2, 8, 8, 1, 16, 2},
		{"kp < k", 2, 40, 32, 4, 80, 2},
		{"scales too short", 2, 16, 16, 1, 32, 2},
		{"scales too long", 2, 16, 16, 3, 32, 2},
		{"source too short", 2, 16, 16, 2, 31, 2},
		{"source too long", 2, 16, 16, 2, 33, 2},
		{"row scales wrong (per-row only)", 2, 16, 16, 2, 32, 3},
	}
	for _, c := range cases {
		packed, scales, src := make([]byte, max(c.nPacked, 0)), make([]byte, c.nSc), make([]uint16, c.nSrc)
		_, errM := QuantizeMatrix(packed, scales, src, c.rows, c.k)
		errR := QuantizePerRow(packed, scales, make([]float32, c.nRowScales), src, c.rows, c.k)
		perRowOnly := c.name == "row scales wrong (per-row only)"
		if (errM == nil) != perRowOnly {
			t.Errorf("%s: QuantizeMatrix error = %v", c.name, errM)
		}
		if errR == nil {
			t.Errorf("%s: QuantizePerRow gave no error", c.name)
		}
	}
	// Dims accepts a valid larger kp.
	if kp, err := Dims(3, 200, 3*128, 3*16); err != nil || kp != 256 {
		t.Errorf("Dims(3, 200, 384, 48) = %d, %v; want 256, nil", kp, err)
	}
}

// TestPaddedK and AmaxBF16 against their definitions.
func TestPaddedKAndAmax(t *testing.T) {
	for k, want := range map[int]int{1: 16, 15: 16, 16: 16, 17: 32, 200: 208, 256: 256} {
		if got := PaddedK(k); got != want {
			t.Errorf("PaddedK(%d) = %d, want %d", k, got, want)
		}
	}
	rng := rand.New(rand.NewPCG(7, 7))
	for i := range 2000 {
		src := make([]uint16, 1+rng.IntN(40))
		for j := range src {
			switch rng.IntN(4) {
			case 0:
				src[j] = randSub(rng)
			case 1:
				src[j] = uint16(rng.IntN(2)) << 15
			default:
				src[j] = randNormal(rng, -126, 127)
			}
		}
		if got, want := AmaxBF16(src), refAmax(src); math.Float32bits(got) != math.Float32bits(want) {
			t.Fatalf("case %d: AmaxBF16 = %s, want %s", i, fbits(got), fbits(want))
		}
	}
	if a := AmaxBF16([]uint16{0x8000, 0x3f80, 0x7fc0}); !math.IsNaN(float64(a)) {
		t.Errorf("AmaxBF16 with NaN = %v, want NaN", a)
	}
	if a := AmaxBF16([]uint16{0xff80, 0x3f80}); !math.IsInf(float64(a), 1) {
		t.Errorf("AmaxBF16 with -Inf = %v, want +Inf", a)
	}
}

func TestQuantizeRowGeometry(t *testing.T) {
	row := make([]uint16, 33)
	for _, tc := range []struct {
		name           string
		packed, scales int
	}{
		{"row longer than the blocks", 16, 2},
		{"packed and scales disagree", 8, 3},
	} {
		if err := QuantizeRow(make([]byte, tc.packed), make([]byte, tc.scales), row, 1, 1); err == nil {
			t.Errorf("%s: no error", tc.name)
		}
	}
	if err := QuantizeRow(make([]byte, 24), make([]byte, 3), row, 1, 1); err != nil {
		t.Errorf("33 values into 3 blocks: %v", err)
	}
}
