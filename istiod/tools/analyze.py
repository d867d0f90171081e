"""`istiod analyze [FILES...] [--kubeconfig K]`: istioctl analyze's messages (codes, levels, texts,
order, exit codes) for files alone (`istioctl analyze --use-kube=false`) or for a cluster with the
files on top. Validation errors are istiod's own (IST0106, texts differ from Istio's)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from istiod.model.config.analysis import (
    DOCS, ERROR, IGNORED_NAMESPACES, KUBE_KINDS, Message, Objects, Resource, analyze, schema_error, selected,
)
from istiod.model.config.kinds import BY_KIND
from istiod.sources.configdir import SUFFIXES, _expand_lists
from istiod.sources.convert import ConversionError, convert, object_key
from istiod.sources.fields import FieldTypeError
from istiod.sources.yamldocs import LimitError, load_documents

# istioctl's exit codes (istioctl/cmd/sysexits.go).
EXIT_USAGE, EXIT_DATA_ERROR, EXIT_ISSUES = 64, 65, 79
ISTIO_NAMESPACE = "istio-system"


class AnalyzeError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Read:
    """What the sources gave: objects with their `file:line` ("" from a cluster), and files' parse errors."""

    objects: list[tuple[dict[str, Any], str, dict[str, int]]]  # (object, `file:line`, its fields' lines)
    errors: list[str]


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


def _document_lines(text: str) -> list[int]:
    """The line each YAML document starts on (after its `---`), as istioctl's references count them."""
    lines = [1]
    for number, line in enumerate(text.splitlines(), 1):
        if line.rstrip() == "---" or line.startswith("--- "):
            lines.append(number + 1)
    return lines


def read_files(paths: list[Path]) -> Read:
    objects, errors = [], []
    for path in _files(paths):
        try:
            text = path.read_text()
            load_documents(text)  # the bounds on aliases every file read keeps, before anything walks it
            chunks = _split(text)
            documents = [yaml.safe_load(chunk) for chunk in chunks]
        except (OSError, UnicodeDecodeError, yaml.YAMLError, LimitError) as error:
            errors.append(f"{path}: {' '.join(str(error).split())}")
            continue
        lines = _document_lines(text) if path.suffix != ".json" else []
        for i, document in enumerate(documents):
            if i < len(lines):
                reference, fields = f"{path}:{lines[i]}", field_lines(chunks[i], lines[i])
            else:
                reference, fields = str(path), {}
            expanded = [o for o in _expand_lists([document]) if isinstance(o, dict)]
            objects += [(o, reference, fields if o is document else {}) for o in expanded]
    return Read(objects, errors)


def field_lines(chunk: str, first: int) -> dict[str, int]:
    """The line of every scalar field of one YAML document starting on line `first`, keyed as
    Istio's analyzers name fields (`{.spec.http[0].route[0].destination.host}`)."""
    found: dict[str, int] = {}

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                here = f"{path}.{key.value}"
                if isinstance(value, yaml.ScalarNode):
                    found[f"{{{here}}}"] = value.start_mark.line + first
                else:
                    walk(value, here)
        elif isinstance(node, yaml.SequenceNode):
            for j, item in enumerate(node.value):
                if isinstance(item, yaml.ScalarNode):
                    found[f"{{{path}[{j}]}}"] = item.start_mark.line + first
                else:
                    walk(item, f"{path}[{j}]")

    root = yaml.compose(chunk, Loader=yaml.SafeLoader)
    if isinstance(root, yaml.MappingNode):
        walk(root, "")
    return found


def _split(text: str) -> list[str]:
    """The YAML documents of a stream, empty ones kept so that they line up with `_document_lines`."""
    documents: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        if line.rstrip() == "---" or line.startswith("--- "):
            documents.append("\n".join(current))
            current = [line[4:]] if line.startswith("--- ") else []
        else:
            current.append(line)
    documents.append("\n".join(current))
    return documents


async def read_cluster(kubeconfig: Path) -> list[dict[str, Any]]:
    from kubernetes_asyncio import client

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
        calls = {k: c for k, c in list_calls(api).items() if k in KUBE_KINDS} | istio_list_calls(api)
        calls["Deployment"] = client.AppsV1Api(api).list_deployment_for_all_namespaces  # read for analysis only
        # Istio's ConfigMaps only: the injector's (whether namespaces are injected by default).
        calls["ConfigMap"] = lambda **kw: client.CoreV1Api(api).list_namespaced_config_map(ISTIO_NAMESPACE, **kw)
        for kind, call in calls.items():
            try:
                await Informer(kind, call, collect).relist()
            except API_ERRORS as error:
                if kind in BY_KIND and getattr(error, "status", None) == 404:
                    continue  # its CRD is not installed: no objects of it
                raise AnalyzeError(f"listing {kind}: {describe_error(error)}") from None
    return collect.objects


def resources(objects: Iterable[tuple[dict[str, Any], str, dict[str, int]]], default_namespace: str) -> tuple[list[Resource], list[Message], list[str]]:
    """The objects analyzers read (later ones replace earlier ones of the same name), the schema
    errors of Istio's kinds (those objects left out of the other analyzers), and the objects that
    do not parse (left out, as istioctl does)."""
    found: dict[tuple[str, str, str], Resource] = {}
    invalid: dict[tuple[str, str, str], Message] = {}
    errors = []
    for body, reference, fields in objects:
        if reference and not (body.get("metadata") or {}).get("namespace") and body.get("kind") in BY_KIND:
            body = {**body, "metadata": {**(body.get("metadata") or {}), "namespace": default_namespace}}
        try:
            key = object_key(body)
        except ConversionError:
            continue  # not an object
        # Files give Istio's kinds only; the Kubernetes kinds come from a cluster.
        if key.kind not in BY_KIND and (reference or key.kind not in KUBE_KINDS):
            continue
        namespace = key.name if key.kind == "Namespace" else key.namespace
        if namespace in IGNORED_NAMESPACES:
            continue
        resource = Resource(key.kind, key.namespace, key.name, body, reference, fields)
        index = (key.kind, key.namespace, key.name)
        invalid.pop(index, None)
        if key.kind in BY_KIND:
            try:
                convert(body)
            except FieldTypeError as error:
                errors.append(f"{reference or key}: {error}")
                found.pop(index, None)
                continue
            except ConversionError as error:
                # The origin names the object: the message keeps only the field and the problem. Left
                # out of the other analyzers (Istio's run on it too): past its first error, the fields
                # were not read, so not known to have their types.
                invalid[index] = schema_error(resource, str(error).removeprefix(str(key)).lstrip(": "))
                found.pop(index, None)
                continue
        found[index] = resource
    return list(found.values()), list(invalid.values()), errors


def messages(objects: Iterable[tuple[dict[str, Any], str, dict[str, int]]], cluster: bool, namespace: str | None) -> tuple[list[Message], list[str]]:
    """istioctl analyze's messages for `namespace` (None: all namespaces), and the parse errors."""
    read, invalid, errors = resources(objects, namespace or "default")
    kinds = set(BY_KIND) | (set(KUBE_KINDS) if cluster else set())
    found = analyze(Objects(read, kinds)) + invalid
    return selected(sorted(found, key=Message.sort_key), namespace), errors


def run(paths: list[Path], kubeconfig: Path | None, output: str, namespace: str | None) -> int:
    try:
        objects: list[tuple[dict[str, Any], str, dict[str, int]]] = []
        if kubeconfig:
            objects = [(o, "", {}) for o in asyncio.run(read_cluster(kubeconfig))]
        read = read_files(paths)  # files on top of the cluster, as istioctl analyze does
    except AnalyzeError as error:
        print(f"istiod analyze: {error}", file=sys.stderr)
        return EXIT_USAGE
    found, errors = messages(objects + read.objects, kubeconfig is not None, namespace)
    errors = read.errors + errors
    if errors:
        print("Error(s) adding files: " + "".join(f"\n\t* {e}" for e in errors), file=sys.stderr)
    if output == "json":
        sys.stdout.write(json.dumps([m.json() for m in found], indent=2) + "\n")
        return 0  # as istioctl's: only its log format exits non-zero for what it found
    sys.stdout.write("".join(m.line() + "\n" for m in found) or "\n")  # istioctl's empty line when clean
    target = "all namespaces" if namespace is None else f"namespace: {namespace}"
    if not found:
        print(_clean(target, [str(p) for p in paths], bool(errors)), file=sys.stderr)
    if any(m.level == ERROR for m in found):
        print(f"Error: Analyzers found issues when analyzing {target}.\n"
              f"See {DOCS} for more information about causes and resolutions.", file=sys.stderr)
        return EXIT_ISSUES
    return EXIT_DATA_ERROR if errors else 0


def _clean(target: str, files: list[str], unparsed: bool) -> str:
    """istioctl analyze's line when it found nothing (it counts files it could not parse as one)."""
    if unparsed:
        return f"No validation issues found when analyzing {target} (but 1 file could not be parsed)."
    if len(files) > 1:
        return "\u2714 No validation issues found when analyzing:\n  - " + "\n  - ".join(files)
    return f"\u2714 No validation issues found when analyzing {files[0] if files else target}."
