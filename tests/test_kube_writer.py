"""How informer objects reach the store: relist diffs, discovery selectors, bad objects.
(The informers against a real kube-apiserver are in e2e/.)"""

from __future__ import annotations

import asyncio
import logging

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.sources.convert import ObjectKey
from istiod.backoff import Backoff
from istiod.sources.kube import Gone, Informer, KubeWriter
from istiod.sources.namespaces import NamespaceFilter, parse_selector
from istiod.sources.store import Store


def ns(name: str, **labels: str) -> dict:
    return {"kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def svc(name: str, namespace: str, port: object = 80) -> dict:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"ports": [{"port": port}]}}


def keys(store: Store, kind: str) -> list[str]:
    return sorted(f"{k.namespace}/{k.name}" for k in store.keys(kind))


def test_relist_deletes_what_vanished_and_duplicates_nothing() -> None:
    store = Store()
    writer = KubeWriter(store, NamespaceFilter())
    writer.replace("Service", [svc("a", "x"), svc("b", "x")])
    events: list[str] = []
    store.subscribe(lambda change: events.append(f"{change.type.value} {change.key.name}"))
    writer.replace("Service", [svc("b", "x"), svc("c", "x")])
    assert keys(store, "Service") == ["x/b", "x/c"]
    assert sorted(events) == ["added c", "deleted a"]  # b is unchanged: no event


def test_discovery_selectors_follow_namespace_labels() -> None:
    store = Store()
    writer = KubeWriter(store, NamespaceFilter((parse_selector("istio-discovery=enabled"),)))
    writer.replace("Namespace", [ns("in", **{"istio-discovery": "enabled"}), ns("out")])
    writer.replace("Service", [svc("a", "in"), svc("b", "out"), svc("early", "later")])
    assert keys(store, "Service") == ["in/a"]
    writer.apply(ns("out", **{"istio-discovery": "enabled"}))  # labelled in: its objects appear
    writer.apply(ns("later", **{"istio-discovery": "enabled"}))  # objects seen before their namespace
    assert keys(store, "Service") == ["in/a", "later/early", "out/b"]
    writer.apply(ns("in"))  # labelled out: its objects leave
    assert keys(store, "Service") == ["later/early", "out/b"]
    writer.replace("Service", [svc("b", "out")])  # a relist forgets excluded objects that vanished
    writer.apply(ns("in", **{"istio-discovery": "enabled"}))
    assert keys(store, "Service") == ["out/b"]


def test_selector_grammar() -> None:
    selector = parse_selector("env=prod,team,!legacy")
    assert selector.matches({"env": "prod", "team": "a"})
    assert not selector.matches({"env": "prod", "team": "a", "legacy": "1"})
    assert not selector.matches({"env": "dev", "team": "a"})
    with pytest.raises(ValueError, match="empty term"):
        parse_selector("env=prod,,x")


def test_bad_objects_are_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    writer = KubeWriter(store, NamespaceFilter())
    writer.replace("Service", [svc("good", "x")])
    with caplog.at_level(logging.ERROR):
        writer.apply({"kind": "Service", **svc("good", "x", port=0)})
        writer.apply({"kind": "Service", "metadata": {"namespace": "x"}})
    assert store.get(ObjectKey("Service", "x", "good")).value.ports[0].port == 80  # type: ignore[union-attr]
    assert "kube Service x/good: spec.ports[0].port 0 is not in 1-65535; skipped" in caplog.text
    assert "kube object skipped: Service has no metadata.name" in caplog.text


def test_backoff_is_jittered_and_capped() -> None:
    backoff = Backoff(initial=0.5, cap=4.0)
    delays = [backoff.delay(attempt) for attempt in range(20) for _ in range(5)]
    assert all(0 <= d <= 4.0 for d in delays) and len(set(delays)) > 50


class _ScriptedInformer(Informer):
    """An informer whose list always works and whose watches follow a script (no API involved)."""

    def __init__(self, watches: list[BaseException | int]) -> None:
        super().__init__("Service", None, KubeWriter(Store(), NamespaceFilter()),  # type: ignore[arg-type]
                         backoff=Backoff(initial=1.0, cap=64.0))
        self.script = watches

    async def relist(self) -> None:
        self.resource_version = "1"

    async def watch(self) -> None:
        step = self.script.pop(0)
        if isinstance(step, int):
            self.events += step  # it delivered this many events before breaking
            raise ApiException(status=500, reason="connection cut")
        raise step


async def test_relists_back_off_while_no_watch_makes_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    ceilings: list[float] = []

    async def sleep(delay: float) -> None:
        ceilings.append(delay)
        if len(ceilings) == 9:
            raise asyncio.CancelledError

    forbidden = ApiException(status=403, reason="watch is forbidden")
    informer = _ScriptedInformer([forbidden] * 4 + [Gone("too old"), Gone("too old"), 3, forbidden, forbidden])
    monkeypatch.setattr("istiod.sources.kube.asyncio.sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await informer.run()
    # Failing watches back off (attempts 0..3: up to 1, 2, 4, 8 s); a 410 right after is not a
    # fresh start either; a watch that delivered events resets the count.
    bounds = [1, 2, 4, 8, 16, 32, 1, 2, 4]
    assert all(0 <= d <= b for d, b in zip(ceilings, bounds, strict=True)), ceilings
    assert informer.gone == 2


def test_field_managers_are_not_kept() -> None:
    store = Store()
    body = svc("a", "x")
    body["metadata"]["managedFields"] = [{"manager": "kubectl", "operation": "Apply", "fieldsType": "FieldsV1",
                                          "fieldsV1": {"f:spec": {"f:ports": {}}}}]
    KubeWriter(store, NamespaceFilter()).apply({"kind": "Service", **body})
    stored = store.get(ObjectKey("Service", "x", "a"))
    assert stored is not None and "managedFields" not in stored.raw["metadata"]
    assert stored.raw["metadata"]["name"] == "a"
