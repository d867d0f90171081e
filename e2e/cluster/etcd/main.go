// Command etcd runs a single-member etcd (go.etcd.io/etcd/server/v3/embed) for e2e tests,
// `etcd compact` compacts it so tests can force a watch to fail with 410 Gone, and `etcd put`
// writes a key straight into the store so tests can plant objects the API would refuse.
//
//	etcd --data-dir DIR --listen-client-urls URL [--advertise-client-urls URL] --listen-peer-urls URL
//	etcd compact --endpoint URL
//	etcd put --endpoint URL KEY < VALUE
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

func main() {
	var err error
	if len(os.Args) > 1 && os.Args[1] == "compact" {
		err = compact(os.Args[2:])
	} else if len(os.Args) > 1 && os.Args[1] == "put" {
		err = put(os.Args[2:])
	} else {
		err = serve(os.Args[1:])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "etcd:", err)
		os.Exit(1)
	}
}

func serve(args []string) error {
	fs := flag.NewFlagSet("etcd", flag.ExitOnError)
	dataDir := fs.String("data-dir", "", "data directory (required)")
	// Loopback versions of etcd's defaults; tests pass their own free ports.
	listenClient := fs.String("listen-client-urls", "http://127.0.0.1:2379", "client URL to listen on")
	advertiseClient := fs.String("advertise-client-urls", "", "client URL to advertise (default: --listen-client-urls)")
	listenPeer := fs.String("listen-peer-urls", "http://127.0.0.1:2380", "peer URL to listen on (also advertised)")
	fs.Parse(args)
	if *dataDir == "" {
		return errors.New("--data-dir is required")
	}
	if *advertiseClient == "" {
		*advertiseClient = *listenClient
	}

	cfg := embed.NewConfig()
	cfg.Name = "e2e"
	cfg.Dir = *dataDir
	cfg.LogLevel = "warn" // etcd logs every request at info; keep test output readable
	var err error
	if cfg.ListenClientUrls, err = parseURL(*listenClient); err != nil {
		return err
	}
	if cfg.AdvertiseClientUrls, err = parseURL(*advertiseClient); err != nil {
		return err
	}
	if cfg.ListenPeerUrls, err = parseURL(*listenPeer); err != nil {
		return err
	}
	// A single member: advertise the peer URL we listen on and name only ourselves in the
	// initial cluster, or etcd refuses to start because the two disagree.
	cfg.AdvertisePeerUrls = cfg.ListenPeerUrls
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return err
	}
	defer e.Close()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	select {
	case <-e.Server.ReadyNotify():
		fmt.Println("etcd ready")
	case <-time.After(60 * time.Second):
		return errors.New("not ready after 60s")
	case <-ctx.Done():
		return nil
	}
	select {
	case err := <-e.Err():
		return err
	case <-ctx.Done():
		return nil // deferred e.Close() stops the server and closes the data dir cleanly
	}
}

// dial parses `--endpoint` and connects a client to it.
func dial(name string, args []string) (*clientv3.Client, *flag.FlagSet, error) {
	fs := flag.NewFlagSet(name, flag.ExitOnError)
	endpoint := fs.String("endpoint", "http://127.0.0.1:2379", "client URL of the etcd")
	fs.Parse(args)
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{*endpoint},
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	return cli, fs, err
}

// put writes stdin as the value of one key and prints the new revision.
func put(args []string) error {
	cli, fs, err := dial("etcd put", args)
	if err != nil {
		return err
	}
	defer cli.Close()
	if fs.NArg() != 1 {
		return errors.New("usage: etcd put --endpoint URL KEY < VALUE")
	}
	value, err := io.ReadAll(os.Stdin)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := cli.Put(ctx, fs.Arg(0), string(value))
	if err != nil {
		return err
	}
	fmt.Println(resp.Header.Revision)
	return nil
}

// compact compacts the store up to its current revision, physically, and prints the revision.
func compact(args []string) error {
	cli, _, err := dial("etcd compact", args)
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Any read returns the store's current revision in its header.
	resp, err := cli.Get(ctx, "compact-probe", clientv3.WithCountOnly())
	if err != nil {
		return err
	}
	rev := resp.Header.Revision
	_, err = cli.Compact(ctx, rev, clientv3.WithCompactPhysical())
	// Compacting again with no writes in between is not an error for our purpose.
	if err != nil && !errors.Is(err, rpctypes.ErrCompacted) {
		return err
	}
	fmt.Println(rev)
	return nil
}

func parseURL(s string) ([]url.URL, error) {
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("bad URL %q: %w", s, err)
	}
	return []url.URL{*u}, nil
}
