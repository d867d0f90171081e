"""Services, their ports, and the endpoints (service instances) behind them."""

from __future__ import annotations

from dataclasses import dataclass, field

from istiod.model.config.networking import Resolution
from istiod.model.names import listener_host_aliases, outbound_cluster_name, service_hostname


@dataclass(frozen=True, slots=True)
class Locality:
    region: str = ""
    zone: str = ""
    subzone: str = ""

    @classmethod
    def parse(cls, label: str) -> Locality:
        """Istio's `istio-locality` label form `region.zone.subzone` (parts optional)."""
        parts = (label.split(".") + ["", "", ""])[:3]
        return cls(*parts)

    def __str__(self) -> str:
        return "/".join(p for p in (self.region, self.zone, self.subzone) if p)


@dataclass(frozen=True, slots=True)
class Port:
    name: str
    port: int
    protocol: str = "TCP"
    target_port: int | str = 0  # a container port number or name; 0 means "same as port"
    app_protocol: str = ""  # spec.ports[].appProtocol


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    namespace: str
    domain: str  # the cluster's DNS suffix, e.g. cluster.local
    ports: tuple[Port, ...]
    selector: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    cluster_ip: str = ""
    # A ServiceEntry's host (the Service is one host of it), and how its endpoints are found.
    external_host: str = ""
    resolution: Resolution | None = None
    hostname: str = field(init=False)  # <name>.<namespace>.svc.<domain>, or the ServiceEntry's host

    def __post_init__(self) -> None:
        object.__setattr__(self, "hostname", self.external_host or service_hostname(self.name, self.namespace, self.domain))

    @property
    def aliases(self) -> tuple[str, ...]:
        """The host spellings a proxyless client may use for it, longest first."""
        if self.external_host:
            return (self.external_host,)
        return listener_host_aliases(self.name, self.namespace, self.domain)

    @property
    def dns_resolved(self) -> bool:
        """Its endpoints are DNS names the client resolves (a ServiceEntry with DNS resolution)."""
        return self.resolution in (Resolution.DNS, Resolution.DNS_ROUND_ROBIN)

    def port(self, number: int) -> Port | None:
        return next((p for p in self.ports if p.port == number), None)

    def cluster_name(self, port: int) -> str:
        return outbound_cluster_name(port, self.hostname)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One address:port serving one port of one Service (Istio's ServiceInstance, flattened)."""

    address: str
    port: int
    service_port: int
    healthy: bool = True
    locality: Locality = field(default_factory=Locality)
    labels: tuple[tuple[str, str], ...] = ()
    service_account: str = ""
    workload_name: str = ""
    workload_kind: str = ""
    pod: str = ""
    namespace: str = ""
