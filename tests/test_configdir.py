"""The config-dir source: adds, edits, deletions, and whatever cannot be read keeps the last good state."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from istiod.sources import configdir
from istiod.sources.configdir import ConfigDirSource, _read_documents
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Change, EventType, Store
from istiod.sources.yamldocs import LimitError
from tests.peers import eventually

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


def count_errors(type: str) -> float:
    return REGISTRY.get_sample_value("pilot_config_dir_errors_total", {"type": type}) or 0.0


async def test_missing_or_empty_dir_keeps_the_last_good_state(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`rm -rf d && cp -r new d`, an unmounted volume: never read as "no objects"."""
    root = tmp_path / "d"
    root.mkdir()
    store = Store()
    source = ConfigDirSource(root, store)
    touch(root / "ns.yaml", NS_A + "---\n" + NS_B)
    await source.scan()
    before = count_errors("dir"), count_errors("empty_dir")
    with caplog.at_level(logging.INFO):
        shutil.rmtree(root)
        await source.scan()
        assert names(store, "Namespace") == ["a", "b"]
        root.write_text("not a directory")  # unreadable as a directory
        await source.scan()
        root.unlink()
        root.mkdir()  # back, but empty: an unmounted volume's mount point
        await source.scan()
        assert names(store, "Namespace") == ["a", "b"]
        assert (count_errors("dir") - before[0], count_errors("empty_dir") - before[1]) == (2, 1)
        assert f"config dir {root}: No such file or directory; keeping the last good state" in caplog.text
        assert f"config dir {root}: Not a directory; keeping the last good state" in caplog.text
        assert f"config dir {root} has no YAML file (an unmounted volume?); keeping the last good state" in caplog.text
        touch(root / "ns.yaml", NS_A)  # the new contents apply when it is back
        await source.scan()
    assert names(store, "Namespace") == ["a"]
    assert "resolved: config dir" in caplog.text


async def test_unreadable_entries_keep_their_objects(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "d"
    (root / "sub").mkdir(parents=True)
    store = Store()
    source = ConfigDirSource(root, store)
    touch(root / "sub" / "ns.yaml", NS_A)
    volume = tmp_path / "volume"  # a file on another volume, which is then unmounted
    volume.mkdir()
    touch(volume / "ns.yaml", NS_B)
    (root / "b.yaml").symlink_to(volume / "ns.yaml")
    await source.scan()
    assert names(store, "Namespace") == ["a", "b"]

    shutil.rmtree(root / "sub")
    (root / "sub").symlink_to("loop")  # a symlink loop where the directory was
    (root / "loop").symlink_to("sub")
    shutil.rmtree(volume)
    with caplog.at_level(logging.ERROR):
        await source.scan()
    assert names(store, "Namespace") == ["a", "b"]
    assert f"config dir entry {root / 'sub'}: Too many levels of symbolic links" in caplog.text
    assert f"config dir entry {root / 'b.yaml'}: a symlink whose target is missing" in caplog.text

    (root / "b.yaml").unlink()  # the link itself removed: now `b` goes
    await source.scan()
    assert names(store, "Namespace") == ["a"]


async def test_special_files_never_block(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    source = ConfigDirSource(tmp_path, store)
    os.mkfifo(tmp_path / "fifo.yaml")
    touch(tmp_path / "ns.yaml", NS_A)
    with caplog.at_level(logging.ERROR):
        await asyncio.wait_for(source.scan(), 10)
    assert names(store, "Namespace") == ["a"]
    assert f"config dir entry {tmp_path / 'fifo.yaml'}: not a regular file; skipped" in caplog.text
    # A FIFO put in place between the listing and the read: the read refuses it at once.
    with pytest.raises(LimitError, match="not a regular file"):
        await asyncio.wait_for(asyncio.to_thread(_read_documents, tmp_path / "fifo.yaml"), 10)


async def test_hung_reads_are_given_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """A read that never returns (a dead network mount) fails after a timeout, keeps the file's
    objects, and is left to a daemon thread, which istiod's exit does not wait for."""
    store = Store()
    source = ConfigDirSource(tmp_path, store)
    touch(tmp_path / "ns.yaml", NS_A)
    await source.scan()
    hang = threading.Event()
    monkeypatch.setattr(configdir, "IO_TIMEOUT", 0.5)
    monkeypatch.setattr(configdir, "_read_documents", lambda path: hang.wait(60))
    touch(tmp_path / "ns.yaml", NS_B)
    try:
        with caplog.at_level(logging.ERROR):
            await asyncio.wait_for(source.scan(), 10)
        assert names(store, "Namespace") == ["a"]
        assert f"config file {tmp_path / 'ns.yaml'}: reading took longer than 0.5s; keeping its last good objects" in caplog.text
        assert all(t.daemon for t in threading.enumerate() if t.name == "config-dir-io")
    finally:
        hang.set()


HUNG_READ = """
import asyncio, sys, threading
from pathlib import Path
from istiod.sources import configdir
from istiod.sources.store import Store
configdir._read_documents = lambda path: threading.Event().wait()  # a read that never returns

async def main() -> None:
    task = asyncio.create_task(configdir.ConfigDirSource(Path(sys.argv[1]), Store()).run())
    await asyncio.sleep(1)
    task.cancel()  # what SIGTERM does to istiod's tasks
    await asyncio.gather(task, return_exceptions=True)

asyncio.run(main())
"""


def test_a_hung_read_does_not_hold_up_exit(tmp_path: Path) -> None:
    touch(tmp_path / "ns.yaml", NS_A)
    try:
        subprocess.run([sys.executable, "-c", HUNG_READ, str(tmp_path)], timeout=20, check=True)
    except subprocess.TimeoutExpired:
        raise AssertionError("the process waited for a hung read at exit") from None


async def test_symlinks_are_followed_and_loops_stopped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    source = ConfigDirSource(tmp_path / "d", store)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "up").symlink_to("..")  # a directory loop
    (tmp_path / "d" / "x.yaml").symlink_to("y.yaml")  # a file loop
    (tmp_path / "d" / "y.yaml").symlink_to("x.yaml")
    (tmp_path / "other").mkdir()
    touch(tmp_path / "other" / "ns.yaml", NS_A)
    (tmp_path / "d" / "linked").symlink_to(tmp_path / "other")
    (tmp_path / "d" / "same.yaml").symlink_to(tmp_path / "other" / "ns.yaml")  # one file, two paths
    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(source.scan(), 10)
    assert names(store, "Namespace") == ["a"]
    assert "Too many levels of symbolic links" in caplog.text
    assert "also defined" not in caplog.text


def configmap_version(root: Path, stamp: str, files: dict[str, str]) -> None:
    """What the kubelet does on a ConfigMap update: a new timestamped dir, `..data` swapped to it
    atomically, the old dir removed; each key is a symlink through `..data`."""
    new = root / f"..2026_12_03_00_00_{stamp}.000000001"
    new.mkdir()
    for name, text in files.items():
        (new / name).write_text(text)
        if not (root / name).is_symlink():
            (root / name).symlink_to(Path("..data") / name)
    old = (root / "..data").resolve() if (root / "..data").exists() else None
    (root / "..data_tmp").symlink_to(new.name)
    os.rename(root / "..data_tmp", root / "..data")
    if old is not None:
        shutil.rmtree(old)


async def test_configmap_mount_is_read_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    changes: list[Change] = []
    store.subscribe(changes.append)
    source = ConfigDirSource(tmp_path, store)
    configmap_version(tmp_path, "01", {"mesh.yaml": NS_A + "---\n" + SVC % 80})
    with caplog.at_level(logging.WARNING):
        await source.scan()
    assert "also defined" not in caplog.text
    configmap_version(tmp_path, "02", {"mesh.yaml": NS_A + "---\n" + SVC % 81})
    await source.scan()
    assert store.get(ObjectKey("Service", "a", "s")).value.ports[0].port == 81  # type: ignore[union-attr]
    assert [c.type for c in changes] == [EventType.ADDED, EventType.ADDED, EventType.UPDATED]
    assert "also defined" not in caplog.text


async def test_other_definition_takes_over(tmp_path: Path) -> None:
    store = Store()
    source = ConfigDirSource(tmp_path, store)
    labelled = "kind: Namespace\nmetadata: {name: a, labels: {from: '%s'}}\n"
    touch(tmp_path / "1.yaml", labelled % 1)
    touch(tmp_path / "2.yaml", labelled % 2 + "---\n" + NS_B)
    touch(tmp_path / "3.yaml", labelled % 3)
    await source.scan()
    (tmp_path / "3.yaml").unlink()  # the winner goes: the last other definition by path takes over
    await source.scan()
    assert store.get(ObjectKey("Namespace", "", "a")).value.labels == (("from", "2"),)  # type: ignore[union-attr]
    touch(tmp_path / "2.yaml", NS_B)  # the new winner drops it
    await source.scan()
    assert store.get(ObjectKey("Namespace", "", "a")).value.labels == (("from", "1"),)  # type: ignore[union-attr]
    (tmp_path / "1.yaml").unlink()
    await source.scan()
    assert names(store, "Namespace") == ["b"]


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


async def test_alias_bombs_are_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    source = ConfigDirSource(tmp_path, store)
    touch(tmp_path / "ns.yaml", NS_A)
    await source.scan()
    touch(tmp_path / "ns.yaml", "kind: Namespace\nmetadata: {name: a, labels: {x: y}}\nspec:\n"
          + "".join("  " + line + "\n" for line in BILLION_LAUGHS.splitlines()))
    touch(tmp_path / "cycle.yaml", "kind: Namespace\nmetadata: {name: c}\nspec: &s {self: *s}\n")
    with caplog.at_level(logging.ERROR):
        await asyncio.wait_for(source.scan(), 10)
    assert names(store, "Namespace") == ["a"] and store.get(ObjectKey("Namespace", "", "a")).raw.get("spec") is None  # type: ignore[union-attr]
    assert caplog.text.count("it expands to more than") == 2
    anchors = "kind: Namespace\nmetadata: {name: a, labels: &l {app: x}, annotations: *l}\n"
    touch(tmp_path / "ns.yaml", anchors)  # anchors as people use them are fine
    await source.scan()
    assert store.get(ObjectKey("Namespace", "", "a")).value.labels == (("app", "x"),)  # type: ignore[union-attr]


async def test_file_events_apply_without_polling(tmp_path: Path) -> None:
    """inotify wakes the source: with polling and resync an hour apart, changes still apply at once,
    and so does a directory removed and copied back (`rm -rf d && cp -r new d`)."""
    root = tmp_path / "d"
    root.mkdir()
    touch(root / "ns.yaml", NS_A)
    store = Store()
    source = ConfigDirSource(root, store, poll_interval=3600, resync=3600)
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(source.synced.wait(), 10)
        (root / "sub").mkdir()
        touch(root / "sub" / "ns.yaml", NS_B)
        await eventually(lambda: names(store, "Namespace") == ["a", "b"], 5, "a new file in a new dir")
        new = tmp_path / "new"
        new.mkdir()
        touch(new / "svc.yaml", SVC % 80)
        touch(new / "ns.yaml", NS_A)
        shutil.rmtree(root)
        shutil.copytree(new, root)
        await eventually(lambda: names(store, "Service") == ["s"] and names(store, "Namespace") == ["a"], 5,
                         "the replaced directory's contents")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_file_events_for_a_relative_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # `--config-dir .`: its parent is watched too, its own events still count
    store = Store()
    source = ConfigDirSource(Path("."), store, poll_interval=3600, resync=3600)
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(source.synced.wait(), 10)
        touch(tmp_path / "ns.yaml", NS_A)
        await eventually(lambda: names(store, "Namespace") == ["a"], 5, "a new file")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_configmap_update_is_seen_by_file_events(tmp_path: Path) -> None:
    store = Store()
    configmap_version(tmp_path, "01", {"mesh.yaml": SVC % 80})
    source = ConfigDirSource(tmp_path, store, poll_interval=3600, resync=3600)
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(source.synced.wait(), 10)
        configmap_version(tmp_path, "02", {"mesh.yaml": SVC % 81})
        key = ObjectKey("Service", "a", "s")
        await eventually(lambda: store.get(key).value.ports[0].port == 81, 5, "the swapped ..data")  # type: ignore[union-attr]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


_FD_EXHAUSTION = """
import asyncio, os, resource, sys
from pathlib import Path
from istiod.sources.configdir import ConfigDirSource
from istiod.sources.store import Store

async def main(root: Path) -> None:
    store = Store()
    source = ConfigDirSource(root, store)
    await source.scan()
    before = sorted(o.key.name for o in store.objects())
    os.utime(root / "svc.yaml", ns=(1, 1))  # changed: it must be read again
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    await source.scan()
    during = sorted(o.key.name for o in store.objects())
    for fd in held:
        os.close(fd)
    await source.scan()
    print(before, during, sorted(o.key.name for o in store.objects()))

asyncio.run(main(Path(sys.argv[1])))
"""


def test_running_out_of_fds_never_reads_as_files_removed(tmp_path: Path) -> None:
    touch(tmp_path / "ns.yaml", NS_A)
    touch(tmp_path / "svc.yaml", SVC % 80)
    result = subprocess.run([sys.executable, "-c", _FD_EXHAUSTION, str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    print(result.stdout.strip(), result.stderr.strip()[-500:])
    assert result.returncode == 0, result.stderr
    # before, while every fd is taken, and after they are free again: the same objects.
    assert result.stdout.strip() == "['a', 's'] ['a', 's'] ['a', 's']"
