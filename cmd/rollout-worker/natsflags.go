package main

import (
	"flag"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// natsFlags are the connection flags shared by serve, publish, generate and
// demo.
type natsFlags struct {
	url, creds, nkey, ca, cert, key string
}

// register registers --nats-url (empty: serve starts an embedded server)
// and the authentication and TLS flags.
func (n *natsFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&n.url, "nats-url", "", "NATS server URL; empty starts an embedded server (serve only)")
	n.registerAuth(fs)
}

// registerAuth registers the authentication and TLS flags, for a command
// with its own --nats-url.
func (n *natsFlags) registerAuth(fs *flag.FlagSet) {
	fs.StringVar(&n.creds, "nats-creds", "", "NATS credentials `file` (JWT and nkey)")
	fs.StringVar(&n.nkey, "nats-nkey", "", "NATS nkey seed `file`")
	fs.StringVar(&n.ca, "tls-ca", "", "CA certificate `file` to verify the NATS server")
	fs.StringVar(&n.cert, "tls-cert", "", "client certificate `file` (with --tls-key)")
	fs.StringVar(&n.key, "tls-key", "", "client key `file`")
}

func (n *natsFlags) options(name string) ([]nats.Option, error) {
	opts := []nats.Option{nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(250 * time.Millisecond)}
	if n.creds != "" {
		opts = append(opts, nats.UserCredentials(n.creds))
	}
	if n.nkey != "" {
		o, err := nats.NkeyOptionFromSeed(n.nkey)
		if err != nil {
			return nil, fmt.Errorf("--nats-nkey: %w", err)
		}
		opts = append(opts, o)
	}
	if n.ca != "" {
		opts = append(opts, nats.RootCAs(n.ca))
	}
	if (n.cert == "") != (n.key == "") {
		return nil, usageErrorf("--tls-cert and --tls-key go together")
	}
	if n.cert != "" {
		opts = append(opts, nats.ClientCert(n.cert, n.key))
	}
	return opts, nil
}

// urlCredentials matches the user information of a URL: scheme://userinfo@.
var urlCredentials = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://)([^/?#@\s,]*)@`)

// redactURL hides the credentials of every URL in s (a URL, a
// comma-separated list of them, or a message quoting them): user:password@
// becomes user:xxxxx@, and a token (user information without a colon)
// becomes xxxxx@.
func redactURL(s string) string {
	return urlCredentials.ReplaceAllStringFunc(s, func(m string) string {
		sub := urlCredentials.FindStringSubmatch(m)
		scheme, info := sub[1], sub[2]
		if user, _, ok := strings.Cut(info, ":"); ok {
			return scheme + user + ":xxxxx@"
		}
		return scheme + "xxxxx@"
	})
}

// splitList splits a comma-separated list, trimming spaces; empty items are
// dropped (so "" is no item).
func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
