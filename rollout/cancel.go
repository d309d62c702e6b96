package rollout

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"go.uber.org/zap"
)

// A generate request ends early when its client says so (the cancel
// subject) or when its client is gone (nothing subscribes to its reply
// subject any more). Either way the job's context is cancelled with
// errCancelled or errClientGone, and the job aborts the request in the
// engine (Handle.Abort) or ends its version wait: the unfinished samples
// go out with finish_reason "abort", then the summary, as in a drain.
//
// # Gone clients
//
// NATS tells a publisher whether a message reached anyone, when asked: a
// message published with a reply subject that matches no subscription is
// answered on that reply subject with a no-responders status (an empty
// message with the header "Status: 503"). The server sends it when the
// publisher's connection has headers and no_responders on (nats.go's
// default) and the publisher itself subscribes to the reply subject. So
// every message of a stream goes out with the reply subject
// <probes>.<job key>.<seq>, where <probes> is an inbox the service
// subscribes to with a wildcard, and a quiet stream gets a heartbeat at
// least every ClientGone/probesPerGone, so there is always a message to
// probe with. Clients ignore that reply subject.
//
// A status for message seq says that seq reached nobody. The server
// answers in publish order, so statuses for consecutive seqs say that no
// message in between reached the client; once such a run has lasted
// ClientGone, the request is aborted. One delivered message breaks the
// run: a client that reconnects (to this or another server of the
// cluster, which then learns its subscriptions again) within ClientGone
// keeps its request. Where the server cannot tell, it counts the message
// as delivered (a reply subject behind a gateway or an account import):
// no false abort, only no detection, and the cancel subject covers it.
//
// Other mechanisms were weaker: asking the server for the interest in a
// subject ($SYS.REQ.SERVER.PING.SUBSZ) needs the system account, which a
// worker's credentials should not have; a heartbeat from the client needs
// every client, in every language, to send one.

// probesPerGone is how many probes a quiet stream gets per ClientGone.
const probesPerGone = 3

// startProbes subscribes to the reply subjects of the service's stream
// messages, where the server sends its no-responders statuses.
func (s *Service) startProbes() error {
	s.probes = s.nc.NewInbox()
	sub, err := s.nc.Subscribe(s.probes+".>", s.handleNoResponders)
	if err != nil {
		s.probes = ""
		return fmt.Errorf("rollout: service: subscribe to the gone-client probes: %w", err)
	}
	s.probeSub = sub
	return nil
}

// stopProbes ends the probe subscription; it is idempotent.
func (s *Service) stopProbes() error {
	sub := s.probeSub
	s.probeSub = nil
	if sub == nil {
		return nil
	}
	if err := sub.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) && !errors.Is(err, nats.ErrBadSubscription) {
		return fmt.Errorf("rollout: stop: gone-client probes: %w", err)
	}
	return nil
}

// probeSubject is the reply subject of message seq of the job with key.
func (s *Service) probeSubject(key, seq uint64) string {
	b := make([]byte, 0, len(s.probes)+42)
	b = append(b, s.probes...)
	b = append(b, '.')
	b = strconv.AppendUint(b, key, 10)
	b = append(b, '.')
	b = strconv.AppendUint(b, seq, 10)
	return string(b)
}

// handleNoResponders runs on the probe subscription's goroutine: a
// no-responders status for one of a job's messages.
func (s *Service) handleNoResponders(m *nats.Msg) {
	if len(m.Data) != 0 || m.Header.Get("Status") != "503" {
		return
	}
	rest, _ := strings.CutPrefix(m.Subject, s.probes+".")
	keyText, seqText, _ := strings.Cut(rest, ".")
	key, err1 := strconv.ParseUint(keyText, 10, 64)
	seq, err2 := strconv.ParseUint(seqText, 10, 64)
	if err1 != nil || err2 != nil {
		return
	}
	s.mu.Lock()
	j := s.byKey[key]
	s.mu.Unlock()
	if j == nil || !j.unheard(seq, time.Now()) {
		return
	}
	if j.ctx.Err() == nil {
		s.log.Info("client gone: aborting its request", zap.String("id", j.id), zap.String("reply", j.reply),
			zap.Duration("unheard_for", s.cfg.ClientGone))
	}
	j.cancel(errClientGone)
}

// unheard records that message seq reached no subscriber, and reports
// whether none has reached one for ClientGone.
func (j *job) unheard(seq uint64, now time.Time) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.quietFrom.IsZero() || seq != j.quietSeq+1 {
		j.quietFrom = now // a message in between was delivered: a new run
	}
	j.quietSeq = seq
	return now.Sub(j.quietFrom) >= j.s.cfg.ClientGone
}

// replyMatches reports whether the reply subject a job got is the inbox a
// cancel names: the same subject, or that subject behind a gateway's reply
// prefix.
func replyMatches(reply, inbox string) bool {
	if reply == inbox {
		return true
	}
	return strings.HasPrefix(reply, "_GR_.") && strings.HasSuffix(reply, "."+inbox)
}

// handleCancel runs on the cancel subscription's goroutine, on every
// worker of the model: the one holding the generate request with the id
// and the inbox the cancel names aborts it and, when the cancel has a
// reply subject, confirms. The others say nothing, so a cancel sent as a
// request gets the confirmation or a timeout, never a wrong "not found".
func (s *Service) handleCancel(req micro.Request) {
	id, inbox, e := parseCancel(req.Data())
	if e != nil {
		if req.Reply() != "" {
			s.replyError(req, e)
		} else {
			s.met.requests.WithLabelValues("cancel", e.Reason).Inc()
		}
		return
	}
	var found []*job
	s.mu.Lock()
	for j := range s.jobs {
		if j.op == "generate" && j.id == id && replyMatches(j.reply, inbox) {
			found = append(found, j)
		}
	}
	s.mu.Unlock()
	if len(found) == 0 {
		s.met.requests.WithLabelValues("cancel", resultNotFound).Inc()
		return
	}
	for _, j := range found {
		j.cancel(errCancelled)
	}
	s.met.requests.WithLabelValues("cancel", resultOK).Inc()
	s.log.Debug("request cancelled", zap.String("id", id))
	if req.Reply() == "" {
		return
	}
	if err := req.RespondJSON(CancelReply{Type: TypeCancelled, ID: id, Worker: s.cfg.Worker}); err != nil {
		s.log.Warn("cancel reply failed", zap.String("id", id), zap.Error(err))
	}
}
