"""What one proxy was sent, as an Envoy admin config dump, and how it differs from what it ACKed."""

from __future__ import annotations

from typing import Any

from envoy.admin.v3 import config_dump_pb2, config_dump_shared_pb2 as dump_pb2

# Decoding the sent Any values to JSON needs every message type they (and the Anys nested in them)
# hold registered in the default descriptor pool, which importing their modules does.
from envoy.config.cluster.v3 import cluster_pb2  # noqa: F401
from envoy.config.endpoint.v3 import endpoint_pb2  # noqa: F401
from envoy.config.listener.v3 import listener_pb2  # noqa: F401
from envoy.config.route.v3 import route_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from google.protobuf import any_pb2, json_format, timestamp_pb2
from google.protobuf.message import Message

from istiod.debug.views import SYNC_TYPES, sync_state
from istiod.xds import types
from istiod.xds.cache import Resource
from istiod.xds.connection import Connection, WatchedResource

Status = dump_pb2.ClientResourceStatus


def config_dump(connection: Connection) -> dict[str, Any]:
    """Envoy's ConfigDump of the last response of each type: clusters, listeners, routes, endpoints."""
    dump = config_dump_pb2.ConfigDump()
    for type_url in DUMP_ORDER:
        watched = connection.watched.get(type_url)
        if watched is not None:
            dump.configs.add().Pack(_dump(watched))
    return json_format.MessageToDict(dump, preserving_proto_field_name=True)


def sync_diff(connection: Connection) -> dict[str, Any]:
    """Per type: the sync state and the resource names whose sent and ACKed copies differ."""
    result = []
    for type_url, _ in SYNC_TYPES:
        watched = connection.watched.get(type_url)
        if watched is None:
            continue
        sent, acked = watched.sent, watched.acked
        result.append({
            "type": types.short_name(type_url),
            "type_url": type_url,
            "status": sync_state(watched.nonce_sent, watched.nonce_acked, watched.rejection),
            "version_sent": watched.version_sent,
            "version_acked": watched.version_acked,
            "nonce_sent": watched.nonce_sent,
            "nonce_acked": watched.nonce_acked,
            "error": watched.last_error,
            "sent_not_acked": sorted(set(sent) - set(acked)),
            "acked_not_sent": sorted(set(acked) - set(sent)),
            "changed": sorted(n for n in set(sent) & set(acked) if not sent[n].same_as(acked[n])),
        })
    return {"proxy": connection.proxy.id, "connection_id": connection.id, "types": result}


def _entry_state(watched: WatchedResource, resource: Resource) -> tuple[int, dump_pb2.UpdateFailureState | None]:
    """Envoy's client_status of one sent resource, and its error_state when the proxy rejected it."""
    if resource.same_as(watched.acked.get(resource.name)):
        return Status.ACKED, None
    if watched.rejection:
        return Status.NACKED, dump_pb2.UpdateFailureState(
            details=watched.rejection, version_info=watched.version_sent, last_update_attempt=_time(watched.sent_at)
        )
    return Status.UNKNOWN, None  # sent, not answered yet


def _any(resource: Resource) -> any_pb2.Any:
    return any_pb2.Any(type_url=resource.type_url, value=resource.value)


def _time(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _dump(watched: WatchedResource) -> Message:
    if watched.type_url == types.LISTENER:
        listeners = dump_pb2.ListenersConfigDump(version_info=watched.version_sent)
        for resource in watched.sent.values():
            status, error = _entry_state(watched, resource)
            listeners.dynamic_listeners.add(
                name=resource.name,
                active_state=dump_pb2.ListenersConfigDump.DynamicListenerState(
                    version_info=watched.version_sent, listener=_any(resource), last_updated=_time(watched.sent_at)
                ),
                client_status=status, error_state=error,
            )
        return listeners
    message, entries, field = _FLAT_DUMPS[watched.type_url]
    result = message()
    for resource in watched.sent.values():
        status, error = _entry_state(watched, resource)
        getattr(result, entries).add(
            version_info=watched.version_sent, last_updated=_time(watched.sent_at), client_status=status,
            error_state=error, **{field: _any(resource)},
        )
    return result


# type URL -> (its dump message, the dump's list of dynamic entries, the entry's resource field)
_FLAT_DUMPS: dict[str, tuple[type[Message], str, str]] = {
    types.CLUSTER: (dump_pb2.ClustersConfigDump, "dynamic_active_clusters", "cluster"),
    types.ROUTE: (dump_pb2.RoutesConfigDump, "dynamic_route_configs", "route_config"),
    types.ENDPOINT: (dump_pb2.EndpointsConfigDump, "dynamic_endpoint_configs", "endpoint_config"),
}
DUMP_ORDER = (types.CLUSTER, types.LISTENER, types.ROUTE, types.ENDPOINT)  # Envoy's
