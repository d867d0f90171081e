"""The Snapshot: one immutable, versioned view of the mesh, used from start to end of a push.

Like istiod's PushContext. Values in it are shared with the previous snapshot when they did not
change, so caches can key on identity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from istiod.model.batch import CronJob, Job
from istiod.model.config import ConfigSet
from istiod.model.credentials import TlsCredential
from istiod.model.mesh import MeshConfig
from istiod.model.service import Endpoint, Service
from istiod.model.storage import PersistentVolume, PersistentVolumeClaim
from istiod.model.workload import Workload

@dataclass(frozen=True, slots=True)
class VolumeMount:
    """A PersistentVolume with the claim bound to it and the workloads that mount that claim."""

    volume: PersistentVolume
    claim: PersistentVolumeClaim | None
    mounted_by: tuple[Workload, ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: str
    services: Mapping[str, Service] = field(default_factory=dict)  # by hostname
    # (hostname, service port) -> endpoints; the tuple object is reused while it stays equal.
    endpoints: Mapping[tuple[str, int], tuple[Endpoint, ...]] = field(default_factory=dict)
    workloads: Mapping[tuple[str, str], Workload] = field(default_factory=dict)  # (namespace, pod name)
    jobs: Mapping[tuple[str, str], Job] = field(default_factory=dict)
    cronjobs: Mapping[tuple[str, str], CronJob] = field(default_factory=dict)
    volumes: tuple[VolumeMount, ...] = ()
    mesh: MeshConfig = MeshConfig()
    config: ConfigSet = ConfigSet()  # Istio's config objects (VirtualService, DestinationRule, ...)
    credentials: Mapping[tuple[str, str], TlsCredential] = field(default_factory=dict)  # Secrets by (namespace, name)
    _aliases: dict[str, Service] = field(default_factory=dict, compare=False, repr=False)
    _inbound: dict[tuple[str, int], list[tuple[Service, Endpoint]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _by_address: dict[str, list[tuple[Service, Endpoint]]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for service in self.services.values():
            for alias in service.aliases:
                self._aliases[alias] = service
        for (hostname, _), endpoints in self.endpoints.items():
            service = self.services[hostname]
            for endpoint in endpoints:
                self._inbound.setdefault((endpoint.address, endpoint.port), []).append((service, endpoint))
                self._by_address.setdefault(endpoint.address, []).append((service, endpoint))

    def service_for_host(self, host: str) -> Service | None:
        """A Service by any spelling a proxyless client may use: FQDN, name.ns.svc or name.ns."""
        return self._aliases.get(host)

    def endpoints_for(self, hostname: str, port: int) -> tuple[Endpoint, ...]:
        return self.endpoints.get((hostname, port), ())

    def instances_at(self, address: str, port: int) -> list[tuple[Service, Endpoint]]:
        """The services an address:port serves (Istio's service targets), for inbound listeners."""
        return self._inbound.get((address, port), [])

    def instances_on(self, address: str) -> list[tuple[Service, Endpoint]]:
        """Every (service, endpoint) served at an address: a sidecar's inbound ports."""
        return self._by_address.get(address, [])
