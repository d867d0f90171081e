"""The config-dir source: adds, edits, deletions, and bad files that keep the last good state."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from istiod.sources.configdir import ConfigDirSource
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store

NS_A = "kind: Namespace\nmetadata: {name: a}\n"
NS_B = "kind: Namespace\nmetadata: {name: b}\n"
SVC = "kind: Service\nmetadata: {name: s, namespace: a}\nspec: {ports: [{port: %s}]}\n"


def names(store: Store, kind: str) -> list[str]:
    return sorted(o.key.name for o in store.objects(kind))


def touch(path: Path, text: str) -> None:
    """Write and make sure the mtime moves even on coarse clocks."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    if path.stat().st_mtime_ns == before:
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


async def test_adds_edits_and_deletions(tmp_path: Path) -> None:
    store = Store()
    source = ConfigDirSource(tmp_path, store)
    (tmp_path / "sub").mkdir()
    touch(tmp_path / "sub" / "ns.yml", NS_A + "---\n" + NS_B)
    touch(tmp_path / "svc.yaml", SVC % 80)
    (tmp_path / "notes.txt").write_text("kind: Namespace\nmetadata: {name: ignored}\n")
    await source.scan()
    assert names(store, "Namespace") == ["a", "b"] and names(store, "Service") == ["s"]

    touch(tmp_path / "svc.yaml", SVC % 81)
    touch(tmp_path / "sub" / "ns.yml", NS_A)
    await source.scan()
    assert store.get(ObjectKey("Service", "a", "s")).value.ports[0].port == 81  # type: ignore[union-attr]
    assert names(store, "Namespace") == ["a"]

    (tmp_path / "svc.yaml").unlink()
    await source.scan()
    assert names(store, "Service") == []


async def test_malformed_file_keeps_its_objects(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    source = ConfigDirSource(tmp_path, store)
    touch(tmp_path / "m.yaml", NS_A + "---\n" + SVC % 80)
    await source.scan()
    touch(tmp_path / "m.yaml", NS_A + "---\nkind: [\n")
    with caplog.at_level(logging.ERROR):
        await source.scan()
    assert names(store, "Namespace") == ["a"] and names(store, "Service") == ["s"]
    assert "m.yaml" in caplog.text and "keeping its last good objects" in caplog.text
    touch(tmp_path / "m.yaml", NS_A)  # fixed: now the Service really is gone
    await source.scan()
    assert names(store, "Service") == []


async def test_bad_object_keeps_its_last_good_state(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    source = ConfigDirSource(tmp_path, store)
    touch(tmp_path / "s.yaml", SVC % 80)
    await source.scan()
    touch(tmp_path / "s.yaml", SVC % "99999" + "---\n" + NS_B + "---\n- not an object\n")
    with caplog.at_level(logging.ERROR):
        await source.scan()
    assert store.get(ObjectKey("Service", "a", "s")).value.ports[0].port == 80  # type: ignore[union-attr]
    assert names(store, "Namespace") == ["b"]
    assert "s.yaml object #1: Service a/s: spec.ports[0].port 99999 is not in 1-65535" in caplog.text
    assert "s.yaml object #3: expected a Kubernetes object (a map), got list" in caplog.text


async def test_lists_and_objects_defined_twice(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    source = ConfigDirSource(tmp_path, store)
    touch(tmp_path / "1.yaml", "kind: List\nitems:\n- {kind: Namespace, metadata: {name: a}}\n- {kind: Namespace, metadata: {name: b}}\n")
    await source.scan()
    touch(tmp_path / "2.yaml", NS_A)
    with caplog.at_level(logging.WARNING):
        await source.scan()
    assert "Namespace a is also defined in" in caplog.text
    (tmp_path / "1.yaml").unlink()  # 2.yaml owns `a` now, so it stays
    await source.scan()
    assert names(store, "Namespace") == ["a"]
