"""What a sidecar proxies: the service ports it sends to (outbound) and those its pod serves (inbound)."""

from __future__ import annotations

from dataclasses import dataclass

from istiod.model.protocol import Protocol, port_protocol
from istiod.model.proxy import Proxy
from istiod.model.service import Port, Service
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.eds import is_ip
from istiod.xds.gen.targets import visible_services

VIRTUAL_OUTBOUND_PORT = 15001
VIRTUAL_INBOUND_PORT = 15006
# The sidecar's own ports (pilot-agent's and Envoy's): never a service's listener or inbound chain.
PROXY_PORTS = frozenset({15000, VIRTUAL_OUTBOUND_PORT, VIRTUAL_INBOUND_PORT, 15020, 15021, 15090})


@dataclass(frozen=True, slots=True)
class OutboundPort:
    service: Service
    port: Port
    protocol: Protocol

    @property
    def cluster(self) -> str:
        return self.service.cluster_name(self.port.port)

    @property
    def vip(self) -> str | None:
        """The ClusterIP, when the service has one (not headless)."""
        return self.service.cluster_ip if is_ip(self.service.cluster_ip) else None


@dataclass(frozen=True, slots=True, order=True)
class InboundPort:
    port: int  # the port the app listens on (the endpoint's, not the service's)
    protocol: Protocol


def carried(port: Port) -> bool:
    """Envoy proxies TCP only: UDP and SCTP ports pass by the sidecar."""
    return port.protocol.upper() == "TCP"


def outbound_ports(snapshot: Snapshot, proxy: Proxy) -> list[OutboundPort]:
    """Every service port the proxy sees and proxies, by host then port."""
    return [
        OutboundPort(service, port, port_protocol(port))
        for service in sorted(visible_services(snapshot, proxy), key=lambda s: s.hostname)
        for port in service.ports
        if carried(port)
    ]


def inbound_ports(snapshot: Snapshot, proxy: Proxy) -> tuple[InboundPort, ...]:
    """The ports the proxy's pod serves for some service; where services disagree on a port's
    protocol, the first by hostname decides."""
    found: dict[int, Protocol] = {}
    instances = [i for address in proxy.ip_addresses for i in snapshot.instances_on(address)]
    for service, endpoint in sorted(instances, key=lambda i: i[0].hostname):
        port = service.port(endpoint.service_port)
        if port is not None and carried(port) and endpoint.port not in PROXY_PORTS:
            found.setdefault(endpoint.port, port_protocol(port))
    return tuple(sorted(InboundPort(port, protocol) for port, protocol in found.items()))
