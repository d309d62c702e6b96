package refit

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
)

// Fuzz targets of the wire parsers. Under plain `go test` they run their
// seed corpora; `go test -run=^$ -fuzz=FuzzParseChunk ./refit` explores.
// Every target checks that the parser does not panic, that a rejection
// wraps ErrProtocol, and that what it accepts satisfies the documented
// invariants and survives a round trip through its encoding.

func FuzzParseChunk(f *testing.F) {
	add := func(c Chunk, payload uint32) {
		h := c.Header()
		f.Add(h.Get(HeaderProtocol), h.Get(HeaderVersion), h.Get(HeaderSeq), h.Get(HeaderOffset),
			h.Get(HeaderTotal), h.Get(HeaderChunks), h.Get(HeaderCRC), payload)
	}
	add(wtChunk, 4000)
	add(Chunk{Version: 1, Seq: 0, Offset: 0, Total: 9, Chunks: 1, CRC: 0}, 9)
	add(Chunk{Version: 1<<64 - 1, Seq: 1<<31 - 2, Offset: MaxStreamBytes - MaxChunkBytes, Total: MaxStreamBytes, Chunks: 1<<31 - 1, CRC: 0xffffffff}, MaxChunkBytes)
	add(wtChunk, 0)
	add(wtChunk, MaxChunkBytes+1)
	add(wtChunk, 6001)
	f.Add("1", "7", "3", "4000", "10000", "3", "deadbeef", uint32(10))
	f.Add("1", "0", "0", "0", "10000", "3", "deadbeef", uint32(10))
	f.Add("1", "7", "0", "-1", "10000", "3", "deadbeef", uint32(10))
	f.Add("1", "7", "0", "0", "10000", "3", "DEADBEEF", uint32(10))
	f.Add("1", "7", "0", "0", "10000", "3", "dead", uint32(10))
	f.Add("2", "7", "0", "0", "10000", "3", "deadbeef", uint32(10))
	f.Add("3", "7", "0", "0", "10000", "3", "deadbeef", uint32(10))
	f.Add(" 2", "7", "0", "0", "10000", "3", "deadbeef", uint32(10))
	f.Add("", "", "", "", "", "", "", uint32(0))
	f.Add("1", "+7", "00", "0x0", "1e4", "3", "-eadbeef", uint32(10))
	f.Fuzz(func(t *testing.T, protocol, version, seq, offset, total, chunks, crc string, payload uint32) {
		n := int(payload % (MaxChunkBytes + 2))
		h := nats.Header{}
		for k, v := range map[string]string{HeaderProtocol: protocol, HeaderVersion: version, HeaderSeq: seq,
			HeaderOffset: offset, HeaderTotal: total, HeaderChunks: chunks, HeaderCRC: crc} {
			if v != "" {
				h.Set(k, v)
			}
		}
		c, err := ParseChunk(h, n)
		if err != nil {
			if !errors.Is(err, ErrProtocol) || c != (Chunk{}) {
				t.Fatalf("rejection %v with %+v", err, c)
			}
			return
		}
		switch {
		case !knownProtocol(c.Protocol) || strconv.Itoa(c.Protocol) != protocol:
			t.Fatalf("accepted protocol %q as %d", protocol, c.Protocol)
		case c.Version == 0:
			t.Fatalf("accepted version 0: %+v", c)
		case c.Seq < 0 || c.Seq >= c.Chunks:
			t.Fatalf("accepted seq %d of %d chunks", c.Seq, c.Chunks)
		case c.Offset < 0 || c.Total <= 8 || c.Total > MaxStreamBytes:
			t.Fatalf("accepted offset %d, total %d", c.Offset, c.Total)
		case n <= 0 || n > MaxChunkBytes:
			t.Fatalf("accepted a payload of %d bytes", n)
		case c.Offset > c.Total-int64(n):
			t.Fatalf("accepted bytes %d..+%d past the total %d", c.Offset, n, c.Total)
		case fmt.Sprintf("%08x", c.CRC) != strings.ToLower(crc):
			t.Fatalf("crc %q decoded as %08x", crc, c.CRC)
		}
		again, err := ParseChunk(c.Header(), n)
		if err != nil || again != c {
			t.Fatalf("round trip of %+v: %+v, %v", c, again, err)
		}
	})
}

func FuzzParseAnnounce(f *testing.F) {
	f.Add([]byte(wtAnnounce))
	f.Add([]byte(strings.Replace(wtAnnounce, `"chunks":3`, `"chunks":2`, 1)))
	f.Add([]byte(strings.Replace(wtAnnounce, `"total_bytes":10000`, `"total_bytes":4398046511105`, 1)))
	f.Add([]byte(`{"protocol":1,"model":"m","version":1,"subject":"refit.m.v.1","total_bytes":9,"chunk_bytes":4194304,"chunks":1}`))
	f.Add([]byte(`{"protocol":3,"model":"m","version":1,"subject":"refit.m.v.1","total_bytes":9,"chunk_bytes":4194304,"chunks":1}`))
	f.Add([]byte(`{"PROTOCOL":1,"Model":"m","version":1e0,"subject":"refit.m.v.1","total_bytes":9,"chunk_bytes":9,"chunks":1,"chunks":1}`))
	f.Add([]byte(`{"protocol":1,"model":"m","version":18446744073709551615,"subject":"refit.m.v.18446744073709551615","total_bytes":9,"chunk_bytes":1,"chunks":9}`))
	f.Add([]byte(strings.Replace(wtAnnounce, `"protocol":2,`, `"protocol":3,"parts":[`+wtPart0+`,`+wtPart1+`],`, 1)))
	f.Add([]byte(`null`))
	f.Add([]byte(`{}`))
	f.Add([]byte(`[`))
	f.Add([]byte(``))
	f.Fuzz(func(t *testing.T, data []byte) {
		a, err := ParseAnnounce(data)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("rejection without ErrProtocol: %v", err)
			}
			return
		}
		wtCheckAnnounce(t, a)
		b, err := json.Marshal(a)
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseAnnounce(b)
		if err != nil || !reflect.DeepEqual(again, a) {
			t.Fatalf("round trip of %+v through %s: %+v, %v", a, b, again, err)
		}
	})
}

// wtCheckAnnounce checks the invariants of an accepted announcement.
func wtCheckAnnounce(t *testing.T, a Announce) {
	t.Helper()
	switch {
	case !knownProtocol(a.Protocol) || !ValidModelID(a.Model) || a.Version == 0:
		t.Fatalf("accepted %+v", a)
	case a.Subject != VersionSubject(a.Model, a.Version):
		t.Fatalf("accepted subject %q for %+v", a.Subject, a)
	case a.TotalBytes <= 8 || a.TotalBytes > MaxStreamBytes || a.ChunkBytes <= 0 || a.ChunkBytes > MaxChunkBytes:
		t.Fatalf("accepted sizes of %+v", a)
	}
	// Chunks of ChunkBytes, the last one short: they cover the total exactly.
	last := a.TotalBytes - int64(a.Chunks-1)*int64(a.ChunkBytes)
	if a.Chunks < 1 || last <= 0 || last > int64(a.ChunkBytes) {
		t.Fatalf("accepted %d chunks of %d bytes for %d bytes", a.Chunks, a.ChunkBytes, a.TotalBytes)
	}
	// Parts: protocol 3 only, 2 to MaxParts, each named and sized as its
	// part of the version, part 0 the version's own fields.
	if (a.Protocol == ProtocolParts) != (len(a.Parts) > 0) || len(a.Parts) == 1 || len(a.Parts) > MaxParts {
		t.Fatalf("accepted protocol %d with %d parts", a.Protocol, len(a.Parts))
	}
	for i, pt := range a.Parts {
		last := pt.TotalBytes - int64(pt.Chunks-1)*int64(a.ChunkBytes)
		if pt.Subject != PartSubject(a.Model, a.Version, i) || pt.TotalBytes <= 8 || pt.Chunks < 1 || last <= 0 || last > int64(a.ChunkBytes) ||
			i == 0 && (pt.TotalBytes != a.TotalBytes || pt.Chunks != a.Chunks) {
			t.Fatalf("accepted part %d %+v of %+v", i, pt, a)
		}
	}
}

func FuzzParseManifest(f *testing.F) {
	f.Add([]byte(wtManifest))
	f.Add([]byte(wtManifest1))
	f.Add([]byte(wtManifestParts))
	f.Add([]byte(strings.Replace(wtManifest, `"chunk_table_sha256"`, `"sha256"`, 1)))
	f.Add([]byte(strings.Replace(wtManifest1, `"sha256"`, `"chunk_table_sha256"`, 1)))
	f.Add([]byte(strings.Replace(wtManifest, `"chunk_table_sha256"`, `"sha256":"`+wtSHA+`","chunk_table_sha256"`, 1)))
	f.Add([]byte(strings.Replace(wtManifest, wtSHA, strings.ToUpper(wtSHA), 1)))
	f.Add([]byte(strings.Replace(wtManifest, wtSHA, wtSHA[:63], 1)))
	f.Add([]byte(strings.Replace(wtManifest, `"2026-12-02T16:00:00Z"`, `"2026-12-02T16:00:00.123456789+05:30"`, 1)))
	f.Add([]byte(strings.Replace(wtManifest, `"2026-12-02T16:00:00Z"`, `null`, 1)))
	f.Add([]byte(strings.Replace(wtManifest, `"2026-12-02T16:00:00Z"`, `"10000-01-01T00:00:00Z"`, 1)))
	f.Add([]byte(wtAnnounce))
	f.Add([]byte(`{"sha256":1}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := ParseManifest(data)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("rejection without ErrProtocol: %v", err)
			}
			return
		}
		wtCheckAnnounce(t, m.Announce)
		// The protocol's digest, 64 lowercase hex digits, and not the other.
		sum, other := m.ChunkTableSHA256, m.SHA256
		if m.Protocol == Protocol1 {
			sum, other = other, sum
		}
		if len(sum) != 64 || other != "" || sum != strings.ToLower(sum) || sum != m.Digest() {
			t.Fatalf("accepted digests %+v", m)
		}
		if _, err := strconv.ParseUint(sum[:16], 16, 64); err != nil {
			t.Fatalf("accepted digest %q", sum)
		}
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatalf("accepted a manifest that does not encode again: %+v: %v", m, err)
		}
		again, err := ParseManifest(b)
		if err != nil || !again.PublishedAt.Equal(m.PublishedAt) {
			t.Fatalf("round trip of %+v through %s: %+v, %v", m, b, again, err)
		}
		again.PublishedAt = m.PublishedAt
		if !reflect.DeepEqual(again, m) {
			t.Fatalf("round trip of %+v through %s: %+v", m, b, again)
		}
	})
}

func FuzzParseStatus(f *testing.F) {
	f.Add([]byte(wtStatus))
	f.Add([]byte(`{"protocol":1,"worker":"w","version":3,"state":"rejected","reason":"bad \u0000 header","current_version":2}`))
	f.Add([]byte(`{"protocol":1,"state":"needs_full","phases_ms":{},"layers":[]}`))
	f.Add([]byte(`{"protocol":1,"state":"applied","phases_ms":{"receive":1e308},"layers":[{"layer":-1}]}`))
	f.Add([]byte(`{"protocol":1,"state":"applied","phases_ms":{"receive":1e309}}`))
	f.Add([]byte(`{"protocol":1,"state":"Applied"}`))
	f.Add([]byte(`{"protocol":2,"state":"applied"}`))
	f.Add([]byte(`{"protocol":2,"worker":"w","version":3,"state":"applied"}`))
	f.Add([]byte(`{"protocol":3,"worker":"w","version":3,"state":"applied"}`))
	f.Add([]byte(`{"protocol":1,"state":"applied","bytes":-1,"layers":null}`))
	f.Add([]byte(`"applied"`))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := ParseStatus(data)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("rejection without ErrProtocol: %v", err)
			}
			return
		}
		if !knownProtocol(s.Protocol) || (s.State != StateApplied && s.State != StateRejected && s.State != StateNeedsFull) {
			t.Fatalf("accepted %+v", s)
		}
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatalf("accepted a status that does not encode again: %+v: %v", s, err)
		}
		again, err := ParseStatus(b)
		if err != nil {
			t.Fatalf("round trip of %+v through %s: %v", s, b, err)
		}
		b2, err := json.Marshal(again)
		if err != nil || string(b2) != string(b) {
			t.Fatalf("round trip changed %s into %s (%v)", b, b2, err)
		}
		// Nothing but empty collections is lost on the way.
		if len(s.PhasesMS) == 0 {
			s.PhasesMS = nil
		}
		if len(s.Layers) == 0 {
			s.Layers = nil
		}
		if !reflect.DeepEqual(again, s) {
			t.Fatalf("round trip of %+v: %+v", s, again)
		}
	})
}

func FuzzParseHeader(f *testing.F) {
	f.Add([]byte(wtHeader), uint32(12))
	f.Add([]byte(wtHeader), uint32(11))
	f.Add([]byte(`{}`), uint32(0))
	f.Add([]byte(`null`), uint32(0))
	f.Add([]byte(`{"__metadata__":{"a":"b"}}`), uint32(0))
	f.Add([]byte(`{"s":{"dtype":"BF16","shape":[],"data_offsets":[0,2]}}  `), uint32(2))
	f.Add([]byte(`{"z":{"dtype":"BF16","shape":[0,4],"data_offsets":[0,0]},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`), uint32(4))
	f.Add([]byte(`{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"a":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}}`), uint32(8))
	f.Add([]byte(`{"a":{"dtype":"U8","shape":[3],"data_offsets":[4,7]},"b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}`), uint32(7))
	f.Add([]byte(`{"a":{"dtype":"X","shape":[3],"data_offsets":[-4,0]}}`), uint32(0))
	f.Add([]byte(`{"a":{"dtype":"BF16","shape":[9223372036854775807],"data_offsets":[0,0]}}`), uint32(0))
	f.Add([]byte(`{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0]}}`), uint32(2))
	f.Add([]byte(`{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2,4]}}`), uint32(2))
	f.Add([]byte(`{"a":[]}`), uint32(0))
	f.Add([]byte(`{"a":{"dtype":"F64","shape":[2147483647,2147483647],"data_offsets":[0,0]}}`), uint32(0))
	f.Add([]byte(`{`), uint32(0))
	f.Add([]byte(`{"__metadata__":{"shape":"x","dtype":"y"},"s":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}`), uint32(2))
	f.Add([]byte(`{"__metadata__":7,"s":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}`), uint32(2))
	f.Add([]byte(`{"s":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},"__metadata__":{"data_offsets":[0,2]}}`), uint32(2))
	f.Add([]byte(`{"s":{"dtype":"BF16","shape":[1],"data_offsets":[0,2],"DTYPE":"F32"}}`), uint32(2))
	f.Add([]byte(`{"d":{"dtype":"BF16_DELTA","shape":[70000],"data_offsets":[0,16]}}`), uint32(16))
	f.Add([]byte(`{"d":{"dtype":"BF16_DELTA","shape":[3],"data_offsets":[2,16]},"s":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}`), uint32(16))
	f.Add([]byte(`{"d":{"dtype":"BF16_DELTA","shape":[0],"data_offsets":[0,0]}}`), uint32(0))
	f.Fuzz(func(t *testing.T, js []byte, dataLen uint32) {
		// The one-pass decode gives what the two passes give.
		fast, ferr := headerEntries(js)
		slow, serr := headerEntriesTwoPass(js)
		delete(fast, "__metadata__")
		if (ferr == nil) != (serr == nil) || ferr == nil && len(fast)+len(slow) > 0 && !reflect.DeepEqual(fast, slow) {
			t.Fatalf("one pass: %+v, %v; two passes: %+v, %v", fast, ferr, slow, serr)
		}
		total := 8 + int64(len(js)) + int64(dataLen)
		h, err := ParseHeader(js, total)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("rejection without ErrProtocol: %v", err)
			}
			return
		}
		if h.Len != int64(len(js)) || h.DataStart() != 8+int64(len(js)) {
			t.Fatalf("header length %d for %d bytes", h.Len, len(js))
		}
		if len(h.Tensors) > MaxTensors {
			t.Fatalf("accepted %d tensors", len(h.Tensors))
		}
		// The tensors tile the data section: in data order, each starts
		// where the previous ended, the first at 0, the last at its end.
		var at int64
		names := map[string]bool{}
		for _, ti := range h.Tensors {
			if ti.Begin != at || ti.End < ti.Begin {
				t.Fatalf("tensor %q at [%d, %d), want a start at %d: %+v", ti.Name, ti.Begin, ti.End, at, h.Tensors)
			}
			at = ti.End
			if ti.Name == "__metadata__" || names[ti.Name] {
				t.Fatalf("tensor name %q (metadata or repeated)", ti.Name)
			}
			names[ti.Name] = true
			elems := int64(1)
			for _, d := range ti.Shape {
				if d < 0 {
					t.Fatalf("tensor %q: shape %v", ti.Name, ti.Shape)
				}
				elems *= int64(d)
			}
			if size := dtypeSize(ti.DType); size > 0 && elems*size != ti.End-ti.Begin {
				t.Fatalf("tensor %q: %s%v in %d bytes", ti.Name, ti.DType, ti.Shape, ti.End-ti.Begin)
			}
			if lo, hi := deltaBytesRange(elems); ti.DType == DeltaDType && (ti.End-ti.Begin < lo || ti.End-ti.Begin > hi) {
				t.Fatalf("delta tensor %q: %v in %d bytes, outside [%d, %d]", ti.Name, ti.Shape, ti.End-ti.Begin, lo, hi)
			}
		}
		if at != int64(dataLen) {
			t.Fatalf("tensors cover %d of %d data bytes", at, dataLen)
		}
	})
}

func FuzzHeaderLen(f *testing.F) {
	f.Add([]byte{16, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{1, 2, 3})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1})
	f.Fuzz(func(t *testing.T, prefix []byte) {
		n, ok, err := HeaderLen(prefix)
		switch {
		case len(prefix) < 8:
			if ok || err != nil || n != 0 {
				t.Fatalf("%d bytes: %d, %v, %v", len(prefix), n, ok, err)
			}
		case !ok:
			t.Fatalf("%d bytes not enough", len(prefix))
		case err != nil:
			if u := binary.LittleEndian.Uint64(prefix); !errors.Is(err, ErrProtocol) || u > 0 && u <= MaxHeaderBytes {
				t.Fatalf("rejected %d: %v", u, err)
			}
		case n <= 0 || n > MaxHeaderBytes || uint64(n) != binary.LittleEndian.Uint64(prefix):
			t.Fatalf("accepted %d from %x", n, prefix)
		}
	})
}
