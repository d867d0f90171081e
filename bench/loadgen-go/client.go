package main

// One simulated xDS client, as loadgen.Client and loadgen.Worker's streams are: its own
// connection, SotW (proxyless or Envoy-like) or delta, reconnecting with backoff from nothing.

import (
	"bytes"
	"context"
	"io"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Spec is loadgen.ClientSpec, as JSON.
type Spec struct {
	Index            int      `json:"index"`
	Kind             string   `json:"kind"`              // "proxyless" | "envoy" | "delta" | "ztunnel"
	Listeners        []string `json:"listeners"`         // proxyless: the listener names it watches
	ExpectedClusters int      `json:"expected_clusters"` // ztunnel: Addresses
	Node             string   `json:"node"`              // ztunnel: its node's name
	ReportHeld       bool     `json:"report_held"`       // its summary names what it holds, by type
}

// codeNames are the status codes as Python's grpc.StatusCode names them (the summaries of both
// generators are read by the same code): grpc-go's String() spells them otherwise.
var codeNames = [...]string{"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
	"NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
	"ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"}

type Client struct {
	Spec
	node *corev3.Node

	mu            sync.Mutex          // the client's goroutine against the end-of-run readers
	names         map[string]set      // subscribed names per type (present and empty: wildcard)
	requested     map[string][]string // names, sorted: SotW requests carry them, ACKs included
	versions      map[string][2]string
	resources     map[string]map[string]*held
	answered      set // the types answered on this stream
	sentNode      bool
	configuredAt  *float64
	seen          map[int]float64 // mark -> first time held
	streamsFailed map[string]int
	// Envoy-like: the clusters its route configurations name, and marks held of clusters none names yet.
	routed   set
	unrouted map[int]string // mark -> its cluster
}

func (c *Client) envoyLike() bool { return c.Kind == "envoy" || c.Kind == "delta" }

func newClient(spec Spec) *Client {
	c := &Client{Spec: spec, node: node(spec), seen: map[int]float64{}, streamsFailed: map[string]int{}}
	c.reset()
	return c
}

// reset: a new stream starts from nothing, as a restarted client does.
func (c *Client) reset() {
	c.names, c.requested, c.versions = map[string]set{}, map[string][]string{}, map[string][2]string{}
	c.resources, c.answered, c.sentNode = map[string]map[string]*held{}, set{}, false
	c.routed, c.unrouted = set{}, map[int]string{}
}

func (c *Client) held(typeURL string) map[string]*held {
	if c.resources[typeURL] == nil {
		c.resources[typeURL] = map[string]*held{}
	}
	return c.resources[typeURL]
}

// subscribe asks for exactly `names` of typeURL from now on and forgets what is no longer asked
// for (see loadgen.Client.subscribe); returns (added, removed).
func (c *Client) subscribe(typeURL string, names set) (set, set) {
	old := c.names[typeURL]
	c.names[typeURL], c.requested[typeURL] = names, names.sorted()
	removed := old.minus(names)
	for name := range removed {
		delete(c.resources[typeURL], name)
	}
	return names.minus(old), removed
}

// settled: every type asked for on this stream was answered, with every name asked for.
func (c *Client) settled() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for typeURL, names := range c.names {
		if _, ok := c.answered[typeURL]; !ok {
			return false
		}
		for name := range names {
			if _, ok := c.resources[typeURL][name]; !ok {
				return false
			}
		}
	}
	return true
}

func (c *Client) first(node **corev3.Node) {
	if !c.sentNode { // only the first request of a stream carries the node
		*node, c.sentNode = c.node, true
	}
}

func (w *Worker) runClient(ctx context.Context, c *Client) {
	delay := 0.1
	for ctx.Err() == nil {
		err := w.stream(ctx, c)
		if ctx.Err() != nil {
			return
		}
		c.mu.Lock()
		if err != nil && err != io.EOF { // EOF: the server ended the stream with OK
			s := status.Convert(err)
			name := codeNames[codeIndex(int(s.Code()))]
			c.streamsFailed[name]++
			w.failed(name, s.Message())
		}
		c.reset()
		c.mu.Unlock()
		sleep := time.Duration(delay * (0.5 + rand.Float64()) * float64(time.Second)) // jittered backoff
		select {
		case <-ctx.Done():
			return
		case <-time.After(sleep):
		}
		delay = math.Min(delay*2, 5)
	}
}

func codeIndex(code int) int {
	if code < 0 || code >= len(codeNames) {
		return 2 // UNKNOWN
	}
	return code
}

// stream runs one stream on a connection of its own, as separate proxies have.
func (w *Worker) stream(ctx context.Context, c *Client) error {
	addr, creds := w.addr, insecure.NewCredentials()
	if w.secure != nil && (c.Kind == "ztunnel" || w.secure.AllClients) { // the secure port with a workload certificate, as a real proxy connects
		var err error
		if addr, creds, err = w.secure.credentials(c.Index, w); err != nil {
			return err
		}
	}
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(creds),
		// Envoy has no cap on a response's size; grpc's default (4 MB) would be one at large meshes.
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32)))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ads := discoveryv3.NewAggregatedDiscoveryServiceClient(conn)
	if c.Kind == "delta" || c.Kind == "ztunnel" {
		return w.deltaStream(ctx, c, ads)
	}
	return w.sotwStream(ctx, c, ads)
}

// Send errors are left to Recv, which returns the stream's status.

func (w *Worker) sotwStream(ctx context.Context, c *Client, ads discoveryv3.AggregatedDiscoveryServiceClient) error {
	stream, err := ads.StreamAggregatedResources(ctx)
	if err != nil {
		return err
	}
	send := func(typeURL string) {
		version := c.versions[typeURL]
		request := &discoveryv3.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: c.requested[typeURL],
			VersionInfo: version[0], ResponseNonce: version[1]}
		c.first(&request.Node)
		_ = stream.Send(request)
	}
	c.mu.Lock()
	if c.Kind == "proxyless" {
		c.subscribe(LDS, toSet(c.Listeners))
		send(LDS)
	} else {
		for _, typeURL := range []string{CDS, LDS} {
			c.subscribe(typeURL, set{})
			send(typeURL)
		}
	}
	c.mu.Unlock()
	return receive(w, c, stream.Recv, func(response *discoveryv3.DiscoveryResponse, typeURL string, now float64) error {
		previous, have := c.held(typeURL), c.held(typeURL)
		if typeURL == LDS || typeURL == CDS { // the whole state; EDS and RDS may carry only what changed
			have = map[string]*held{}
			c.resources[typeURL] = have
		}
		for _, packed := range response.GetResources() {
			name, err := leadingName(packed.GetValue())
			if err != nil {
				return err
			}
			have[name] = w.hold(c, typeURL, name, packed.GetValue(), previous[name], now)
		}
		c.versions[typeURL] = [2]string{response.GetVersionInfo(), response.GetNonce()}
		send(typeURL) // the ACK
		if next, names, ok := w.follow(c, typeURL, now); ok {
			if old, asked := c.names[next]; !asked || !names.equal(old) {
				c.subscribe(next, names)
				send(next)
			}
		}
		return nil
	})
}

func (w *Worker) deltaStream(ctx context.Context, c *Client, ads discoveryv3.AggregatedDiscoveryServiceClient) error {
	stream, err := ads.DeltaAggregatedResources(ctx)
	if err != nil {
		return err
	}
	send := func(typeURL string, subscribe, unsubscribe set, nonce string) {
		request := &discoveryv3.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: subscribe.sorted(),
			ResourceNamesUnsubscribe: unsubscribe.sorted(), ResponseNonce: nonce}
		c.first(&request.Node)
		_ = stream.Send(request)
	}
	c.mu.Lock()
	wildcard := []string{CDS, LDS}
	if c.Kind == "ztunnel" {
		wildcard = []string{ADDRESS, AUTHORIZATION} // in ztunnel's order
	}
	for _, typeURL := range wildcard { // wildcard: an empty subscribe list
		c.subscribe(typeURL, set{})
		send(typeURL, nil, nil, "")
	}
	c.mu.Unlock()
	return receive(w, c, stream.Recv, func(response *discoveryv3.DeltaDiscoveryResponse, typeURL string, now float64) error {
		have := c.held(typeURL)
		for _, name := range response.GetRemovedResources() {
			delete(have, name)
		}
		for _, resource := range response.GetResources() {
			have[resource.GetName()] = w.hold(c, typeURL, resource.GetName(), resource.GetResource().GetValue(), have[resource.GetName()], now)
		}
		send(typeURL, nil, nil, response.GetNonce()) // the ACK
		if next, names, ok := w.follow(c, typeURL, now); ok {
			if added, removed := c.subscribe(next, names); len(added)+len(removed) > 0 {
				send(next, added, removed, "")
			}
		}
		return nil
	})
}

// receive handles a stream's responses, counted and under the client's lock, until the stream ends.
func receive[R interface {
	proto.Message
	GetTypeUrl() string
}](w *Worker, c *Client, recv func() (R, error), handle func(response R, typeURL string, now float64) error) error {
	for {
		response, err := recv()
		if err != nil {
			return err
		}
		now := wallClock()
		w.count(proto.Size(response), now)
		c.mu.Lock()
		typeURL := response.GetTypeUrl()
		c.answered[typeURL] = struct{}{}
		err = handle(response, typeURL, now)
		c.mu.Unlock()
		if err != nil {
			return err
		}
	}
}

// hold: a resource the client now holds, derived once per content; marks held are recorded (heldMarks).
func (w *Worker) hold(c *Client, typeURL, name string, value []byte, previous *held, now float64) *held {
	if previous != nil && bytes.Equal(previous.value, value) {
		return previous
	}
	found := []int(nil)
	switch typeURL {
	case EDS:
		found = marks(value)
	case ADDRESS:
		found = workloadMarks(value)
	case AUTHORIZATION:
	default:
		return &held{value: value, derived: derive(typeURL, value)}
	}
	w.heldMarks(c, name, found, now)
	return &held{value: value}
}

// heldMarks: marks now held in cluster's assignment are seen, or for an Envoy-like client seen once a
// route configuration it holds names the cluster (loadgen.Client.held_marks).
func (w *Worker) heldMarks(c *Client, cluster string, marks []int, now float64) {
	for _, mark := range marks {
		if _, routed := c.routed[cluster]; c.envoyLike() && !routed {
			if _, ok := c.unrouted[mark]; !ok {
				c.unrouted[mark] = cluster
			}
			continue
		}
		w.see(c, mark, now)
	}
}

func (w *Worker) see(c *Client, mark int, now float64) {
	if _, ok := c.seen[mark]; !ok {
		c.seen[mark] = now
		w.saw(mark)
	}
}

// routeTo: the route configurations an Envoy-like client holds now name clusters.
func (w *Worker) routeTo(c *Client, clusters set, now float64) {
	c.routed = clusters
	for mark, cluster := range c.unrouted {
		if _, ok := clusters[cluster]; ok {
			w.see(c, mark, now)
			delete(c.unrouted, mark)
		}
	}
}

// configured: everything it asked for on the way to its endpoints held (loadgen.Client.configured).
func (c *Client) configured() bool {
	if c.Kind == "ztunnel" {
		_, addresses := c.answered[ADDRESS]
		_, policies := c.answered[AUTHORIZATION]
		return addresses && policies && len(c.resources[ADDRESS]) >= c.ExpectedClusters
	}
	held := func(typeURL string) bool {
		if _, ok := c.answered[typeURL]; !ok {
			return false
		}
		for name := range c.names[typeURL] {
			if _, ok := c.resources[typeURL][name]; !ok {
				return false
			}
		}
		return true
	}
	return held(EDS) && len(c.resources[EDS]) >= c.ExpectedClusters && (!c.envoyLike() || held(RDS))
}

// follow: the subscription that follows from what the client now holds of typeURL, if any.
func (w *Worker) follow(c *Client, typeURL string, now float64) (string, set, bool) {
	derived := func() set {
		names := set{}
		for _, h := range c.resources[typeURL] {
			for name := range h.derived {
				names[name] = struct{}{}
			}
		}
		return names
	}
	if next, ok := follows[typeURL]; ok && (typeURL != RDS || c.Kind == "proxyless") {
		return next, derived(), true
	}
	if typeURL == RDS { // Envoy-like: it asked for every cluster already
		w.routeTo(c, derived(), now)
	}
	if c.configuredAt == nil && c.configured() {
		c.configuredAt = &now
		w.configured(now)
	}
	return "", nil, false
}

func toSet(names []string) set {
	s := set{}
	for _, name := range names {
		s[name] = struct{}{}
	}
	return s
}
