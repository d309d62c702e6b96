package refit

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nkeys"
)

// The worked example of PROTOCOL.md, "Signatures": a user seed whose raw
// bytes are 1, 2, ..., 32.
const (
	sgExampleSeed = "SUAACAQDAQCQMBYIBEFAWDANBYHRAEISCMKBKFQXDAMRUGY4DUPB6IC5CQ"
	sgExamplePub  = "UB43KVROR7TFJ6KAPCYRF2FJROTZAH4FHLTJLPWX4DRZCC5NASLGJBFE"
)

func sgExample() (Announce, Manifest) {
	a := Announce{Protocol: 2, Model: "llama", Version: 7, Full: false, Base: 6, Subject: "refit.llama.v.7",
		TotalBytes: 10000, ChunkBytes: 4000, Chunks: 3,
		HeaderSHA256: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"}
	m := Manifest{Announce: a, HeaderBytes: 20480, Tensors: 579,
		ChunkTableSHA256: "7bfacf0a6878da970aa6dde1edd631418ad06b1c3263972f04e6a606274abe7e",
		StreamSHA256:     "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
		PublishedAt:      time.Date(2026, 12, 5, 16, 0, 0, 0, time.UTC)} // not signed
	return a, m
}

// sgSigner returns a signer of a fresh user key.
func sgSigner(t testing.TB) *Signer {
	t.Helper()
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, err := kp.Seed()
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSigner(seed)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func sgTrust(t testing.TB, keys ...string) *Trust {
	t.Helper()
	tr, err := NewTrust(keys...)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// TestSignedBytes pins the bytes signed and the signatures of PROTOCOL.md's
// worked example (ed25519 signatures are deterministic).
func TestSignedBytes(t *testing.T) {
	s, err := NewSigner([]byte(sgExampleSeed + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	if s.PublicKey() != sgExamplePub {
		t.Fatalf("public key %s, want %s", s.PublicKey(), sgExamplePub)
	}
	a, m := sgExample()
	wantA := "rollout-worker refit announce signature 1\nprotocol=2\nmodel=llama\nversion=7\nfull=false\nbase=6\n" +
		"subject=refit.llama.v.7\ntotal_bytes=10000\nchunk_bytes=4000\nchunks=3\n" +
		"header_sha256=9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n"
	wantM := "rollout-worker refit manifest signature 1\n" + strings.TrimPrefix(wantA, "rollout-worker refit announce signature 1\n") +
		"header_bytes=20480\ntensors=579\nchunk_table_sha256=7bfacf0a6878da970aa6dde1edd631418ad06b1c3263972f04e6a606274abe7e\n" +
		"stream_sha256=2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824\n"
	if got := string(a.SignedBytes()); got != wantA {
		t.Fatalf("announce signed bytes\n%q\nwant\n%q", got, wantA)
	}
	if got := string(m.SignedBytes()); got != wantM {
		t.Fatalf("manifest signed bytes\n%q\nwant\n%q", got, wantM)
	}
	if err := s.SignAnnounce(&a); err != nil {
		t.Fatal(err)
	}
	if err := s.SignManifest(&m); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ what, got, want string }{
		{"announce", a.Signature, "ly4oUAIo+MWq0uy03Oq0qolAs0exbVYgR9Cz2DiL+yTUxcjsnvucQc5s3xer/cViX7IalG6hcPojZk+LJP5ODQ=="},
		{"manifest", m.Signature, "C1HhgJkJQRBTtEX7ZfklfwyQBNrP8iNZ/vJwL+cAdVK7Lz3LcpzKMq5Y5B4mctBBWxxhLVX4lzOpwg5M9qrIAQ=="},
		{"announce signer", a.SignedBy, sgExamplePub},
		{"manifest signer", m.SignedBy, sgExamplePub},
	} {
		if c.got != c.want {
			t.Errorf("%s: %s, want %s", c.what, c.got, c.want)
		}
	}
	// The manifest's signature fields are its own, in JSON too.
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseManifest(b)
	if err != nil {
		t.Fatal(err)
	}
	if got.Signature != m.Signature || got.Announce.Signature != "" {
		t.Fatalf("manifest after JSON: signature %q, announce's %q", got.Signature, got.Announce.Signature)
	}
	if err := sgTrust(t, sgExamplePub).VerifyManifest(got); err != nil {
		t.Fatal(err)
	}
}

// TestVerify: every way a signature is not accepted has its error.
func TestVerify(t *testing.T) {
	s, other := sgSigner(t), sgSigner(t)
	trust := sgTrust(t, s.PublicKey())
	signedA := func(t *testing.T, by *Signer, change func(*Announce)) Announce {
		t.Helper()
		a, _ := sgExample()
		if err := by.SignAnnounce(&a); err != nil {
			t.Fatal(err)
		}
		if change != nil {
			change(&a)
		}
		return a
	}
	signedM := func(t *testing.T, by *Signer, change func(*Manifest)) Manifest {
		t.Helper()
		_, m := sgExample()
		if err := by.SignManifest(&m); err != nil {
			t.Fatal(err)
		}
		if change != nil {
			change(&m)
		}
		return m
	}
	for _, tc := range []struct {
		name string
		err  func(t *testing.T) error
		want error // nil: accepted
	}{
		{"announce signed", func(t *testing.T) error { return trust.VerifyAnnounce(signedA(t, s, nil)) }, nil},
		{"manifest signed", func(t *testing.T) error { return trust.VerifyManifest(signedM(t, s, nil)) }, nil},
		{"announce unsigned", func(t *testing.T) error { a, _ := sgExample(); return trust.VerifyAnnounce(a) }, ErrUnsigned},
		{"manifest unsigned", func(t *testing.T) error { _, m := sgExample(); return trust.VerifyManifest(m) }, ErrUnsigned},
		{"untrusted key", func(t *testing.T) error { return trust.VerifyAnnounce(signedA(t, other, nil)) }, ErrUntrustedKey},
		{"signer claims a trusted key", func(t *testing.T) error {
			return trust.VerifyAnnounce(signedA(t, other, func(a *Announce) { a.SignedBy = s.PublicKey() }))
		}, ErrBadSignature},
		{"version changed", func(t *testing.T) error {
			return trust.VerifyAnnounce(signedA(t, s, func(a *Announce) { a.Version = 1<<64 - 1 }))
		}, ErrBadSignature},
		{"full changed", func(t *testing.T) error {
			return trust.VerifyAnnounce(signedA(t, s, func(a *Announce) { a.Full = true }))
		}, ErrBadSignature},
		{"base changed", func(t *testing.T) error {
			return trust.VerifyManifest(signedM(t, s, func(m *Manifest) { m.Base = 5 }))
		}, ErrBadSignature},
		{"header changed", func(t *testing.T) error {
			return trust.VerifyManifest(signedM(t, s, func(m *Manifest) { m.HeaderSHA256 = strings.Repeat("0", 64) }))
		}, ErrBadSignature},
		{"chunk table changed", func(t *testing.T) error {
			return trust.VerifyManifest(signedM(t, s, func(m *Manifest) { m.ChunkTableSHA256 = strings.Repeat("1", 64) }))
		}, ErrBadSignature},
		{"stream digest changed", func(t *testing.T) error {
			return trust.VerifyManifest(signedM(t, s, func(m *Manifest) { m.StreamSHA256 = strings.Repeat("2", 64) }))
		}, ErrBadSignature},
		{"announce signature on a manifest", func(t *testing.T) error {
			a := signedA(t, s, nil)
			_, m := sgExample()
			m.SignedBy, m.Signature = a.SignedBy, a.Signature
			return trust.VerifyManifest(m)
		}, ErrBadSignature},
		{"signature not base64", func(t *testing.T) error {
			return trust.VerifyAnnounce(signedA(t, s, func(a *Announce) { a.Signature = "not base64!" }))
		}, ErrBadSignature},
		{"signature too short", func(t *testing.T) error {
			return trust.VerifyAnnounce(signedA(t, s, func(a *Announce) { a.Signature = a.Signature[:40] }))
		}, ErrBadSignature},
		{"signature without its key", func(t *testing.T) error {
			return trust.VerifyAnnounce(signedA(t, s, func(a *Announce) { a.SignedBy = "" }))
		}, ErrUntrustedKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.err(t)
			switch {
			case tc.want == nil && err != nil:
				t.Fatalf("rejected: %v", err)
			case tc.want != nil && !errors.Is(err, tc.want):
				t.Fatalf("error %v, want %v", err, tc.want)
			}
		})
	}
}

// TestSignedNeedsFields: a signed announcement or manifest must be protocol
// 2 and carry the digests its signature is there to bind.
func TestSignedNeedsFields(t *testing.T) {
	s := sgSigner(t)
	trust := sgTrust(t, s.PublicKey())
	a, m := sgExample()
	a.HeaderSHA256 = ""
	if err := s.SignAnnounce(&a); err != nil {
		t.Fatal(err)
	}
	if err := trust.VerifyAnnounce(a); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "header_sha256") {
		t.Fatalf("signed announcement without header_sha256: %v", err)
	}
	m.StreamSHA256 = ""
	if err := s.SignManifest(&m); err != nil {
		t.Fatal(err)
	}
	if err := trust.VerifyManifest(m); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "stream_sha256") {
		t.Fatalf("signed manifest without stream_sha256: %v", err)
	}
}

func TestParseTrust(t *testing.T) {
	user, account := sgSigner(t).PublicKey(), sgExamplePub
	acc, err := nkeys.CreateAccount()
	if err != nil {
		t.Fatal(err)
	}
	accPub, _ := acc.PublicKey()
	srv, _ := nkeys.CreateServer()
	srvPub, _ := srv.PublicKey()
	for _, tc := range []struct {
		name string
		file string
		keys []string // nil: an error
		want string   // in the error
	}{
		{"one key", user + "\n", []string{user}, ""},
		{"comments and blanks", "# trainers\n\n  " + user + "  # the main trainer\r\n#" + srvPub + "\n" + account, []string{user, account}, ""},
		{"account key", accPub, []string{accPub}, ""},
		{"duplicate", user + "\n" + user + "\n", []string{user}, ""},
		{"empty", "", nil, "no keys"},
		{"only comments", "# nothing\n   \n", nil, "no keys"},
		{"a seed", user + "\n" + sgExampleSeed + "\n", nil, "line 2: a seed"},
		{"not a key", "hello\n", nil, "line 1: not a public nkey"},
		{"bad checksum", sgFlip(user, 10), nil, "line 1"},
		{"server key", srvPub, nil, "want a user (U), account (A) or operator (O) key"},
		{"two keys on a line", user + " " + account, nil, "line 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := ParseTrust([]byte(tc.file))
			if tc.keys == nil {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("error %v, want one mentioning %q", err, tc.want)
				}
				if strings.Contains(err.Error(), sgExampleSeed) {
					t.Fatalf("the error quotes the seed: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := sgTrust(t, tc.keys...).Keys()
			if got := tr.Keys(); strings.Join(got, ",") != strings.Join(want, ",") {
				t.Fatalf("keys %v, want %v", got, want)
			}
		})
	}
}

// sgFlip changes character i of a key to another base32 letter.
func sgFlip(k string, i int) string {
	c := byte('A')
	if k[i] == 'A' {
		c = 'B'
	}
	return k[:i] + string(c) + k[i+1:]
}

func TestNewSignerRejects(t *testing.T) {
	curve, _ := nkeys.CreateCurveKeys()
	curveSeed, _ := curve.Seed()
	srv, _ := nkeys.CreateServer()
	srvSeed, _ := srv.Seed()
	for _, tc := range []struct {
		name string
		seed []byte
	}{
		{"empty", nil},
		{"public key", []byte(sgExamplePub)},
		{"garbage", []byte("SUxxxx")},
		{"curve key", curveSeed},
		{"server key", srvSeed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewSigner(tc.seed); err == nil {
				t.Fatal("accepted")
			} else if len(tc.seed) > 8 && strings.Contains(err.Error(), string(tc.seed)) {
				t.Fatalf("the error quotes the seed: %v", err)
			}
		})
	}
}

// FuzzParseTrust: any file parses or fails without a panic, and what it
// accepts holds only valid keys, which parse again to the same set.
func FuzzParseTrust(f *testing.F) {
	f.Add([]byte(sgExamplePub + "\n"))
	f.Add([]byte("# c\n" + sgExamplePub + " # x\n\n"))
	f.Add([]byte(sgExampleSeed))
	f.Add([]byte("U\nA\nO\n#"))
	f.Fuzz(func(t *testing.T, b []byte) {
		tr, err := ParseTrust(b)
		if err != nil {
			return
		}
		keys := tr.Keys()
		if len(keys) == 0 {
			t.Fatal("accepted a file without keys")
		}
		for _, k := range keys {
			if _, err := nkeys.FromPublicKey(k); err != nil || !signingPrefix(k) {
				t.Fatalf("accepted %q: %v", k, err)
			}
		}
		again, err := ParseTrust([]byte(strings.Join(keys, "\n")))
		if err != nil || strings.Join(again.Keys(), ",") != strings.Join(keys, ",") {
			t.Fatalf("keys %v parse again to %v, %v", keys, again, err)
		}
	})
}

// FuzzVerifyManifest: a manifest from the wire is accepted by a trust only
// if what its signature covers is exactly what the key signed.
func FuzzVerifyManifest(f *testing.F) {
	s, err := NewSigner([]byte(sgExampleSeed))
	if err != nil {
		f.Fatal(err)
	}
	trust := sgTrust(f, s.PublicKey())
	_, m := sgExample()
	if err := s.SignManifest(&m); err != nil {
		f.Fatal(err)
	}
	signed := string(m.SignedBytes())
	b, _ := json.Marshal(m)
	f.Add(b)
	f.Add([]byte(strings.Replace(string(b), `"version":7`, `"version":8`, 1)))
	f.Add([]byte(strings.Replace(string(b), `"signature":"`, `"signature":"A`, 1)))
	f.Add([]byte(`{"signed_by":"` + sgExamplePub + `","signature":""}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := ParseManifest(b)
		if err != nil {
			return
		}
		if err := trust.VerifyManifest(got); err != nil {
			if !errors.Is(err, ErrUnsigned) && !errors.Is(err, ErrUntrustedKey) && !errors.Is(err, ErrBadSignature) && !errors.Is(err, ErrProtocol) {
				t.Fatalf("error %v is none of the sentinels", err)
			}
			return
		}
		if string(got.SignedBytes()) != signed {
			t.Fatalf("accepted a manifest whose signed bytes are\n%q\nnot the ones signed\n%q", got.SignedBytes(), signed)
		}
		var a Announce
		if err := json.Unmarshal(b, &a); err != nil {
			t.Fatal(err)
		}
		if a.Version != 7 {
			t.Fatalf("accepted version %d", a.Version)
		}
	})
}
