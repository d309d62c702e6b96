package kernelstest

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/rollout-worker/rollout-worker/internal/bf16"
	"github.com/rollout-worker/rollout-worker/internal/philox"
	"github.com/rollout-worker/rollout-worker/kernels"
)

// roundBF16 rounds a float64 straight to BF16, nearest-even (one rounding,
// not float64 -> float32 -> BF16). Exact for the normal range, which is
// all the tests produce; subnormal results fall back to the FP32 path.
func roundBF16(x float64) uint16 {
	if x != 0 && math.Abs(x) < 0x1p-126 {
		return bf16.FromFloat32(float32(x))
	}
	b := math.Float64bits(x)
	const drop = 52 - 7 // float64 keeps 52 fraction bits, BF16 7
	b += 1<<(drop-1) - 1 + (b>>drop)&1
	b &^= 1<<drop - 1
	return bf16.FromFloat32(float32(math.Float64frombits(b))) // exact, or Inf on overflow
}

// bf16Ord maps a BF16 pattern to an integer that is monotone in its value,
// so ulp distances are differences.
func bf16Ord(h uint16) int {
	if h&0x8000 != 0 {
		return -int(h & 0x7fff)
	}
	return int(h)
}

func bf16Val(h uint16) float64 { return float64(bf16.ToFloat32(h)) }

func testEmbed(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(21, 22))
	const V, H, T = 11, 24, 9
	table := randBF16(r, V*H, 1)
	ids := make([]int32, T)
	for i := range ids {
		ids[i] = int32(r.IntN(V))
	}
	ids[0], ids[T-1] = 0, V-1
	out := alloc(t, be, kernels.BF16, T, H)
	if err := be.Embed(kernels.EmbedArgs{Out: out, Table: bf16Buf(t, be, table, V, H), IDs: i32Buf(t, be, ids, T)}); err != nil {
		t.Fatal(err)
	}
	var want []uint16
	for _, id := range ids {
		want = append(want, table[int(id)*H:(int(id)+1)*H]...)
	}
	expectBytes(t, "out", download(t, be, out), kernels.Uint16Bytes(want), 2*H)
}

func testRMSNorm(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(23, 24))
	const eps = 1e-6
	for _, tc := range []struct {
		rows, d int
		inPlace bool
	}{{7, 64, false}, {12, 8, false}, {5, 96, true}} {
		t.Run(fmt.Sprintf("%dx%d_inplace=%v", tc.rows, tc.d, tc.inPlace), func(t *testing.T) {
			x := randBF16(r, tc.rows*tc.d, 1)
			clear(x[tc.d : 2*tc.d]) // a zero row: r = 1/sqrt(eps)
			for i, scale := range []float32{1e3, 1e-3} {
				row := x[(2+i)*tc.d : (3+i)*tc.d]
				for j := range row {
					row[j] = bf16.FromFloat32(bf16.ToFloat32(row[j]) * scale)
				}
			}
			w := make([]uint16, tc.d)
			for i := range w {
				w[i] = bf16.FromFloat32(float32(1 + 0.2*r.NormFloat64()))
			}
			src := bf16Buf(t, be, x, tc.rows, tc.d)
			out := src
			if !tc.inPlace {
				out = alloc(t, be, kernels.BF16, tc.rows, tc.d)
			}
			if err := be.RMSNorm(kernels.RMSNormArgs{Out: out, Src: src, Weight: bf16Buf(t, be, w, tc.d), Eps: eps}); err != nil {
				t.Fatal(err)
			}
			got := kernels.BytesUint16(download(t, be, out))
			for row := range tc.rows {
				xr := x[row*tc.d : (row+1)*tc.d]
				var ss float64
				for _, h := range xr {
					ss += bf16Val(h) * bf16Val(h)
				}
				rs := 1 / math.Sqrt(ss/float64(tc.d)+float64(float32(eps)))
				for i, h := range xr {
					// The result is monotone in r, so bracketing r by the
					// FP32 error of the sum and of rsqrt brackets the output.
					ref := func(r float64) int {
						return bf16Ord(roundBF16(bf16Val(w[i]) * bf16Val(roundBF16(bf16Val(h)*r))))
					}
					lo, hi := ref(rs*(1-0x1p-16)), ref(rs*(1+0x1p-16))
					lo, hi = min(lo, hi), max(lo, hi)
					if g := bf16Ord(got[row*tc.d+i]); g < lo || g > hi {
						t.Fatalf("out[%d,%d] = %g, want %g", row, i, bf16Val(got[row*tc.d+i]), bf16Val(roundBF16(bf16Val(w[i])*bf16Val(roundBF16(bf16Val(h)*rs)))))
					}
				}
			}
		})
	}
}

// testQKVPrep: QKVPrep equals RMSNorm of the q and k heads, RoPE and
// KVWrite called one by one: bitwise without the norms; with them each
// value within one BF16 step (a backend may order the norm's sum its own
// way).
func testQKVPrep(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(29, 30))
	const T, qh, kvh, maxPos, pages, ps, eps = 5, 8, 2, 64, 4, 8, 1e-6
	for _, d := range []int{16, 128} {
		for _, norm := range []bool{false, true} {
			t.Run(fmt.Sprintf("d%d_norm=%v", d, norm), func(t *testing.T) {
				q, k, v := randBF16(r, T*qh*d, 1), randBF16(r, T*kvh*d, 1), randBF16(r, T*kvh*d, 1)
				cos, sin := randBF16(r, maxPos*d/2, 0.5), randBF16(r, maxPos*d/2, 0.5)
				qw, kw := randBF16(r, d, 1), randBF16(r, d, 1)
				pos, slots := []int32{3, 0, 63, 17, 5}, []int32{9, -1, 31, 0, 12}
				type run struct{ q, k, ck, cv []byte }
				do := func(fused bool) run {
					Q, K, V := bf16Buf(t, be, q, T, qh, d), bf16Buf(t, be, k, T, kvh, d), bf16Buf(t, be, v, T, kvh, d)
					cache := kernels.KVCache{K: alloc(t, be, kernels.BF16, pages, ps, kvh, d), V: alloc(t, be, kernels.BF16, pages, ps, kvh, d)}
					P, S := i32Buf(t, be, pos, T), i32Buf(t, be, slots, T)
					C, Sn := bf16Buf(t, be, cos, maxPos, d/2), bf16Buf(t, be, sin, maxPos, d/2)
					var QW, KW *kernels.Buffer
					if norm {
						QW, KW = bf16Buf(t, be, qw, d), bf16Buf(t, be, kw, d)
					}
					if fused {
						err := be.QKVPrep(kernels.QKVPrepArgs{Q: Q, K: K, V: V, QNorm: QW, KNorm: KW, Eps: eps, Positions: P, Cos: C, Sin: Sn,
							Cache: cache, Slots: S})
						if err != nil {
							t.Fatal(err)
						}
					} else {
						if norm {
							q2, err := Q.Reshape(T*qh, d)
							if err != nil {
								t.Fatal(err)
							}
							k2, err := K.Reshape(T*kvh, d)
							if err != nil {
								t.Fatal(err)
							}
							for _, a := range []kernels.RMSNormArgs{{Out: q2, Src: q2, Weight: QW, Eps: eps}, {Out: k2, Src: k2, Weight: KW, Eps: eps}} {
								if err := be.RMSNorm(a); err != nil {
									t.Fatal(err)
								}
							}
						}
						for _, x := range []*kernels.Buffer{Q, K} {
							if err := be.RoPE(kernels.RoPEArgs{X: x, Positions: P, Cos: C, Sin: Sn}); err != nil {
								t.Fatal(err)
							}
						}
						if err := be.KVWrite(kernels.KVWriteArgs{Cache: cache, K: K, V: V, Slots: S}); err != nil {
							t.Fatal(err)
						}
					}
					return run{download(t, be, Q), download(t, be, K), download(t, be, cache.K), download(t, be, cache.V)}
				}
				want, got := do(false), do(true)
				expectBytes(t, "cache.v", got.cv, want.cv, 2*kvh*d)
				for _, c := range []struct {
					name      string
					got, want []byte
				}{{"q", got.q, want.q}, {"k", got.k, want.k}, {"cache.k", got.ck, want.ck}} {
					if !norm {
						expectBytes(t, c.name, c.got, c.want, 2*d)
						continue
					}
					g, w := kernels.BytesUint16(c.got), kernels.BytesUint16(c.want)
					for i := range g {
						if diff := bf16Ord(g[i]) - bf16Ord(w[i]); diff < -1 || diff > 1 {
							t.Fatalf("%s[%d] = %g, the ops one by one give %g", c.name, i, bf16Val(g[i]), bf16Val(w[i]))
						}
					}
				}
			})
		}
	}
}

// testAddRMSNorm: RMSNorm with a residual equals Add then RMSNorm, bit for
// bit, both the updated residual stream and the norm.
func testAddRMSNorm(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(27, 28))
	const eps = 1e-6
	for _, d := range []int{8, 96, 128, 2048} {
		t.Run(fmt.Sprint(d), func(t *testing.T) {
			const rows = 6
			h, res := randBF16(r, rows*d, 1), randBF16(r, rows*d, 0.3)
			w := randBF16(r, d, 1)
			weight, resB := bf16Buf(t, be, w, d), bf16Buf(t, be, res, rows, d)
			h1, out1 := bf16Buf(t, be, h, rows, d), alloc(t, be, kernels.BF16, rows, d)
			if err := be.Add(kernels.AddArgs{Out: h1, A: h1, B: resB}); err != nil {
				t.Fatal(err)
			}
			if err := be.RMSNorm(kernels.RMSNormArgs{Out: out1, Src: h1, Weight: weight, Eps: eps}); err != nil {
				t.Fatal(err)
			}
			h2, out2 := bf16Buf(t, be, h, rows, d), alloc(t, be, kernels.BF16, rows, d)
			if err := be.RMSNorm(kernels.RMSNormArgs{Out: out2, Src: h2, Weight: weight, Eps: eps, Residual: resB}); err != nil {
				t.Fatal(err)
			}
			expectBytes(t, "src", download(t, be, h2), download(t, be, h1), 2*d)
			expectBytes(t, "out", download(t, be, out2), download(t, be, out1), 2*d)
		})
	}
}

func testAdd(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(25, 26))
	const R, C = 5, 37
	a, b := randBF16(r, R*C, 1), randBF16(r, R*C, 1e-3)
	b[3] = bf16.FromFloat32(1e-30) // far below a's ulp: the FP32 sum rounds
	want := make([]uint16, R*C)
	for i := range want {
		want[i] = bf16.FromFloat32(bf16.ToFloat32(a[i]) + bf16.ToFloat32(b[i]))
	}
	A, B := bf16Buf(t, be, a, R, C), bf16Buf(t, be, b, R, C)
	out := alloc(t, be, kernels.BF16, R, C)
	if err := be.Add(kernels.AddArgs{Out: out, A: A, B: B}); err != nil {
		t.Fatal(err)
	}
	expectBytes(t, "out", download(t, be, out), kernels.Uint16Bytes(want), 2*C)
	// In place, the residual stream's form: A += B.
	if err := be.Add(kernels.AddArgs{Out: A, A: A, B: B}); err != nil {
		t.Fatal(err)
	}
	expectBytes(t, "in-place out", download(t, be, A), kernels.Uint16Bytes(want), 2*C)
}

func testRoPE(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(27, 28))
	const T, heads, D, maxPos = 5, 3, 16, 32
	cos, sin := make([]uint16, maxPos*D/2), make([]uint16, maxPos*D/2)
	for p := range maxPos {
		for i := range D / 2 {
			angle := float64(p) * math.Pow(10000, -2*float64(i)/D)
			cos[p*D/2+i], sin[p*D/2+i] = roundBF16(math.Cos(angle)), roundBF16(math.Sin(angle))
		}
	}
	pos := []int32{0, 3, maxPos - 1, 7, 7}
	x := randBF16(r, T*heads*D, 1)
	X := bf16Buf(t, be, x, T, heads, D)
	err := be.RoPE(kernels.RoPEArgs{X: X, Positions: i32Buf(t, be, pos, T), Cos: bf16Buf(t, be, cos, maxPos, D/2), Sin: bf16Buf(t, be, sin, maxPos, D/2)})
	if err != nil {
		t.Fatal(err)
	}
	got := kernels.BytesUint16(download(t, be, X))
	for tok := range T {
		for h := range heads {
			row := x[(tok*heads+h)*D:][:D]
			for i := range D / 2 {
				c, s := bf16Val(cos[int(pos[tok])*D/2+i]), bf16Val(sin[int(pos[tok])*D/2+i])
				x1, x2 := bf16Val(row[i]), bf16Val(row[i+D/2])
				want := [2]uint16{
					roundBF16(bf16Val(roundBF16(x1*c)) - bf16Val(roundBF16(x2*s))),
					roundBF16(bf16Val(roundBF16(x2*c)) + bf16Val(roundBF16(x1*s))),
				}
				for j, idx := range []int{i, i + D/2} {
					g := got[(tok*heads+h)*D+idx]
					if d := bf16Ord(g) - bf16Ord(want[j]); d < -1 || d > 1 {
						t.Fatalf("x[%d,%d,%d] = %g, want %g (1 ulp)", tok, h, idx, bf16Val(g), bf16Val(want[j]))
					}
				}
			}
		}
	}
}

func testKVWrite(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(29, 30))
	const pages, ps, kvh, D, T = 5, 4, 2, 8, 6
	row := kvh * D
	ck, cv := randBF16(r, pages*ps*row, 1), randBF16(r, pages*ps*row, 1)
	cache := kernels.KVCache{K: bf16Buf(t, be, ck, pages, ps, kvh, D), V: bf16Buf(t, be, cv, pages, ps, kvh, D)}
	k, v := randBF16(r, T*row, 1), randBF16(r, T*row, 1)
	slots := make([]int32, T)
	for i, s := range r.Perm(pages*ps - 1)[:T] {
		slots[i] = int32(s)
	}
	slots[0] = pages*ps - 1 // the last slot of the last page
	slots[3] = -1           // a padding row: writes nothing
	err := be.KVWrite(kernels.KVWriteArgs{Cache: cache, K: bf16Buf(t, be, k, T, kvh, D), V: bf16Buf(t, be, v, T, kvh, D), Slots: i32Buf(t, be, slots, T)})
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range slots {
		if s < 0 {
			continue
		}
		copy(ck[int(s)*row:], k[i*row:(i+1)*row])
		copy(cv[int(s)*row:], v[i*row:(i+1)*row])
	}
	expectBytes(t, "cache.k", download(t, be, cache.K), kernels.Uint16Bytes(ck), 2*row)
	expectBytes(t, "cache.v", download(t, be, cache.V), kernels.Uint16Bytes(cv), 2*row)
}

// attnSetup is a paged cache holding a few sequences on scattered pages,
// with a query vector for every position of every sequence.
type attnSetup struct {
	pages, ps, kvh, qh, d, maxPages int
	scale                           float32
	ck, cv                          []uint16
	cache                           kernels.KVCache
	lens                            []int
	table                           [][]int32  // per sequence, maxPages entries, -1 past its length
	q                               [][]uint16 // per sequence: [len, qh, d]
}

func newAttnSetup(t *testing.T, be kernels.Backend, r *rand.Rand, g attnGeometry) *attnSetup {
	s := &attnSetup{pages: g.pages, ps: g.ps, kvh: g.kvh, qh: g.qh, d: g.d, maxPages: g.maxPages, scale: g.scale, lens: g.lens}
	n := s.pages * s.ps * s.kvh * s.d
	// Unused slots hold values too: reading one would change a result.
	s.ck, s.cv = randBF16(r, n, 1), randBF16(r, n, 1)
	shape := []int{s.pages, s.ps, s.kvh, s.d}
	s.cache = kernels.KVCache{K: bf16Buf(t, be, s.ck, shape...), V: bf16Buf(t, be, s.cv, shape...)}
	perm := r.Perm(s.pages)
	for _, l := range s.lens {
		row := slices.Repeat([]int32{-1}, s.maxPages)
		for j := range (l + s.ps - 1) / s.ps {
			row[j], perm = int32(perm[0]), perm[1:]
		}
		s.table = append(s.table, row)
		s.q = append(s.q, randBF16(r, l*s.qh*s.d, 1))
	}
	return s
}

// attnGeometry is an attnSetup's cache and sequences.
type attnGeometry struct {
	name                            string
	pages, ps, kvh, qh, d, maxPages int
	scale                           float32
	lens                            []int
	cases                           []attnCase
}

// attnCase attends the last nq[i] positions of every sequence i.
type attnCase struct {
	name string
	nq   []int
}

// run attends the last nq[i] positions of sequences seqs[i] in one call and
// returns the output rows.
func (s *attnSetup) run(t *testing.T, be kernels.Backend, seqs, nq []int) []uint16 {
	t.Helper()
	lens := make([]int, len(seqs))
	for i, seq := range seqs {
		lens[i] = s.lens[seq]
	}
	return s.runAt(t, be, seqs, nq, lens, nil)
}

// runAt is run with sequence i cut to its first lens[i] positions, and
// the given scratch (nil: none).
func (s *attnSetup) runAt(t *testing.T, be kernels.Backend, seqs, nq, lens []int, scratch *kernels.Buffer) []uint16 {
	t.Helper()
	var table, lens32, start []int32
	var q []uint16
	start = append(start, 0)
	for i, seq := range seqs {
		l := lens[i]
		table = append(table, s.table[seq]...)
		lens32 = append(lens32, int32(l))
		start = append(start, start[i]+int32(nq[i]))
		q = append(q, s.q[seq][(l-nq[i])*s.qh*s.d:l*s.qh*s.d]...)
	}
	tq := int(start[len(seqs)])
	out := alloc(t, be, kernels.BF16, tq, s.qh, s.d)
	err := be.Attention(kernels.AttentionArgs{
		Out: out, Q: bf16Buf(t, be, q, tq, s.qh, s.d), Cache: s.cache,
		PageTable: i32Buf(t, be, table, len(seqs), s.maxPages), SeqLens: i32Buf(t, be, lens32, len(seqs)),
		QueryStart: i32Buf(t, be, start, len(seqs)+1), Scale: s.scale, Scratch: scratch,
	})
	if err != nil {
		t.Fatal(err)
	}
	return kernels.BytesUint16(download(t, be, out))
}

// ref is the float64 attention of sequence seq's query at position pos.
func (s *attnSetup) ref(seq, pos int) []float64 {
	out := make([]float64, s.qh*s.d)
	for h := range s.qh {
		kvh := h / (s.qh / s.kvh)
		q := s.q[seq][(pos*s.qh+h)*s.d:][:s.d]
		at := func(c []uint16, p int) []uint16 {
			slot := int(s.table[seq][p/s.ps])*s.ps + p%s.ps
			return c[(slot*s.kvh+kvh)*s.d:][:s.d]
		}
		scores := make([]float64, pos+1)
		m := math.Inf(-1)
		for p := range scores {
			for i, k := range at(s.ck, p) {
				scores[p] += bf16Val(q[i]) * bf16Val(k)
			}
			scores[p] *= float64(s.scale)
			m = max(m, scores[p])
		}
		var z float64
		for p := range scores {
			scores[p] = math.Exp(scores[p] - m)
			z += scores[p]
		}
		for p, e := range scores {
			for i, v := range at(s.cv, p) {
				out[h*s.d+i] += e / z * bf16Val(v)
			}
		}
	}
	return out
}

// attnGeometries are testAttention's: a small cache, and one at a real
// model's head geometry (8 query heads a KV head of 128) whose sequences
// are long enough for a backend to split their positions.
var attnGeometries = []attnGeometry{
	{name: "small", pages: 16, ps: 4, kvh: 2, qh: 4, d: 16, maxPages: 5, scale: 0.25, lens: []int{9, 3, 17},
		cases: []attnCase{{"prefill", []int{9, 3, 17}}, {"decode", []int{1, 1, 1}}, {"chunked", []int{4, 1, 17}}}},
	{name: "long", pages: 120, ps: 16, kvh: 2, qh: 16, d: 128, maxPages: 70, scale: 0.088, lens: []int{1100, 530, 45},
		cases: []attnCase{{"decode", []int{1, 1, 1}}, {"chunked", []int{65, 1, 45}}}},
}

func testAttention(t *testing.T, be kernels.Backend) {
	for gi, g := range attnGeometries {
		t.Run(g.name, func(t *testing.T) {
			s := newAttnSetup(t, be, rand.New(rand.NewPCG(31, uint64(32+gi))), g)
			all := []int{0, 1, 2}
			rowLen := s.qh * s.d
			byCase := map[string][]uint16{}
			for _, tc := range g.cases {
				t.Run(tc.name, func(t *testing.T) {
					got := s.run(t, be, all, tc.nq)
					byCase[tc.name] = got
					var ref []float64
					for seq, n := range tc.nq {
						for j := range n {
							ref = append(ref, s.ref(seq, s.lens[seq]-n+j)...)
						}
					}
					var maxRef float64
					for _, v := range ref {
						maxRef = max(maxRef, math.Abs(v))
					}
					for i, g := range got {
						if !closeTo(bf16Val(g), ref[i], maxRef) {
							t.Fatalf("out[%d,%d,%d] = %g, want %g (max %g)", i/rowLen, i/s.d%s.qh, i%s.d, bf16Val(g), ref[i], maxRef)
						}
					}
					// Batch invariance: each sequence alone gives the same bits.
					row := 0
					for seq, n := range tc.nq {
						alone := s.run(t, be, []int{seq}, []int{n})
						if !slices.Equal(alone, got[row*rowLen:(row+n)*rowLen]) {
							t.Fatalf("sequence %d: output changes with the batch", seq)
						}
						row += n
					}
				})
			}
			// A row prefilled with others equals the same position decoded
			// alone (the sequence cut just after it), bitwise, and a
			// backend's scratch changes no bit.
			t.Run("PrefillEqualsDecode", func(t *testing.T) {
				tc := g.cases[len(g.cases)-1]
				got, ok := byCase[tc.name]
				if !ok {
					t.Skip("the prefill case did not run")
				}
				row := 0
				for seq, n := range tc.nq {
					for _, j := range []int{0, n / 2, n - 1} {
						pos := s.lens[seq] - n + j
						dec := s.runAt(t, be, []int{seq}, []int{1}, []int{pos + 1}, nil)
						if !slices.Equal(dec, got[(row+j)*rowLen:(row+j+1)*rowLen]) {
							t.Fatalf("sequence %d position %d: decoded alone differs from its prefill row", seq, pos)
						}
					}
					row += n
				}
				sc, ok := be.(kernels.AttentionScratcher)
				if !ok {
					return
				}
				n := sc.AttentionScratch(len(all), s.qh, s.kvh, s.d, s.maxPages*s.ps)
				if n == 0 {
					return
				}
				scratch := alloc(t, be, kernels.F32, (n+3)/4)
				for _, nq := range [][]int{{1, 1, 1}, tc.nq} {
					lens := []int{s.lens[0], s.lens[1], s.lens[2]}
					with := s.runAt(t, be, all, nq, lens, scratch)
					again := s.runAt(t, be, all, nq, lens, scratch) // the counters were left ready
					without := s.runAt(t, be, all, nq, lens, nil)
					if !slices.Equal(with, without) || !slices.Equal(again, without) {
						t.Fatalf("queries %v: output changes with scratch", nq)
					}
				}
			})
		})
	}
}

// sampleRow is one row of a Sample call.
type sampleRow struct {
	logits  []float32
	temp    float32
	topK    int32
	topP    float32
	seed    uint64
	id, pos int32
}

func runSample(t *testing.T, be kernels.Backend, rows []sampleRow) ([]int32, []float32) {
	t.Helper()
	s, v := len(rows), len(rows[0].logits)
	var logits, temp, topP []float32
	var topK, seeds, ids, pos []int32
	for _, r := range rows {
		logits = append(logits, r.logits...)
		temp, topK, topP = append(temp, r.temp), append(topK, r.topK), append(topP, r.topP)
		seeds = append(seeds, int32(uint32(r.seed)), int32(uint32(r.seed>>32)))
		ids, pos = append(ids, r.id), append(pos, r.pos)
	}
	tokens, lps := alloc(t, be, kernels.I32, s), alloc(t, be, kernels.F32, s)
	err := be.Sample(kernels.SampleArgs{
		Logits: f32Buf(t, be, logits, s, v), Temperature: f32Buf(t, be, temp, s), TopK: i32Buf(t, be, topK, s),
		TopP: f32Buf(t, be, topP, s), Seeds: i32Buf(t, be, seeds, s, 2), SampleIDs: i32Buf(t, be, ids, s),
		Positions: i32Buf(t, be, pos, s), Tokens: tokens, LogProbs: lps,
	})
	if err != nil {
		t.Fatal(err)
	}
	return kernels.BytesInt32(download(t, be, tokens)), kernels.BytesFloat32(download(t, be, lps))
}

// refLogSoftmax is log softmax(logits / temp) in float64 (temp 0: 1).
func refLogSoftmax(logits []float32, temp float32) []float64 {
	tt := float64(temp)
	if tt == 0 {
		tt = 1
	}
	out := make([]float64, len(logits))
	m := math.Inf(-1)
	for i, l := range logits {
		out[i] = float64(l) / tt
		m = max(m, out[i])
	}
	var z float64
	for _, s := range out {
		z += math.Exp(s - m)
	}
	for i := range out {
		out[i] -= m + math.Log(z)
	}
	return out
}

func argmax(x []float32) int {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return best
}

// refDraw is the documented draw in float64. ok is false when the draw is
// too close to a boundary (u against a cumulative probability, or TopP
// against one) for an FP32 pipeline to be held to the same token.
func refDraw(r sampleRow) (tok int, ok bool) {
	const margin = 1e-5
	lp := refLogSoftmax(r.logits, r.temp)
	order := make([]int, len(lp))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		switch {
		case lp[a] > lp[b]:
			return -1
		case lp[a] < lp[b]:
			return 1
		}
		return a - b
	})
	if r.topK > 0 {
		order = order[:r.topK]
	}
	ok = true
	if r.topP < 1 {
		var cum float64
		for j, id := range order {
			cum += math.Exp(lp[id])
			if math.Abs(cum-float64(r.topP)) < margin {
				ok = false
			}
			if cum >= float64(r.topP) {
				order = order[:j+1]
				break
			}
		}
	}
	slices.Sort(order) // the draw walks the kept tokens by id
	var total float64
	for _, id := range order {
		total += math.Exp(lp[id])
	}
	u := philox.Uniform(r.seed, uint32(r.id), uint32(r.pos))
	var cum float64
	for _, id := range order {
		cum += math.Exp(lp[id])
		if math.Abs(cum/total-u) < margin {
			ok = false
		}
		if cum/total > u {
			return id, ok
		}
	}
	return order[len(order)-1], ok
}

// checkLogProb compares a logprob with the float64 reference.
func checkLogProb(t *testing.T, what string, got float32, ref float64) {
	t.Helper()
	if math.Abs(float64(got)-ref) > 1e-5+1e-6*math.Abs(ref) {
		t.Fatalf("%s: logprob %v, want %v", what, got, ref)
	}
}

func testSample(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(33, 34))
	randLogits := func(v int) []float32 {
		l := make([]float32, v)
		for i := range l {
			l[i] = float32(r.NormFloat64() * 2)
		}
		return l
	}

	t.Run("greedy", func(t *testing.T) {
		const V = 50
		var rows []sampleRow
		for i := range 6 {
			rows = append(rows, sampleRow{logits: randLogits(V), topK: int32(i), topP: 1 - 0.1*float32(i), seed: uint64(i)})
		}
		tie := randLogits(V)
		tie[3], tie[7] = 20, 20
		tie[12] = float32(math.Inf(-1)) // masked
		rows = append(rows, sampleRow{logits: tie, topP: 1})
		tokens, lps := runSample(t, be, rows)
		for i, row := range rows {
			want := argmax(row.logits)
			if int(tokens[i]) != want {
				t.Fatalf("row %d: token %d, want the argmax %d", i, tokens[i], want)
			}
			checkLogProb(t, fmt.Sprintf("row %d", i), lps[i], refLogSoftmax(row.logits, 1)[want])
		}
		if tokens[len(rows)-1] != 3 {
			t.Fatalf("tie: token %d, want 3 (the lower id)", tokens[len(rows)-1])
		}
	})

	const V = 64
	var rows []sampleRow
	for i := range 48 {
		logits := randLogits(V)
		if i%3 == 2 { // coarse logits: many ties in probability, ordered by id
			for j := range logits {
				logits[j] = float32(math.Round(float64(logits[j])))
			}
		}
		rows = append(rows, sampleRow{
			logits: logits, temp: []float32{0.3, 0.7, 1, 1.5}[i%4],
			topK: []int32{0, 1, 5, V, 20, 0}[i%6], topP: []float32{1, 0.9, 0.5, 1e-6, 1}[i%5],
			seed: r.Uint64(), id: int32(r.IntN(16)), pos: int32(r.IntN(4096)),
		})
	}
	tokens, lps := runSample(t, be, rows)

	t.Run("reference draws", func(t *testing.T) {
		skipped := 0
		for i, row := range rows {
			want, ok := refDraw(row)
			if !ok {
				skipped++
			} else if int(tokens[i]) != want {
				t.Fatalf("row %d (T %v, top k %d, top p %v): token %d, want %d", i, row.temp, row.topK, row.topP, tokens[i], want)
			}
			// Over the whole vocabulary, before truncation.
			checkLogProb(t, fmt.Sprintf("row %d", i), lps[i], refLogSoftmax(row.logits, row.temp)[tokens[i]])
			if row.topK == 1 || row.topP == 1e-6 {
				if a := argmax(row.logits); int(tokens[i]) != a {
					t.Fatalf("row %d (top k %d, top p %v): token %d, want the argmax %d", i, row.topK, row.topP, tokens[i], a)
				}
			}
		}
		t.Logf("%d of %d draws within 1e-5 of a boundary, not compared", skipped, len(rows))
		if skipped > len(rows)/8 {
			t.Fatalf("%d of %d draws too close to a boundary to check", skipped, len(rows))
		}
	})

	t.Run("deterministic and batch invariant", func(t *testing.T) {
		again, lpAgain := runSample(t, be, rows)
		if !slices.Equal(again, tokens) || !bytes.Equal(kernels.Float32Bytes(lpAgain), kernels.Float32Bytes(lps)) {
			t.Fatal("the same call drew different tokens or logprobs")
		}
		for _, i := range []int{0, 7, len(rows) - 1} {
			tok, lp := runSample(t, be, rows[i:i+1])
			if tok[0] != tokens[i] || math.Float32bits(lp[0]) != math.Float32bits(lps[i]) {
				t.Fatalf("row %d: alone %d (%v), in the batch %d (%v)", i, tok[0], lp[0], tokens[i], lps[i])
			}
		}
	})

	t.Run("extreme temperatures", func(t *testing.T) {
		// Every temperature a request may carry, down to the smallest
		// subnormal: tiny ones put all the probability on the largest
		// logit (logprob 0), the largest spreads it nearly evenly.
		logits := []float32{-3e38, -1, 0, 2.5, 2.5 - 1.0/(1<<21), 1e-7, 3e38, -float32(math.Inf(1))}
		var rows []sampleRow
		for i, temp := range []float32{math.SmallestNonzeroFloat32, 1e-38, 1e-30, 1e-6, 0.01} {
			rows = append(rows, sampleRow{logits: logits, temp: temp, topP: 1, seed: 9, id: int32(i), pos: 5})
		}
		mild := []float32{1, 2, 3, 4, 2.5 + 1.0/(1<<21), 2.5, 0, -1}
		for i, temp := range []float32{math.SmallestNonzeroFloat32, 1e-30, 1e-6} {
			rows = append(rows, sampleRow{logits: mild, temp: temp, topK: int32(i), topP: 1, seed: 10, id: int32(i), pos: 6})
		}
		rows = append(rows, sampleRow{logits: mild, temp: 1e6, topP: 1, seed: 11, pos: 7})
		tokens, lps := runSample(t, be, rows)
		for i, row := range rows[:len(rows)-1] {
			want := argmax(row.logits)
			if int(tokens[i]) != want || lps[i] != 0 {
				t.Fatalf("row %d (T %v): token %d logprob %v, want the argmax %d with logprob 0", i, row.temp, tokens[i], lps[i], want)
			}
		}
		last := len(rows) - 1
		if tokens[last] < 0 || int(tokens[last]) >= len(mild) {
			t.Fatalf("T 1e6: token %d, want one of the vocabulary", tokens[last])
		}
		checkLogProb(t, "T 1e6", lps[last], refLogSoftmax(mild, 1e6)[tokens[last]])
	})

	t.Run("unsampleable rows fail alone", func(t *testing.T) {
		const V = 40
		inf := float32(math.Inf(1))
		good := sampleRow{logits: randLogits(V), temp: 0.8, topK: 7, topP: 0.9, seed: 12, id: 1, pos: 3}
		greedy := sampleRow{logits: randLogits(V), topP: 1}
		poison := func(set func(l []float32)) []float32 {
			l := randLogits(V)
			set(l)
			return l
		}
		bad := []sampleRow{
			{logits: poison(func(l []float32) { l[17] = float32(math.NaN()) }), temp: 1, topP: 1},
			{logits: poison(func(l []float32) { l[0] = inf }), temp: 0.5, topP: 1},
			{logits: poison(func(l []float32) { l[V-1] = float32(math.NaN()) }), topP: 1}, // greedy
			{logits: poison(func(l []float32) {
				for i := range l {
					l[i] = -inf
				}
			}), temp: 1, topP: 1},
		}
		rows := append([]sampleRow{good}, bad...)
		rows = append(rows, greedy)
		tokens, lps := runSample(t, be, rows)
		for i := 1; i <= len(bad); i++ {
			if tokens[i] != kernels.UnsampledToken || !math.IsNaN(float64(lps[i])) {
				t.Fatalf("bad row %d: token %d logprob %v, want %d and NaN", i, tokens[i], lps[i], kernels.UnsampledToken)
			}
		}
		for _, i := range []int{0, len(rows) - 1} {
			tok, lp := runSample(t, be, rows[i:i+1])
			if tok[0] != tokens[i] || math.Float32bits(lp[0]) != math.Float32bits(lps[i]) {
				t.Fatalf("row %d: alone %d (%v), next to unsampleable rows %d (%v)", i, tok[0], lp[0], tokens[i], lps[i])
			}
		}
	})

	t.Run("statistics", func(t *testing.T) {
		// V = 4 with probabilities 0.1 .. 0.4; each case draws n tokens at
		// n positions and checks the frequencies within 5 sigma.
		const n = 4000
		p := []float64{0.1, 0.2, 0.3, 0.4}
		logits := make([]float32, len(p))
		for i, x := range p {
			logits[i] = float32(math.Log(x))
		}
		for c, tc := range []struct {
			temp float32
			topK int32
			topP float32
		}{{1, 0, 1}, {1, 2, 1}, {1, 0, 0.65}, {2, 0, 1}, {0.5, 3, 0.8}} {
			var draws []sampleRow
			for i := range n {
				draws = append(draws, sampleRow{logits: logits, temp: tc.temp, topK: tc.topK, topP: tc.topP, seed: 0x5eed, id: int32(c), pos: int32(i)})
			}
			got, gotLP := runSample(t, be, draws)
			// Expected frequencies: the truncated, renormalised distribution.
			lp := refLogSoftmax(logits, tc.temp)
			q := make([]float64, len(p))
			var total float64                  // of the kept tokens, added in order
			for j := len(p) - 1; j >= 0; j-- { // ids in descending probability
				if tc.topK > 0 && int32(len(p)-1-j) >= tc.topK || total >= float64(tc.topP) {
					break
				}
				q[j] = math.Exp(lp[j])
				total += q[j]
			}
			counts := make([]int, len(p))
			for i, tok := range got {
				counts[tok]++
				if i < 200 { // the logprob and the exact draw, on a subset
					checkLogProb(t, fmt.Sprintf("case %d row %d", c, i), gotLP[i], lp[tok])
					if want, ok := refDraw(draws[i]); ok && int(tok) != want {
						t.Fatalf("case %d row %d: token %d, want %d", c, i, tok, want)
					}
				}
			}
			for j, k := range counts {
				mean := n * q[j] / total
				sigma := math.Sqrt(mean * (1 - q[j]/total))
				if math.Abs(float64(k)-mean) > 5*sigma || q[j] == 0 && k != 0 {
					t.Fatalf("case %+v: token %d drawn %d times of %d, want %.1f ± %.1f", tc, j, k, n, mean, 5*sigma)
				}
			}
		}
	})
}

func testLogProbs(t *testing.T, be kernels.Backend) {
	r := rand.New(rand.NewPCG(35, 36))
	const S, V = 7, 37
	logits := make([]float32, S*V)
	for i := range logits {
		logits[i] = float32(r.NormFloat64() * 3)
	}
	tokens := make([]int32, S)
	for i := range tokens {
		tokens[i] = int32(r.IntN(V))
	}
	tokens[0], tokens[1] = 0, V-1
	logits[2*V+(int(tokens[2])+1)%V] = float32(math.Inf(-1)) // a masked logit elsewhere in the row
	out := alloc(t, be, kernels.F32, S)
	if err := be.LogProbs(kernels.LogProbsArgs{Logits: f32Buf(t, be, logits, S, V), Tokens: i32Buf(t, be, tokens, S), LogProbs: out}); err != nil {
		t.Fatal(err)
	}
	for i, g := range kernels.BytesFloat32(download(t, be, out)) {
		checkLogProb(t, fmt.Sprintf("row %d", i), g, refLogSoftmax(logits[i*V:(i+1)*V], 1)[tokens[i]])
	}
}

// testModelErrors checks shape errors that every backend reports at call
// time (data-dependent errors are backend-specific).
func testModelErrors(t *testing.T, be kernels.Backend) {
	bf := func(shape ...int) *kernels.Buffer { return alloc(t, be, kernels.BF16, shape...) }
	f32 := func(shape ...int) *kernels.Buffer { return alloc(t, be, kernels.F32, shape...) }
	i32 := func(shape ...int) *kernels.Buffer { return alloc(t, be, kernels.I32, shape...) }
	cache := kernels.KVCache{K: bf(4, 2, 2, 8), V: bf(4, 2, 2, 8)}
	sample := func(seeds *kernels.Buffer) kernels.SampleArgs {
		return kernels.SampleArgs{Logits: f32(3, 5), Temperature: f32(3), TopK: i32(3), TopP: f32(3),
			Seeds: seeds, SampleIDs: i32(3), Positions: i32(3), Tokens: i32(3), LogProbs: f32(3)}
	}
	for _, c := range []struct {
		name, op string
		err      error
	}{
		{"embed out width", "embed", be.Embed(kernels.EmbedArgs{Out: bf(3, 9), Table: bf(10, 8), IDs: i32(3)})},
		{"embed ids dtype", "embed", be.Embed(kernels.EmbedArgs{Out: bf(3, 8), Table: bf(10, 8), IDs: f32(3)})},
		{"rmsnorm weight length", "rmsnorm", be.RMSNorm(kernels.RMSNormArgs{Out: bf(2, 8), Src: bf(2, 8), Weight: bf(7), Eps: 1e-6})},
		{"rmsnorm eps", "rmsnorm", be.RMSNorm(kernels.RMSNormArgs{Out: bf(2, 8), Src: bf(2, 8), Weight: bf(8)})},
		{"rmsnorm residual shape", "rmsnorm", be.RMSNorm(kernels.RMSNormArgs{Out: bf(2, 8), Src: bf(2, 8), Weight: bf(8), Eps: 1e-6, Residual: bf(2, 7)})},
		{"add shapes", "add", be.Add(kernels.AddArgs{Out: bf(2, 8), A: bf(2, 8), B: bf(8, 2)})},
		{"rope odd head dim", "rope", be.RoPE(kernels.RoPEArgs{X: bf(2, 1, 7), Positions: i32(2), Cos: bf(4, 3), Sin: bf(4, 3)})},
		{"rope positions", "rope", be.RoPE(kernels.RoPEArgs{X: bf(2, 1, 8), Positions: i32(3), Cos: bf(4, 4), Sin: bf(4, 4)})},
		{"kv write heads", "kv write", be.KVWrite(kernels.KVWriteArgs{Cache: cache, K: bf(3, 1, 8), V: bf(3, 1, 8), Slots: i32(3)})},
		{"kv write cache", "kv write", be.KVWrite(kernels.KVWriteArgs{Cache: kernels.KVCache{K: cache.K, V: bf(4, 2, 2, 4)}, K: bf(3, 2, 8), V: bf(3, 2, 8), Slots: i32(3)})},
		{"attention groups", "attention", be.Attention(kernels.AttentionArgs{Out: bf(2, 3, 8), Q: bf(2, 3, 8), Cache: cache,
			PageTable: i32(1, 2), SeqLens: i32(1), QueryStart: i32(2), Scale: 1})},
		{"attention query start", "attention", be.Attention(kernels.AttentionArgs{Out: bf(2, 4, 8), Q: bf(2, 4, 8), Cache: cache,
			PageTable: i32(1, 2), SeqLens: i32(1), QueryStart: i32(1), Scale: 1})},
		{"sample seeds", "sample", be.Sample(sample(i32(3)))},
		{"logprobs tokens", "logprobs", be.LogProbs(kernels.LogProbsArgs{Logits: f32(3, 5), Tokens: i32(2), LogProbs: f32(3)})},
	} {
		wantError(t, c.name, c.op, c.err)
	}
}
