"""Where the injector config comes from: a directory holding `config` and `values` (the ConfigMap
mounted as a volume, as istiod's /var/lib/istio/inject), read at start; or, in a cluster, the
ConfigMap `istio-sidecar-injector` (a revision's: `istio-sidecar-injector-<rev>`) in istiod's namespace,
watched. A bad edit keeps the last good one."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from istiod.sources.kube import Informer
from istiod.webhooks.injection import CONFIGMAP, InjectionError, Injector, parse_injector

log = logging.getLogger(__name__)


def read_injection_dir(directory: Path) -> Injector:
    """InjectionError naming the file or field."""
    try:
        config, values = ((directory / key).read_text(encoding="utf-8") for key in ("config", "values"))
    except OSError as error:
        raise InjectionError(f"{error.filename}: {error.strerror or error}") from None
    return parse_injector(config, values, str(directory))


class InjectorConfigMapWatcher:
    """An informer's writer for the one ConfigMap; `current` is what /inject uses."""

    def __init__(self, api: client.ApiClient, namespace: str, watch_timeout: int = 300, name: str = CONFIGMAP) -> None:
        self.namespace, self.name = namespace, name
        self.current: Injector | None = None
        core = client.CoreV1Api(api)
        call = functools.partial(core.list_namespaced_config_map, namespace, field_selector=f"metadata.name={name}")
        self.informer = Informer("ConfigMap", call, self, watch_timeout)

    def apply(self, body: dict[str, Any]) -> object:
        data = body.get("data") or {}
        try:
            self.current = parse_injector(data.get("config", ""), data.get("values", ""),
                                          f"ConfigMap {self.namespace}/{self.name}")
        except InjectionError as error:
            log.error("%s; keeping the last good injector config", error)
        return None

    def delete(self, body: dict[str, Any]) -> None:
        log.warning("ConfigMap %s/%s deleted: sidecar injection is refused until it exists", self.namespace, self.name)
        self.current = None

    def replace(self, kind: str, items: list[dict[str, Any]]) -> None:
        if items:
            self.apply(items[0])
        else:
            self.current = None
