"""VirtualService mirrors, CORS policies and delegation through a real Envoy sidecar: the pod of
tests/test_envoy_routing.py (web-1 calling the echo versions inside its network namespace), with a
Service `shadowed` (echo-v1 alone) whose routes mirror to echo-v2, carry a CORS policy, or
delegate to a VirtualService of another namespace."""

from __future__ import annotations

import time

from tests.peers import wait_until
from tests.test_envoy_routing import Pod, pod  # noqa: F401  (the module's pod fixture)

VIP = "10.96.0.22"
SHADOWED = f"""apiVersion: v1
kind: Service
metadata: {{name: shadowed, namespace: shop}}
spec:
  clusterIP: {VIP}
  selector: {{app: echo, version: v1}}
  ports: [{{name: http, port: 80, targetPort: 8080}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: shadowed, namespace: shop}}
spec:
  hosts: [shadowed]
  http:
  - name: unmirrored
    match: [{{uri: {{prefix: /unmirrored}}}}]
    mirror: {{host: echo, subset: v2}}
    mirrorPercentage: {{value: 0}}
    route: [{{destination: {{host: shadowed}}}}]
  - name: mirrored
    match: [{{uri: {{prefix: /mirrored}}}}]
    mirrors: [{{destination: {{host: echo, subset: v2}}}}]
    route: [{{destination: {{host: shadowed}}}}]
  - name: cors
    corsPolicy:
      allowOrigins: [{{exact: "https://ok.example"}}, {{prefix: "https://also."}}]
      allowMethods: [GET, PUT]
      allowHeaders: [x-custom]
      exposeHeaders: [x-exposed]
      maxAge: 1h
      allowCredentials: true
      unmatchedPreflights: IGNORE
    route: [{{destination: {{host: shadowed}}}}]
"""


def _setup(pod: Pod, config: str = SHADOWED) -> None:
    (pod.config / "shadowed.yaml").write_text(config)
    assert pod.run("ip", "addr", "add", f"{VIP}/32", "dev", "lo").returncode == 0
    wait_until(lambda: '"name"' in pod.curl(host="shadowed", url=f"http://{VIP}/cors/ready"), 20,
               "the shadowed Service's routes in the sidecar")


def _teardown(pod: Pod) -> None:
    (pod.config / "shadowed.yaml").unlink()
    pod.run("ip", "addr", "del", f"{VIP}/32", "dev", "lo")


def _requests_seen(pod: Pod, backend: str, path: str) -> int:
    return sum(f"GET {path}" in line for line in pod.backends[backend].output)


def test_a_mirrored_request_reaches_the_mirror_and_zero_percent_mirrors_none(pod: Pod) -> None:  # noqa: F811
    _setup(pod)
    try:
        n = 5
        answers = [pod.get(f"/mirrored/{i}", host="shadowed")["name"] for i in range(n)]
        skipped = [pod.get(f"/unmirrored/{i}", host="shadowed")["name"] for i in range(n)]
        assert set(answers) == set(skipped) == {"echo-v1"}  # the client's answers come from the route only
        wait_until(lambda: all(_requests_seen(pod, "echo-v2", f"/mirrored/{i} ") == 1 for i in range(n)), 10,
                   "each mirrored request at echo-v2")
        time.sleep(0.5)  # a mirror of /unmirrored would have arrived as fast as those above
        print(f"{n} requests on a mirrored route: echo-v1 answered {answers.count('echo-v1')}, echo-v2 got "
              f"{sum(_requests_seen(pod, 'echo-v2', f'/mirrored/{i} ') for i in range(n))} shadows; "
              f"mirrorPercentage 0: {_requests_seen(pod, 'echo-v2', '/unmirrored/')} shadows")
        assert _requests_seen(pod, "echo-v2", "/unmirrored/") == 0
        assert all(_requests_seen(pod, "echo-v1", f"/mirrored/{i} ") == 1 for i in range(n))
    finally:
        _teardown(pod)


def _preflight(pod: Pod, origin: str) -> dict[str, str]:
    out = pod.curl("-i", "-X", "OPTIONS", "-H", f"Origin: {origin}", "-H", "Access-Control-Request-Method: PUT",
                   "-H", "Access-Control-Request-Headers: x-custom", host="shadowed", url=f"http://{VIP}/cors/x")
    return {"status": out.split()[1], **_headers(out)}


def _headers(response: str) -> dict[str, str]:
    head = response.replace("\r\n", "\n").partition("\n\n")[0].splitlines()
    return {name.lower(): value for name, _, value in (line.partition(": ") for line in head[1:])}


def test_cors_preflight_is_answered_by_the_sidecar_for_allowed_origins_only(pod: Pod) -> None:  # noqa: F811
    _setup(pod)
    try:
        allowed, prefixed, other = (_preflight(pod, o) for o in (
            "https://ok.example", "https://also.example", "https://evil.example"))
        print(f"preflight from an allowed origin: {allowed}; from another: {other}")
        for answer, origin in ((allowed, "https://ok.example"), (prefixed, "https://also.example")):
            assert answer["status"] == "200" and answer["server"] == "envoy"  # not the app: it has no OPTIONS
            assert answer["access-control-allow-origin"] == origin
            assert (answer["access-control-allow-methods"], answer["access-control-allow-headers"]) == ("GET,PUT", "x-custom")
            assert (answer["access-control-max-age"], answer["access-control-allow-credentials"]) == ("3600", "true")
        # IGNORE: a preflight from an origin not allowed is answered by Envoy too, but allows no origin
        # (Envoy still lists the methods and headers: without the origin a browser refuses).
        assert other["status"] == "200" and "access-control-allow-origin" not in other
        assert _requests_seen(pod, "echo-v1", "/cors/x") == 0 and not any(
            "OPTIONS /cors/x" in line for line in pod.backends["echo-v1"].output)

        simple = pod.curl("-i", "-H", "Origin: https://ok.example", host="shadowed", url=f"http://{VIP}/cors/get")
        headers = _headers(simple)
        assert headers["access-control-allow-origin"] == "https://ok.example"
        assert headers["access-control-expose-headers"] == "x-exposed"
        blocked = pod.curl("-i", "-H", "Origin: https://evil.example", host="shadowed", url=f"http://{VIP}/cors/get")
        assert "access-control-allow-origin" not in _headers(blocked) and '"echo-v1"' in blocked
    finally:
        _teardown(pod)


DELEGATED = """apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: shadowed, namespace: shop}
spec:
  hosts: [shadowed]
  http:
  - name: team
    match: [{uri: {prefix: /team}}]
    delegate: {name: team-routes, namespace: team}
  - route: [{destination: {host: shadowed}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: team-routes, namespace: team}
spec:
  http:
  - name: v2
    match: [{uri: {prefix: /team/v2}}]
    route: [{destination: {host: echo.shop.svc.cluster.local, subset: v2}}]
"""


def test_a_delegated_route_reaches_its_backend_and_follows_the_delegate(pod: Pod) -> None:  # noqa: F811
    """The root VirtualService `shadowed` hands /team to the delegate in namespace team: its route
    to echo-v2 is what the sidecar follows; a change of the delegate alone moves the traffic."""
    _setup(pod, SHADOWED.split("---")[0] + "---\n" + DELEGATED)
    try:
        wait_until(lambda: pod.get("/team/v2/x", host="shadowed")["name"] == "echo-v2", 20,
                   "the delegate's route in the sidecar")
        assert pod.get("/team/other", host="shadowed")["name"] == "echo-v1"  # no delegate route: the root's next
        config = pod.config / "shadowed.yaml"
        config.write_text(config.read_text().replace("subset: v2", "subset: v1"))
        wait_until(lambda: pod.get("/team/v2/y", host="shadowed")["name"] == "echo-v1", 20,
                   "the changed delegate's route in the sidecar")
        print("/team/v2 through the delegate: echo-v2, then echo-v1 after the delegate alone changed")
    finally:
        _teardown(pod)
