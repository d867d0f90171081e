"""Split-horizon EDS (istiod's EndpointsByNetworkFilter): for a proxy in one network, the endpoints
of another network that has gateways are replaced by those gateways, weighted by the endpoints
behind each. Only mTLS endpoints cross (the gateway routes by the SNI of Istio's mTLS); a network
without a gateway keeps its endpoints as they are, as istiod does for sidecars. A Kubernetes
endpoint without a network of its own is in the network of istiod's namespace's label, else
meshNetworks' `fromRegistry` network, else its `fromCidr` one (a WorkloadEntry's is its own, as
istiod's)."""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
from collections import defaultdict

from istiod.model.entries import TLS_MODE_LABEL
from istiod.model.mesh import MeshConfig, NetworkCidr, NetworkGateway
from istiod.model.service import NETWORK_LABEL, Endpoint, Locality, Service
from istiod.model.snapshot import Snapshot


def by_network(endpoint_list: tuple[Endpoint, ...], network: str, mesh: MeshConfig,
               default_network: str = "", view: tuple[str, ...] = ()) -> tuple[Endpoint, ...]:
    """What a proxy in `network` ("" when its NETWORK is unset) is sent; `default_network`: the
    label of istiod's namespace; `view`: its REQUESTED_NETWORK_VIEW, the networks whose endpoints
    it sees at all (with those in none), as istiod's ProxyView. Without gateways the mesh is one
    network and only the view changes anything."""
    gateways = mesh.network_gateways
    if not gateways and not view:
        return endpoint_list
    if default_network or mesh.registry_network or mesh.network_cidrs:
        endpoint_list = tuple(e if e.network or not e.kube else dataclasses.replace(
            e, network=endpoint_network(e.address, mesh, default_network)) for e in endpoint_list)
    if view:
        endpoint_list = tuple(e for e in endpoint_list if not e.network or e.network in view)
    if not gateways:
        return endpoint_list
    per_network: dict[str, list[NetworkGateway]] = defaultdict(list)
    for gateway in gateways:
        per_network[gateway.network].append(gateway)
    # Scaled by the lcm of gateway counts so an endpoint's weight splits evenly among its gateways.
    scale = math.lcm(*(len(g) for g in per_network.values()))
    result: list[Endpoint] = []
    weights: dict[tuple[Locality, NetworkGateway], int] = defaultdict(int)
    for endpoint in endpoint_list:
        if not endpoint.healthy:
            continue
        weight = (endpoint.weight or 1) * scale
        remote = per_network.get(endpoint.network, []) if endpoint.network not in ("", network) else []
        if not remote:  # same network, or one reached directly
            result.append(dataclasses.replace(endpoint, weight=weight) if scale > 1 else endpoint)
        elif dict(endpoint.labels).get(TLS_MODE_LABEL) == "istio":
            for gateway in remote:
                weights[endpoint.locality, gateway] += weight // len(remote)
    for (where, gateway), weight in sorted(weights.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        result.append(Endpoint(address=gateway.address, port=gateway.port, service_port=0, locality=where,
                               labels=((TLS_MODE_LABEL, "istio"),), network=gateway.network, weight=weight))
    return tuple(result)


def endpoint_network(address: str, mesh: MeshConfig, default_network: str = "") -> str:
    """The network of an endpoint that names none, in istiod's kube registry's order: the label of
    istiod's namespace, meshNetworks' `fromRegistry` (our cluster's endpoints), the first `fromCidr`
    holding its IP, else none."""
    if default_network or mesh.registry_network:
        return default_network or mesh.registry_network
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return ""
    return next((c.network for c in mesh.network_cidrs if ip in _cidr(c)), "")


@functools.lru_cache(maxsize=256)
def _cidr(cidr: NetworkCidr) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(cidr.cidr, strict=False)


GATEWAY_PORT_LABEL = "networking.istio.io/gatewayPort"  # Istio's label.NetworkingGatewayPort
DEFAULT_GATEWAY_PORT = 15443  # istiod's DefaultNetworkGatewayPort (the AUTO_PASSTHROUGH mTLS port)


def with_service_gateways(snapshot: Snapshot) -> MeshConfig:
    """The mesh config with the gateways of Services labelled `topology.istio.io/network` (as
    istiod's kube registry): each external address on the `networking.istio.io/gatewayPort`
    label's port (15443 by default), when the Service has that port. A gateway named by a hostname
    is a gateway at each address it resolved to (none yet: left out), as istiod's
    RESOLVE_HOSTNAME_GATEWAYS."""
    found = {*snapshot.mesh.network_gateways,
             *(gateway for service in snapshot.services.values() for gateway in service_gateways(service))}
    if found == set(snapshot.mesh.network_gateways) and all(_is_ip(g.address) for g in found):
        return snapshot.mesh
    resolved = dict(snapshot.mesh.gateway_addresses)
    gateways = {g for g in found if _is_ip(g.address)} | {
        NetworkGateway(g.network, ip, g.port) for g in found if not _is_ip(g.address) for ip in resolved.get(g.address, ())}
    return dataclasses.replace(snapshot.mesh, network_gateways=tuple(sorted(gateways)))


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def gateway_hostnames(snapshot: Snapshot) -> frozenset[str]:
    """The hostnames network gateways are named by (meshNetworks' addresses, Services' load balancers)."""
    return frozenset(g.address for g in (*snapshot.mesh.network_gateways,
                                         *(g for s in snapshot.services.values() for g in service_gateways(s)))
                     if not _is_ip(g.address))


def service_gateways(service: Service) -> tuple[NetworkGateway, ...]:
    labels = dict(service.labels)
    if not (name := labels.get(NETWORK_LABEL, "")):
        return ()
    text = labels.get(GATEWAY_PORT_LABEL, "")
    number = int(text) if text.isdigit() else DEFAULT_GATEWAY_PORT  # istiod: unparsable, its default
    if service.port(number) is None:  # istiod: labelled, but does not listen on the gateway port
        return ()
    return tuple(NetworkGateway(name, address, number) for address in service.external_addresses)


def system_network(snapshot: Snapshot) -> str:
    """The cluster's default network: the `topology.istio.io/network` label of istiod's namespace."""
    namespace = snapshot.namespaces.get(snapshot.mesh.system_namespace)
    return dict(namespace.labels).get(NETWORK_LABEL, "") if namespace is not None else ""
