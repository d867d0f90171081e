"""The Gateway API through a real Envoy 1.40 as the Gateway's proxy (its node labelled
gateway.networking.k8s.io/gateway-name, as the Gateway's deployment pods are), on istiod's TLS
xDS port: HTTP by host and path, HTTPS with the certificate of a Secret, a weighted split, header
modifiers seen by the backend, a redirect seen by curl; bad input (a missing backend, an RE2
pattern Envoy would refuse, a conflicting listener, a missing Secret) is answered with 500s or
left out, never NACKed. Config: tests/data/gateway-api-mesh.yaml."""

from __future__ import annotations

import base64
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec
from concurrent import futures
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from istiod.ca.pki import cert_pem, key_pem
from tests.conftest import render
from tests.pki import ca_cert, leaf_cert
from tests.peers import ROOT, Istiod, Process, free_port, wait_until
from tests.test_envoy_gateway import BIND, NAMESPACE, SERVICE_ACCOUNT, TOKEN, Gateway, agent_gateway, gateway_envoy
from tests.test_envoy_authn import ISSUER, Signer
from tests.test_gateway_gen import server_credential, tls_secret

V1_IP, V2_IP, GRPC_IP = "127.0.0.41", "127.0.0.42", "127.0.0.43"
GATEWAY_LABELS = {"gateway.networking.k8s.io/gateway-name": "web", "service.istio.io/canonical-name": "web-istio"}


@pytest.fixture
def mesh(mesh_dir: Path, start_istiod: Callable[..., Istiod], processes: list[Process],
         monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Gateway:
    app_port, http_port, https_port, other_port = free_port(V1_IP), free_port(BIND), free_port(BIND), free_port(BIND)
    grpc_port = free_port(GRPC_IP)
    (mesh_dir / "mesh.yaml").write_text(render("gateway-api-mesh.yaml", app_port=app_port, http_port=http_port,
                                               https_port=https_port, other_port=other_port, v1_ip=V1_IP, v2_ip=V2_IP,
                                               grpc_ip=GRPC_IP, grpc_port=grpc_port))
    health = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), health)
    health.add_insecure_port(f"{GRPC_IP}:{grpc_port}")
    health.start()
    request.addfinalizer(lambda: health.stop(None))
    ca, cert, key = server_credential("secure.example.com")
    (mesh_dir / "secret.yaml").write_text(yaml.safe_dump(tls_secret("web-cert", NAMESPACE, cert, key)))
    (mesh_dir.parent / "ca.pem").write_bytes(ca)
    (mesh_dir.parent / "tokens.json").write_text(json.dumps({TOKEN: f"{NAMESPACE}/{SERVICE_ACCOUNT}"}))
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh_dir.parent / "tokens.json"))
    for name, ip in (("v1", V1_IP), ("v2", V2_IP)):
        processes.append(Process([sys.executable, str(ROOT / "tests" / "http_echo.py"), ip, str(app_port), name],
                                 name=f"echo-{name}"))
    # The gateway's node carries the Gateway's pod labels, not Istio's ingress gateway's.
    import tests.test_envoy_gateway as envoy_gateway
    original = envoy_gateway.bootstrap

    def labelled(*args: object, **kwargs: object) -> object:
        args_list = list(args)
        args_list[4] = {**args_list[4], "LABELS": GATEWAY_LABELS}  # type: ignore[dict-item]
        return original(*args_list, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(envoy_gateway, "bootstrap", labelled)
    return Gateway(mesh_dir, istiod, http_port, https_port)


@pytest.fixture
def gateway(mesh: Gateway) -> Iterator[Gateway]:
    with gateway_envoy(mesh) as started:
        yield started


def _get(gateway: Gateway, host: str, path: str, *options: str) -> tuple[int, str]:
    port = gateway.http_port
    return gateway.curl(f"http://{host}:{port}{path}", "--resolve", f"{host}:{port}:{BIND}", *options)


def test_http_routes_by_host_and_path(gateway: Gateway) -> None:
    status, body = _get(gateway, "web.example.com", "/anything")
    print("HTTP through the Gateway API gateway:", status, body)
    assert status == 200 and json.loads(body)["path"] == "/anything"
    assert _get(gateway, "elsewhere.example.com", "/")[0] == 404  # no route names this host
    # A rewrite of the matched prefix.
    status, body = _get(gateway, "web.example.com", "/api/items")
    assert status == 200 and json.loads(body)["path"] == "/v2/items", body
    # Regex path and query parameter matches both reach the backend.
    assert _get(gateway, "web.example.com", "/re/abc")[0] == 200
    # A path prefix matches whole segments: /apix is not under /api (the catch-all rule takes it).
    status, body = _get(gateway, "web.example.com", "/apix")
    assert status == 200 and json.loads(body)["path"] == "/apix"


def test_mirror_and_destination_rule_apply(gateway: Gateway) -> None:
    assert gateway.envoy is not None
    mirror = "cluster.outbound|8080||echo-v2.shop.svc.cluster.local.upstream_rq_total"

    def mirrored() -> int:
        line = next((x for x in gateway.envoy.get(f"/stats?filter={mirror}")[1].splitlines()  # type: ignore[union-attr]
                     if x.startswith(mirror + ":")), f"{mirror}: 0")
        return int(line.rpartition(" ")[2])

    before = mirrored()
    for _ in range(5):
        status, body = _get(gateway, "web.example.com", "/mirrored")
        assert status == 200
    wait_until(lambda: mirrored() >= before + 5, 5, "5 requests mirrored to echo-v2")
    clusters = json.loads(gateway.envoy.get("/config_dump?resource=dynamic_active_clusters")[1])["configs"]
    echo = next(c["cluster"] for c in clusters if c["cluster"]["name"] == "outbound|8080||echo.shop.svc.cluster.local")
    print("echo's cluster (DestinationRule applied):", echo.get("lb_policy"), echo.get("circuit_breakers"))
    assert echo["lb_policy"] == "RANDOM"
    assert echo["circuit_breakers"]["thresholds"][0]["max_connections"] == 77


def test_header_modifiers_reach_the_backend_and_the_client(gateway: Gateway) -> None:
    status, body = _get(gateway, "web.example.com", "/headers", "-H", "x-variant: blue", "-H", "x-drop: me", "-D", "-")
    print("headers route:", status, body[-400:])
    headers_text, _, payload = body.partition("\n\n")
    seen = json.loads(payload)["headers"]
    assert seen["x-from-gateway"] == "yes" and "x-drop" not in seen
    assert "x-served-by: gateway-api" in headers_text.lower()


def test_a_backends_own_header_filter_reaches_it(gateway: Gateway) -> None:
    status, body = _get(gateway, "web.example.com", "/per-backend")
    print("per-backend filter:", status, body[-300:])
    assert status == 200 and json.loads(body)["headers"]["x-backend"] == "echo"


def test_a_cors_preflight_is_answered_by_the_gateway(gateway: Gateway) -> None:
    preflight = ("-X", "OPTIONS", "-H", "Origin: https://app.example", "-H", "Access-Control-Request-Method: PUT",
                 "-D", "-")
    status, body = _get(gateway, "web.example.com", "/cors", *preflight)
    headers = body.lower()
    print("CORS preflight:", status, [line for line in headers.splitlines() if line.startswith("access-control")])
    assert status == 200 and "access-control-allow-origin: https://app.example" in headers
    assert "access-control-allow-methods: get,put" in headers and "access-control-max-age: 60" in headers
    assert '"path"' not in body  # answered by Envoy, not the backend
    # An origin the filter does not allow gets no CORS headers (IGNORE: the preflight is still answered).
    _, other = _get(gateway, "web.example.com", "/cors", "-X", "OPTIONS", "-H", "Origin: https://evil.example",
                    "-H", "Access-Control-Request-Method: PUT", "-D", "-")
    assert "access-control-allow-origin" not in other.lower()
    # The rule's retry: Envoy's retry policy on that route.
    configs = json.loads(gateway.envoy.get("/config_dump?resource=dynamic_route_configs")[1])["configs"]  # type: ignore[union-attr]
    routes = [r for c in configs for h in c["route_config"].get("virtual_hosts", []) for r in h.get("routes", [])]
    retry = next(r["route"]["retry_policy"] for r in routes if r["match"].get("path_separated_prefix") == "/cors")
    print("the /cors route's retry policy:", retry)
    assert retry["num_retries"] == 3 and retry["retriable_status_codes"] == [503] and "connect-failure" in retry["retry_on"]


def test_redirect_is_seen_by_curl(gateway: Gateway) -> None:
    status, body = _get(gateway, "web.example.com", "/old/page", "-D", "-")
    print("redirect:", status, body.splitlines()[:3])
    assert status == 301 and "location: http://web.example.com:" in body.lower() and "/new" in body.lower()
    # ReplacePrefixMatch: the matched prefix swapped, the rest of the path kept.
    status, body = _get(gateway, "web.example.com", "/moved/page", "-D", "-")
    location = next(line for line in body.lower().splitlines() if line.startswith("location:"))
    print("prefix redirect:", status, location)
    assert status == 302 and location.endswith("/here/page")


def test_https_listener_serves_the_secret(gateway: Gateway, mesh_dir: Path) -> None:
    status, body = gateway.https("/secure", mesh_dir.parent / "ca.pem")
    print("HTTPS through the Gateway API gateway:", status, body)
    assert status == 200 and json.loads(body)["path"] == "/secure"


def test_weighted_split_within_five_sigma(gateway: Gateway) -> None:
    n, p = 200, 0.8  # echo-v1 weight 80, echo-v2 weight 20
    names = Counter(json.loads(_get(gateway, "web.example.com", "/split")[1])["name"] for _ in range(n))
    sigma = math.sqrt(n * p * (1 - p))
    print(f"split over {n} requests: {dict(names)} (expected v1 {n * p:.0f} +- {5 * sigma:.1f})")
    assert set(names) <= {"v1", "v2"}
    assert abs(names["v1"] - n * p) <= 5 * sigma


def test_bad_input_is_answered_not_nacked(gateway: Gateway) -> None:
    # A missing backend and a regex RE2 refuses: 500 for their rules, the rest of the route works.
    assert _get(gateway, "broken.example.com", "/missing")[0] == 500
    assert _get(gateway, "broken.example.com", "/")[0] == 200
    assert gateway.envoy is not None
    dump = gateway.envoy.get("/config_dump")[1]
    assert "kubernetes-gateway://istio-ingress/missing-cert" not in dump
    stats = gateway.envoy.get("/stats?filter=update_rejected")[1]
    print("rejections:", stats)
    assert all(line.endswith(": 0") for line in stats.splitlines() if line), stats


def test_grpc_route_sends_a_method_to_its_backend(gateway: Gateway) -> None:
    options = [("grpc.default_authority", "rpc.example.com"), ("grpc.so_reuseport", 0)]
    with grpc.insecure_channel(f"{BIND}:{gateway.http_port}", options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        print("grpc.health.v1.Health/Check through the GRPCRoute:", reply)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # Another method of the service matches no rule: Envoy's 404, which gRPC reads as UNIMPLEMENTED.
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Watch(health_pb2.HealthCheckRequest(), timeout=5))
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_changes_reach_the_envoy_and_a_removed_grant_is_not_followed(gateway: Gateway, mesh_dir: Path) -> None:
    ca = mesh_dir.parent / "ca.pem"
    assert gateway.https("/", ca)[0] == 200  # the route in istio-ingress to Service echo in shop
    documents = list(yaml.safe_load_all((mesh_dir / "mesh.yaml").read_text()))
    kept = [d for d in documents if d["kind"] != "ReferenceGrant"]
    kept.append({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                 "metadata": {"name": "late", "namespace": "shop"},
                 "spec": {"parentRefs": [{"name": "web", "namespace": "istio-ingress", "sectionName": "http"}],
                          "hostnames": ["late.example.com"], "rules": [{"backendRefs": [{"name": "echo", "port": 8080}]}]}})
    (mesh_dir / "mesh.yaml").write_text(yaml.safe_dump_all(kept))
    wait_until(lambda: gateway.https("/", ca)[0] == 500, 10, "the HTTPS route's backend refused without the grant")
    wait_until(lambda: _get(gateway, "late.example.com", "/")[0] == 200, 10, "the new route served")
    print("without the ReferenceGrant:", gateway.https("/", ca))


def _client_ca(workdir: Path) -> bytes:
    """A client CA and a client certificate of it (client.pem, client-key.pem); the CA as PEM."""
    client_ca_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    client_ca = ca_cert("gateway api clients", client_ca_key)
    (workdir / "client.pem").write_text(cert_pem(leaf_cert(client_key, (client_ca, client_ca_key), dns=("client",))))
    (workdir / "client-key.pem").write_bytes(key_pem(client_key))
    return cert_pem(client_ca).encode()


def _mutual_served(gateway: Gateway, workdir: Path) -> None:
    """The HTTPS listener refuses a client without a certificate and serves one with a certificate of the CA."""
    host, port = "secure.example.com", gateway.https_port
    args = (f"https://{host}:{port}/mtls", "--resolve", f"{host}:{port}:{BIND}", "--cacert", str(workdir / "ca.pem"))
    status, body = wait_until(lambda: (r := gateway.curl(*args))[0] == 0 and r, 15, "a client without a certificate refused")
    print("MUTUAL listener, no client certificate:", status, body.strip()[:120])
    status, body = gateway.curl(*args, "--cert", str(workdir / "client.pem"), "--key", str(workdir / "client-key.pem"))
    print("MUTUAL listener, client certificate:", status, body[:80])
    assert status == 200 and json.loads(body)["path"] == "/mtls"


@pytest.mark.parametrize("how", ["tls-terminate-mode", "frontend-validation"])
def test_a_mutual_listener_refuses_a_client_without_a_certificate(gateway: Gateway, mesh_dir: Path, how: str) -> None:
    """The HTTPS listener made MUTUAL as istiod reads it: by the `gateway.istio.io/tls-terminate-mode:
    MUTUAL` option (clients verified by the certificateRef's `-cacert` Secret), or by the Gateway's
    spec.tls.frontend validation (by the CA Secret it names)."""
    workdir = mesh_dir.parent
    assert gateway.https("/", workdir / "ca.pem")[0] == 200
    ca = base64.b64encode(_client_ca(workdir)).decode()
    documents = list(yaml.safe_load_all((mesh_dir / "mesh.yaml").read_text()))
    gateway_api = next(d for d in documents if d["kind"] == "Gateway")
    if how == "tls-terminate-mode":
        https = next(listener for listener in gateway_api["spec"]["listeners"] if listener["name"] == "https")
        https["tls"]["options"] = {"gateway.istio.io/tls-terminate-mode": "MUTUAL"}
        secret = "web-cert-cacert"
    else:
        gateway_api["spec"]["tls"] = {"frontend": {"default": {"validation": {
            "caCertificateRefs": [{"group": "", "kind": "Secret", "name": "client-ca"}]}}}}
        secret = "client-ca"
    documents.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": NAMESPACE},
                      "data": {"ca.crt": ca}})
    (mesh_dir / "mesh.yaml").write_text(yaml.safe_dump_all(documents))
    _mutual_served(gateway, workdir)


def test_allow_insecure_fallback_takes_any_client_and_tells_the_backend(gateway: Gateway, mesh_dir: Path) -> None:
    """spec.tls.frontend validation with AllowInsecureFallback (istiod: OPTIONAL_MUTUAL with
    insecureSkipVerify): a client without a certificate and one with a certificate of a CA nobody
    named are both served; the backend sees the latter's certificate in x-forwarded-client-cert."""
    workdir = mesh_dir.parent
    ca = base64.b64encode(_client_ca(workdir)).decode()
    _, stranger, stranger_key = server_credential("stranger")
    (workdir / "stranger.pem").write_bytes(stranger)
    (workdir / "stranger-key.pem").write_bytes(stranger_key)
    documents = list(yaml.safe_load_all((mesh_dir / "mesh.yaml").read_text()))
    next(d for d in documents if d["kind"] == "Gateway")["spec"]["tls"] = {"frontend": {"default": {"validation": {
        "caCertificateRefs": [{"group": "", "kind": "Secret", "name": "client-ca"}], "mode": "AllowInsecureFallback"}}}}
    documents.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "client-ca", "namespace": NAMESPACE},
                      "data": {"ca.crt": ca}})
    (mesh_dir / "mesh.yaml").write_text(yaml.safe_dump_all(documents))
    host, port = "secure.example.com", gateway.https_port
    args = (f"https://{host}:{port}/fallback", "--resolve", f"{host}:{port}:{BIND}", "--cacert", str(workdir / "ca.pem"))
    stranger_args = ("--cert", str(workdir / "stranger.pem"), "--key", str(workdir / "stranger-key.pem"))
    status, body = wait_until(lambda: (r := gateway.curl(*args, *stranger_args))[0] == 200
                              and json.loads(r[1])["xfcc"] and r, 15, "a client of an unknown CA served, its certificate told")
    print("AllowInsecureFallback, unknown CA:", status, json.loads(body)["xfcc"][:100])
    assert "DNS=stranger" in json.loads(body)["xfcc"]
    status, body = gateway.curl(*args)
    print("AllowInsecureFallback, no certificate:", status, body[:80])
    assert status == 200 and json.loads(body)["xfcc"] is None


def test_the_agent_runs_the_gateway(mesh: Gateway, processes: list[Process]) -> None:
    """`istiod agent proxy router` with the Gateway's pod label: its Envoy is the Gateway's proxy,
    sent the certificateRef's Secret over the agent's xDS proxy on istiod's TLS port."""
    with agent_gateway(mesh, processes, GATEWAY_LABELS):
        status, body = mesh.https("/via-agent", mesh.mesh_dir.parent / "ca.pem")
        print("HTTPS through the agent's Gateway API gateway:", status, body)
        assert status == 200 and json.loads(body)["path"] == "/via-agent"
        assert _get(mesh, "web.example.com", "/via-agent")[0] == 200


def test_a_tls_route_passes_tls_through_and_a_tcp_route_proxies(gateway: Gateway, processes: list[Process]) -> None:
    """A second Gateway on the same proxy (its Service `l4-istio` selects the same pods): a TLS
    listener in Passthrough mode with a TLSRoute by SNI to a backend whose own certificate the client
    sees, and a TCP listener with a TCPRoute."""
    workdir, backend_ip, host = gateway.mesh_dir.parent, "127.0.0.44", "tls.example.com"
    ca, cert, key = server_credential(host)
    for name, data in (("backend-ca.pem", ca), ("backend.pem", cert), ("backend-key.pem", key)):
        (workdir / name).write_bytes(data)
    backend_port, tls_port, tcp_port = free_port(backend_ip), free_port(BIND), free_port(BIND)
    processes.append(Process([sys.executable, str(ROOT / "tests" / "tls_echo.py"), backend_ip, str(backend_port),
                              str(workdir / "backend.pem"), str(workdir / "backend-key.pem"), "tls-app"], name="tls-app"))
    group = "gateway.networking.k8s.io"
    parent = {"name": "l4", "namespace": NAMESPACE}
    objects = [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "l4-istio", "namespace": NAMESPACE},
         "spec": {"clusterIP": "10.96.0.81", "selector": {"gateway.networking.k8s.io/gateway-name": "web"},
                  "ports": [{"name": "tls", "port": tls_port}, {"name": "tcp", "port": tcp_port}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "tls-app", "namespace": "shop"},
         "spec": {"clusterIP": "10.96.0.30", "selector": {"app": "tls-app"},
                  "ports": [{"name": "tls", "port": 443, "targetPort": backend_port}]}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tls-app-1", "namespace": "shop", "labels": {"app": "tls-app"}},
         "spec": {"containers": [{"name": "app", "ports": [{"containerPort": backend_port}]}]},
         "status": {"phase": "Running", "podIP": backend_ip, "conditions": [{"type": "Ready", "status": "True"}]}},
        {"apiVersion": f"{group}/v1", "kind": "Gateway", "metadata": {"name": "l4", "namespace": NAMESPACE},
         "spec": {"gatewayClassName": "istio", "listeners": [
             {"name": "tls", "port": tls_port, "protocol": "TLS", "tls": {"mode": "Passthrough"},
              "allowedRoutes": {"namespaces": {"from": "All"}}},
             {"name": "tcp", "port": tcp_port, "protocol": "TCP", "allowedRoutes": {"namespaces": {"from": "All"}}}]}},
        {"apiVersion": f"{group}/v1", "kind": "TLSRoute", "metadata": {"name": "sni", "namespace": "shop"},
         "spec": {"parentRefs": [parent], "hostnames": [host],
                  "rules": [{"backendRefs": [{"name": "tls-app", "port": 443}]}]}},
        {"apiVersion": f"{group}/v1", "kind": "TCPRoute", "metadata": {"name": "raw", "namespace": "shop"},
         "spec": {"parentRefs": [parent], "rules": [{"backendRefs": [{"name": "echo", "port": 8080}]}]}},
    ]
    (gateway.mesh_dir / "l4.yaml").write_text(yaml.safe_dump_all(objects))
    url, resolve = f"https://{host}:{tls_port}/sni", ("--resolve", f"{host}:{tls_port}:{BIND}")
    status, body = wait_until(lambda: (r := gateway.curl(url, *resolve, "--cacert", str(workdir / "backend-ca.pem")))[0] == 200
                              and r, 15, "the TLSRoute's backend through the passthrough listener")
    print("TLSRoute passthrough:", status, body)
    assert json.loads(body) == {"name": "tls-app", "path": "/sni"}
    assert gateway.curl(url, *resolve, "--cacert", str(workdir / "ca.pem"))[0] == 0  # not the gateway's certificate
    status, body = wait_until(lambda: (r := gateway.curl(f"http://{BIND}:{tcp_port}/raw"))[0] == 200 and r, 15,
                              "the TCPRoute's backend")
    print("TCPRoute:", status, body)
    assert json.loads(body)["path"] == "/raw"


def test_policies_attached_to_the_gateway_apply_there(gateway: Gateway, mesh_dir: Path) -> None:
    """AuthorizationPolicy and RequestAuthentication `targetRefs` naming the Gateway apply to the gateway
    it deployed (its pods' gateway-name label), as istiod's policy attachment; one naming another
    Gateway does not."""
    signer = Signer()

    def attached(kind: str, name: str, target: str, spec: dict[str, object]) -> dict[str, object]:
        return {"apiVersion": "security.istio.io/v1", "kind": kind, "metadata": {"name": name, "namespace": "istio-ingress"},
                "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": target}], **spec}}

    (mesh_dir / "policies.yaml").write_text(yaml.safe_dump_all([
        attached("RequestAuthentication", "jwt", "web", {"jwtRules": [{"issuer": ISSUER, "jwks": signer.jwks()}]}),
        attached("AuthorizationPolicy", "deny", "web", {"action": "DENY", "rules": [{"to": [{"operation": {"paths": ["/denied"]}}]}]}),
        attached("AuthorizationPolicy", "elsewhere", "other", {"action": "DENY", "rules": [{"to": [{"operation": {"paths": ["/kept"]}}]}]}),
    ]))
    wait_until(lambda: _get(gateway, "web.example.com", "/denied")[0] == 403, 10, "the attached DENY")
    assert _get(gateway, "web.example.com", "/kept")[0] == 200  # attached to another Gateway
    assert _get(gateway, "web.example.com", "/anything", "-H", f"authorization: Bearer {signer.token()}")[0] == 200
    status, body = _get(gateway, "web.example.com", "/anything", "-H", f"authorization: Bearer {Signer().token()}")
    print("a token the attached RequestAuthentication does not verify:", status, body)
    assert status == 401


@pytest.mark.parametrize("target", ["Service", "ServiceEntry"])
def test_a_backend_tls_policy_makes_the_gateway_originate_tls(gateway: Gateway, processes: list[Process],
                                                              target: str) -> None:
    """BackendTLSPolicy: the route's backend speaks only TLS; with the policy the gateway calls it over TLS,
    verifying its certificate with the CA of the ConfigMap the policy names (served over SDS); a CA
    that did not sign it fails the call (503); without the policy, plaintext fails too. The backend is a
    Service, or the host of a ServiceEntry the route names as a `networking.istio.io/Hostname` backend
    and the policy targets."""
    workdir, backend_ip, host = gateway.mesh_dir.parent, "127.0.0.45", "backend.example.com"
    ca, cert, key = server_credential("backend.internal")
    other_ca, _, _ = server_credential("backend.internal")
    (workdir / "tls-backend.pem").write_bytes(cert)
    (workdir / "tls-backend-key.pem").write_bytes(key)
    backend_port = free_port(backend_ip)
    processes.append(Process([sys.executable, str(ROOT / "tests" / "tls_echo.py"), backend_ip, str(backend_port),
                              str(workdir / "tls-backend.pem"), str(workdir / "tls-backend-key.pem"), "tls-backend"],
                             name="tls-backend"))
    group = "gateway.networking.k8s.io"

    if target == "Service":
        backend: list[dict[str, object]] = [
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "tls-backend", "namespace": "shop"},
             "spec": {"clusterIP": "10.96.0.31", "selector": {"app": "tls-backend"},
                      "ports": [{"name": "https", "port": 443, "targetPort": backend_port}]}},
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tls-backend-1", "namespace": "shop",
                                                            "labels": {"app": "tls-backend"}},
             "spec": {"containers": [{"name": "app", "ports": [{"containerPort": backend_port}]}]},
             "status": {"phase": "Running", "podIP": backend_ip, "conditions": [{"type": "Ready", "status": "True"}]}}]
        backend_ref: dict[str, object] = {"name": "tls-backend", "port": 443}
        target_ref = {"group": "", "kind": "Service", "name": "tls-backend"}
    else:
        backend = [{"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
                    "metadata": {"name": "tls-backend", "namespace": "shop"},
                    "spec": {"hosts": ["tls-backend.example.org"], "location": "MESH_EXTERNAL", "resolution": "STATIC",
                             "ports": [{"number": 443, "name": "https", "protocol": "HTTPS"}],
                             "endpoints": [{"address": backend_ip, "ports": {"https": backend_port}}]}}]
        backend_ref = {"group": "networking.istio.io", "kind": "Hostname", "name": "tls-backend.example.org", "port": 443}
        target_ref = {"group": "networking.istio.io", "kind": "ServiceEntry", "name": "tls-backend"}

    def objects(ca_pem: bytes | None) -> list[dict[str, object]]:
        made: list[dict[str, object]] = [
            *backend,
            {"apiVersion": f"{group}/v1", "kind": "HTTPRoute", "metadata": {"name": "to-tls", "namespace": "shop"},
             "spec": {"parentRefs": [{"name": "web", "namespace": NAMESPACE, "sectionName": "http"}], "hostnames": [host],
                      "rules": [{"backendRefs": [backend_ref]}]}},
        ]
        if ca_pem is not None:
            made += [
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "backend-ca", "namespace": "shop"},
                 "data": {"ca.crt": ca_pem.decode()}},
                {"apiVersion": f"{group}/v1", "kind": "BackendTLSPolicy", "metadata": {"name": "tls-backend", "namespace": "shop"},
                 "spec": {"targetRefs": [target_ref],
                          "validation": {"hostname": "backend.internal",
                                         "caCertificateRefs": [{"group": "", "kind": "ConfigMap", "name": "backend-ca"}]}}},
            ]
        return made

    (gateway.mesh_dir / "backend-tls.yaml").write_text(yaml.safe_dump_all(objects(None)))
    status, _ = wait_until(lambda: (r := _get(gateway, host, "/plain"))[0] in (502, 503) and r, 15,
                           "plaintext to a TLS-only backend failing")
    # (A changed CA applies to new upstream connections: the one that fails first, then the right one.)
    (gateway.mesh_dir / "backend-tls.yaml").write_text(yaml.safe_dump_all(objects(other_ca)))
    # (Plaintext ended in the backend's "connection termination"; a refused handshake is a connection failure.)
    status, body = wait_until(lambda: (r := _get(gateway, host, "/other-ca"))[0] == 503
                              and "remote connection failure" in r[1] and r,
                              20, "a CA that did not sign the backend's certificate refused")
    print(f"BackendTLSPolicy on a {target}, another CA:", status, body[:160])
    (gateway.mesh_dir / "backend-tls.yaml").write_text(yaml.safe_dump_all(objects(ca)))
    status, body = wait_until(lambda: (r := _get(gateway, host, "/tls"))[0] == 200 and r, 20,
                              "the backend over the policy's TLS")
    print(f"BackendTLSPolicy on a {target}, the ConfigMap's CA:", status, body)
    assert json.loads(body) == {"name": "tls-backend", "path": "/tls"}


def test_a_backend_traffic_policy_gives_the_cluster_a_retry_budget(gateway: Gateway) -> None:
    """XBackendTrafficPolicy: Envoy takes the Service's cluster with the policy's retry budget merged
    into the user's DestinationRule (its circuit breaker kept), budget_interval included (a field newer
    than this copy of Envoy's API), and still routes to it."""
    assert gateway.envoy is not None
    (gateway.mesh_dir / "traffic-policy.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "gateway.networking.x-k8s.io/v1alpha1", "kind": "XBackendTrafficPolicy",
         "metadata": {"name": "echo-retries", "namespace": "shop"},
         "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}],
                  "retryConstraint": {"budget": {"percent": 40, "interval": "30s"}, "minRetryRate": {"count": 5}}}}))

    def threshold() -> dict[str, object] | None:
        clusters = json.loads(gateway.envoy.get("/config_dump?resource=dynamic_active_clusters")[1])["configs"]  # type: ignore[union-attr]
        echo = next(c["cluster"] for c in clusters if c["cluster"]["name"] == "outbound|8080||echo.shop.svc.cluster.local")
        first: dict[str, object] = echo["circuit_breakers"]["thresholds"][0]
        return first if "retry_budget" in first else None

    found = wait_until(threshold, 15, "the retry budget in Envoy's cluster")
    print("echo's circuit breaker with the policy's retry budget:", found)
    assert found["retry_budget"] == {"budget_percent": {"value": 40}, "min_retry_concurrency": 5,
                                     "budget_interval": "30s"}
    assert found["max_connections"] == 77  # the user's DestinationRule, kept
    assert _get(gateway, "web.example.com", "/budgeted")[0] == 200
