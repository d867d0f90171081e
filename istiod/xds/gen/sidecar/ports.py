"""What a sidecar proxies: the service ports it sends to (outbound) and those its pod serves (inbound)."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

from istiod import logs
from istiod.model.config.networking import EgressListener, IngressListener, ServerTLS
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
ANY_ADDRESS = "0.0.0.0"
# istiod's CanBindToPort: an ingress listener on one of PROXY_PORTS is left out with a warning.
_reserved = logs.Throttled(logging.getLogger(__name__), 60.0)


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
    port: int  # the port the app listens on (the endpoint's, not the service's), or an ingress listener's
    protocol: Protocol  # after the sidecar's own TLS termination, if it terminates (HTTPS: HTTP)
    # The service it serves (the first by hostname), by its own port: whose DestinationRule applies.
    service: Service | None = None
    service_port: int = 0
    # What a Sidecar resource's ingress listener sets: the chains' address (its bind, else the
    # pod's), whether Envoy binds it itself (captureMode NONE) rather than take captured traffic,
    # where the app is (defaultEndpoint, resolved: else the connection's original destination), and
    # the caller's TLS the sidecar terminates.
    bind: str = ""
    bind_to_port: bool = False
    endpoint: tuple[str, int] | None = None
    tls: ServerTLS | None = None
    config: str = ""  # the Sidecar resource's path, which istiod puts in the chains' metadata

    @property
    def name(self) -> str:
        """istiod's `<bind>_<port>`, of its filter chains and, bound, of its listener."""
        return f"{self.bind or ANY_ADDRESS}_{self.port}"


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
    protocol, the first by hostname decides. Under a Sidecar resource with ingress listeners, those
    instead, as istiod (without PILOT_ALLOW_SIDECAR_SERVICE_INBOUND_LISTENER_MERGE)."""
    found: dict[int, InboundPort] = {}
    instances = [i for address in proxy.ip_addresses for i in snapshot.instances_on(address)]
    for service, endpoint in sorted(instances, key=lambda i: i[0].hostname):
        port = service.port(endpoint.service_port)
        if port is not None and carried(port) and endpoint.port not in PROXY_PORTS:
            found.setdefault(endpoint.port, InboundPort(endpoint.port, port_protocol(port), service, port.port))
    sidecar = sidecar_resource(snapshot, proxy)
    if sidecar is not None and sidecar.ingress:
        config = f"/apis/networking.istio.io/v1/namespaces/{sidecar.meta.namespace}/sidecar/{sidecar.meta.name}"
        for listener in sidecar.ingress:
            if listener.port.number in PROXY_PORTS:
                _reserved.warning(logs.event("Sidecar ingress listener skipped: its port conflicts with the sidecar's own",
                                             sidecar=f"{sidecar.meta.namespace}/{sidecar.meta.name}",
                                             port=listener.port.number, proxy=proxy.id))
        return tuple(sorted((_ingress_port(listener, found.get(listener.port.number), proxy, config)
                             for listener in sidecar.ingress if listener.port.number not in PROXY_PORTS),
                            key=lambda p: p.port))
    return tuple(found[port] for port in sorted(found))


def _ingress_port(listener: IngressListener, served: InboundPort | None, proxy: Proxy, config: str) -> InboundPort:
    """An ingress listener's port; the service whose endpoint is on that port, if any, lends its
    DestinationRule (istiod's findOrCreateService). No protocol: sniffed."""
    protocol = parse(listener.port.protocol)
    if listener.tls is not None:  # istiod's AfterTLSTermination
        protocol = {Protocol.HTTPS: Protocol.HTTP, Protocol.TLS: Protocol.TCP}.get(protocol, protocol)
    # The DestinationRule's port-level settings for the listener's port, as istiod looks them up.
    return InboundPort(listener.port.number, protocol, served.service if served else None,
                       listener.port.number if served else 0, listener.bind or _pod_bind(proxy),
                       listener.capture_mode == "NONE", _default_endpoint(listener.default_endpoint, proxy),
                       listener.tls, config)


def _pod_bind(proxy: Proxy) -> str:
    """istiod's getSidecarInboundBindIPs: the pod's address if global unicast (Go's sense: private
    ones too), else the wildcard."""
    try:
        address = ipaddress.ip_address(proxy.ip)
    except ValueError:
        return ANY_ADDRESS
    local = address.is_loopback or address.is_multicast or address.is_link_local or address.is_unspecified
    return ANY_ADDRESS if local or proxy.ip == "255.255.255.255" else proxy.ip


def _default_endpoint(endpoint: str, proxy: Proxy) -> tuple[str, int] | None:
    """istiod's resolution of defaultEndpoint: 127.0.0.1 and [::1] are the pod's loopback (the other
    family's when the pod has only that one), 0.0.0.0 and [::] its first address of that family
    (else loopback)."""
    if not endpoint:
        return None
    host, _, number = endpoint.rpartition(":")
    host = host.strip("[]")
    v6 = [a for a in proxy.ip_addresses if ":" in a]
    v4 = [a for a in proxy.ip_addresses if "." in a and ":" not in a]
    if host == "0.0.0.0":
        address = v4[0] if v4 else "127.0.0.1"
    elif host == "::":
        address = v6[0] if v6 else "::1"
    elif host == "::1":
        address = "::1" if v6 or not v4 else "127.0.0.1"
    else:
        address = "127.0.0.1" if v4 or not v6 else "::1"
    return address, int(number)
