"""Each metric changes when the thing it counts happens, read from the running istiod's /metrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from istiod.xds import types
from tests.ads_client import AdsClient
from tests.conftest import CLIENT_PROXY, ECHO_HOST, ECHO_PORT, Mesh, render, synced
from tests.peers import eventually, metric, wait_until

CLUSTER = f"outbound|{ECHO_PORT}||{ECHO_HOST}"
LISTENER = f"{ECHO_HOST}:{ECHO_PORT}"
XDS_TYPES = (("cds", types.CLUSTER, CLUSTER), ("eds", types.ENDPOINT, CLUSTER), ("lds", types.LISTENER, LISTENER),
             ("rds", types.ROUTE, LISTENER))


def changed(before: dict, after: dict, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def test_counters_are_exposed_with_istio_names(synced_mesh: Mesh) -> None:
    status, text = synced_mesh.istiod.get("/metrics", "monitoring")
    for name in ("pilot_xds_pushes", "pilot_push_triggers", "pilot_total_xds_rejects", "pilot_inbound_updates",
                 "pilot_k8s_reg_events", "citadel_server_csr_count"):
        assert f"# TYPE {name} counter" in text
        assert f"{name}_total" not in text and f"{name}_created" not in text
    for name in ("pilot_xds", "pilot_services", "pilot_xds_cds_reject", "citadel_server_root_cert_expiry_timestamp"):
        assert f"# TYPE {name} gauge" in text
    for name in ("pilot_debounce_time", "pilot_xds_push_time", "pilot_proxy_convergence_time",
                 "pilot_proxy_queue_time", "pilot_xds_config_size_bytes"):
        assert f"# TYPE {name} histogram" in text


def test_connections_and_pushes_move_the_xds_metrics(
    mesh_dir: Path, synced_mesh: Mesh, start_demo: Callable
) -> None:
    istiod = synced_mesh.istiod
    before = istiod.metrics()
    # Another real client: one more connection, and one response of each type.
    second = start_demo("client", f"xds:///{ECHO_HOST}:{ECHO_PORT}", "--xds", istiod.xds_address, "--count", "0",
                        "--interval", "0.2", "--namespace", "echo-ns", "--node-ip", "127.0.0.51", name="second")
    second_proxy = CLIENT_PROXY.replace("127.0.0.1", "127.0.0.51")
    wait_until(lambda: synced(istiod, second_proxy, ("cluster", "listener", "endpoint", "route")), 15, "second client")
    connected = istiod.metrics()
    assert changed(before, connected, "pilot_xds", version="unknown") == 1
    for short, _, _ in XDS_TYPES:
        assert changed(before, connected, "pilot_xds_pushes", type=short) == 1, short
        assert changed(before, connected, "pilot_xds_push_time_count", type=short) == 1, short
        assert changed(before, connected, "pilot_xds_config_size_bytes_count", type=short) == 1, short
        assert changed(before, connected, "pilot_xds_config_size_bytes_sum", type=short) > 0, short

    # An endpoint change: one trigger, debounced, queued to both clients, converged, EDS pushed twice.
    (mesh_dir / "pod-b.yaml").write_text(
        render("pod.yaml", pod="echo-b", app="echo", namespace="echo-ns", ip="127.0.0.22", port=7071))
    wait_until(lambda: changed(connected, istiod.metrics(), "pilot_xds_pushes", type="eds") == 2, 5, "EDS pushes")
    wait_until(lambda: istiod.get("/debug/push_status")[1]["in_progress"] is False, 5, "the push to finish")
    pushed = istiod.metrics()
    assert changed(connected, pushed, "pilot_push_triggers", type="endpoint") == 1
    assert changed(connected, pushed, "pilot_inbound_updates", type="eds") == 1
    assert changed(connected, pushed, "pilot_k8s_reg_events", type="Pod", event="add") == 1
    assert changed(connected, pushed, "pilot_debounce_time_count") == 1
    # Both clients; not the server, whose config does not depend on that service's endpoints.
    assert changed(connected, pushed, "pilot_proxy_queue_time_count") == 2
    assert changed(connected, pushed, "pilot_proxy_convergence_time_count") == 2
    assert changed(connected, pushed, "pilot_xds_pushes", type="cds") == 0  # clusters did not change

    second.stop()
    wait_until(lambda: changed(before, istiod.metrics(), "pilot_xds", version="unknown") == 0, 5, "a disconnect")


def test_registry_events_by_kind_and_type(synced_mesh: Mesh) -> None:
    istiod, mesh_dir = synced_mesh.istiod, synced_mesh.dir
    before = istiod.metrics()
    assert metric(before, "pilot_services") == 1
    other = mesh_dir / "other.yaml"
    other.write_text(render("service.yaml", name="other", namespace="echo-ns", port=8080))
    wait_until(lambda: metric(istiod.metrics(), "pilot_services") == 2, 5, "a second service")
    other.write_text(render("service.yaml", name="other", namespace="echo-ns", port=8081))
    wait_until(lambda: changed(before, istiod.metrics(), "pilot_k8s_reg_events", type="Service", event="update"), 5,
               "a service update")
    other.unlink()
    wait_until(lambda: metric(istiod.metrics(), "pilot_services") == 1, 5, "the service to go")
    (mesh_dir / "ns2.yaml").write_text(render("namespace.yaml", namespace="second-ns"))
    wait_until(lambda: changed(before, istiod.metrics(), "pilot_push_triggers", type="config") == 1, 5, "a config push")
    after = istiod.metrics()
    for event in ("add", "update", "delete"):
        assert changed(before, after, "pilot_k8s_reg_events", type="Service", event=event) == 1, event
    assert changed(before, after, "pilot_k8s_reg_events", type="Namespace", event="add") == 1
    assert changed(before, after, "pilot_inbound_updates", type="svc") == 2
    assert changed(before, after, "pilot_inbound_updates", type="svcdelete") == 1
    assert changed(before, after, "pilot_inbound_updates", type="config") == 1
    assert changed(before, after, "pilot_push_triggers", type="service") == 3


async def test_nacks_of_each_type_count_as_rejects(
    synced_mesh: Mesh, ads_client: Callable[..., AdsClient]
) -> None:
    istiod = synced_mesh.istiod
    before = istiod.metrics()
    client = ads_client(istiod, "nacker", "echo-ns", istio_version="1.99.0")
    node = client.node.id
    for short, type_url, name in XDS_TYPES:
        await client.subscribe(type_url, [name], nack=f"rejecting {short} for the test")
    await eventually(lambda: changed(before, istiod.metrics(), "pilot_total_xds_rejects", type="rds") == 1, 5,
                     "the NACKs")
    nacked = istiod.metrics()
    assert metric(nacked, "pilot_xds", version="1.99.0") == 1
    for short, _, _ in XDS_TYPES:
        assert changed(before, nacked, "pilot_total_xds_rejects", type=short) == 1, short
        assert metric(nacked, f"pilot_xds_{short}_reject", node=node, err="InvalidArgument") == 1, short

    await client.close()
    await eventually(lambda: metric(istiod.metrics(), "pilot_xds", version="1.99.0") == 0, 5, "the disconnect")
    gone = istiod.metrics()
    assert all(metric(gone, f"pilot_xds_{short}_reject", node=node, err="InvalidArgument") == 0
               for short, _, _ in XDS_TYPES)


async def test_a_reject_stays_while_another_connection_of_the_proxy_has_it(
    synced_mesh: Mesh, ads_client: Callable[..., AdsClient]
) -> None:
    """pilot_xds_*_reject is per proxy: a reconnect overlaps the old stream, and the old one closing must
    not remove the series while the new one still has the NACK."""
    istiod = synced_mesh.istiod
    before = istiod.metrics()
    old = ads_client(istiod, "reconnecting", "echo-ns", istio_version="1.98.0")
    new = ads_client(istiod, "reconnecting", "echo-ns", istio_version="1.98.0")
    node = old.node.id
    assert new.node.id == node
    for client in (old, new):
        await client.subscribe(types.CLUSTER, [CLUSTER], nack="rejecting cds for the test")
    await eventually(lambda: changed(before, istiod.metrics(), "pilot_total_xds_rejects", type="cds") == 2, 5,
                     "both NACKs")
    both = istiod.metrics()
    assert metric(both, "pilot_xds_cds_reject", node=node, err="InvalidArgument") == 1
    assert metric(both, "pilot_xds", version="1.98.0") == 2

    await old.close()
    await eventually(lambda: metric(istiod.metrics(), "pilot_xds", version="1.98.0") == 1, 5, "the old disconnect")
    assert metric(istiod.metrics(), "pilot_xds_cds_reject", node=node, err="InvalidArgument") == 1

    await new.close()
    await eventually(lambda: metric(istiod.metrics(), "pilot_xds", version="1.98.0") == 0, 5, "the new disconnect")
    assert metric(istiod.metrics(), "pilot_xds_cds_reject", node=node, err="InvalidArgument") == 0
