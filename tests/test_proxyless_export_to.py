"""meshConfig defaultVirtualServiceExportTo through a real gRPC xDS client (grpcio, in a
subprocess): a VirtualService of another namespace, without exportTo, routes echo-ns's client to
subset v2 while the mesh default lets the client see it; an edit of the mesh config file to `.`
hides it (the client reaches both pods again), one naming echo-ns shows it again. No restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.peers import Istiod, Process, wait_until
from tests.test_proxyless_grpc import start_client, wait_for_replies
from tests.test_proxyless_routing import TARGET, versioned_mesh  # noqa: F401 (the fixture)

FOREIGN = """apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: echo-canary, namespace: team}
spec:
  hosts: [echo.echo-ns.svc.cluster.local]
  http: [{route: [{destination: {host: echo.echo-ns.svc.cluster.local, subset: v2}}]}]
"""


def test_a_virtual_service_of_another_namespace_follows_the_mesh_default(
        versioned_mesh: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],  # noqa: F811 (the fixture)
        start_demo: Callable[..., Process]) -> None:
    (versioned_mesh / "vs.yaml").write_text(FOREIGN)
    mesh_config = tmp_path / "mesh-config.yaml"
    mesh_config.write_text("rootNamespace: istio-system\n")
    istiod = start_istiod(versioned_mesh, "--mesh-config", str(mesh_config))
    client = start_client(start_demo, istiod, TARGET)
    wait_until(lambda: any(line["ok"] for line in client.drain()), 15, "a first reply")
    took = wait_for_replies(client, {"echo-v2"}, timeout=5)
    print(f"no default (Istio's `*`): team's VirtualService routes to v2 ({took:.2f}s)")

    mesh_config.write_text("rootNamespace: istio-system\ndefaultVirtualServiceExportTo: ['.']\n")
    took = wait_for_replies(client, {"echo-v1", "echo-v2"})
    print(f"defaultVirtualServiceExportTo ['.']: the client no longer sees it, both pods answer ({took:.2f}s)")

    mesh_config.write_text("rootNamespace: istio-system\ndefaultVirtualServiceExportTo: [echo-ns]\n")
    took = wait_for_replies(client, {"echo-v2"})
    print(f"defaultVirtualServiceExportTo [echo-ns]: v2 only again ({took:.2f}s)")
