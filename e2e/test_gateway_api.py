"""The Gateway API on a real kube-apiserver with the CRDs of sigs.k8s.io/gateway-api v1.6.0:
istiod creates the GatewayClass `istio` and writes the status Istio writes (GatewayClass Accepted;
Gateway Accepted and Programmed with its address and each listener's attachedRoutes and
conditions; each route parent's Accepted and ResolvedRefs with controllerName
istio.io/gateway-controller). A ReferenceGrant removed flips ResolvedRefs to RefNotPermitted.
istiod runs as its own ServiceAccount under exactly deploy/rbac/istiod.yaml."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from e2e.gateway_api_crds import install_gateway_api_crds
from e2e.harness import Cluster
from e2e.kube_objects import create_running_pod, ensure_namespace, pod_body
from e2e.test_rbac import istiod_kubeconfig
from tests.peers import Istiod, Process
from tests.test_gateway_gen import server_credential, tls_secret

CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"  # read, never parsed, by the status
GROUP, VERSION = "gateway.networking.k8s.io", "v1"
X_GROUP = "gateway.networking.x-k8s.io"  # the experimental channel's X kinds


async def _status(custom: client.CustomObjectsApi, plural: str, namespace: str, name: str) -> dict[str, Any]:
    if not namespace:
        body = await custom.get_cluster_custom_object(GROUP, VERSION, plural, name)
    else:
        body = await custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
    return body.get("status") or {}


def _conditions(conditions: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in conditions}


async def _wait(check: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    last: Any = None
    for _ in range(int(timeout * 4)):
        try:
            last = await check()
            if last:
                return last
        except (KeyError, IndexError, client.exceptions.ApiException):
            pass
        await asyncio.sleep(0.25)
    raise AssertionError(f"{what} within {timeout}s; last: {last}")


async def test_status_as_istio_writes_it(cluster: Cluster, kube: client.ApiClient, tmp_path: Path,
                                        processes: list[Process]) -> None:
    await install_gateway_api_crds(kube)
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    custom, core = client.CustomObjectsApi(kube), client.CoreV1Api(kube)
    await ensure_namespace(kube, "gw-ingress")
    await ensure_namespace(kube, "gw-shop")
    await core.create_namespaced_service("gw-shop", {"metadata": {"name": "echo"}, "spec": {
        "selector": {"app": "echo"}, "ports": [{"name": "http", "port": 8080}]}})
    await core.create_namespaced_service("gw-ingress", {"metadata": {"name": "web-istio"}, "spec": {
        "selector": {"gateway.networking.k8s.io/gateway-name": "web"}, "ports": [{"name": "http", "port": 80}]}})
    await custom.create_namespaced_custom_object(GROUP, VERSION, "gw-ingress", "gateways", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Gateway", "metadata": {"name": "web"},
        "spec": {"gatewayClassName": "istio", "listeners": [
            {"name": "http", "port": 80, "protocol": "HTTP", "allowedRoutes": {"namespaces": {"from": "All"}}},
            {"name": "clash", "port": 80, "protocol": "HTTPS", "tls": {"certificateRefs": [{"name": "nope"}]}}]}})
    await custom.create_namespaced_custom_object(GROUP, VERSION, "gw-ingress", "httproutes", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "HTTPRoute", "metadata": {"name": "shop"},
        "spec": {"parentRefs": [{"name": "web", "sectionName": "http"}], "hostnames": ["web.example.com"],
                 "rules": [{"backendRefs": [{"name": "echo", "namespace": "gw-shop", "port": 8080}]}]}})
    await custom.create_namespaced_custom_object(GROUP, "v1beta1", "gw-shop", "referencegrants", {
        "apiVersion": f"{GROUP}/v1beta1", "kind": "ReferenceGrant", "metadata": {"name": "from-ingress"},
        "spec": {"from": [{"group": GROUP, "kind": "HTTPRoute", "namespace": "gw-ingress"}],
                 "to": [{"group": "", "kind": "Service"}]}})
    # A BackendTLSPolicy on the route's backend, its CA in a ConfigMap.
    await core.create_namespaced_config_map("gw-shop", {"metadata": {"name": "echo-ca"}, "data": {"ca.crt": CA_PEM}})
    await custom.create_namespaced_custom_object(GROUP, VERSION, "gw-shop", "backendtlspolicies", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "BackendTLSPolicy", "metadata": {"name": "echo-tls"},
        "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}],
                 "validation": {"hostname": "echo.internal",
                                "caCertificateRefs": [{"group": "", "kind": "ConfigMap", "name": "echo-ca"}]}}})
    # A short lease: an istiod an earlier test of the session killed may still hold the writers' lock.
    istiod = Istiod(tmp_path, "--kubeconfig", str(kubeconfig), "--leader-lease-duration", "2s",
                    "--leader-renew-deadline", "1.5s", "--leader-retry-period", "0.25s", ready_timeout=60)
    processes.append(istiod)

    async def gateway_not_programmed() -> dict[str, Any] | None:  # no deployment yet: no endpoints
        status = await _status(custom, "gateways", "gw-ingress", "web")
        return status if _conditions(status["conditions"])["Programmed"] == ("False", "AddressNotAssigned") else None

    print("Gateway web without its pods:", (await _wait(gateway_not_programmed, "Programmed False"))["conditions"])
    await create_running_pod(kube, "gw-ingress", pod_body("web-1", "web", 80, labels={
        "gateway.networking.k8s.io/gateway-name": "web"}), "10.244.0.80")

    async def class_accepted() -> dict[str, Any] | None:  # the CRD's default is Unknown/Pending
        status = await _status(custom, "gatewayclasses", "", "istio")
        return status if _conditions(status["conditions"])["Accepted"] == ("True", "Accepted") else None

    cls = await _wait(class_accepted, "the GatewayClass istio created and Accepted")
    print("GatewayClass istio:", cls)

    async def gateway_programmed() -> dict[str, Any] | None:
        status = await _status(custom, "gateways", "gw-ingress", "web")
        programmed = _conditions(status["conditions"])["Programmed"] == ("True", "Programmed")
        return status if programmed and status["listeners"][0]["attachedRoutes"] == 1 else None

    gateway = await _wait(gateway_programmed, "the Gateway's status with the route attached")
    print("Gateway web:", gateway)
    conditions = _conditions(gateway["conditions"])
    assert conditions["Accepted"] == ("True", "ListenersNotValid") and conditions["Programmed"] == ("True", "Programmed")
    service = await core.read_namespaced_service("web-istio", "gw-ingress")
    assert gateway["addresses"] == [{"type": "IPAddress", "value": service.spec.cluster_ip}]
    http, clash = gateway["listeners"]
    assert _conditions(http["conditions"]) == {"Accepted": ("True", "Accepted"), "Programmed": ("True", "Programmed"),
                                                "Conflicted": ("False", "NoConflicts"),
                                                "ResolvedRefs": ("True", "ResolvedRefs")}
    assert _conditions(clash["conditions"]) == {"Accepted": ("False", "ProtocolConflict"),
                                                 "Programmed": ("False", "ProtocolConflict"),
                                                 "Conflicted": ("True", "ProtocolConflict")}

    route = await _wait(lambda: _status(custom, "httproutes", "gw-ingress", "shop"), "the route's status")
    print("HTTPRoute shop:", route)
    parent = route["parents"][0]
    assert parent["controllerName"] == "istio.io/gateway-controller"
    assert parent["parentRef"] == {"group": GROUP, "kind": "Gateway", "name": "web", "sectionName": "http"}
    assert _conditions(parent["conditions"]) == {"Accepted": ("True", "Accepted"),
                                                 "ResolvedRefs": ("True", "ResolvedRefs"),
                                                 "ResolvedWaypoints": ("True", "ResolvedWaypoints")}

    async def policy_status() -> dict[str, Any] | None:
        status = await _status(custom, "backendtlspolicies", "gw-shop", "echo-tls")
        return status if len(status.get("ancestors") or []) == 2 else None

    policy = await _wait(policy_status, "the BackendTLSPolicy's ancestors")
    print("BackendTLSPolicy echo-tls:", policy)
    mesh, gateway_ancestor = policy["ancestors"]
    assert (mesh["ancestorRef"], mesh["controllerName"]) == (
        {"group": "", "kind": "Service", "name": "echo"}, "istio.io/mesh-controller")
    assert (gateway_ancestor["ancestorRef"], gateway_ancestor["controllerName"]) == (
        {"group": GROUP, "kind": "Gateway", "name": "web"}, "istio.io/gateway-controller")
    for ancestor in policy["ancestors"]:
        assert _conditions(ancestor["conditions"]) == {"Accepted": ("True", "Accepted"),
                                                       "ResolvedRefs": ("True", "ResolvedRefs")}
    await custom.delete_namespaced_custom_object(GROUP, VERSION, "gw-shop", "backendtlspolicies", "echo-tls")

    await custom.delete_namespaced_custom_object(GROUP, "v1beta1", "gw-shop", "referencegrants", "from-ingress")

    async def refused() -> dict[str, Any] | None:
        status = await _status(custom, "httproutes", "gw-ingress", "shop")
        resolved = _conditions(status["parents"][0]["conditions"])["ResolvedRefs"]
        return status if resolved == ("False", "RefNotPermitted") else None

    flipped = await _wait(refused, "ResolvedRefs False (RefNotPermitted) once the ReferenceGrant is gone")
    print("after the ReferenceGrant is removed:", flipped["parents"][0]["conditions"])
    assert "Forbidden" not in istiod.text()
    # Other tests share the cluster (and read every Gateway): leave none behind.
    await custom.delete_namespaced_custom_object(GROUP, VERSION, "gw-ingress", "httproutes", "shop")
    await custom.delete_namespaced_custom_object(GROUP, VERSION, "gw-ingress", "gateways", "web")


async def test_tls_and_tcp_routes_status(cluster: Cluster, kube: client.ApiClient, tmp_path: Path,
                                         processes: list[Process]) -> None:
    """TLSRoute and TCPRoute (the experimental channel's CRDs) on a Gateway's TLS Passthrough and
    TCP listeners: each listener's supportedKinds and attachedRoutes, each route's parent conditions;
    an XBackendTrafficPolicy (that channel's, in its own group and version) on the backend Service."""
    await install_gateway_api_crds(kube)
    await install_gateway_api_crds(kube, "experimental")  # adds TCPRoute and TLSRoute (and keeps the rest)
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    custom, core = client.CustomObjectsApi(kube), client.CoreV1Api(kube)
    await ensure_namespace(kube, "gw-l4")
    await core.create_namespaced_service("gw-l4", {"metadata": {"name": "backend"}, "spec": {
        "selector": {"app": "backend"}, "ports": [{"name": "tls", "port": 443}]}})
    await custom.create_namespaced_custom_object(GROUP, VERSION, "gw-l4", "gateways", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Gateway", "metadata": {"name": "edge"},
        "spec": {"gatewayClassName": "istio", "listeners": [
            {"name": "tls", "port": 443, "protocol": "TLS", "tls": {"mode": "Passthrough"}},
            {"name": "tcp", "port": 9000, "protocol": "TCP"}]}})
    backend = [{"backendRefs": [{"name": "backend", "port": 443}]}]
    await custom.create_namespaced_custom_object(GROUP, VERSION, "gw-l4", "tlsroutes", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TLSRoute", "metadata": {"name": "sni"},
        "spec": {"parentRefs": [{"name": "edge", "sectionName": "tls"}], "hostnames": ["tls.example.com"], "rules": backend}})
    await custom.create_namespaced_custom_object(GROUP, VERSION, "gw-l4", "tcproutes", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TCPRoute", "metadata": {"name": "raw"},
        "spec": {"parentRefs": [{"name": "edge", "sectionName": "tcp"}],
                 "rules": [{"backendRefs": [{"name": "missing", "port": 1}]}]}})
    await custom.create_namespaced_custom_object(X_GROUP, "v1alpha1", "gw-l4", "xbackendtrafficpolicies", {
        "apiVersion": f"{X_GROUP}/v1alpha1", "kind": "XBackendTrafficPolicy", "metadata": {"name": "retries"},
        "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "backend"}], "retryConstraint": {}}})
    istiod = Istiod(tmp_path, "--kubeconfig", str(kubeconfig), "--leader-lease-duration", "2s",
                    "--leader-renew-deadline", "1.5s", "--leader-retry-period", "0.25s", ready_timeout=60)
    processes.append(istiod)
    try:
        async def attached() -> dict[str, Any] | None:
            status = await _status(custom, "gateways", "gw-l4", "edge")
            return status if [x["attachedRoutes"] for x in status["listeners"]] == [1, 1] else None

        gateway = await _wait(attached, "both listeners with their route attached")
        print("Gateway edge listeners:", gateway["listeners"])
        tls, tcp = gateway["listeners"]
        assert tls["supportedKinds"] == [{"group": GROUP, "kind": "TLSRoute"}]
        assert tcp["supportedKinds"] == [{"group": GROUP, "kind": "TCPRoute"}]
        for listener in (tls, tcp):
            assert _conditions(listener["conditions"])["Accepted"] == ("True", "Accepted")
        sni = await _wait(lambda: _status(custom, "tlsroutes", "gw-l4", "sni"), "the TLSRoute's status")
        print("TLSRoute sni:", sni)
        assert _conditions(sni["parents"][0]["conditions"]) == {"Accepted": ("True", "Accepted"),
                                                                "ResolvedRefs": ("True", "ResolvedRefs"),
                                                                "ResolvedWaypoints": ("True", "ResolvedWaypoints")}
        raw = await _wait(lambda: _status(custom, "tcproutes", "gw-l4", "raw"), "the TCPRoute's status")
        print("TCPRoute raw:", raw)
        assert _conditions(raw["parents"][0]["conditions"]) == {"Accepted": ("True", "Accepted"),
                                                                "ResolvedRefs": ("False", "BackendNotFound"),
                                                                "ResolvedWaypoints": ("True", "ResolvedWaypoints")}

        async def policy_status() -> dict[str, Any]:
            body = await custom.get_namespaced_custom_object(X_GROUP, "v1alpha1", "gw-l4", "xbackendtrafficpolicies",
                                                             "retries")
            return body.get("status") or {}

        policy = await _wait(policy_status, "the XBackendTrafficPolicy's ancestors")
        print("XBackendTrafficPolicy retries:", policy)
        [ancestor] = policy["ancestors"]
        assert ancestor["ancestorRef"] == {"group": "", "kind": "Service", "name": "backend"}
        assert ancestor["controllerName"] == "istio.io/mesh-controller"
        assert _conditions(ancestor["conditions"]) == {"Accepted": ("True", "Accepted")}
    finally:
        await custom.delete_namespaced_custom_object(X_GROUP, "v1alpha1", "gw-l4", "xbackendtrafficpolicies", "retries")
        # Other tests share the cluster (and read every Gateway): leave none behind.
        await custom.delete_namespaced_custom_object(GROUP, VERSION, "gw-l4", "tlsroutes", "sni")
        await custom.delete_namespaced_custom_object(GROUP, VERSION, "gw-l4", "tcproutes", "raw")
        await custom.delete_namespaced_custom_object(GROUP, VERSION, "gw-l4", "gateways", "edge")


async def test_mutual_listeners_status(cluster: Cluster, kube: client.ApiClient, tmp_path: Path,
                                       processes: list[Process]) -> None:
    """HTTPS listeners made MUTUAL as istiod reads them, on the CRDs' own defaults: the
    `gateway.istio.io/tls-terminate-mode` option and spec.tls.frontend validation (default and perPort)
    are Accepted; a perPort caCertificateRef to a missing Secret is `Accepted: False`, NoValidCACertificate."""
    await install_gateway_api_crds(kube)
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    custom, core = client.CustomObjectsApi(kube), client.CoreV1Api(kube)
    await ensure_namespace(kube, "gw-mtls")
    ca, cert, key = server_credential("secure.example.com")
    await core.create_namespaced_secret("gw-mtls", tls_secret("web-cert", "gw-mtls", cert, key))
    await core.create_namespaced_secret("gw-mtls", {"metadata": {"name": "client-ca"},
                                                    "data": {"ca.crt": base64.b64encode(ca).decode()}})

    def https(name: str, port: int, options: dict[str, str] | None = None) -> dict[str, Any]:
        return {"name": name, "port": port, "protocol": "HTTPS", "hostname": "secure.example.com",
                "tls": {"certificateRefs": [{"name": "web-cert"}], **({"options": options} if options else {})}}

    ca_ref = {"group": "", "kind": "Secret", "name": "client-ca"}
    await custom.create_namespaced_custom_object(GROUP, VERSION, "gw-mtls", "gateways", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Gateway", "metadata": {"name": "mtls"},
        "spec": {"gatewayClassName": "istio", "listeners": [
            https("option", 8443, {"gateway.istio.io/tls-terminate-mode": "MUTUAL"}), https("frontend", 8444),
            https("missing-ca", 8445)],
            "tls": {"frontend": {"default": {"validation": {"caCertificateRefs": [ca_ref]}},
                                 "perPort": [{"port": 8443, "tls": {}},
                                             {"port": 8445, "tls": {"validation": {"caCertificateRefs": [
                                                 {**ca_ref, "name": "nowhere"}]}}}]}}}})
    istiod = Istiod(tmp_path, "--kubeconfig", str(kubeconfig), "--leader-lease-duration", "2s",
                    "--leader-renew-deadline", "1.5s", "--leader-retry-period", "0.25s", ready_timeout=60)
    processes.append(istiod)
    try:
        async def reported() -> dict[str, Any] | None:
            status = await _status(custom, "gateways", "gw-mtls", "mtls")
            return status if len(status.get("listeners", [])) == 3 else None

        gateway = await _wait(reported, "the listeners' status")
        print("Gateway mtls listeners:", gateway["listeners"])
        option, frontend, missing = (_conditions(x["conditions"]) for x in gateway["listeners"])
        for conditions in (option, frontend):
            assert conditions["Accepted"] == ("True", "Accepted") and conditions["ResolvedRefs"] == ("True", "ResolvedRefs")
        assert missing["Accepted"] == ("False", "NoValidCACertificate")
        assert missing["ResolvedRefs"] == ("False", "InvalidCACertificateRef")
        assert "Forbidden" not in istiod.text()
    finally:
        await custom.delete_namespaced_custom_object(GROUP, VERSION, "gw-mtls", "gateways", "mtls")
