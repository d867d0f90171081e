"""A waypoint proxy on the data path, every peer real: A (node-1) calls B's Service, which uses the
waypoint; node-1's ztunnel sends the call over HBONE to the waypoint, a real Envoy run by `istiod agent
proxy waypoint` in its own pod (node type `waypoint`, the labels Istio's waypoint pods have), which
terminates HBONE, applies B's L7 routes and sends the request over HBONE to B's pod, through node-2's
ztunnel. A VirtualService and then an HTTPRoute (Service parent) on B take effect on the waypoint.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_envoy_authn import ISSUER, Signer
from tests.peers import Process, wait_until
from tests.pods import requires_root
from tests.test_ambient_traffic import ISTIOD, VIP, Cluster, ambient_cluster, timed

pytestmark = requires_root
WAYPOINT_VIP = "10.96.0.30"
WAYPOINT_IDENTITY = "spiffe://cluster.local/ns/demo/sa/waypoint"
TOKEN = "waypoint-token"
WAYPOINT_LABELS = {"gateway.networking.k8s.io/gateway-name": "waypoint",
                   "gateway.istio.io/managed": "istio.io-mesh-controller", "istio.io/dataplane-mode": "none"}


def waypoint_objects(ip: str) -> dict[str, dict[str, Any]]:
    """The waypoint Gateway, its Service and pod, as istiod deploys them (Istio's labels)."""
    return {
        "waypoint-gateway": {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                             "metadata": {"name": "waypoint", "namespace": "demo",
                                          "labels": {"istio.io/waypoint-for": "service"}},
                             "spec": {"gatewayClassName": "istio-waypoint",
                                      "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]}},
        "waypoint-service": {"apiVersion": "v1", "kind": "Service",
                             "metadata": {"name": "waypoint", "namespace": "demo",
                                          "labels": {"istio.io/waypoint-for": "service",
                                                     "gateway.istio.io/managed": "istio.io-mesh-controller"}},
                             "spec": {"clusterIP": WAYPOINT_VIP,
                                      "selector": {"gateway.networking.k8s.io/gateway-name": "waypoint"},
                                      "ports": [{"name": "mesh", "port": 15008}]}},
        "waypoint-pod": {"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": "waypoint-1", "namespace": "demo", "uid": "uid-waypoint",
                                      "labels": WAYPOINT_LABELS},
                         "spec": {"nodeName": "node-1", "serviceAccountName": "waypoint",
                                  "containers": [{"name": "istio-proxy", "ports": [{"name": "mesh", "containerPort": 15008}]}]},
                         "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}},
    }


SERVICE_B = {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "b", "namespace": "demo", "labels": {"istio.io/use-waypoint": "waypoint"}},
             "spec": {"clusterIP": VIP, "selector": {"app": "b"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}
# A header match on the waypoint: `x-canary: yes` is answered 418 (a fault abort), the rest goes to B.
VIRTUAL_SERVICE = {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
                   "metadata": {"name": "b", "namespace": "demo"},
                   "spec": {"hosts": ["b.demo.svc.cluster.local"], "http": [
                       {"match": [{"headers": {"x-canary": {"exact": "yes"}}}],
                        "fault": {"abort": {"httpStatus": 418, "percentage": {"value": 100}}},
                        "route": [{"destination": {"host": "b.demo.svc.cluster.local"}}]},
                       {"route": [{"destination": {"host": "b.demo.svc.cluster.local"}}]}]}}
# GAMMA: an HTTPRoute on B's Service adds a request header when `x-canary: yes`.
HTTP_ROUTE = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
              "metadata": {"name": "b", "namespace": "demo"},
              "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "b", "port": 80}], "rules": [
                  {"matches": [{"headers": [{"name": "x-canary", "value": "yes"}]}],
                   "filters": [{"type": "RequestHeaderModifier",
                                "requestHeaderModifier": {"add": [{"name": "x-via-waypoint", "value": "canary"}]}}],
                   "backendRefs": [{"name": "b", "port": 80}]},
                  {"backendRefs": [{"name": "b", "port": 80}]}]}}

ALLOW_PUBLIC = {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                "metadata": {"name": "allow-public", "namespace": "demo"},
                "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "waypoint"}],
                         "action": "ALLOW", "rules": [{"to": [{"operation": {"paths": ["/public/*"]}}]}]}}
# By the caller's identity (the certificate A's ztunnel presents for it): A is refused one path, a
# rule naming another identity refuses A nothing.
DENY_BY_CALLER = {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                  "metadata": {"name": "deny-by-caller", "namespace": "demo"},
                  "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "waypoint"}],
                           "action": "DENY", "rules": [
                               {"from": [{"source": {"principals": ["cluster.local/ns/demo/sa/sa-a"]}}],
                                "to": [{"operation": {"paths": ["/public/not-for-a"]}}]},
                               {"from": [{"source": {"namespaces": ["elsewhere"]}}],
                                "to": [{"operation": {"paths": ["/public/page"]}}]}]}}
DENY_SECRET = {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
               "metadata": {"name": "deny-secret", "namespace": "demo"},
               "spec": {"targetRef": {"kind": "Service", "group": "", "name": "b"},
                        "action": "DENY", "rules": [{"to": [{"operation": {"paths": ["/public/secret"]}}]}]}}


class Waypoint:
    """`istiod agent proxy waypoint` (and its Envoy) in the waypoint pod's namespace on node-1."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        one = cluster.one
        self.pod = one.add_pod("waypoint", 3)
        self.ip = one.node.pod_ip(3)
        for name, body in waypoint_objects(self.ip).items():
            one.write(name, body)
        (workdir / "token").write_text(TOKEN)
        self.workdir = workdir
        self.agent = Process(self.pod.exec_args(
            "env", f"ISTIO_METAJSON_LABELS={json.dumps(WAYPOINT_LABELS)}",
            sys.executable, "-m", "istiod", "agent", "--ca-addr", ISTIOD, "--ca-root-cert", str(cluster.state / "root-cert.pem"),
            "--token-file", str(workdir / "token"), "--output-dir", str(workdir / "certs"),
            "--pod-name", "waypoint-1", "--pod-namespace", "demo", "--instance-ip", self.ip,
            "--service-account", "waypoint",
            "proxy", "waypoint", "--workdir", str(workdir), "--proxy-admin-addr", "unix:admin.sock",
            "--status-addr", "127.0.0.1:15020", "--readiness-addr", "127.0.0.1:15021",
            "--envoy-prometheus-addr", "127.0.0.1:15090", "--termination-drain-duration", "1s"), name="waypoint agent")

    def ready(self) -> bool:
        return self.pod.run("curl", "-sf", "--max-time", "2", "http://127.0.0.1:15021/healthz/ready").returncode == 0

    def admin(self, path: str) -> str:
        return self.pod.run("curl", "-s", "--max-time", "5", "--unix-socket", str(self.workdir / "admin.sock"),
                            f"http://envoy{path}").stdout

    def stat(self, name: str) -> int:
        lines = [l for l in self.admin(f"/stats?filter={name}").splitlines() if l.startswith(name + ":")]
        return int(lines[0].split(":")[1]) if lines else 0


def call(cluster: Cluster, *headers: str, path: str = "/") -> tuple[int, dict[str, Any] | None]:
    """A's call to B's Service by name: its status and B's reply (what B saw)."""
    args = [a for h in headers for a in ("-H", h)]
    done = cluster.one.pods["a"].run("curl", "-s", "--max-time", "5", "-w", "\n%{http_code}", *args, f"http://b:80{path}")
    body, _, code = done.stdout.rpartition("\n")
    try:
        reply = json.loads(body) if body else None
    except ValueError:
        reply = None
    return int(code or 0), reply


@pytest.fixture
def waypoint(tmp_path: Path) -> Iterator[tuple[Cluster, Waypoint]]:
    with ambient_cluster(tmp_path, {TOKEN: "demo/waypoint"}) as cluster:
        workdir = Path(tempfile.mkdtemp(prefix="waypoint-", dir="/tmp"))  # short: Unix socket paths
        made = Waypoint(cluster, workdir)
        try:
            try:
                wait_until(made.ready, 30, "the waypoint's Envoy ready")
            except AssertionError:
                raise AssertionError(f"agent:\n{made.agent.log()[-6000:]}\nistiod:\n{cluster.istiod.log()[-3000:]}") from None
            yield cluster, made
        finally:
            made.agent.stop()
            shutil.rmtree(workdir, ignore_errors=True)


def test_a_call_to_a_service_with_a_waypoint_crosses_it_and_its_l7_routes(waypoint: tuple[Cluster, Waypoint]) -> None:
    cluster, proxy = waypoint
    served = "cluster.inbound-vip|80|http|b.demo.svc.cluster.local.upstream_rq_completed"
    assert call(cluster)[0] == 200 and proxy.stat(served) == 0  # B does not use the waypoint yet
    # Envoy took all three listeners (main_internal without a chain: no service uses the waypoint).
    assert set(proxy.admin("/listeners").split()) >= {"connect_terminate::0.0.0.0:15008", "main_internal::envoy://main_internal/",
                                                      "connect_originate::envoy://connect_originate/"}, proxy.admin("/listeners")

    cluster.one.write("service-b", SERVICE_B)  # now it does: ztunnel sends its traffic to the waypoint
    try:
        timed(lambda: call(cluster)[0] == 200 and proxy.stat(served) >= 1, "A's call answered through the waypoint", 15)
    except AssertionError:
        raise AssertionError(f"waypoint:\n{proxy.agent.log()[-4000:]}\nclusters:\n{proxy.admin('/clusters')[-3000:]}\n"
                             f"ztunnel-1:\n{cluster.ztunnels['node-1'].log()[-3000:]}") from None
    status, reply = call(cluster)
    assert status == 200 and reply is not None and reply["host"] == "b"

    # Into B over HBONE from the waypoint: node-2's ztunnel names the waypoint's identity.
    b = cluster.two.node.pod_ip(2)
    wait_until(lambda: [l for l in cluster.ztunnels["node-2"].output if 'direction="inbound"' in l
                        and f'src.identity="{WAYPOINT_IDENTITY}"' in l and f"dst.hbone_addr={b}:8080" in l],
               5, "node-2's ztunnel logging the waypoint's call into B")
    # and into the waypoint from A's ztunnel, over HBONE to its port 15008.
    wait_until(lambda: [l for l in cluster.ztunnels["node-1"].output if 'direction="outbound"' in l
                        and f"dst.hbone_addr={VIP}:80" in l and f"{proxy.ip}:15008" in l],
               5, "node-1's ztunnel logging A's call sent to the waypoint")

    # A VirtualService on B: its header match is applied by the waypoint.
    cluster.one.write("vs-b", VIRTUAL_SERVICE)
    timed(lambda: call(cluster, "x-canary: yes")[0] == 418, "the VirtualService's abort on the waypoint", 10)
    assert call(cluster)[0] == 200

    # An HTTPRoute with B's Service as its parent instead.
    (cluster.one.config / "vs-b.yaml").unlink()
    cluster.one.write("route-b", HTTP_ROUTE)

    def canary() -> bool:
        status, reply = call(cluster, "x-canary: yes")
        return status == 200 and reply is not None and reply["headers"].get("x-via-waypoint") == "canary"

    timed(canary, "the HTTPRoute's header on the waypoint", 10)
    plain = call(cluster)[1]
    assert plain is not None and "x-via-waypoint" not in plain["headers"]

    # L7 authorization on the waypoint: an ALLOW attached to the waypoint's Gateway lets /public/* in
    # (the rest is 403), a DENY attached to B's Service refuses /public/secret.
    cluster.one.write("allow-public", ALLOW_PUBLIC)
    timed(lambda: call(cluster, path="/private")[0] == 403, "the waypoint's ALLOW policy refusing /private", 10)
    assert call(cluster, path="/public/page")[0] == 200
    cluster.one.write("deny-secret", DENY_SECRET)
    timed(lambda: call(cluster, path="/public/secret")[0] == 403, "the Service's DENY policy on the waypoint", 10)
    assert call(cluster, path="/public/page")[0] == 200
    cluster.one.write("deny-by-caller", DENY_BY_CALLER)
    timed(lambda: call(cluster, path="/public/not-for-a")[0] == 403, "the DENY of A's identity on the waypoint", 10)
    assert call(cluster, path="/public/page")[0] == 200  # A is not in namespace `elsewhere`

    # A RequestAuthentication attached to the waypoint checks tokens there, and an ALLOW attached to
    # it lets /jwt/* in for the token's principal only: no token 403, a bad one 401, a good one 200.
    signer = Signer()
    cluster.one.write("jwt", {
        "apiVersion": "security.istio.io/v1", "kind": "RequestAuthentication", "metadata": {"name": "jwt", "namespace": "demo"},
        "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "waypoint"}],
                 "jwtRules": [{"issuer": ISSUER, "jwks": signer.jwks()}]}})
    cluster.one.write("allow-jwt", {
        "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy", "metadata": {"name": "allow-jwt", "namespace": "demo"},
        "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "waypoint"}],
                 "rules": [{"from": [{"source": {"requestPrincipals": [f"{ISSUER}/alice"]}}],
                            "to": [{"operation": {"paths": ["/jwt/*"]}}]}]}})
    bearer = f"authorization: Bearer {signer.token()}"
    timed(lambda: call(cluster, bearer, path="/jwt/page")[0] == 200, "a token's principal allowed on the waypoint", 10)
    assert call(cluster, path="/jwt/page")[0] == 403
    assert call(cluster, f"authorization: Bearer {Signer().token()}", path="/jwt/page")[0] == 401
    assert call(cluster, bearer, path="/private")[0] == 403  # the token opens only what the rule names
    # Neither reached ztunnel as an L4 policy (B's ztunnel would refuse everything from the waypoint).
    assert not [l for l in cluster.ztunnels["node-2"].output if "policy rejection" in l]
    assert "ads NACK" not in cluster.istiod.text()  # the waypoint's Envoy took every push
    assert "level=error" not in cluster.istiod.text()  # every push built (the ztunnels' too)
