"""CDS for gateways: the mesh's outbound clusters, built as for sidecars, and BlackHoleCluster; with
an AUTO_PASSTHROUGH server, an SNI-DNAT cluster `outbound_.<port>_.<subset>_.<host>` beside each:
the same endpoints (its EDS is the outbound cluster's), no TLS of its own (the client's passes)."""

from __future__ import annotations

from functools import partial

from envoy.config.cluster.v3 import cluster_pb2

from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.gateway.servers import gateway_servers, sni_dnat_name
from istiod.xds.gen.sidecar.clusters import BLACKHOLE, blackhole, outbound_clusters


def clusters(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    outbound = outbound_clusters(snapshot, proxy, cache)
    result = [cache.get(types.CLUSTER, BLACKHOLE, None, blackhole), *outbound]
    if any(s.auto_passthrough for s in gateway_servers(snapshot, proxy)):
        result += [cache.get(types.CLUSTER, _dnat_name(r.name), r, partial(sni_dnat_cluster, r))
                   for r in outbound if r.name.startswith("outbound|")]
    if names is not None:
        wanted = set(names)
        result = [r for r in result if r.name in wanted]
    return result


def _dnat_name(outbound: str) -> str:
    _, port, subset, host = outbound.split("|", 3)
    return sni_dnat_name(int(port), host, subset)


def sni_dnat_cluster(outbound: Resource) -> cluster_pb2.Cluster:
    cluster = cluster_pb2.Cluster.FromString(outbound.value)
    cluster.name = _dnat_name(outbound.name)
    if cluster.HasField("eds_cluster_config"):
        cluster.eds_cluster_config.service_name = cluster.eds_cluster_config.service_name or outbound.name
    cluster.ClearField("transport_socket")
    cluster.ClearField("transport_socket_matches")
    return cluster
