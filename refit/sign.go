package refit

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/nats-io/nkeys"
)

// Signing (PROTOCOL.md, "Signatures"). A publisher holding an nkey seed
// signs every announcement and manifest with ed25519 over a fixed text
// rendering of the fields a worker acts on (SignedBytes); a worker given a
// Trust applies only versions whose announcement and manifest are signed by
// one of its keys. The manifest of a signed version also carries the SHA-256
// of the whole stream: the chunk table binds chunks by their CRC-32C, which
// anyone can forge, so it alone does not authenticate the bytes.

// Errors of signature checks, for errors.Is.
var (
	// ErrUnsigned: the worker trusts signed versions only and this one
	// carries no signature.
	ErrUnsigned = errors.New("refit: unsigned version")
	// ErrUntrustedKey: signed by a key the worker does not trust.
	ErrUntrustedKey = errors.New("refit: signed by an untrusted key")
	// ErrBadSignature: the signature does not verify (the signed fields
	// were changed, or it is not an ed25519 signature at all).
	ErrBadSignature = errors.New("refit: bad signature")
)

// signatureBytes is the size of an ed25519 signature.
const signatureBytes = 64

// Domain lines: the first line of the signed text, so that a signature of
// an announcement is never one of a manifest, nor of anything else.
const (
	signedAnnounceLine = "rollout-worker refit announce signature 1\n"
	signedManifestLine = "rollout-worker refit manifest signature 1\n"
)

// SignedBytes is what the signature of an announcement covers: the domain
// line, then one "name=value\n" line per field, in this order, numbers in
// decimal without leading zeros, booleans as true or false (PROTOCOL.md,
// "Signatures").
func (a Announce) SignedBytes() []byte {
	var b bytes.Buffer
	b.WriteString(signedAnnounceLine)
	a.writeSigned(&b)
	return b.Bytes()
}

func (a Announce) writeSigned(b *bytes.Buffer) {
	line := func(name, value string) {
		b.WriteString(name)
		b.WriteByte('=')
		b.WriteString(value)
		b.WriteByte('\n')
	}
	u := func(v uint64) string { return strconv.FormatUint(v, 10) }
	line("protocol", strconv.Itoa(a.Protocol))
	line("model", a.Model)
	line("version", u(a.Version))
	line("full", strconv.FormatBool(a.Full))
	line("base", u(a.Base))
	line("subject", a.Subject)
	line("total_bytes", strconv.FormatInt(a.TotalBytes, 10))
	line("chunk_bytes", strconv.Itoa(a.ChunkBytes))
	line("chunks", strconv.Itoa(a.Chunks))
	line("header_sha256", a.HeaderSHA256)
}

// SignedBytes is what the signature of a manifest covers: the manifest's
// domain line, the announcement's lines, then header_bytes, tensors,
// chunk_table_sha256 and stream_sha256 (PROTOCOL.md, "Signatures").
// published_at and the signature fields are not covered.
func (m Manifest) SignedBytes() []byte {
	var b bytes.Buffer
	b.WriteString(signedManifestLine)
	m.Announce.writeSigned(&b)
	fmt.Fprintf(&b, "header_bytes=%d\ntensors=%d\nchunk_table_sha256=%s\nstream_sha256=%s\n",
		m.HeaderBytes, m.Tensors, m.ChunkTableSHA256, m.StreamSHA256)
	return b.Bytes()
}

// Signer signs announcements and manifests with an nkey.
type Signer struct {
	kp  nkeys.KeyPair
	pub string
}

// NewSigner returns a signer for the seed of an ed25519 nkey (user,
// account or operator), or for a NATS credentials file's seed.
func NewSigner(seed []byte) (*Signer, error) {
	seed = bytes.TrimSpace(seed)
	var kp nkeys.KeyPair
	var err error
	if bytes.Contains(seed, []byte("-----BEGIN")) {
		kp, err = nkeys.ParseDecoratedNKey(seed)
	} else {
		kp, err = nkeys.FromSeed(seed)
	}
	if err != nil {
		// The seed is secret: the error does not quote it.
		return nil, fmt.Errorf("refit: signing key: not an nkey seed: %w", err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return nil, fmt.Errorf("refit: signing key: %w", err)
	}
	if !signingPrefix(pub) {
		return nil, fmt.Errorf("refit: signing key: public key %s is not a user, account or operator key", pub)
	}
	if _, err := kp.Sign(nil); err != nil {
		return nil, fmt.Errorf("refit: signing key %s: %w", pub, err)
	}
	return &Signer{kp: kp, pub: pub}, nil
}

// LoadSigner reads a seed file (as nk -gen user writes it, or a NATS
// credentials file) and returns its signer.
func LoadSigner(path string) (*Signer, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("refit: signing key: %w", err)
	}
	s, err := NewSigner(b)
	if err != nil {
		return nil, fmt.Errorf("%w (file %s)", err, path)
	}
	return s, nil
}

// PublicKey is the signer's public nkey, as a Trust file lists it.
func (s *Signer) PublicKey() string { return s.pub }

// sign returns the signature fields for msg.
func (s *Signer) sign(msg []byte) (signedBy, signature string, err error) {
	sig, err := s.kp.Sign(msg)
	if err != nil {
		return "", "", fmt.Errorf("sign with %s: %w", s.pub, err)
	}
	return s.pub, base64.StdEncoding.EncodeToString(sig), nil
}

// SignAnnounce sets a's signature fields. HeaderSHA256 must be set first.
func (s *Signer) SignAnnounce(a *Announce) error {
	var err error
	a.SignedBy, a.Signature, err = s.sign(a.SignedBytes())
	return err
}

// SignManifest sets m's signature fields. StreamSHA256 and HeaderSHA256
// must be set first.
func (s *Signer) SignManifest(m *Manifest) error {
	var err error
	m.SignedBy, m.Signature, err = s.sign(m.SignedBytes())
	return err
}

// signingPrefix reports whether a public nkey is of a type that signs:
// user (U), account (A) or operator (O).
func signingPrefix(pub string) bool {
	return pub != "" && strings.ContainsRune("UAO", rune(pub[0]))
}

// Trust is the set of public keys whose signed versions a worker applies.
type Trust struct {
	keys map[string]nkeys.KeyPair
}

// NewTrust returns a Trust of the given public nkeys.
func NewTrust(keys ...string) (*Trust, error) {
	t := &Trust{keys: map[string]nkeys.KeyPair{}}
	for i, k := range keys {
		kp, err := parsePublicKey(k)
		if err != nil {
			return nil, fmt.Errorf("refit: trust: key %d: %w", i+1, err)
		}
		t.keys[k] = kp
	}
	if len(t.keys) == 0 {
		return nil, errors.New("refit: trust: no keys")
	}
	return t, nil
}

// parsePublicKey checks one public nkey. Its errors never quote the key
// (it may be a seed pasted by mistake).
func parsePublicKey(k string) (nkeys.KeyPair, error) {
	if k == "" {
		return nil, errors.New("empty key")
	}
	if k[0] == 'S' {
		return nil, errors.New("a seed, not a public key (list the public key; keep the seed secret)")
	}
	kp, err := nkeys.FromPublicKey(k)
	if err != nil {
		return nil, fmt.Errorf("not a public nkey (%d characters): %w", len(k), err)
	}
	if !signingPrefix(k) {
		return nil, fmt.Errorf("public key of type %q: want a user (U), account (A) or operator (O) key", k[:1])
	}
	return kp, nil
}

// ParseTrust reads a trust file: one public nkey a line; blank lines and
// everything from a '#' to the end of its line are ignored. At least one
// key is required, and every other line must be a valid public key.
func ParseTrust(b []byte) (*Trust, error) {
	var keys []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		if _, err := parsePublicKey(line); err != nil {
			return nil, fmt.Errorf("refit: trust: line %d: %w", n, err)
		}
		keys = append(keys, line)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("refit: trust: %w", err)
	}
	if len(keys) == 0 {
		return nil, errors.New("refit: trust: no keys (a worker given a trust file applies versions signed by one of its keys)")
	}
	return NewTrust(keys...)
}

// LoadTrust reads a trust file (see ParseTrust).
func LoadTrust(path string) (*Trust, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("refit: trust: %w", err)
	}
	t, err := ParseTrust(b)
	if err != nil {
		return nil, fmt.Errorf("%w (file %s)", err, path)
	}
	return t, nil
}

// Keys returns the trusted public keys, sorted.
func (t *Trust) Keys() []string {
	out := make([]string, 0, len(t.keys))
	for k := range t.keys {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// verify checks a signature of msg: signedBy must be a trusted key and
// signature the standard base64 of its ed25519 signature of msg.
func (t *Trust) verify(msg []byte, signedBy, signature string) error {
	if signedBy == "" && signature == "" {
		return ErrUnsigned
	}
	kp, ok := t.keys[signedBy]
	if !ok {
		if len(signedBy) > 64 {
			signedBy = signedBy[:64] + "..."
		}
		return fmt.Errorf("%w: %q", ErrUntrustedKey, signedBy)
	}
	sig, err := base64.StdEncoding.Strict().DecodeString(signature)
	if err != nil || len(sig) != signatureBytes {
		return fmt.Errorf("%w: signature by %s: want the base64 of %d bytes", ErrBadSignature, signedBy, signatureBytes)
	}
	if err := kp.Verify(msg, sig); err != nil {
		return fmt.Errorf("%w: by %s: the signed fields were changed or signed by another key", ErrBadSignature, signedBy)
	}
	return nil
}

// VerifyAnnounce checks an announcement's signature against the trusted
// keys. A signed version must be protocol 2 and name its header's SHA-256.
func (t *Trust) VerifyAnnounce(a Announce) error {
	if err := t.verify(a.SignedBytes(), a.SignedBy, a.Signature); err != nil {
		return fmt.Errorf("announcement of version %d: %w", a.Version, err)
	}
	return a.checkSigned("announcement")
}

// VerifyManifest checks a manifest's signature against the trusted keys.
// A signed manifest must be protocol 2 and carry the header's and the
// whole stream's SHA-256.
func (t *Trust) VerifyManifest(m Manifest) error {
	if err := t.verify(m.SignedBytes(), m.SignedBy, m.Signature); err != nil {
		return fmt.Errorf("manifest of version %d: %w", m.Version, err)
	}
	if err := m.checkSigned("manifest"); err != nil {
		return err
	}
	if !isSHA256Hex(m.StreamSHA256) {
		return fmt.Errorf("%w: signed manifest of version %d: stream_sha256 %q: want 64 lowercase hex digits", ErrProtocol, m.Version, m.StreamSHA256)
	}
	return nil
}

// checkSigned checks what a signed announcement or manifest must carry.
func (a Announce) checkSigned(what string) error {
	if a.Protocol != ProtocolVersion {
		return fmt.Errorf("%w: signed %s of version %d: protocol %d, signatures are protocol %d", ErrProtocol, what, a.Version, a.Protocol, ProtocolVersion)
	}
	if !isSHA256Hex(a.HeaderSHA256) {
		return fmt.Errorf("%w: signed %s of version %d: header_sha256 %q: want 64 lowercase hex digits", ErrProtocol, what, a.Version, a.HeaderSHA256)
	}
	return nil
}

// isSHA256Hex reports whether s is 64 lowercase hex digits.
func isSHA256Hex(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range []byte(s) {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}
