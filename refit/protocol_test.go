package refit

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// Tests of the protocol's definitions (PROTOCOL.md) as a publisher written
// from the page alone meets them: the fields of the announcement and the
// manifest, statuses for malformed ones.

// jsonEdit is a change to a JSON object: the value of a field, or its
// removal (delete).
type jsonEdit struct {
	field  string
	value  any
	delete bool
}

// editJSON applies edits to the JSON encoding of v.
func editJSON(t testing.TB, v any, edits []jsonEdit) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if len(edits) == 0 {
		return b
	}
	var obj map[string]any
	if err := json.Unmarshal(b, &obj); err != nil {
		t.Fatal(err)
	}
	for _, e := range edits {
		if e.delete {
			delete(obj, e.field)
		} else {
			obj[e.field] = e.value
		}
	}
	if b, err = json.Marshal(obj); err != nil {
		t.Fatal(err)
	}
	return b
}

// rawPublishEdited publishes version v as rawPublish does (a partial
// version on base, chunks of chunk bytes), its announcement and manifest
// as JSON changed by the edits. A nil edit list writes it as is;
// writeManifest false writes no manifest.
func rawPublishEdited(t *testing.T, url string, v uint64, stream []byte, full bool, base uint64, chunk int, announce, manifest []jsonEdit, writeManifest bool) {
	t.Helper()
	rawPublishWith(t, url, v, stream, full, base, chunk,
		rawOptions{protocol: ProtocolVersion, stopAfter: -1, announce: announce, manifest: manifest, noManifest: !writeManifest})
}

// TestParseManifestFields: the fields PROTOCOL.md defines for the
// announcement and the manifest are checked as it says, each rejection
// naming its field.
func TestParseManifestFields(t *testing.T) {
	var valid map[string]any
	if err := json.Unmarshal([]byte(wtManifest), &valid); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		edits []jsonEdit
		want  string // "" for a manifest that parses
	}{
		{"as is", nil, ""},
		{"header_bytes missing", []jsonEdit{{field: "header_bytes", delete: true}}, `no "header_bytes" field`},
		{"header_bytes null", []jsonEdit{{field: "header_bytes", value: nil}}, `no "header_bytes" field`},
		{"header_bytes 0", []jsonEdit{{field: "header_bytes", value: 0}}, "header_bytes 0"},
		{"header_bytes 1", []jsonEdit{{field: "header_bytes", value: 1}}, "header_bytes 1"},
		{"header_bytes past the limit", []jsonEdit{{field: "header_bytes", value: MaxHeaderBytes + 1}}, "header_bytes 67108865"},
		{"header_bytes a string", []jsonEdit{{field: "header_bytes", value: "120"}}, "header_bytes"},
		{"header_bytes fractional", []jsonEdit{{field: "header_bytes", value: 120.5}}, "header_bytes"},
		{"tensors missing", []jsonEdit{{field: "tensors", delete: true}}, `no "tensors" field`},
		{"tensors negative", []jsonEdit{{field: "tensors", value: -1}}, "tensors -1"},
		{"tensors 0", []jsonEdit{{field: "tensors", value: 0}}, ""},
		{"published_at missing", []jsonEdit{{field: "published_at", delete: true}}, `no "published_at" field`},
		{"published_at zero", []jsonEdit{{field: "published_at", value: "0001-01-01T00:00:00Z"}}, "published_at"},
		{"published_at not RFC 3339", []jsonEdit{{field: "published_at", value: "2026-12-02 16:00:00"}}, "published_at"},
		{"published_at a number", []jsonEdit{{field: "published_at", value: 1796227200}}, "published_at"},
		{"published_at with an offset", []jsonEdit{{field: "published_at", value: "2026-12-02T17:30:00.25+01:30"}}, ""},
		{"partial without base", []jsonEdit{{field: "base", delete: true}}, `no "base" field`},
		{"partial on a later base", []jsonEdit{{field: "base", value: 7}}, "partial version 7 on base 7"},
		{"partial on base 0", []jsonEdit{{field: "base", value: 0}}, ""},
		{"full on base 0", []jsonEdit{{field: "full", value: true}, {field: "base", value: 0}}, ""},
		{"full without base", []jsonEdit{{field: "full", value: true}, {field: "base", delete: true}}, ""},
		{"full on base 6", []jsonEdit{{field: "full", value: true}}, "base 6 in a full version"},
		{"full missing", []jsonEdit{{field: "full", delete: true}}, `no "full" field`},
		{"full spelled Full", []jsonEdit{{field: "full", delete: true}, {field: "Full", value: true}, {field: "base", value: 0}}, `no "full" field`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := editJSON(t, valid, tc.edits)
			_, err := ParseManifest(b)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("%s: %v", b, err)
			case tc.want != "" && (!errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("%s: got %v, want an ErrProtocol naming %q", b, err, tc.want)
			}
		})
	}
	// The announcement's full and base follow the same rules.
	var ann map[string]any
	if err := json.Unmarshal([]byte(wtAnnounce), &ann); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		edits []jsonEdit
		want  string
	}{
		{"full, no base", nil, ""},
		{"full on base 0", []jsonEdit{{field: "base", value: 0}}, ""},
		{"full on base 3", []jsonEdit{{field: "base", value: 3}}, "base 3 in a full version"},
		{"partial without base", []jsonEdit{{field: "full", value: false}}, `no "base" field`},
		{"partial on base 6", []jsonEdit{{field: "full", value: false}, {field: "base", value: 6}}, ""},
		{"full missing", []jsonEdit{{field: "full", delete: true}, {field: "base", value: 6}}, `no "full" field`},
	} {
		t.Run("announce/"+tc.name, func(t *testing.T) {
			b := editJSON(t, ann, tc.edits)
			_, err := ParseAnnounce(b)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("%s: %v", b, err)
			case tc.want != "" && (!errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("%s: got %v, want an ErrProtocol naming %q", b, err, tc.want)
			}
		})
	}
}

// TestRefitManifestFields: a worker checks header_bytes, tensors,
// published_at and a full version's base, and rejects a version whose
// manifest or announcement gets one wrong with a status naming the field;
// the same version with the fields right is applied.
func TestRefitManifestFields(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 60), modelDir(t, 61)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipeBF16, nil) // bf16: everything staged, a rejection leaves nothing dirty
	stream := subset(t, b, nil)
	hb, tensors := headerCounts(t, stream)
	v := uint64(0)
	for _, tc := range []struct {
		name               string
		announce, manifest []jsonEdit
		want               string
	}{
		{"header_bytes one more", nil, []jsonEdit{{field: "header_bytes", value: hb + 1}}, "header_bytes"},
		{"header_bytes with the 8-byte length", nil, []jsonEdit{{field: "header_bytes", value: hb + 8}}, "header_bytes"},
		{"tensors one more", nil, []jsonEdit{{field: "tensors", value: tensors + 1}}, "manifest tensors"},
		{"tensors counting __metadata__", nil, []jsonEdit{{field: "tensors", value: tensors - 1}}, "manifest tensors"},
		{"published_at missing", nil, []jsonEdit{{field: "published_at", delete: true}}, "published_at"},
		{"published_at not a time", nil, []jsonEdit{{field: "published_at", value: "yesterday"}}, "published_at"},
		{"full on base 3, in the manifest", nil, []jsonEdit{{field: "base", value: 3}}, "base 3 in a full version"},
		{"full on base 3, in both", []jsonEdit{{field: "base", value: 3}}, []jsonEdit{{field: "base", value: 3}}, "base 3 in a full version"},
		{"chunk_bytes other than announced", nil, []jsonEdit{{field: "chunk_bytes", value: 8192}, {field: "chunks", value: (len(stream) + 8191) / 8192}}, "chunk_bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v++
			rawPublishEdited(t, srv.URL(), v, stream, true, 0, 4096, tc.announce, tc.manifest, true)
			st := w.waitStatus(t, v)
			if st.State != StateRejected || !strings.Contains(st.Reason, tc.want) {
				t.Fatalf("status %+v, want a rejection naming %q", st, tc.want)
			}
			if w.r.CurrentVersion() != 0 {
				t.Fatalf("serving %d after a rejection", w.r.CurrentVersion())
			}
		})
	}
	// Right, the same stream is applied: a full version without base too.
	v++
	rawPublishEdited(t, srv.URL(), v, stream, true, 0, 4096, []jsonEdit{{field: "base", delete: true}}, []jsonEdit{{field: "base", delete: true}}, true)
	if st := w.waitStatus(t, v); st.State != StateApplied {
		t.Fatalf("version %d with its fields right: %+v", v, st)
	}
}

// TestRefitMalformedStatus: an announcement or manifest that does not parse
// is answered with a rejected status for the version it names, the reason
// naming what is malformed, whether the worker meets it live, as the
// manifest of a version whose announcement it did not see, or at start.
func TestRefitMalformedStatus(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 62), modelDir(t, 63)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipeBF16, nil)
	stream := subset(t, b, nil)
	ctx := context.Background()
	_, kv, err := newPublisher(t, srv.URL()).ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	statuses := watchStatuses(t, srv.URL())
	expectRejected := func(w *worker, v uint64, want ...string) {
		t.Helper()
		st := statuses.wait(t, w.r.cfg.Worker, v)
		if st.State != StateRejected {
			t.Fatalf("version %d: %+v, want rejected", v, st)
		}
		for _, s := range want {
			if !strings.Contains(st.Reason, s) {
				t.Fatalf("version %d: reason %q does not name %q", v, st.Reason, s)
			}
		}
	}

	// A malformed announcement: the version is rejected at once, and its
	// (valid) manifest later does not bring it back.
	rawPublishEdited(t, srv.URL(), 1, stream, true, 0, 4096, []jsonEdit{{field: "full", delete: true}, {field: "base", value: 0}}, nil, true)
	expectRejected(w, 1, "malformed announce", `no "full" field`)
	// An announcement of another model.
	rawPublishEdited(t, srv.URL(), 2, stream, true, 0, 4096, []jsonEdit{{field: "model", value: "other"}, {field: "subject", value: VersionSubject("other", 2)}}, nil, false)
	expectRejected(w, 2, "malformed announce", `model "other"`)
	// A manifest alone (its announcement missed), malformed.
	m := Manifest{Announce: Announce{Protocol: ProtocolVersion, Model: testModel, Version: 3, Full: true, Subject: VersionSubject(testModel, 3),
		TotalBytes: int64(len(stream)), ChunkBytes: 4096, Chunks: (len(stream) + 4095) / 4096},
		HeaderBytes: 0, Tensors: 3, ChunkTableSHA256: wtSHA, PublishedAt: time.Now()}
	if _, err := kv.Put(ctx, KeyManifest, editJSON(t, m, nil)); err != nil {
		t.Fatal(err)
	}
	expectRejected(w, 3, "malformed manifest", "header_bytes 0")
	// A manifest whose digest is malformed, after its announcement: the
	// version being received is rejected naming it.
	rawPublishEdited(t, srv.URL(), 4, stream, true, 0, 4096, nil, []jsonEdit{{field: "chunk_table_sha256", value: "XYZ"}}, true)
	expectRejected(w, 4, "chunk_table_sha256")
	// No version number to read: nothing to report on.
	n := w.r.reports.Load()
	if _, err := kv.Put(ctx, KeyManifest, []byte(`{"protocol":2,"model":"tiny","version":"five"`)); err != nil {
		t.Fatal(err)
	}
	// ...and a version after it is received as usual.
	rawPublishEdited(t, srv.URL(), 5, stream, true, 0, 4096, nil, nil, true)
	if st := statuses.wait(t, "w", 5); st.State != StateApplied {
		t.Fatalf("version 5: %+v", st)
	}
	for deadline := time.Now().Add(time.Second); w.r.reports.Load()-n < 1 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if got := w.r.reports.Load() - n; got != 1 {
		t.Fatalf("%d statuses for a garbled manifest and version 5, want 1 (version 5's)", got)
	}

	// A worker that starts with a malformed manifest in the bucket.
	m.Version, m.Subject, m.HeaderBytes = 6, VersionSubject(testModel, 6), 20
	if _, err := kv.Put(ctx, KeyManifest, editJSON(t, m, []jsonEdit{{field: "published_at", delete: true}})); err != nil {
		t.Fatal(err)
	}
	late := startWorker(t, srv.URL(), a, "late", moe.RecipeBF16, nil)
	expectRejected(late, 6, "malformed manifest", "published_at")
	// It then receives version 5, still announced, whose manifest is in
	// the bucket's history.
	if st := statuses.wait(t, "late", 5); st.State != StateApplied {
		t.Fatalf("late worker, version 5: %+v", st)
	}
}

// statusLog collects every status published on the model's status subject.
type statusLog struct {
	mu  sync.Mutex
	got []Status
}

// watchStatuses starts collecting statuses; it returns once the server has
// the subscription.
func watchStatuses(t testing.TB, url string) *statusLog {
	t.Helper()
	l := &statusLog{}
	nc := refittest.Connect(t, url)
	if _, err := nc.Subscribe(StatusSubject(testModel), func(msg *nats.Msg) {
		if s, err := ParseStatus(msg.Data); err == nil {
			l.mu.Lock()
			l.got = append(l.got, s)
			l.mu.Unlock()
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return l
}

// find returns the first status of worker on version v.
func (l *statusLog) find(worker string, v uint64) (Status, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range l.got {
		if s.Worker == worker && s.Version == v {
			return s, true
		}
	}
	return Status{}, false
}

// wait waits up to 20 s for a status of worker on version v.
func (l *statusLog) wait(t testing.TB, worker string, v uint64) Status {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		if s, ok := l.find(worker, v); ok {
			return s
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	t.Fatalf("no status of worker %s on version %d; statuses: %+v", worker, v, l.got)
	return Status{}
}

// TestParseHeaderForm: the header rules of PROTOCOL.md ("The safetensors
// stream"): keys in any order, entry keys in any order, any padding of
// spaces and JSON whitespace between tokens are accepted; a name or key
// given twice, other keys, other padding, a header not starting with {,
// non-string metadata and malformed offsets are refused.
func TestParseHeaderForm(t *testing.T) {
	const (
		a    = `"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}`
		b    = `"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]}`
		meta = `"__metadata__":{"format":"pt"}`
	)
	obj := func(members ...string) string { return "{" + strings.Join(members, ",") + "}" }
	for _, tc := range []struct {
		name, js string
		want     string // "" for accepted
	}{
		{"data order", obj(a, b), ""},
		{"reverse data order", obj(b, a), ""},
		{"metadata first", obj(meta, b, a), ""},
		{"metadata between", obj(b, meta, a), ""},
		{"metadata last", obj(a, b, meta), ""},
		{"empty metadata", obj(`"__metadata__":{}`, a, b), ""},
		{"entry keys in another order", obj(`"a":{"data_offsets":[0,8],"dtype":"BF16","shape":[2,2]}`, `"b":{"shape":[2],"data_offsets":[8,12],"dtype":"BF16"}`), ""},
		{"padded to 8", obj(a, b) + strings.Repeat(" ", 8-(8+len(obj(a, b)))%8), ""},
		{"padded by 13 spaces", obj(a, b) + strings.Repeat(" ", 13), ""},
		{"whitespace between tokens", "{\n\t\"a\" : {\r\n \"dtype\": \"BF16\",\n \"shape\": [ 2 , 2 ],\n \"data_offsets\": [0, 8]\n},\n" + b + "\n}  ", ""},
		{"escaped names and keys", obj(`"\u0061":{"d\u0074ype":"BF16","shape":[2,2],"data_offsets":[0,8]}`, b), ""},

		{"a leading space", " " + obj(a, b), "starts with"},
		{"a leading newline", "\n" + obj(a, b), "starts with"},
		{"padded by a newline", obj(a, b) + "\n", "only spaces"},
		{"padded by a tab", obj(a, b) + "  \t", "only spaces"},
		{"padded by NULs", obj(a, b) + "\x00\x00", "safetensors header"},
		{"not UTF-8", obj(`"__metadata__":{"format":"p`+"\xff"+`"}`, a, b), "not UTF-8"},
		{"a name twice", obj(a, b, b), "appears twice"},
		{"a name twice, once escaped", obj(a, b, `"\u0062":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]}`), "appears twice"},
		{"metadata twice", obj(meta, a, b, meta), "__metadata__ appears twice"},
		{"metadata of numbers", obj(`"__metadata__":{"step":7}`, a, b), "not a string"},
		{"metadata a string", obj(`"__metadata__":"pt"`, a, b), "__metadata__ is not an object"},
		{"metadata null", obj(`"__metadata__":null`, a, b), "__metadata__ is not an object"},
		{"an entry key twice", obj(`"a":{"dtype":"BF16","dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}`, b), "appears twice"},
		{"an entry key in capitals", obj(`"a":{"DTYPE":"BF16","shape":[2,2],"data_offsets":[0,8]}`, b), "want only dtype, shape and data_offsets"},
		{"another entry key", obj(`"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8],"note":"x"}`, b), "want only dtype"},
		{"no dtype", obj(`"a":{"shape":[2,2],"data_offsets":[0,8]}`, b), "want the keys dtype, shape and data_offsets"},
		{"no shape", obj(`"a":{"dtype":"BF16","data_offsets":[0,8]}`, b), "want the keys"},
		{"shape null", obj(`"a":{"dtype":"BF16","shape":null,"data_offsets":[0,8]}`, b), "an array of integers"},
		{"a null in the shape", obj(`"a":{"dtype":"BF16","shape":[null,4],"data_offsets":[0,8]}`, b), "an array of integers"},
		{"one data offset", obj(`"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0]}`, b), "two integers"},
		{"three data offsets", obj(`"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8,12]}`, b), "two integers"},
		{"a tensor not an object", obj(a, `"b":[8,12]`), `tensor "b"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := ParseHeader([]byte(tc.js), 8+int64(len(tc.js))+12)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("%q: %v", tc.js, err)
			case tc.want == "" && (len(h.Tensors) != 2 || h.Tensors[0].Name != "a" || h.Tensors[1].Name != "b"):
				t.Fatalf("%q: tensors %+v, want a then b", tc.js, h.Tensors)
			case tc.want != "" && (!errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("%q: got %v, want an ErrProtocol naming %q", tc.js, err, tc.want)
			}
		})
	}
}

// rewriteHeader returns stream with its header replaced by what build
// makes of its tensors (in data order); the data section is unchanged.
func rewriteHeader(t testing.TB, stream []byte, build func(ts []TensorInfo) string) []byte {
	t.Helper()
	n := binary.LittleEndian.Uint64(stream)
	h, err := ParseHeader(stream[8:8+n], int64(len(stream)))
	if err != nil {
		t.Fatal(err)
	}
	js := build(h.Tensors)
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(js)))
	out = append(out, js...)
	return append(out, stream[8+n:]...)
}

// entryJSON is a tensor's header entry, its keys in data_offsets, dtype,
// shape order.
func entryJSON(ti TensorInfo) string {
	shape, _ := json.Marshal(ti.Shape)
	name, _ := json.Marshal(ti.Name)
	return fmt.Sprintf("%s: {\"data_offsets\": [%d, %d], \"dtype\": %q, \"shape\": %s}", name, ti.Begin, ti.End, ti.DType, shape)
}

// TestRefitHeaderForms: a worker applies a version whose header lists the
// tensors against data order, __metadata__ among them, entry keys in
// another order, on several lines and padded to no multiple of 8, byte for
// byte; and rejects one that names a tensor twice before writing anything.
func TestRefitHeaderForms(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 64), modelDir(t, 65)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	stream := subset(t, b, nil)
	shuffled := rewriteHeader(t, stream, func(ts []TensorInfo) string {
		var members []string
		for i := len(ts) - 1; i >= 0; i-- {
			members = append(members, entryJSON(ts[i]))
			if i == len(ts)/2 {
				members = append(members, `"__metadata__": {"format": "pt", "step": "12"}`)
			}
		}
		js := "{\n" + strings.Join(members, ",\n") + "\n}"
		for (8+len(js))%8 != 3 {
			js += " "
		}
		return js
	})
	rawPublish(t, srv.URL(), 1, shuffled, true, 0, 4096, -1, nil)
	if st := w.waitStatus(t, 1); st.State != StateApplied {
		t.Fatalf("a shuffled, padded header: %+v", st)
	}
	residentEquals(t, "after a version with a shuffled header", w.m, b)

	// The same name twice: rejected before any byte is written (nothing
	// dirty), whatever the second entry says.
	twice := rewriteHeader(t, subset(t, a, experts), func(ts []TensorInfo) string {
		var members []string
		for _, ti := range ts {
			members = append(members, entryJSON(ti))
		}
		members = append(members, entryJSON(ts[0]))
		return "{" + strings.Join(members, ",") + "}"
	})
	rawPublish(t, srv.URL(), 2, twice, false, 1, 4096, -1, nil)
	if st := w.waitStatus(t, 2); st.State != StateRejected || !strings.Contains(st.Reason, "appears twice") {
		t.Fatalf("a name twice: %+v", st)
	}
	if len(w.r.dirty) != 0 {
		t.Fatalf("%d ranges dirty after a header refused", len(w.r.dirty))
	}
	residentEquals(t, "after a refused header", w.m, b)
}

// protocolDoc is the protocol's page.
const protocolDoc = "PROTOCOL.md"

// docSection returns the text of a "## " section of PROTOCOL.md.
func docSection(t *testing.T, title string) string {
	t.Helper()
	doc, err := os.ReadFile(protocolDoc)
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(doc), "\n## "+title+"\n")
	if !ok {
		t.Fatalf("%s: no section %q", protocolDoc, title)
	}
	if i := strings.Index(rest, "\n## "); i >= 0 {
		rest = rest[:i]
	}
	return rest
}

// docJSONBlocks returns the ```json blocks of a text.
func docJSONBlocks(text string) []string {
	var out []string
	for {
		_, rest, ok := strings.Cut(text, "```json\n")
		if !ok {
			return out
		}
		block, after, _ := strings.Cut(rest, "```")
		out = append(out, block)
		text = after
	}
}

// jsonShape describes a decoded JSON value by its structure: the keys of
// objects (recursively), the element shape of arrays (all elements must
// share it) and the type of everything else.
func jsonShape(t *testing.T, v any) string {
	t.Helper()
	switch x := v.(type) {
	case map[string]any:
		var parts []string
		for _, k := range slices.Sorted(maps.Keys(x)) {
			parts = append(parts, k+":"+jsonShape(t, x[k]))
		}
		return "{" + strings.Join(parts, ",") + "}"
	case []any:
		shape := ""
		for i, e := range x {
			s := jsonShape(t, e)
			if i > 0 && s != shape {
				t.Fatalf("array elements of two shapes: %s and %s", shape, s)
			}
			shape = s
		}
		return "[" + shape + "]"
	case float64:
		return "number"
	case string:
		return "string"
	case bool:
		return "bool"
	case nil:
		return "null"
	}
	t.Fatalf("JSON value %T", v)
	return ""
}

// TestStatusExamples: the status examples of PROTOCOL.md ("Status") are
// what workers send: one per state, each with exactly the fields (and
// nested fields, and their types) of a status a real worker sent in that
// state, valid for ParseStatus, and the applied one's layers start with
// layer -1 as real ones do.
func TestStatusExamples(t *testing.T) {
	examples := map[string]map[string]any{}
	for _, block := range docJSONBlocks(docSection(t, "Status")) {
		var v map[string]any
		if err := json.Unmarshal([]byte(block), &v); err != nil {
			t.Fatalf("a status example of %s is not JSON: %v\n%s", protocolDoc, err, block)
		}
		if _, err := ParseStatus([]byte(block)); err != nil {
			t.Fatalf("a status example does not parse: %v\n%s", err, block)
		}
		state, _ := v["state"].(string)
		if examples[state] != nil {
			t.Fatalf("two examples of state %q", state)
		}
		examples[state] = v
	}

	// Real statuses: applied (a full version), rejected (a corrupted
	// chunk), needs_full (a partial version on the rejected one).
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 70), modelDir(t, 71)
	raw := map[string][]byte{}
	var mu sync.Mutex
	nc := refittest.Connect(t, srv.URL())
	if _, err := nc.Subscribe(StatusSubject(testModel), func(msg *nats.Msg) {
		var v struct{ State string }
		if json.Unmarshal(msg.Data, &v) == nil {
			mu.Lock()
			raw[v.State] = msg.Data
			mu.Unlock()
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	w := startWorker(t, srv.URL(), a, "w-1", moe.RecipePerToken, nil)
	rawPublish(t, srv.URL(), 7, subset(t, b, nil), true, 0, 4096, -1, nil)
	w.waitStatus(t, 7)
	rawPublish(t, srv.URL(), 8, subset(t, b, experts), false, 7, 4096, -1, func(seq int, h nats.Header, d []byte) []byte {
		if seq == 3 {
			d[100] ^= 0x40
		}
		return d
	})
	w.waitStatus(t, 8)
	rawPublish(t, srv.URL(), 9, subset(t, b, experts), false, 8, 4096, -1, nil)
	w.waitStatus(t, 9)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		mu.Lock()
		n := len(raw)
		mu.Unlock()
		if n == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("statuses seen: %q", raw)
		}
	}

	for _, state := range []string{StateApplied, StateRejected, StateNeedsFull} {
		var real map[string]any
		if err := json.Unmarshal(raw[state], &real); err != nil {
			t.Fatal(err)
		}
		doc := examples[state]
		if doc == nil {
			t.Errorf("%s has no status example of state %q; a real one: %s", protocolDoc, state, raw[state])
			continue
		}
		if got, want := jsonShape(t, doc), jsonShape(t, real); got != want {
			t.Errorf("state %s: the example of %s has the fields\n%s\na real status\n%s\n(%s)", state, protocolDoc, got, want, raw[state])
		}
		if state == StateApplied {
			first := func(v map[string]any) any { return v["layers"].([]any)[0].(map[string]any)["layer"] }
			if first(doc) != first(real) || first(real) != -1.0 {
				t.Errorf("applied: the example's first layer is %v, a real status's %v", first(doc), first(real))
			}
		}
	}
	if len(examples) != 3 {
		t.Errorf("status examples of states %v, want applied, rejected and needs_full", slices.Sorted(maps.Keys(examples)))
	}
}

// TestProtocolDocLayout: PROTOCOL.md states the protocol first and keeps
// its history in a Changes section at the end.
func TestProtocolDocLayout(t *testing.T) {
	doc, err := os.ReadFile(protocolDoc)
	if err != nil {
		t.Fatal(err)
	}
	var titles []string
	for _, line := range strings.Split(string(doc), "\n") {
		if title, ok := strings.CutPrefix(line, "## "); ok {
			titles = append(titles, title)
		}
	}
	if len(titles) < 2 || titles[0] != "JetStream objects" || titles[len(titles)-1] != "Changes" {
		t.Fatalf("sections %q: want the specification first (JetStream objects) and Changes last", titles)
	}
	before, _, _ := strings.Cut(string(doc), "\n## Changes\n")
	for _, history := range []string{"Changed on", "(since 2026-"} {
		if strings.Contains(before, history) {
			t.Errorf("%s: %q before the Changes section", protocolDoc, history)
		}
	}
}

// TestNextVersion: a publisher numbers a version one above the highest of
// the bucket's announcements and manifests and the stream's subjects
// (PROTOCOL.md, "Version numbers"): after versions it published, after an
// attempt that died (announced, some chunks or none), after a malformed
// announcement, after chunks left on a subject; a restarted publisher gets
// the same number, its version is applied, and the number of an unfinished
// attempt is refused.
func TestNextVersion(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b := modelDir(t, 72), modelDir(t, 73)
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, nil)
	ctx := ptContext(t, 30*time.Second)
	p := newPublisher(t, srv.URL())
	next := func(p *Publisher, want uint64) {
		t.Helper()
		got, err := p.NextVersion(ctx)
		if err != nil || got != want {
			t.Fatalf("NextVersion: %d, %v; want %d", got, err, want)
		}
	}
	next(p, 1) // nothing yet: not even a stream or a bucket
	full := subset(t, b, nil)
	publish(t, p, 3, full, true)
	next(p, 4)

	// The publisher dies in the middle of version 4: announced, some
	// chunks stored, no manifest. A new one (a restart) takes 5.
	dying, cancel := context.WithCancel(ctx)
	p.onInflight = func(int64) { cancel() }
	if _, err := p.Publish(dying, 4, bytes.NewReader(full), int64(len(full)), true); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled publish: %v", err)
	}
	restarted := newPublisher(t, srv.URL())
	next(restarted, 5)
	if _, err := restarted.Publish(ctx, 4, bytes.NewReader(full), int64(len(full)), true); err == nil ||
		!strings.Contains(err.Error(), "already holds") && !strings.Contains(err.Error(), "announced already") {
		t.Fatalf("the number of the attempt that died: %v", err)
	}
	publish(t, restarted, 5, full, true)
	if st := w.waitStatus(t, 5); st.State != StateApplied {
		t.Fatalf("version 5 after an attempt that died: %+v", st)
	}
	next(restarted, 6)

	// Announced, no chunk: the number is used all the same.
	rawPublishEdited(t, srv.URL(), 6, full, true, 0, 4096, nil, nil, false) // chunks, no manifest...
	js, _ := jetstream.New(restarted.nc)
	stream, err := js.Stream(ctx, StreamName(testModel))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Purge(ctx, jetstream.WithPurgeSubject(VersionSubject(testModel, 6))); err != nil { // ...nor chunks
		t.Fatal(err)
	}
	next(restarted, 7)
	if _, err := restarted.Publish(ctx, 6, bytes.NewReader(full), int64(len(full)), true); err == nil || !strings.Contains(err.Error(), "announced already") {
		t.Fatalf("version 6, announced and nothing more: %v", err)
	}
	// A malformed announcement counts by the number it names.
	_, kv, err := restarted.ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, KeyAnnounce, []byte(`{"protocol":2,"model":"tiny","version":9}`)); err != nil {
		t.Fatal(err)
	}
	next(restarted, 10)
	// Chunks left on a subject count too.
	if _, err := js.Publish(ctx, VersionSubject(testModel, 12), []byte("left over")); err != nil {
		t.Fatal(err)
	}
	next(restarted, 13)

	// A signing publisher counts only its own announcements and manifests,
	// not bogus ones, but every subject.
	srv2 := refittest.StartServer(t)
	signed := signedPublisher(t, srv2.URL(), sgSigner(t))
	next(signed, 1)
	publish(t, signed, 1, full, true)
	next(signed, 2)
	rawPublish(t, srv2.URL(), math.MaxUint64-1, full, true, 0, 4096, -1, nil) // unsigned, and its subject...
	js2, _ := jetstream.New(signed.nc)
	stream2, err := js2.Stream(ctx, StreamName(testModel))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream2.Purge(ctx, jetstream.WithPurgeSubject(VersionSubject(testModel, math.MaxUint64-1))); err != nil {
		t.Fatal(err) // ...purged
	}
	next(signed, 2)
	if _, err := js2.Publish(ctx, VersionSubject(testModel, 4), []byte("left over")); err != nil {
		t.Fatal(err)
	}
	next(signed, 5)
}

// TestPublishFullAfterNotApplied: after a status other than applied on its
// previous version, from any worker, a Publisher refuses a partial version
// (ErrFullVersionNeeded, naming the worker and its state) and publishes a
// full one; so does a Publisher after a version announced and never
// completed. A worker that rejected a version is then served by the full
// one.
func TestPublishFullAfterNotApplied(t *testing.T) {
	srv := refittest.StartServer(t)
	a, b, c := modelDir(t, 74), modelDir(t, 75), modelDir(t, 76)
	w := startWorker(t, srv.URL(), a, "w-1", moe.RecipePerToken, nil)
	ctx := ptContext(t, 30*time.Second)
	p := newPublisher(t, srv.URL())
	needsFull := func(p *Publisher, want ...string) {
		t.Helper()
		err := p.FullVersionNeeded(ctx)
		for deadline := time.Now().Add(5 * time.Second); err == nil && time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
			err = p.FullVersionNeeded(ctx) // the status may still be on its way
		}
		if !errors.Is(err, ErrFullVersionNeeded) {
			t.Fatalf("FullVersionNeeded: %v, want ErrFullVersionNeeded", err)
		}
		for _, s := range want {
			if !strings.Contains(err.Error(), s) {
				t.Fatalf("FullVersionNeeded: %v: does not name %q", err, s)
			}
		}
	}
	expertsC := subset(t, c, experts)

	// Version 1 holds a NaN: the worker rejects it.
	publish(t, p, 1, setBF16(t, subset(t, b, nil), "model.layers.1.mlp.experts.2.up_proj.weight", 3, float32(math.NaN())), true)
	if st := w.waitStatus(t, 1); st.State != StateRejected {
		t.Fatalf("version 1: %+v", st)
	}
	needsFull(p, "version 1", "w-1 (rejected: ", "NaN or Inf")
	_, err := p.Publish(ctx, 2, bytes.NewReader(expertsC), int64(len(expertsC)), false)
	if !errors.Is(err, ErrFullVersionNeeded) || !strings.Contains(err.Error(), "w-1 (rejected") || !strings.Contains(err.Error(), "publish a full version") {
		t.Fatalf("a partial version after a rejection: %v", err)
	}
	if got, err := p.NextVersion(ctx); err != nil || got != 2 {
		t.Fatalf("the refused version used a number: next %d, %v", got, err)
	}
	// The full version is published and applied.
	publish(t, p, 2, subset(t, b, nil), true)
	if st := w.waitStatus(t, 2); st.State != StateApplied {
		t.Fatalf("version 2: %+v", st)
	}
	residentEquals(t, "the full version after a rejection", w.m, b)
	if err := p.FullVersionNeeded(ctx); err != nil {
		t.Fatalf("after an applied version: %v", err)
	}
	publish(t, p, 3, expertsC, false)
	if st := w.waitStatus(t, 3); st.State != StateApplied {
		t.Fatalf("version 3: %+v", st)
	}

	// needs_full from another worker (one that missed version 3's base,
	// say) counts as much.
	nc := refittest.Connect(t, srv.URL())
	for _, st := range []Status{
		{Protocol: ProtocolVersion, Worker: "w-0", Version: 3, State: StateApplied, CurrentVersion: 3},
		{Protocol: ProtocolVersion, Worker: "w-9", Version: 3, State: StateNeedsFull, Reason: "needs a full version", CurrentVersion: 1},
	} {
		b, _ := json.Marshal(st)
		if err := nc.Publish(StatusSubject(testModel), b); err != nil {
			t.Fatal(err)
		}
	}
	needsFull(p, "version 3", "1 of the 3 workers", "w-9 (needs_full")
	if _, err := p.Publish(ctx, 4, bytes.NewReader(expertsC), int64(len(expertsC)), false); !errors.Is(err, ErrFullVersionNeeded) {
		t.Fatalf("a partial version after needs_full: %v", err)
	}

	// A version announced and never completed (its publisher died): a
	// restarted publisher, which saw no status, publishes a full version.
	rawPublishEdited(t, srv.URL(), 4, subset(t, c, nil), true, 0, 4096, nil, nil, false)
	restarted := newPublisher(t, srv.URL())
	needsFull(restarted, "version 4 was announced and never completed")
	if _, err := restarted.Publish(ctx, 5, bytes.NewReader(expertsC), int64(len(expertsC)), false); !errors.Is(err, ErrFullVersionNeeded) {
		t.Fatalf("a partial version after an unfinished one: %v", err)
	}
	publish(t, restarted, 5, subset(t, c, nil), true)
	if st := w.waitStatus(t, 5); st.State != StateApplied {
		t.Fatalf("version 5: %+v", st)
	}
	residentEquals(t, "the full version after an unfinished one", w.m, c)
	if err := restarted.FullVersionNeeded(ctx); err != nil {
		t.Fatalf("after the full version: %v", err)
	}
}

// TestRefitSuperseded: a version whose publisher died (mid-version, or
// after its last chunk and before its manifest) gives way at once to a
// newer version announced after it: it is rejected as superseded and the
// newer one applied well within chunk_timeout, not after it. A version
// complete in the stream is not superseded: a slow worker still reading it
// when the next one is announced applies both.
func TestRefitSuperseded(t *testing.T) {
	const chunkTimeout = 20 * time.Second
	srv := refittest.StartServer(t)
	a, b, c := modelDir(t, 77), modelDir(t, 78), modelDir(t, 79)
	statuses := watchStatuses(t, srv.URL())
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(cfg *ReceiverConfig) { cfg.ChunkTimeout = chunkTimeout })
	ctx := ptContext(t, 60*time.Second)
	fullB, fullC := subset(t, b, nil), subset(t, c, nil)

	for _, tc := range []struct {
		name      string
		dead, new uint64
		publish   func(v uint64) // a publisher that dies
		stalled   func() bool    // the worker waits on the dead version
	}{
		{"died mid-version", 1, 2,
			func(v uint64) { rawPublish(t, srv.URL(), v, fullB, true, 0, 4096, 10, nil) },
			func() bool { return w.r.receivedBytes() == 10*4096 }},
		{"died before the manifest", 3, 4,
			func(v uint64) { rawPublishEdited(t, srv.URL(), v, fullB, true, 0, 4096, nil, nil, false) },
			func() bool { return w.r.receivedBytes() == int64(len(fullB)) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.publish(tc.dead)
			for deadline := time.Now().Add(10 * time.Second); !tc.stalled(); time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("the worker received %d bytes of version %d", w.r.receivedBytes(), tc.dead)
				}
			}
			start := time.Now()
			p := newPublisher(t, srv.URL()) // a publisher restarted
			if next, err := p.NextVersion(ctx); err != nil || next != tc.new {
				t.Fatalf("next version %d, %v; want %d", next, err, tc.new)
			}
			publish(t, p, tc.new, fullC, true)
			st := statuses.wait(t, "w", tc.new)
			took := time.Since(start)
			if st.State != StateApplied {
				t.Fatalf("version %d: %+v", tc.new, st)
			}
			if dead, _ := statuses.find("w", tc.dead); dead.State != StateRejected || !strings.Contains(dead.Reason, fmt.Sprintf("superseded by version %d", tc.new)) {
				t.Fatalf("version %d: %+v, want rejected as superseded by version %d", tc.dead, dead, tc.new)
			}
			if took > chunkTimeout/4 {
				t.Fatalf("version %d applied %v after it was published, chunk_timeout is %v", tc.new, took, chunkTimeout)
			}
			residentEquals(t, "the version after a dead one", w.m, c)
			t.Logf("version %d applied %v after its publish began", tc.new, took)
		})
	}

	// A slow worker still reading version 5, complete in the stream, when
	// version 6 (a partial one on 5) is announced applies 5, then 6.
	slow := startWorker(t, srv.URL(), a, "slow", moe.RecipePerToken, func(cfg *ReceiverConfig) { cfg.ChunkTimeout = chunkTimeout })
	statuses.wait(t, "slow", 4) // its catch-up
	slow.r.chunkDelay = 5 * time.Millisecond
	p, err := NewPublisher(refittest.Connect(t, srv.URL()), PublisherConfig{Model: testModel, ChunkBytes: 4096}, nil)
	if err != nil {
		t.Fatal(err)
	}
	publish(t, p, 5, fullB, true)
	if statuses.wait(t, "w", 5).State != StateApplied {
		t.Fatal("the fast worker did not apply version 5")
	}
	if _, done := statuses.find("slow", 5); done {
		t.Fatal("the slow worker was not slow: the test proves nothing")
	}
	publish(t, p, 6, subset(t, c, experts), false)
	for _, v := range []uint64{5, 6} {
		if st := statuses.wait(t, "slow", v); st.State != StateApplied {
			t.Fatalf("slow worker, version %d: %+v", v, st)
		}
	}
	residentEquals(t, "the slow worker", slow.m, mixDir(t, b, c, experts))
}

// TestSignedFullWithoutBase: a full version may leave base out
// (PROTOCOL.md, "Announcement"); its signed bytes then say base=0, as
// "Signatures" has it, so its signature verifies either way.
func TestSignedFullWithoutBase(t *testing.T) {
	s := sgSigner(t)
	trust := sgTrust(t, s.PublicKey())
	a, m := sgExample()
	a.Full, a.Base, m.Full, m.Base = true, 0, true, 0
	if !strings.Contains(string(a.SignedBytes()), "\nbase=0\n") {
		t.Fatalf("signed bytes of a full version:\n%s", a.SignedBytes())
	}
	if err := s.SignAnnounce(&a); err != nil {
		t.Fatal(err)
	}
	if err := s.SignManifest(&m); err != nil {
		t.Fatal(err)
	}
	for _, drop := range []bool{false, true} {
		var edits []jsonEdit
		if drop {
			edits = []jsonEdit{{field: "base", delete: true}}
		}
		pa, err := ParseAnnounce(editJSON(t, a, edits))
		if err != nil {
			t.Fatal(err)
		}
		if err := trust.VerifyAnnounce(pa); err != nil {
			t.Errorf("announcement, base dropped %v: %v", drop, err)
		}
		pm, err := ParseManifest(editJSON(t, m, edits))
		if err != nil {
			t.Fatal(err)
		}
		if err := trust.VerifyManifest(pm); err != nil {
			t.Errorf("manifest, base dropped %v: %v", drop, err)
		}
	}
}
