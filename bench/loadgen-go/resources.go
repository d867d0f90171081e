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
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
)

const (
	LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
	RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
	CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
	// ztunnel's
	ADDRESS       = "type.googleapis.com/istio.workload.Address"
	AUTHORIZATION = "type.googleapis.com/istio.security.Authorization"
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

// Where a workload's addresses are in a serialized istio.workload.Address (no Go package of
// ztunnel's protos here: the field numbers of api/istio/workload/workload.proto).
var workloadAddresses = []protowire.Number{1, 3} // Address.workload, Workload.addresses (bytes)

// workloadMarks are the marked addresses of the workload an Address holds, if it holds one.
func workloadMarks(value []byte) []int {
	var found []int
	each(value, workloadAddresses, func(ip []byte) {
		if len(ip) == 4 && ip[0] == 100 {
			if mark, ok := markOf(fmt.Sprintf("%d.%d.%d.%d", ip[0], ip[1], ip[2], ip[3])); ok {
				found = append(found, mark)
			}
		}
	})
	return found
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

// Where the names that follow are in the serialized resources, by field number: read straight off
// the wire rather than parsing whole resources (a wildcard client holds thousands, and parsing them
// was most of the generator's CPU). Each path is looked up by field name, so a typo fails at start.
var (
	apiListener    = path(&listenerv3.Listener{}, "api_listener", "api_listener")
	chainManagers  = path(&listenerv3.Listener{}, "filter_chains", "filters", "typed_config")
	anyType        = path(&anypb.Any{}, "type_url")
	anyValue       = path(&anypb.Any{}, "value")
	hcmRds         = path(&hcmv3.HttpConnectionManager{}, "rds")
	rdsName        = path(&hcmv3.Rds{}, "route_config_name")
	routeActions   = path(&routev3.RouteConfiguration{}, "virtual_hosts", "routes", "route")
	actionCluster  = path(&routev3.RouteAction{}, "cluster")
	actionWeighted = path(&routev3.RouteAction{}, "weighted_clusters", "clusters")
	weightedName   = path(&routev3.WeightedCluster_ClusterWeight{}, "name")
	clusterName    = path(&clusterv3.Cluster{}, "name")
	clusterType    = path(&clusterv3.Cluster{}, "type")
	edsService     = path(&clusterv3.Cluster{}, "eds_cluster_config", "service_name")
	hcmType        = string((&hcmv3.HttpConnectionManager{}).ProtoReflect().Descriptor().FullName())
)

// path: the field numbers of a chain of fields, from message m down.
func path(m proto.Message, names ...string) []protowire.Number {
	message := m.ProtoReflect().Descriptor()
	var numbers []protowire.Number
	for _, name := range names {
		field := message.Fields().ByName(protoreflect.Name(name))
		numbers = append(numbers, field.Number())
		message = field.Message()
	}
	return numbers
}

// each calls fn with the value of every occurrence of the field at the end of `path` in the
// serialized message b (length-delimited values: their contents; varints: their encoding).
func each(b []byte, path []protowire.Number, fn func([]byte)) {
	if len(path) == 0 {
		fn(b)
		return
	}
	for len(b) > 0 {
		number, kind, n := protowire.ConsumeTag(b)
		if n < 0 {
			return
		}
		b = b[n:]
		size := protowire.ConsumeFieldValue(number, kind, b)
		if size < 0 {
			return
		}
		if number == path[0] {
			value := b[:size]
			if kind == protowire.BytesType {
				value, _ = protowire.ConsumeBytes(value)
			}
			each(value, path[1:], fn)
		}
		b = b[size:]
	}
}

// last is the field's value as a parser keeps it (the last occurrence), nil when absent.
func last(b []byte, path []protowire.Number) []byte {
	var value []byte
	each(b, path, func(v []byte) { value = v })
	return value
}

// derive: what follows from one LDS, RDS or CDS resource (route names, cluster names, EDS names),
// as loadgen.derive finds it.
func derive(typeURL string, value []byte) set {
	names := set{}
	switch typeURL {
	case LDS:
		var managers [][]byte // Anys: HttpConnectionManagers, if their type says so
		if last(value, apiListener[:1]) != nil {
			each(value, apiListener, func(v []byte) { managers = append(managers, v) })
		} else {
			each(value, chainManagers, func(v []byte) {
				if strings.HasSuffix(string(last(v, anyType)), "HttpConnectionManager") {
					managers = append(managers, v)
				}
			})
		}
		for _, packed := range managers {
			typeName := string(last(packed, anyType))
			if typeName[strings.LastIndex(typeName, "/")+1:] != hcmType {
				continue
			}
			each(last(packed, anyValue), hcmRds, func(rds []byte) { names[string(last(rds, rdsName))] = struct{}{} })
		}
	case RDS:
		each(value, routeActions, func(action []byte) {
			if cluster := last(action, actionCluster); len(cluster) > 0 {
				names[string(cluster)] = struct{}{}
			}
			each(action, actionWeighted, func(weighted []byte) { names[string(last(weighted, weightedName))] = struct{}{} })
		})
	case CDS:
		kind, _ := protowire.ConsumeVarint(last(value, clusterType))
		if clusterv3.Cluster_DiscoveryType(kind) != clusterv3.Cluster_EDS {
			return names
		}
		if service := last(value, edsService); len(service) > 0 {
			names[string(service)] = struct{}{}
		} else {
			names[string(last(value, clusterName))] = struct{}{}
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
