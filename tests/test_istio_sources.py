"""Istio's kinds come through the same config-dir path as Services: applied, refused when invalid
(the last good version keeps serving), deleted with their file, and listed by /debug/configz."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from istiod.model.builder import build_snapshot
from istiod.model.config.kinds import CONFIG_KINDS
from istiod.sources.configdir import ConfigDirSource
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store
from tests.peers import Istiod, wait_until
from tests.test_configdir import touch

VALID = Path(__file__).parent / "data" / "istio" / "valid.yaml"
VS = """apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: echo, namespace: demo}
spec:
  hosts: [echo]
  http: [{route: [{destination: {host: echo, subset: v1}, weight: %s}]}]
"""
VS_KEY = ObjectKey("VirtualService", "demo", "echo")


async def test_every_kind_is_read_from_the_config_dir(tmp_path: Path) -> None:
    shutil.copy(VALID, tmp_path / "istio.yaml")
    store = Store()
    await ConfigDirSource(tmp_path, store).scan()
    assert {o.key.kind for o in store.objects()} == {k.kind for k in CONFIG_KINDS}


async def test_invalid_object_is_logged_and_the_last_good_one_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    source = ConfigDirSource(tmp_path, store)
    touch(tmp_path / "empty.yaml", "")  # a dir with no YAML file at all reads as an unmounted volume
    touch(tmp_path / "vs.yaml", VS % 100)
    await source.scan()
    good = store.get(VS_KEY)
    assert good is not None and good.value.http[0].route[0].weight == 100

    touch(tmp_path / "vs.yaml", VS % -1)
    with caplog.at_level(logging.ERROR):
        await source.scan()
    assert store.get(VS_KEY) is good
    line = next(r.getMessage() for r in caplog.records if "VirtualService demo/echo" in r.getMessage())
    assert "vs.yaml" in line and "spec.http[0].route[0]: weight: -1 < 0" in line and "last good state" in line

    (tmp_path / "vs.yaml").unlink()
    await source.scan()
    assert store.get(VS_KEY) is None


def test_configz_lists_istio_objects(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    shutil.copy(VALID, mesh_dir / "istio.yaml")
    istiod = start_istiod(mesh_dir)

    def listed() -> set[str]:
        status, objects = istiod.get("/debug/configz")
        return {o["kind"] for o in objects} if status == 200 else set()

    wait_until(lambda: {k.kind for k in CONFIG_KINDS} <= listed(), 10, "every Istio kind in /debug/configz")
    (mesh_dir / "bad.yaml").write_text(VS % -1)
    wait_until(lambda: "VirtualService demo/echo" in istiod.log(), 10, "the refusal in istiod's log")
    assert "spec.http[0].route[0]: weight: -1 < 0" in istiod.log()


async def test_snapshot_carries_the_config(tmp_path: Path) -> None:
    shutil.copy(VALID, tmp_path / "istio.yaml")
    store = Store()
    await ConfigDirSource(tmp_path, store).scan()
    config = build_snapshot(store, "1").config
    assert [vs.meta.name for vs in config.virtual_services] == ["reviews"]
    assert [se.meta.name for se in config.service_entries] == ["external-api", "static-backend", "vms"]
    assert config.service_entries[2].workload_selector == (("app", "backend"),)
    assert len(config.peer_authentications) == 2 and config.peer_authentications[0].meta.namespace == "demo"


def test_push_status_and_log_name_the_config(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    istiod = start_istiod(mesh_dir)
    (mesh_dir / "vs.yaml").write_text(VS % 100)

    def configs() -> list[str]:
        status, push = istiod.get("/debug/push_status")
        return push.get("configs", []) if status == 200 and push else []

    wait_until(lambda: configs() == ["VirtualService/demo/echo"], 10, "the push that the VirtualService caused")
    assert "configs=VirtualService/demo/echo" in istiod.log()
