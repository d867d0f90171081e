"""PeerAuthentication and AuthorizationPolicy on a real xDS-enabled grpcio server, called by real
grpcio clients (xDS with mTLS, and plaintext straight to the server), certificates from `istiod agent`."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.peers import Istiod, Process, wait_until
from tests.test_mtls import Workload, mesh, mtls_call, run_agent  # noqa: F401  (mesh: the fixture)

SELECTOR = "selector: {matchLabels: {app: xecho}}"


def policy(name: str, spec: str) -> str:
    return (f"apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\n"
            f"metadata: {{name: {name}, namespace: echo-ns}}\nspec:\n  {SELECTOR}\n{spec}")


def peer_authentication(name: str, spec: str) -> str:
    return f"apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {{name: {name}, namespace: echo-ns}}\nspec: {spec}\n"


def apply(path: Path, text: str) -> float:
    path.write_text(text)
    return time.monotonic()


def next_code(caller: Process, want: str, since: float, timeout: float) -> float:
    """Seconds from `since` until the caller printed a call ending with `want` (OK or a status code)."""
    caller.drain()

    def seen() -> dict | None:  # type: ignore[type-arg]
        return next((l for l in caller.drain() if (l.get("code") if not l["ok"] else "OK") == want), None)

    line = wait_until(seen, timeout, f"a call ending {want}")
    took = time.monotonic() - since
    print(f"client printed {line} after {took:.2f} s")
    return took


def test_authorization_policy_on_a_proxyless_server(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],  # noqa: F811
    start_demo: Callable[..., Process], start_agent: Callable[..., Process],
) -> None:
    server, client = mesh["server"], mesh["client"]
    istiod = start_istiod(mesh_dir, "--mtls", "--ca-static-tokens", str(tmp_path / "tokens.json"))
    run_agent(start_agent, istiod, server)
    run_agent(start_agent, istiod, client)
    caller, _ = mtls_call(start_demo, istiod, server, client)
    port = server.home.joinpath("port").read_text()
    file = mesh_dir / "authz.yaml"

    # DENY the client's identity on the Echo method: PERMISSION_DENIED, within 2 s of the write.
    since = apply(file, policy("deny-client", """  action: DENY
  rules:
  - from: [{source: {principals: [cluster.local/ns/echo-ns/sa/client]}}]
    to: [{operation: {paths: [/demo.Echo/*]}}]
"""))
    assert next_code(caller, "PERMISSION_DENIED", since, 2.0) <= 2.0

    # ALLOW the right principal, method, path and port: calls succeed again.
    since = apply(file, policy("allow-client", f"""  action: ALLOW
  rules:
  - from: [{{source: {{principals: [cluster.local/ns/echo-ns/sa/client]}}}}]
    to: [{{operation: {{methods: [POST], paths: [/demo.Echo/Echo], ports: ["{port}"]}}}}]
"""))
    next_code(caller, "OK", since, 2.0)

    # ALLOW only another principal: this client is denied.
    since = apply(file, policy("allow-client", """  rules:
  - from: [{source: {principals: [cluster.local/ns/echo-ns/sa/other]}}]
"""))
    next_code(caller, "PERMISSION_DENIED", since, 2.0)

    # ALLOW by namespace: allowed; DENY for a namespace that is not the client's: still allowed.
    since = apply(file, policy("allow-client", """  rules:
  - from: [{source: {namespaces: [echo-ns]}}]
""") + "---\n" + policy("deny-other-ns", """  action: DENY
  rules:
  - from: [{source: {namespaces: [other-ns]}}]
"""))
    next_code(caller, "OK", since, 2.0)

    # A GET-only rule: gRPC calls are POSTs, so this ALLOW lets nothing through.
    since = apply(file, policy("allow-client", """  rules:
  - to: [{operation: {methods: [GET]}}]
"""))
    next_code(caller, "PERMISSION_DENIED", since, 2.0)

    # An invalid version of the policy is logged with its name and skipped; the last good one stays.
    apply(file, policy("allow-client", """  rules:
  - to: [{operation: {ports: [http]}}]
"""))
    wait_until(lambda: "echo-ns/allow-client" in istiod.text() and "invalid port http" in istiod.text(), 5,
               "istiod's log of the invalid policy")
    print("istiod logged:", next(l for l in istiod.text().splitlines() if "invalid port http" in l))
    time.sleep(1)
    lines = caller.drain()
    assert lines and all(l.get("code") == "PERMISSION_DENIED" for l in lines), lines

    # What gRPC's RBAC filter checks: service accounts and hosts (the :authority header).
    since = apply(file, policy("allow-client", """  rules:
  - from: [{source: {serviceAccounts: [client]}}]
    to: [{operation: {hosts: ["*"]}}]
"""))
    next_code(caller, "OK", since, 5.0)
    since = apply(file, policy("allow-client", """  rules:
  - from: [{source: {serviceAccounts: [echo-ns/client]}}]
    to: [{operation: {hosts: [nope.example]}}]
"""))
    next_code(caller, "PERMISSION_DENIED", since, 5.0)
    # What it lacks (path templates) fails closed, as istiod: the ALLOW rule is left out, and said.
    since = apply(file, policy("allow-client", """  rules:
  - from: [{source: {notServiceAccounts: [other]}}]
""") + "---\n" + policy("allow-template", """  rules:
  - to: [{operation: {paths: ["/demo.Echo/{*}"]}}]
"""))
    next_code(caller, "OK", since, 5.0)
    wait_until(lambda: "is not supported by proxyless gRPC" in istiod.text(), 5, "istiod's note of the template")


def test_policies_follow_the_mesh_trust_domain(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],  # noqa: F811
    start_demo: Callable[..., Process], start_agent: Callable[..., Process],
) -> None:
    """A mesh whose trust domain is example.org (identities spiffe://example.org/...): a policy naming
    `cluster.local/...` means the mesh's own domain, as Istio renames it; `trustDomains` match the
    peer identity's domain."""
    server, client = mesh["server"], mesh["client"]
    istiod = start_istiod(mesh_dir, "--mtls", "--ca-static-tokens", str(tmp_path / "tokens.json"),
                          "--trust-domain", "example.org")
    run_agent(start_agent, istiod, server)
    run_agent(start_agent, istiod, client)
    caller, _ = mtls_call(start_demo, istiod, server, client, "spiffe://example.org/ns/echo-ns/sa/client")
    file = mesh_dir / "authz.yaml"
    since = apply(file, policy("deny-client", """  action: DENY
  rules: [{from: [{source: {principals: [cluster.local/ns/echo-ns/sa/client]}}]}]
"""))
    next_code(caller, "PERMISSION_DENIED", since, 5.0)
    since = apply(file, policy("allow-domain", """  rules: [{from: [{source: {trustDomains: [example.org]}}]}]
"""))
    next_code(caller, "OK", since, 5.0)
    since = apply(file, policy("allow-domain", """  rules: [{from: [{source: {trustDomains: ["*.other"]}}]}]
"""))
    next_code(caller, "PERMISSION_DENIED", since, 5.0)
    since = apply(file, policy("allow-domain", """  rules: [{when: [{key: source.trustDomain, values: ["example.*"]}]}]
"""))
    next_code(caller, "OK", since, 5.0)


def test_peer_authentication_strict_and_disable(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],  # noqa: F811
    start_demo: Callable[..., Process], start_agent: Callable[..., Process],
) -> None:
    server = mesh["server"]
    file = mesh_dir / "peerauth.yaml"
    file.write_text(peer_authentication("default", "{mtls: {mode: STRICT}}"))
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(tmp_path / "tokens.json"))  # mesh mTLS off
    run_agent(start_agent, istiod, server)
    port = server.home.joinpath("port").read_text()
    address = f"{server.ip}:{port}"
    start_demo("server", "--address", address, "--name", server.pod, "--xds", istiod.secure_address,
               "--namespace", "echo-ns", env={"GRPC_XDS_BOOTSTRAP": str(server.bootstrap)}, name="xds-server").next_json(15)

    def plaintext_call(name: str) -> dict:  # type: ignore[type-arg]
        line = start_demo("client", address, "--count", "1", "--timeout", "2", name=name).next_json(10)
        print(f"{name}: {line}")
        return line

    def until(name: str, ok: bool) -> dict:  # type: ignore[type-arg]
        return wait_until(lambda: (line := plaintext_call(name))["ok"] is ok and line, 10, f"{name}: ok={ok}")

    # Namespace STRICT: a plaintext client is refused.
    assert until("plaintext-strict", False)["code"] == "UNAVAILABLE"

    # The workload's port-level DISABLE overrides the namespace's STRICT: plaintext is served.
    file.write_text(peer_authentication("default", "{mtls: {mode: STRICT}}") + "---\n" + peer_authentication(
        "xecho", f"{{{SELECTOR}, mtls: {{mode: STRICT}}, portLevelMtls: {{{port}: {{mode: DISABLE}}}}}}"))
    assert until("plaintext-disable", True)["reply"] == f"{server.pod} {address}"

    # PERMISSIVE, on a gRPC server, serves plaintext (it cannot tell TLS from plaintext on one port).
    file.write_text(peer_authentication("default", "{mtls: {mode: STRICT}}") + "---\n" + peer_authentication(
        "xecho", f"{{{SELECTOR}, mtls: {{mode: PERMISSIVE}}}}"))
    time.sleep(1)
    assert plaintext_call("plaintext-permissive")["ok"]
