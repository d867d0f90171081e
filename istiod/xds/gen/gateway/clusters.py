"""CDS for gateways: the mesh's outbound clusters, built as for sidecars, and BlackHoleCluster."""

from __future__ import annotations

from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.sidecar.clusters import BLACKHOLE, blackhole, outbound_clusters


def clusters(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    result = [cache.get(types.CLUSTER, BLACKHOLE, None, blackhole), *outbound_clusters(snapshot, proxy, cache)]
    if names is not None:
        wanted = set(names)
        result = [r for r in result if r.name in wanted]
    return result
