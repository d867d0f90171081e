"""Who may read /debug: loopback callers, and others only with the bearer token; no secret is ever shown."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from istiod.ca.authenticate import ClientCertAuthenticator, StaticToken, StaticTokenAuthenticator
from istiod.debug.access import AccessPolicy, is_loopback
from istiod.debug.app import DEBUG_ENDPOINTS, DebugView, create_app
from istiod.debug.connections import Question, answer
from istiod.debug.views import configz
from istiod.model.mesh import MeshConfig
from istiod.model.snapshot import Snapshot
from istiod.sources.store import Store
from tests.conftest import CLIENT_PROXY, render
from tests.peers import Istiod, Process, wait_until

TOKEN = "s3cret-debug-token-7f1c"
REMOTE = "192.0.2.10"  # TEST-NET-1: only ever an ASGI scope value here, never a network peer


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "127.255.0.9", "::1", "::ffff:127.0.0.2"])
async def test_loopback_callers_need_no_credentials(host: str) -> None:
    assert is_loopback(host)
    assert await AccessPolicy().refusal(host, None) is None
    assert await AccessPolicy(TOKEN).refusal(host, None) is None


@pytest.mark.parametrize("host", [REMOTE, "10.1.2.3", "::ffff:192.0.2.10", "2001:db8::1", "testclient", "", None])
async def test_other_callers_need_the_token(host: str | None) -> None:
    assert not is_loopback(host)
    assert "loopback callers only" in (await AccessPolicy().refusal(host, f"Bearer {TOKEN}") or "")
    policy = AccessPolicy(TOKEN)
    assert "must present 'Authorization: Bearer <token>'" in (await policy.refusal(host, None) or "")
    assert "must present" in (await policy.refusal(host, f"Basic {TOKEN}") or "")
    assert await policy.refusal(host, "Bearer wrong") == "the bearer token is not valid"
    assert await policy.refusal(host, f"Bearer {TOKEN}") is None
    assert await policy.refusal(host, f"bearer {TOKEN}") is None


async def test_tokens_the_ca_accepts_for_istiods_namespace() -> None:
    """As istiod: a service-account token (here the CA's static stand-in for TokenReview) is enough
    when its identity is in istiod's namespace."""
    accounts = {"istiod-sa-token": StaticToken("istio-system", "istiod"), "app-token": StaticToken("demo", "web")}
    policy = AccessPolicy(authenticators=(ClientCertAuthenticator(MeshConfig), StaticTokenAuthenticator(accounts, "cluster.local")))
    assert await policy.refusal(REMOTE, "Bearer istiod-sa-token") is None
    assert await policy.refusal(REMOTE, "Bearer app-token") == (
        "debug endpoints need an identity in namespace 'istio-system'; the token is for ['demo']")
    reason = await policy.refusal(REMOTE, "Bearer unknown-token") or ""
    assert reason.startswith("the bearer token is not valid: ") and "unknown-token" not in reason
    assert "must present" in (await policy.refusal(REMOTE, None) or "")


def test_the_token_is_not_in_the_policy_repr() -> None:
    assert TOKEN not in repr(AccessPolicy(TOKEN))


async def test_token_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert await AccessPolicy.from_token_file(path).refusal(REMOTE, f"Bearer {TOKEN}") is None
    assert AccessPolicy.from_token_file(None) == AccessPolicy()
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        AccessPolicy.from_token_file(path)


async def asgi_get(app: FastAPI, path: str, client: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One GET through the ASGI app with the client address a socket from `client` would give."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "client": (client, 40000), "server": ("127.0.0.1", 8080),
    }
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        return sent[0]["status"], json.loads(body)
    except json.JSONDecodeError:
        return sent[0]["status"], body.decode()


def empty_view() -> DebugView:
    async def answers(question: Question) -> list[Any]:
        return [answer(question, {}, None)]

    return DebugView(lambda: Snapshot("v1"), answers, lambda: None, lambda: [])


async def test_remote_callers_are_refused_without_the_token() -> None:
    app = create_app(empty_view(), AccessPolicy(TOKEN), monitoring=True)
    for path in ["/debug", "/debug/syncz", "/debug/ui", "/debug/config_dump"]:
        status, body = await asgi_get(app, path, REMOTE)
        assert status == 403 and "Authorization: Bearer" in body["error"], (path, body)
        assert (await asgi_get(app, path, REMOTE, {"Authorization": "Bearer nope"}))[0] == 403
    assert await asgi_get(app, "/debug/syncz", REMOTE, {"Authorization": f"Bearer {TOKEN}"}) == (200, [])
    assert await asgi_get(app, "/debug/syncz", "127.0.0.1") == (200, [])
    # Probes and metrics stay open, as on istiod: kubelet and Prometheus carry no token.
    for path in ["/ready", "/healthz", "/metrics", "/version"]:
        assert (await asgi_get(app, path, REMOTE))[0] == 200, path


async def test_without_a_token_debug_is_loopback_only() -> None:
    app = create_app(empty_view())
    status, body = await asgi_get(app, "/debug/registryz", REMOTE, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 403 and "loopback callers only" in body["error"]
    assert await asgi_get(app, "/debug/registryz", "::1") == (200, [])


def get_from(istiod: Istiod, port: str, path: str, source: str, headers: dict[str, str]) -> tuple[int, str]:
    """A GET over a real socket bound to `source`, so istiod sees that peer address."""
    connection = http.client.HTTPConnection("127.0.0.1", istiod.ports[port], timeout=5, source_address=(source, 0))
    try:
        connection.request("GET", path, headers=headers)
        reply = connection.getresponse()
        return reply.status, reply.read().decode()
    finally:
        connection.close()


def test_a_configured_token_never_appears_in_any_response(
    tmp_path: Path, mesh_dir: Path, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    token_file = tmp_path / "debug-token"
    token_file.write_text(TOKEN)
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port=7070))
    istiod = start_istiod(mesh_dir, "--debug-auth-token-file", str(token_file))
    start_demo("client", "xds:///echo.echo-ns.svc.cluster.local:7070", "--xds", istiod.xds_address, "--count", "0",
               "--interval", "0.2", "--namespace", "echo-ns", name="client")
    wait_until(lambda: CLIENT_PROXY in str(istiod.get("/debug/syncz")[1]), 15, "the client to connect")
    paths = [p.replace("proxyID=", f"proxyID={CLIENT_PROXY}") for p in DEBUG_ENDPOINTS]
    paths += ["/debug", "/ready", "/healthz", "/metrics", "/version", "/debug/nothing"]
    for source in ("127.0.0.1", "127.0.0.2"):  # the whole of 127.0.0.0/8 is loopback
        # X-Forwarded-For is not trusted: the check sees the socket peer, so these stay loopback.
        for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}, {"X-Forwarded-For": REMOTE}):
            for path in paths:
                status, body = get_from(istiod, "monitoring", path, source, headers)
                assert status == (404 if path == "/debug/nothing" else 200), (path, status, body)
                assert TOKEN not in body, path
    assert TOKEN not in istiod.text()


def test_configz_hides_environment_values_and_kubectls_copy() -> None:
    store = Store()
    secret = "hunter2-db-password"
    store.apply({"kind": "Pod", "metadata": {"name": "p", "namespace": "n", "annotations": {
        "kubectl.kubernetes.io/last-applied-configuration": f'{{"env": "{secret}"}}', "team": "a"}},
        "spec": {"containers": [{"name": "c", "env": [{"name": "DB_PASSWORD", "value": secret},
                                                    {"name": "FROM_REF", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}],
                 "initContainers": [{"name": "i", "env": [{"name": "X", "value": secret}]}]}})
    store.apply({"kind": "Service", "metadata": {"name": "s", "namespace": "n"}, "spec": {"ports": [{"port": 80}]}})
    shown = json.dumps(configz(store.objects()))
    assert secret not in shown and "DB_PASSWORD" in shown and "secretKeyRef" in shown and '"team": "a"' in shown
    assert store.get(next(iter(store.keys("Pod")))).raw["spec"]["containers"][0]["env"][0]["value"] == secret  # type: ignore[union-attr]


def test_configz_bounds_what_shared_references_expand_to() -> None:
    """Aliases kept as shared references: 10 levels of 10 make 10^10 values; configz names the object
    instead of expanding it, and shows the others as they are."""
    bomb: list[object] = ["x"] * 10
    for _ in range(9):
        bomb = [bomb] * 10
    store = Store()
    store.apply({"kind": "Namespace", "metadata": {"name": "bomb"}, "spec": {"laughs": bomb}})
    store.apply({"kind": "Namespace", "metadata": {"name": "fine"}})
    shown = configz(store.objects())
    assert shown == [{"kind": "Namespace", "metadata": {"name": "bomb"}, "omitted": "expands to more than 200000 values"},
                     {"kind": "Namespace", "metadata": {"name": "fine"}}]
