"""Which services a proxy sees, and what requested resource names refer to: (name, Service, port)
triples, or everything the proxy sees for a wildcard. Shared by every flavor."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from istiod.model.names import parse_cluster_name, split_host_port
from istiod.model.proxy import Proxy
from istiod.model.service import Service
from istiod.model.snapshot import Snapshot


def visible_services(snapshot: Snapshot, proxy: Proxy) -> Iterable[Service]:
    """The services a proxy sees: all of them until Sidecar resources and exportTo narrow it."""
    return snapshot.services.values()


def outbound_host_ports(snapshot: Snapshot, proxy: Proxy, names: list[str] | None) -> Iterator[tuple[str, Service, int]]:
    """Listener/route names `host:port` (host in any alias form) that name a Service port."""
    if names is None:
        names = [f"{s.hostname}:{p.port}" for s in visible_services(snapshot, proxy) for p in s.ports]
    for name in names:
        try:
            host, port = split_host_port(name)
        except ValueError:
            continue
        service = snapshot.service_for_host(host)
        if service is not None and service.port(port) is not None:
            yield name, service, port


def outbound_clusters(snapshot: Snapshot, proxy: Proxy, names: list[str] | None) -> Iterator[tuple[str, Service, int]]:
    """Cluster names `outbound|port||host` that name a Service port (no subsets yet)."""
    if names is None:
        names = [s.cluster_name(p.port) for s in visible_services(snapshot, proxy) for p in s.ports]
    for name in names:
        try:
            direction, port, subset, host = parse_cluster_name(name)
        except ValueError:
            continue
        service = snapshot.services.get(host)
        if direction == "outbound" and not subset and service is not None and service.port(port) is not None:
            yield name, service, port
