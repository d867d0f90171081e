"""Store contents -> Snapshot. Pure: reads model values, writes nothing.

Endpoints are rebuilt only for Services in namespaces whose Pods, EndpointSlices or Services
changed; every other endpoint list is carried over from the previous snapshot as the same object.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any, Protocol

from istiod.model.batch import CronJob, Job
from istiod.model.cluster import Node
from istiod.model.config import ConfigSet
from istiod.model.entries import service_entry_services
from istiod.model.endpointslice import EndpointSlice
from istiod.model.mesh import MeshConfig
from istiod.model.service import Endpoint, Locality, Port, Service
from istiod.model.snapshot import Snapshot, VolumeMount
from istiod.model.storage import PersistentVolume, PersistentVolumeClaim
from istiod.model.workload import Workload

# Changes to these kinds can move any endpoint (locality, finished jobs), so they rebuild all.
_GLOBAL_KINDS = frozenset({"Node", "Job", "Namespace"})
_NAMESPACED_ENDPOINT_KINDS = frozenset({"Service", "Pod", "EndpointSlice"})


class ObjectValues(Protocol):
    def values(self, kind: str) -> Iterable[Any]: ...


class ChangedKey(Protocol):  # read-only, so frozen dataclasses such as ObjectKey satisfy it
    @property
    def kind(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...


def build_snapshot(
    objects: ObjectValues,
    version: str,
    previous: Snapshot | None = None,
    changed: Iterable[ChangedKey] | None = None,
    mesh: MeshConfig = MeshConfig(),
) -> Snapshot:
    """Build the next snapshot; `changed` (None = unknown) lets unchanged endpoints carry over."""
    services = {s.hostname: s for s in objects.values("Service")}
    config = ConfigSet.collect(objects)
    entries = service_entry_services(config, services)
    services.update({hostname: service for hostname, (service, _) in entries.items()})
    workloads: dict[tuple[str, str], Workload] = {(w.namespace, w.name): w for w in objects.values("Pod")}
    nodes: dict[str, Locality] = {n.name: n.locality for n in objects.values("Node") if isinstance(n, Node)}
    jobs: dict[tuple[str, str], Job] = {(j.namespace, j.name): j for j in objects.values("Job")}
    cronjobs: dict[tuple[str, str], CronJob] = {(c.namespace, c.name): c for c in objects.values("CronJob")}
    slices: dict[tuple[str, str], list[EndpointSlice]] = defaultdict(list)
    for endpoint_slice in objects.values("EndpointSlice"):
        if endpoint_slice.service:
            slices[(endpoint_slice.namespace, endpoint_slice.service)].append(endpoint_slice)

    dirty = _dirty_namespaces(changed) if previous is not None else None
    context = _EndpointContext(workloads, nodes, jobs)
    endpoints: dict[tuple[str, int], tuple[Endpoint, ...]] = {}
    for hostname, (service, by_port) in entries.items():
        for port_number, entry_endpoints in by_port.items():
            endpoints[(hostname, port_number)] = entry_endpoints
    for service in services.values():
        if service.hostname in entries:
            continue
        for port in service.ports:
            key = (service.hostname, port.port)
            old = previous.endpoints.get(key) if previous is not None else None
            if old is not None and dirty is not None and service.namespace not in dirty:
                endpoints[key] = old
                continue
            new = tuple(
                context.slice_endpoints(service, port, slices[(service.namespace, service.name)])
                if (service.namespace, service.name) in slices
                else context.selected_endpoints(service, port)
            )
            endpoints[key] = old if old == new else new

    return Snapshot(
        version=version,
        services=MappingProxyType(services),
        endpoints=MappingProxyType(endpoints),
        workloads=MappingProxyType(workloads),
        jobs=MappingProxyType(jobs),
        cronjobs=MappingProxyType(cronjobs),
        mesh=mesh,
        config=config,
        credentials=MappingProxyType({(c.namespace, c.name): c for c in objects.values("Secret")}),
        volumes=_volume_mounts(objects.values("PersistentVolume"), objects.values("PersistentVolumeClaim"), workloads),
    )


def _dirty_namespaces(changed: Iterable[ChangedKey] | None) -> set[str] | None:
    """Namespaces whose endpoints may have moved; None means all of them."""
    if changed is None:
        return None
    namespaces = set()
    for key in changed:
        if key.kind in _GLOBAL_KINDS:
            return None
        if key.kind in _NAMESPACED_ENDPOINT_KINDS:
            namespaces.add(key.namespace)
    return namespaces


class _EndpointContext:
    def __init__(
        self,
        workloads: dict[tuple[str, str], Workload],
        nodes: dict[str, Locality],
        jobs: dict[tuple[str, str], Job],
    ) -> None:
        self.workloads = workloads
        self.nodes = nodes
        self.jobs = jobs
        self._labels: dict[str, dict[tuple[str, str], list[Workload]]] = {}

    @cached_property
    def _by_namespace(self) -> dict[str, list[Workload]]:
        grouped: dict[str, list[Workload]] = defaultdict(list)
        for workload in self.workloads.values():
            grouped[workload.namespace].append(workload)
        return grouped

    def labelled(self, namespace: str, key: str, value: str) -> list[Workload]:
        """Pods of a namespace with one label, from an index built on first use per namespace, so
        a push that rebuilds one namespace indexes only that one."""
        index = self._labels.get(namespace)
        if index is None:
            index = self._labels[namespace] = defaultdict(list)
            for workload in self._by_namespace.get(namespace, ()):
                for label in workload.labels:
                    index[label].append(workload)
        return index.get((key, value), [])

    def serving(self, workload: Workload) -> bool:
        """Pods that finished (their own phase, or their Job's) leave the endpoints entirely."""
        if workload.terminal:
            return False
        owner = workload.owner
        if owner is not None and owner.kind == "Job":
            job = self.jobs.get((workload.namespace, owner.name))
            return not (job and job.finished)
        return True

    def endpoint(self, workload: Workload | None, address: str, port: int, service_port: Port,
                 ready: bool, node_name: str, zone: str, namespace: str) -> Endpoint:
        if workload is None:
            locality = self.nodes.get(node_name) or Locality(zone=zone)
            return Endpoint(address, port, service_port.port, ready, locality, namespace=namespace)
        return Endpoint(
            address=address,
            port=port,
            service_port=service_port.port,
            healthy=ready,
            locality=workload.locality(self.nodes.get(node_name or workload.node_name)),
            labels=workload.labels,
            service_account=workload.service_account,
            workload_name=workload.workload_name,
            workload_kind=workload.workload_kind,
            pod=workload.name,
            namespace=workload.namespace,
        )

    def slice_endpoints(self, service: Service, port: Port, slices: list[EndpointSlice]) -> list[Endpoint]:
        result: dict[tuple[str, int], Endpoint] = {}
        for endpoint_slice in slices:
            numbers = [number for name, number in endpoint_slice.ports if name == port.name]
            for number in numbers:
                for e in endpoint_slice.endpoints:
                    workload = self.workloads.get((service.namespace, e.pod)) if e.pod else None
                    if workload is not None and not self.serving(workload):
                        continue
                    for address in e.addresses:
                        # Slices can overlap while the controller moves endpoints; keep one.
                        result[(address, number)] = self.endpoint(
                            workload, address, number, port, e.ready, e.node_name, e.zone, service.namespace
                        )
        return [result[k] for k in sorted(result)]

    def selected_endpoints(self, service: Service, port: Port) -> list[Endpoint]:
        """No EndpointSlices: the Pods the selector picks, as the endpoints controller would."""
        if not service.selector:
            return []
        result = []
        candidates = min((self.labelled(service.namespace, k, v) for k, v in service.selector), key=len)
        for workload in candidates:
            if not workload.ip or not self.serving(workload):
                continue
            labels = workload.label_map()
            if any(labels.get(k) != v for k, v in service.selector):
                continue
            number = workload.container_port(port.target_port or port.port)
            if number is None:
                continue
            result.append(self.endpoint(workload, workload.ip, number, port, workload.ready, "", "", service.namespace))
        result.sort(key=lambda e: (e.address, e.port))
        return result


def _volume_mounts(
    volumes: Iterable[PersistentVolume],
    claims: Iterable[PersistentVolumeClaim],
    workloads: dict[tuple[str, str], Workload],
) -> tuple[VolumeMount, ...]:
    claims_by_key = {(c.namespace, c.name): c for c in claims}
    claims_by_volume = {c.volume_name: c for c in claims_by_key.values() if c.volume_name}
    mounts: dict[tuple[str, str], list[Workload]] = defaultdict(list)
    for workload in workloads.values():
        for claim_name in workload.claims:
            mounts[(workload.namespace, claim_name)].append(workload)
    result = []
    for volume in sorted(volumes, key=lambda v: v.name):
        claim = claims_by_key.get(volume.claim) if volume.claim else claims_by_volume.get(volume.name)
        mounted = mounts.get((claim.namespace, claim.name), []) if claim else []
        result.append(VolumeMount(volume, claim, tuple(sorted(mounted, key=lambda w: (w.namespace, w.name)))))
    return tuple(result)
