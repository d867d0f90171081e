"""Store contents -> Snapshot. Pure: reads model values, writes nothing.

Given the previous snapshot and the keys that changed since, a build costs what changed: maps and
config kinds that did not change are carried over as the same objects, changed Pods and
EndpointSlices are patched into copies, only the Services they (or a changed Service) select get
their endpoints recomputed, and the snapshot's indexes are moved along (istiod/model/snapshot.py).
Without them, or when a kind that can move any endpoint changed, everything is built afresh.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from istiod.model.batch import CronJob, Job
from istiod.model.cluster import Namespace, Node
from istiod.model.config import GATEWAY_API_KINDS, ConfigSet
from istiod.model.config.scope import ExportToDefaults
from istiod.model.config.gateway_api import GatewayApiConfig
from istiod.model.config.gateway_conversion import convert as convert_gateway_api
from istiod.model.credentials import TlsCredential
from istiod.model.config.common import Labels, selector_matches
from istiod.model.config.networking import ServiceEntry, ServicePort, WorkloadEntry
from istiod.model.entries import EntryServices, PodEndpoints, service_entry_services, workload_entry_endpoint
from istiod.model.endpointslice import EndpointSlice
from istiod.model.mesh import MeshConfig
from istiod.model.service import NETWORK_LABEL, Endpoint, Locality, Port, Service
from istiod.model.snapshot import EndpointKey, Selection, Snapshot, VolumeMount
from istiod.model.storage import PersistentVolume, PersistentVolumeClaim
from istiod.model.workload import Workload

# Changes to these kinds can move any endpoint (finished jobs), so they rebuild all; so does a
# Node change that moves a locality (one that does not, a status update, costs nothing).
_GLOBAL_KINDS = frozenset({"Job", "Namespace"})
_SERVICE_KINDS = frozenset({"Service", "ServiceEntry", "WorkloadEntry"})  # what the services map is made of


class ChangedKey(Protocol):  # read-only, so frozen dataclasses such as ObjectKey satisfy it
    @property
    def kind(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...


class Stored(Protocol):
    @property
    def value(self) -> Any: ...


Key = TypeVar("Key", bound=ChangedKey, contravariant=True)


class ObjectValues(Protocol[Key]):
    def values(self, kind: str) -> Iterable[Any]: ...
    def get(self, key: Key, /) -> Stored | None: ...


def build_snapshot(
    objects: ObjectValues[Key],
    version: str,
    previous: Snapshot | None = None,
    changed: Iterable[Key] | None = None,
    mesh: MeshConfig = MeshConfig(),
    jwks: Mapping[str, str] = MappingProxyType({}),
) -> Snapshot:
    """Build the next snapshot; `changed` (None = unknown) makes it proportional to the change;
    `jwks`: the keys istiod fetched, by jwksUri."""
    if previous is not None and changed is not None:
        keys: dict[str, list[Key]] = defaultdict(list)
        for key in dict.fromkeys(changed):  # a key changed twice is patched once
            keys[key.kind].append(key)
        nodes = _nodes(objects) if "Node" in keys else previous.nodes
        if not keys.keys() & _GLOBAL_KINDS and nodes == previous.nodes:
            return _next(objects, version, previous, keys, mesh, jwks)
    return _whole(objects, version, previous, mesh, jwks)


def _whole(objects: ObjectValues[Key], version: str, previous: Snapshot | None, mesh: MeshConfig,
           jwks: Mapping[str, str]) -> Snapshot:
    config = ConfigSet.collect(objects, export_defaults=_export_defaults(mesh))
    workloads: dict[tuple[str, str], Workload] = {(w.namespace, w.name): w for w in objects.values("Pod")}
    jobs: dict[tuple[str, str], Job] = {(j.namespace, j.name): j for j in objects.values("Job")}
    endpoint_slices: dict[tuple[str, str], EndpointSlice] = {
        (s.namespace, s.name): s for s in objects.values("EndpointSlice")}
    # Endpoints need the Pods and slices indexed, not the Services (ServiceEntries pick Pods too).
    selection = Selection.of({}, workloads, endpoint_slices)
    nodes = _nodes(objects)
    context = _EndpointContext(workloads, nodes, jobs, selection, config.workload_entries)
    services, entries = _services(objects, config, context.entry_pod_endpoints)
    selection = selection.with_services(services)
    credentials = _credentials(objects)
    namespaces = {n.name: n for n in objects.values("Namespace") if isinstance(n, Namespace)}
    endpoints: dict[EndpointKey, tuple[Endpoint, ...]] = {}
    old = previous.endpoints if previous is not None else {}
    for hostname, (_, by_port) in entries.items():
        for port_number, entry_endpoints in by_port.items():
            endpoints[(hostname, port_number)] = _kept(old.get((hostname, port_number)), entry_endpoints)
    for service in services.values():
        if service.hostname not in entries:
            for port in service.ports:
                key = (service.hostname, port.port)
                endpoints[key] = _kept(old.get(key), context.endpoints(service, port))
    config = _with_gateway_api(config, services, endpoints, credentials, namespaces)
    return Snapshot(
        version=version,
        services=MappingProxyType(services),
        endpoints=MappingProxyType(endpoints),
        workloads=MappingProxyType(workloads),
        jobs=MappingProxyType(jobs),
        cronjobs=MappingProxyType(_cronjobs(objects)),
        mesh=mesh,
        jwks=jwks,
        config=config,
        credentials=MappingProxyType(credentials),
        volumes=_volume_mounts(objects.values("PersistentVolume"), objects.values("PersistentVolumeClaim"), workloads),
        endpoint_slices=MappingProxyType(endpoint_slices),
        nodes=MappingProxyType(nodes),
        namespaces=MappingProxyType(namespaces),
        selection=selection,
    )


def _export_defaults(mesh: MeshConfig) -> ExportToDefaults:
    return ExportToDefaults(mesh.default_virtual_service_export_to, mesh.default_destination_rule_export_to)


def _next(objects: ObjectValues[Key], version: str, previous: Snapshot, keys: Mapping[str, list[Key]],
          mesh: MeshConfig, jwks: Mapping[str, str]) -> Snapshot:
    assert previous.selection is not None and previous.lookups is not None  # set by Snapshot.__post_init__
    selection = previous.selection
    config = ConfigSet.collect(objects, previous.config, keys.keys(), _export_defaults(mesh))

    workloads = previous.workloads
    pods = [(k.namespace, k.name) for k in keys.get("Pod", ())]
    if pods:
        workloads = _patched(previous.workloads, objects, keys["Pod"])
        selection = selection.with_pods(previous.workloads, workloads, pods)
    endpoint_slices = previous.endpoint_slices
    slices = {(k.namespace, k.name) for k in keys.get("EndpointSlice", ())}
    if slices:
        endpoint_slices = _patched(previous.endpoint_slices, objects, keys["EndpointSlice"])
        selection = selection.with_slices(previous.endpoint_slices, endpoint_slices, slices)

    services: Mapping[str, Service] = previous.services
    entries: EntryServices = {}
    hosts: set[str] = set()  # hostnames whose Service is new, gone or changed
    context = _EndpointContext(workloads, previous.nodes, previous.jobs, selection, config.workload_entries)
    if keys.keys() & _SERVICE_KINDS or _entries_pick(config.service_entries, pods, previous.workloads, workloads):
        fresh, entries = _services(objects, config, context.entry_pod_endpoints)
        for hostname in fresh.keys() | previous.services.keys():
            old, new = previous.services.get(hostname), fresh.get(hostname)
            if new is not None and old is not None and new is not old and new == old:
                fresh[hostname] = old  # an equal ServiceEntry host made anew: keep the shared object
            elif new is not old:
                hosts.add(hostname)
        services = MappingProxyType(fresh)
        selection = selection.with_services(services)

    # Kubernetes Services whose endpoints may have moved: those a changed Pod was or is selected
    # by or named in, those a changed slice belongs to, and the changed Services themselves.
    dirty = {(s.namespace, s.name) for h in hosts if (s := services.get(h)) is not None and not s.external_host}
    for key in slices:
        dirty.update((s.namespace, s.service) for s in (previous.endpoint_slices.get(key), endpoint_slices.get(key))
                     if s is not None)
    if "WorkloadEntry" in keys:  # Services may select them: those of their namespaces, with a selector
        for namespace in {k.namespace for k in keys["WorkloadEntry"]}:
            dirty.update((namespace, s.name) for s in selection.namespaces.get(namespace, ()) if s.selector)
    for namespace, name in pods:
        old_pod, new_pod = previous.workloads.get((namespace, name)), workloads.get((namespace, name))
        for service in selection.namespaces.get(namespace, ()):
            if (_selects(service, old_pod) or _selects(service, new_pod)
                    or any(e.pod == name for s in selection.slices.get((namespace, service.name), ())
                           for e in s.endpoints)):
                dirty.add((namespace, service.name))

    endpoints = dict(previous.endpoints)
    changed_keys: set[EndpointKey] = set()  # whose endpoints or Service changed
    for hostname in hosts:
        for either in (previous.services.get(hostname), services.get(hostname)):
            for port in either.ports if either is not None else ():
                changed_keys.add((hostname, port.port))
                endpoints.pop((hostname, port.port), None)

    def put(key: EndpointKey, new: Iterable[Endpoint]) -> None:
        endpoints[key] = kept = _kept(previous.endpoints.get(key), new)
        if kept is not previous.endpoints.get(key):
            changed_keys.add(key)

    for hostname, (_, by_port) in entries.items():
        for port_number, entry_endpoints in by_port.items():
            put((hostname, port_number), entry_endpoints)
    for namespace, name in dirty:
        for service in selection.namespaces.get(namespace, ()):
            if service.name == name and services.get(service.hostname) is service:
                for port in service.ports:
                    put((service.hostname, port.port), context.endpoints(service, port))

    credentials = MappingProxyType(_credentials(objects)) if "Secret" in keys else previous.credentials
    # A Gateway's Programmed condition depends on its Service's endpoints (Pods, slices).
    if keys.keys() & (GATEWAY_API_KINDS | _SERVICE_KINDS | {"Secret", "ConfigMap"}) or (
            config.has_gateway_api and keys.keys() & {"Pod", "EndpointSlice"}):
        config = _with_gateway_api(config, services, endpoints, credentials, previous.namespaces)

    volumes = previous.volumes
    if (keys.keys() & {"PersistentVolume", "PersistentVolumeClaim"}
            or any(w.claims for k in pods for w in (previous.workloads.get(k), workloads.get(k)) if w is not None)):
        volumes = _volume_mounts(objects.values("PersistentVolume"), objects.values("PersistentVolumeClaim"), workloads)
    return Snapshot(
        version=version,
        services=services,
        endpoints=MappingProxyType(endpoints),
        workloads=workloads,
        jobs=previous.jobs,
        cronjobs=MappingProxyType(_cronjobs(objects)) if "CronJob" in keys else previous.cronjobs,
        mesh=mesh,
        jwks=jwks,
        config=config,
        credentials=credentials,
        volumes=volumes,
        endpoint_slices=endpoint_slices,
        nodes=previous.nodes,
        namespaces=previous.namespaces,
        lookups=previous.lookups.updated(previous, services, endpoints, hosts, changed_keys),
        selection=selection,
    )


def _with_gateway_api(config: ConfigSet, services: Mapping[str, Service],
                      endpoints: Mapping[EndpointKey, tuple[Endpoint, ...]],
                      credentials: Mapping[tuple[str, str], TlsCredential], namespaces: Mapping[str, Namespace]) -> ConfigSet:
    """The Gateway API objects converted to Istio's Gateways and VirtualServices, with their status."""
    if not config.has_gateway_api:
        return config.with_gateway_api(GatewayApiConfig())
    return config.with_gateway_api(convert_gateway_api(
        config.gateway_classes, config.kubernetes_gateways,
        (*config.http_routes, *config.grpc_routes, *config.tcp_routes, *config.tls_routes), config.reference_grants, services.values(),
        endpoints, credentials, namespaces, config.config_maps, config.backend_tls_policies,
        config.service_entries, config.backend_traffic_policies))


def _services(objects: ObjectValues[Key], config: ConfigSet,
              pod_endpoints: PodEndpoints) -> tuple[dict[str, Service], EntryServices]:
    """Kubernetes Services and ServiceEntry hosts by hostname, and the hosts' own endpoints."""
    services = {s.hostname: s for s in objects.values("Service")}
    entries = service_entry_services(config, services, pod_endpoints)
    services.update({hostname: service for hostname, (service, _) in entries.items()})
    return services, entries


def _patched(before: Mapping[tuple[str, str], Any], objects: ObjectValues[Key],
             keys: Iterable[Key]) -> Mapping[tuple[str, str], Any]:
    """A copy of a (namespace, name) map with the changed keys' current values (gone when deleted)."""
    result = dict(before)
    for key in keys:
        stored = objects.get(key)
        if stored is None:
            result.pop((key.namespace, key.name), None)
        else:
            result[(key.namespace, key.name)] = stored.value
    return MappingProxyType(result)


def _kept(old: tuple[Endpoint, ...] | None, new: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    """The previous tuple object while it stays equal, so caches keyed on identity stay warm."""
    endpoints = tuple(new)
    return old if old == endpoints and old is not None else endpoints


def _entries_pick(entries: Iterable[ServiceEntry], pods: Iterable[tuple[str, str]],
                  before: Mapping[tuple[str, str], Workload], after: Mapping[tuple[str, str], Workload]) -> bool:
    """Whether a ServiceEntry's workloadSelector picked or picks one of the changed Pods (its
    endpoints then move; recomputing every entry's is cheap next to the Services' own)."""
    selecting = [e for e in entries if e.workload_selector]
    for key in pods if selecting else ():
        for pod in (before.get(key), after.get(key)):
            if pod is not None and any(e.meta.namespace == pod.namespace
                                       and selector_matches(e.workload_selector, pod.label_map()) for e in selecting):
                return True
    return False


def _selects(service: Service, workload: Workload | None) -> bool:
    return bool(service.selector) and workload is not None and all(label in workload.labels for label in service.selector)


def _nodes(objects: ObjectValues[Key]) -> dict[str, Locality]:
    return {n.name: n.locality for n in objects.values("Node") if isinstance(n, Node)}


def _cronjobs(objects: ObjectValues[Key]) -> dict[tuple[str, str], CronJob]:
    return {(c.namespace, c.name): c for c in objects.values("CronJob")}


def _credentials(objects: ObjectValues[Key]) -> dict[tuple[str, str], TlsCredential]:
    return {(c.namespace, c.name): c for c in objects.values("Secret")}


class _EndpointContext:
    def __init__(
        self,
        workloads: Mapping[tuple[str, str], Workload],
        nodes: Mapping[str, Locality],
        jobs: Mapping[tuple[str, str], Job],
        selection: Selection,
        workload_entries: tuple[WorkloadEntry, ...],
    ) -> None:
        self.workloads = workloads
        self.nodes = nodes
        self.jobs = jobs
        self.selection = selection
        self.workload_entries = workload_entries

    def endpoints(self, service: Service, port: Port) -> list[Endpoint]:
        """From the Service's EndpointSlices when it has some, else the Pods its selector picks; and
        the WorkloadEntries its selector picks, as Istio's registry adds them."""
        if service.external_name:  # an alias (istiod's): the service it names has the endpoints
            return []
        slices = self.selection.slices.get((service.namespace, service.name))
        found = self.slice_endpoints(service, port, slices) if slices else self.selected_endpoints(service, port)
        return found + self.entry_endpoints(service, port)

    def entry_endpoints(self, service: Service, port: Port) -> list[Endpoint]:
        """The labelled WorkloadEntries of the Service's namespace its selector picks: at the entry's
        port named as the targetPort (a named targetPort the entry lacks leaves it out), else as the
        Service's port, else the targetPort's number."""
        if not service.selector or not self.workload_entries:
            return []
        result = []
        for entry in self.workload_entries:
            if (entry.meta.namespace != service.namespace or not entry.labels or not entry.address
                    or not selector_matches(service.selector, dict(entry.labels))):
                continue
            ports = dict(entry.ports)
            number = (ports.get(port.target_port) if isinstance(port.target_port, str)
                      else ports.get(port.name) or port.target_port or port.port)
            if number:
                result.append(workload_entry_endpoint(entry, number, port.port, service.namespace))
        return result

    def serving(self, workload: Workload) -> bool:
        """Pods that finished (their own phase, or their Job's) leave the endpoints entirely."""
        if workload.terminal:
            return False
        owner = workload.owner
        if owner is not None and owner.kind == "Job":
            job = self.jobs.get((workload.namespace, owner.name))
            return not (job and job.finished)
        return True

    def endpoint(self, workload: Workload | None, address: str, port: int, service_port: int,
                 ready: bool, node_name: str, zone: str, namespace: str) -> Endpoint:
        if workload is None:
            locality = self.nodes.get(node_name) or Locality(zone=zone)
            return Endpoint(address, port, service_port, ready, locality, namespace=namespace, kube=True)
        return Endpoint(
            address=address,
            port=port,
            service_port=service_port,
            healthy=ready,
            locality=workload.locality(self.nodes.get(node_name or workload.node_name)),
            labels=workload.labels,
            service_account=workload.service_account,
            workload_name=workload.workload_name,
            workload_kind=workload.workload_kind,
            pod=workload.name,
            namespace=workload.namespace,
            network=dict(workload.labels).get(NETWORK_LABEL, ""),
            kube=True,
        )

    def slice_endpoints(self, service: Service, port: Port, slices: Iterable[EndpointSlice]) -> list[Endpoint]:
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
                            workload, address, number, port.port, e.ready, e.node_name, e.zone, service.namespace
                        )
        return [result[k] for k in sorted(result)]

    def picked(self, namespace: str, selector: Labels) -> Iterable[Workload]:
        """The serving Pods with an IP of the namespace that a (non-empty) selector picks."""
        candidates = min((self.selection.labelled(namespace, label) for label in selector), key=len)
        return (w for w in candidates
                if w.ip and self.serving(w) and selector_matches(selector, w.label_map()))

    def selected_endpoints(self, service: Service, port: Port) -> list[Endpoint]:
        """No EndpointSlices: the Pods the selector picks, as the endpoints controller would."""
        if not service.selector:
            return []
        result = []
        for workload in self.picked(service.namespace, service.selector):
            number = workload.container_port(port.target_port or port.port)
            if number is None:
                continue
            result.append(self.endpoint(workload, workload.ip, number, port.port, workload.ready, "", "",
                                        service.namespace))
        result.sort(key=lambda e: (e.address, e.port))
        return result

    def entry_pod_endpoints(self, namespace: str, selector: Labels, port: ServicePort) -> list[Endpoint]:
        """A ServiceEntry's Pods, as istiod's ServiceEntry controller makes them: the pod's IP at
        its container port named as the entry's port, else the port's targetPort or number (the
        Pod need not declare it)."""
        result = [self.endpoint(w, w.ip, dict(w.container_ports).get(port.name) or port.target_port or port.number,
                                port.number, w.ready, "", "", namespace)
                  for w in self.picked(namespace, selector)]
        result.sort(key=lambda e: (e.address, e.port))
        return result


def _volume_mounts(
    volumes: Iterable[PersistentVolume],
    claims: Iterable[PersistentVolumeClaim],
    workloads: Mapping[tuple[str, str], Workload],
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
