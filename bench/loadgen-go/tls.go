package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/credentials"
)

// Secure is loadgen.Secure: how clients reach istiod's secure port with a workload certificate, as
// real ztunnels and sidecars do: ztunnel clients always, every client with AllClients.
type Secure struct {
	Addr       string `json:"addr"`
	Root       string `json:"root"` // PEM files; "{index}" in Cert stands for the client's index
	Cert       string `json:"cert"`
	Key        string `json:"key"`
	AllClients bool   `json:"all_clients"`
}

func (s *Secure) credentials(index int, w *Worker) (string, credentials.TransportCredentials, error) {
	root, err := os.ReadFile(s.Root)
	if err != nil {
		return "", nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(root) {
		return "", nil, fmt.Errorf("no root certificate in %s", s.Root)
	}
	pair, err := tls.LoadX509KeyPair(strings.ReplaceAll(s.Cert, "{index}", strconv.Itoa(index)), s.Key)
	if err != nil {
		return "", nil, err
	}
	creds := credentials.NewTLS(&tls.Config{RootCAs: pool, Certificates: []tls.Certificate{pair}})
	return s.Addr, timedHandshakes{creds, w}, nil
}

// timedHandshakes counts how long each TLS handshake takes, from the first byte sent to the last read.
type timedHandshakes struct {
	credentials.TransportCredentials
	w *Worker
}

func (t timedHandshakes) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	start := time.Now()
	secured, info, err := t.TransportCredentials.ClientHandshake(ctx, authority, conn)
	if err == nil {
		t.w.mu.Lock()
		t.w.handshakes = append(t.w.handshakes, time.Since(start).Seconds())
		t.w.mu.Unlock()
	}
	return secured, info, err
}

func (t timedHandshakes) Clone() credentials.TransportCredentials {
	return timedHandshakes{t.TransportCredentials.Clone(), t.w}
}
