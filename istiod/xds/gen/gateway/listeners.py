"""LDS for gateways: a listener `<bind or 0.0.0.0>_<port>` per server port that binds for real.

Plaintext HTTP servers of a port share one filter chain whose routes come from RDS `http.<port>`.
HTTPS (SIMPLE) servers get a filter chain each, matched by SNI on their hosts, terminating TLS with
the certificate of `kubernetes://<credentialName>` over SDS on the ADS stream; their routes come
from RDS `https.<port>.<portName>.<gateway>.<namespace>`, as istiod names them. MUTUAL and
OPTIONAL_MUTUAL servers verify clients with `kubernetes://<credentialName>-cacert`.

TCP and TLS servers share a port with HTTPS ones: a TCP server is one chain to where the first
matching VirtualService `tcp` route sends; a TLS server terminating TLS is that chain behind its
certificate, matched by SNI; a PASSTHROUGH server (TLS or HTTPS) gets a chain per matching `tls`
route, by its `sniHosts`, that never opens the TLS (istiod's createGatewayTCPFilterChainOpts); an
AUTO_PASSTHROUGH server a chain per mesh service port and subset its hosts admit, by the SNI
`outbound_.<port>_.<subset>_.<host>` and Istio's mTLS ALPNs, to the SNI-DNAT cluster of that name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.filters.listener.tls_inspector.v3 import tls_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from istiod import logs
from istiod.model.config.networking import ServerTLSMode, TunnelSettings
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.filters import (
    HCM_FILTER, ads_source, http_connection_manager, l4_proxy, network_filter, pack, with_fault_filter,
)
from istiod.xds.gen.gateway.servers import GatewayServer, bound_hosts, servers_by, sni_dnat_names
from istiod.xds.gen.routes import L4Destinations, gateway_tcp_destinations, gateway_tls_destinations
from istiod.xds.gen.security import workload_policy
from istiod.xds.gen.targets import destination_rule, tunnel_lookup
from istiod.xds.gen.tls import HTTP_ALPN, MESH_ALPN_MATCH, TLS_TRANSPORT_SOCKET, sds_downstream_tls, server_tls

TLS_INSPECTOR_FILTER = "envoy.filters.listener.tls_inspector"
log = logging.getLogger(__name__)
_duplicate = logs.Throttled(log, 60.0)  # every push meets the same routes again
_empty = logs.Throttled(log, 60.0)

# A TCP or TLS server's routes: (SNI names, where they send, the DestinationRule's tunnel) per filter chain.
L4Chains = tuple[tuple[tuple[str, ...], L4Destinations, TunnelSettings | None], ...]


def listeners(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    result = []
    # The AuthorizationPolicies and RequestAuthentications selecting the gateway's pod, on every
    # HTTP chain, as istiod's gateway builder adds them.
    policy = workload_policy(snapshot, proxy)
    for name, group in servers_by(snapshot, proxy, lambda s: s.listener_name):
        if names is None or name in names:
            gateways = tuple(dict.fromkeys(s.gateway for s in group))
            l4, depends_on = l4_chains(snapshot, proxy, group)
            if all(not (s.plaintext_http or s.tls) and not l4[s] for s in group):
                # Envoy refuses a listener without filter chains; istiod leaves it out too.
                _empty.warning(logs.event("gateway listener left out: no VirtualService tcp or tls route matches",
                                              listener=name, gateway=",".join(s.ref for s in group)))
                continue
            result.append(cache.get(
                types.LISTENER, name, (*gateways, *policy.authorization, *policy.request_auth, *depends_on),
                lambda: gateway_listener(name, group, policy.http_filters(f"gateway listener {name}", clear_route_cache=True),
                                         l4),
                scope=",".join(str(g.meta) for g in gateways) + ":" + policy.scope))
    return result


def l4_chains(snapshot: Snapshot, proxy: Proxy,
              servers: tuple[GatewayServer, ...]) -> tuple[dict[GatewayServer, L4Chains], tuple[object, ...]]:
    """The chains of a listener's TCP and TLS servers, and what they depend on (for the cache: the
    bound VirtualServices, their destinations' Services and DestinationRules). An SNI name already
    taken on the listener leaves the later match out, with a warning, as istiod (Envoy refuses two
    chains alike). AUTO_PASSTHROUGH chains never tunnel, as istiod's."""
    chains: dict[GatewayServer, L4Chains] = {}
    depends_on: list[object] = []
    taken: set[str] = set()
    tunnel_of = tunnel_lookup(snapshot, proxy)
    for served in servers:
        if served.plaintext_http or served.tls:
            continue
        bound = list(dict.fromkeys(vs for _, vs in bound_hosts(snapshot, proxy, served)))
        depends_on += bound
        destinations = [snapshot.services.get(r.destination.host)
                        for vs in bound for route in (*vs.tcp, *vs.tls) for r in route.route]
        depends_on += destinations
        depends_on += [destination_rule(snapshot, proxy, s) for s in destinations if s is not None]
        if served.auto_passthrough:
            chains[served] = tuple(((name,), [(name, 0)], None) for name in sni_dnat_names(snapshot, proxy, served))
            continue
        if not served.passthrough:
            sent = gateway_tcp_destinations(bound, served.port, served.ref, snapshot.services)
            names = tuple(served.server_names) if served.terminates else ()
            chains[served] = ((names, sent, tunnel_of(sent)),) if sent else ()
            continue
        found = []
        for vs, names, sent in gateway_tls_destinations(bound, served.port, served.ref, snapshot.services):
            if taken.intersection(names):
                _duplicate.warning(logs.event("tls route left out: duplicate SNI host names", gateway=served.ref,
                                              virtual_service=str(vs.meta), sni_hosts=",".join(sorted(taken & set(names)))))
                continue
            taken.update(names)
            # `*`: any name (a TLSRoute without hostnames)
            found.append(((), sent, tunnel_of(sent)) if "*" in names else (names, sent, tunnel_of(sent)))
        chains[served] = tuple(found)
    return chains, tuple(depends_on)


def gateway_listener(name: str, servers: tuple[GatewayServer, ...],
                     http_filters: tuple[hcm_pb2.HttpFilter, ...] = (),
                     l4: Mapping[GatewayServer, L4Chains] | None = None) -> listener_pb2.Listener:
    """`http_filters`: what runs before the fault filter and router (JWT, authorization); `l4`:
    the chains of the TCP and TLS servers (l4_chains)."""
    first = servers[0]
    listener = listener_pb2.Listener(
        name=name,
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=first.address,
                                                                             port_value=first.listen_port)),
        traffic_direction=base_pb2.OUTBOUND,
    )
    if first.route_name is not None and first.plaintext_http:
        listener.filter_chains.append(listener_components_pb2.FilterChain(
            filters=[_hcm(name, first.route_name, http_filters)]))
        return listener
    for served in servers:
        if served.tls:
            assert served.route_name is not None
            listener.filter_chains.append(listener_components_pb2.FilterChain(
                name=served.route_name,
                filter_chain_match=listener_components_pb2.FilterChainMatch(server_names=served.server_names),
                transport_socket=_transport_socket(served),
                filters=[_hcm(name, served.route_name, http_filters)],
            ))
            continue
        for names, sent, tunnel in (l4 or {}).get(served, ()):
            chain = listener_components_pb2.FilterChain(filters=[l4_proxy(sent[0][0], sent, tunnel)])
            if names:
                chain.filter_chain_match.server_names.extend(names)
            if served.terminates:
                chain.transport_socket.CopyFrom(_transport_socket(served))
            if served.auto_passthrough:  # mesh mTLS only, as istiod: a peer that speaks Istio's ALPN
                chain.filter_chain_match.application_protocols.extend(MESH_ALPN_MATCH)
            listener.filter_chains.append(chain)
    if any(c.filter_chain_match.server_names or c.HasField("transport_socket") for c in listener.filter_chains):
        listener.listener_filters.append(listener_components_pb2.ListenerFilter(
            name=TLS_INSPECTOR_FILTER, typed_config=pack(tls_inspector_pb2.TlsInspector())))
    return listener


def _transport_socket(served: GatewayServer) -> base_pb2.TransportSocket:
    if served.mesh_tls:
        # The workload certificate and root from the agent's SDS (`default`, `ROOTCA`), as a sidecar's
        # inbound; subjectAltNames restrict the client identities, caCrl (a file in the pod) revokes some.
        assert served.server.tls is not None
        return sds_downstream_tls(HTTP_ALPN, served.server.tls.subject_alt_names, served.server.tls.ca_crl)
    # The credential's certificate; a client certificate verified by `<credential>-cacert` for MUTUAL
    # (required) and OPTIONAL_MUTUAL (asked for). HTTP's ALPN on HTTPS servers only.
    tls = served.server.tls
    assert tls is not None
    context = server_tls(tls, HTTP_ALPN if served.tls else (), served.credentials, served.ca_credential)
    return base_pb2.TransportSocket(name=TLS_TRANSPORT_SOCKET, typed_config=pack(context))


def _hcm(listener: str, route_name: str, http_filters: tuple[hcm_pb2.HttpFilter, ...]) -> listener_components_pb2.Filter:
    """istiod's gateway HCM: the client's address is the peer's (a gateway is the edge), paths
    normalised, websockets pass, VirtualService faults and CORS policies act; a client's certificate
    (MUTUAL) is told to the backend in x-forwarded-client-cert, one from the client dropped
    (istiod's SANITIZE_SET default)."""
    rds = hcm_pb2.Rds(config_source=ads_source(initial_fetch_timeout=duration_pb2.Duration()),
                      route_config_name=route_name)
    return network_filter(HCM_FILTER, with_fault_filter(http_connection_manager(
        http_filters,
        stat_prefix=f"outbound_{listener}",
        rds=rds,
        use_remote_address=wrappers_pb2.BoolValue(value=True),
        normalize_path=wrappers_pb2.BoolValue(value=True),
        upgrade_configs=[hcm_pb2.HttpConnectionManager.UpgradeConfig(upgrade_type="websocket")],
        forward_client_cert_details=hcm_pb2.HttpConnectionManager.SANITIZE_SET,
        set_current_client_cert_details=hcm_pb2.HttpConnectionManager.SetCurrentClientCertDetails(
            subject=wrappers_pb2.BoolValue(value=True), cert=True, dns=True, uri=True),
    ), cors=True))
