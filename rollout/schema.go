package rollout

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rollout-worker/rollout-worker/policy"
)

// Schema is the version of the wire format (SCHEMA.md). Every request
// carries it; a request with another value is refused with a 400 error.
const Schema = "rollout.v1"

// Release is the rollout-worker release the micro service announces in
// $SRV.INFO (Config.Release overrides it).
const Release = "0.1.0"

// ServiceName is the NATS micro service name every worker registers.
const ServiceName = "rollout-worker"

// Message types (the "type" field of every reply).
const (
	TypeSample    = "sample"
	TypeSummary   = "summary"
	TypeHeartbeat = "heartbeat"
	TypeError     = "error"
	TypeScore     = "score"
	TypeStatus    = "status"
	TypeCancelled = "cancelled"
)

// Finish reasons of a sample (policy.FinishReason on the wire).
const (
	FinishStop   = "stop"
	FinishLength = "length"
	FinishAbort  = "abort"
	// FinishError: the model produced non-finite logits for the sample; its
	// Error says where, and the request's other samples are aborted.
	FinishError = "error"
)

// Subject returns the subject of an endpoint ("generate", "score",
// "status", "cancel") of a model's workers: rollout.<model>.<endpoint>.
func Subject(model, endpoint string) string { return "rollout." + model + "." + endpoint }

// validModelID reports whether s can be one subject token.
func validModelID(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// GenerateRequest is one prompt with N samples (the "generate" endpoint).
//
// Zero values that JSON omits take the service's defaults: N 0 is sent as
// absent (1 sample), TopP 0 as absent (1), TopK 0 means the whole
// vocabulary, a nil Seed asks the service to choose one (echoed in every
// sample), MinPolicyVersion 0 waits for nothing. Temperature is always
// sent: 0 is greedy. Stop holds at most MaxStop distinct ids. A Seed above
// MaxSafeSeed is exact here but not in JavaScript clients (SCHEMA.md).
type GenerateRequest struct {
	Schema              string  `json:"schema"`
	ID                  string  `json:"id,omitempty"`
	Prompt              []int32 `json:"prompt"`
	N                   int     `json:"n,omitempty"`
	Temperature         float32 `json:"temperature"`
	TopP                float32 `json:"top_p,omitempty"`
	TopK                int     `json:"top_k,omitempty"`
	MaxTokens           int     `json:"max_tokens"`
	Stop                []int32 `json:"stop,omitempty"`
	Seed                *uint64 `json:"seed,omitempty"`
	ReturnLogprobs      bool    `json:"return_logprobs,omitempty"`
	ReturnRoutedExperts bool    `json:"return_routed_experts,omitempty"`
	MinPolicyVersion    uint64  `json:"min_policy_version,omitempty"`
	// MaxWaitMS bounds the min_policy_version wait (the service's
	// MaxWaitVersion caps it); 0: the service's bound. The client sets it
	// from its context's deadline.
	MaxWaitMS int64 `json:"max_wait_ms,omitempty"`
}

// MaxStop bounds the distinct ids of a request's stop list (more: a 400).
const MaxStop = 1024

// MaxSafeSeed is the largest seed every JSON parser reads exactly: 2^53-1.
// Parsers that read numbers as IEEE doubles (JavaScript's JSON.parse)
// round larger ones; the seeds the worker draws are never larger.
const MaxSafeSeed = 1<<53 - 1

// generateWire is what the service decodes: pointers tell an absent field
// (default) from an explicit zero (possibly invalid).
type generateWire struct {
	Schema              *string  `json:"schema"`
	ID                  string   `json:"id"`
	Prompt              []int32  `json:"prompt"`
	N                   *int     `json:"n"`
	Temperature         *float32 `json:"temperature"`
	TopP                *float32 `json:"top_p"`
	TopK                int      `json:"top_k"`
	MaxTokens           *int     `json:"max_tokens"`
	Stop                []int32  `json:"stop"`
	Seed                *uint64  `json:"seed"`
	ReturnLogprobs      bool     `json:"return_logprobs"`
	ReturnRoutedExperts bool     `json:"return_routed_experts"`
	MinPolicyVersion    uint64   `json:"min_policy_version"`
	MaxWaitMS           int64    `json:"max_wait_ms"`
}

// SampleReply is one finished sample.
type SampleReply struct {
	Type  string `json:"type"` // "sample"
	ID    string `json:"id"`
	Index int    `json:"index"`
	// Tokens are the generated token ids (a stop token is included).
	Tokens []int32 `json:"tokens"`
	// LogProbs of each token under softmax(logits / T) (return_logprobs
	// only; a non-finite value travels as null and decodes as NaN).
	LogProbs LogProbs `json:"logprobs,omitempty"`
	// Versions is the policy version each token was produced under.
	Versions     []uint64 `json:"versions"`
	FinishReason string   `json:"finish_reason"`
	// RoutedExperts[i][layer*k+j]: the experts token i's forward pass
	// routed to (return_routed_experts only).
	RoutedExperts [][]int32 `json:"routed_experts,omitempty"`
	// Seed is the request's sampling seed, chosen by the service when the
	// request had none: resending the request with it reproduces the sample.
	Seed uint64 `json:"seed"`
	// TimeMS is the time from the request's arrival to this sample's end.
	TimeMS float64 `json:"time_ms"`
	// Warning says what was left out of this message, if anything (routed
	// experts too large for the server's max payload).
	Warning string `json:"warning,omitempty"`
	// Error says why the sample failed (finish_reason "error" only).
	Error string `json:"error,omitempty"`
}

// Summary is the last message of a generate request's stream.
type Summary struct {
	Type string `json:"type"` // "summary"
	ID   string `json:"id"`
	// Samples is the number of sample messages sent before it (n, unless
	// Error says why not); Aborted counts those with finish_reason "abort".
	Samples         int    `json:"samples"`
	Aborted         int    `json:"aborted"`
	GeneratedTokens int    `json:"generated_tokens"`
	Seed            uint64 `json:"seed"`
	Worker          string `json:"worker"`
	// QueueMS is the time from arrival to submission to the engine
	// (including any min_policy_version wait); TotalMS to this message.
	QueueMS float64 `json:"queue_ms"`
	TotalMS float64 `json:"total_ms"`
	Error   string  `json:"error,omitempty"`
}

// Heartbeat keeps a quiet stream alive (a min_policy_version wait, long
// samples); clients skip it but reset their idle timer.
type Heartbeat struct {
	Type      string  `json:"type"` // "heartbeat"
	ID        string  `json:"id"`
	ElapsedMS float64 `json:"elapsed_ms"`
	Samples   int     `json:"samples"` // sent so far
}

// ErrorReply is the body of an error reply; the same code and text travel
// in the Nats-Service-Error-Code and Nats-Service-Error headers.
type ErrorReply struct {
	Type   string `json:"type"` // "error"
	ID     string `json:"id"`
	Code   int    `json:"code"`
	Reason string `json:"reason"`
	Error  string `json:"error"`
}

// ScoreRequest asks for teacher-forced logprobs of whole sequences.
type ScoreRequest struct {
	Schema    string    `json:"schema"`
	ID        string    `json:"id,omitempty"`
	Sequences [][]int32 `json:"sequences"`
}

// ScoreReply holds, per sequence, one logprob per token: log p(token_i |
// tokens before i), null (NaN in Go) for the first token.
type ScoreReply struct {
	Type     string     `json:"type"` // "score"
	ID       string     `json:"id"`
	Worker   string     `json:"worker"`
	LogProbs []LogProbs `json:"logprobs"`
}

// StatusRequest is the body of a status request (it may also be empty).
type StatusRequest struct {
	Schema string `json:"schema"`
}

// CancelRequest asks the workers of a model to abort a generate request:
// the one holding the request whose id is ID and whose reply subject is
// Inbox aborts its unfinished samples (they end with finish_reason
// "abort", then the summary). Every worker receives it (the cancel
// subject is not in the queue group); only the one holding the request
// answers, and only when the cancel has a reply subject.
type CancelRequest struct {
	Schema string `json:"schema"`
	ID     string `json:"id"`
	Inbox  string `json:"inbox"`
}

// CancelReply confirms a cancel: the worker found the request and aborted
// it. Its samples and summary still go to the request's inbox.
type CancelReply struct {
	Type   string `json:"type"` // "cancelled"
	ID     string `json:"id"`
	Worker string `json:"worker"`
}

// StatusReply describes one worker.
type StatusReply struct {
	Type    string `json:"type"` // "status"
	Schema  string `json:"schema"`
	Release string `json:"release"`
	Model   string `json:"model"`
	Worker  string `json:"worker"`
	// Version is the policy version being served (absent when it could not
	// be read; VersionError says why).
	Version      *uint64 `json:"version,omitempty"`
	VersionError string  `json:"version_error,omitempty"`
	// QueueDepth counts admitted requests not yet finished (generate and
	// score), of at most MaxQueue; Running the generate requests in the
	// engine, WaitingVersion those waiting for their min_policy_version.
	QueueDepth     int    `json:"queue_depth"`
	MaxQueue       int    `json:"max_queue"`
	Running        int    `json:"running"`
	WaitingVersion int    `json:"waiting_version"`
	Draining       bool   `json:"draining"`
	KVPagesInUse   int64  `json:"kv_pages_in_use"`
	KVPages        int    `json:"kv_pages"`
	Recipe         string `json:"recipe"`
	// Context is the model's context (max positions): prompt + max_tokens
	// must fit it. Absent when the service was not told.
	Context   int    `json:"context,omitempty"`
	Limits    Limits `json:"limits"`
	Steps     uint64 `json:"engine_steps"`
	Generated uint64 `json:"engine_generated_tokens"`
}

// LogProbs is a list of logprobs whose non-finite values (none in
// practice; the first token of a scored sequence) travel as JSON null and
// decode as NaN.
type LogProbs []float32

// MarshalJSON writes non-finite values as null.
func (l LogProbs) MarshalJSON() ([]byte, error) {
	if l == nil {
		return []byte("null"), nil
	}
	b := make([]byte, 0, 2+len(l)*12)
	b = append(b, '[')
	for i, v := range l {
		if i > 0 {
			b = append(b, ',')
		}
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			b = append(b, "null"...)
			continue
		}
		b = appendFloat32(b, v)
	}
	return append(b, ']'), nil
}

// appendFloat32 formats v as encoding/json does: the shortest text that
// reads back as the same float32.
func appendFloat32(b []byte, v float32) []byte {
	f, fmtc := float64(v), byte('f')
	if a := math.Abs(f); a != 0 && (float32(a) < 1e-6 || float32(a) >= 1e21) {
		fmtc = 'e'
	}
	b = strconv.AppendFloat(b, f, fmtc, -1, 32)
	if fmtc == 'e' { // clean up e-09 to e-9
		if n := len(b); n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
			b[n-2] = b[n-1]
			b = b[:n-1]
		}
	}
	return b
}

// UnmarshalJSON reads null as NaN.
func (l *LogProbs) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*l = nil
		return nil
	}
	var vs []*float32
	if err := json.Unmarshal(b, &vs); err != nil {
		return err
	}
	out := make(LogProbs, len(vs))
	for i, v := range vs {
		if v == nil {
			out[i] = float32(math.NaN())
		} else {
			out[i] = *v
		}
	}
	*l = out
	return nil
}

// Error reasons: the machine-readable "reason" of an error reply.
const (
	ReasonBadRequest        = "bad_request"         // 400
	ReasonOverloaded        = "overloaded"          // 503: the admission queue is full
	ReasonDraining          = "draining"            // 503: the worker is shutting down
	ReasonVersionNotReached = "version_not_reached" // 503: min_policy_version not served in time
	ReasonInternal          = "internal"            // 500
)

// Error is an error reply from a worker (the client returns it), or the
// error a service is about to send.
type Error struct {
	Op     string // "generate", "score", "status"
	ID     string // the request's id
	Code   int    // 400, 503, 500
	Reason string // Reason* constant
	Msg    string
}

func (e *Error) Error() string {
	s := "rollout: " + e.Op
	if e.ID != "" {
		s += " " + strconv.Quote(e.ID)
	}
	return fmt.Sprintf("%s: %d %s: %s", s, e.Code, e.Reason, e.Msg)
}

// Is matches the sentinels by reason (and code, when the sentinel has one).
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	if !ok || t.Msg != "" {
		return false
	}
	return t.Reason == e.Reason && (t.Code == 0 || t.Code == e.Code)
}

// Sentinels for errors.Is.
var (
	ErrBadRequest        = &Error{Code: 400, Reason: ReasonBadRequest}
	ErrOverloaded        = &Error{Code: 503, Reason: ReasonOverloaded}
	ErrDraining          = &Error{Code: 503, Reason: ReasonDraining}
	ErrVersionNotReached = &Error{Code: 503, Reason: ReasonVersionNotReached}
	ErrInternal          = &Error{Code: 500, Reason: ReasonInternal}
	// ErrTimeout: nothing arrived on a stream for the client's idle time.
	ErrTimeout = errors.New("rollout: no reply within the idle timeout")
)

func badRequest(op, id, format string, args ...any) *Error {
	return &Error{Op: op, ID: id, Code: 400, Reason: ReasonBadRequest, Msg: fmt.Sprintf(format, args...)}
}

// body is the JSON error reply for e.
func (e *Error) body() []byte {
	b, _ := json.Marshal(ErrorReply{Type: TypeError, ID: e.ID, Code: e.Code, Reason: e.Reason, Error: e.Msg})
	return b
}

// decodeStrict decodes exactly one JSON value into v, refusing unknown
// fields, and turns decoding errors into messages that name the field.
func decodeStrict(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var se *json.SyntaxError
		var te *json.UnmarshalTypeError
		switch {
		case errors.As(err, &se):
			return fmt.Errorf("malformed JSON at byte %d: %v", se.Offset, err)
		case errors.As(err, &te):
			if te.Field == "" {
				return fmt.Errorf("request: JSON %s, want an object", te.Value)
			}
			return fmt.Errorf("%s: JSON %s where %v expected (at byte %d)", te.Field, te.Value, te.Type, te.Offset)
		case strings.HasPrefix(err.Error(), "json: unknown field "):
			return fmt.Errorf("%s: unknown field (not in %s)", strings.TrimPrefix(err.Error(), "json: unknown field "), Schema)
		case errors.Is(err, io.EOF):
			return errors.New("malformed JSON: empty body")
		case errors.Is(err, io.ErrUnexpectedEOF):
			return errors.New("malformed JSON: unexpected end of input")
		}
		return fmt.Errorf("malformed JSON: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("malformed JSON: data after the request object")
	}
	return checkFieldNames(data, v)
}

// checkFieldNames refuses a key of the JSON object data that is not, byte
// for byte, the json name of a field of the struct v points to.
// encoding/json matches names case-insensitively, so "Prompt" or
// "MAX_TOKENS" would fill prompt and max_tokens; rollout.v1 field names are
// exact. data has already decoded into v.
func checkFieldNames(data []byte, v any) error {
	names := fieldNames(reflect.TypeOf(v))
	dec := json.NewDecoder(bytes.NewReader(data))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil // null: nothing to check
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return fmt.Errorf("malformed JSON: %v", err)
		}
		key, _ := t.(string)
		if !names[key] {
			for name := range names {
				if strings.EqualFold(name, key) {
					return fmt.Errorf("%s: unknown field (field names are case-sensitive: %q)", key, name)
				}
			}
			return fmt.Errorf("%s: unknown field (not in %s)", key, Schema)
		}
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return fmt.Errorf("malformed JSON: %v", err)
		}
	}
	return nil
}

// fieldNamesCache maps a struct type to the set of its fields' json names.
var fieldNamesCache sync.Map // reflect.Type -> map[string]bool

// fieldNames returns the json names of the fields of struct type t (or of
// what t points to).
func fieldNames(t reflect.Type) map[string]bool {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if m, ok := fieldNamesCache.Load(t); ok {
		return m.(map[string]bool)
	}
	m := map[string]bool{}
	if t.Kind() == reflect.Struct {
		for i := range t.NumField() {
			f := t.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			switch {
			case name == "-" || !f.IsExported():
			case name == "":
				m[f.Name] = true
			default:
				m[name] = true
			}
		}
	}
	fieldNamesCache.Store(t, m)
	return m
}

// newID returns a random request id (16 hex digits).
func newID() string {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], rand.Uint64())
	return hex.EncodeToString(b[:])
}

// maxIDLen bounds a request id.
const maxIDLen = 256

func checkSchema(s *string) error {
	switch {
	case s == nil:
		return fmt.Errorf("schema: missing, want %q", Schema)
	case *s != Schema:
		return fmt.Errorf("schema: %q, want %q", *s, Schema)
	}
	return nil
}

func checkTokens(field string, ids []int32, vocab int) error {
	for i, t := range ids {
		if t < 0 || int(t) >= vocab {
			return fmt.Errorf("%s[%d]: token %d outside the vocabulary [0, %d)", field, i, t, vocab)
		}
	}
	return nil
}

// generateParams is a validated generate request.
type generateParams struct {
	req        policy.Request
	logprobs   bool
	routed     bool
	minVersion uint64
	maxWait    time.Duration // 0: the service's bound
}

// parseGenerate decodes and validates a generate request against the
// limits, the vocabulary and the model's context (0: unknown, left to the
// engine). newID names a request that has no id; seed draws a seed for one
// that has none.
func parseGenerate(data []byte, lim Limits, vocab, ctxLen int, newID func() string, seed func() uint64) (generateParams, *Error) {
	const op = "generate"
	var w generateWire
	if err := decodeStrict(data, &w); err != nil {
		return generateParams{}, badRequest(op, "", "%v", err)
	}
	id := w.ID
	bad := func(format string, args ...any) (generateParams, *Error) {
		return generateParams{}, badRequest(op, id, format, args...)
	}
	if err := checkSchema(w.Schema); err != nil {
		return bad("%v", err)
	}
	if len(id) > maxIDLen {
		id = id[:maxIDLen]
		return bad("id: %d bytes, limit %d", len(w.ID), maxIDLen)
	}
	if id == "" {
		id = newID()
	}
	p := generateParams{logprobs: w.ReturnLogprobs, routed: w.ReturnRoutedExperts, minVersion: w.MinPolicyVersion}
	r := &p.req
	r.ID, r.Prompt, r.N = id, w.Prompt, 1
	r.Params = policy.SamplingParams{Temperature: 1, TopP: 1, TopK: w.TopK, Stop: w.Stop, RoutedExperts: w.ReturnRoutedExperts}
	switch {
	case len(w.Prompt) == 0:
		return bad("prompt: empty, want at least one token id")
	case len(w.Prompt) > lim.MaxPromptTokens:
		return bad("prompt: %d tokens, limit %d", len(w.Prompt), lim.MaxPromptTokens)
	case ctxLen > 0 && len(w.Prompt) >= ctxLen:
		return bad("prompt: %d tokens, the model's context of %d leaves no room for max_tokens", len(w.Prompt), ctxLen)
	}
	if err := checkTokens("prompt", w.Prompt, vocab); err != nil {
		return bad("%v", err)
	}
	if w.N != nil {
		r.N = *w.N
	}
	if r.N < 1 || r.N > lim.MaxN {
		return bad("n: %d, want 1..%d", r.N, lim.MaxN)
	}
	switch {
	case w.MaxTokens == nil:
		return bad("max_tokens: missing, want 1..%d", lim.MaxTokens)
	case *w.MaxTokens < 1 || *w.MaxTokens > lim.MaxTokens:
		return bad("max_tokens: %d, want 1..%d", *w.MaxTokens, lim.MaxTokens)
	}
	r.Params.MaxTokens = *w.MaxTokens
	if ctxLen > 0 && len(w.Prompt)+r.Params.MaxTokens > ctxLen {
		return bad("max_tokens: %d, at most %d with a prompt of %d tokens (the model's context of %d)",
			r.Params.MaxTokens, ctxLen-len(w.Prompt), len(w.Prompt), ctxLen)
	}
	if w.Temperature != nil {
		r.Params.Temperature = *w.Temperature
	}
	if t := r.Params.Temperature; !(t >= 0 && t <= maxTemperature) {
		return bad("temperature: %v, want 0 (greedy) up to 1e6", t)
	}
	if w.TopP != nil {
		r.Params.TopP = *w.TopP
	}
	if tp := r.Params.TopP; !(tp > 0 && tp <= 1) {
		return bad("top_p: %v, want (0, 1]", tp)
	}
	if w.TopK < 0 || w.TopK > vocab {
		return bad("top_k: %d, want 0 (whole vocabulary) up to %d", w.TopK, vocab)
	}
	if err := checkTokens("stop", w.Stop, vocab); err != nil {
		return bad("%v", err)
	}
	stop, err := distinctStop(w.Stop)
	if err != nil {
		return bad("%v", err)
	}
	r.Params.Stop = stop
	if w.MaxWaitMS < 0 {
		return bad("max_wait_ms: %d, want >= 0 (0: the worker's bound)", w.MaxWaitMS)
	}
	p.maxWait = time.Duration(min(w.MaxWaitMS, math.MaxInt64/int64(time.Millisecond))) * time.Millisecond
	if w.Seed != nil {
		r.Params.Seed = *w.Seed
	} else {
		r.Params.Seed = seed()
	}
	return p, nil
}

// maxTemperature is the engine's bound.
const maxTemperature = 1e6

// distinctStop returns the distinct ids of a stop list in their first
// order, or an error naming stop when there are more than MaxStop.
func distinctStop(ids []int32) ([]int32, error) {
	if len(ids) <= 1 {
		return ids, nil
	}
	seen := make(map[int32]struct{}, min(len(ids), MaxStop+1))
	out := make([]int32, 0, min(len(ids), MaxStop))
	for _, t := range ids {
		if _, dup := seen[t]; dup {
			continue
		}
		if len(out) == MaxStop {
			return nil, fmt.Errorf("stop: more than %d distinct token ids (%d listed), limit %d", MaxStop, len(ids), MaxStop)
		}
		seen[t] = struct{}{}
		out = append(out, t)
	}
	return out, nil
}

// parseScore decodes and validates a score request.
func parseScore(data []byte, lim Limits, vocab, ctxLen int, newID func() string) (string, [][]int32, *Error) {
	const op = "score"
	var w struct {
		Schema    *string   `json:"schema"`
		ID        string    `json:"id"`
		Sequences [][]int32 `json:"sequences"`
	}
	if err := decodeStrict(data, &w); err != nil {
		return "", nil, badRequest(op, "", "%v", err)
	}
	id := w.ID
	bad := func(format string, args ...any) (string, [][]int32, *Error) {
		return "", nil, badRequest(op, id, format, args...)
	}
	if err := checkSchema(w.Schema); err != nil {
		return bad("%v", err)
	}
	if len(id) > maxIDLen {
		id = id[:maxIDLen]
		return bad("id: %d bytes, limit %d", len(w.ID), maxIDLen)
	}
	if id == "" {
		id = newID()
	}
	switch {
	case len(w.Sequences) == 0:
		return bad("sequences: empty, want at least one sequence")
	case len(w.Sequences) > lim.MaxScoreSequences:
		return bad("sequences: %d, limit %d", len(w.Sequences), lim.MaxScoreSequences)
	}
	maxLen := lim.MaxPromptTokens + lim.MaxTokens
	if ctxLen > 0 {
		maxLen = min(maxLen, ctxLen)
	}
	for i, s := range w.Sequences {
		switch {
		case len(s) == 0:
			return bad("sequences[%d]: empty", i)
		case len(s) > maxLen:
			return bad("sequences[%d]: %d tokens, limit %d", i, len(s), maxLen)
		}
		if err := checkTokens(fmt.Sprintf("sequences[%d]", i), s, vocab); err != nil {
			return bad("%v", err)
		}
	}
	return id, w.Sequences, nil
}

// parseStatus validates the body of a status request: empty, or an object
// with the schema.
func parseStatus(data []byte) *Error {
	if len(data) == 0 {
		return nil
	}
	var w struct {
		Schema *string `json:"schema"`
	}
	err := decodeStrict(data, &w)
	if err == nil && w.Schema != nil {
		err = checkSchema(w.Schema)
	}
	if err != nil {
		return badRequest("status", "", "%v", err)
	}
	return nil
}

// maxInboxLen bounds the inbox of a cancel request (a NATS subject).
const maxInboxLen = 1024

// parseCancel decodes and validates a cancel request: the id and the reply
// subject of the generate request to abort.
func parseCancel(data []byte) (id, inbox string, _ *Error) {
	const op = "cancel"
	var w struct {
		Schema *string `json:"schema"`
		ID     string  `json:"id"`
		Inbox  string  `json:"inbox"`
	}
	if err := decodeStrict(data, &w); err != nil {
		return "", "", badRequest(op, "", "%v", err)
	}
	id = w.ID
	if len(id) > maxIDLen {
		id = id[:maxIDLen]
	}
	bad := func(format string, args ...any) (string, string, *Error) {
		return "", "", badRequest(op, id, format, args...)
	}
	if err := checkSchema(w.Schema); err != nil {
		return bad("%v", err)
	}
	switch {
	case w.ID == "":
		return bad("id: missing, want the id of the generate request")
	case len(w.ID) > maxIDLen:
		return bad("id: %d bytes, limit %d", len(w.ID), maxIDLen)
	case w.Inbox == "":
		return bad("inbox: missing, want the reply subject of the generate request")
	case len(w.Inbox) > maxInboxLen || strings.ContainsAny(w.Inbox, " \t\r\n*>"):
		return bad("inbox: not a reply subject")
	}
	return w.ID, w.Inbox, nil
}
