package natsembed

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine they started is still
// running once they are done.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
