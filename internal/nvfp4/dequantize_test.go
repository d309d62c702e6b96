package nvfp4

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// boundStats counts what checkDequantRow could and could not bound.
type boundStats struct {
	bounded, underflow, unscaled, exact int
}

// checkDequantRow checks the dequantized row xhat (DequantizeRow's output,
// len(x) elements) against the original values x of a row quantized into
// codes/scales with decode scale sDec (S_dec or per_token_scale):
//
//   - xhat[i] is exactly (e2m1(q) * f32(SF)) * sDec, computed in float32;
//   - a block with SF 0x00 dequantizes to zeros (it underflowed, or was zero);
//   - otherwise, when the block scale s = f32(SF)*sDec is a normal float32
//     (so that enc = RN(1/s) is accurate and not clamped to FLT_MAX),
//     |x - xhat| <= 0.5 * s * 2 (half the largest E2M1 gap, 4..6), with a
//     relative slack of 2^-10 for the float32 roundings. A block whose SF is
//     an E4M3 subnormal (0x01..0x07) can be under-scaled by up to 50% (its
//     mantissa has 1..3 bits), so elements may also saturate at +-6: there
//     the bound is s + (|x| - 6s);
//   - an element exactly on the block's grid (x == e2m1(c)*f32(SF)*sDec for
//     some code c) comes back exactly.
func checkDequantRow(log *failLog, where string, x, xhat []float32, codes []uint8, scales []byte, sDec float32, st *boundStats) {
	for i := range x {
		sf := scales[i/BlockSize]
		if sf&0x7f == 0x7f {
			log.add("%s: element %d: NaN block scale 0x%02X for finite input", where, i, sf)
			continue
		}
		sfv := refE4M3Value(sf)
		want := refE2M1Value(codes[i]) * sfv * sDec
		if math.Float32bits(xhat[i]) != math.Float32bits(want) {
			log.add("%s: element %d: DequantizeRow = %s, want (e2m1(%X)*%v)*%s = %s", where, i, fbits(xhat[i]), codes[i], sfv, fbits(sDec), fbits(want))
		}
		if sf == 0 {
			st.underflow++
			if xhat[i] != 0 {
				log.add("%s: element %d: SF 0 but xhat = %v", where, i, xhat[i])
			}
			continue
		}
		if s32 := sfv * sDec; s32 < 0x1p-126 {
			st.unscaled++
			continue
		}
		st.bounded++
		s := float64(sfv) * float64(sDec) // exact
		ax := math.Abs(float64(x[i]))
		bound := s * (1 + 0x1p-10)
		if sf < 0x08 {
			bound += max(0, ax-6*s)
		}
		if err := math.Abs(float64(x[i]) - float64(xhat[i])); err > bound {
			log.add("%s: element %d: |x - xhat| = |%s - %s| = %g > bound %g (SF 0x%02X, S_dec %s, code %X)",
				where, i, fbits(x[i]), fbits(xhat[i]), err, bound, sf, fbits(sDec), codes[i])
		}
		for c := range uint8(16) {
			if g := refE2M1Value(c) * sfv * sDec; g == x[i] {
				st.exact++
				if xhat[i] != x[i] {
					log.add("%s: element %d: %s is on the grid (code %X) but came back as %s", where, i, fbits(x[i]), c, fbits(xhat[i]))
				}
				break
			}
		}
	}
}

// refE2M1Value is the float32 value of an E2M1 code (8 is -0).
func refE2M1Value(c uint8) float32 {
	v := float32(refE2M1Table[c&7].v)
	if c&8 != 0 {
		return -v
	}
	return v
}

// dequantizeRows dequantizes each row of q (rows x kp, real width k) and
// checks it; scale(r) is the decode scale of row r.
func dequantizeRows(t *testing.T, where string, src []uint16, q refQuantized, rows, k, kp int, perRow bool, st *boundStats) [][]float32 {
	t.Helper()
	var log failLog
	out := make([][]float32, rows)
	for r := range rows {
		sDec := q.sDec[0]
		if perRow {
			sDec = q.sDec[r]
		}
		packed, scales := q.packed[r*kp/2:(r+1)*kp/2], q.scales[r*kp/16:(r+1)*kp/16]
		xhat := make([]float32, kp)
		for i := range xhat {
			xhat[i] = float32(math.NaN()) // must be overwritten
		}
		DequantizeRow(xhat, packed, scales, sDec)
		x := make([]float32, k)
		for i := range x {
			x[i] = refBF16(src[r*k+i])
		}
		checkDequantRow(&log, fmt.Sprintf("row %d", r), x, xhat[:k], unpack(packed), scales, sDec, st)
		for i := k; i < kp; i++ {
			if xhat[i] != 0 {
				log.add("row %d: padding element %d dequantizes to %v", r, i, xhat[i])
			}
		}
		// A shorter dst is allowed and leaves the rest alone.
		short := []float32{42, 42, 42}
		DequantizeRow(short[:min(2, k)], packed, scales, sDec)
		if short[2] != 42 || short[0] != xhat[0] {
			log.add("row %d: DequantizeRow on a short dst wrote %v", r, short)
		}
		out[r] = xhat[:k]
	}
	log.report(t, where)
	return out
}

// TestDequantizeBound: on the random matrices, every dequantized element is
// within the format's error bound of its original.
func TestDequantizeBound(t *testing.T) {
	var st boundStats
	for _, spec := range randomSpecs {
		for seed := range uint64(4) {
			rng := rand.New(rand.NewPCG(seed, 0xdec))
			src := genMatrix(rng, spec)
			kp := spec.paddedK()
			global, perRow := quantizeBoth(t, src, spec.rows, spec.k, kp)
			dequantizeRows(t, fmt.Sprintf("%s (global, seed %d)", spec.name, seed), src, global, spec.rows, spec.k, kp, false, &st)
			dequantizeRows(t, fmt.Sprintf("%s (per-row, seed %d)", spec.name, seed), src, perRow, spec.rows, spec.k, kp, true, &st)
		}
	}
	if st.bounded == 0 || st.exact == 0 {
		t.Errorf("nothing checked: %+v", st)
	}
	t.Logf("elements: %+v", st)
}

// TestDequantizeExact builds matrices whose elements lie exactly on the NVFP4
// grid: x = e2m1(c) * f32(SF) * 2^-n, with a power-of-two S_enc = 2^n (the
// amax 2688*2^-n is present) and one +-6 code in every block, so SF is
// recovered. Quantization must reproduce the chosen SF bytes and codes, and
// dequantization must give x back exactly.
func TestDequantizeExact(t *testing.T) {
	for seed := range uint64(40) {
		rng := rand.New(rand.NewPCG(seed, 0xe4))
		n := -100 + rng.IntN(211) // S_enc = 2^n, S_dec = 2^-n, everything stays a normal BF16
		rows, blocks := 1+rng.IntN(5), 1+rng.IntN(6)
		k := 16 * blocks
		wantSF := make([]byte, rows*blocks)
		wantCodes := make([]uint8, rows*k)
		src := make([]uint16, rows*k)
		for b := range wantSF {
			wantSF[b] = uint8(0x08 + rng.IntN(0x7E-0x08+1)) // normal E4M3
			if b == 0 {
				wantSF[b] = 0x7E // carries the amax
			}
			codes := wantCodes[b*16 : b*16+16]
			for i := range codes {
				codes[i] = uint8(rng.IntN(16))
			}
			codes[rng.IntN(16)] = 7 | uint8(rng.IntN(2))<<3
			for i, c := range codes {
				x := float64(refE2M1Value(c)) * refE4M3Values[wantSF[b]] * math.Ldexp(1, -n)
				f := float32(x)
				if float64(f) != x || math.Float32bits(f)&0xffff != 0 {
					t.Fatalf("seed %d: %g is not a BF16", seed, x)
				}
				src[b*16+i] = uint16(math.Float32bits(f) >> 16)
			}
		}
		packed, scales := make([]byte, rows*k/2), make([]byte, rows*blocks)
		sDec, err := QuantizeMatrix(packed, scales, src, rows, k)
		if err != nil {
			t.Fatal(err)
		}
		where := fmt.Sprintf("seed %d (n=%d, %dx%d)", seed, n, rows, k)
		checkBits(t, where+": S_dec", sDec, math.Float32bits(float32(math.Ldexp(1, -n))))
		checkBytes(t, where+": SF", scales, wantSF)
		checkBytes(t, where+": codes", unpack(packed), wantCodes)
		xhat := make([]float32, k)
		for r := range rows {
			DequantizeRow(xhat, packed[r*k/2:(r+1)*k/2], scales[r*blocks:(r+1)*blocks], sDec)
			for i, v := range xhat {
				if x := refBF16(src[r*k+i]); math.Float32bits(v) != math.Float32bits(x) {
					t.Errorf("%s: (%d,%d): dequantized %s, want %s", where, r, i, fbits(v), fbits(x))
				}
			}
		}
	}
}

// TestRoundTrip: quantize, dequantize, round to BF16, requantize with the
// same S_enc / S_dec gives the same bytes.
//
// It is exact for every block whose SF is a normal E4M3 (0x08..0x7E) with a
// block scale s = f32(SF)*S_dec >= 2^-120, and for all-zero blocks: the block
// max then has code +-6, so the dequantized block max is 6*s within BF16
// rounding (2^-9 relative), which maps back to the same SF and codes. Blocks
// that underflowed (SF 0 with nonzero input) or have an E4M3-subnormal SF do
// not round-trip (their largest element need not be +-6) and are skipped.
func TestRoundTrip(t *testing.T) {
	compared := 0
	for _, spec := range randomSpecs {
		for seed := range uint64(4) {
			rng := rand.New(rand.NewPCG(seed, 0x77))
			src := genMatrix(rng, spec)
			kp := spec.paddedK()
			global, perRow := quantizeBoth(t, src, spec.rows, spec.k, kp)
			for mode, q := range []refQuantized{global, perRow} {
				var log failLog
				for r := range spec.rows {
					row := src[r*spec.k : (r+1)*spec.k]
					amax := AmaxBF16(src)
					if mode == 1 {
						amax = AmaxBF16(row)
					}
					sEnc, sDec := EncodeScale(amax)
					packed, scales := q.packed[r*kp/2:(r+1)*kp/2], q.scales[r*kp/16:(r+1)*kp/16]
					xhat := make([]float32, spec.k)
					DequantizeRow(xhat, packed, scales, sDec)
					p2, s2 := make([]byte, kp/2), make([]byte, kp/16)
					if err := QuantizeRow(p2, s2, toBF16Rounded(xhat), sEnc, sDec); err != nil {
						t.Fatal(err)
					}
					for b, sf := range scales {
						lo, hi := b*16, min(b*16+16, spec.k)
						if lo >= spec.k {
							break
						}
						zero := refAmax(row[lo:hi]) == 0
						normal := sf >= 0x08 && sf <= 0x7E && refE4M3Value(sf)*sDec >= 0x1p-120
						if !zero && !normal {
							continue
						}
						compared++
						if s2[b] != sf {
							log.add("row %d block %d: SF 0x%02X -> 0x%02X", r, b, sf, s2[b])
						}
						for j := lo / 2; j < (hi+1)/2; j++ {
							if p2[j] != packed[j] {
								log.add("row %d block %d: packed[%d] 0x%02X -> 0x%02X", r, b, j, packed[j], p2[j])
							}
						}
					}
				}
				log.report(t, fmt.Sprintf("%s (mode %d, seed %d)", spec.name, mode, seed))
			}
		}
	}
	if compared == 0 {
		t.Error("no block compared")
	}
	t.Logf("%d blocks compared", compared)

	// Power-of-two S_enc: every dequantized value is exact in BF16, so the
	// whole matrix round-trips through QuantizeMatrix byte for byte.
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 0x2))
		n := -60 + rng.IntN(121)
		rows, k := 1+rng.IntN(6), 16*(1+rng.IntN(6))
		src := make([]uint16, rows*k)
		for i := range src {
			src[i] = randNormal(rng, -n+2, -n+10) // within 8 binades below the amax: SF stays normal
		}
		amax := float32(math.Ldexp(2688, -n))
		src[rng.IntN(len(src))] = uint16(math.Float32bits(amax)>>16) | uint16(rng.IntN(2))<<15
		packed, scales := make([]byte, rows*k/2), make([]byte, rows*k/16)
		sDec, err := QuantizeMatrix(packed, scales, src, rows, k)
		if err != nil {
			t.Fatal(err)
		}
		deq := make([]uint16, rows*k)
		xhat := make([]float32, k)
		for r := range rows {
			DequantizeRow(xhat, packed[r*k/2:(r+1)*k/2], scales[r*k/16:(r+1)*k/16], sDec)
			for i, v := range xhat {
				if math.Float32bits(v)&0xffff != 0 {
					t.Fatalf("seed %d: dequantized %s is not exact in BF16", seed, fbits(v))
				}
				deq[r*k+i] = uint16(math.Float32bits(v) >> 16)
			}
		}
		p2, s2 := make([]byte, rows*k/2), make([]byte, rows*k/16)
		sDec2, err := QuantizeMatrix(p2, s2, deq, rows, k)
		if err != nil {
			t.Fatal(err)
		}
		where := fmt.Sprintf("power-of-two seed %d", seed)
		checkBits(t, where+": S_dec", sDec2, math.Float32bits(sDec))
		checkBytes(t, where+": SF", s2, scales)
		checkBytes(t, where+": packed", p2, packed)
	}
}
