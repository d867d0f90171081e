"""One connection's sync state as Envoy's CSDS ClientConfig: the resources of istiod's
`istio.io/debug/syncz` xDS type, which `istioctl proxy-status` reads."""

from __future__ import annotations

from envoy.admin.v3 import config_dump_shared_pb2 as dump_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.status.v3 import csds_pb2
from google.protobuf import struct_pb2, timestamp_pb2

from istiod.xds.connection import Connection, WatchedResource

# istiod's ProxyConfig-less nodes are its own clients (istioctl's queries): not proxies, not listed.
QUERY_GENERATOR = "event"


def client_config(connection: Connection) -> bytes | None:
    """The serialized ClientConfig of a proxy's connection (None for an istioctl query's)."""
    proxy = connection.proxy
    if proxy.generator == QUERY_GENERATOR:
        return None
    metadata = struct_pb2.Struct()
    # Only these three, as istiod fills them; istioctl reads CLUSTER_ID and ISTIO_VERSION.
    metadata.update({"CLUSTER_ID": proxy.cluster_id or "Kubernetes", "NAMESPACE": proxy.namespace,
                     **({"ISTIO_VERSION": proxy.istio_version} if proxy.istio_version else {})})
    config = csds_pb2.ClientConfig(node=base_pb2.Node(id=proxy.id, metadata=metadata))
    for type_url, watched in sorted(connection.watched.items()):
        entry = config.generic_xds_configs.add(type_url=type_url, config_status=_status(watched))
        entry.last_updated.CopyFrom(_time(watched.sent_at))
        if watched.last_error:
            entry.error_state.CopyFrom(dump_pb2.UpdateFailureState(
                last_update_attempt=_time(watched.sent_at), details=watched.last_error))
    return config.SerializeToString()


def _status(watched: WatchedResource) -> csds_pb2.ConfigStatus.ValueType:
    """istiod's debugSyncStatus."""
    if watched.last_error:
        return csds_pb2.ERROR
    if not watched.nonce_sent:
        return csds_pb2.NOT_SENT
    return csds_pb2.SYNCED if watched.nonce_acked == watched.nonce_sent else csds_pb2.STALE


def _time(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
