package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// TestAbandonedRequestAborted: a client that goes away in the middle of a
// long request (16 x 1000 tokens) frees the engine within a bound, whether
// it says so (Stream.Close, its context ending) or just vanishes (its
// connection closes, or it drops the inbox without a word): the request's
// samples are aborted and the tokens generated stay far below those asked
// for.
func TestAbandonedRequestAborted(t *testing.T) {
	const n, maxTokens = 16, 1000
	cases := []struct {
		name       string
		clientGone time.Duration // the worker's check; -1: off, only the cancel can end the request
		result     string        // rollout_worker_requests_total{generate,result}
		// start sends the request and returns how the client goes away.
		start func(t *testing.T, c *Client, nc *nats.Conn, req GenerateRequest) (leave func())
	}{
		{"stream closed", -1, resultCancelled, func(t *testing.T, c *Client, _ *nats.Conn, req GenerateRequest) func() {
			st, err := c.Generate(testCtx(t), req)
			if err != nil {
				t.Fatal(err)
			}
			return func() {
				if err := st.Close(); err != nil {
					t.Errorf("close: %v", err)
				}
			}
		}},
		{"context cancelled", -1, resultCancelled, func(t *testing.T, c *Client, _ *nats.Conn, req GenerateRequest) func() {
			ctx, cancel := context.WithCancel(testCtx(t))
			t.Cleanup(cancel)
			go func() { _, _, _ = c.GenerateAll(ctx, req) }()
			return cancel
		}},
		{"connection closed", 100 * time.Millisecond, resultClientGone, func(t *testing.T, c *Client, nc *nats.Conn, req GenerateRequest) func() {
			if _, err := c.Generate(testCtx(t), req); err != nil {
				t.Fatal(err)
			}
			return nc.Close
		}},
		{"inbox dropped without a cancel", 100 * time.Millisecond, resultClientGone, func(t *testing.T, _ *Client, nc *nats.Conn, req GenerateRequest) func() {
			inbox := nc.NewInbox()
			sub, err := nc.SubscribeSync(inbox)
			if err != nil {
				t.Fatal(err)
			}
			req.Schema, req.ID = Schema, "raw"
			if err := nc.PublishMsg(&nats.Msg{Subject: Subject(testModel, "generate"), Reply: inbox, Data: mustJSON(t, req)}); err != nil {
				t.Fatal(err)
			}
			return func() {
				if err := sub.Unsubscribe(); err != nil {
					t.Error(err)
				}
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv := refittest.StartServer(t)
			w := startWorker(t, srv.URL(), tinyModelDir(t), Config{ClientGone: tc.clientGone, Heartbeat: -1})
			// The client's own connection, so that closing it leaves the worker's.
			nc, err := nats.Connect(srv.URL())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			c := NewClient(nc, testModel)
			before := w.eng.Stats().Generated
			leave := tc.start(t, c, nc, GenerateRequest{Prompt: prompt(8), N: n, Temperature: 1, MaxTokens: maxTokens, Seed: seed(3)})
			waitFor(t, func() bool { return w.eng.Stats().Generated >= before+4*n })

			leave()
			left := time.Now()
			// The job ends once the engine has returned every sample.
			for w.svc.snapshot().depth != 0 {
				if time.Since(left) > 2*time.Second {
					t.Fatalf("%v after the client left, the request still runs: %d tokens generated",
						time.Since(left), w.eng.Stats().Generated-before)
				}
				time.Sleep(2 * time.Millisecond)
			}
			gen := w.eng.Stats().Generated - before
			t.Logf("freed %v after the client left; %d of %d tokens generated", time.Since(left), gen, n*maxTokens)
			if gen > n*maxTokens/2 {
				t.Errorf("%d tokens generated of the %d asked for: the abandoned request ran on", gen, n*maxTokens)
			}
			if got := w.counter(t, w.svc.met.requests.WithLabelValues("generate", tc.result)); got != 1 {
				t.Errorf("requests_total{generate,%s} = %v, want 1", tc.result, got)
			}
			if got := w.counter(t, w.svc.met.samples.WithLabelValues(FinishAbort)); got == 0 {
				t.Error("no sample aborted")
			}
		})
	}
}

// TestCancelScope: a cancel aborts only the request with both its id and
// its inbox (another driver's request with the same id runs on), the
// holder confirms a cancel sent as a request and the other workers stay
// silent, and a request waiting for its policy version is cancelled too.
func TestCancelScope(t *testing.T) {
	srv := refittest.StartServer(t)
	dir := tinyModelDir(t)
	w := startWorker(t, srv.URL(), dir, Config{Worker: "wa", ClientGone: -1})
	wb := startWorker(t, srv.URL(), dir, Config{Worker: "wb", ClientGone: -1})
	ctx := testCtx(t)
	driver := func() (*Client, *nats.Conn) {
		nc := refittest.Connect(t, srv.URL())
		return NewClient(nc, testModel), nc
	}
	ca, nca := driver()
	cb, _ := driver()

	long := GenerateRequest{ID: "step1-p0", Prompt: prompt(8), N: 4, Temperature: 1, MaxTokens: 1000, Seed: seed(1)}
	a, err := ca.Generate(ctx, long)
	if err != nil {
		t.Fatal(err)
	}
	short := long
	short.N, short.MaxTokens = 2, 200
	b, err := cb.Generate(ctx, short)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return w.eng.Stats().Generated+wb.eng.Stats().Generated > 0 })

	cancel := func(id, inbox string, wait time.Duration) (*nats.Msg, error) {
		return nca.Request(Subject(testModel, "cancel"), mustJSON(t, CancelRequest{Schema: Schema, ID: id, Inbox: inbox}), wait)
	}
	// The id alone, with another inbox, or an unknown id: no worker holds it.
	for _, c := range []struct{ id, inbox string }{{"step1-p0", nca.NewInbox()}, {"step1-p9", a.inbox}} {
		if msg, err := cancel(c.id, c.inbox, 300*time.Millisecond); !errors.Is(err, nats.ErrTimeout) {
			t.Errorf("cancel %+v: reply %v, %v: want none", c, msg, err)
		}
	}
	msg, err := cancel("step1-p0", a.inbox, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var rep CancelReply
	if err := json.Unmarshal(msg.Data, &rep); err != nil || rep.Type != TypeCancelled || rep.ID != "step1-p0" || (rep.Worker != "wa" && rep.Worker != "wb") {
		t.Errorf("cancel reply %s, %v", msg.Data, err)
	}
	gotA, sumA := checkStream(t, ctx, a, 4)
	if sumA.Aborted == 0 || !strings.Contains(sumA.Error, "cancelled by the client") {
		t.Errorf("cancelled request: summary %+v", sumA)
	}
	for _, r := range gotA {
		if r.FinishReason == FinishAbort && len(r.Tokens) >= 1000 {
			t.Errorf("sample %d aborted with all its tokens", r.Index)
		}
	}
	if _, sumB := checkStream(t, ctx, b, 2); sumB.Aborted != 0 || sumB.Error != "" {
		t.Errorf("the other driver's request with the same id: summary %+v", sumB)
	}

	// A request waiting for its policy version.
	wait, err := ca.Generate(ctx, GenerateRequest{ID: "wait", Prompt: prompt(4), N: 3, MaxTokens: 4, MinPolicyVersion: 9})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return w.svc.snapshot().waiting+wb.svc.snapshot().waiting == 1 })
	if _, err := cancel("wait", wait.inbox, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, sum := checkStream(t, ctx, wait, 3); sum.Aborted != 3 || !strings.Contains(sum.Error, "cancelled by the client") {
		t.Errorf("cancelled while waiting: summary %+v", sum)
	}

	// A malformed cancel is refused by every worker; the first answer comes back.
	for _, body := range []string{`{"schema":"rollout.v1","id":"x"}`, `{"schema":"rollout.v1","ID":"x","inbox":"y"}`, `{"id":"x","inbox":"y"}`} {
		msg, err := nca.Request(Subject(testModel, "cancel"), []byte(body), 5*time.Second)
		if err != nil || msg.Header.Get("Nats-Service-Error-Code") != "400" {
			t.Errorf("cancel %s: %v, %v: want a 400", body, msg, err)
		}
	}
}

// TestUnheard: the gone-client check aborts after a run of undelivered
// messages lasting ClientGone, and any delivered message (a gap in the
// run) starts the count again.
func TestUnheard(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	type miss struct {
		seq uint64
		ms  int
	}
	for _, tc := range []struct {
		name   string
		misses []miss
		gone   bool // after the last
	}{
		{"one miss", []miss{{1, 0}}, false},
		{"a run shorter than the bound", []miss{{1, 0}, {2, 100}, {3, 200}}, false},
		{"a run as long as the bound", []miss{{1, 0}, {2, 100}, {3, 200}, {4, 300}}, true},
		{"a delivered message in between", []miss{{1, 0}, {2, 100}, {4, 200}, {5, 300}}, false},
		{"a new run as long as the bound", []miss{{1, 0}, {3, 100}, {4, 250}, {5, 400}}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := &job{s: &Service{cfg: Config{ClientGone: 300 * time.Millisecond}}}
			var gone bool
			for _, m := range tc.misses {
				gone = j.unheard(m.seq, at(m.ms))
			}
			if gone != tc.gone {
				t.Errorf("misses %v: gone %v, want %v", tc.misses, gone, tc.gone)
			}
		})
	}
}

// TestVersionWaitersBounded: requests waiting for a policy version fill at
// most max_waiting_version places of the queue; beyond, such a request
// gets 503 overloaded naming that bound, while requests that need no wait
// are still admitted.
func TestVersionWaitersBounded(t *testing.T) {
	w, c := setup(t, Config{Limits: Limits{MaxQueue: 8, MaxWaitingVersion: 2}})
	ctx := testCtx(t)
	if st, err := c.Status(ctx); err != nil || st.Limits.MaxWaitingVersion != 2 {
		t.Fatalf("status %+v, %v: want max_waiting_version 2", st, err)
	}
	var waiting []*Stream
	for range 2 {
		st, err := c.Generate(ctx, GenerateRequest{Prompt: prompt(6), N: 2, MaxTokens: 5, MinPolicyVersion: 2})
		if err != nil {
			t.Fatal(err)
		}
		waiting = append(waiting, st)
	}
	waitFor(t, func() bool { return w.svc.Status().WaitingVersion == 2 })
	start := time.Now()
	_, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(6), MaxTokens: 5, MinPolicyVersion: 2})
	var e *Error
	if !errors.Is(err, ErrOverloaded) || !errors.As(err, &e) || !strings.Contains(e.Msg, "max_waiting_version 2") {
		t.Fatalf("third waiter: %v, want 503 overloaded naming max_waiting_version", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("refused after %v", d)
	}
	for range 3 {
		if _, sum, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(6), N: 2, MaxTokens: 5}); err != nil || sum.Samples != 2 {
			t.Fatalf("a request that needs no wait, with the waiters at their bound: %+v, %v", sum, err)
		}
	}
	w.setVersion(t, 2)
	for _, st := range waiting {
		checkStream(t, ctx, st, 2)
	}
}

// TestVersionWaitersReached: with Config.CurrentVersion, a request whose
// version is already served does not count as waiting.
func TestVersionWaitersReached(t *testing.T) {
	var cur atomicVersion
	cur.set(3)
	w, c := setup(t, Config{CurrentVersion: cur.get, Limits: Limits{MaxQueue: 4, MaxWaitingVersion: 1}})
	ctx := testCtx(t)
	w.setVersion(t, 3)
	waiter, err := c.Generate(ctx, GenerateRequest{Prompt: prompt(6), MaxTokens: 5, MinPolicyVersion: 4})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return w.svc.Status().WaitingVersion == 1 })
	if _, _, err := c.GenerateAll(ctx, GenerateRequest{Prompt: prompt(6), MaxTokens: 5, MinPolicyVersion: 3}); err != nil {
		t.Errorf("a request for the served version, with the waiters at their bound: %v", err)
	}
	w.setVersion(t, 4)
	cur.set(4)
	checkStream(t, ctx, waiter, 1)
}
