"""Pods, WorkloadEntries, ServiceEntry endpoints and Services -> istio.workload.Address, as istiod's
ambient index builds them (pilot/pkg/serviceregistry/kube/controller/ambient/). Pure.

Resource names: a workload's uid (`<cluster>//Pod/<ns>/<name>`,
`<cluster>/networking.istio.io/WorkloadEntry/<ns>/<name>`,
`<cluster>/networking.istio.io/ServiceEntry/<ns>/<name>/<address>`), a service's `<ns>/<hostname>`.
Addresses are `<network>/<IP>` (one network here: the network is empty).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from istiod.gen.istio.workload import workload_pb2 as pb
from istiod.model.config.common import selector_matches
from istiod.model.config.gateway_api import USE_WAYPOINT_LABEL, Waypoint
from istiod.model.config.gateway_conversion import GATEWAY_NAME_LABEL  # on a waypoint's own pods
from istiod.model.config.networking import Resolution, ServiceEntry, WorkloadEntry
from istiod.model.mesh import DEFAULT_TRUST_DOMAIN, MeshConfig
from istiod.model.names import DEFAULT_CLUSTER_ID
from istiod.model.protocol import Protocol, parse, port_protocol
from istiod.model.service import Locality, Service
from istiod.model.snapshot import Snapshot
from istiod.model.workload import AMBIENT_REDIRECTION_ANNOTATION, WORKLOAD_NAME_LABEL, Workload
from istiod.xds.gen.ztunnel.policies import workload_policies

USE_WAYPOINT_NAMESPACE_LABEL = "istio.io/use-waypoint-namespace"
TUNNEL_LABEL = "networking.istio.io/tunnel"  # `http`: the workload terminates HBONE itself
MANAGED_LABEL = "gateway.istio.io/managed"
MESH_CONTROLLER = "istio.io-mesh-controller"  # the value of MANAGED_LABEL on what istiod deploys for a waypoint
HBONE_PORT = 15008


def pod_uid(namespace: str, name: str, cluster: str = DEFAULT_CLUSTER_ID) -> str:
    return f"{cluster}//Pod/{namespace}/{name}"


def workload_entry_uid(namespace: str, name: str, cluster: str = DEFAULT_CLUSTER_ID) -> str:
    return f"{cluster}/networking.istio.io/WorkloadEntry/{namespace}/{name}"


def entry_endpoint_uid(namespace: str, name: str, address: str, cluster: str = DEFAULT_CLUSTER_ID) -> str:
    return f"{cluster}/networking.istio.io/ServiceEntry/{namespace}/{name}/{address}"


def service_name(namespace: str, hostname: str) -> str:
    return f"{namespace}/{hostname}"


def trust_domain(mesh: MeshConfig) -> str:
    """Sent only when it is not the default (ztunnel assumes cluster.local), as istiod does."""
    return "" if mesh.trust_domain == DEFAULT_TRUST_DOMAIN else mesh.trust_domain


def canonical_service(labels: Mapping[str, str], workload_name: str) -> tuple[str, str]:
    """Istio's canonical service name and revision of a workload's labels."""
    name = (labels.get("service.istio.io/canonical-name") or labels.get("app.kubernetes.io/name")
            or labels.get("app") or workload_name)
    revision = (labels.get("service.istio.io/canonical-revision") or labels.get("app.kubernetes.io/version")
                or labels.get("version") or "latest")
    return name, revision


def _ip(address: str) -> bytes | None:
    try:
        return ipaddress.ip_address(address).packed
    except ValueError:
        return None


def _locality(locality: Locality) -> pb.Locality | None:
    if not (locality.region or locality.zone or locality.subzone):
        return None
    return pb.Locality(region=locality.region, zone=locality.zone, subzone=locality.subzone)


def _gateway_address(waypoint: Waypoint) -> pb.GatewayAddress:
    """By hostname: the waypoint Gateway's status address (its Service's), as istiod prefers it."""
    return pb.GatewayAddress(hostname=pb.NamespacedHostname(namespace=waypoint.meta.namespace,
                                                           hostname=waypoint.hostname),
                             hbone_mtls_port=HBONE_PORT)


def waypoint_for(snapshot: Snapshot, namespace: str, labels: Mapping[str, str], traffic: str) -> pb.GatewayAddress | None:
    """As istiod's ambient index: the waypoint Gateway that `istio.io/use-waypoint` (with
    `istio.io/use-waypoint-namespace`) names on the object, or else on its namespace (`none` on the
    object opts out), if it is programmed, its HBONE listener's allowedRoutes admit the object's
    namespace and it takes this kind of traffic (`service` or `workload`; `all` takes both). A
    waypoint's own Service and pods have none."""
    waypoints = snapshot.config.gateway_api.waypoints
    if labels.get(MANAGED_LABEL) == MESH_CONTROLLER or (namespace, labels.get(GATEWAY_NAME_LABEL, "")) in waypoints:
        return None
    namespace_labels = dict(_namespace_labels(snapshot, namespace))
    source = labels if USE_WAYPOINT_LABEL in labels else namespace_labels
    name = source.get(USE_WAYPOINT_LABEL, "")
    if not name or name == "none":
        return None
    waypoint = waypoints.get((source.get(USE_WAYPOINT_NAMESPACE_LABEL) or namespace, name))
    if waypoint is None or not waypoint.admits(namespace, namespace_labels) or waypoint.traffic not in (traffic, "all"):
        return None
    return _gateway_address(waypoint)


def _namespace_labels(snapshot: Snapshot, namespace: str) -> tuple[tuple[str, str], ...]:
    found = snapshot.namespaces.get(namespace)
    return found.labels if found is not None else ()


# --- Services ----------------------------------------------------------------------------------

def kube_service(snapshot: Snapshot, service: Service) -> pb.Address:
    """A Kubernetes Service: its cluster IP (none when headless), its ports with numeric target
    ports (0 for a named one: each workload says its own), its waypoint."""
    ip = _ip(service.cluster_ip)
    result = pb.Service(
        name=service.name, namespace=service.namespace, hostname=service.hostname,
        addresses=[pb.NetworkAddress(address=ip)] if ip is not None else [],
        ports=[pb.Port(service_port=p.port, target_port=p.target_port if isinstance(p.target_port, int) else 0,
                       app_protocol=_app_protocol(port_protocol(p)))
               for p in service.ports],
        ip_families=_ip_families(service.cluster_ip),
        canonical=True,  # as istiod: a Kubernetes Service is always its hostname's
    )
    waypoint = waypoint_for(snapshot, service.namespace, dict(service.labels), "service")
    if waypoint is not None:
        result.waypoint.CopyFrom(waypoint)
    return pb.Address(service=result)


# What ztunnel is told of a port's protocol, as istiod maps it (what it would sniff is UNKNOWN).
_APP_PROTOCOLS = {Protocol.HTTP: pb.HTTP11, Protocol.HTTP2: pb.HTTP2, Protocol.GRPC: pb.GRPC, Protocol.TLS: pb.TLS,
                  Protocol.HTTPS: pb.TLS, Protocol.TCP: pb.TCP}


def _app_protocol(protocol: Protocol) -> pb.AppProtocol:
    return _APP_PROTOCOLS.get(protocol, pb.UNKNOWN)


def _ip_families(cluster_ip: str) -> pb.IPFamilies:
    try:
        version = ipaddress.ip_address(cluster_ip).version
    except ValueError:
        return pb.AUTOMATIC  # headless: the API server's ipFamilies are not read here
    return pb.IPV4_ONLY if version == 4 else pb.IPV6_ONLY


def entry_services(snapshot: Snapshot, entry: ServiceEntry, canonical: frozenset[str] = frozenset()
                   ) -> list[tuple[str, pb.Address]]:
    """A ServiceEntry's hosts, each a service with the entry's addresses, ports and SANs; `canonical`:
    its hosts for which it is the service ztunnel prefers (see canonical_hosts)."""
    addresses = [pb.NetworkAddress(address=network.network_address.packed, length=network.prefixlen)
                 if network.prefixlen != network.max_prefixlen else pb.NetworkAddress(address=network.network_address.packed)
                 for network in _networks(entry.addresses)]
    ports = [pb.Port(service_port=p.number, target_port=p.target_port or p.number, app_protocol=_app_protocol(parse(p.protocol)))
             for p in entry.ports]
    waypoint = waypoint_for(snapshot, entry.meta.namespace, {}, "service")
    result = []
    for host in entry.hosts:
        service = pb.Service(name=entry.meta.name, namespace=entry.meta.namespace, hostname=host,
                             addresses=addresses, ports=ports, subject_alt_names=entry.subject_alt_names,
                             canonical=host in canonical)
        if waypoint is not None:
            service.waypoint.CopyFrom(waypoint)
        result.append((service_name(entry.meta.namespace, host), pb.Address(service=service)))
    return result


def canonical_hosts(entry: ServiceEntry, taken: set[str]) -> frozenset[str]:
    """The entry's hosts it is canonical for, as istiod picks: none that a Kubernetes Service or an
    earlier entry has (`taken`, which this adds to; istiod: the oldest entry, creation times are not
    kept), and none when it is visible in its own namespace only."""
    if entry.export_to == (".",) or entry.export_to == (entry.meta.namespace,):
        return frozenset()
    mine = frozenset(h for h in entry.hosts if h not in taken)
    taken.update(mine)
    return mine


def _networks(values: Iterable[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    result = []
    for value in values:
        try:
            result.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            continue
    return result


# --- Workloads ---------------------------------------------------------------------------------

def is_workload(pod: Workload) -> bool:
    """A Pod with an IP that has not finished. Every such pod is one (ztunnel must know who a peer
    is whatever its data plane), pending ones too (init containers may still run)."""
    return bool(pod.ip) and not pod.terminal  # the source checked it is an IP


def pod_workload(snapshot: Snapshot, pod: Workload) -> pb.Address:
    """A pod that `is_workload`; HBONE only once istio-cni redirects it (or it speaks HBONE itself)."""
    ip = ipaddress.ip_address(pod.ip).packed
    labels = pod.label_map()
    canonical_name, canonical_revision = canonical_service(labels, pod.workload_name)
    workload = pb.Workload(
        uid=pod_uid(pod.namespace, pod.name), name=pod.name, namespace=pod.namespace, addresses=[ip],
        trust_domain=trust_domain(snapshot.mesh), service_account=pod.service_account, node=pod.node_name,
        canonical_name=canonical_name, canonical_revision=canonical_revision,
        workload_type=pb.POD,  # for every pod, as istiod sends it (backwards compatibility)
        workload_name=pod.workload_name, status=pb.HEALTHY if pod.ready and not pod.terminating else pb.UNHEALTHY,
        cluster_id=DEFAULT_CLUSTER_ID, network_mode=pb.HOST_NETWORK if pod.host_network else pb.STANDARD,
        authorization_policies=_policies(snapshot, pod.namespace, labels),
    )
    _tunnel(workload, labels, dict(pod.annotations))
    for key, ports in services_of(snapshot, pod.namespace, labels, dict(pod.container_ports), {}).items():
        workload.services[key].ports.extend(ports)
    # From its Node only (istiod reads no locality label of the pod for ztunnel).
    _finish(snapshot, workload, pod.namespace, labels, snapshot.nodes.get(pod.node_name) or Locality())
    return pb.Address(workload=workload)


def _tunnel(workload: pb.Workload, labels: Mapping[str, str], annotations: Mapping[str, str]) -> None:
    if annotations.get(AMBIENT_REDIRECTION_ANNOTATION) == "enabled":
        workload.tunnel_protocol = pb.HBONE
    if labels.get(TUNNEL_LABEL) == "http":
        workload.tunnel_protocol, workload.native_tunnel = pb.HBONE, True


def _finish(snapshot: Snapshot, workload: pb.Workload, namespace: str, labels: Mapping[str, str],
            locality: Locality) -> None:
    waypoint = waypoint_for(snapshot, namespace, labels, "workload")
    if waypoint is not None:
        workload.waypoint.CopyFrom(waypoint)
    where = _locality(locality)
    if where is not None:
        workload.locality.CopyFrom(where)


def _policies(snapshot: Snapshot, namespace: str, labels: Mapping[str, str]) -> list[str]:
    config = snapshot.config
    return workload_policies(config.authorization_policies, config.peer_authentications, namespace, labels,
                             snapshot.mesh.root_namespace)


def services_of(snapshot: Snapshot, namespace: str, labels: Mapping[str, str], named: Mapping[str, int],
                entry_named: Mapping[str, int]) -> dict[str, list[pb.Port]]:
    """`ns/hostname` -> ports, of the Services of the namespace that select a workload and of the
    ServiceEntries whose workloadSelector picks it. A Service's named target port is the workload's
    port of that name in `named` (a port it does not name is left out, the service kept); a
    ServiceEntry's target is the port named as the entry's in `entry_named`, else its targetPort,
    else its number (a WorkloadEntry's ports count here; a pod's do not, as in istiod)."""
    result: dict[str, list[pb.Port]] = {}
    assert snapshot.selection is not None
    for service in snapshot.selection.namespaces.get(namespace, ()):
        if not service.selector or not selector_matches(service.selector, labels):
            continue
        ports = result[service_name(service.namespace, service.hostname)] = []
        for port in service.ports:
            target = named.get(port.target_port) if isinstance(port.target_port, str) else port.target_port
            if target is not None:
                ports.append(pb.Port(service_port=port.port, target_port=target or port.port))
    for entry in snapshot.config.service_entries:
        if entry.meta.namespace == namespace and entry.workload_selector \
                and selector_matches(entry.workload_selector, labels):
            result.update(entry_ports(entry, entry_named))
    return result


def entry_endpoints(entry: ServiceEntry) -> list[tuple[WorkloadEntry, dict[str, list[pb.Port]]]]:
    """A ServiceEntry's own endpoints and their services: inline ones in every host of it; for DNS
    resolution without endpoints or workloadSelector, each host is one, in that host only."""
    if entry.endpoints:
        return [(member, entry_ports(entry, dict(member.ports))) for member in entry.endpoints]
    if entry.workload_selector or entry.resolution not in (Resolution.DNS, Resolution.DNS_ROUND_ROBIN):
        return []
    ports = entry_ports(entry, {})
    return [(WorkloadEntry(entry.meta, address=host), {service_name(entry.meta.namespace, host):
                                                       ports[service_name(entry.meta.namespace, host)]})
            for host in entry.hosts]


def entry_ports(entry: ServiceEntry, named: Mapping[str, int]) -> dict[str, list[pb.Port]]:
    ports = [pb.Port(service_port=p.number, target_port=named.get(p.name) or p.target_port or p.number)
             for p in entry.ports]
    return {service_name(entry.meta.namespace, host): ports for host in entry.hosts}


def workload_entry(snapshot: Snapshot, member: WorkloadEntry, uid: str) -> pb.Address:
    """A standalone WorkloadEntry: its labels pick its services, policies and waypoint."""
    labels = dict(member.labels)
    ports = dict(member.ports)
    services = services_of(snapshot, member.meta.namespace, labels, ports, ports)
    name = labels.get(WORKLOAD_NAME_LABEL) or member.meta.name
    return entry_workload(snapshot, member, uid, services, name, labels)


def entry_workload(snapshot: Snapshot, member: WorkloadEntry, uid: str, services: Mapping[str, list[pb.Port]],
                   name: str, labels: Mapping[str, str]) -> pb.Address:
    """A WorkloadEntry, or a ServiceEntry endpoint (`member.meta` is the entry's, `name` the entry's
    name, `labels` the entry's: the policies and canonical name go by those). An address that is
    no IP is a hostname ztunnel resolves."""
    canonical_name, canonical_revision = canonical_service(labels, name)
    ip = _ip(member.address)
    workload = pb.Workload(
        uid=uid, name=member.meta.name, namespace=member.meta.namespace, addresses=[ip] if ip is not None else [],
        hostname="" if ip is not None else member.address, network=member.network,
        trust_domain=trust_domain(snapshot.mesh), service_account=member.service_account,
        canonical_name=canonical_name, canonical_revision=canonical_revision, workload_type=pb.POD,
        workload_name=name, status=pb.HEALTHY if member.healthy else pb.UNHEALTHY, cluster_id=DEFAULT_CLUSTER_ID,
        authorization_policies=_policies(snapshot, member.meta.namespace, labels),
    )
    if member.weight > 0:
        workload.capacity.value = member.weight
    _tunnel(workload, labels, {})
    for key, ports in services.items():
        workload.services[key].ports.extend(ports)
    # A WorkloadEntry's locality is `region/zone/subzone`.
    _finish(snapshot, workload, member.meta.namespace, dict(member.labels),
            Locality.parse(member.locality.replace("/", ".")))
    return pb.Address(workload=workload)
