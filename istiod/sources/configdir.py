"""Config-dir source: Kubernetes YAML files in a directory, watched by polling.

Every `*.yaml`/`*.yml` below the directory is read as multi-document YAML (a `kind: List` is
expanded). A file that does not parse keeps its objects' last good state; an object that does not
convert is logged with its file and skipped, keeping its own last good state.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from istiod.logs import one_line
from istiod.sources.convert import ConversionError, ObjectKey, object_key
from istiod.sources.store import Store

log = logging.getLogger(__name__)
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
SUFFIXES = (".yaml", ".yml")


@dataclass
class _FileState:
    signature: tuple[int, int, int]
    keys: set[ObjectKey] = field(default_factory=set)


class ConfigDirSource:
    def __init__(self, root: Path, store: Store, poll_interval: float = 0.25) -> None:
        self.root = root
        self.store = store
        self.poll_interval = poll_interval
        self.synced = asyncio.Event()
        self._files: dict[Path, _FileState] = {}
        self._owner: dict[ObjectKey, Path] = {}

    async def run(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception:  # the watcher must outlive any one bad scan
                log.exception("config dir %s: scan failed; keeping the last good state", self.root)
            self.synced.set()
            await asyncio.sleep(self.poll_interval)

    async def scan(self) -> None:
        """Apply every file added, changed or removed since the last scan."""
        seen = await asyncio.to_thread(lambda: dict(_yaml_files(self.root)))  # walking and stats stay off the loop
        for path in sorted(set(self._files) - set(seen)):
            log.info("config file %s removed", path)
            self._retire(path, self._files.pop(path).keys)
        for path, signature in sorted(seen.items()):
            state = self._files.get(path)
            if state is not None and state.signature == signature:
                continue
            try:
                documents = await asyncio.to_thread(_read_documents, path)
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
                log.error("config file %s: %s; keeping its last good objects", path, one_line(error))
                if state is not None:
                    state.signature = signature
                else:
                    self._files[path] = _FileState(signature)
                continue
            old_keys = state.keys if state is not None else set()
            self._files[path] = _FileState(signature, self._apply(path, documents, old_keys))

    def _apply(self, path: Path, documents: list[Any], old_keys: set[ObjectKey]) -> set[ObjectKey]:
        keys: set[ObjectKey] = set()
        for index, body in enumerate(_expand_lists(documents)):
            where = f"config file {path} object #{index + 1}"
            try:
                key = object_key(body)
            except ConversionError as error:
                log.error("%s: %s; skipped", where, error)
                continue
            keys.add(key)  # even if it fails to convert: its last good state stays, not deleted
            owner = self._owner.get(key)
            if owner is not None and owner != path and owner in self._files:
                log.warning("%s: %s is also defined in %s; this one wins", where, key, owner)
                self._files[owner].keys.discard(key)
            self._owner[key] = path
            try:
                self.store.apply(body)
            except ConversionError as error:
                log.error("%s: %s; skipped, keeping its last good state", where, error)
        self._retire(path, old_keys - keys)
        return keys

    def _retire(self, path: Path, keys: set[ObjectKey]) -> None:
        for key in keys:
            if self._owner.get(key) == path:
                del self._owner[key]
                self.store.delete(key)


def _yaml_files(root: Path) -> Iterator[tuple[Path, tuple[int, int, int]]]:
    for directory, _, names in os.walk(root):
        for name in names:
            if name.endswith(SUFFIXES) and not name.startswith("."):
                path = Path(directory, name)
                try:
                    stat = path.stat()
                except OSError:
                    continue  # removed between the listing and the stat
                yield path, (stat.st_mtime_ns, stat.st_size, stat.st_ino)


def _read_documents(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as stream:
        return [doc for doc in yaml.load_all(stream, Loader=_Loader) if doc is not None]


def _expand_lists(documents: list[Any]) -> Iterator[Any]:
    for doc in documents:
        if isinstance(doc, Mapping) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            yield from doc["items"]
        else:
            yield doc
