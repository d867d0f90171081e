"""A proxy's labels are its Pod's in the registry (istiod's SetWorkloadLabels), not those it sent:
a real Envoy whose bootstrap says `track: stable` while its Pod says `track: canary` gets the
canary Sidecar's config, and relabelling the running Pod re-selects it without a reconnect."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from istiod.model.proxy import proxy_from_node, with_workload_labels
from tests.envoy_peer import sidecar_envoy
from tests.peers import Istiod, wait_until
from tests.test_envoy_sidecar import _dynamic, _mesh

POD = """apiVersion: v1
kind: Pod
metadata: {{name: client-1, namespace: shop, labels: {{app: client, track: {track}}}}}
spec: {{containers: [{{name: app}}]}}
status: {{phase: Running, podIP: 127.0.0.1, conditions: [{{type: Ready, status: "True"}}]}}
"""
# Under it the canary sees only the web Service: no db cluster.
SIDECAR = """apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: canary, namespace: shop}
spec:
  workloadSelector: {labels: {track: canary}}
  egress: [{hosts: ["./web.shop.svc.cluster.local"]}]
"""
DB = "outbound|5432||db.shop.svc.cluster.local"
WEB = "outbound|80||web.shop.svc.cluster.local"


def test_registry_labels_win_over_metadata_and_follow_the_pod(mesh_dir: Path,
                                                              start_istiod: Callable[..., Istiod]) -> None:
    _mesh(mesh_dir)
    (mesh_dir / "client.yaml").write_text(POD.format(track="canary"))
    (mesh_dir / "sidecar.yaml").write_text(SIDECAR)
    istiod = start_istiod(mesh_dir)
    with sidecar_envoy(istiod.xds_address, "client-1", "shop",
                       metadata={"LABELS": {"app": "client", "track": "stable"}}) as envoy:
        def clusters() -> set[str]:
            return set(_dynamic(envoy.config_dump(), "clusters"))

        wait_until(lambda: WEB in clusters() and DB not in clusters(), 15, "the canary Sidecar's view (web only)")
        (mesh_dir / "client.yaml").write_text(POD.format(track="stable"))
        wait_until(lambda: {WEB, DB} <= clusters(), 15, "the whole mesh once the Pod is relabelled")
        (mesh_dir / "client.yaml").unlink()
        # Without a Pod the labels it sent apply again: still stable, still everything.
        wait_until(lambda: {WEB, DB} <= clusters(), 5, "the metadata labels once the Pod is gone")


def test_with_workload_labels() -> None:
    node = proxy_from_node("sidecar~10.0.0.5~c-1.shop~shop.svc.cluster.local",
                           {"LABELS": {"app": "c", "track": "stable"}, "STATIC_LABELS": {"env": "prod", "app": "x"}})
    assert dict(node.static_labels) == {"env": "prod", "app": "x"}
    assert with_workload_labels(node, None) is node
    relabelled = with_workload_labels(node, (("app", "c"), ("track", "canary")))
    # The Pod's labels over the static ones; what the proxy sent as LABELS no longer counts.
    assert dict(relabelled.labels) == {"app": "c", "track": "canary", "env": "prod"}
    assert relabelled.id == node.id and relabelled.static_labels == node.static_labels
