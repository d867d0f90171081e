"""Incremental xDS with real Envoys: one on DELTA_GRPC next to one on state of the world, for the
same pod, end with the same config; a delta Envoy that reconnects is sent only what changed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.envoy_peer import Envoy, sidecar_envoy
from tests.peers import Istiod, wait_until
from tests.test_envoy_sidecar import CART, PROXY, TYPES, _dynamic, _mesh, _notable

KINDS = ("listeners", "clusters", "routes", "endpoints")


def _config(envoy: Envoy) -> dict[str, dict[str, Any]] | None:
    """The Envoy's dynamic resources by kind, once nothing is warming."""
    dump = envoy.config_dump()
    if dump["ClustersConfigDump"].get("dynamic_warming_clusters"):
        return None
    if any("warming_state" in e for e in dump["ListenersConfigDump"].get("dynamic_listeners", [])):
        return None
    return {kind: _dynamic(dump, kind) for kind in KINDS}


def _connections_synced(istiod: Istiod, count: int) -> bool:
    """`count` connections of the pod in /debug/syncz, every type of each sent and ACKed."""
    status, syncz = istiod.get("/debug/syncz")
    entries = [s for s in syncz if s["proxy"] == PROXY] if status == 200 else []
    return len(entries) == count and all(e[f"{t}_sent"] and e[f"{t}_sent"] == e[f"{t}_acked"]
                                         for e in entries for t in TYPES)


def _changed(config: dict[str, dict[str, Any]] | None) -> bool:
    """The changes below have all landed: rpc's cluster is HTTP/1.1, cart is in, db is out."""
    if config is None:
        return False
    rpc = config["clusters"].get("outbound|7070||rpc.shop.svc.cluster.local", {})
    return (bool(rpc) and "typed_extension_protocol_options" not in rpc
            and "outbound|9090||cart.shop.svc.cluster.local" in config["endpoints"] and "9090" in config["routes"]
            and "10.96.0.11_5432" not in config["listeners"]
            and "outbound|5432||db.shop.svc.cluster.local" not in config["clusters"])


def test_delta_and_sotw_envoys_converge_and_a_reconnect_gets_only_what_changed(
    mesh_dir: Path, start_istiod: Callable[..., Istiod]
) -> None:
    _mesh(mesh_dir)
    istiod = start_istiod(mesh_dir)
    pod = ("web-1", "shop", "127.0.0.31")
    with sidecar_envoy(istiod.xds_address, *pod, service_account="web") as sotw, \
            sidecar_envoy(istiod.xds_address, *pod, service_account="web", delta=True) as delta:
        wait_until(lambda: _connections_synced(istiod, 2), 20, "both Envoys to ACK every type")
        first = wait_until(lambda: _config(sotw), 10, "the SotW Envoy's config")
        wait_until(lambda: _config(delta) == first, 10, "the delta Envoy to hold the SotW Envoy's config")

        # While the delta Envoy is cut off, a cluster changes, a service comes and one goes.
        assert delta.xds_relay is not None
        delta.xds_relay.disconnect(hold=True)
        wait_until(lambda: _connections_synced(istiod, 1), 10, "istiod to see the delta stream gone")
        mesh = (mesh_dir / "mesh.yaml").read_text().replace("appProtocol: grpc", "appProtocol: http")
        documents = mesh.split("---\n")
        (mesh_dir / "mesh.yaml").write_text(
            "---\n".join(d for d in documents if "kind: Service\nmetadata: {name: db" not in d))
        (mesh_dir / "cart.yaml").write_text(CART)
        changed = wait_until(lambda: (c := _config(sotw)) is not None and _changed(c) and c, 15,
                             "the changes in the SotW Envoy")
        assert not _changed(_config(delta))

        # It reconnects with the versions it holds (initial_resource_versions): istiod sends what differs.
        before = len(delta.log())
        delta.xds_relay.resume()
        try:
            wait_until(lambda: _config(delta) == changed, 20, "the delta Envoy to hold the SotW Envoy's config again")
        except AssertionError:
            now = _config(delta)
            diff = {k: sorted(set(changed[k]) ^ set(now[k])) for k in KINDS} if now else "warming"
            raise AssertionError(f"differs: {diff}\n{delta.log()[before:][-8000:]}") from None
        wait_until(lambda: _connections_synced(istiod, 2), 10, "both Envoys to ACK every type again")
        reconnect = delta.log()[before:]
        print("The delta Envoy printed after reconnecting:\n" + _notable_tail(reconnect))
        assert "cds: response indicates 2 added/updated cluster(s), 1 removed cluster(s)" in reconnect
        assert "add/update cluster 'outbound|80||web.shop.svc.cluster.local'" not in reconnect
        assert "lds: remove listener '10.96.0.11_5432'" in reconnect
        assert "add/update listener 'virtualInbound'" not in reconnect

        # An endpoint-only change: each Envoy is sent cart's assignment alone, over SotW too.
        marks = len(sotw.log()), len(delta.log())
        (mesh_dir / "cart.yaml").write_text(CART + CART_2)
        both = wait_until(lambda: (c := _config(sotw)) is not None and _cart_pods(c) == 2 and c, 15,
                          "cart's second pod in the SotW Envoy")
        wait_until(lambda: _config(delta) == both, 15, "the delta Envoy to hold the SotW Envoy's config")
        sotw_eds, delta_eds = (_eds_updates(e.log()[mark:]) for e, mark in zip((sotw, delta), marks))
        print(f"Envoys' EDS updates for the new endpoint:\nSotW: {sotw_eds}\ndelta: {delta_eds}")
        assert sotw_eds == ["accepted with 1 resources"] and delta_eds == ["accepted with 1 resources added, 0 removed"]
        print("The SotW Envoy printed:\n" + _notable(sotw))


# cart's pod again, as cart-2 at another address
CART_2 = "---" + CART.split("---")[1].replace("cart-1", "cart-2").replace("127.0.0.34", "127.0.0.35")


def _cart_pods(config: dict[str, dict[str, Any]]) -> int:
    cart = config["endpoints"].get("outbound|9090||cart.shop.svc.cluster.local", {})
    return sum(len(group.get("lb_endpoints", [])) for group in cart.get("endpoints", []))


def _eds_updates(log: str) -> list[str]:
    """What Envoy's config:debug lines say of each ClusterLoadAssignment response it took."""
    lines = [line for line in log.splitlines() if "ClusterLoadAssignment accepted with" in line]
    return ["accepted with " + line.split("accepted with ", 1)[1].split(" with version")[0] for line in lines]


def _notable_tail(log: str) -> str:
    words = ("cds:", "lds:", "warning", "error", "rejected", "initialized")
    return "".join(line for line in log.splitlines(True) if any(w in line for w in words))
