package cuda

import "syscall"

// gettid identifies the calling OS thread, so that Ctx can refuse calls from
// any thread but the owner's.
func gettid() int { return syscall.Gettid() }
