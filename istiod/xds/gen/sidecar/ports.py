"""What a sidecar proxies: the service ports it sends to (outbound) and those its pod serves (inbound)."""

from __future__ import annotations

from dataclasses import dataclass

from istiod.model.config.networking import EgressListener
from istiod.model.config.scope import egress_allows
from istiod.model.protocol import Protocol, parse, port_protocol
from istiod.model.proxy import Proxy
from istiod.model.service import Port, Service
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.eds import is_ip
from istiod.xds.gen.targets import sidecar_resource, visible_services

VIRTUAL_OUTBOUND_PORT = 15001
VIRTUAL_INBOUND_PORT = 15006
# The sidecar's own ports (pilot-agent's and Envoy's): never a service's listener or inbound chain.
PROXY_PORTS = frozenset({15000, VIRTUAL_OUTBOUND_PORT, VIRTUAL_INBOUND_PORT, 15020, 15021, 15090})


# Where an egress listener with captureMode NONE and no bind listens, as istiod defaults it.
NONE_CAPTURE_BIND = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class OutboundPort:
    service: Service
    port: Port  # the service's port: where the traffic goes
    protocol: Protocol
    # What a Sidecar resource's egress listener sets: the port the listener takes (0: the
    # service's), its address, and whether Envoy binds it itself (captureMode NONE).
    listen: int = 0
    bind: str = ""
    bind_to_port: bool = False

    @property
    def number(self) -> int:
        """The listener's port."""
        return self.listen or self.port.port

    @property
    def cluster(self) -> str:
        return self.service.cluster_name(self.port.port)

    @property
    def vip(self) -> str | None:
        """The ClusterIP, when the service has one (not headless)."""
        return self.service.cluster_ip if is_ip(self.service.cluster_ip) else None


@dataclass(frozen=True, slots=True)
class InboundPort:
    port: int  # the port the app listens on (the endpoint's, not the service's)
    protocol: Protocol
    # The service it serves (the first by hostname), by its own port: whose DestinationRule applies.
    service: Service | None = None
    service_port: int = 0


def carried(port: Port) -> bool:
    """Envoy proxies TCP only: UDP and SCTP ports pass by the sidecar."""
    return port.protocol.upper() == "TCP"


def outbound_ports(snapshot: Snapshot, proxy: Proxy) -> list[OutboundPort]:
    """Every service port the proxy sees and proxies, by host then port; under a Sidecar resource,
    as its egress listeners say: one with a port takes that port for the hosts it names, the catch-all (no port) every
    other port of its hosts, and without a catch-all nothing else is seen (as istiod)."""
    services = sorted(visible_services(snapshot, proxy), key=lambda s: s.hostname)
    sidecar = sidecar_resource(snapshot, proxy)
    if sidecar is None or not sidecar.egress:
        return [OutboundPort(service, port, port_protocol(port))
                for service in services for port in service.ports if carried(port)]
    namespace = sidecar.meta.namespace
    result = []
    explicit = [e for e in sidecar.egress if e.port is not None]
    for listener in explicit:
        result += [t for service in services if (t := _egress_target(listener, service, namespace)) is not None]
    taken = {e.port.number for e in explicit if e.port is not None}
    for listener in sidecar.egress:
        if listener.port is None:
            result += [OutboundPort(service, port, port_protocol(port)) for service in services
                       if egress_allows(listener, namespace, service.namespace, service.hostname)
                       for port in service.ports if carried(port) and port.port not in taken]
    return result


def _egress_target(listener: EgressListener, service: Service, namespace: str) -> OutboundPort | None:
    """`service` on an egress listener with a port, if its hosts name it."""
    egress = listener.port
    assert egress is not None
    if not egress_allows(listener, namespace, service.namespace, service.hostname):
        return None
    # Not a port of the service: its only port Envoy carries (UDP ones aside), as istiod picks.
    ports = [p for p in service.ports if carried(p)]
    port = next((p for p in ports if p.port == egress.number), ports[0] if len(ports) == 1 else None)
    if port is None:
        return None
    none = listener.capture_mode == "NONE"
    protocol = parse(egress.protocol) if egress.protocol else port_protocol(port)
    return OutboundPort(service, port, protocol, egress.number, listener.bind or (NONE_CAPTURE_BIND if none else ""),
                        none)


def inbound_ports(snapshot: Snapshot, proxy: Proxy) -> tuple[InboundPort, ...]:
    """The ports the proxy's pod serves for some service; where services disagree on a port's
    protocol, the first by hostname decides."""
    found: dict[int, InboundPort] = {}
    instances = [i for address in proxy.ip_addresses for i in snapshot.instances_on(address)]
    for service, endpoint in sorted(instances, key=lambda i: i[0].hostname):
        port = service.port(endpoint.service_port)
        if port is not None and carried(port) and endpoint.port not in PROXY_PORTS:
            found.setdefault(endpoint.port, InboundPort(endpoint.port, port_protocol(port), service, port.port))
    return tuple(found[port] for port in sorted(found))
