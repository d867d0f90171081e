"""`istiod proxy-config`: readable tables of what one proxy was sent, from /debug/config_dump."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import yaml

from istiod.debug.dump_layout import BY_KIND
from istiod.model.names import parse_cluster_name
from istiod.tools import tables
from istiod.tools.debug_client import DebugClient

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Filter:
    """istioctl's proxy-config filters; each kind's parser offers the ones that apply to it."""

    fqdn: str | None = None
    port: int | None = None
    direction: str | None = None
    subset: str | None = None
    name: str | None = None
    cluster: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Filter:
        return cls(**{f.name: getattr(args, f.name, None) for f in fields(cls)})

    def keep(self, kind: str, resource: Json) -> bool:
        if kind == "clusters":
            direction, port, subset, host = _cluster_name(resource.get("name", ""))
            return ((self.fqdn is None or self.fqdn in host) and self.port in (None, port)
                    and self.direction in (None, direction) and self.subset in (None, subset))
        if kind == "listeners":
            return self.port is None or _listener_port(resource) == self.port
        if kind == "routes":
            return self.name in (None, resource.get("name"))
        name = resource.get("cluster_name", "")
        return (self.cluster is None or self.cluster in name) and (
            self.port is None or any(_endpoint_port(e) == self.port for e in _lb_endpoints(resource)))


def run(client: DebugClient, kind: str, proxy: str, output: str, only: Filter = Filter()) -> int:
    resources = [r for r in resources_of(client.get("/debug/config_dump", proxyID=proxy), kind) if only.keep(kind, r)]
    if output == "short":
        headers, rows = _TABLES[kind]
        sys.stdout.write(tables.render(headers, [row for r in resources for row in rows(r, only)]))
        return 0
    printed = [as_istioctl(r) for r in resources]
    if output == "json":
        sys.stdout.write(json.dumps(printed, indent=4) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(printed, sort_keys=False))
    return 0


def as_istioctl(resource: Json) -> Json:
    """A resource as istioctl prints it: protobuf JSON (camelCase field names), without its `@type`."""
    # The debug dump keeps proto field names; re-reading it as the message it is gives protobuf's own
    # JSON names without guessing which keys are fields and which are map keys.
    from google.protobuf import any_pb2, json_format

    import istiod.debug.config_dump  # noqa: F401  (registers every type a dump can hold, as the server does)
    import istiod.xds.gen  # noqa: F401

    printed: Json = json.loads(json_format.MessageToJson(json_format.ParseDict(resource, any_pb2.Any())))
    printed.pop("@type", None)
    return printed


def resources_of(dump: Json, kind: str) -> list[Json]:
    """The resources of one kind in an Envoy config dump, in the order istiod sent them."""
    layout = BY_KIND[kind]
    config: Json = next((c for c in dump.get("configs", []) if c.get("@type", "").endswith("." + layout.dump_type)), {})
    result = []
    for entry in config.get(layout.entries, []):
        for key in layout.path:
            entry = entry.get(key, {})
        result.append(entry)
    return result


def _cluster_name(name: str) -> tuple[str, int, str, str]:
    try:
        return parse_cluster_name(name)
    except ValueError:
        return "-", 0, "", name


def _cluster_rows(cluster: Json, _: Filter) -> Iterator[tuple[str, ...]]:
    direction, port, subset, host = _cluster_name(cluster.get("name", ""))
    yield (host or "-", str(port or "-"), subset or "-", direction.upper(), cluster.get("type", "STATIC"),
           cluster.get("lb_policy", "ROUND_ROBIN"))


def _listener_port(listener: Json) -> int | None:
    """The port a listener is on: its socket address, or for a proxyless one the `:port` its name ends with."""
    socket = listener.get("address", {}).get("socket_address", {})
    if "port_value" in socket:
        return int(socket["port_value"])
    port = listener.get("name", "").rpartition(":")[2]
    return int(port) if port.isdigit() else None


def _listener_rows(listener: Json, _: Filter) -> Iterator[tuple[str, ...]]:
    """One row per filter chain (an Envoy sidecar's) or per api_listener (a proxyless client's)."""
    name = listener.get("name", "")
    manager = listener.get("api_listener", {}).get("api_listener")
    if manager is not None:
        yield name, "OUTBOUND", "ALL", f"Route: {manager.get('rds', {}).get('route_config_name', '-')}"
        return
    direction = listener.get("traffic_direction", "-")
    chains = [(chain, _chain_match(chain.get("filter_chain_match", {}))) for chain in listener.get("filter_chains", [])]
    if "default_filter_chain" in listener:
        chains.append((listener["default_filter_chain"], "ALL (default)"))
    for chain, match in chains:
        for network_filter in chain.get("filters", []):
            yield name, direction, match, _filter_destination(network_filter.get("typed_config", {}))


def _chain_match(match: Json) -> str:
    """istioctl's MATCH: what a connection must show to take the chain."""
    parts = []
    if "destination_port" in match:
        parts.append(f"Port: {match['destination_port']}")
    if "transport_protocol" in match:
        parts.append(f"Trans: {match['transport_protocol']}")
    if match.get("application_protocols"):
        parts.append(f"App: {','.join(match['application_protocols'])}")
    if match.get("server_names"):
        parts.append(f"SNI: {','.join(match['server_names'])}")
    if match.get("prefix_ranges"):  # a ServiceEntry's CIDR address
        parts.append("Addr: " + ",".join(f"{r['address_prefix']}/{r.get('prefix_len', 0)}"
                                         for r in match["prefix_ranges"]))
    return "; ".join(parts) or "ALL"


def _filter_destination(config: Json) -> str:
    if "rds" in config:
        return f"Route: {config['rds'].get('route_config_name', '-')}"
    if "route_config" in config:
        return f"Inline Route: {config['route_config'].get('name', '-')}"
    if "cluster" in config:  # tcp_proxy
        return f"Cluster: {config['cluster']}"
    if "weighted_clusters" in config:  # tcp_proxy split by a VirtualService's tcp route
        return "WeightedClusters: " + ", ".join(
            f"{c['name']} ({c.get('weight', 0)})" for c in config["weighted_clusters"].get("clusters", []))
    return config.get("@type", "-").rsplit(".", 1)[-1]


def _route_rows(route_config: Json, _: Filter) -> Iterator[tuple[str, ...]]:
    for host in route_config.get("virtual_hosts", []):
        domains = host.get("domains", [])
        shown = domains[0] + (f" +{len(domains) - 1} more" if len(domains) > 1 else "") if domains else "-"
        for route in host.get("routes", []):
            match = _match(route.get("match", {}))
            yield route_config.get("name", ""), host.get("name", ""), shown, match, _destination(route)


def _match(match: Json) -> str:
    if "path" in match:
        return match["path"]
    return (match.get("prefix") or "/") + "*"


def _destination(route: Json) -> str:
    if "route" in route:
        return route["route"].get("cluster", "-")
    return "NonForwarding" if "non_forwarding_action" in route else "-"


def _lb_endpoints(assignment: Json) -> Iterator[Json]:
    for group in assignment.get("endpoints", []):
        yield from group.get("lb_endpoints", [])


def _socket(lb_endpoint: Json) -> Json:
    socket: Json = lb_endpoint.get("endpoint", {}).get("address", {}).get("socket_address", {})
    return socket


def _endpoint_port(lb_endpoint: Json) -> int:
    return int(_socket(lb_endpoint).get("port_value", 0))


def _endpoint_rows(assignment: Json, only: Filter) -> Iterator[tuple[str, ...]]:
    for group in assignment.get("endpoints", []):
        locality = group.get("locality", {})
        where = "/".join(locality[k] for k in ("region", "zone", "sub_zone") if locality.get(k)) or "-"
        for lb_endpoint in group.get("lb_endpoints", []):
            if only.port not in (None, _endpoint_port(lb_endpoint)):
                continue
            socket = _socket(lb_endpoint)
            yield (f"{socket.get('address', '')}:{_endpoint_port(lb_endpoint)}",
                   lb_endpoint.get("health_status", "UNKNOWN"), where, assignment.get("cluster_name", ""))


_TABLES: dict[str, tuple[tuple[str, ...], Callable[[Json, Filter], Iterator[tuple[str, ...]]]]] = {
    "clusters": (("SERVICE FQDN", "PORT", "SUBSET", "DIRECTION", "TYPE", "LB POLICY"), _cluster_rows),
    "listeners": (("NAME", "DIRECTION", "MATCH", "DESTINATION"), _listener_rows),
    "routes": (("NAME", "VHOST NAME", "DOMAINS", "MATCH", "DESTINATION"), _route_rows),
    "endpoints": (("ENDPOINT", "STATUS", "LOCALITY", "CLUSTER"), _endpoint_rows),
}
