"""Chaining the `istio-cni` plugin into the node's CNI configuration, as Istio's install-cni does.

The primary network's config is `--cni-conf-name` in the CNI conf dir, or else the first
`.conf`/`.conflist`/`.json` file there by name (the one the runtime uses). Our entry goes last in its
`plugins` list; a single-plugin `.conf` becomes a `.conflist` (the `.conf` is removed). Every write
is atomic. The agent checks again every few seconds, since the primary CNI may rewrite its file,
and takes its entry out on shutdown. The plugin executable is written into the CNI bin dir.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from istiod.atomicfile import write_atomic

log = logging.getLogger(__name__)
PLUGIN_TYPE = "istio-cni"
SUFFIXES = (".conf", ".conflist", ".json")


class CniConfigError(Exception):
    """The primary config cannot be read as a CNI network configuration."""


@dataclass(frozen=True, slots=True)
class CniInstall:
    conf_dir: Path
    conf_name: str  # "" picks the runtime's: the first config file by name
    bin_dir: Path | None  # where the plugin executable goes; None leaves it to the operator
    plugin_conf: tuple[tuple[str, Any], ...]  # our entry's keys, beside "type"

    def entry(self) -> dict[str, Any]:
        return {"type": PLUGIN_TYPE, **dict(self.plugin_conf)}

    def primary(self) -> Path | None:
        if self.conf_name:
            named = self.conf_dir / self.conf_name
            # Like Istio: a .conf we already turned into a .conflist is found under its new name.
            return next((p for p in (named, named.with_suffix(".conflist")) if p.is_file()), None)
        try:
            files = sorted(p for p in self.conf_dir.iterdir() if p.suffix in SUFFIXES and p.is_file())
        except FileNotFoundError:
            return None
        return files[0] if files else None

    def install(self) -> Path | None:
        """Make sure our entry is in the primary config; its path, or None while there is none."""
        path = self.primary()
        if path is None:
            return None
        config = _read(path)
        wanted = chained(config, self.entry())
        target = path.with_suffix(".conflist") if path.suffix == ".conf" else path
        if target != path or wanted != config:
            write_atomic(target, (json.dumps(wanted, indent=2) + "\n").encode())
            if target != path:
                path.unlink()
            log.info("CNI config %s: %s chained", target, PLUGIN_TYPE)
        return target

    def uninstall(self) -> None:
        path = self.primary()
        if path is None:
            return
        try:
            config = _read(path)
        except CniConfigError as error:
            log.error("%s; not removing %s from it", error, PLUGIN_TYPE)
            return
        plugins = config.get("plugins")
        if isinstance(plugins, list) and any(_ours(p) for p in plugins):
            config["plugins"] = [p for p in plugins if not _ours(p)]
            write_atomic(path, (json.dumps(config, indent=2) + "\n").encode())
            log.info("CNI config %s: %s removed", path, PLUGIN_TYPE)

    def install_binary(self) -> None:
        """The executable the runtime runs as `istio-cni`: this Python running istiod.cni.plugin."""
        if self.bin_dir is None:
            return
        script = f'#!/bin/sh\nexec "{sys.executable}" -m istiod.cni.plugin "$@"\n'
        path = self.bin_dir / PLUGIN_TYPE
        if not path.is_file() or path.read_text() != script:
            write_atomic(path, script.encode(), mode=0o755)
            log.info("CNI plugin %s written", path)

    async def keep_installed(self, interval: float = 2.0) -> None:
        waiting = ""
        while True:
            try:
                path = self.install()
                problem = "" if path else f"no CNI config in {self.conf_dir} yet; waiting for the primary CNI"
            except (CniConfigError, OSError) as error:
                problem = str(error)
            if problem and problem != waiting:
                log.warning("%s", problem)
            waiting = problem
            await asyncio.sleep(interval)


def chained(config: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """`config` as a plugin list ending with `entry` (any earlier entry of ours replaced). Pure."""
    if isinstance(config.get("plugins"), list):
        plugins = [p for p in config["plugins"] if not _ours(p)]
        return {**config, "plugins": [*plugins, entry]}
    # A single-plugin .conf: its network name and version lead the list.
    return {"cniVersion": config.get("cniVersion", "0.3.1"), "name": config.get("name", "k8s-pod-network"),
            "plugins": [config, entry]}


def _ours(plugin: Any) -> bool:
    return isinstance(plugin, dict) and plugin.get("type") == PLUGIN_TYPE


def _read(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CniConfigError(f"CNI config {path}: {error}") from None
    if not isinstance(config, dict) or not (isinstance(config.get("plugins"), list) or isinstance(config.get("type"), str)):
        raise CniConfigError(f"CNI config {path}: neither a plugin list (`plugins`) nor a plugin (`type`)")
    return config
