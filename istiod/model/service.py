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
    mesh_external: bool = False  # a ServiceEntry's location MESH_EXTERNAL (the default)
    # A ServiceEntry's exportTo, or a Service's `networking.istio.io/exportTo` annotation (empty:
    # the mesh's defaultServiceExportTo).
    export_to: tuple[str, ...] = ()
    subject_alt_names: tuple[str, ...] = ()  # a ServiceEntry's: what TLS origination verifies by default
    # An ExternalName Service's spec.externalName: istiod's resolution Alias, no config of its own,
    # its names added to those of the service it names.
    external_name: str = ""
    # Where the cluster's outside reaches it (istiod's ClusterExternalAddresses): a LoadBalancer's
    # status ingress IPs, then spec.externalIPs. A network gateway Service's addresses.
    external_addresses: tuple[str, ...] = ()
    hostname: str = field(init=False)  # <name>.<namespace>.svc.<domain>, or the ServiceEntry's host
    # The host spellings a proxyless client may use for it, longest first.
    aliases: tuple[str, ...] = field(init=False, compare=False, repr=False)
    # Derived once: generators look ports up per cluster name, per proxy, per push.
    _by_number: dict[int, Port] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hostname", self.external_host or service_hostname(self.name, self.namespace, self.domain))
        object.__setattr__(self, "aliases", (self.external_host,) if self.external_host
                           else listener_host_aliases(self.name, self.namespace, self.domain))
        object.__setattr__(self, "_by_number", {p.port: p for p in reversed(self.ports)})  # the first wins, as a scan

    @property
    def dns_resolved(self) -> bool:
        """Its endpoints are DNS names the client resolves (a ServiceEntry with DNS resolution)."""
        return self.resolution in (Resolution.DNS, Resolution.DNS_ROUND_ROBIN)

    @property
    def headless(self) -> bool:
        """A Kubernetes Service with `clusterIP: None` (istiod's resolution Passthrough)."""
        return self.cluster_ip == "None" and not self.external_host and not self.external_name

    @property
    def passthrough(self) -> bool:
        """Sidecars send to the address the client connected to (istiod's resolution Passthrough):
        a headless Service, a ServiceEntry with resolution NONE."""
        return self.headless or self.resolution is Resolution.NONE

    def port(self, number: int) -> Port | None:
        return self._by_number.get(number)

    def cluster_name(self, port: int) -> str:
        return outbound_cluster_name(port, self.hostname)


NETWORK_LABEL = "topology.istio.io/network"  # a pod's network (Istio's label.TopologyNetwork)


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
    network: str = ""  # Istio's network ID ("": the proxy's own)
    # Of the Kubernetes registry (Pods, EndpointSlices): only those take a network they lack from
    # istiod's namespace label or meshNetworks' endpoints (istiod's WorkloadEntries do not).
    kube: bool = False
    weight: int = 0  # a WorkloadEntry's load-balancing weight; 0 is the default, 1
