"""LDS for sidecars, with Istio's names and shapes.

- `virtualOutbound` (15001) takes captured outbound traffic and hands each connection to the listener
  of its original destination (`use_original_dst`); what no listener claims goes to
  PassthroughCluster, or BlackHoleCluster under REGISTRY_ONLY.
- `0.0.0.0_<port>` per HTTP service port (routes from RDS `<port>`) for what the HTTP inspector
  finds is HTTP/1.1 or h2c; the rest falls to its PassthroughFilterChain (BlackHole under
  REGISTRY_ONLY), as Istio's. `<vip>_<port>` per TCP service
  port with a ClusterIP (tcp_proxy to its cluster, or where the VirtualService's `tls` routes
  send it by SNI and its `tcp` routes send the rest); these never bind (`bind_to_port: false`).
- `0.0.0.0_<port>` for the TCP ports of ServiceEntry hosts without an address: by SNI on TLS ports.
- A Sidecar resource's egress listeners narrow the hosts and may move a port (istiod's egress
  listeners): `<bind>_<port>` when they name an address, bound by Envoy under captureMode NONE;
  its outboundTrafficPolicy overrides the mesh's.
- `virtualInbound` (15006): Istio's catch-all chains for ports no service names (HTTP over mesh
  mTLS or plaintext through an HCM, TCP over mesh mTLS, plaintext or the app's own TLS through
  tcp_proxy, all to InboundPassthroughCluster), then per port the pod serves, chains matched on
  the transport protocol: mesh mTLS (TLS with Istio's ALPN, the workload certificate, a client
  certificate the mesh root signed), the app's own TLS on TCP ports, and plaintext; STRICT keeps
  only mTLS, DISABLE only plaintext.
  HTTP chains run jwt_authn (RequestAuthentication) then RBAC (AuthorizationPolicy) before the
  router; TCP chains, the pass-through ones included, run the RBAC network filter before tcp_proxy.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.listener.http_inspector.v3 import http_inspector_pb2
from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2
from envoy.extensions.filters.listener.tls_inspector.v3 import tls_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.type.v3 import range_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from istiod.model.config.security import AuthorizationPolicy, MTLSMode, RequestAuthentication
from istiod.model.names import inbound_cluster_name
from istiod.model.protocol import Protocol
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.filters import (
    HCM_FILTER, TCP_PROXY_FILTER, ads_source, http_connection_manager, l4_proxy, network_filter, pack, tcp_proxy,
    with_fault_filter,
)
from istiod.xds.gen.routes import L4Destinations, tcp_destinations, tls_destinations
from istiod.xds.gen.sidecar.clusters import BLACKHOLE, INBOUND_PASSTHROUGH, unmatched_cluster
from istiod.xds.gen.sidecar.ports import (
    ANY_ADDRESS,
    PROXY_PORTS,
    VIRTUAL_INBOUND_PORT,
    VIRTUAL_OUTBOUND_PORT,
    InboundPort,
    OutboundPort,
    inbound_ports,
    outbound_ports,
)
from istiod.xds.gen.eds import is_ip
from istiod.xds.gen.extauthz import ResolvedProvider
from istiod.xds.gen.rbac import authorization_filters, tcp_authorization_filters
from istiod.xds.gen.security import WorkloadPolicy, inbound_mtls_mode, workload_policy
from istiod.xds.gen.targets import TunnelOf, alike, no_tunnel, route_inputs, tunnel_lookup
from istiod.xds.gen.tls import (
    HTTP_ALPN, MESH_ALPN_MATCH, MESH_HTTP_ALPN_MATCH, MESH_TCP_ALPN_MATCH, PLAINTEXT_HTTP_ALPN_MATCH, sds_downstream_tls,
    TLS_TRANSPORT_SOCKET, server_tls,
)

VIRTUAL_OUTBOUND = "virtualOutbound"
VIRTUAL_INBOUND = "virtualInbound"
ORIGINAL_DST_FILTER = "envoy.filters.listener.original_dst"
TLS_INSPECTOR_FILTER = "envoy.filters.listener.tls_inspector"
HTTP_INSPECTOR_FILTER = "envoy.filters.listener.http_inspector"

log = logging.getLogger(__name__)


def listeners(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    result = list(cache.per_snapshot(snapshot, ("outbound listeners", alike(snapshot, proxy)),
                                     lambda: _outbound(snapshot, proxy, cache)))
    inbound = inbound_ports(snapshot, proxy)
    # PeerAuthentication per port (port 0: ports no service names), the AuthorizationPolicies
    # (translated as for proxyless servers) and RequestAuthentications selecting the workload.
    modes = {port: inbound_mtls_mode(snapshot, proxy, port) for port in (0, *(p.port for p in inbound))}
    policy = workload_policy(snapshot, proxy)
    # Proxies whose pods serve the same ports under the same policies share one copy: the scope
    # says what it holds.
    captured = tuple(p for p in inbound if not p.bind_to_port)  # the rest Envoy binds (captureMode NONE)
    scope = ",".join(f"{p.port}/{p.protocol.value}/{p.name}/{p.tls}/{p.config}" for p in captured) + ":" + \
        ",".join(f"{port}={mode.value}" for port, mode in modes.items()) + ":" + policy.scope
    timeout = snapshot.mesh.protocol_detection_timeout
    result.append(cache.get(types.LISTENER, VIRTUAL_INBOUND, (*policy.authorization, *policy.request_auth),
                            scope=f"{scope}:{timeout}",
                            build=lambda: virtual_inbound(captured, modes, policy.authorization, policy.request_auth,
                                                          policy.providers, policy.fetched_jwks, timeout)))
    for bound in (p for p in inbound if p.bind_to_port):
        if any(r.name == bound.name for r in result):  # istiod builds inbound first: it keeps the name
            log.info("sidecar %s: outbound listener %s left out for the Sidecar ingress listener of that name",
                     proxy.id, bound.name)
            result = [r for r in result if r.name != bound.name]
        result.append(cache.get(
            types.LISTENER, bound.name, (*policy.authorization, *policy.request_auth),
            scope=f"{bound.name}/{bound.protocol.value}/{bound.tls}/{bound.config}:{modes[bound.port].value}:{policy.scope}:{timeout}",
            build=lambda: bound_inbound(bound, modes[bound.port], policy.authorization, policy.request_auth,
                                        policy.providers, policy.fetched_jwks, timeout)))
    if names is not None:
        wanted = set(names)
        result = [r for r in result if r.name in wanted]
    return result


def _outbound(snapshot: Snapshot, proxy: Proxy, cache: ResourceCache) -> list[Resource]:
    """virtualOutbound and a listener per outbound address and port."""
    unmatched, alike_key = unmatched_cluster(snapshot, proxy), alike(snapshot, proxy)
    result = [cache.get(types.LISTENER, VIRTUAL_OUTBOUND, None, lambda: virtual_outbound(unmatched), scope=unmatched)]
    # One listener per address: Envoy refuses two of one name (two Services claiming one ClusterIP
    # and port); the first by hostname keeps it.
    named: set[str] = set()
    source = (proxy.namespace, dict(proxy.labels))
    unaddressed: dict[int, list[OutboundPort]] = {}  # TCP ports of ServiceEntry hosts without a VIP
    timeout = snapshot.mesh.protocol_detection_timeout
    tunnel_of = tunnel_lookup(snapshot, proxy)
    for target in outbound_ports(snapshot, proxy):
        number = target.number
        if number in PROXY_PORTS:
            continue
        if target.protocol.is_http:
            name = f"{target.bind or ANY_ADDRESS}_{number}"
            if name not in named:
                result.append(cache.get(types.LISTENER, name, None,
                                        lambda: http_outbound_listener(target, unmatched, timeout),
                                        scope=f"{target.bind_to_port}:{unmatched}:{timeout}"))
        elif (address := target.bind or target.vip) is not None:
            name = f"{address}_{number}"
            if name not in named:
                vs, depends_on = route_inputs(snapshot, proxy, target.service)
                result.append(cache.get(
                    types.LISTENER, name, (target.service, *depends_on),
                    lambda: tcp_outbound_listener(address, target, tcp_destinations(
                        vs, target.service, target.port.port, snapshot.services, source, target.vip),
                        tls_destinations(vs, target.port.port, snapshot.services, source, target.vip), timeout,
                        tunnel_of),
                    scope=f"{target.bind_to_port}:{alike_key}:{timeout}"))
        elif target.service.external_host:
            unaddressed.setdefault(number, []).append(target)
            continue
        elif target.service.headless:
            result += _per_endpoint(snapshot, proxy, target, named, cache)
            continue
        else:
            continue
        named.add(name)
    for number, targets in unaddressed.items():
        name = f"{ANY_ADDRESS}_{number}"
        if name not in named:  # else an HTTP port's listener has the address
            inputs = {t.cluster: route_inputs(snapshot, proxy, t.service) for t in targets}
            result.append(cache.get(
                types.LISTENER, name, (*(t.service for t in targets), *(d for _, ds in inputs.values() for d in ds)),
                lambda: unaddressed_listener(number, targets, unmatched, {
                    t.cluster: (tcp_destinations(inputs[t.cluster][0], t.service, t.port.port, snapshot.services,
                                                 source, None),
                                tls_destinations(inputs[t.cluster][0], t.port.port, snapshot.services, source, None))
                    for t in targets}, tunnel_of, timeout),
                scope=f"{unmatched}:{alike_key}:{timeout}"))
    return result


def _per_endpoint(snapshot: Snapshot, proxy: Proxy, target: OutboundPort, named: set[str],
                  cache: ResourceCache) -> list[Resource]:
    """A headless Service's TCP (or sniffed) port: a listener `<pod IP>_<port>` per endpoint, to
    its ORIGINAL_DST cluster, as istiod builds them for StatefulSets (istiod leaves out the proxy's
    own address; here proxies alike share one list, so it stays: captured traffic never takes it)."""
    result = []
    vs, depends_on = route_inputs(snapshot, proxy, target.service)
    source = (proxy.namespace, dict(proxy.labels))
    timeout = snapshot.mesh.protocol_detection_timeout
    scope = f"{alike(snapshot, proxy)}:{timeout}"
    for endpoint in snapshot.endpoints_for(target.service.hostname, target.port.port):
        name = f"{endpoint.address}_{target.number}"
        if not is_ip(endpoint.address) or name in named:
            continue
        named.add(name)
        result.append(cache.get(
            types.LISTENER, name, (target.service, *depends_on),
            lambda: tcp_outbound_listener(endpoint.address, target, tcp_destinations(
                vs, target.service, target.port.port, snapshot.services, source, None),
                tls_destinations(vs, target.port.port, snapshot.services, source, None), timeout,
                tunnel_lookup(snapshot, proxy)),
            scope=scope))
    return result


def virtual_outbound(unmatched: str) -> listener_pb2.Listener:
    catch_all = _catch_all(unmatched)
    catch_all.name = f"{VIRTUAL_OUTBOUND}-catchall-tcp"
    return listener_pb2.Listener(
        name=VIRTUAL_OUTBOUND,
        address=_address(ANY_ADDRESS, VIRTUAL_OUTBOUND_PORT),
        use_original_dst=wrappers_pb2.BoolValue(value=True),
        traffic_direction=base_pb2.OUTBOUND,
        filter_chains=[_loop_breaker(VIRTUAL_OUTBOUND, VIRTUAL_OUTBOUND_PORT), catch_all],
    )


def _catch_all(unmatched: str) -> listener_components_pb2.FilterChain:
    """Outbound traffic no service claims, to `unmatched` (unmatched_cluster)."""
    chain = "BlackHoleFilterChain" if unmatched == BLACKHOLE else "PassthroughFilterChain"
    return listener_components_pb2.FilterChain(name=chain, filters=[tcp_proxy(unmatched, unmatched)])


def _loop_breaker(listener: str, port: int) -> listener_components_pb2.FilterChain:
    """A connection addressed to the virtual listener's own port would come back to it forever."""
    return listener_components_pb2.FilterChain(
        name=f"{listener}-blackhole",
        filter_chain_match=listener_components_pb2.FilterChainMatch(
            destination_port=wrappers_pb2.UInt32Value(value=port)),
        filters=[tcp_proxy(BLACKHOLE, BLACKHOLE)],
    )


def http_outbound_listener(target: OutboundPort, unmatched: str, timeout: float = 0.0) -> listener_pb2.Listener:
    """The HCM takes what the HTTP inspector recognises as HTTP/1.1 or h2c; another protocol on
    an HTTP port (a client speaking TLS or its own bytes) leaves as virtualOutbound's would.
    `timeout`: the mesh's protocolDetectionTimeout."""
    port = target.number
    name = f"{target.bind or ANY_ADDRESS}_{port}"
    listener = _outbound_listener(name, target.bind or ANY_ADDRESS, port, _outbound_hcm(name, str(port)),
                                  target.bind_to_port)
    listener.filter_chains[0].filter_chain_match.MergeFrom(_match("raw_buffer", PLAINTEXT_HTTP_ALPN_MATCH))
    _sniff(listener, timeout)
    listener.default_filter_chain.CopyFrom(_catch_all(unmatched))
    return listener


def _outbound_hcm(listener: str, route_config_name: str) -> listener_components_pb2.Filter:
    rds = hcm_pb2.Rds(config_source=ads_source(initial_fetch_timeout=duration_pb2.Duration()),
                      route_config_name=route_config_name)
    return network_filter(HCM_FILTER, with_fault_filter(_sidecar_hcm(f"outbound_{listener}", rds=rds), cors=True))


def _sniff(listener: listener_pb2.Listener, timeout: float) -> None:
    """The HTTP inspector, waiting for the client's first bytes as long as the mesh's
    protocolDetectionTimeout says (0: for ever, Istio's default), then carrying on as not HTTP."""
    listener.listener_filters.append(_http_inspector())
    listener.listener_filters_timeout.CopyFrom(_duration(timeout))
    listener.continue_on_listener_filters_timeout = True


def _duration(seconds: float) -> duration_pb2.Duration:
    result = duration_pb2.Duration()
    result.FromNanoseconds(round(seconds * 1e9))
    return result


def sniffed_route_name(target: OutboundPort) -> str:
    """A sniffed port's own route configuration, `<host>:<port>` (istiod's name)."""
    return f"{target.service.hostname}:{target.number}"


def _http_inspector(skip_ports: Sequence[int] = ()) -> listener_components_pb2.ListenerFilter:
    """Sets `http/1.1` or `h2c` as the application protocol of what it recognises; not run for
    `skip_ports`, whose protocol is declared."""
    inspector = listener_components_pb2.ListenerFilter(
        name=HTTP_INSPECTOR_FILTER, typed_config=pack(http_inspector_pb2.HttpInspector()))
    ranges = [listener_components_pb2.ListenerFilterChainMatchPredicate(
        destination_port_range=range_pb2.Int32Range(start=port, end=port + 1)) for port in skip_ports]
    if len(ranges) == 1:
        inspector.filter_disabled.CopyFrom(ranges[0])
    elif ranges:
        inspector.filter_disabled.or_match.rules.extend(ranges)
    return inspector


def tcp_outbound_listener(address: str, target: OutboundPort, destinations: L4Destinations,
                          by_sni: Sequence[tuple[tuple[str, ...], L4Destinations]] = (),
                          timeout: float = 0.0, tunnel_of: TunnelOf = no_tunnel) -> listener_pb2.Listener:
    """tcp_proxy to where the VirtualService's `tls` routes send by SNI, and the rest where its
    `tcp` routes send (weighted if several), each through the tunnel a DestinationRule asks for.
    A port of undeclared protocol is sniffed, as istiod:
    what the HTTP inspector recognises as HTTP/1.1 or h2c takes the HCM and the service's own
    route configuration `<host>:<port>` (its VirtualService's `http` routes), the rest this."""
    port = target.number
    name = f"{address}_{port}"
    listener = _outbound_listener(name, address, port, l4_proxy(target.cluster, destinations, tunnel_of(destinations)),
                                  target.bind_to_port)
    listener = _by_sni(listener, [(names, l4_proxy(target.cluster, sent, tunnel_of(sent))) for names, sent in by_sni])
    if target.protocol is Protocol.UNSUPPORTED:
        # Matching never backtracks: a connection the HTTP chain's `raw_buffer` claims but whose
        # protocol is not HTTP would match no chain. The TCP chain is the default, as istiod's.
        listener.default_filter_chain.CopyFrom(listener.filter_chains.pop())
        listener.filter_chains.append(listener_components_pb2.FilterChain(
            filter_chain_match=_match("raw_buffer", PLAINTEXT_HTTP_ALPN_MATCH),
            filters=[_outbound_hcm(name, sniffed_route_name(target))]))
        _sniff(listener, timeout)
    return listener


# Per cluster of a ServiceEntry host without an address: where its VirtualService's `tcp` routes
# send, and its `tls` routes by SNI (tcp_destinations, tls_destinations).
L4Routes = Mapping[str, tuple[L4Destinations, Sequence[tuple[tuple[str, ...], L4Destinations]]]]


def unaddressed_listener(port: int, targets: Sequence[OutboundPort], unmatched: str,
                         routes: L4Routes | None = None, tunnel_of: TunnelOf = no_tunnel,
                         timeout: float = 0.0) -> listener_pb2.Listener:
    """istiod's wildcard listener for ServiceEntry hosts without an address: a connection to any
    IP on the port is theirs, by the destination's CIDR for hosts with one (a ServiceEntry address
    `10.1.0.0/16`), by SNI on TLS ports (the client resolved the host itself, `*.example.com`
    matching as Envoy matches a wildcard name: the host's VirtualService `tls` routes by their
    `sniHosts` instead, when it has some), else the first plain host's; each goes where the host's
    VirtualService `tcp` routes send, else to the host. What no host claims goes where
    virtualOutbound sends the unknown. On a port of undeclared protocol what the HTTP inspector
    finds is HTTP takes the port's routes (RDS `<port>`), as istiod's."""
    name = f"{ANY_ADDRESS}_{port}"
    found = routes or {}

    def tcp(target: OutboundPort) -> listener_components_pb2.Filter:
        sent = found.get(target.cluster, ([(target.cluster, 0)], ()))[0]
        return l4_proxy(target.cluster, sent, tunnel_of(sent))

    cidr = {t.service.cluster_ip: t for t in reversed(targets) if "/" in t.service.cluster_ip}
    rest = [t for t in targets if "/" not in t.service.cluster_ip]
    tls = [t for t in rest if t.protocol in (Protocol.TLS, Protocol.HTTPS)]
    plain = [t for t in rest if t not in tls]
    listener = _outbound_listener(name, ANY_ADDRESS, port, tcp(plain[0]) if plain and not tls
                                  else tcp_proxy(unmatched, unmatched))
    by_sni: list[tuple[tuple[str, ...], listener_components_pb2.Filter]] = []
    claimed: set[str] = set()  # Envoy refuses two chains of one match: the first target keeps a name
    for target in sorted(tls, key=lambda t: t.service.hostname):
        sni = found.get(target.cluster, ([], ()))[1]
        chosen = [(names, l4_proxy(target.cluster, sent, tunnel_of(sent))) for names, sent in sni] or \
            [((target.service.hostname,), tcp(target))]
        for names, proxy in chosen:
            if free := tuple(n for n in names if n not in claimed):
                claimed.update(free)
                by_sni.append((free, proxy))
    listener = _by_sni(listener, by_sni)
    # Before the SNI chains: Envoy takes the most specific match, destination first.
    chains = [listener_components_pb2.FilterChain(
        filter_chain_match=listener_components_pb2.FilterChainMatch(prefix_ranges=[_cidr(prefix)]),
        filters=[tcp(target)])
        for prefix, target in sorted(cidr.items())]
    chains += listener.filter_chains
    del listener.filter_chains[:]
    listener.filter_chains.extend(chains)
    if not (plain and not tls):  # what no host claims: the default chain, as istiod's
        listener.filter_chains.pop()
        listener.default_filter_chain.CopyFrom(_catch_all(unmatched))
    elif plain[0].protocol is Protocol.UNSUPPORTED:
        listener.default_filter_chain.CopyFrom(listener.filter_chains.pop())
        listener.filter_chains.append(listener_components_pb2.FilterChain(
            filter_chain_match=_match("raw_buffer", PLAINTEXT_HTTP_ALPN_MATCH), filters=[_outbound_hcm(name, str(port))]))
        _sniff(listener, timeout)
    return listener


def _cidr(prefix: str) -> address_pb2.CidrRange:
    network = ipaddress.ip_network(prefix, strict=False)
    return address_pb2.CidrRange(address_prefix=str(network.network_address),
                                 prefix_len=wrappers_pb2.UInt32Value(value=network.prefixlen))


def _by_sni(listener: listener_pb2.Listener,
            chains: Sequence[tuple[tuple[str, ...], listener_components_pb2.Filter]]) -> listener_pb2.Listener:
    """Filter chains by SNI (after the TLS inspector) before the listener's one chain, which
    keeps what none of them takes."""
    if chains:
        listener.listener_filters.append(listener_components_pb2.ListenerFilter(
            name=TLS_INSPECTOR_FILTER, typed_config=pack(tls_inspector_pb2.TlsInspector())))
        listener.continue_on_listener_filters_timeout = True  # a client that speaks first: no SNI
        rest = listener.filter_chains.pop()
        listener.filter_chains.extend(listener_components_pb2.FilterChain(
            name=f"{listener.name}_{names[0]}", filter_chain_match=listener_components_pb2.FilterChainMatch(
                server_names=names), filters=[proxy]) for names, proxy in chains)
        listener.filter_chains.append(rest)
    return listener


def _outbound_listener(name: str, ip: str, port: int, main: listener_components_pb2.Filter,
                       bind_to_port: bool = False) -> listener_pb2.Listener:
    """Reached through virtualOutbound (captured traffic), or, for an egress listener with
    captureMode NONE, bound by Envoy itself for the app to call."""
    return listener_pb2.Listener(
        name=name,
        address=_address(ip, port),
        bind_to_port=wrappers_pb2.BoolValue(value=bind_to_port),
        traffic_direction=base_pb2.OUTBOUND,
        filter_chains=[listener_components_pb2.FilterChain(filters=[main])],  # unnamed, as Istio's
        # istiod's: no timeout for listener filters unless one sniffs HTTP (_sniff).
        listener_filters_timeout=duration_pb2.Duration(),
        continue_on_listener_filters_timeout=True,
    )


def virtual_inbound(ports: tuple[InboundPort, ...], modes: Mapping[int, MTLSMode],
                    policies: tuple[AuthorizationPolicy, ...] = (),
                    request_auth: tuple[RequestAuthentication, ...] = (),
                    providers: Mapping[str, ResolvedProvider] | None = None,
                    fetched_jwks: Mapping[str, str] | None = None, timeout: float = 0.0) -> listener_pb2.Listener:
    """`modes`: the mTLS mode of each inbound port, and of the rest under port 0; `providers`:
    the extension providers CUSTOM policies name; `fetched_jwks`: keys istiod fetched, by jwksUri;
    `timeout`: the mesh's protocolDetectionTimeout."""
    filters = _authorization(VIRTUAL_INBOUND, policies, request_auth, providers, fetched_jwks)
    chains = [_loop_breaker(VIRTUAL_INBOUND, VIRTUAL_INBOUND_PORT), *_passthrough_chains(modes[0], filters)]
    for inbound in ports:
        chains += _inbound_chains(inbound, modes[inbound.port], filters)
    listener_filters = [
        listener_components_pb2.ListenerFilter(name=ORIGINAL_DST_FILTER, typed_config=pack(original_dst_pb2.OriginalDst())),
        listener_components_pb2.ListenerFilter(
            name=TLS_INSPECTOR_FILTER, typed_config=pack(tls_inspector_pb2.TlsInspector()),
            filter_disabled=listener_components_pb2.ListenerFilterChainMatchPredicate(
                destination_port_range=range_pb2.Int32Range(start=VIRTUAL_INBOUND_PORT, end=VIRTUAL_INBOUND_PORT + 1))),
    ]
    if any(set(PLAINTEXT_HTTP_ALPN_MATCH) & set(c.filter_chain_match.application_protocols) for c in chains):
        # Only ports no service declares need telling HTTP from the rest.
        declared = {p.port for p in ports if p.protocol is not Protocol.UNSUPPORTED}
        listener_filters.append(_http_inspector(sorted(declared | {VIRTUAL_INBOUND_PORT})))
    return listener_pb2.Listener(
        name=VIRTUAL_INBOUND,
        address=_address(ANY_ADDRESS, VIRTUAL_INBOUND_PORT),
        traffic_direction=base_pb2.INBOUND,
        listener_filters=listener_filters,
        # A server-first protocol sends nothing for the inspectors to read: after the mesh's
        # protocolDetectionTimeout (0, Istio's default: never) carry on without them (raw_buffer).
        listener_filters_timeout=_duration(timeout),
        continue_on_listener_filters_timeout=True,
        # What no chain matches (plaintext under STRICT) is closed.
        filter_chains=chains,
    )


def bound_inbound(inbound: InboundPort, mode: MTLSMode, policies: tuple[AuthorizationPolicy, ...] = (),
                  request_auth: tuple[RequestAuthentication, ...] = (),
                  providers: Mapping[str, ResolvedProvider] | None = None,
                  fetched_jwks: Mapping[str, str] | None = None, timeout: float = 0.0) -> listener_pb2.Listener:
    """A Sidecar ingress listener with captureMode NONE: istiod's inboundCustomListener `<bind>_<port>`,
    which Envoy binds itself, with the chains virtualInbound would have for the port and the
    inspectors they need."""
    chains = _inbound_chains(inbound, mode, _authorization(inbound.name, policies, request_auth, providers,
                                                           fetched_jwks))
    listener_filters = []
    if any(c.filter_chain_match.transport_protocol == "tls" for c in chains):
        listener_filters.append(listener_components_pb2.ListenerFilter(
            name=TLS_INSPECTOR_FILTER, typed_config=pack(tls_inspector_pb2.TlsInspector())))
    if any(set(PLAINTEXT_HTTP_ALPN_MATCH) & set(c.filter_chain_match.application_protocols) for c in chains):
        listener_filters.append(_http_inspector())
    return listener_pb2.Listener(
        name=inbound.name,
        address=_address(inbound.bind or ANY_ADDRESS, inbound.port),
        traffic_direction=base_pb2.INBOUND,
        listener_filters=listener_filters,
        listener_filters_timeout=_duration(timeout),
        continue_on_listener_filters_timeout=True,
        filter_chains=chains,
    )


def _authorization(listener: str, policies: tuple[AuthorizationPolicy, ...],
                   request_auth: tuple[RequestAuthentication, ...], providers: Mapping[str, ResolvedProvider] | None,
                   fetched_jwks: Mapping[str, str] | None) -> _Filters:
    """The workload's RequestAuthentication and AuthorizationPolicy filters, for its HTTP and TCP chains."""
    policy = WorkloadPolicy(policies, request_auth, providers or {}, fetched_jwks or {})
    http = policy.http_filters(f"sidecar {listener}, HTTP ports")
    said = authorization_filters(policies, request_auth=True, providers=providers).problems
    tcp = tcp_authorization_filters(policies, providers)
    for problem in tcp.problems:
        if problem not in said:  # istiod's semantics for HTTP fields on TCP: said, not warned
            log.info("%s (sidecar %s, TCP and unnamed ports)", problem, listener)
    return _Filters(http, tcp.filters)


def _passthrough_chains(mode: MTLSMode, authz: _Filters) -> list[listener_components_pb2.FilterChain]:
    """Istio's catch-all chains for ports no service names, all to InboundPassthroughCluster:
    HTTP (mTLS with Istio's HTTP ALPNs, or what the HTTP inspector recognises) through an HCM,
    the rest through tcp_proxy (mesh mTLS, plaintext, or the app's own TLS untouched)."""
    http = _Port(0, Protocol.HTTP, INBOUND_PASSTHROUGH)
    tcp = _Port(0, Protocol.TCP, INBOUND_PASSTHROUGH)

    def chain(name: str, port: _Port, match: listener_components_pb2.FilterChainMatch,
              mtls: bool) -> listener_components_pb2.FilterChain:
        return listener_components_pb2.FilterChain(
            name=name, filter_chain_match=match,
            transport_socket=sds_downstream_tls(HTTP_ALPN) if mtls else None,
            filters=_inbound_filters(port, INBOUND_PASSTHROUGH, mtls=mtls, authz=authz))

    catch_all_http, catch_all_tcp = f"{VIRTUAL_INBOUND}-catchall-http", VIRTUAL_INBOUND
    mesh_http = chain(catch_all_http, http, _match("tls", MESH_HTTP_ALPN_MATCH), mtls=True)
    plain_http = chain(catch_all_http, http, _match("raw_buffer", PLAINTEXT_HTTP_ALPN_MATCH), mtls=False)
    plain_tcp = chain(catch_all_tcp, tcp, _match("raw_buffer"), mtls=False)
    if mode is MTLSMode.STRICT:
        return [mesh_http, chain(catch_all_tcp, tcp, _match("tls"), mtls=True)]
    if mode is MTLSMode.DISABLE:
        return [plain_http, plain_tcp]
    return [mesh_http, plain_http, chain(catch_all_tcp, tcp, _match("tls", MESH_TCP_ALPN_MATCH), mtls=True),
            plain_tcp, chain(catch_all_tcp, tcp, _match("tls"), mtls=False)]


def _sniffed_chains(inbound: InboundPort, mode: MTLSMode, authz: _Filters) -> list[listener_components_pb2.FilterChain]:
    """A port of undeclared protocol, as istiod: HTTP (over mesh mTLS with Istio's HTTP ALPNs, or
    plaintext the HTTP inspector recognises) through an HCM, the rest through tcp_proxy."""
    cluster, name = inbound_cluster_name(inbound.port), inbound.name
    http, tcp = _Port(inbound.port, Protocol.HTTP, name), _Port(inbound.port, Protocol.TCP, name)

    def chain(port: _Port, transport: str, alpn: Sequence[str], mtls: bool) -> listener_components_pb2.FilterChain:
        return listener_components_pb2.FilterChain(
            name=name, filter_chain_match=_match(transport, alpn, port=inbound.port),
            transport_socket=sds_downstream_tls(HTTP_ALPN) if mtls else None,
            filters=_inbound_filters(port, cluster, mtls=mtls, authz=authz), metadata=_config_metadata(inbound.config))

    mesh_http = chain(http, "tls", MESH_HTTP_ALPN_MATCH, mtls=True)
    plain_http = chain(http, "raw_buffer", PLAINTEXT_HTTP_ALPN_MATCH, mtls=False)
    plain_tcp = chain(tcp, "raw_buffer", (), mtls=False)
    if mode is MTLSMode.STRICT:
        return [mesh_http, chain(tcp, "tls", (), mtls=True)]
    if mode is MTLSMode.DISABLE:
        return [plain_http, plain_tcp]
    return [mesh_http, plain_http, chain(tcp, "tls", MESH_TCP_ALPN_MATCH, mtls=True), plain_tcp,
            chain(tcp, "tls", (), mtls=False)]


@dataclass(frozen=True, slots=True)
class _Port:
    """A port the catch-all chains stand for (0: any)."""

    port: int
    protocol: Protocol
    name: str


def _match(transport: str, alpn: Sequence[str] = (), port: int | None = None) -> listener_components_pb2.FilterChainMatch:
    return listener_components_pb2.FilterChainMatch(
        destination_port=None if port is None else wrappers_pb2.UInt32Value(value=port),
        transport_protocol=transport, application_protocols=alpn)


@dataclass(frozen=True, slots=True)
class _Filters:
    """What runs before the app on inbound chains: HTTP filters before the router, network
    filters before tcp_proxy."""

    http: Sequence[hcm_pb2.HttpFilter] = ()
    tcp: Sequence[listener_components_pb2.Filter] = ()


def _inbound_chains(inbound: InboundPort, mode: MTLSMode, authz: _Filters) -> list[listener_components_pb2.FilterChain]:
    """Istio's per port, all named `<bind>_<port>` (`0.0.0.0_<port>` for a service's). STRICT: mTLS
    only; PERMISSIVE: mesh mTLS (by ALPN), the app's own TLS on TCP ports, and plaintext; DISABLE:
    plaintext, or the caller's TLS where a Sidecar ingress listener has the sidecar terminate it."""
    cluster = inbound_cluster_name(inbound.port)

    def chain(match: listener_components_pb2.FilterChainMatch, mtls: bool,
              transport: base_pb2.TransportSocket | None = None) -> listener_components_pb2.FilterChain:
        return listener_components_pb2.FilterChain(
            name=inbound.name, filter_chain_match=match,
            transport_socket=transport or (sds_downstream_tls(HTTP_ALPN) if mtls else None),
            filters=_inbound_filters(inbound, cluster, mtls=mtls, authz=authz), metadata=_config_metadata(inbound.config))

    if inbound.tls is not None:
        if mode is MTLSMode.DISABLE:  # the app sees the client's certificate, if any, as with mesh mTLS
            own = base_pb2.TransportSocket(name=TLS_TRANSPORT_SOCKET, typed_config=pack(server_tls(inbound.tls, HTTP_ALPN)))
            return [chain(_match("tls", port=inbound.port), mtls=True, transport=own)]
        # istiod's rule: mesh mTLS wins; the settings act once PeerAuthentication disables it on the port.
        log.info("Sidecar ingress listener %s: tls applies only where PeerAuthentication's mode is DISABLE "
                 "(the port's is %s): mesh mTLS is served", inbound.name, mode.value)
    if inbound.protocol is Protocol.UNSUPPORTED:
        return _sniffed_chains(inbound, mode, authz)
    plaintext = chain(_match("raw_buffer", port=inbound.port), mtls=False)
    if mode is MTLSMode.DISABLE:
        return [plaintext]
    if mode is MTLSMode.STRICT:
        return [chain(_match("tls", port=inbound.port), mtls=True)]
    mesh = chain(_match("tls", MESH_ALPN_MATCH, port=inbound.port), mtls=True)
    if inbound.protocol.is_http:  # declared HTTP: TLS other than the mesh's is not expected
        return [mesh, plaintext]
    return [mesh, chain(_match("tls", port=inbound.port), mtls=False), plaintext]


def _config_metadata(config: str) -> base_pb2.Metadata | None:
    """istiod's BuildConfigInfoMetadata: which resource made the chain (a Sidecar's ingress listener)."""
    if not config:
        return None
    metadata = base_pb2.Metadata()
    metadata.filter_metadata["istio"].update({"config": config})
    return metadata


def _inbound_filters(inbound: InboundPort | _Port, cluster: str, mtls: bool,
                     authz: _Filters) -> list[listener_components_pb2.Filter]:
    stat_prefix = cluster if cluster == INBOUND_PASSTHROUGH else f"inbound_{inbound.name}"
    if not inbound.protocol.is_http:
        return [*authz.tcp, tcp_proxy(cluster, cluster)]
    route = route_pb2.RouteConfiguration(
        name=cluster,
        validate_clusters=wrappers_pb2.BoolValue(value=False),
        virtual_hosts=[route_components_pb2.VirtualHost(
            name=f"inbound|http|{inbound.port}",
            domains=["*"],
            routes=[route_components_pb2.Route(
                name="default",
                match=route_components_pb2.RouteMatch(prefix="/"),
                route=route_components_pb2.RouteAction(cluster=cluster, timeout=duration_pb2.Duration()),
            )],
        )],
    )
    fields: dict[str, object] = {}
    if mtls:  # the app sees its caller's SPIFFE identity in x-forwarded-client-cert
        fields = dict(
            forward_client_cert_details=hcm_pb2.HttpConnectionManager.APPEND_FORWARD,
            set_current_client_cert_details=hcm_pb2.HttpConnectionManager.SetCurrentClientCertDetails(
                subject=wrappers_pb2.BoolValue(value=True), dns=True, uri=True),
        )
    return [network_filter(HCM_FILTER, _sidecar_hcm(stat_prefix, authz.http, route_config=route,
                                                     server_name="istio-envoy", **fields))]


def _sidecar_hcm(stat_prefix: str, http_filters: Sequence[hcm_pb2.HttpFilter] = (), /,
                 **fields: object) -> hcm_pb2.HttpConnectionManager:
    """Istio's defaults: the client's address is not trusted, paths are normalised, websockets pass."""
    manager = http_connection_manager(
        http_filters,
        stat_prefix=stat_prefix,
        use_remote_address=wrappers_pb2.BoolValue(value=False),
        normalize_path=wrappers_pb2.BoolValue(value=True),
        upgrade_configs=[hcm_pb2.HttpConnectionManager.UpgradeConfig(upgrade_type="websocket")],
        **fields,
    )
    return manager


def _address(ip: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=ip, port_value=port))
