"""`istiod analyze [FILES...|--kubeconfig K]`: istiod's validation of every Istio object plus
istioctl analyze's cross-object checks; one line per finding (or `-o json`), exit 1 on any."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from istiod.model.config import ConfigSet
from istiod.model.config.analysis import Finding, analyze, schema_error
from istiod.model.config.kinds import BY_KIND
from istiod.model.mesh import MeshConfig
from istiod.sources.configdir import SUFFIXES, _expand_lists, _read_documents
from istiod.sources.convert import ConversionError, object_key
from istiod.sources.store import Store

# What the checks read from a cluster besides Istio's kinds.
_CLUSTER_KINDS = ("Namespace", "Service", "Pod")


class AnalyzeError(Exception):
    pass


def _files(paths: list[Path]) -> list[Path]:
    found = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        elif path.exists():
            found.append(path)
        else:
            raise AnalyzeError(f"{path}: no such file or directory")
    return found


def read_files(paths: list[Path]) -> list[dict[str, Any]]:
    objects = []
    for path in _files(paths):
        try:
            objects += [o for o in _expand_lists(_read_documents(path)) if isinstance(o, dict)]
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
            raise AnalyzeError(f"{path}: {' '.join(str(error).split())}") from None
    return objects


async def read_cluster(kubeconfig: Path) -> list[dict[str, Any]]:
    from istiod.kubeapi import api_client
    from istiod.sources.kube import API_ERRORS, Informer, describe_error, istio_list_calls, list_calls

    class Collect:
        def __init__(self) -> None:
            self.objects: list[dict[str, Any]] = []

        def replace(self, kind: str, items: list[dict[str, Any]]) -> None:
            self.objects += [{"kind": kind, **item} for item in items]

        def apply(self, body: dict[str, Any]) -> object:
            return None

        def delete(self, body: dict[str, Any]) -> None:
            pass

    collect = Collect()
    async with await api_client(kubeconfig) as api:
        calls = {k: c for k, c in list_calls(api).items() if k in _CLUSTER_KINDS} | istio_list_calls(api)
        for kind, call in calls.items():
            try:
                await Informer(kind, call, collect).relist()
            except API_ERRORS as error:
                if kind in BY_KIND and getattr(error, "status", None) == 404:
                    continue  # its CRD is not installed: no objects of it
                raise AnalyzeError(f"listing {kind}: {describe_error(error)}") from None
    return collect.objects


def findings(objects: list[dict[str, Any]], mesh: MeshConfig, domain: str) -> list[Finding]:
    store = Store(domain)
    found = []
    for body in objects:
        try:
            key = object_key(body)
        except ConversionError:
            continue  # not an object: nothing to analyze
        try:
            store.apply(body)
        except ConversionError as error:
            if key.kind in BY_KIND:  # other kinds are read for context only
                # The origin names the object: the message keeps only the field and the problem.
                found.append(schema_error(str(key), str(error).removeprefix(str(key)).lstrip(": ")))
    return sorted(found + analyze(ConfigSet.collect(store), store.values("Service"), store.values("Pod"),
                                  mesh.root_namespace))


def run(paths: list[Path], kubeconfig: Path | None, output: str, mesh: MeshConfig, domain: str) -> int:
    try:
        objects = asyncio.run(read_cluster(kubeconfig)) if kubeconfig else []
        objects += read_files(paths)  # files on top of the cluster, as istioctl analyze does
    except AnalyzeError as error:
        print(f"istiod analyze: {error}", file=sys.stderr)
        return 2
    found = findings(objects, mesh, domain)
    if output == "json":
        sys.stdout.write(json.dumps([f.json() for f in found], indent=2) + "\n")
    elif found:
        sys.stdout.write("".join(f.line() + "\n" for f in found))
    else:
        print("\u2714 No validation issues found when analyzing the given config.")
    return 1 if found else 0
