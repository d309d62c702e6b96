package main

import (
	"strconv"
	"sync"
	"time"
)

// cpuGroups follows the CPU time of the processes of a transfer run, by
// role: the publisher of the version in hand, the NATS servers (processes
// of their own, or this process where they are embedded) and the worker.
type cpuGroups struct {
	mu      sync.Mutex
	pub     int   // 0 until the version's publish process starts
	servers []int // nil: servers not run by the bench (--nats-url), not counted
	worker  int
}

// cpuSnap is what each role had used at one moment.
type cpuSnap struct {
	at                   time.Time
	pub, servers, worker time.Duration
	ok, serversKnown     bool
}

func (g *cpuGroups) setPublisher(pid int) {
	g.mu.Lock()
	g.pub = pid
	g.mu.Unlock()
}

// snap reads every role's CPU time now; ok is false where any process
// could not be read (another system, or one that exited).
func (g *cpuGroups) snap() cpuSnap {
	g.mu.Lock()
	pub, servers, worker := g.pub, g.servers, g.worker
	g.mu.Unlock()
	s := cpuSnap{at: time.Now(), ok: pub > 0 && worker > 0, serversKnown: servers != nil}
	read := func(pid int) time.Duration {
		d, ok := processCPU(pid)
		s.ok = s.ok && ok
		return d
	}
	if s.ok {
		s.pub, s.worker = read(pub), read(worker)
		for _, pid := range servers {
			s.servers += read(pid)
		}
	}
	return s
}

// cores returns the cores each role kept busy on average from a to b, as
// "pub/servers/worker", or "-" where either snapshot is missing.
func cores(a, b cpuSnap) string {
	dt := b.at.Sub(a.at).Seconds()
	if !a.ok || !b.ok || dt <= 0 {
		return "-"
	}
	c := func(x, y time.Duration) string { return strconv.FormatFloat((y-x).Seconds()/dt, 'f', 1, 64) }
	srv := "-"
	if a.serversKnown {
		srv = c(a.servers, b.servers)
	}
	return c(a.pub, b.pub) + "/" + srv + "/" + c(a.worker, b.worker)
}
