"""`istiod proxy-config`: readable tables of what one proxy was sent, from /debug/config_dump."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from istiod.debug.dump_layout import BY_KIND
from istiod.model.names import parse_cluster_name
from istiod.tools import tables
from istiod.tools.debug_client import DebugClient

Json = dict[str, Any]


def run(client: DebugClient, kind: str, proxy: str, output: str) -> int:
    resources = resources_of(client.get("/debug/config_dump", proxyID=proxy), kind)
    if output == "json":
        sys.stdout.write(json.dumps(resources, indent=2) + "\n")
    else:
        headers, rows = _TABLES[kind]
        sys.stdout.write(tables.render(headers, [row for r in resources for row in rows(r)]))
    return 0


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


def _cluster_rows(cluster: Json) -> Iterator[tuple[str, ...]]:
    name = cluster.get("name", "")
    try:
        direction, port, subset, host = parse_cluster_name(name)
    except ValueError:
        direction, port, subset, host = "-", 0, "", name
    yield (host or "-", str(port or "-"), subset or "-", direction.upper(), cluster.get("type", "STATIC"),
           cluster.get("lb_policy", "ROUND_ROBIN"))


def _listener_rows(listener: Json) -> Iterator[tuple[str, ...]]:
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
    return "; ".join(parts) or "ALL"


def _filter_destination(config: Json) -> str:
    if "rds" in config:
        return f"Route: {config['rds'].get('route_config_name', '-')}"
    if "route_config" in config:
        return f"Inline Route: {config['route_config'].get('name', '-')}"
    if "cluster" in config:  # tcp_proxy
        return f"Cluster: {config['cluster']}"
    return config.get("@type", "-").rsplit(".", 1)[-1]


def _route_rows(route_config: Json) -> Iterator[tuple[str, ...]]:
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


def _endpoint_rows(assignment: Json) -> Iterator[tuple[str, ...]]:
    for group in assignment.get("endpoints", []):
        locality = group.get("locality", {})
        where = "/".join(locality[k] for k in ("region", "zone", "sub_zone") if locality.get(k)) or "-"
        for lb_endpoint in group.get("lb_endpoints", []):
            socket = lb_endpoint.get("endpoint", {}).get("address", {}).get("socket_address", {})
            yield (f"{socket.get('address', '')}:{socket.get('port_value', 0)}",
                   lb_endpoint.get("health_status", "UNKNOWN"), where, assignment.get("cluster_name", ""))


_TABLES: dict[str, tuple[tuple[str, ...], Callable[[Json], Iterator[tuple[str, ...]]]]] = {
    "clusters": (("SERVICE FQDN", "PORT", "SUBSET", "DIRECTION", "TYPE", "LB POLICY"), _cluster_rows),
    "listeners": (("NAME", "DIRECTION", "MATCH", "DESTINATION"), _listener_rows),
    "routes": (("NAME", "VHOST NAME", "DOMAINS", "MATCH", "DESTINATION"), _route_rows),
    "endpoints": (("ENDPOINT", "STATUS", "LOCALITY", "CLUSTER"), _endpoint_rows),
}
