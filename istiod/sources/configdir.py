"""Config-dir source: Kubernetes YAML files in a directory, watched with inotify and a slow resync.

Every `*.yaml`/`*.yml` below the directory is read as multi-document YAML (a `kind: List` is
expanded). Names starting with a dot are skipped: a kubelet-mounted ConfigMap shows each key as
`key -> ..data/key` with `..data -> ..2026_12_03_...`, so each key is read once, by the name the
kubelet presents. Symlinks are followed, loops stopped, and a file reached by two paths read once.

Like Istio's file monitor, any file event under the directory (or the directory itself coming or
going) triggers a rescan after a short quiet time, and a slow resync catches what events miss
(files outside the tree behind symlinks, file systems without events). Without inotify, it polls.

Whatever cannot be read keeps the last good state, is logged when it starts and when it ends, and is
counted in pilot_config_dir_errors{type}:
- the directory is missing, unreadable, or holds no YAML file at all (an unmounted volume, or a
  directory being replaced): nothing changes until it is back, and its new contents are applied then;
- a subdirectory or file cannot be read, is not a regular file (FIFOs are never opened for a blocking
  read), is too large, or does not parse: its objects keep their last good state;
- an object does not convert: it keeps its last good state.
An object defined in several files is served from the last of them to change; when that file drops
it, another file's definition (the last by path) takes over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from asyncinotify import Inotify, Mask

from istiod import metrics
from istiod.logs import one_line
from istiod.sources.convert import ConversionError, ObjectKey, object_key
from istiod.sources.store import Store
from istiod.sources.yamldocs import LimitError, load_documents

log = logging.getLogger(__name__)
SUFFIXES = (".yaml", ".yml")
MAX_FILE_BYTES = 32 << 20  # far above any config file; a ConfigMap holds at most 1 MiB
RESYNC = 30.0  # seconds between full rescans when file events work
DEBOUNCE = 0.1  # quiet time after the last event before a rescan ...
DEBOUNCE_MAX = 1.0  # ... but never longer than this after the first
IO_TIMEOUT = 60.0  # a listing, or a file's read and parse, that takes longer is given up as failed
_DIR_EVENTS = (Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.MODIFY | Mask.CLOSE_WRITE
               | Mask.ATTRIB | Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.ONLYDIR)
_PARENT_EVENTS = Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.ATTRIB | Mask.ONLYDIR

# (mtime, ctime, size, inode, device): ctime moves on chmod too, so a file made readable is re-read.
Signature = tuple[int, int, int, int, int]
T = TypeVar("T")


@dataclass
class _FileState:
    signature: Signature
    keys: set[ObjectKey] = field(default_factory=set)


@dataclass
class _Listing:
    files: dict[Path, Signature]
    problems: dict[Path, str]  # entries that could not be read now, and why: what is below them is kept


class ConfigDirSource:
    def __init__(self, root: Path, store: Store, poll_interval: float = 0.25, resync: float = RESYNC) -> None:
        self.root = root
        self.store = store
        self.poll_interval = poll_interval
        self.resync = resync
        self.synced = asyncio.Event()
        self._files: dict[Path, _FileState] = {}
        self._owner: dict[ObjectKey, Path] = {}
        self._definitions: dict[ObjectKey, dict[Path, Mapping[str, Any]]] = {}  # every file's body of a key
        self._problems: dict[Path, str] = {}  # reported and not yet resolved
        self._watcher: _Watcher | None = None

    async def run(self) -> None:
        self._watcher = watcher = _Watcher(self.root)
        try:
            while True:
                try:
                    await self.scan()
                except Exception:  # the watcher must outlive any one bad scan
                    log.exception("config dir %s: scan failed; keeping the last good state", self.root)
                await watcher.wait(self.resync if watcher.active else self.poll_interval)
        finally:
            self._watcher = None
            watcher.close()

    async def scan(self) -> None:
        """Apply every file added, changed or removed since the last scan."""
        watcher = self._watcher
        try:
            listing = await _io(lambda: _list(self.root, watcher.add if watcher else None), "listing the dir")
        except OSError as error:
            listing = None
            self._track({self.root: ("dir", f"config dir {self.root}: {_reason(error)}")})
        if watcher is not None:
            watcher.walked()
        if listing is None:
            return
        if not listing.files and not listing.problems and self._files:
            self._track({self.root: ("empty_dir", f"config dir {self.root} has no YAML file (an unmounted volume?)")})
            return
        self._track({p: ("entry", f"config dir entry {p}: {why}") for p, why in listing.problems.items()})
        for path in sorted(set(self._files) - set(listing.files)):
            if not any(p == path or p in path.parents for p in listing.problems):
                log.info("config file %s removed", path)
                self._retire(path, self._files.pop(path).keys)
        for path, signature in sorted(listing.files.items()):
            state = self._files.get(path)
            if state is not None and state.signature == signature:
                continue
            try:
                documents = await _io(lambda: _read_documents(path), "reading")
            except (OSError, UnicodeDecodeError, yaml.YAMLError, LimitError) as error:
                metrics.CONFIG_DIR_ERRORS.labels(type="file").inc()
                log.error("config file %s: %s; keeping its last good objects", path, one_line(error))
                if state is not None:
                    state.signature = signature
                else:
                    self._files[path] = _FileState(signature)
                continue
            if state is None:
                state = self._files[path] = _FileState(signature)
            state.signature = signature
            self._apply(path, state, documents)
        self.synced.set()

    def _apply(self, path: Path, state: _FileState, documents: list[Any]) -> None:
        keys: set[ObjectKey] = set()
        for index, body in enumerate(_expand_lists(documents)):
            where = f"config file {path} object #{index + 1}"
            try:
                key = object_key(body)
            except ConversionError as error:
                metrics.CONFIG_DIR_ERRORS.labels(type="object").inc()
                log.error("%s: %s; skipped", where, error)
                continue
            keys.add(key)  # even if it fails to convert: its last good state stays, not deleted
            owner = self._owner.get(key)
            if owner is not None and owner != path:
                log.warning("%s: %s is also defined in %s; this one wins", where, key, owner)
            self._owner[key] = path
            self._definitions.setdefault(key, {})[path] = body
            self._store(where, body)
        old, state.keys = state.keys, keys
        self._retire(path, old - keys)

    def _retire(self, path: Path, keys: set[ObjectKey]) -> None:
        """`path` no longer defines `keys`: each goes, unless another file defines it too."""
        for key in sorted(keys):
            definitions = self._definitions.get(key, {})
            definitions.pop(path, None)
            if self._owner.get(key) != path:
                continue
            if definitions:
                other = max(definitions)
                log.info("%s: no longer defined in %s; the definition in %s takes over", key, path, other)
                self._owner[key] = other
                self._store(f"config file {other}", definitions[other])
            else:
                del self._owner[key]
                self._definitions.pop(key, None)
                self.store.delete(key)

    def _store(self, where: str, body: Mapping[str, Any]) -> None:
        try:
            self.store.apply(body)
        except ConversionError as error:
            metrics.CONFIG_DIR_ERRORS.labels(type="object").inc()
            log.error("%s: %s; skipped, keeping its last good state", where, error)

    def _track(self, problems: dict[Path, tuple[str, str]]) -> None:
        """This scan's problems, by path: (metric type, message). Each is counted on every scan, so
        an alert sees it persist, and logged when it starts and when it ends."""
        for path, (type, message) in problems.items():
            metrics.CONFIG_DIR_ERRORS.labels(type=type).inc()
            if self._problems.get(path) != message:
                log.error("%s; keeping the last good state", message)
                self._problems[path] = message
        for path in set(self._problems) - set(problems):
            message = self._problems.pop(path)
            if self.root not in problems:  # else not looked at, so not known to be fixed
                log.info("resolved: %s", message)


class _Watcher:
    """inotify on every directory the last scan walked, and on the root's parent (the root itself
    may go and come back); any event wakes the source. Without inotify, or out of watches, it is
    inactive and the source polls."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))  # so that `.` has a parent to watch
        self.active = False
        self._wake = asyncio.Event()
        self._walked: set[int] = set()
        self._watched: dict[int, Any] = {}  # wd -> asyncinotify Watch
        self._parent_wd = -1
        self._reader: asyncio.Task[None] | None = None
        try:
            self._inotify: Inotify | None = Inotify()
        except OSError as error:  # e.g. fs.inotify.max_user_instances reached
            log.warning("config dir %s: no file events (%s); polling instead", root, _reason(error))
            self._inotify = None
            return
        self.active = True
        self._reader = asyncio.create_task(self._read(), name="config-dir-events")

    def add(self, directory: Path) -> None:
        """Watch one directory; called by the listing, before it reads the directory, so nothing
        created in between is missed. Runs in the listing's thread."""
        if self._inotify is None:
            return
        if os.path.abspath(directory) == str(self.root):
            self._watch_parent()
        try:
            watch = self._inotify.add_watch(directory, _DIR_EVENTS)
        except (FileNotFoundError, NotADirectoryError):
            return  # gone: the listing will say so
        except OSError as error:  # ENOSPC: fs.inotify.max_user_watches reached
            if self.active:
                log.warning("config dir %s: cannot watch %s (%s); polling instead", self.root, directory,
                            _reason(error))
                self.active = False
            return
        self._walked.add(watch.wd)
        self._watched[watch.wd] = watch

    def _watch_parent(self) -> None:
        assert self._inotify is not None
        if self.root.parent == self.root:
            return  # `/` has no parent
        try:
            self._parent_wd = self._inotify.add_watch(self.root.parent, _PARENT_EVENTS).wd
        except OSError:
            self._parent_wd = -1  # the resync still finds the root when it comes back

    def walked(self) -> None:
        """After a listing: stop watching directories it no longer reached."""
        for wd in set(self._watched.copy()) - self._walked.copy():  # copies: a listing given up may still add
            watch = self._watched.pop(wd)
            try:
                if self._inotify is not None:
                    self._inotify.rm_watch(watch)
            except OSError:
                pass  # already gone with its directory
        self._walked = set()

    async def _read(self) -> None:
        assert self._inotify is not None
        try:
            async for event in self._inotify:
                watch = event.watch
                if watch is not None and watch.wd == self._parent_wd and event.name != Path(self.root.name):
                    continue  # a sibling of the root
                self._wake.set()
        except OSError as error:
            log.warning("config dir %s: file events failed (%s); polling instead", self.root, _reason(error))
            self.active = False
            self._wake.set()

    async def wait(self, timeout: float) -> None:
        """Until files change and then stay quiet for DEBOUNCE (DEBOUNCE_MAX at most), or timeout."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            return
        deadline = asyncio.get_running_loop().time() + DEBOUNCE_MAX
        while True:
            self._wake.clear()
            quiet = min(DEBOUNCE, deadline - asyncio.get_running_loop().time())
            if quiet <= 0:
                return
            try:
                await asyncio.wait_for(self._wake.wait(), quiet)
            except TimeoutError:
                return

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None


def _list(root: Path, watch: Callable[[Path], None] | None) -> _Listing:
    """Every YAML file below root and what could not be read; raises OSError when root cannot be."""
    listing = _Listing({}, {})
    top = os.stat(root)
    seen_dirs = {(top.st_dev, top.st_ino)}
    seen_files: set[tuple[int, int]] = set()
    pending = [root]
    while pending:
        directory = pending.pop()
        if watch is not None:
            watch(directory)
        try:
            with os.scandir(directory) as scan:
                names = sorted(entry.name for entry in scan if not entry.name.startswith("."))
        except FileNotFoundError:
            if directory == root:
                raise
            continue  # removed while we walked: its files are gone
        except OSError as error:
            if directory == root:
                raise
            listing.problems[directory] = _reason(error)
            continue
        subdirectories = []
        for name in names:
            path = directory / name
            try:
                info = os.stat(path)  # through symlinks
            except FileNotFoundError:
                if os.path.islink(path):  # its target gone, maybe with an unmounted volume: keep what it had
                    listing.problems[path] = "a symlink whose target is missing"
                continue  # else removed
            except OSError as error:  # ELOOP for a symlink loop, EACCES below an unreadable dir
                listing.problems[path] = _reason(error)
                continue
            identity = (info.st_dev, info.st_ino)
            if stat.S_ISDIR(info.st_mode):
                if identity not in seen_dirs:  # else a link back up the tree, or a second way in
                    seen_dirs.add(identity)
                    subdirectories.append(path)
            elif name.endswith(SUFFIXES):
                if not stat.S_ISREG(info.st_mode):
                    listing.problems[path] = "not a regular file; skipped"
                elif identity not in seen_files:
                    seen_files.add(identity)
                    listing.files[path] = (info.st_mtime_ns, info.st_ctime_ns, info.st_size, info.st_ino, info.st_dev)
        pending.extend(reversed(subdirectories))
    return listing


def _read_documents(path: Path) -> list[Any]:
    # Non-blocking open: a FIFO put in place since the listing must not hang the read.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as stream:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LimitError("not a regular file")
        data = stream.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise LimitError(f"larger than {MAX_FILE_BYTES} bytes; refused")
    return load_documents(data.decode("utf-8"))


async def _io(work: Callable[[], T], what: str) -> T:
    """Blocking file work in a daemon thread, given up after IO_TIMEOUT (TimeoutError, an OSError):
    a read that hangs (a dead network mount) must hold up neither the source for ever nor istiod's
    exit, which waits for asyncio.to_thread's threads but not for daemon threads."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (work(), None)
        except BaseException as error:  # handed to the awaiting task
            outcome = (None, error)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    threading.Thread(target=run, name="config-dir-io", daemon=True).start()
    try:
        return await asyncio.wait_for(future, IO_TIMEOUT)
    except TimeoutError:
        raise TimeoutError(f"{what} took longer than {IO_TIMEOUT:g}s") from None


def _expand_lists(documents: list[Any]) -> Iterator[Any]:
    for doc in documents:
        if isinstance(doc, Mapping) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            yield from doc["items"]
        else:
            yield doc


def _reason(error: OSError) -> str:
    return error.strerror or str(error)
