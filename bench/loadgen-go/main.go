// The load benchmark's compiled generator: one process, thousands of simulated xDS clients (a
// goroutine and a connection each), the same clients as bench/loadgen.py's Worker, at a fraction
// of its CPU so that the benchmark measures the server, not the generator.
//
// Protocol with bench/load.py, one JSON document a line:
//
//	stdin:  {"xds_addr": ..., "settle_seconds": ..., "ticks": ..., "clients": [ClientSpec...]}
//	        then "go" (start the clients) and "stop" (settle, report, exit); end of input: exit
//	stdout: ["ready", null], ["configured", t], ["all-seen", mark], ["summary", {...}] as the
//	        (kind, value) tuples loadgen.serve puts on its control queue
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

type config struct {
	XdsAddr       string  `json:"xds_addr"`
	SettleSeconds float64 `json:"settle_seconds"`
	Ticks         float64 `json:"ticks"`
	Clients       []Spec  `json:"clients"`
	Secure        *Secure `json:"secure"` // ztunnel clients (all with AllClients): istiod's secure port and their certificate; none: the plaintext port (Istio's istiod's)
}

type Worker struct {
	addr    string
	secure  *Secure
	ticks   float64
	clients []*Client

	mu             sync.Mutex
	traffic        map[int64]*[2]int64 // tick -> [bytes, responses] received
	failureDetails map[string]string   // status -> the first failed stream's message
	seenBy         map[int]int         // mark -> how many clients hold it
	configuredN    int
	lastConfigured float64
	handshakes     []float64 // seconds each TLS handshake took

	out sync.Mutex
}

func node(spec Spec) *corev3.Node {
	ip := fmt.Sprintf("10.250.%d.%d", spec.Index>>8&255, spec.Index&255)
	if spec.Kind == "ztunnel" { // as ztunnel's xds client builds it (src/xds/client.rs), CLUSTER_ID from its chart
		metadata, _ := structpb.NewStruct(map[string]any{"NAME": fmt.Sprintf("ztunnel-%d", spec.Index),
			"NAMESPACE": "istio-system", "INSTANCE_IPS": ip, "NODE_NAME": spec.Node, "CLUSTER_ID": "Kubernetes"})
		return &corev3.Node{Id: fmt.Sprintf("ztunnel~%s~ztunnel-%d.istio-system~istio-system.svc.cluster.local",
			ip, spec.Index), Metadata: metadata}
	}
	fields := map[string]any{"NAMESPACE": "bench"}
	if spec.Kind == "proxyless" {
		fields["GENERATOR"] = "grpc"
	} else { // a sidecar's pod labels, as istio-agent reports them: its own pod's
		fields["LABELS"] = map[string]any{"app": fmt.Sprintf("client%d", spec.Index)}
	}
	metadata, _ := structpb.NewStruct(fields)
	return &corev3.Node{Id: fmt.Sprintf("sidecar~%s~client%d.bench~bench.svc.cluster.local", ip, spec.Index),
		Metadata: metadata}
}

func wallClock() float64 { return float64(time.Now().UnixNano()) / 1e9 }

// emit writes one (kind, value) line to the coordinator.
func (w *Worker) emit(kind string, value any) {
	line, err := json.Marshal([]any{kind, value})
	if err != nil {
		panic(err)
	}
	w.out.Lock()
	defer w.out.Unlock()
	os.Stdout.Write(append(line, '\n'))
}

func (w *Worker) count(size int, now float64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	tick := int64(now * w.ticks)
	if w.traffic[tick] == nil {
		w.traffic[tick] = &[2]int64{}
	}
	w.traffic[tick][0] += int64(size)
	w.traffic[tick][1]++
}

func (w *Worker) failed(code, message string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.failureDetails[code]; !ok {
		w.failureDetails[code] = message
	}
}

// saw: a client holds `mark` for the first time; once all of them do, the coordinator is told.
func (w *Worker) saw(mark int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seenBy[mark]++
	if w.seenBy[mark] == len(w.clients) {
		w.emit("all-seen", mark)
	}
}

// configured: a client is configured for the first time; once all are, the coordinator is told when.
func (w *Worker) configured(now float64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.configuredN++
	w.lastConfigured = max(w.lastConfigured, now)
	if w.configuredN == len(w.clients) {
		w.emit("configured", w.lastConfigured)
	}
}

type clientSummary struct {
	Index         int                 `json:"index"`
	Kind          string              `json:"kind"`
	ConfiguredAt  *float64            `json:"configured_at"`
	Seen          map[int]float64     `json:"seen"`
	StreamsFailed map[string]int      `json:"streams_failed"`
	State         string              `json:"state"`
	Settled       bool                `json:"settled"`
	Held          map[string][]string `json:"held"` // names by type, when its spec asks
}

// summary is loadgen.Worker.summary's, key for key; called once every client's goroutine is done.
func (w *Worker) summary() map[string]any {
	clients := make([]clientSummary, len(w.clients))
	for i, c := range w.clients {
		clients[i] = clientSummary{c.Index, c.Kind, c.configuredAt, c.seen, c.streamsFailed, digest(c.resources), c.settled(), nil}
		if c.ReportHeld {
			clients[i].Held = map[string][]string{}
			for typeURL, resources := range c.resources {
				names := set{}
				for name := range resources {
					names[name] = struct{}{}
				}
				clients[i].Held[typeURL] = names.sorted()
			}
		}
	}
	var usage syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &usage)
	cpu := time.Duration(usage.Utime.Nano() + usage.Stime.Nano()).Seconds() // the generator's own CPU
	return map[string]any{"clients": clients, "traffic": w.traffic, "failure_details": w.failureDetails, "cpu_s": cpu,
		"handshakes": w.handshakes}
}

func main() {
	in := bufio.NewReader(os.Stdin)
	line, err := in.ReadBytes('\n')
	var cfg config
	if err == nil {
		err = json.Unmarshal(line, &cfg)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "loadgen: the first line of input must be the run's JSON: %v\n", err)
		os.Exit(2)
	}
	w := &Worker{addr: cfg.XdsAddr, secure: cfg.Secure, ticks: cfg.Ticks, traffic: map[int64]*[2]int64{},
		failureDetails: map[string]string{}, seenBy: map[int]int{}}
	for _, spec := range cfg.Clients {
		w.clients = append(w.clients, newClient(spec))
	}
	words := make(chan string)
	go func() {
		for {
			line, err := in.ReadString('\n')
			if err != nil { // the coordinator is gone: so are we
				os.Exit(1)
			}
			words <- strings.TrimSpace(line)
		}
	}()
	await := func(word string) {
		for w := range words {
			if w == word {
				return
			}
		}
	}
	w.emit("ready", nil)
	await("go") // all workers connect at once: the storm does not time process start-up
	ctx, cancel := context.WithCancel(context.Background())
	var running sync.WaitGroup
	for _, c := range w.clients {
		running.Go(func() { w.runClient(ctx, c) })
	}
	await("stop")
	// The final states are compared: first let clients that are still catching up finish (briefly).
	settledBy := time.Now().Add(time.Duration(cfg.SettleSeconds * float64(time.Second)))
	for time.Now().Before(settledBy) && !allSettled(w.clients) {
		time.Sleep(100 * time.Millisecond)
	}
	cancel()
	running.Wait()
	w.emit("summary", w.summary())
}

func allSettled(clients []*Client) bool {
	for _, c := range clients {
		if !c.settled() {
			return false
		}
	}
	return true
}
