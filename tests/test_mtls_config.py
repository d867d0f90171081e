"""mTLS in the generated xDS, and who may connect as which proxy on the TLS port. Pure, no peers."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2

from istiod.model.mesh import MeshConfig
from istiod.model.proxy import proxy_from_node
from istiod.model.service import Endpoint, Port, Service
from istiod.model.snapshot import Snapshot
from istiod.xds.authz import identity_mismatch
from istiod.xds.cache import ResourceCache
from istiod.xds.gen.grpc import clusters, listeners

HOST = "echo.app.svc.cluster.local"
CLUSTER = f"outbound|7070||{HOST}"


def snapshot(mtls: bool, accounts: tuple[str, ...] = ("echo",)) -> Snapshot:
    service = Service("echo", "app", "cluster.local", (Port("grpc", 7070),))
    endpoints = tuple(Endpoint(f"127.0.0.{i + 10}", 8080, 7070, service_account=sa, namespace="app")
                      for i, sa in enumerate(accounts))
    return Snapshot("v1", {HOST: service}, {(HOST, 7070): endpoints}, mesh=MeshConfig("example.org", mtls))


def proxy(ip: str = "127.0.0.10", service_account: str = "echo"):  # type: ignore[no-untyped-def]
    return proxy_from_node(f"sidecar~{ip}~echo-1.app~app.svc.cluster.local",
                           {"NAMESPACE": "app", "SERVICE_ACCOUNT": service_account, "GENERATOR": "grpc"})


def test_outbound_cluster_checks_the_destination_identities() -> None:
    cache = ResourceCache()
    plain = cluster_pb2.Cluster.FromString(clusters(snapshot(False), proxy(), [CLUSTER], cache)[0].value)
    assert not plain.HasField("transport_socket")
    resource = clusters(snapshot(True, ("echo", "echo", "")), proxy(), [CLUSTER], ResourceCache())[0]
    socket = cluster_pb2.Cluster.FromString(resource.value).transport_socket
    assert socket.name == "envoy.transport_sockets.tls"
    context = tls_pb2.UpstreamTlsContext()
    socket.typed_config.Unpack(context)
    common = context.common_tls_context
    assert (common.tls_certificate_provider_instance.instance_name, common.tls_certificate_provider_instance.certificate_name) == ("default", "default")
    roots = common.validation_context.ca_certificate_provider_instance
    assert (roots.instance_name, roots.certificate_name) == ("default", "ROOTCA")
    assert [m.exact for m in common.validation_context.match_subject_alt_names] == [
        "spiffe://example.org/ns/app/sa/default", "spiffe://example.org/ns/app/sa/echo"]


def test_cluster_follows_the_endpoints_service_accounts_through_the_cache() -> None:
    cache, before = ResourceCache(), snapshot(True, ("echo",))
    first = clusters(before, proxy(), [CLUSTER], cache)[0]
    assert clusters(before, proxy(), [CLUSTER], cache)[0] is first  # same inputs: served from the cache
    after = Snapshot("v2", before.services, {(HOST, 7070): (Endpoint("127.0.0.11", 8080, 7070, service_account="other", namespace="app"),)},
                     mesh=before.mesh)
    assert b"sa/other" in clusters(after, proxy(), [CLUSTER], cache)[0].value


def test_inbound_listener_requires_a_client_certificate() -> None:
    name = "xds.istio.io/grpc/lds/inbound/127.0.0.10:8080"
    plain = listener_pb2.Listener.FromString(listeners(snapshot(False), proxy(), [name], ResourceCache())[0].value)
    assert not plain.filter_chains[0].HasField("transport_socket")
    strict = listener_pb2.Listener.FromString(listeners(snapshot(True), proxy(), [name], ResourceCache())[0].value)
    context = tls_pb2.DownstreamTlsContext()
    strict.filter_chains[0].transport_socket.typed_config.Unpack(context)
    assert context.require_client_certificate.value is True
    assert context.common_tls_context.tls_certificate_provider_instance.instance_name == "default"
    assert context.common_tls_context.validation_context.ca_certificate_provider_instance.certificate_name == "ROOTCA"


def test_connection_identity() -> None:
    web = "spiffe://cluster.local/ns/app/sa/echo"
    assert identity_mismatch(proxy(), [web]) is None
    assert identity_mismatch(proxy(service_account=""), ["spiffe://cluster.local/ns/app/sa/anything"]) is None
    assert identity_mismatch(proxy(), ["spiffe://cluster.local/ns/other/sa/echo"]) == (
        "no identities ([spiffe://cluster.local/ns/other/sa/echo]) matched app/echo")
    assert identity_mismatch(proxy(), ["spiffe://cluster.local/ns/app/sa/web", "not-spiffe"]) == (
        "no identities ([spiffe://cluster.local/ns/app/sa/web not-spiffe]) matched app/echo")
