// Package rollout serves a policy.Engine to RL drivers over NATS, and is
// the Go client of that service.
//
// The service is the NATS micro service "rollout-worker" with four
// endpoints per model; the first three in one queue group (default
// "rollout") so that every worker of the model shares the load, cancel
// outside it so that every worker sees each cancel:
//
//	rollout.<model>.generate  one prompt, n samples: a message per sample as it finishes, then a summary
//	rollout.<model>.score     teacher-forced logprobs of whole sequences
//	rollout.<model>.status    the worker's version, queue and KV cache use
//	rollout.<model>.cancel    abort a generate request, named by its id and its reply subject
//
// Discovery and per-endpoint statistics come from micro's control subjects
// ($SRV.PING, $SRV.INFO, $SRV.STATS). The wire format, versioned
// "rollout.v1", is in SCHEMA.md. Token in, token out: no tokenizer.
//
// # Admission
//
// A request is validated first (every refusal is a 400 naming the field),
// then admitted: at most Limits.MaxQueue generate and score requests are
// admitted and unfinished at once; beyond that the reply is 503
// "overloaded" at once, never a silent drop. The engine has its own wait
// for KV pages behind that bound. A request with min_policy_version waits,
// admitted, until the worker serves that version (bounded by
// Config.MaxWaitVersion and the request's max_wait_ms), else it gets a 503
// "policy version N not reached"; at most Limits.MaxWaitingVersion wait at
// once (503 "overloaded" beyond), so that waiters cannot fill the queue.
//
// # Cancel and gone clients
//
// A generate request is aborted early when its client cancels it or when
// nothing subscribes to its reply subject any more for Config.ClientGone
// (cancel.go says how the service learns that from NATS). Its unfinished
// samples end with "abort" and its summary says why, as in a drain.
//
// # Goroutines and ownership
//
// The caller owns the *nats.Conn (the service never closes it), the
// engine and the goroutine running Engine.Run. The service owns:
//
//   - the micro service, whose handlers run on nats.go's subscription
//     goroutines (one per endpoint). Handlers only decode, validate, admit
//     and start a job; status and cancel answer inline.
//   - the subscription to the no-responders statuses of its stream
//     messages (the gone-client check), whose handler runs on its nats.go
//     goroutine and only cancels a job's context; shutdown unsubscribes it.
//   - one goroutine per admitted request (a job), tracked in a WaitGroup.
//     A generate job submits to the engine (the handler already did when
//     there is no version to wait for), forwards each sample as the engine
//     delivers it, sends heartbeats while quiet, and sends the summary
//     last; a score job calls Engine.Score and replies. Only the job
//     publishes on its reply subject, so its messages keep their order.
//
// Each job has a context, a child of the service's abort context, that a
// cancel or the gone-client check ends with its cause; the job's goroutine
// watches it and aborts its engine handle or its version wait.
//
// Drain(ctx) stops admitting (new requests get 503 "draining"), waits for
// the jobs until ctx ends, then aborts the rest through Handle.Abort: the
// engine returns their unfinished samples with finish_reason "abort", and
// the jobs forward them and their summaries. If the engine does not return
// them within Config.AbortGrace (its loop is stuck), Drain sends the
// missing samples as aborted and the summaries itself, and marks those
// streams ended so nothing the engine delivers later goes out twice; those
// jobs' goroutines end when the engine closes their handles (Engine.Run
// returning does). Then Drain flushes the connection, stops the micro
// service and ends the gone-client subscription. Stop is Drain with an
// expired deadline; both are idempotent and safe to call concurrently.
// Either way every admitted request gets exactly one end: its summary, or
// a single error reply.
//
// A serve command drains first, then stops the engine, then closes the
// connection: Drain(ctx with the shutdown deadline), cancel Engine.Run's
// context, nc.Drain.
//
// # Policy version
//
// Engine.Version is safe only on the engine's loop goroutine. The service
// reads the version through Config.CurrentVersion when set (wire
// refit.Receiver.CurrentVersion: it changes inside the same AtBoundary
// commit as Engine.SetVersion, so it never runs ahead of the engine), and
// otherwise inside Engine.AtBoundary, which costs one step boundary per
// read. The cleaner home would be a policy.Engine.CurrentVersion backed by
// an atomic written by SetVersion; Config.CurrentVersion is the seam until
// then.
package rollout
