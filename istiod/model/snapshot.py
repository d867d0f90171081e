"""The Snapshot: one immutable, versioned view of the mesh, used from start to end of a push.

Like istiod's PushContext. Values in it are shared with the previous snapshot when they did not
change, so caches can key on identity. Its indexes are derived from the previous snapshot's for
what changed (copy-on-write: a new dict, the unchanged tuples in it shared), so a push costs what
changed, not the size of the mesh; a snapshot made without them builds them whole.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from istiod.model.batch import CronJob, Job
from istiod.model.cluster import Namespace
from istiod.model.config import ConfigSet
from istiod.model.credentials import TlsCredential
from istiod.model.endpointslice import EndpointSlice
from istiod.model.mesh import MeshConfig
from istiod.model.service import Endpoint, Locality, Service
from istiod.model.storage import PersistentVolume, PersistentVolumeClaim
from istiod.model.workload import Workload

K = TypeVar("K")
V = TypeVar("V")
Instance = tuple[Service, Endpoint]
EndpointKey = tuple[str, int]  # (hostname, service port)


@dataclass(frozen=True, slots=True)
class VolumeMount:
    """A PersistentVolume with the claim bound to it and the workloads that mount that claim."""

    volume: PersistentVolume
    claim: PersistentVolumeClaim | None
    mounted_by: tuple[Workload, ...]


def _instance_order(instance: Instance) -> tuple[str, int]:
    return instance[0].hostname, instance[1].service_port


def _alias_order(service: Service) -> tuple[bool, str]:
    # A ServiceEntry host wins over a Kubernetes short alias spelled the same: it is its exact host.
    return not service.external_host, service.hostname


def _pod_order(workload: Workload) -> str:
    return workload.name


def _slice_order(endpoint_slice: EndpointSlice) -> str:
    return endpoint_slice.name


def _grouped(items: Iterable[tuple[K, V]], order: Callable[[V], Any]) -> dict[K, tuple[V, ...]]:
    groups: dict[K, list[V]] = defaultdict(list)
    for key, value in items:
        groups[key].append(value)
    return {key: tuple(sorted(values, key=order)) for key, values in groups.items()}


def _patched(index: Mapping[K, tuple[V, ...]], removed: Iterable[K], added: Iterable[tuple[K, V]],
             stale: Callable[[V], bool], order: Callable[[V], Any]) -> dict[K, tuple[V, ...]]:
    """A copy of `index` where, under each key named, the stale values are gone and the added ones
    are in, in the order a whole build gives (sorting is stable, so ties keep their arrival order)."""
    touched: dict[K, list[V]] = {key: [] for key in removed}
    for key, value in added:
        touched.setdefault(key, []).append(value)
    result = dict(index)
    for key, new in touched.items():
        values = sorted([v for v in index.get(key, ()) if not stale(v)] + new, key=order)
        if values:
            result[key] = tuple(values)
        else:
            result.pop(key, None)
    return result


def _instances(services: Mapping[str, Service], endpoints: Mapping[EndpointKey, tuple[Endpoint, ...]],
               keys: Iterable[EndpointKey]) -> list[Instance]:
    return [(services[hostname], endpoint) for hostname, port in keys
            for endpoint in endpoints.get((hostname, port), ())]


@dataclass(frozen=True, slots=True)
class Lookups:
    """Indexes over services and endpoints: host spellings, and what an address (and port) serves."""

    aliases: Mapping[str, tuple[Service, ...]]  # every service that claims the spelling, the winner first
    inbound: Mapping[tuple[str, int], tuple[Instance, ...]]  # by (address, port)
    by_address: Mapping[str, tuple[Instance, ...]]

    @classmethod
    def of(cls, services: Mapping[str, Service], endpoints: Mapping[EndpointKey, tuple[Endpoint, ...]]) -> Lookups:
        instances = _instances(services, endpoints, endpoints)
        return cls(
            _grouped(((alias, s) for s in services.values() for alias in s.aliases), _alias_order),
            _grouped((((e.address, e.port), (s, e)) for s, e in instances), _instance_order),
            _grouped(((e.address, (s, e)) for s, e in instances), _instance_order),
        )

    def updated(self, before: Snapshot, services: Mapping[str, Service],
                endpoints: Mapping[EndpointKey, tuple[Endpoint, ...]],
                hosts: Collection[str], keys: Collection[EndpointKey]) -> Lookups:
        """These lookups moved from `before` to the new services and endpoints, given every hostname
        whose Service changed and every endpoint key whose endpoints (or Service) changed."""
        aliases = self.aliases
        if hosts:
            old = [before.services[h] for h in hosts if h in before.services]
            new = [services[h] for h in hosts if h in services]
            aliases = _patched(aliases, (a for s in old for a in s.aliases), ((a, s) for s in new for a in s.aliases),
                               lambda s: s.hostname in hosts, _alias_order)
        if not keys:
            return Lookups(aliases, self.inbound, self.by_address)
        old_instances = _instances(before.services, before.endpoints, keys)
        new_instances = _instances(services, endpoints, keys)

        def stale(instance: Instance) -> bool:
            return _instance_order(instance) in keys

        inbound = _patched(self.inbound, ((e.address, e.port) for _, e in old_instances),
                           (((e.address, e.port), (s, e)) for s, e in new_instances), stale, _instance_order)
        by_address = _patched(self.by_address, (e.address for _, e in old_instances),
                              ((e.address, (s, e)) for s, e in new_instances), stale, _instance_order)
        return Lookups(aliases, inbound, by_address)


@dataclass(frozen=True, slots=True)
class Selection:
    """Indexes that find a Service's endpoints: Pods by label, EndpointSlices by Service, and the
    Kubernetes Services of each namespace."""

    labels: Mapping[str, Mapping[tuple[str, str], tuple[Workload, ...]]]  # namespace -> label -> pods by name
    slices: Mapping[tuple[str, str], tuple[EndpointSlice, ...]]  # (namespace, service name) -> by slice name
    namespaces: Mapping[str, tuple[Service, ...]]  # Kubernetes Services (not ServiceEntry hosts)

    @classmethod
    def of(cls, services: Mapping[str, Service], workloads: Mapping[tuple[str, str], Workload],
           endpoint_slices: Mapping[tuple[str, str], EndpointSlice]) -> Selection:
        labels: dict[str, dict[tuple[str, str], list[Workload]]] = defaultdict(lambda: defaultdict(list))
        for workload in workloads.values():
            for label in workload.labels:
                labels[workload.namespace][label].append(workload)
        return cls({ns: {label: tuple(sorted(pods, key=_pod_order)) for label, pods in index.items()}
                    for ns, index in labels.items()},
                   _slices(endpoint_slices.values()), _namespaces(services))

    def with_services(self, services: Mapping[str, Service]) -> Selection:
        return Selection(self.labels, self.slices, _namespaces(services, self.namespaces))

    def with_pods(self, before: Mapping[tuple[str, str], Workload], after: Mapping[tuple[str, str], Workload],
                  keys: Iterable[tuple[str, str]]) -> Selection:
        labels = dict(self.labels)
        by_namespace: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for namespace, name in keys:
            by_namespace[namespace].append((namespace, name))
        for namespace, pods in by_namespace.items():
            names = {name for _, name in pods}
            old = [before[k] for k in pods if k in before]
            new = [after[k] for k in pods if k in after]
            patched = _patched(labels.get(namespace, {}), (label for w in old for label in w.labels),
                               ((label, w) for w in new for label in w.labels),
                               lambda w: w.name in names, _pod_order)
            if patched:
                labels[namespace] = patched
            else:
                labels.pop(namespace, None)
        return Selection(labels, self.slices, self.namespaces)

    def with_slices(self, before: Mapping[tuple[str, str], EndpointSlice],
                    after: Mapping[tuple[str, str], EndpointSlice], keys: Collection[tuple[str, str]]) -> Selection:
        old = [before[k] for k in keys if k in before]
        new = [after[k] for k in keys if k in after]
        slices = _patched(self.slices, ((s.namespace, s.service) for s in old if s.service),
                          (((s.namespace, s.service), s) for s in new if s.service),
                          lambda s: (s.namespace, s.name) in keys, _slice_order)
        return Selection(self.labels, slices, self.namespaces)

    def labelled(self, namespace: str, label: tuple[str, str]) -> tuple[Workload, ...]:
        return self.labels.get(namespace, {}).get(label, ())


def _slices(endpoint_slices: Iterable[EndpointSlice]) -> dict[tuple[str, str], tuple[EndpointSlice, ...]]:
    return _grouped((((s.namespace, s.service), s) for s in endpoint_slices if s.service), _slice_order)


def _namespaces(services: Mapping[str, Service],
                before: Mapping[str, tuple[Service, ...]] | None = None) -> dict[str, tuple[Service, ...]]:
    """A namespace's tuple is the one `before` had while its Services are the same objects, so what
    reads one namespace's Services can key on it."""
    grouped = _grouped(((s.namespace, s) for s in services.values() if not s.external_host), lambda s: s.name)
    for namespace, group in grouped.items():
        old = before.get(namespace) if before is not None else None
        if old is not None and len(old) == len(group) and all(a is b for a, b in zip(old, group)):
            grouped[namespace] = old
    return grouped


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: str
    services: Mapping[str, Service] = field(default_factory=dict)  # by hostname
    # (hostname, service port) -> endpoints; the tuple object is reused while it stays equal.
    endpoints: Mapping[EndpointKey, tuple[Endpoint, ...]] = field(default_factory=dict)
    workloads: Mapping[tuple[str, str], Workload] = field(default_factory=dict)  # (namespace, pod name)
    jobs: Mapping[tuple[str, str], Job] = field(default_factory=dict)
    cronjobs: Mapping[tuple[str, str], CronJob] = field(default_factory=dict)
    volumes: tuple[VolumeMount, ...] = ()
    mesh: MeshConfig = MeshConfig()
    jwks: Mapping[str, str] = field(default_factory=dict)  # JSON Web Key Sets istiod fetched, by jwksUri
    config: ConfigSet = ConfigSet()  # Istio's config objects (VirtualService, DestinationRule, ...)
    credentials: Mapping[tuple[str, str], TlsCredential] = field(default_factory=dict)  # Secrets by (namespace, name)
    endpoint_slices: Mapping[tuple[str, str], EndpointSlice] = field(default_factory=dict)  # (namespace, name)
    nodes: Mapping[str, Locality] = field(default_factory=dict)  # by Node name
    namespaces: Mapping[str, Namespace] = field(default_factory=dict)  # by name (their labels)
    # Derived from the fields above; given by the builder when it moved them from the previous snapshot.
    lookups: Lookups | None = field(default=None, compare=False, repr=False)
    selection: Selection | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.lookups is None:
            object.__setattr__(self, "lookups", Lookups.of(self.services, self.endpoints))
        if self.selection is None:
            object.__setattr__(self, "selection", Selection.of(self.services, self.workloads, self.endpoint_slices))

    @property
    def _lookups(self) -> Lookups:
        assert self.lookups is not None  # set by __post_init__
        return self.lookups

    def service_for_host(self, host: str) -> Service | None:
        """A Service by any spelling a proxyless client may use: FQDN, name.ns.svc or name.ns."""
        claimants = self._lookups.aliases.get(host)
        return claimants[0] if claimants else None

    def endpoints_for(self, hostname: str, port: int) -> tuple[Endpoint, ...]:
        return self.endpoints.get((hostname, port), ())

    def instances_at(self, address: str, port: int) -> tuple[Instance, ...]:
        """The services an address:port serves (Istio's service targets), for inbound listeners."""
        return self._lookups.inbound.get((address, port), ())

    def instances_on(self, address: str) -> tuple[Instance, ...]:
        """Every (service, endpoint) served at an address: a sidecar's inbound ports."""
        return self._lookups.by_address.get(address, ())
