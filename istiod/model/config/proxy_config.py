"""Istio's ProxyConfig kind (networking.istio.io/v1beta1) and the effective ProxyConfig of a workload.

Istio's order (pilot/pkg/model/proxy_config.go): the mesh's defaultConfig, then the root namespace's
ProxyConfig without a selector, then the workload namespace's without a selector, then the pod's
`proxy.istio.io/config` annotation, then the workload namespace's ProxyConfig whose selector matches
(it wins over the annotation). Of several candidates the oldest wins (creation time, then name).
Configs are Istio's JSON form (meshconfig.ProxyConfig's field names), as PROXY_CONFIG carries them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from istiod.model.config.common import Labels, Meta


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """A ProxyConfig object: what it sets of the meshconfig.ProxyConfig of the workloads it selects."""

    meta: Meta
    selector: Labels = ()  # none: every workload of its namespace (of the mesh, in the root namespace)
    concurrency: int | None = None
    environment_variables: tuple[tuple[str, str], ...] = ()  # become the proxy's proxyMetadata
    image_type: str | None = None  # image.imageType: the proxy image's variant (default, debug, distroless)
    created: str = ""  # metadata.creationTimestamp (RFC 3339: ordered as text)

    def as_mesh(self) -> dict[str, Any]:
        """Istio's toMeshConfigProxyConfig."""
        out: dict[str, Any] = {}
        if self.concurrency is not None:
            out["concurrency"] = self.concurrency
        if self.environment_variables:
            out["proxyMetadata"] = dict(self.environment_variables)
        if self.image_type is not None:
            out["image"] = {"imageType": self.image_type}
        return out


def merge_proxy_config(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Istio's MergeProxyConfig: a field `over` sets replaces the base's, except proxyMetadata, whose
    keys merge, and proxyHeaders, whose fields `over` leaves empty keep the base's."""
    out = {**base, **over}
    if isinstance(base.get("proxyMetadata"), Mapping) and isinstance(over.get("proxyMetadata"), Mapping):
        out["proxyMetadata"] = {**base["proxyMetadata"], **over["proxyMetadata"]}
    if isinstance(base.get("proxyHeaders"), Mapping) and isinstance(over.get("proxyHeaders"), Mapping):
        out["proxyHeaders"] = {**base["proxyHeaders"], **{k: v for k, v in over["proxyHeaders"].items() if v}}
    return out


def _oldest(configs: Iterable[ProxyConfig]) -> ProxyConfig | None:
    return min(configs, key=lambda c: (c.created, c.meta.name), default=None)


def effective_proxy_config(default: Mapping[str, Any], configs: Iterable[ProxyConfig], root_namespace: str,
                           namespace: str, labels: Mapping[str, str],
                           annotation: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The workload's ProxyConfig: `default` (the mesh's defaultConfig) overlaid in Istio's order."""
    configs = list(configs)
    effective = dict(default)
    layers = [_oldest(c for c in configs if c.meta.namespace == root_namespace and not c.selector)]
    if namespace != root_namespace:
        layers.append(_oldest(c for c in configs if c.meta.namespace == namespace and not c.selector))
    for layer in layers:
        if layer is not None:
            effective = merge_proxy_config(effective, layer.as_mesh())
    if annotation:
        effective = merge_proxy_config(effective, annotation)
    workload = _oldest(c for c in configs if c.meta.namespace == namespace and c.selector
                       and all(labels.get(k) == v for k, v in c.selector))
    return merge_proxy_config(effective, workload.as_mesh()) if workload is not None else effective
