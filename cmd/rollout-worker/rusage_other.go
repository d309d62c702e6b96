//go:build !linux

package main

// rssWatch reads no resident memory on this system.
type rssWatch struct{}

func watchRSS(int) *rssWatch { return &rssWatch{} }

// Stop returns 0: unknown.
func (*rssWatch) Stop() int64 { return 0 }
