//go:build !linux

package main

import "time"

// rssWatch reads no resident memory on this system.
type rssWatch struct{}

func watchRSS(int) *rssWatch { return &rssWatch{} }

// Stop returns 0: unknown.
func (*rssWatch) Stop() int64 { return 0 }

// processCPU reads no CPU time on this system.
func processCPU(int) (time.Duration, bool) { return 0, false }
