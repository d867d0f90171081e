"""Which Gateway servers a gateway proxy serves, and which VirtualServices each one routes.

What is implemented: HTTP servers; HTTPS servers terminating TLS (`SIMPLE`, `MUTUAL`,
`OPTIONAL_MUTUAL` with a `credentialName` or several `credentialNames`, Secrets in the gateway's
namespace, clients pinned by `verifyCertificateSpki`/`verifyCertificateHash`; `ISTIO_MUTUAL` with
the proxy's mesh certificate); TCP servers and
TLS servers (terminating as HTTPS does, or `PASSTHROUGH`, as HTTPS `PASSTHROUGH` too), routed by
the VirtualServices' `tcp` and `tls` routes; `AUTO_PASSTHROUGH` by the SNI naming a mesh service. Any other server is left out with a warning naming
it, never served half-configured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from istiod import logs
from istiod.model.config import scope
from istiod.model.config.gateway_conversion import GATEWAY_CREDENTIAL_PREFIX
from istiod.xds.gen.tls import CA_SUFFIX, CREDENTIAL_PREFIX
from istiod.model.config.networking import Gateway, Server, ServerTLSMode, VirtualService
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.sidecar.ports import outbound_ports
from istiod.xds.gen.targets import destination_rule

ANY_ADDRESS = "0.0.0.0"
HTTP_PROTOCOLS = frozenset({"HTTP", "HTTP2", "GRPC"})
PORT_TRANSLATION_OPT_OUT = "networking.istio.io/disable-gateway-port-translation"
TERMINATING = frozenset({ServerTLSMode.SIMPLE, ServerTLSMode.MUTUAL, ServerTLSMode.OPTIONAL_MUTUAL,
                         ServerTLSMode.ISTIO_MUTUAL})

log = logging.getLogger(__name__)
_unsupported = logs.Throttled(log, 60.0)  # every push meets the same server again


@dataclass(frozen=True, slots=True)
class GatewayServer:
    gateway: Gateway
    server: Server
    # Where Envoy listens: the target port of the gateway's Service port that is the server's
    # number, else the number itself (istiod's resolvePorts for selector-bound Gateways).
    listen_port: int

    @property
    def ref(self) -> str:
        """How VirtualServices bind to the Gateway: `<namespace>/<name>`."""
        return f"{self.gateway.meta.namespace}/{self.gateway.meta.name}"

    @property
    def port(self) -> int:
        return self.server.port.number

    @property
    def address(self) -> str:
        return self.server.bind or ANY_ADDRESS

    @property
    def listener_name(self) -> str:
        return f"{self.address}_{self.listen_port}"

    @property
    def tls(self) -> bool:
        """An HTTPS server that terminates TLS (an HTTP chain behind it)."""
        return self.server.port.protocol == "HTTPS" and self.terminates

    @property
    def terminates(self) -> bool:
        return self.server.tls is not None and self.server.tls.mode in TERMINATING

    @property
    def mesh_tls(self) -> bool:
        """ISTIO_MUTUAL: the proxy's own mesh certificate, and clients' verified by the mesh root."""
        return self.server.tls is not None and self.server.tls.mode is ServerTLSMode.ISTIO_MUTUAL

    @property
    def plaintext_http(self) -> bool:
        """A port's servers are all of this kind (one HTTP chain) or none (a chain per server)."""
        return self.server.port.protocol in HTTP_PROTOCOLS

    @property
    def passthrough(self) -> bool:
        """TLS passed on unopened, to where the VirtualServices' `tls` routes send by SNI."""
        return self.server.tls is not None and self.server.tls.mode is ServerTLSMode.PASSTHROUGH and not self.plaintext_http

    @property
    def auto_passthrough(self) -> bool:
        """TLS passed on by an SNI `outbound_.<port>_.<subset>_.<host>` naming the mesh service (an
        east-west gateway's), to the SNI-DNAT cluster of that name."""
        return self.server.tls is not None and self.server.tls.mode is ServerTLSMode.AUTO_PASSTHROUGH

    @property
    def route_name(self) -> str | None:
        """istiod's: `http.<port>` shared by a port's plaintext servers, one per HTTPS server; None
        for TCP and TLS servers, whose routes are in their listener."""
        port = self.listen_port
        if self.plaintext_http:
            return f"http.{port}"
        if not self.tls:
            return None
        meta = self.gateway.meta
        return f"https.{port}.{self.server.port.name}.{meta.name}.{meta.namespace}"

    @property
    def https_redirect(self) -> bool:
        """A plaintext server that answers every request with a 301 to https (tls.httpsRedirect)."""
        return self.plaintext_http and self.server.tls is not None and self.server.tls.https_redirect

    @property
    def credentials(self) -> tuple[str, ...]:
        """The SDS names, one per credentialNames entry (or the credentialName): `kubernetes://<name>`,
        or the Gateway API's `kubernetes-gateway://<ns>/<name>` as is."""
        assert self.server.tls is not None
        return tuple(name if name.startswith(GATEWAY_CREDENTIAL_PREFIX) else CREDENTIAL_PREFIX + name
                     for name in self.server.tls.credentials)

    @property
    def ca_credential(self) -> str | None:
        """The SDS name of the CA verifying clients (MUTUAL, OPTIONAL_MUTUAL): `<credential>-cacert` of
        the first credential (istiod takes one CA for all of credentialNames)."""
        tls = self.server.tls
        if tls is None or tls.mode not in (ServerTLSMode.MUTUAL, ServerTLSMode.OPTIONAL_MUTUAL) or not tls.credentials:
            return None  # files: the agent's file-root of caCertificates
        return tls.ca_cert_credential_name or self.credentials[0] + CA_SUFFIX

    @property
    def server_names(self) -> list[str]:
        """SNI names: the hosts' DNS names; none when any host is `*` (every name)."""
        names = list(dict.fromkeys(host for _, host in self.server.hosts))
        return [] if "*" in names else names


def unsupported(server: Server) -> str | None:
    """Why a server is not served, or None."""
    protocol, tls = server.port.protocol, server.tls
    if protocol in HTTP_PROTOCOLS:
        return None
    if protocol == "TCP":  # validation admits only PASSTHROUGH settings here: passthrough, as istiod
        return None
    if protocol not in ("HTTPS", "TLS"):
        return f"protocol {protocol} is not implemented (HTTP, HTTPS, TLS and TCP are)"
    assert tls is not None  # validation requires it for HTTPS and TLS
    if tls.mode in (ServerTLSMode.PASSTHROUGH, ServerTLSMode.AUTO_PASSTHROUGH):
        return None
    if tls.mode is ServerTLSMode.ISTIO_MUTUAL:  # validation admits no certificates here; subjectAltNames apply
        return None
    if not tls.credentials:  # files in the pod, served by the agent
        if tls.verify_certificate_spki or tls.verify_certificate_hash:
            return "tls.verifyCertificateSpki/Hash need tls.credentialName(s) (istiod ignores them with files)"
        return None
    if tls.subject_alt_names or tls.ca_certificates:
        return "tls.subjectAltNames/caCertificates are not implemented (the credentialName's ca.crt is)"
    if (tls.verify_certificate_spki or tls.verify_certificate_hash) and tls.mode is ServerTLSMode.SIMPLE:
        return "tls.verifyCertificateSpki/Hash need MUTUAL or OPTIONAL_MUTUAL (istiod ignores them with SIMPLE)"
    return None


def gateway_servers(snapshot: Snapshot, proxy: Proxy) -> list[GatewayServer]:
    """The servers of the Gateways selecting the proxy, by Gateway namespace and name. A port keeps
    the kind (plaintext HTTP or not) of its first server; a later server of the other kind is left out."""
    result: list[GatewayServer] = []
    kinds: dict[tuple[str, int], bool] = {}
    labels = dict(proxy.labels)
    # The Gateway API's Gateways configure proxies of their own namespace only (istiod: the
    # instances of the Gateway's Service, which lives there).
    gateways = [*scope.gateways_for(snapshot.config.gateways, labels),
                *(g for g in scope.gateways_for(snapshot.config.gateway_api.gateways, labels)
                  if g.meta.namespace == proxy.namespace)]
    targets = target_ports(snapshot, proxy)
    for gateway in gateways:
        for server in gateway.servers:
            served = GatewayServer(gateway, server, targets.get(server.port.number, server.port.number))
            reason = unsupported(server)
            plain = served.plaintext_http
            if reason is None and kinds.setdefault((served.address, served.listen_port), plain) != plain:
                reason = f"port {served.listen_port} already has {'HTTP' if not plain else 'HTTPS, TLS or TCP'} servers"
            if reason is not None:
                _unsupported.warning(logs.event("gateway server not served", gateway=served.ref,
                                                server=server.port.name, reason=reason))
                continue
            result.append(served)
    return result


def target_ports(snapshot: Snapshot, proxy: Proxy) -> dict[int, int]:
    """Service port -> the pod's port, of the Services whose endpoints the gateway's pod is (by
    hostname, the first wins), but those labelled to opt out, as istiod."""
    found: dict[int, int] = {}
    instances = [i for address in proxy.ip_addresses for i in snapshot.instances_on(address)]
    for service, endpoint in sorted(instances, key=lambda i: i[0].hostname):
        if PORT_TRANSLATION_OPT_OUT not in dict(service.labels):
            found.setdefault(endpoint.service_port, endpoint.port)
    return found


def servers_by(snapshot: Snapshot, proxy: Proxy,
               key: Callable[[GatewayServer], str | None]) -> list[tuple[str, tuple[GatewayServer, ...]]]:
    """The proxy's servers grouped by `key` (their listener's or route configuration's name, None
    for none), by name."""
    groups: dict[str, list[GatewayServer]] = {}
    for served in gateway_servers(snapshot, proxy):
        if (name := key(served)) is not None:
            groups.setdefault(name, []).append(served)
    return [(name, tuple(servers)) for name, servers in sorted(groups.items())]


def bound_hosts(snapshot: Snapshot, proxy: Proxy, served: GatewayServer) -> Iterator[tuple[str, VirtualService]]:
    """(host, VirtualService) for each VirtualService bound to the server's Gateway, visible to the
    proxy's namespace, and each of its hosts one of the server's hosts admits (the more specific
    of the two names, as istiod picks)."""
    for vs in scope.virtual_services_for(snapshot.config.all_virtual_services, proxy.namespace, served.ref,
                                         snapshot.config.export_defaults):
        for host in vs.hosts:
            for namespace, pattern in served.server.hosts:
                if not _namespace_admits(namespace, served.gateway.meta.namespace, vs.meta.namespace):
                    continue
                if scope.host_matches(pattern, host):
                    yield host, vs
                    break
                if scope.host_matches(host, pattern):
                    yield pattern, vs
                    break


def sni_dnat_names(snapshot: Snapshot, proxy: Proxy, served: GatewayServer) -> list[str]:
    """istiod's builtAutoPassthroughFilterChains: `outbound_.<port>_.<subset>_.<host>` for each port
    (and DestinationRule subset) of each mesh service the proxy sees that the server's hosts admit."""
    names = []
    for target in outbound_ports(snapshot, proxy):
        service = target.service
        if service.mesh_external or not any(
                namespace in ("*", service.namespace) or (namespace == "." and service.namespace == served.gateway.meta.namespace)
                for namespace, pattern in served.server.hosts if scope.host_matches(pattern, service.hostname)):
            continue
        rule = destination_rule(snapshot, proxy, service)
        for subset in ("", *(s.name for s in (rule.subsets if rule is not None else ()))):
            names.append(sni_dnat_name(target.port.port, service.hostname, subset))
    return list(dict.fromkeys(names))


def sni_dnat_name(port: int, host: str, subset: str = "") -> str:
    return f"outbound_.{port}_.{subset}_.{host}"


def _namespace_admits(namespace: str, gateway_namespace: str, vs_namespace: str) -> bool:
    return namespace == "*" or vs_namespace == (gateway_namespace if namespace == "." else namespace)
