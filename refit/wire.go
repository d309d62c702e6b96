package refit

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"math"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
)

// ProtocolVersion is the version of PROTOCOL.md this package publishes.
// Workers also accept Protocol1 versions from older publishers.
const ProtocolVersion = 2

// Protocol1 is the first protocol: its manifest carries the SHA-256 of the
// whole stream instead of the chunk table's (see PROTOCOL.md, "Manifest").
const Protocol1 = 1

// ProtocolParts is protocol 2 with the version split into parts, each a
// stream of its own published over its own connection (PROTOCOL.md,
// "Parts"): what a publisher speaks for a version of more than one part.
const ProtocolParts = 3

// ProtocolLive is protocol 3 sent live first (PROTOCOL.md, "Live
// first"): each part's chunks go out over core NATS on its live subject
// (LiveSubject), which no stream stores, and the version is sealed (key
// KeySealed) once they are all out, so that workers that received them
// commit without waiting for the stream; then the publisher stores the
// same chunks in the part's stream on its stored subject (StoredSubject)
// and writes the manifest.
const ProtocolLive = 4

// MaxParts bounds the parts of a version.
const MaxParts = 16

// knownProtocol reports whether p is a protocol this package reads.
func knownProtocol(p int) bool {
	return p == Protocol1 || p == ProtocolVersion || p == ProtocolParts || p == ProtocolLive
}

// inParts reports whether versions of protocol p come in parts.
func inParts(p int) bool { return p == ProtocolParts || p == ProtocolLive }

// NATS headers of a chunk.
const (
	HeaderProtocol = "Refit-Protocol"
	HeaderVersion  = "Refit-Version"
	HeaderSeq      = "Refit-Seq"
	HeaderOffset   = "Refit-Offset"
	HeaderTotal    = "Refit-Total"
	HeaderChunks   = "Refit-Chunks"
	HeaderCRC      = "Refit-CRC32C"
)

// Limits on what the parsers accept from the wire.
const (
	MaxChunkBytes  = 4 << 20        // a chunk's payload
	MaxHeaderBytes = 64 << 20       // a safetensors JSON header
	MaxStreamBytes = int64(1) << 42 // a version (4 TiB)
	MaxTensors     = 1 << 20        // tensors in one version
)

// ErrProtocol wraps every malformed-input error of the wire formats.
var ErrProtocol = errors.New("refit: protocol error")

var modelID = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// ValidModelID reports whether id can name a model in subjects and streams.
func ValidModelID(id string) bool { return modelID.MatchString(id) }

// Names of the JetStream objects of a model (see PROTOCOL.md).
func StreamName(model string) string     { return "REFIT_" + model }
func BucketName(model string) string     { return "REFIT_" + model }
func StreamSubjects(model string) string { return "refit." + model + ".v.*" }
func VersionSubject(model string, v uint64) string {
	return "refit." + model + ".v." + strconv.FormatUint(v, 10)
}
func StatusSubject(model string) string { return "refit." + model + ".status" }
func MsgID(model string, v uint64, seq int) string {
	return model + "." + strconv.FormatUint(v, 10) + "." + strconv.Itoa(seq)
}

// Names of part i of a version (PROTOCOL.md, "Parts"): part 0 is published
// as a protocol-2 version's stream; part i >= 1 in a stream of its own.
func PartStreamName(model string, i int) string {
	if i == 0 {
		return StreamName(model)
	}
	return StreamName(model) + "_P" + strconv.Itoa(i)
}
func PartStreamSubjects(model string, i int) string { return partPrefix(model, i) + "v.*" }
func PartSubject(model string, v uint64, i int) string {
	return partPrefix(model, i) + "v." + strconv.FormatUint(v, 10)
}

// partPrefix is what every subject of part i starts with: "refit.<model>."
// for part 0, "refit.<model>.p<i>." for part i >= 1.
func partPrefix(model string, i int) string {
	if i == 0 {
		return "refit." + model + "."
	}
	return "refit." + model + ".p" + strconv.Itoa(i) + "."
}

// Subjects of live-first versions (ProtocolLive). A part's chunks are
// stored on its stored subject, refit.<model>.s.<N> for part 0 and
// refit.<model>.p<i>.s.<N> for part i, which the part's stream also
// captures (PartStoredSubjects) and no worker follows live; they go out
// live first on the part's subject with ".live" appended, which no stream
// captures and every worker's live subscription (PartLiveSubjects)
// matches.
func StoredSubject(model string, v uint64, i int) string {
	return partPrefix(model, i) + "s." + strconv.FormatUint(v, 10)
}
func PartStoredSubjects(model string, i int) string    { return partPrefix(model, i) + "s.*" }
func LiveSubject(model string, v uint64, i int) string { return PartSubject(model, v, i) + ".live" }

// PartLiveSubjects is what a worker subscribes to for part i's live
// chunks: the part's version subjects (chunks of protocols 1 to 3, live as
// they are stored) and their live subjects (protocol 4).
func PartLiveSubjects(model string, i int) string { return partPrefix(model, i) + "v.>" }

// partSubjectsFilter matches every subject of part i's stream: its
// version subjects and its stored subjects.
func partSubjectsFilter(model string, i int) string { return partPrefix(model, i) + "*.*" }

// storedSubject is where a version of protocol proto stores part i.
func storedSubject(proto int, model string, v uint64, i int) string {
	if proto == ProtocolLive {
		return StoredSubject(model, v, i)
	}
	return PartSubject(model, v, i)
}

// liveSubject is where the chunks of part i of a version of protocol
// proto come live.
func liveSubject(proto int, model string, v uint64, i int) string {
	if proto == ProtocolLive {
		return LiveSubject(model, v, i)
	}
	return PartSubject(model, v, i)
}

func PartMsgID(model string, v uint64, i, seq int) string {
	if i == 0 {
		return MsgID(model, v, seq)
	}
	return model + "." + strconv.FormatUint(v, 10) + ".p" + strconv.Itoa(i) + "." + strconv.Itoa(seq)
}

// Keys of the bucket.
const (
	KeyAnnounce = "announce"
	KeyManifest = "manifest"
	// KeySealed holds the manifest of a live-first version once its chunks
	// are all out live, before they are stored (ProtocolLive).
	KeySealed = "sealed"
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// CRC32C returns the CRC-32C of b.
func CRC32C(b []byte) uint32 { return crc32.Checksum(b, crcTable) }

// Chunk is the header of one chunk message.
type Chunk struct {
	Protocol int // 0 encodes as ProtocolVersion
	Version  uint64
	Seq      int
	Offset   int64
	Total    int64
	Chunks   int
	CRC      uint32
}

// Header encodes c as NATS headers.
func (c Chunk) Header() nats.Header {
	h := nats.Header{}
	proto := c.Protocol
	if proto == 0 {
		proto = ProtocolVersion
	}
	h.Set(HeaderProtocol, strconv.Itoa(proto))
	h.Set(HeaderVersion, strconv.FormatUint(c.Version, 10))
	h.Set(HeaderSeq, strconv.Itoa(c.Seq))
	h.Set(HeaderOffset, strconv.FormatInt(c.Offset, 10))
	h.Set(HeaderTotal, strconv.FormatInt(c.Total, 10))
	h.Set(HeaderChunks, strconv.Itoa(c.Chunks))
	h.Set(HeaderCRC, fmt.Sprintf("%08x", c.CRC))
	return h
}

// ParseChunk decodes and checks a chunk's headers against its payload
// length (the CRC is checked by Verify).
func ParseChunk(h nats.Header, payloadLen int) (Chunk, error) {
	var c Chunk
	bad := func(format string, args ...any) (Chunk, error) {
		return Chunk{}, fmt.Errorf("%w: chunk: %s", ErrProtocol, fmt.Sprintf(format, args...))
	}
	var err error
	switch p := h.Get(HeaderProtocol); p {
	case "1":
		c.Protocol = Protocol1
	case "2":
		c.Protocol = ProtocolVersion
	case "3":
		c.Protocol = ProtocolParts
	case "4":
		c.Protocol = ProtocolLive
	default:
		return bad("protocol %q, want %d to %d", p, Protocol1, ProtocolLive)
	}
	if c.Version, err = strconv.ParseUint(h.Get(HeaderVersion), 10, 64); err != nil || c.Version == 0 {
		return bad("version %q", h.Get(HeaderVersion))
	}
	seq, err := strconv.ParseUint(h.Get(HeaderSeq), 10, 31)
	if err != nil {
		return bad("seq %q", h.Get(HeaderSeq))
	}
	c.Seq = int(seq)
	if c.Offset, err = strconv.ParseInt(h.Get(HeaderOffset), 10, 64); err != nil || c.Offset < 0 {
		return bad("offset %q", h.Get(HeaderOffset))
	}
	if c.Total, err = strconv.ParseInt(h.Get(HeaderTotal), 10, 64); err != nil || c.Total <= 8 || c.Total > MaxStreamBytes {
		return bad("total %q", h.Get(HeaderTotal))
	}
	chunks, err := strconv.ParseUint(h.Get(HeaderChunks), 10, 31)
	if err != nil || chunks == 0 {
		return bad("chunks %q", h.Get(HeaderChunks))
	}
	c.Chunks = int(chunks)
	crc := h.Get(HeaderCRC)
	v, err := strconv.ParseUint(crc, 16, 32)
	if err != nil || len(crc) != 8 {
		return bad("crc %q", crc)
	}
	c.CRC = uint32(v)
	switch {
	case c.Seq >= c.Chunks:
		return bad("seq %d of %d chunks", c.Seq, c.Chunks)
	case payloadLen <= 0 || payloadLen > MaxChunkBytes:
		return bad("payload of %d bytes", payloadLen)
	case c.Offset > c.Total-int64(payloadLen): // written so that it cannot overflow
		return bad("%d bytes at offset %d run past the total %d", payloadLen, c.Offset, c.Total)
	}
	return c, nil
}

// Verify checks the payload's CRC-32C.
func (c Chunk) Verify(payload []byte) error {
	if got := CRC32C(payload); got != c.CRC {
		return fmt.Errorf("%w: chunk %d of version %d: crc32c %08x, header says %08x", ErrProtocol, c.Seq, c.Version, got, c.CRC)
	}
	return nil
}

// Announce is the bucket's "announce" value: a version starts.
type Announce struct {
	Protocol int    `json:"protocol"`
	Model    string `json:"model"`
	Version  uint64 `json:"version"`
	Full     bool   `json:"full"`
	// Base is the version a partial version is a delta on: the newest
	// version published before it (0: the weights workers load at start).
	// A partial version must carry it; a full version carries 0 or omits
	// it (PROTOCOL.md, "Announcement").
	Base       uint64 `json:"base"`
	Subject    string `json:"subject"`
	TotalBytes int64  `json:"total_bytes"`
	ChunkBytes int    `json:"chunk_bytes"`
	Chunks     int    `json:"chunks"`
	// HeaderSHA256 is the hex SHA-256 of the stream's first 8 + header
	// length bytes (the length and the JSON header): set by a signing
	// publisher, so that a worker checks the header before it writes
	// anything (PROTOCOL.md, "Signatures").
	HeaderSHA256 string `json:"header_sha256,omitempty"`
	// SignedBy and Signature sign the announcement (SignedBytes): the
	// public nkey and the standard base64 of its ed25519 signature. In a
	// Manifest, the manifest's own fields of these names hold its
	// signature, and these stay empty.
	SignedBy  string `json:"signed_by,omitempty"`
	Signature string `json:"signature,omitempty"`
	// Parts lists the parts of a protocol-3 version, part 0 first (its
	// subject, total_bytes and chunks are also the fields above); absent
	// in protocols 1 and 2 (PROTOCOL.md, "Parts").
	Parts []Part `json:"parts,omitempty"`
}

// Part is one part of a protocol-3 version. An announcement's parts carry
// the first three fields; a manifest's parts all of them.
type Part struct {
	Subject          string `json:"subject"`
	TotalBytes       int64  `json:"total_bytes"`
	Chunks           int    `json:"chunks"`
	HeaderBytes      int    `json:"header_bytes,omitempty"`
	Tensors          int    `json:"tensors,omitempty"`
	ChunkTableSHA256 string `json:"chunk_table_sha256,omitempty"`
}

// PartList returns the version's parts: Parts, or for a version of one
// part (protocols 1 and 2) that part, from the top-level fields.
func (a Announce) PartList() []Part {
	if len(a.Parts) > 0 {
		return a.Parts
	}
	return []Part{{Subject: a.Subject, TotalBytes: a.TotalBytes, Chunks: a.Chunks}}
}

// Manifest is the bucket's "manifest" value: the newest complete version.
type Manifest struct {
	Announce
	// HeaderBytes is the length of the stream's JSON header in bytes, the
	// value of its first 8 bytes (padding included, the 8 bytes not).
	HeaderBytes int `json:"header_bytes"`
	// Tensors is the number of tensors in the header (__metadata__ not
	// counted).
	Tensors int `json:"tensors"`
	// ChunkTableSHA256 is the hex SHA-256 of the version's chunk table
	// (ChunkTable): protocol 2.
	ChunkTableSHA256 string `json:"chunk_table_sha256,omitempty"`
	// SHA256 is the hex SHA-256 of the whole stream: protocol 1 only.
	SHA256 string `json:"sha256,omitempty"`
	// StreamSHA256 is the hex SHA-256 of the whole stream in a signed
	// protocol-2 manifest: what binds the signature to the bytes (a chunk
	// table binds them only by CRC-32C, which is no defence against
	// forgery).
	StreamSHA256 string `json:"stream_sha256,omitempty"`
	// PublishedAt is when the publisher wrote the manifest, RFC 3339:
	// required, not checked against any clock, not signed.
	PublishedAt time.Time `json:"published_at"`
	// SignedBy and Signature sign the manifest (SignedBytes).
	SignedBy  string `json:"signed_by,omitempty"`
	Signature string `json:"signature,omitempty"`
}

// Digest returns the manifest's digest field, by its protocol.
func (m Manifest) Digest() string {
	if m.Protocol == Protocol1 {
		return m.SHA256
	}
	return m.ChunkTableSHA256
}

// check validates an announcement's fields.
func (a Announce) check(what string) error {
	switch {
	case !knownProtocol(a.Protocol):
		return fmt.Errorf("%w: %s: protocol %d, want %d to %d", ErrProtocol, what, a.Protocol, Protocol1, ProtocolLive)
	case !ValidModelID(a.Model):
		return fmt.Errorf("%w: %s: model %q", ErrProtocol, what, a.Model)
	case a.Version == 0:
		return fmt.Errorf("%w: %s: version 0", ErrProtocol, what)
	case !a.Full && a.Base >= a.Version:
		return fmt.Errorf("%w: %s: partial version %d on base %d", ErrProtocol, what, a.Version, a.Base)
	case a.Full && a.Base != 0:
		return fmt.Errorf("%w: %s: base %d in a full version: want 0 (or no base)", ErrProtocol, what, a.Base)
	case a.Subject != storedSubject(a.Protocol, a.Model, a.Version, 0):
		return fmt.Errorf("%w: %s: subject %q, want %q", ErrProtocol, what, a.Subject, storedSubject(a.Protocol, a.Model, a.Version, 0))
	case a.TotalBytes <= 8 || a.TotalBytes > MaxStreamBytes:
		return fmt.Errorf("%w: %s: total bytes %d", ErrProtocol, what, a.TotalBytes)
	case a.ChunkBytes <= 0 || a.ChunkBytes > MaxChunkBytes:
		return fmt.Errorf("%w: %s: chunk bytes %d", ErrProtocol, what, a.ChunkBytes)
	case int64(a.Chunks) != (a.TotalBytes+int64(a.ChunkBytes)-1)/int64(a.ChunkBytes):
		return fmt.Errorf("%w: %s: %d chunks of %d bytes for %d bytes", ErrProtocol, what, a.Chunks, a.ChunkBytes, a.TotalBytes)
	case a.HeaderSHA256 != "" && !isSHA256Hex(a.HeaderSHA256):
		return fmt.Errorf("%w: %s: header_sha256 %q: want 64 lowercase hex digits", ErrProtocol, what, a.HeaderSHA256)
	case !inParts(a.Protocol) && a.Parts != nil:
		return fmt.Errorf("%w: %s: protocol %d with parts: parts are protocol %d or %d", ErrProtocol, what, a.Protocol, ProtocolParts, ProtocolLive)
	case inParts(a.Protocol) && (len(a.Parts) < 2 || len(a.Parts) > MaxParts):
		return fmt.Errorf("%w: %s: protocol %d with %d parts: want 2 to %d", ErrProtocol, what, a.Protocol, len(a.Parts), MaxParts)
	}
	var sum int64
	for i, pt := range a.Parts {
		switch {
		case pt.Subject != storedSubject(a.Protocol, a.Model, a.Version, i):
			return fmt.Errorf("%w: %s: part %d: subject %q, want %q", ErrProtocol, what, i, pt.Subject, storedSubject(a.Protocol, a.Model, a.Version, i))
		case pt.TotalBytes <= 8 || pt.TotalBytes > MaxStreamBytes:
			return fmt.Errorf("%w: %s: part %d: total bytes %d", ErrProtocol, what, i, pt.TotalBytes)
		case int64(pt.Chunks) != (pt.TotalBytes+int64(a.ChunkBytes)-1)/int64(a.ChunkBytes):
			return fmt.Errorf("%w: %s: part %d: %d chunks of %d bytes for %d bytes", ErrProtocol, what, i, pt.Chunks, a.ChunkBytes, pt.TotalBytes)
		case i == 0 && (pt.TotalBytes != a.TotalBytes || pt.Chunks != a.Chunks):
			return fmt.Errorf("%w: %s: part 0 of %d bytes in %d chunks, the version's fields say %d in %d", ErrProtocol, what, pt.TotalBytes, pt.Chunks, a.TotalBytes, a.Chunks)
		}
		if sum += pt.TotalBytes; sum > MaxStreamBytes {
			return fmt.Errorf("%w: %s: parts of more than %d bytes", ErrProtocol, what, MaxStreamBytes)
		}
	}
	return nil
}

// requireFields checks that the JSON object b has the named keys, spelled
// exactly so and not null: encoding/json would take a missing one as its
// zero value (a missing "full" as a partial version, a missing "base" as
// base 0) and match keys regardless of case.
func requireFields(keys map[string]json.RawMessage, what string, names ...string) error {
	for _, n := range names {
		if v, ok := keys[n]; !ok || string(v) == "null" {
			return fmt.Errorf("%w: %s: no %q field", ErrProtocol, what, n)
		}
	}
	return nil
}

// announceRequired returns the fields an announcement (or a manifest)
// must carry: all of them but base, which only a partial version needs.
func announceRequired(full bool) []string {
	f := []string{"protocol", "model", "version", "full", "subject", "total_bytes", "chunk_bytes", "chunks"}
	if !full {
		f = append(f, "base")
	}
	return f
}

// ParseAnnounce decodes and checks an announcement.
func ParseAnnounce(b []byte) (Announce, error) {
	var a Announce
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(b, &keys); err != nil {
		return a, fmt.Errorf("%w: announce: %v", ErrProtocol, err)
	}
	if err := json.Unmarshal(b, &a); err != nil {
		return a, fmt.Errorf("%w: announce: %v", ErrProtocol, err)
	}
	if err := requireFields(keys, "announce", announceRequired(a.Full)...); err != nil {
		return a, err
	}
	return a, a.check("announce")
}

// ParseManifest decodes and checks a manifest.
func ParseManifest(b []byte) (Manifest, error) {
	var m Manifest
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(b, &keys); err != nil {
		return m, fmt.Errorf("%w: manifest: %v", ErrProtocol, err)
	}
	if raw, ok := keys["published_at"]; ok {
		// Checked on its own, so that the error names the field.
		var at time.Time
		if err := json.Unmarshal(raw, &at); err != nil {
			return m, fmt.Errorf("%w: manifest: published_at %.40s: want an RFC 3339 time, a JSON string (%v)", ErrProtocol, raw, err)
		}
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("%w: manifest: %v", ErrProtocol, err)
	}
	if err := requireFields(keys, "manifest", append(announceRequired(m.Full), "header_bytes", "tensors", "published_at")...); err != nil {
		return m, err
	}
	if err := m.check("manifest"); err != nil {
		return m, err
	}
	switch {
	case m.HeaderBytes < 2 || m.HeaderBytes > MaxHeaderBytes:
		return m, fmt.Errorf("%w: manifest: header_bytes %d: want 2 to %d", ErrProtocol, m.HeaderBytes, MaxHeaderBytes)
	case m.Tensors < 0 || m.Tensors > MaxTensors:
		return m, fmt.Errorf("%w: manifest: tensors %d: want 0 to %d", ErrProtocol, m.Tensors, MaxTensors)
	case m.PublishedAt.IsZero():
		return m, fmt.Errorf("%w: manifest: published_at %s: want the time the manifest was written", ErrProtocol, m.PublishedAt.Format(time.RFC3339))
	}
	field, other := "chunk_table_sha256", "sha256"
	if m.Protocol == Protocol1 {
		field, other = other, field
	}
	sum := m.Digest()
	if b, err := hex.DecodeString(sum); err != nil || len(b) != sha256.Size || strings.ToLower(sum) != sum {
		return m, fmt.Errorf("%w: manifest: protocol %d: %s %q: want 64 lowercase hex digits", ErrProtocol, m.Protocol, field, sum)
	}
	// One digest per protocol: a manifest carrying the other one was made
	// by a publisher that mixed the two.
	if m.Protocol == Protocol1 && m.ChunkTableSHA256 != "" || m.Protocol != Protocol1 && m.SHA256 != "" {
		return m, fmt.Errorf("%w: manifest: protocol %d carries %s", ErrProtocol, m.Protocol, other)
	}
	if m.StreamSHA256 != "" && !isSHA256Hex(m.StreamSHA256) {
		return m, fmt.Errorf("%w: manifest: stream_sha256 %q: want 64 lowercase hex digits", ErrProtocol, m.StreamSHA256)
	}
	if inParts(m.Protocol) && m.StreamSHA256 != "" {
		return m, fmt.Errorf("%w: manifest: protocol %d carries stream_sha256: parts are not signed", ErrProtocol, m.Protocol)
	}
	for i, pt := range m.Parts {
		switch {
		case pt.HeaderBytes < 2 || pt.HeaderBytes > MaxHeaderBytes:
			return m, fmt.Errorf("%w: manifest: part %d: header_bytes %d: want 2 to %d", ErrProtocol, i, pt.HeaderBytes, MaxHeaderBytes)
		case pt.Tensors < 1 || pt.Tensors > MaxTensors:
			return m, fmt.Errorf("%w: manifest: part %d: tensors %d: want 1 to %d", ErrProtocol, i, pt.Tensors, MaxTensors)
		case !isSHA256Hex(pt.ChunkTableSHA256):
			return m, fmt.Errorf("%w: manifest: part %d: chunk_table_sha256 %q: want 64 lowercase hex digits", ErrProtocol, i, pt.ChunkTableSHA256)
		case i == 0 && (pt.HeaderBytes != m.HeaderBytes || pt.Tensors != m.Tensors || pt.ChunkTableSHA256 != m.ChunkTableSHA256):
			return m, fmt.Errorf("%w: manifest: part 0 differs from the version's header_bytes, tensors and chunk_table_sha256", ErrProtocol)
		}
	}
	return m, nil
}

// ChunkTableEntryBytes is the size of one chunk's entry in the chunk table.
const ChunkTableEntryBytes = 16

// ChunkTable computes the digest of a protocol-2 version (PROTOCOL.md,
// "Manifest"): the SHA-256 of its chunk table, which holds for every chunk,
// in order, its offset (uint64), length (uint32) and CRC-32C (uint32),
// little-endian, 16 bytes an entry. The CRC-32C of every chunk is computed
// anyway, so the digest costs no pass over the bytes; the table's hash
// still binds every chunk's content (through its CRC) to the manifest.
type ChunkTable struct {
	h hash.Hash
	n int
}

// NewChunkTable returns an empty table.
func NewChunkTable() *ChunkTable { return &ChunkTable{h: sha256.New()} }

// Add appends the entry of the next chunk.
func (t *ChunkTable) Add(offset int64, length int, crc uint32) {
	var e [ChunkTableEntryBytes]byte
	binary.LittleEndian.PutUint64(e[0:], uint64(offset))
	binary.LittleEndian.PutUint32(e[8:], uint32(length))
	binary.LittleEndian.PutUint32(e[12:], crc)
	t.h.Write(e[:])
	t.n++
}

// Len is the number of entries added.
func (t *ChunkTable) Len() int { return t.n }

// Sum returns the hex SHA-256 of the entries added so far.
func (t *ChunkTable) Sum() string { return hex.EncodeToString(t.h.Sum(nil)) }

// Worker states in a Status.
const (
	StateApplied   = "applied"
	StateRejected  = "rejected"
	StateNeedsFull = "needs_full"
)

// LayerTiming is one decoder layer's share of a refit, in milliseconds.
type LayerTiming struct {
	Layer        int     `json:"layer"`
	ReceiveMS    float64 `json:"receive_ms"`
	CopyMS       float64 `json:"copy_ms"`
	RequantizeMS float64 `json:"requantize_ms"`
}

// Status is a worker's report on one version.
type Status struct {
	Protocol       int                `json:"protocol"`
	Worker         string             `json:"worker"`
	Version        uint64             `json:"version"`
	State          string             `json:"state"`
	Reason         string             `json:"reason,omitempty"`
	CurrentVersion uint64             `json:"current_version"`
	Bytes          int64              `json:"bytes"`
	PhasesMS       map[string]float64 `json:"phases_ms,omitempty"`
	Layers         []LayerTiming      `json:"layers,omitempty"`
	Chunks         *ChunkSources      `json:"chunks,omitempty"`
}

// ChunkSources counts where an applied version's chunks came from: live
// (core NATS, as published) or read back from the streams (a part that
// fell behind, or was joined late).
type ChunkSources struct {
	Live   int `json:"live"`
	Stream int `json:"stream"`
}

// ParseStatus decodes a status message.
func ParseStatus(b []byte) (Status, error) {
	var s Status
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("%w: status: %v", ErrProtocol, err)
	}
	switch {
	case !knownProtocol(s.Protocol):
		return s, fmt.Errorf("%w: status: protocol %d, want %d to %d", ErrProtocol, s.Protocol, Protocol1, ProtocolLive)
	case s.State != StateApplied && s.State != StateRejected && s.State != StateNeedsFull:
		return s, fmt.Errorf("%w: status: state %q", ErrProtocol, s.State)
	case s.Worker == "" || s.Version == 0:
		return s, fmt.Errorf("%w: status: worker %q, version %d", ErrProtocol, s.Worker, s.Version)
	}
	return s, nil
}

// TensorInfo is one tensor of an incoming safetensors header.
type TensorInfo struct {
	Name  string
	DType string
	Shape []int
	Begin int64 // data offsets, relative to the start of the data section
	End   int64
}

// Header is a parsed safetensors header.
type Header struct {
	Len     int64 // JSON bytes
	Tensors []TensorInfo
}

// DataStart is the stream offset of the data section.
func (h Header) DataStart() int64 { return 8 + h.Len }

// deltaTensors counts the delta tensors (DeltaDType).
func (h Header) deltaTensors() int {
	n := 0
	for _, t := range h.Tensors {
		if t.DType == DeltaDType {
			n++
		}
	}
	return n
}

// HeaderLen reads the 8-byte little-endian header length at the start of a
// stream; ok is false while fewer than 8 bytes are known.
func HeaderLen(prefix []byte) (n int64, ok bool, err error) {
	if len(prefix) < 8 {
		return 0, false, nil
	}
	u := binary.LittleEndian.Uint64(prefix)
	if u == 0 || u > MaxHeaderBytes {
		return 0, true, fmt.Errorf("%w: safetensors header of %d bytes", ErrProtocol, u)
	}
	return int64(u), true, nil
}

// ParseHeader decodes the JSON header of a stream of total bytes and checks
// it (PROTOCOL.md, "The safetensors stream"): its form (checkHeaderForm: an
// object from the first byte, spaces after it, no key twice, tensor entries
// of exactly dtype, shape and data_offsets, string metadata), every entry
// has a known dtype, a shape whose size matches its byte range (for BF16: 2
// bytes an element; for a delta tensor, DeltaDType, between the least and
// the most its regions' records take), and the data ranges tile the data section exactly,
// without gaps or overlaps, whatever the order of the keys. Tensors are
// returned in data order.
func ParseHeader(js []byte, total int64) (Header, error) {
	h := Header{Len: int64(len(js))}
	entries, err := headerEntries(js)
	if err != nil {
		return h, err
	}
	keys, meta, err := checkHeaderForm(js)
	if err != nil {
		return h, err
	}
	// A name given twice decodes as one entry (the last): JSON parsers
	// disagree on which, so the protocol refuses it.
	names := len(entries)
	if _, ok := entries["__metadata__"]; ok {
		names--
	}
	if meta {
		keys--
	}
	if names != keys {
		return h, fmt.Errorf("%w: safetensors header: %d tensor entries for %d distinct names: a name appears twice", ErrProtocol, keys, names)
	}
	for name, e := range entries {
		if name == "__metadata__" {
			continue
		}
		t := TensorInfo{Name: name, DType: e.DType, Begin: e.DataOffsets[0], End: e.DataOffsets[1]}
		elems := int64(1)
		for _, d := range e.Shape {
			if d < 0 || d > math.MaxInt32 || (d > 0 && elems > MaxStreamBytes/d) {
				return h, fmt.Errorf("%w: tensor %q: shape %v", ErrProtocol, name, e.Shape)
			}
			elems *= d
			t.Shape = append(t.Shape, int(d))
		}
		if t.Begin < 0 || t.End < t.Begin {
			return h, fmt.Errorf("%w: tensor %q: data offsets %v", ErrProtocol, name, e.DataOffsets)
		}
		if e.DType == DeltaDType {
			// Records of its regions: as many bytes as they take.
			if lo, hi := deltaBytesRange(elems); t.End-t.Begin < lo || t.End-t.Begin > hi {
				return h, fmt.Errorf("%w: tensor %q: %s%v in %d bytes: its records take %d to %d", ErrProtocol, name, e.DType, e.Shape, t.End-t.Begin, lo, hi)
			}
			h.Tensors = append(h.Tensors, t)
			continue
		}
		size := dtypeSize(e.DType)
		if size == 0 {
			return h, fmt.Errorf("%w: tensor %q: unknown dtype %q", ErrProtocol, name, e.DType)
		}
		if elems*size != t.End-t.Begin {
			return h, fmt.Errorf("%w: tensor %q: %s%v takes %d bytes, data offsets give %d", ErrProtocol, name, e.DType, e.Shape, elems*size, t.End-t.Begin)
		}
		h.Tensors = append(h.Tensors, t)
	}
	sort.Slice(h.Tensors, func(i, j int) bool {
		a, b := h.Tensors[i], h.Tensors[j]
		return a.Begin < b.Begin || a.Begin == b.Begin && (a.End < b.End || a.End == b.End && a.Name < b.Name)
	})
	var at int64
	for _, t := range h.Tensors {
		if t.Begin != at {
			return h, fmt.Errorf("%w: tensor %q: data starts at %d, want %d (gap or overlap)", ErrProtocol, t.Name, t.Begin, at)
		}
		at = t.End
	}
	if want := total - h.DataStart(); at != want {
		return h, fmt.Errorf("%w: tensors cover %d data bytes, the stream has %d", ErrProtocol, at, want)
	}
	return h, nil
}

// checkHeaderForm checks the form of a safetensors JSON header that
// encoding/json has accepted (so it is one valid JSON value), as
// PROTOCOL.md has it: UTF-8; an object from the first byte, followed by
// nothing but spaces (the padding); __metadata__ at most once, an object of
// strings; every other value an object with exactly the keys dtype (a
// string), shape (an array of integers) and data_offsets (an array of two
// integers), each once, in any order. It returns the number of top-level
// keys and whether __metadata__ is one of them: the caller compares the
// count with the distinct names decoded, to refuse a name given twice.
// One pass over the bytes, no allocation but for an error or an escaped
// key.
func checkHeaderForm(js []byte) (keys int, meta bool, err error) {
	bad := func(format string, args ...any) (int, bool, error) {
		return 0, false, fmt.Errorf("%w: safetensors header: %s", ErrProtocol, fmt.Sprintf(format, args...))
	}
	if !utf8.Valid(js) {
		return bad("not UTF-8")
	}
	if len(js) == 0 || js[0] != '{' {
		return bad("starts with %q: want {", js[:min(len(js), 1)])
	}
	s := &hdrScan{b: js}
	err = s.object(func(key []byte) error {
		keys++
		if keyIs(key, "__metadata__") {
			if meta {
				return fmt.Errorf("__metadata__ appears twice")
			}
			meta = true
			if s.b[s.i] != '{' {
				return fmt.Errorf("__metadata__ is not an object")
			}
			return s.object(func(k []byte) error {
				if s.b[s.i] != '"' {
					return fmt.Errorf("__metadata__ %s: the value is not a string", k)
				}
				s.skip()
				return nil
			})
		}
		if s.b[s.i] != '{' {
			return fmt.Errorf("tensor %s is not an object", key)
		}
		var have uint8
		err := s.object(func(k []byte) error {
			var bit uint8
			var ok bool
			var want string
			switch {
			case keyIs(k, "dtype"):
				bit, ok, want = 1, s.b[s.i] == '"', "a string"
				s.skip()
			case keyIs(k, "shape"):
				bit, want = 2, "an array of integers"
				_, ok = s.ints()
			case keyIs(k, "data_offsets"):
				var n int
				bit, want = 4, "an array of two integers [begin, end]"
				n, ok = s.ints()
				ok = ok && n == 2
			default:
				return fmt.Errorf("tensor %s: key %s: want only dtype, shape and data_offsets", key, k)
			}
			if !ok {
				return fmt.Errorf("tensor %s: %s: want %s", key, k, want)
			}
			if have&bit != 0 {
				return fmt.Errorf("tensor %s: key %s appears twice", key, k)
			}
			have |= bit
			return nil
		})
		if err != nil {
			return err
		}
		if have != 7 {
			return fmt.Errorf("tensor %s: want the keys dtype, shape and data_offsets, each once", key)
		}
		return nil
	})
	if err != nil {
		return bad("%v", err)
	}
	for i := s.i; i < len(js); i++ {
		if js[i] != ' ' {
			return bad("byte %d, %q, after the object: only spaces (0x20) may follow it", i, js[i])
		}
	}
	return keys, meta, nil
}

// hdrScan walks JSON text that encoding/json has already accepted: it
// does not check the grammar, only reads it.
type hdrScan struct {
	b []byte
	i int
}

// ws skips JSON whitespace.
func (s *hdrScan) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// str reads the string at s.i and returns its JSON text, quotes included.
func (s *hdrScan) str() []byte {
	start := s.i
	for s.i++; s.b[s.i] != '"'; s.i++ {
		if s.b[s.i] == '\\' {
			s.i++
		}
	}
	s.i++
	return s.b[start:s.i]
}

// skip skips the value at s.i.
func (s *hdrScan) skip() {
	switch s.b[s.i] {
	case '"':
		s.str()
	case '{', '[':
		for depth := 0; ; {
			switch s.b[s.i] {
			case '"':
				s.str()
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
			}
			s.i++
			if depth == 0 {
				return
			}
		}
	default: // a number, true, false or null
		for ; s.i < len(s.b); s.i++ {
			switch s.b[s.i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return
			}
		}
	}
}

// object reads the object at s.i, calling member with each key's JSON
// text and s.i at its value, which member must read.
func (s *hdrScan) object(member func(key []byte) error) error {
	s.i++ // {
	s.ws()
	if s.b[s.i] == '}' {
		s.i++
		return nil
	}
	for {
		s.ws()
		key := s.str()
		s.ws()
		s.i++ // :
		s.ws()
		if err := member(key); err != nil {
			return err
		}
		s.ws()
		c := s.b[s.i]
		s.i++
		if c == '}' {
			return nil
		}
	}
}

// ints reads the array at s.i; ok says it is one of numbers (whose being
// integers encoding/json checks), n how many.
func (s *hdrScan) ints() (n int, ok bool) {
	if s.b[s.i] != '[' {
		s.skip()
		return 0, false
	}
	s.i++
	ok = true
	s.ws()
	if s.b[s.i] == ']' {
		s.i++
		return 0, true
	}
	for {
		s.ws()
		if c := s.b[s.i]; c != '-' && (c < '0' || c > '9') {
			ok = false
		}
		s.skip()
		n++
		s.ws()
		c := s.b[s.i]
		s.i++
		if c == ']' {
			return n, ok
		}
	}
}

// keyIs reports whether the JSON string text raw stands for name, without
// allocating unless raw holds an escape.
func keyIs(raw []byte, name string) bool {
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw[1:len(raw)-1]) == name
	}
	var k string
	return json.Unmarshal(raw, &k) == nil && k == name
}

// headerEntry is one entry of a safetensors header.
type headerEntry struct {
	DType       string   `json:"dtype"`
	Shape       []int64  `json:"shape"`
	DataOffsets [2]int64 `json:"data_offsets"`
}

// headerEntries decodes a safetensors header's entries, __metadata__
// included (its value then means nothing). It decodes straight into the
// entries: one pass of encoding/json instead of two (the raw entries, then
// each of them) halves the time of a header, which every worker spends on
// the first chunk of every version (0.7 ms for the 300 tensors of the
// small preset; headers of large MoE models hold tens of thousands). An
// error there (a malformed header, or a __metadata__ whose values do not
// fit the entry's fields) falls back to the two passes, which skip
// __metadata__ and name the tensor at fault: the result is the same.
func headerEntries(js []byte) (map[string]headerEntry, error) {
	var entries map[string]headerEntry
	if err := json.Unmarshal(js, &entries); err == nil {
		if len(entries) > MaxTensors {
			return nil, fmt.Errorf("%w: safetensors header: %d tensors", ErrProtocol, len(entries))
		}
		return entries, nil
	}
	return headerEntriesTwoPass(js)
}

// headerEntriesTwoPass is headerEntries in two passes, without
// __metadata__.
func headerEntriesTwoPass(js []byte) (map[string]headerEntry, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(js, &raw); err != nil {
		return nil, fmt.Errorf("%w: safetensors header: %v", ErrProtocol, err)
	}
	if len(raw) > MaxTensors {
		return nil, fmt.Errorf("%w: safetensors header: %d tensors", ErrProtocol, len(raw))
	}
	entries := make(map[string]headerEntry, len(raw))
	for name, v := range raw {
		if name == "__metadata__" {
			continue
		}
		var e headerEntry
		if err := json.Unmarshal(v, &e); err != nil {
			return nil, fmt.Errorf("%w: tensor %q: %v", ErrProtocol, name, err)
		}
		entries[name] = e
	}
	return entries, nil
}

// dtypeSize is the element size of a safetensors dtype, 0 if unknown.
func dtypeSize(dt string) int64 {
	switch dt {
	case "BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2":
		return 1
	case "BF16", "F16", "I16", "U16":
		return 2
	case "F32", "I32", "U32":
		return 4
	case "F64", "I64", "U64":
		return 8
	}
	return 0
}
