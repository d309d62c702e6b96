package refit

import (
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
)

// wtChunk is a valid chunk of a 10000-byte stream in chunks of 4000 bytes.
var wtChunk = Chunk{Protocol: ProtocolVersion, Version: 7, Seq: 1, Offset: 4000, Total: 10000, Chunks: 3, CRC: 0xdeadbeef}

const (
	wtAnnounce = `{"protocol":2,"model":"m-1","version":7,"full":true,"subject":"refit.m-1.v.7",` +
		`"total_bytes":10000,"chunk_bytes":4000,"chunks":3}`
	wtSHA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	// The parts of a protocol-3 version of wtAnnounce's sizes.
	wtPart0    = `{"subject":"refit.m-1.v.7","total_bytes":10000,"chunks":3}`
	wtPart1    = `{"subject":"refit.m-1.p1.v.7","total_bytes":5000,"chunks":2}`
	wtManifest = `{"protocol":2,"model":"m-1","version":7,"full":false,"base":6,"subject":"refit.m-1.v.7",` +
		`"total_bytes":10000,"chunk_bytes":4000,"chunks":3,"header_bytes":120,"tensors":2,` +
		`"chunk_table_sha256":"` + wtSHA + `","published_at":"2026-12-02T16:00:00Z"}`
	// wtManifestParts is wtManifest in two parts (protocol 3).
	wtManifestParts = `{"protocol":3,"model":"m-1","version":7,"full":false,"base":6,"subject":"refit.m-1.v.7",` +
		`"total_bytes":10000,"chunk_bytes":4000,"chunks":3,"header_bytes":120,"tensors":2,` +
		`"chunk_table_sha256":"` + wtSHA + `","published_at":"2026-12-02T16:00:00Z","parts":[` +
		`{"subject":"refit.m-1.v.7","total_bytes":10000,"chunks":3,"header_bytes":120,"tensors":2,"chunk_table_sha256":"` + wtSHA + `"},` +
		`{"subject":"refit.m-1.p1.v.7","total_bytes":5000,"chunks":2,"header_bytes":90,"tensors":1,"chunk_table_sha256":"` + wtSHA2 + `"}]}`
	wtSHA2 = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752"
	// wtManifest1 is a protocol-1 manifest: the whole stream's SHA-256.
	wtManifest1 = `{"protocol":1,"model":"m-1","version":7,"full":false,"base":6,"subject":"refit.m-1.v.7",` +
		`"total_bytes":10000,"chunk_bytes":4000,"chunks":3,"header_bytes":120,"tensors":2,` +
		`"sha256":"` + wtSHA + `","published_at":"2026-12-02T16:00:00Z"}`
	wtStatus = `{"protocol":1,"worker":"w-1","version":7,"state":"applied","current_version":7,"bytes":10000,` +
		`"phases_ms":{"receive":8.5,"copy":0.1,"requantize":0.2,"commit":0.4},` +
		`"layers":[{"layer":0,"receive_ms":2,"copy_ms":0.1,"requantize_ms":0.2}]}`
	// wtHeader tiles 12 data bytes: a [2,2] BF16 tensor, then a [2] one.
	wtHeader = `{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},` +
		`"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}`
)

// wtWithHeader returns h with key set to v, or deleted when v is "<none>".
func wtWithHeader(h nats.Header, key, v string) nats.Header {
	out := nats.Header{}
	for k, vs := range h {
		out[k] = append([]string(nil), vs...)
	}
	if v == "<none>" {
		out.Del(key)
	} else {
		out.Set(key, v)
	}
	return out
}

func TestParseChunkValid(t *testing.T) {
	c, err := ParseChunk(wtChunk.Header(), 4000)
	if err != nil {
		t.Fatal(err)
	}
	if c != wtChunk {
		t.Errorf("got %+v, want %+v", c, wtChunk)
	}
	// The last chunk may be short; a payload may end exactly at the total.
	last := wtChunk
	last.Seq, last.Offset = 2, 8000
	if _, err := ParseChunk(last.Header(), 2000); err != nil {
		t.Errorf("last chunk: %v", err)
	}
	payload := []byte("hello")
	c.CRC = CRC32C(payload)
	if err := c.Verify(payload); err != nil {
		t.Errorf("verify: %v", err)
	}
	if err := c.Verify([]byte("hellO")); !errors.Is(err, ErrProtocol) {
		t.Errorf("verify of a changed payload: %v", err)
	}
}

func TestParseChunkRejects(t *testing.T) {
	h := wtChunk.Header()
	tests := []struct {
		name, key, value string
		payload          int
		want             string
	}{
		{"no protocol", HeaderProtocol, "<none>", 4000, "protocol"},
		{"protocol 5", HeaderProtocol, "5", 4000, "protocol"},
		{"protocol 02", HeaderProtocol, "02", 4000, "protocol"},
		{"no version", HeaderVersion, "<none>", 4000, "version"},
		{"version 0", HeaderVersion, "0", 4000, "version"},
		{"negative version", HeaderVersion, "-7", 4000, "version"},
		{"version overflow", HeaderVersion, "18446744073709551616", 4000, "version"},
		{"hex version", HeaderVersion, "0x7", 4000, "version"},
		{"seq empty", HeaderSeq, "", 4000, "seq"},
		{"negative seq", HeaderSeq, "-1", 4000, "seq"},
		{"seq past int31", HeaderSeq, "2147483648", 4000, "seq"},
		{"seq = chunks", HeaderSeq, "3", 4000, "seq 3 of 3"},
		{"negative offset", HeaderOffset, "-4000", 4000, "offset"},
		{"offset not a number", HeaderOffset, "4k", 4000, "offset"},
		{"total 8", HeaderTotal, "8", 4000, "total"},
		{"total past the limit", HeaderTotal, "4398046511105", 4000, "total"},
		{"no chunks", HeaderChunks, "0", 4000, "chunks"},
		{"crc short", HeaderCRC, "deadbee", 4000, "crc"},
		{"crc long", HeaderCRC, "0deadbeef", 4000, "crc"},
		{"crc not hex", HeaderCRC, "deadbeeg", 4000, "crc"},
		{"crc signed", HeaderCRC, "+eadbeef", 4000, "crc"},
		{"empty payload", "", "", 0, "payload"},
		{"payload too big", "", "", MaxChunkBytes + 1, "payload"},
		{"past the total", HeaderOffset, "8000", 2001, "past the total"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			hh := h
			if tc.key != "" {
				hh = wtWithHeader(h, tc.key, tc.value)
			}
			c, err := ParseChunk(hh, tc.payload)
			if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %+v, %v; want an ErrProtocol naming %q", c, err, tc.want)
			}
		})
	}
}

// TestParseChunkOffsetOverflow: an offset near MaxInt64 must not wrap past
// the "beyond the total" check.
func TestParseChunkOffsetOverflow(t *testing.T) {
	h := wtWithHeader(wtChunk.Header(), HeaderOffset, "9223372036854775807")
	if c, err := ParseChunk(h, 4000); err == nil {
		t.Fatalf("accepted offset %d + 4000 bytes in a stream of %d", c.Offset, c.Total)
	}
}

func TestParseAnnounceRejects(t *testing.T) {
	tests := []struct{ name, from, to, want string }{
		{"not json", `{"protocol"`, `{"protocol"x`, "announce"},
		{"protocol 0", `"protocol":2`, `"protocol":0`, "protocol 0"},
		{"protocol 5", `"protocol":2`, `"protocol":5`, "protocol 5"},
		{"bad model", `"model":"m-1"`, `"model":"m.1"`, "model"},
		{"version 0", `"version":7`, `"version":0`, "version 0"},
		{"negative version", `"version":7`, `"version":-7`, "announce"},
		{"wrong subject", `"subject":"refit.m-1.v.7"`, `"subject":"refit.m-1.v.8"`, "subject"},
		{"total 8", `"total_bytes":10000`, `"total_bytes":8`, "total bytes"},
		{"chunk 0", `"chunk_bytes":4000`, `"chunk_bytes":0`, "chunk bytes"},
		{"chunk over 4 MiB", `"chunk_bytes":4000`, `"chunk_bytes":4194305`, "chunk bytes"},
		{"chunk count", `"chunks":3`, `"chunks":2`, "chunks"},
		{"string version", `"version":7`, `"version":"7"`, "announce"},
		{"protocol 3 without parts", `"protocol":2`, `"protocol":3`, "protocol 3 with 0 parts"},
		{"protocol 2 with parts", `"chunks":3}`, `"chunks":3,"parts":[` + wtPart0 + `,` + wtPart1 + `]}`, "protocol 2 with parts"},
		{"one part", `"protocol":2,`, `"protocol":3,"parts":[` + wtPart0 + `],`, "protocol 3 with 1 parts"},
		{"part subject", `"protocol":2,`, `"protocol":3,"parts":[` + wtPart0 + `,` + strings.Replace(wtPart1, "p1", "p2", 1) + `],`, "part 1: subject"},
		{"part chunks", `"protocol":2,`, `"protocol":3,"parts":[` + wtPart0 + `,` + strings.Replace(wtPart1, `"chunks":2`, `"chunks":3`, 1) + `],`, "part 1: 3 chunks"},
		{"part 0 differs", `"protocol":2,`, `"protocol":3,"parts":[` + strings.Replace(wtPart0, `"chunks":3`, `"chunks":4`, 1) + `,` + wtPart1 + `],`, "part 0"},
	}
	if _, err := ParseAnnounce([]byte(wtAnnounce)); err != nil {
		t.Fatalf("valid announce: %v", err)
	}
	parts := strings.Replace(wtAnnounce, `"protocol":2,`, `"protocol":3,"parts":[`+wtPart0+`,`+wtPart1+`],`, 1)
	if a, err := ParseAnnounce([]byte(parts)); err != nil || len(a.PartList()) != 2 || a.PartList()[1].TotalBytes != 5000 {
		t.Fatalf("valid announce of parts: %+v, %v", a, err)
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := strings.Replace(wtAnnounce, tc.from, tc.to, 1)
			if in == wtAnnounce {
				t.Fatalf("%q not in the announcement", tc.from)
			}
			if _, err := ParseAnnounce([]byte(in)); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: got %v, want an ErrProtocol naming %q", in, err, tc.want)
			}
		})
	}
}

func TestParseManifestRejects(t *testing.T) {
	tests := []struct{ name, manifest, from, to, want string }{
		{"no chunk table sha256", wtManifest, `"chunk_table_sha256":"` + wtSHA + `",`, ``, "protocol 2: chunk_table_sha256"},
		{"part without its header bytes", wtManifestParts, `"header_bytes":90,`, ``, "part 1: header_bytes 0"},
		{"part without tensors", wtManifestParts, `"tensors":1,`, ``, "part 1: tensors 0"},
		{"part without its chunk table", wtManifestParts, `,"chunk_table_sha256":"` + wtSHA2 + `"`, ``, "part 1: chunk_table_sha256"},
		{"part 0 differs", wtManifestParts, `"header_bytes":120,"tensors":2,"chunk_table_sha256":"` + wtSHA + `"}`, `"header_bytes":121,"tensors":2,"chunk_table_sha256":"` + wtSHA + `"}`, "part 0 differs"},
		{"short chunk table sha256", wtManifest, wtSHA, wtSHA[:63], "chunk_table_sha256"},
		{"chunk table sha256 not hex", wtManifest, wtSHA, "z" + wtSHA[1:], "chunk_table_sha256"},
		{"chunk table sha256 upper case", wtManifest, wtSHA, strings.ToUpper(wtSHA), "chunk_table_sha256"},
		{"protocol 2 with a sha256", wtManifest, `"chunk_table_sha256"`, `"sha256":"` + wtSHA + `","chunk_table_sha256"`, "protocol 2 carries sha256"},
		{"protocol 2 with only a sha256", wtManifest, `"chunk_table_sha256"`, `"sha256"`, "protocol 2: chunk_table_sha256"},
		{"protocol 1 without sha256", wtManifest1, `"sha256":"` + wtSHA + `",`, ``, "protocol 1: sha256"},
		{"protocol 1 short sha256", wtManifest1, wtSHA, wtSHA[:63], "sha256"},
		{"protocol 1 with only a chunk table sha256", wtManifest1, `"sha256"`, `"chunk_table_sha256"`, "protocol 1: sha256"},
		{"protocol 1 with both", wtManifest1, `"sha256"`, `"chunk_table_sha256":"` + wtSHA + `","sha256"`, "protocol 1 carries chunk_table_sha256"},
		{"bad time", wtManifest, `2026-12-02T16:00:00Z`, `yesterday`, "manifest"},
		{"announce fields", wtManifest, `"chunks":3`, `"chunks":4`, "manifest"},
		{"protocol", wtManifest, `"protocol":2`, `"protocol":5`, "protocol 5"},
	}
	m, err := ParseManifest([]byte(wtManifest))
	if err != nil {
		t.Fatalf("valid manifest: %v", err)
	}
	if m.HeaderBytes != 120 || m.Tensors != 2 || m.Full || m.Version != 7 || m.ChunkTableSHA256 != wtSHA || m.Digest() != wtSHA {
		t.Errorf("valid manifest decoded as %+v", m)
	}
	m, err = ParseManifest([]byte(wtManifest1))
	if err != nil {
		t.Fatalf("valid protocol-1 manifest: %v", err)
	}
	if m.Protocol != Protocol1 || m.SHA256 != wtSHA || m.Digest() != wtSHA {
		t.Errorf("valid protocol-1 manifest decoded as %+v", m)
	}
	m, err = ParseManifest([]byte(wtManifestParts))
	if err != nil {
		t.Fatalf("valid manifest of parts: %v", err)
	}
	if m.Protocol != ProtocolParts || len(m.Parts) != 2 || m.Parts[1].HeaderBytes != 90 || m.Parts[1].ChunkTableSHA256 != wtSHA2 {
		t.Errorf("valid manifest of parts decoded as %+v", m)
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := strings.Replace(tc.manifest, tc.from, tc.to, 1)
			if in == tc.manifest {
				t.Fatalf("%q not in the manifest", tc.from)
			}
			if _, err := ParseManifest([]byte(in)); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: got %v, want an ErrProtocol naming %q", in, err, tc.want)
			}
		})
	}
}

// TestChunkTable checks the chunk table's digest against the worked
// example of PROTOCOL.md ("Manifest"), computed there with Python's struct
// and hashlib.
func TestChunkTable(t *testing.T) {
	tab := NewChunkTable()
	for _, e := range []struct {
		off int64
		n   int
		crc uint32
	}{{0, 4000, 0xdeadbeef}, {4000, 4000, 0x01234567}, {8000, 2000, 0x89abcdef}} {
		tab.Add(e.off, e.n, e.crc)
	}
	const want = "7bfacf0a6878da970aa6dde1edd631418ad06b1c3263972f04e6a606274abe7e"
	if got := tab.Sum(); got != want || tab.Len() != 3 {
		t.Errorf("chunk table of 3 entries: sha256 %s, want %s", got, want)
	}
	if got := NewChunkTable().Sum(); got != "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855" {
		t.Errorf("empty chunk table: sha256 %s", got)
	}
}

func TestParseStatusRejects(t *testing.T) {
	s, err := ParseStatus([]byte(wtStatus))
	if err != nil {
		t.Fatalf("valid status: %v", err)
	}
	if s.Worker != "w-1" || s.PhasesMS["commit"] != 0.4 || len(s.Layers) != 1 || s.Layers[0].RequantizeMS != 0.2 {
		t.Errorf("valid status decoded as %+v", s)
	}
	tests := []struct{ name, from, to, want string }{
		{"not json", `}]}`, `}]`, "status"},
		{"protocol", `"protocol":1`, `"protocol":5`, "protocol 5"},
		{"state", `"applied"`, `"done"`, "state"},
		{"empty state", `"applied"`, `""`, "state"},
		{"layers not a list", `"layers":[`, `"layers":{"x":`, "status"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := strings.Replace(wtStatus, tc.from, tc.to, 1)
			if in == wtStatus {
				t.Fatalf("%q not in the status", tc.from)
			}
			if _, err := ParseStatus([]byte(in)); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: got %v, want an ErrProtocol naming %q", in, err, tc.want)
			}
		})
	}
}

func TestParseHeaderValid(t *testing.T) {
	h, err := ParseHeader([]byte(wtHeader), 8+int64(len(wtHeader))+12)
	if err != nil {
		t.Fatal(err)
	}
	if len(h.Tensors) != 2 || h.Tensors[0].Name != "a" || h.Tensors[1].Name != "b" || h.Tensors[1].Begin != 8 {
		t.Errorf("tensors %+v, want a then b in data order", h.Tensors)
	}
	if h.DataStart() != 8+int64(len(wtHeader)) {
		t.Errorf("data start %d", h.DataStart())
	}
}

func TestParseHeaderRejects(t *testing.T) {
	dataStart := 8 + int64(len(wtHeader))
	tests := []struct {
		name, from, to string
		data           int64 // data bytes in the stream
		want           string
	}{
		{"not json", `}}`, `}`, 12, "safetensors header"},
		{"array", wtHeader, `[1,2]`, 12, "safetensors header"},
		{"gap", `[8,12]`, `[9,13]`, 13, "gap or overlap"},
		{"overlap", `"shape":[2],"data_offsets":[8,12]`, `"shape":[2],"data_offsets":[6,10]`, 12, "gap or overlap"},
		{"short of the stream", ``, ``, 14, "cover 12 data bytes"},
		{"past the stream", ``, ``, 10, "cover 12 data bytes"},
		{"shape and size", `"shape":[2,2]`, `"shape":[2,3]`, 12, "takes 12 bytes"},
		{"negative dim", `"shape":[2,2]`, `"shape":[-2,-2]`, 12, "shape"},
		{"huge dims", `"shape":[2,2]`, `"shape":[2147483647,2147483647,2147483647]`, 12, "shape"},
		{"reversed offsets", `"dtype":"BF16","shape":[2],"data_offsets":[8,12]`, `"dtype":"XX","shape":[2],"data_offsets":[12,8]`, 12, "data offsets"},
		{"negative offsets", `"dtype":"BF16","shape":[2],"data_offsets":[8,12]`, `"dtype":"XX","shape":[2],"data_offsets":[-4,12]`, 12, "data offsets"},
		{"tensor not an object", `{"dtype":"BF16","shape":[2],"data_offsets":[8,12]}`, `7`, 12, `tensor "b"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			js := strings.Replace(wtHeader, tc.from, tc.to, 1)
			if tc.from != "" && js == wtHeader {
				t.Fatalf("%q not in the header", tc.from)
			}
			h, err := ParseHeader([]byte(js), dataStart+tc.data)
			if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: got %+v, %v; want an ErrProtocol naming %q", js, h.Tensors, err, tc.want)
			}
		})
	}
}

func TestHeaderLen(t *testing.T) {
	if _, ok, err := HeaderLen([]byte{1, 2, 3}); ok || err != nil {
		t.Errorf("short prefix: ok %v, err %v", ok, err)
	}
	if n, ok, err := HeaderLen([]byte{16, 0, 0, 0, 0, 0, 0, 0, 'x'}); n != 16 || !ok || err != nil {
		t.Errorf("16: got %d, %v, %v", n, ok, err)
	}
	for _, b := range [][]byte{{0, 0, 0, 0, 0, 0, 0, 0}, {1, 0, 0, 0x04, 0, 0, 0, 0}, {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}} {
		if _, ok, err := HeaderLen(b); !ok || !errors.Is(err, ErrProtocol) {
			t.Errorf("%x: ok %v, err %v; want a protocol error", b, ok, err)
		}
	}
}

func TestNames(t *testing.T) {
	for id, ok := range map[string]bool{"m": true, "Qwen3-30B_A3B": true, "": false, "a.b": false, "a b": false,
		"a*": false, "a>": false, strings.Repeat("x", 64): true, strings.Repeat("x", 65): false} {
		if ValidModelID(id) != ok {
			t.Errorf("ValidModelID(%q) = %v", id, !ok)
		}
	}
	if got := VersionSubject("m", 12); got != "refit.m.v.12" {
		t.Errorf("VersionSubject %q", got)
	}
	if got := MsgID("m", 12, 3); got != "m.12.3" {
		t.Errorf("MsgID %q", got)
	}
}
