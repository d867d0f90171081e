"""ServiceEntry hosts as Services, so every flavor calls them by name like Kubernetes Services.

Each host of a ServiceEntry becomes a Service whose hostname is that host (a wildcard
`*.example.com` too, as istiod's); its endpoints are the entry's (inline, or the WorkloadEntries
and Pods its workloadSelector picks), or for DNS resolution without endpoints the host itself; NONE
resolution has none (istiod's Passthrough: sidecars send to the address the client connected to).
A host a Kubernetes Service already has gives none; of two entries with one host, the first by
namespace and name wins.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from istiod.model.config import ConfigSet, scope
from istiod.model.config.common import Labels
from istiod.model.config.networking import Location, Resolution, ServiceEntry, ServicePort, WorkloadEntry
from istiod.model.service import Endpoint, Locality, Port, Service

TLS_MODE_LABEL = "security.istio.io/tlsMode"
EntryServices = dict[str, tuple[Service, dict[int, tuple[Endpoint, ...]]]]
# The endpoints of the Pods of a namespace that a workloadSelector picks, for one port of the entry.
PodEndpoints = Callable[[str, Labels, ServicePort], Sequence[Endpoint]]


def service_entry_services(config: ConfigSet, services: Mapping[str, Service],
                           pod_endpoints: PodEndpoints) -> EntryServices:
    """hostname -> (Service, service port -> endpoints)."""
    result: EntryServices = {}
    for entry in config.service_entries:
        members = scope.service_entry_endpoints(entry, config.workload_entries)
        ports = tuple(Port(p.name, p.number, target_port=p.target_port, app_protocol=p.protocol.lower())
                      for p in entry.ports)
        pods = {p.number: tuple(pod_endpoints(entry.meta.namespace, entry.workload_selector, p))
                for p in entry.ports} if entry.workload_selector else {}
        for host in entry.hosts:
            if host in services or host in result:
                continue
            service = Service(
                name=entry.meta.name, namespace=entry.meta.namespace, domain="", ports=ports,
                external_host=host, resolution=entry.resolution,
                mesh_external=entry.location is Location.MESH_EXTERNAL,
                export_to=entry.export_to, subject_alt_names=entry.subject_alt_names,
                # Its first address is its VIP, as a ClusterIP is; a CIDR (istiod's listeners
                # match it on the port's 0.0.0.0 listener), a /32 or /128 one as its address.
                cluster_ip=_address(entry.addresses[0]) if entry.addresses else "",
            )
            result[host] = (service, {p.number: _endpoints(entry, host, p, members, pods.get(p.number, ()))
                                      for p in entry.ports})
    return result


def _address(address: str) -> str:
    ip, slash, bits = address.partition("/")
    return ip if slash and bits == ("128" if ":" in ip else "32") else address


def _endpoints(entry: ServiceEntry, host: str, port: ServicePort, members: tuple[WorkloadEntry, ...],
               pods: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
    if entry.resolution is Resolution.NONE:
        return ()
    if not members and not pods and entry.resolution is not Resolution.STATIC:
        return (Endpoint(host, port.target_port or port.number, port.number, namespace=entry.meta.namespace),)
    return tuple(workload_entry_endpoint(member, dict(member.ports).get(port.name) or port.target_port or port.number,
                                         port.number, entry.meta.namespace)
                 for member in members) + pods


def workload_entry_endpoint(entry: WorkloadEntry, port: int, service_port: int, namespace: str) -> Endpoint:
    """A WorkloadEntry serving a port: with Istio's TLS mode (its `security.istio.io/tlsMode` label,
    else `istio` when it names a service account: a mesh workload), its locality and weight."""
    labels = entry.labels
    if entry.service_account and TLS_MODE_LABEL not in dict(labels):
        labels = (*labels, (TLS_MODE_LABEL, "istio"))
    return Endpoint(address=entry.address, port=port, service_port=service_port,
                    # Its `locality` is `region/zone/subzone` (the label's form uses dots).
                    locality=Locality.parse(entry.locality.replace("/", ".")), labels=labels,
                    service_account=entry.service_account, namespace=namespace, weight=entry.weight,
                    network=entry.network, healthy=entry.healthy)
