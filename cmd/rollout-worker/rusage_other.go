//go:build !linux

package main

import "os"

// peakRSS is an exited process's peak resident memory: not read on this
// system.
func peakRSS(*os.ProcessState) int64 { return 0 }
