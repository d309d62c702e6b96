//go:build linux || darwin

package stfile

import (
	"syscall"
)

// load maps the file at path read-only. An empty file is not mapped (mmap
// rejects length 0); it parses as a too-short header.
func load(path string) ([]byte, func() error, error) {
	fd, size, err := openRegular(path)
	if err != nil {
		return nil, nil, err
	}
	defer fd.Close() // the mapping outlives the descriptor
	if size == 0 {
		return []byte{}, func() error { return nil }, nil
	}
	buf, err := syscall.Mmap(int(fd.Fd()), 0, size, syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, nil, err
	}
	return buf, func() error { return syscall.Munmap(buf) }, nil
}
