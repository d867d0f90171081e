"""LDS for gateways: a listener `<bind or 0.0.0.0>_<port>` per server port that binds for real.

Plaintext HTTP servers of a port share one filter chain whose routes come from RDS `http.<port>`.
HTTPS (SIMPLE) servers get a filter chain each, matched by SNI on their hosts, terminating TLS with
the certificate of `kubernetes://<credentialName>` over SDS on the ADS stream; their routes come
from RDS `https.<port>.<portName>.<gateway>.<namespace>`, as istiod names them.
"""

from __future__ import annotations

from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.filters.listener.tls_inspector.v3 import tls_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.filters import (
    HCM_FILTER, ads_source, http_connection_manager, network_filter, pack, with_fault_filter,
)
from istiod.xds.gen.gateway.servers import GatewayServer, servers_by
from istiod.xds.gen.security import workload_policy
from istiod.xds.gen.tls import HTTP_ALPN, TLS_TRANSPORT_SOCKET

TLS_INSPECTOR_FILTER = "envoy.filters.listener.tls_inspector"
# Istio's minProtocolVersion/maxProtocolVersion values -> Envoy's.
TLS_VERSIONS = {
    "TLS_AUTO": common_pb2.TlsParameters.TLS_AUTO, "TLSV1_0": common_pb2.TlsParameters.TLSv1_0,
    "TLSV1_1": common_pb2.TlsParameters.TLSv1_1, "TLSV1_2": common_pb2.TlsParameters.TLSv1_2,
    "TLSV1_3": common_pb2.TlsParameters.TLSv1_3,
}


def listeners(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    result = []
    # The AuthorizationPolicies and RequestAuthentications selecting the gateway's pod, on every
    # HTTP chain, as istiod's gateway builder adds them.
    policy = workload_policy(snapshot, proxy)
    for name, group in servers_by(snapshot, proxy, lambda s: s.listener_name):
        if names is None or name in names:
            gateways = tuple(dict.fromkeys(s.gateway for s in group))
            result.append(cache.get(
                types.LISTENER, name, (*gateways, *policy.authorization, *policy.request_auth),
                lambda: gateway_listener(name, group, policy.http_filters(f"gateway listener {name}", clear_route_cache=True)),
                scope=",".join(str(g.meta) for g in gateways) + ":" + policy.scope))
    return result


def gateway_listener(name: str, servers: tuple[GatewayServer, ...],
                     http_filters: tuple[hcm_pb2.HttpFilter, ...] = ()) -> listener_pb2.Listener:
    """`http_filters`: what runs before the fault filter and router (JWT, authorization)."""
    first = servers[0]
    listener = listener_pb2.Listener(
        name=name,
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=first.address,
                                                                             port_value=first.port)),
        traffic_direction=base_pb2.OUTBOUND,
    )
    if not first.tls:
        listener.filter_chains.append(listener_components_pb2.FilterChain(
            filters=[_hcm(name, first.route_name, http_filters)]))
        return listener
    listener.listener_filters.append(listener_components_pb2.ListenerFilter(
        name=TLS_INSPECTOR_FILTER, typed_config=pack(tls_inspector_pb2.TlsInspector())))
    for served in servers:
        listener.filter_chains.append(listener_components_pb2.FilterChain(
            name=served.route_name,
            filter_chain_match=listener_components_pb2.FilterChainMatch(server_names=served.server_names),
            transport_socket=base_pb2.TransportSocket(name=TLS_TRANSPORT_SOCKET,
                                                      typed_config=pack(server_tls(served))),
            filters=[_hcm(name, served.route_name, http_filters)],
        ))
    return listener


def server_tls(served: GatewayServer) -> tls_pb2.DownstreamTlsContext:
    """SIMPLE TLS: the credential's certificate, no client certificate asked for."""
    tls = served.server.tls
    assert tls is not None
    params = common_pb2.TlsParameters(
        # istiod's gateway defaults: TLS 1.2 to 1.3 (validation admits only the names below).
        tls_minimum_protocol_version=TLS_VERSIONS[tls.min_protocol_version or "TLSV1_2"],
        tls_maximum_protocol_version=TLS_VERSIONS[tls.max_protocol_version or "TLSV1_3"],
        cipher_suites=list(tls.cipher_suites),
    )
    return tls_pb2.DownstreamTlsContext(
        common_tls_context=tls_pb2.CommonTlsContext(
            alpn_protocols=list(HTTP_ALPN),
            tls_params=params,
            # No fetch timeout: the listener waits for its certificate rather than serving without.
            tls_certificate_sds_secret_configs=[secret_pb2.SdsSecretConfig(
                name=served.credential, sds_config=ads_source(initial_fetch_timeout=duration_pb2.Duration()))],
        ),
        require_client_certificate=wrappers_pb2.BoolValue(value=False),
    )


def _hcm(listener: str, route_name: str, http_filters: tuple[hcm_pb2.HttpFilter, ...]) -> listener_components_pb2.Filter:
    """istiod's gateway HCM: the client's address is the peer's (a gateway is the edge), paths
    normalised, websockets pass, VirtualService faults and CORS policies act."""
    rds = hcm_pb2.Rds(config_source=ads_source(initial_fetch_timeout=duration_pb2.Duration()),
                      route_config_name=route_name)
    return network_filter(HCM_FILTER, with_fault_filter(http_connection_manager(
        http_filters,
        stat_prefix=f"outbound_{listener}",
        rds=rds,
        use_remote_address=wrappers_pb2.BoolValue(value=True),
        normalize_path=wrappers_pb2.BoolValue(value=True),
        upgrade_configs=[hcm_pb2.HttpConnectionManager.UpgradeConfig(upgrade_type="websocket")],
    ), cors=True))
