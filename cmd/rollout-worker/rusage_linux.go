package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"time"
)

// rssWatch follows a running process's peak resident memory: VmHWM of
// /proc/PID/status, polled until Stop. (The exited process's rusage is
// no good for a child of a large process: Linux counts the parent's
// resident pages at the child's exec in the child's maxrss.)
type rssWatch struct {
	pid  int
	peak atomic.Int64
	stop chan struct{}
	done chan struct{}
}

// watchRSS starts following process pid.
func watchRSS(pid int) *rssWatch {
	w := &rssWatch{pid: pid, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			w.sample()
			select {
			case <-w.stop:
				return
			case <-t.C:
			}
		}
	}()
	return w
}

// sample reads VmHWM once; a process that has exited reads nothing.
func (w *rssWatch) sample() {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", w.pid))
	if err != nil {
		return
	}
	_, rest, ok := bytes.Cut(b, []byte("\nVmHWM:"))
	if !ok {
		return
	}
	line, _, _ := bytes.Cut(rest, []byte("\n"))
	kb, err := strconv.ParseInt(string(bytes.TrimSpace(bytes.TrimSuffix(bytes.TrimSpace(line), []byte("kB")))), 10, 64)
	if err == nil && kb<<10 > w.peak.Load() {
		w.peak.Store(kb << 10)
	}
}

// Stop ends the polling and returns the peak seen, in bytes (0: none).
// Call it before waiting for the process, while its status can be read.
func (w *rssWatch) Stop() int64 {
	w.sample()
	close(w.stop)
	<-w.done
	return w.peak.Load()
}

// processCPU returns the CPU time (user and system) process pid has used
// so far, from /proc/PID/stat; false for a process that cannot be read.
func processCPU(pid int) (time.Duration, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// The command name, in parentheses, may hold spaces: fields count from
	// the last ')'. utime and stime are fields 14 and 15, in clock ticks
	// (USER_HZ, 100 a second on Linux).
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 13 {
		return 0, false
	}
	u, err1 := strconv.ParseInt(string(f[11]), 10, 64)
	s, err2 := strconv.ParseInt(string(f[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(u+s) * 10 * time.Millisecond, true
}
