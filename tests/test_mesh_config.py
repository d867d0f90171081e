"""The mesh config: parsing as istiod reads it, discoverySelectors with matchExpressions, and
changes applied by a running istiod without a restart."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from istiod.model.labels import Requirement, Selector
from istiod.model.mesh import ExtAuthzProvider, MeshConfig, OutboundTrafficPolicy, RequestBody
from istiod.sources.kube import KubeWriter
from istiod.sources.meshconfig import MeshConfigError, MeshConfigMapWatcher, parse_mesh_config
from istiod.sources.namespaces import NamespaceFilter
from istiod.sources.store import Store
from tests.peers import Istiod, wait_until
from tests.test_configdir import touch
from tests.test_kube_writer import keys, ns, svc

MESH = """
trustDomain: example.org
trustDomainAliases: [old.example, cluster.local]
rootNamespace: mesh-root
enableAutoMtls: false
outboundTrafficPolicy: {mode: REGISTRY_ONLY}
defaultConfig:
  discoveryAddress: istiod.mesh-root.svc:15012
  proxyMetadata: {ISTIO_META_DNS_CAPTURE: "true"}
  holdApplicationUntilProxyStarts: true
  tracing: {sampling: 1}
accessLogFile: /dev/stdout
enableTracing: true
discoverySelectors:
- matchLabels: {istio-discovery: enabled}
- matchExpressions:
  - {key: team, operator: In, values: [a, b]}
  - {key: legacy, operator: DoesNotExist}
extensionProviders:
- name: ext-http
  envoyExtAuthzHttp:
    service: authz/authz.authz.svc.cluster.local
    port: 8000
    timeout: 250ms
    failOpen: true
    statusOnError: "503"
    pathPrefix: /check
    includeRequestHeadersInCheck: [x-ext-authz, "x-user-*"]
    includeAdditionalHeadersInCheck: {x-from: mesh}
    headersToUpstreamOnAllow: [x-auth-result]
    headersToDownstreamOnDeny: [x-reason]
- name: ext-grpc
  envoyExtAuthzGrpc: {service: authz.authz.svc.cluster.local, port: 9000, clearRouteCache: true,
                      includeRequestBodyInCheck: {maxRequestBytes: 4096, packAsBytes: true}}
- name: tracer
  zipkin: {service: zipkin.istio-system.svc.cluster.local, port: 9411}
"""


def test_fields_istiod_reads(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        mesh = parse_mesh_config(MESH, MeshConfig(mtls=True), "mesh config test")
    assert mesh.trust_domain == "example.org" and mesh.root_namespace == "mesh-root" and mesh.mtls
    assert mesh.trust_domain_aliases == ("old.example", "cluster.local")
    assert mesh.outbound_traffic_policy is OutboundTrafficPolicy.REGISTRY_ONLY and not mesh.enable_auto_mtls
    assert mesh.default_config.discovery_address == "istiod.mesh-root.svc:15012"
    assert mesh.default_config.proxy_metadata == (("ISTIO_META_DNS_CAPTURE", "true"),)
    assert mesh.default_config.hold_application_until_proxy_starts
    # Every defaultConfig field goes to injected pods' PROXY_CONFIG; the agent names those it does not apply.
    assert "tracing" in json.loads(mesh.default_config.json)
    assert mesh.discovery_selectors == (
        Selector((Requirement("istio-discovery", "=", ("enabled",)),)),
        Selector((Requirement("team", "in", ("a", "b")), Requirement("legacy", "!"))),
    )
    assert mesh.extension_providers == (
        ExtAuthzProvider("ext-http", False, "authz/authz.authz.svc.cluster.local", 8000, 0.25, True, 503, "/check",
                         ("x-ext-authz", "x-user-*"), (("x-from", "mesh"),), ("x-auth-result",), ("x-reason",)),
        ExtAuthzProvider("ext-grpc", True, "authz.authz.svc.cluster.local", 9000,
                         request_body=RequestBody(4096, pack_as_bytes=True), clear_route_cache=True),
    )
    # What is not implemented is said, once, by name.
    assert ("not implemented, ignored: enableTracing, extensionProviders[2].zipkin (tracer)"
            in caplog.text)
    assert mesh.access_log is not None and mesh.access_log.path == "/dev/stdout"
    assert parse_mesh_config("", MeshConfig(trust_domain="flag.td"), "x").trust_domain == "flag.td"


@pytest.mark.parametrize("text, error", [
    ("rootNamespace: Not_A_Namespace", "rootNamespace: 'Not_A_Namespace' is not a namespace name"),
    ("outboundTrafficPolicy: {mode: SOMETIMES}", "outboundTrafficPolicy.mode: 'SOMETIMES' is not ALLOW_ANY"),
    ("discoverySelectors: [{matchExpressions: [{key: a, operator: Near}]}]",
     "discoverySelectors[0].matchExpressions[0]: operator: 'Near' is not one of"),
    ("discoverySelectors: [{matchExpressions: [{key: a, operator: In}]}]", "values: In needs some values"),
    ("enableAutoMtls: maybe", "enableAutoMtls: expected bool"),
    ("trustDomainAliases: [old.example, 7]", "trustDomainAliases[1]: expected str, got int"),
    ("[a, b]", "expected a map"),
    ("extensionProviders: [{name: a, envoyExtAuthzHttp: {service: x.svc, port: 0}}]",
     "extensionProviders[0].envoyExtAuthzHttp: port: port number 0 must be in the range 1..65535"),
    ("extensionProviders: [{name: a, envoyExtAuthzGrpc: {service: x.svc, port: 1}}, {name: a, envoyExtAuthzGrpc: "
     "{service: x.svc, port: 1}}]", "extensionProviders[1].name: extension provider name must be unique"),
    ("extensionProviders: [{name: a, envoyExtAuthzHttp: {service: x.svc, port: 1, pathPrefix: check}}]",
     "pathPrefix: pathPrefix should begin with `/` but found 'check'"),
    ("extensionProviders: [{name: a, envoyExtAuthzHttp: {service: x.svc, port: 1, statusOnError: '999'}}]",
     "statusOnError: invalid statusOnError value 999"),
    ("extensionProviders: [{name: a, envoyExtAuthzHttp: {service: x.svc, port: 1, timeout: 5}}]", "timeout: "),
    ("extensionProviders: [{name: a, envoyExtAuthzHttp: {service: x.svc, port: 1, headersToUpstreamOnAllow: ['*']}}]",
     "headersToUpstreamOnAllow: a single wildcard"),
    ("extensionProviders: [{name: a, envoyExtAuthzGrpc: {service: x.svc, port: 1, pathPrefix: /x}}]",
     "unknown field 'pathPrefix'"),
    ("extensionProviders: [{name: a, envoyExtAuthzHttp: {service: x.svc, port: 1, includeRequestBodyInCheck: "
     "{maxRequestBytes: -1}}}]", "includeRequestBodyInCheck: maxRequestBytes: -1 is not a uint32"),
    ("extensionProviders: [{name: a, envoyExtAuthzGrpc: {service: x.svc, port: 1, includeRequestBodyInCheck: "
     "{size: 1}}}]", "unknown field 'size'"),
])
def test_bad_mesh_config_names_the_field(text: str, error: str) -> None:
    with pytest.raises(MeshConfigError) as raised:
        parse_mesh_config(text, MeshConfig(), "mesh config m.yaml")
    assert error in str(raised.value) and "mesh config m.yaml" in str(raised.value)


def test_selector_changes_refilter_namespaces() -> None:
    store = Store()
    writer = KubeWriter(store, NamespaceFilter())
    writer.replace("Namespace", [ns("a", team="a"), ns("b", team="b", legacy="1"), ns("c")])
    writer.replace("Service", [svc("s", "a"), svc("s", "b"), svc("s", "c")])
    assert keys(store, "Service") == ["a/s", "b/s", "c/s"]
    selected = parse_mesh_config(MESH, MeshConfig(), "m").discovery_selectors
    writer.reselect(selected)
    assert keys(store, "Service") == ["a/s"]  # b is legacy, c has no team
    writer.reselect(())
    assert keys(store, "Service") == ["a/s", "b/s", "c/s"]


def test_configmap_watcher_applies_and_keeps_last_good(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[MeshConfig] = []
    watcher = MeshConfigMapWatcher.__new__(MeshConfigMapWatcher)  # no API client: only the writer side
    watcher.namespace, watcher.base, watcher.on_change, watcher.mesh = "istio-system", MeshConfig(), seen.append, MeshConfig()
    watcher.name = "istio"
    watcher.replace("ConfigMap", [{"data": {"mesh": "rootNamespace: one"}}])
    watcher.apply({"data": {"mesh": "rootNamespace: Bad_One"}})
    assert [m.root_namespace for m in seen] == ["one"] and watcher.mesh.root_namespace == "one"
    assert "ConfigMap istio-system/istio key mesh: rootNamespace" in caplog.text
    watcher.delete({})
    assert seen[-1] == MeshConfig()


def test_running_istiod_applies_mesh_changes(mesh_dir: Path, tmp_path: Path,
                                             start_istiod: Callable[..., Istiod]) -> None:
    mesh_file = tmp_path / "mesh.yaml"
    mesh_file.write_text("rootNamespace: first\n")
    istiod = start_istiod(mesh_dir, "--mesh-config", str(mesh_file))
    touch(mesh_file, "rootNamespace: second\noutboundTrafficPolicy: {mode: REGISTRY_ONLY}\n")
    wait_until(lambda: "root_namespace=second" in istiod.log(), 10, "the new mesh config applied")
    assert "outbound_traffic_policy=REGISTRY_ONLY" in istiod.log()
    touch(mesh_file, "rootNamespace: [\n")
    wait_until(lambda: "keeping the last good mesh config" in istiod.log(), 10, "the bad edit refused")
    assert istiod.get("/ready")[0] == 200


def test_protocol_detection_timeout() -> None:
    assert MeshConfig().protocol_detection_timeout == 0  # Istio's default: wait for the client
    assert parse_mesh_config("protocolDetectionTimeout: 250ms", MeshConfig(), "m").protocol_detection_timeout == 0.25
    for bad in ("-1s", "5", "soon"):
        with pytest.raises(MeshConfigError, match="protocolDetectionTimeout"):
            parse_mesh_config(f"protocolDetectionTimeout: {bad!r}", MeshConfig(), "m")


def test_default_service_export_to() -> None:
    assert MeshConfig().default_service_export_to == ()  # every namespace
    parsed = parse_mesh_config("defaultServiceExportTo: ['.', istio-system]", MeshConfig(), "m")
    assert parsed.default_service_export_to == (".", "istio-system")


def test_default_virtual_service_and_destination_rule_export_to() -> None:
    assert MeshConfig().default_virtual_service_export_to == MeshConfig().default_destination_rule_export_to == ()
    parsed = parse_mesh_config("defaultVirtualServiceExportTo: [shop, '.']\ndefaultDestinationRuleExportTo: ['*']",
                               MeshConfig(), "m")
    assert parsed.default_virtual_service_export_to == (".", "shop")
    assert parsed.default_destination_rule_export_to == ("*",)
    # An edit without the field: back to the base (every namespace).
    assert parse_mesh_config("trustDomain: x", MeshConfig(), "m").default_virtual_service_export_to == ()
    with pytest.raises(MeshConfigError, match="defaultVirtualServiceExportTo"):
        parse_mesh_config("defaultVirtualServiceExportTo: [1]", MeshConfig(), "m")
