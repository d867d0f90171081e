package main

// What a client derives from the resources it holds, as bench/loadgen.py does: the names each
// type leads to (LDS -> RDS -> CDS -> EDS) and the marked addresses in ClusterLoadAssignments.

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sort"
	"strconv"
	"strings"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

const (
	LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
	RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
	CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
)

// follows: the type a type's resources name. Envoy-like clients ask CDS for all (wildcard), not by route.
var follows = map[string]string{LDS: RDS, RDS: CDS, CDS: EDS}

type set map[string]struct{}

func (s set) sorted() []string {
	names := make([]string, 0, len(s))
	for name := range s {
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}

func (s set) equal(other set) bool {
	if len(s) != len(other) {
		return false
	}
	for name := range s {
		if _, ok := other[name]; !ok {
			return false
		}
	}
	return true
}

// minus: what s has that other has not.
func (s set) minus(other set) set {
	out := set{}
	for name := range s {
		if _, ok := other[name]; !ok {
			out[name] = struct{}{}
		}
	}
	return out
}

// held is one resource a client holds: its bytes as received and the names that follow from it.
type held struct {
	value   []byte
	derived set
}

// leadingName is field 1 of a serialized resource: the name of a Listener, RouteConfiguration,
// Cluster and ClusterLoadAssignment alike (protobuf writes fields in number order).
func leadingName(value []byte) (string, error) {
	if len(value) == 0 || value[0] != 0x0a {
		return "", fmt.Errorf("a resource without its name first")
	}
	length, shift, pos := 0, 0, 1
	for pos < len(value) {
		b := value[pos]
		length |= int(b&0x7f) << shift
		pos, shift = pos+1, shift+7
		if b < 0x80 {
			if pos+length > len(value) {
				break
			}
			return string(value[pos : pos+length]), nil
		}
	}
	return "", fmt.Errorf("a resource with a truncated name")
}

// marks are the marked addresses (see markOf) in a serialized ClusterLoadAssignment: a
// SocketAddress's address is field 2, a string. Scanning the bytes instead of parsing every
// assignment keeps the generator off the critical path.
func marks(value []byte) []int {
	var found []int
	prefix := []byte("100.")
	for start := 0; ; {
		i := bytes.Index(value[start:], prefix)
		if i < 0 {
			return found
		}
		i += start
		start = i + len(prefix)
		if i < 2 || value[i-2] != 0x12 || value[i-1] < 10 || value[i-1] > 15 || i+int(value[i-1]) > len(value) {
			continue
		}
		address := value[i : i+int(value[i-1])]
		if len(bytes.Trim(address, "0123456789.")) != 0 {
			continue
		}
		if mark, ok := markOf(string(address)); ok {
			found = append(found, mark)
		}
	}
}

// markOf is loadgen.mark_of: the change whose address this is.
func markOf(address string) (int, bool) {
	parts := strings.Split(address, ".")
	if len(parts) != 4 {
		return 0, false
	}
	var octets [3]int
	for i, part := range parts[1:] {
		n, err := strconv.Atoi(part)
		if err != nil {
			return 0, false
		}
		octets[i] = n
	}
	return (octets[0]-64)<<16 | octets[1]<<8 | octets[2], true
}

// derive: what follows from one LDS, RDS or CDS resource (route names, cluster names, EDS names).
func derive(typeURL string, value []byte) set {
	names := set{}
	switch typeURL {
	case LDS:
		listener := &listenerv3.Listener{}
		if proto.Unmarshal(value, listener) != nil {
			return names
		}
		var managers []*anypb.Any
		if listener.ApiListener != nil {
			managers = append(managers, listener.GetApiListener().GetApiListener())
		} else {
			for _, chain := range listener.GetFilterChains() {
				for _, filter := range chain.GetFilters() {
					if strings.HasSuffix(filter.GetTypedConfig().GetTypeUrl(), "HttpConnectionManager") {
						managers = append(managers, filter.GetTypedConfig())
					}
				}
			}
		}
		for _, packed := range managers {
			hcm := &hcmv3.HttpConnectionManager{}
			if packed != nil && packed.UnmarshalTo(hcm) == nil {
				if rds := hcm.GetRds(); rds != nil {
					names[rds.GetRouteConfigName()] = struct{}{}
				}
			}
		}
	case RDS:
		config := &routev3.RouteConfiguration{}
		if proto.Unmarshal(value, config) != nil {
			return names
		}
		for _, host := range config.GetVirtualHosts() {
			for _, route := range host.GetRoutes() {
				action := route.GetRoute()
				if action.GetCluster() != "" {
					names[action.GetCluster()] = struct{}{}
				}
				for _, weighted := range action.GetWeightedClusters().GetClusters() {
					names[weighted.GetName()] = struct{}{}
				}
			}
		}
	case CDS:
		cluster := &clusterv3.Cluster{}
		if proto.Unmarshal(value, cluster) != nil || cluster.GetType() != clusterv3.Cluster_EDS {
			return names
		}
		if service := cluster.GetEdsClusterConfig().GetServiceName(); service != "" {
			names[service] = struct{}{}
		} else {
			names[cluster.GetName()] = struct{}{}
		}
	}
	return names
}

// digest is loadgen.Client.digest, byte for byte: clients asking for the same, the same way, end
// with the same one, whichever generator they run in.
func digest(resources map[string]map[string]*held) string {
	h := sha256.New()
	types := make([]string, 0, len(resources))
	for typeURL := range resources {
		types = append(types, typeURL)
	}
	sort.Strings(types)
	for _, typeURL := range types {
		names := make([]string, 0, len(resources[typeURL]))
		for name := range resources[typeURL] {
			names = append(names, name)
		}
		sort.Strings(names)
		for _, name := range names {
			value := resources[typeURL][name].value
			fmt.Fprintf(h, "%s\x00%s\x00%d\x00", typeURL, name, len(value))
			h.Write(value)
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}
