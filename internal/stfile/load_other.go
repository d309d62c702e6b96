//go:build !linux && !darwin

package stfile

import "io"

// load reads the whole file at path into memory (no mmap on this system).
func load(path string) ([]byte, func() error, error) {
	fd, size, err := openRegular(path)
	if err != nil {
		return nil, nil, err
	}
	defer fd.Close()
	buf := make([]byte, size)
	if _, err := io.ReadFull(fd, buf); err != nil {
		return nil, nil, err
	}
	return buf, func() error { return nil }, nil
}
