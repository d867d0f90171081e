"""A real Envoy whose new ADS stream istiod closes by its send deadline, while the first response is
still being written, reconnects and ends with every type ACKed and current (state of the world and delta).

Envoy grants istiod a 64 KiB HTTP/2 window here and the relay in front of it holds istiod's bytes back
for a while, so the first response (clusters, larger than the window) cannot be written in time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.envoy_peer import Envoy, sidecar_envoy
from tests.peers import Istiod, wait_until
from tests.test_envoy_sidecar import _acked, _dynamic, _mesh

FILLER = 300  # Services enough for a clusters response well past the window
WINDOW = 65535  # the least HTTP/2 allows
LATE = "late.shop.svc.cluster.local"


def _filler() -> str:
    return "---\n".join(f"""apiVersion: v1
kind: Service
metadata: {{name: filler{i}, namespace: shop}}
spec: {{clusterIP: 10.97.{i // 250}.{i % 250 + 1}, selector: {{app: filler{i}}}, ports: [{{name: http, port: 80}}]}}
""" for i in range(FILLER))


def _late() -> str:
    return """apiVersion: v1
kind: Service
metadata: {name: late, namespace: shop}
spec: {clusterIP: 10.96.0.40, selector: {app: late}, ports: [{name: http, port: 80, targetPort: 8080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: late-1, namespace: shop, labels: {app: late}}
spec: {containers: [{name: app, ports: [{containerPort: 8080}]}]}
status: {phase: Running, podIP: 127.0.0.33, conditions: [{type: Ready, status: "True"}]}
"""


def _holds_late(envoy: Envoy) -> bool:
    """Whether Envoy holds the late Service in every type: cluster, its endpoint, the route to it."""
    dump = envoy.config_dump()
    cluster = f"outbound|80||{LATE}"
    endpoints = _dynamic(dump, "endpoints").get(cluster, {}).get("endpoints", [])
    addresses = {e["endpoint"]["address"]["socket_address"]["address"] for group in endpoints
                 for e in group.get("lb_endpoints", [])}
    hosts = {h["name"] for h in _dynamic(dump, "routes").get("80", {}).get("virtual_hosts", [])}
    return (cluster in _dynamic(dump, "clusters") and addresses == {"127.0.0.33"} and f"{LATE}:80" in hosts
            and "0.0.0.0_80" in _dynamic(dump, "listeners"))


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
def test_envoy_closed_by_the_send_deadline_reconnects_and_syncs(
    mesh_dir: Path, start_istiod: Callable[..., Istiod], delta: bool
) -> None:
    _mesh(mesh_dir)
    istiod = start_istiod(mesh_dir, "--xds-send-timeout", "1s")
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web", delta=delta,
                       xds_window=WINDOW) as envoy:
        _acked(istiod, envoy)
        relay = envoy.xds_relay
        assert relay is not None
        relay.disconnect(hold=True)
        # Changed while Envoy is away, so that even over delta the first response of its next stream is large.
        (mesh_dir / "late.yaml").write_text(_filler() + "---\n" + _late())
        wait_until(lambda: LATE in str(istiod.get("/debug/registryz")[1]), 20, "istiod to have the late Services")
        relay.stall()
        relay.resume()
        wait_until(lambda: "ads send timeout" in istiod.text(), 20, "istiod to close the new stream by its send deadline")
        relay.stall(False)
        _acked(istiod, envoy)
        try:
            wait_until(lambda: _holds_late(envoy), 20, "Envoy to hold the late Service's cluster, endpoint and route")
        except AssertionError:
            raise AssertionError(f"Envoy:\n{envoy.log()[-6000:]}") from None
        assert len(_dynamic(envoy.config_dump(), "clusters")) > FILLER
