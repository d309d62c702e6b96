package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// TestKernelsUsage: kernels wants the action warm; help shows its flags;
// --cache-dir off is refused before anything is compiled.
func TestKernelsUsage(t *testing.T) {
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"kernels"}, 2, "want the action warm"},
		{[]string{"kernels", "cool"}, 2, "want the action warm"},
		{[]string{"kernels", "warm", "--cache-dir", "off"}, 2, "warming needs a cache"},
		{[]string{"help", "kernels"}, 0, "-arch"},
	} {
		var out, errb bytes.Buffer
		if code := run(context.Background(), c.args, &out, &errb); code != c.code {
			t.Errorf("%v: exit %d, want %d (%s)", c.args, code, c.code, errb.String())
		}
		if got := out.String() + errb.String(); !strings.Contains(got, c.want) {
			t.Errorf("%v: output lacks %q:\n%s", c.args, c.want, got)
		}
	}
}
