"""An IstioOperator spec (file plus --set overrides) mapped onto the charts' values. Pure.

Every field is either in the table below or refused with its path: nothing is silently ignored.
k8s settings (components.pilot.k8s) win over `values`, as istioctl's overlays do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from istiod.model.names import DNS_1123_LABEL

API_VERSION = "install.istio.io/v1alpha1"
DEFAULT_NAMESPACE = "istio-system"
DEFAULT_HUB, DEFAULT_TAG = "", "0.1.0"  # no hub: the image built from the Dockerfile, `istiod:<tag>`
CPU_METRIC = {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization"}}}


class SpecError(ValueError):
    """A field we do not map (its path), or a value of the wrong shape."""


PROFILES = ("default", "ambient")


@dataclass(frozen=True)
class Install:
    namespace: str = DEFAULT_NAMESPACE
    base: bool = True
    istiod: bool = True
    cni: bool = False
    ztunnel: bool = False
    values: Mapping[str, Any] = field(default_factory=dict)  # the istiod chart's values
    cni_values: Mapping[str, Any] = field(default_factory=dict)  # the cni chart's (the agent runs istiod's image)


@dataclass
class _Plan:  # what the table's entries fill in, turned into an Install at the end
    namespace: str = DEFAULT_NAMESPACE
    base: bool = True
    istiod: bool = True
    cni: bool = False
    ztunnel: bool = False
    hub: str = DEFAULT_HUB
    tag: str = DEFAULT_TAG
    image: str = "istiod"
    values: dict[str, Any] = field(default_factory=dict)

    def set(self, dotted: str, value: Any) -> None:
        *parents, leaf = dotted.split(".")
        node = self.values
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value


Apply = Callable[[_Plan, Any, str], None]


def _value(dotted: str) -> Apply:
    return lambda plan, value, path: plan.set(dotted, value)


def _string(attr: str) -> Apply:
    def apply(plan: _Plan, value: Any, path: str) -> None:
        setattr(plan, attr, _expect(value, str, path))
    return apply


def _enabled(attr: str) -> Apply:
    def apply(plan: _Plan, value: Any, path: str) -> None:
        setattr(plan, attr, _expect(value, bool, path))
    return apply


def _profile(plan: _Plan, value: Any, path: str) -> None:
    """Applied first, as istioctl starts from the profile: `ambient` adds the cni and ztunnel charts
    and turns istiod's ambient switch on."""
    if value not in PROFILES:
        raise SpecError(f"{path}: {value!r}: only the profiles {', '.join(PROFILES)} exist")
    if value == "ambient":
        plan.cni = plan.ztunnel = True
        plan.set("ambient", True)


def _revision(plan: _Plan, value: Any, path: str) -> None:
    """istioctl's revision: a DNS-1123 label; "default" is the unsuffixed install, as empty."""
    revision = _expect(value, str, path)
    if revision and not DNS_1123_LABEL.fullmatch(revision):
        raise SpecError(f"{path}: {revision!r} is not a DNS-1123 label")
    plan.set("revision", "" if revision == "default" else revision)


def _accept(plan: _Plan, value: Any, path: str) -> None:
    """metadata of the IstioOperator object itself: it names the spec, it does not change the install."""


def _replicas(plan: _Plan, value: Any, path: str) -> None:
    plan.set("replicas", _expect(value, int, path))
    plan.values.setdefault("autoscale", {}).setdefault("enabled", False)  # an hpaSpec turns it back on


def _hpa_bound(dotted: str) -> Apply:
    def apply(plan: _Plan, value: Any, path: str) -> None:
        plan.set("autoscale.enabled", True)
        plan.set(dotted, _expect(value, int, path))
    return apply


def _hpa_metrics(plan: _Plan, value: Any, path: str) -> None:
    metrics = _expect(value, list, path)
    if len(metrics) != 1 or not isinstance(metrics[0], dict):
        raise SpecError(f"{path}: only one metric, CPU utilization, is supported")
    metric = yaml.safe_load(yaml.safe_dump(metrics[0]))
    utilization = metric.get("resource", {}).get("target", {}).pop("averageUtilization", None)
    if metric != CPU_METRIC or not isinstance(utilization, int):
        raise SpecError(f"{path}[0]: only a Resource cpu Utilization target with averageUtilization is supported")
    plan.set("autoscale.enabled", True)
    plan.set("autoscale.targetCPUUtilizationPercentage", utilization)


def _env_map(plan: _Plan, value: Any, path: str) -> None:
    env = _expect(value, dict, path)
    plan.set("env", [{"name": str(k), "value": str(v)} for k, v in env.items()])


# IstioOperator path -> what it sets. Paths in `values` are applied before the k8s ones (which win).
TABLE: dict[str, Apply] = {
    "apiVersion": _accept,
    "kind": _accept,
    "metadata.name": _accept,
    "metadata.namespace": _accept,
    "spec.profile": _profile,
    "spec.namespace": _string("namespace"),
    "spec.hub": _string("hub"),
    "spec.tag": _string("tag"),
    "spec.revision": _revision,
    "spec.values.revisionTags": _value("revisionTags"),
    "spec.meshConfig": _value("meshConfig"),
    "spec.values.global.hub": _string("hub"),
    "spec.values.global.tag": _string("tag"),
    "spec.values.global.priorityClassName": _value("priorityClassName"),
    "spec.values.pilot.image": _string("image"),
    "spec.values.pilot.replicaCount": _value("replicas"),
    "spec.values.pilot.autoscaleEnabled": _value("autoscale.enabled"),
    "spec.values.pilot.autoscaleMin": _value("autoscale.min"),
    "spec.values.pilot.autoscaleMax": _value("autoscale.max"),
    "spec.values.pilot.cpu.targetAverageUtilization": _value("autoscale.targetCPUUtilizationPercentage"),
    "spec.values.pilot.resources": _value("resources"),
    "spec.values.pilot.nodeSelector": _value("nodeSelector"),
    "spec.values.pilot.tolerations": _value("tolerations"),
    "spec.values.pilot.affinity": _value("affinity"),
    "spec.values.pilot.env": _env_map,
    "spec.components.base.enabled": _enabled("base"),
    "spec.components.pilot.enabled": _enabled("istiod"),
    "spec.components.cni.enabled": _enabled("cni"),
    "spec.components.ztunnel.enabled": _enabled("ztunnel"),
    "spec.components.pilot.k8s.replicaCount": _replicas,
    "spec.components.pilot.k8s.resources": _value("resources"),
    "spec.components.pilot.k8s.nodeSelector": _value("nodeSelector"),
    "spec.components.pilot.k8s.tolerations": _value("tolerations"),
    "spec.components.pilot.k8s.affinity": _value("affinity"),
    "spec.components.pilot.k8s.strategy": _value("strategy"),
    "spec.components.pilot.k8s.priorityClassName": _value("priorityClassName"),
    "spec.components.pilot.k8s.env": _value("env"),
    "spec.components.pilot.k8s.podDisruptionBudget": _value("podDisruptionBudget"),
    "spec.components.pilot.k8s.hpaSpec.minReplicas": _hpa_bound("autoscale.min"),
    "spec.components.pilot.k8s.hpaSpec.maxReplicas": _hpa_bound("autoscale.max"),
    "spec.components.pilot.k8s.hpaSpec.metrics": _hpa_metrics,
}


def _expect(value: Any, kind: type, path: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SpecError(f"{path}: {value!r} is not a{'n' if kind is int else ''} {kind.__name__}")
    return value


def _leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if path in TABLE:
        yield path, node
        return
    if path and not any(known.startswith(f"{path}.") for known in TABLE):
        raise SpecError(f"{path}: unknown field (not supported by this installer)")
    if isinstance(node, dict):
        for key, child in node.items():
            yield from _leaves(child, f"{path}.{key}" if path else str(key))
    elif node is not None:  # null sets nothing, as in istioctl
        raise SpecError(f"{path}: {node!r} is not a map")


def with_sets(operator: Mapping[str, Any] | None, sets: list[str]) -> dict[str, Any]:
    """The IstioOperator with istioctl's `--set path=value` overrides (paths under spec)."""
    merged: dict[str, Any] = yaml.safe_load(yaml.safe_dump(dict(operator or {}))) or {}
    for assignment in sets:
        dotted, sep, raw = assignment.partition("=")
        if not sep or not dotted:
            raise SpecError(f"--set {assignment}: expected path=value")
        *parents, leaf = ["spec", *dotted.split(".")]
        node = merged
        for depth, key in enumerate(parents):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise SpecError(f"--set {assignment}: {'.'.join(parents[:depth + 1])} is not a map")
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return merged


def to_install(operator: Mapping[str, Any]) -> Install:
    if not isinstance(operator, Mapping):
        raise SpecError("the IstioOperator is not a map")
    if operator.get("apiVersion", API_VERSION) != API_VERSION or operator.get("kind", "IstioOperator") != "IstioOperator":
        raise SpecError(f"expected apiVersion {API_VERSION}, kind IstioOperator")
    plan = _Plan()
    leaves = sorted(_leaves(dict(operator), ""),
                    key=lambda leaf: (leaf[0] != "spec.profile", not leaf[0].startswith("spec.values.")))
    for path, value in leaves:
        TABLE[path](plan, value, path)
    if "/" in plan.image:  # a full reference, as values.pilot.image may be
        image = plan.image
    else:
        image = f"{plan.hub}/{plan.image}:{plan.tag}" if plan.hub else f"{plan.image}:{plan.tag}"
    plan.set("image", image)
    return Install(namespace=plan.namespace, base=plan.base, istiod=plan.istiod, cni=plan.cni, ztunnel=plan.ztunnel,
                   values=plan.values, cni_values={"image": image})
