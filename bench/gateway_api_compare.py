"""What Istio's own istiod and ours write as the Gateway API's status for the same objects (a dev
tool: it needs Istio's pilot-discovery, built by shared/reference-istiod/build.sh, which CI does not
have).

    python bench/gateway_api_compare.py [--reference PATH]

etcd and kube-apiserver are started (the e2e harness), Istio's CRDs and the Gateway API's
(sigs.k8s.io/gateway-api v1.6.0, from the Go module cache) installed, and one Gateway of class
`istio` (an HTTP listener, an HTTPS one with a Secret, one conflicting, one with a missing Secret,
MUTUAL ones by tls-terminate-mode and by spec.tls.frontend, one with a missing CA, one with
AllowInsecureFallback, one with two Secrets)
with HTTPRoutes (a valid one, one to a missing Service, one across namespaces with a
ReferenceGrant; GAMMA routes on a Service: a producer's, a consumer's, one on a missing Service) created, and a
waypoint (class `istio-waypoint`, its HBONE listener and a refused HTTP one), and Gateways whose
parametersRef names a ConfigMap that exists, one that does not, and another kind, and BackendTLSPolicies
(one valid, one on a missing Service with a missing CA). Istio's istiod runs first and its status is recorded and cleared, then
ours. Prints each object's conditions side by side (type, status, reason; messages where they
differ) and the listeners' attachedRoutes, then the route configuration `http.80` each sends the
Gateway's proxy (a router node labelled with the Gateway's name, on the plaintext port): virtual
hosts, domains, and each route's match and action. Exits 1 if a status or reason differs.
Every process started here is stopped at the end, on failure and Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
from e2e.gateway_api_crds import install_gateway_api_crds  # noqa: E402
from e2e.harness import Cluster  # noqa: E402
from e2e.istio_crds import install_crds  # noqa: E402
from istiod.kubeapi import api_client  # noqa: E402
from reference import add_reference_argument, reference_binary, start_reference  # noqa: E402
from envoy.config.route.v3 import route_pb2  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from tests.ads_client import AdsClient  # noqa: E402
from tests.peers import Istiod, stop_group  # noqa: E402
from tests.test_gateway_gen import server_credential, tls_secret  # noqa: E402

GROUP = "gateway.networking.k8s.io"
OBJECTS = f"""
apiVersion: {GROUP}/v1
kind: Gateway
metadata: {{name: web, namespace: gw-ingress}}
spec:
  gatewayClassName: istio
  listeners:
  - {{name: http, port: 80, protocol: HTTP, allowedRoutes: {{namespaces: {{from: All}}}}}}
  - {{name: https, port: 443, protocol: HTTPS, hostname: secure.example.com,
     tls: {{mode: Terminate, certificateRefs: [{{name: web-cert}}]}}}}
  - {{name: clash, port: 80, protocol: HTTPS, tls: {{mode: Terminate, certificateRefs: [{{name: web-cert}}]}}}}
  - {{name: bad-cert, port: 8443, protocol: HTTPS, tls: {{mode: Terminate, certificateRefs: [{{name: missing}}]}}}}
  - {{name: mutual, port: 9443, protocol: HTTPS, tls: {{mode: Terminate, certificateRefs: [{{name: web-cert}}],
     options: {{gateway.istio.io/tls-terminate-mode: MUTUAL}}}}}}
  - {{name: two-certs, port: 9444, protocol: HTTPS, tls: {{mode: Terminate, certificateRefs: [{{name: web-cert}}, {{name: web-cert}}]}}}}
  - {{name: frontend, port: 9445, protocol: HTTPS, tls: {{mode: Terminate, certificateRefs: [{{name: web-cert}}]}}}}
  - {{name: frontend-missing-ca, port: 9446, protocol: HTTPS, tls: {{mode: Terminate, certificateRefs: [{{name: web-cert}}]}}}}
  - {{name: frontend-fallback, port: 9447, protocol: HTTPS, tls: {{mode: Terminate, certificateRefs: [{{name: web-cert}}]}}}}
  tls:
    frontend:
      default: {{}}
      perPort:
      - {{port: 9445, tls: {{validation: {{caCertificateRefs: [{{group: "", kind: Secret, name: client-ca}}]}}}}}}
      - {{port: 9446, tls: {{validation: {{caCertificateRefs: [{{group: "", kind: Secret, name: no-ca}}]}}}}}}
      - {{port: 9447, tls: {{validation: {{caCertificateRefs: [{{group: "", kind: Secret, name: client-ca}}],
                                          mode: AllowInsecureFallback}}}}}}
---
apiVersion: {GROUP}/v1
kind: HTTPRoute
metadata: {{name: shop, namespace: gw-shop}}
spec:
  parentRefs: [{{name: web, namespace: gw-ingress, sectionName: http}}]
  hostnames: [web.example.com]
  rules: [{{matches: [{{path: {{type: PathPrefix, value: /}}}}], backendRefs: [{{name: echo, port: 8080}}]}}]
---
apiVersion: {GROUP}/v1
kind: HTTPRoute
metadata: {{name: broken, namespace: gw-shop}}
spec:
  parentRefs: [{{name: web, namespace: gw-ingress}}]
  hostnames: [broken.example.com]
  rules: [{{backendRefs: [{{name: nowhere, port: 8080}}]}}]
---
apiVersion: {GROUP}/v1
kind: HTTPRoute
metadata: {{name: secure, namespace: gw-ingress}}
spec:
  parentRefs: [{{name: web, sectionName: https}}]
  rules: [{{backendRefs: [{{name: echo, namespace: gw-shop, port: 8080}}]}}]
---
apiVersion: {GROUP}/v1
kind: HTTPRoute
metadata: {{name: refused, namespace: gw-other}}
spec:
  parentRefs: [{{name: web, namespace: gw-ingress, sectionName: http}}]
  hostnames: [refused.example.com]
  rules: [{{backendRefs: [{{name: echo, namespace: gw-shop, port: 8080}}]}}]
---
apiVersion: {GROUP}/v1
kind: Gateway
metadata: {{name: waypoint, namespace: gw-shop}}
spec:
  gatewayClassName: istio-waypoint
  listeners:
  - {{name: mesh, port: 15008, protocol: HBONE}}
  - {{name: http, port: 80, protocol: HTTP}}
---
apiVersion: {GROUP}/v1
kind: HTTPRoute
metadata: {{name: mesh, namespace: gw-shop}}
spec:
  parentRefs: [{{group: "", kind: Service, name: echo, port: 8080}}]
  rules: [{{backendRefs: [{{name: echo, port: 8080}}]}}]
---
apiVersion: {GROUP}/v1
kind: HTTPRoute
metadata: {{name: consumer, namespace: gw-other}}
spec:
  parentRefs: [{{group: "", kind: Service, name: echo, namespace: gw-shop}}, {{group: "", kind: Service, name: nope}}]
  rules: [{{backendRefs: [{{name: echo, namespace: gw-shop, port: 8080}}]}}]
---
apiVersion: {GROUP}/v1
kind: Gateway
metadata: {{name: tuned, namespace: gw-ingress}}
spec:
  gatewayClassName: istio
  infrastructure: {{parametersRef: {{group: "", kind: ConfigMap, name: tuned-params}}}}
  listeners: [{{name: http, port: 80, protocol: HTTP}}]
---
apiVersion: {GROUP}/v1
kind: Gateway
metadata: {{name: untuned, namespace: gw-ingress}}
spec:
  gatewayClassName: istio
  infrastructure: {{parametersRef: {{group: "", kind: ConfigMap, name: missing-params}}}}
  listeners: [{{name: http, port: 80, protocol: HTTP}}]
---
apiVersion: {GROUP}/v1
kind: Gateway
metadata: {{name: misparameterized, namespace: gw-ingress}}
spec:
  gatewayClassName: istio
  infrastructure: {{parametersRef: {{group: example.com, kind: Params, name: tuned-params}}}}
  listeners: [{{name: http, port: 80, protocol: HTTP}}]
---
apiVersion: {GROUP}/v1
kind: BackendTLSPolicy
metadata: {{name: echo-tls, namespace: gw-shop}}
spec:
  targetRefs: [{{group: "", kind: Service, name: echo}}]
  validation: {{hostname: echo.internal, caCertificateRefs: [{{group: "", kind: ConfigMap, name: echo-ca}}]}}
---
apiVersion: {GROUP}/v1
kind: BackendTLSPolicy
metadata: {{name: broken-tls, namespace: gw-shop}}
spec:
  targetRefs: [{{group: "", kind: Service, name: nowhere}}]
  validation: {{hostname: nowhere.internal, caCertificateRefs: [{{group: "", kind: ConfigMap, name: no-ca}}]}}
---
apiVersion: {GROUP}/v1beta1
kind: ReferenceGrant
metadata: {{name: from-ingress, namespace: gw-shop}}
spec:
  from: [{{group: {GROUP}, kind: HTTPRoute, namespace: gw-ingress}}]
  to: [{{group: "", kind: Service}}]
"""
PLURALS = {"Gateway": "gateways", "HTTPRoute": "httproutes", "ReferenceGrant": "referencegrants",
           "BackendTLSPolicy": "backendtlspolicies"}
WATCHED = [("gatewayclasses", "", "istio"), ("gatewayclasses", "", "istio-waypoint"),
           ("gateways", "gw-shop", "waypoint"), ("gateways", "gw-ingress", "web"), ("httproutes", "gw-shop", "shop"),
           ("httproutes", "gw-shop", "broken"), ("httproutes", "gw-ingress", "secure"),
           ("httproutes", "gw-other", "refused"), ("httproutes", "gw-shop", "mesh"),
           ("httproutes", "gw-other", "consumer"), ("gateways", "gw-ingress", "tuned"),
           ("gateways", "gw-ingress", "untuned"), ("gateways", "gw-ingress", "misparameterized"),
           ("backendtlspolicies", "gw-shop", "echo-tls"), ("backendtlspolicies", "gw-shop", "broken-tls")]


async def setup(api: client.ApiClient) -> None:
    await install_crds(api)
    await install_gateway_api_crds(api)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    for namespace in ("gw-ingress", "gw-shop", "gw-other"):
        await core.create_namespace({"metadata": {"name": namespace}})
    await core.create_namespaced_service("gw-shop", {"metadata": {"name": "echo"}, "spec": {
        "selector": {"app": "echo"}, "ports": [{"name": "http", "port": 8080}]}})
    await core.create_namespaced_service("gw-ingress", {"metadata": {"name": "web-istio"}, "spec": {
        "selector": {"gateway.networking.k8s.io/gateway-name": "web"}, "ports": [{"name": "http", "port": 80}]}})
    await core.create_namespaced_service("gw-shop", {"metadata": {"name": "waypoint"}, "spec": {
        "selector": {"gateway.networking.k8s.io/gateway-name": "waypoint"}, "ports": [{"name": "mesh", "port": 15008}]}})
    ca, cert, key = server_credential("secure.example.com")
    await core.create_namespaced_secret("gw-ingress", tls_secret("web-cert", "gw-ingress", cert, key))
    await core.create_namespaced_secret("gw-ingress", {"metadata": {"name": "client-ca"},
                                                       "data": {"ca.crt": base64.b64encode(ca).decode()}})
    await core.create_namespaced_config_map("gw-shop", {"metadata": {"name": "echo-ca"},
                                                        "data": {"ca.crt": ca.decode()}})
    await core.create_namespaced_config_map("gw-ingress", {"metadata": {"name": "tuned-params"},
                                                           "data": {"deployment": "spec: {replicas: 1}"}})
    for body in yaml.safe_load_all(OBJECTS):
        group, _, version = body["apiVersion"].partition("/")
        await custom.create_namespaced_custom_object(group, version, body["metadata"]["namespace"],
                                                     PLURALS[body["kind"]], body)


async def statuses(api: client.ApiClient, settle: float = 8.0) -> dict[str, dict[str, Any]]:
    """Each watched object's status once the Gateway's listeners are reported and nothing changed
    for a while."""
    custom = client.CustomObjectsApi(api)
    last: dict[str, dict[str, Any]] = {}
    stable_since = time.monotonic()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        now: dict[str, dict[str, Any]] = {}
        for plural, namespace, name in WATCHED:
            try:
                body = (await custom.get_cluster_custom_object(GROUP, "v1", plural, name) if not namespace else
                        await custom.get_namespaced_custom_object(GROUP, "v1", namespace, plural, name))
            except client.exceptions.ApiException:
                continue
            now[f"{plural}/{namespace}/{name}".replace("//", "/")] = body.get("status") or {}
        if now != last:
            last, stable_since = now, time.monotonic()
        elif last.get("gateways/gw-ingress/web", {}).get("listeners") and time.monotonic() - stable_since > settle:
            return last
        await asyncio.sleep(0.5)
    return last


async def clear(api: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(api)
    merge: dict[str, Any] = {"_content_type": "application/merge-patch+json"}
    for plural, namespace, name in WATCHED:
        body = {"status": {"conditions": None, "parents": None, "listeners": None, "addresses": None}}
        if plural == "httproutes":
            body = {"status": {"parents": []}}
        if plural == "backendtlspolicies":
            body = {"status": {"ancestors": []}}
        if not namespace:
            await custom.patch_cluster_custom_object_status(GROUP, "v1", plural, name, body, **merge)
        else:
            await custom.patch_namespaced_custom_object_status(GROUP, "v1", namespace, plural, name, body, **merge)


ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
NODE = "router~10.244.0.80~web-1.gw-ingress~gw-ingress.svc.cluster.local"


async def gateway_routes(xds_address: str) -> dict[str, Any]:
    """`http.80` as the Gateway's proxy is sent it: {virtual host: {domains, routes}}."""
    client = AdsClient(xds_address, NODE, "gw-ingress", istio_version="1.31.0")
    del client.node.metadata.fields["GENERATOR"]
    client.node.metadata.update({"LABELS": {"gateway.networking.k8s.io/gateway-name": "web"}, "CLUSTER_ID": "Kubernetes"})
    try:
        response = await client.subscribe(ROUTE, ["http.80"])
    finally:
        await client.close()
    result: dict[str, Any] = {}
    for resource in response.resources:
        config = route_pb2.RouteConfiguration.FromString(resource.value)
        for host in config.virtual_hosts:
            routes = []
            for route in host.routes:
                action = json_format.MessageToDict(route.route) if route.HasField("route") else {}
                routes.append({"match": json_format.MessageToDict(route.match),
                               "cluster": action.get("cluster") or action.get("weightedClusters"),
                               "timeout": action.get("timeout"), "retries": (action.get("retryPolicy") or {}).get("numRetries"),
                               **({"direct": route.direct_response.status} if route.HasField("direct_response") else {})})
            result[host.name] = {"domains": list(host.domains), "routes": routes}
    return result


def compare_routes(theirs: dict[str, Any], ours: dict[str, Any]) -> None:
    print("== route configuration http.80")
    for host in sorted(theirs.keys() | ours.keys()):
        a, b = theirs.get(host), ours.get(host)
        if a == b:
            print(f"   {host}: {json.dumps(a)}")
            continue
        print(f"!! {host}:\n     istio={json.dumps(a)}\n     ours= {json.dumps(b)}")


def summary(status: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for c in status.get("conditions") or []:
        rows.append((c["type"], (c["status"], c["reason"], c["message"])))
    for listener in status.get("listeners") or []:
        rows.append((f"listener {listener['name']} attachedRoutes", listener.get("attachedRoutes")))
        for c in listener.get("conditions") or []:
            rows.append((f"listener {listener['name']} {c['type']}", (c["status"], c["reason"], c["message"])))
    for parent in status.get("parents") or []:
        ref = parent["parentRef"]
        for c in parent.get("conditions") or []:
            rows.append((f"parent {ref.get('name')}/{ref.get('sectionName', '')} {c['type']}",
                         (c["status"], c["reason"], c["message"])))
    for ancestor in status.get("ancestors") or []:
        ref = ancestor["ancestorRef"]
        for c in ancestor.get("conditions") or []:
            rows.append((f"ancestor {ref.get('kind')}/{ref.get('name')} {ancestor['controllerName']} {c['type']}",
                         (c["status"], c["reason"], c["message"])))
    if status.get("addresses"):
        rows.append(("addresses", [a["type"] for a in status["addresses"]]))
    return rows


def compare(theirs: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]]) -> int:
    differences = 0
    for key in sorted(theirs.keys() | ours.keys()):
        print(f"== {key}")
        a, b = dict(summary(theirs.get(key, {}))), dict(summary(ours.get(key, {})))
        for row in sorted(a.keys() | b.keys()):
            x, y = a.get(row), b.get(row)
            same = (x[:2] == y[:2]) if isinstance(x, tuple) and isinstance(y, tuple) else x == y
            differences += not same
            mark = "  " if same else "!!"
            print(f"{mark} {row}: istio={x} ours={y}" if x != y else f"{mark} {row}: {x}")
    return differences


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_reference_argument(parser)
    args = parser.parse_args()
    args.reference = reference_binary(parser, args)
    workdir = Path(tempfile.mkdtemp(prefix="gwapi-compare-"))
    (workdir / "cluster").mkdir()
    cluster = Cluster(workdir / "cluster")
    reference = ours = None
    try:
        cluster.start()
        async with await api_client(cluster.kubeconfig) as api:
            await setup(api)
            reference, reference_xds, _ = start_reference(args.reference, cluster.kubeconfig, workdir)
            theirs = await statuses(api)
            their_routes = await gateway_routes(reference_xds)
            stop_group(reference, grace=5)
            reference = None
            await clear(api)
            ours = Istiod(workdir, "--kubeconfig", str(cluster.kubeconfig), ready_timeout=60)
            mine = await statuses(api)
            my_routes = await gateway_routes(ours.xds_address)
        differences = compare(theirs, mine)
        compare_routes(their_routes, my_routes)
        return 1 if differences else 0
    finally:
        if reference is not None:
            stop_group(reference, grace=5)
        if ours is not None:
            ours.stop()
        cluster.stop()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
