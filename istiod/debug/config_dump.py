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

from istiod.debug.dump_layout import DUMP_LAYOUT, DumpLayout
from istiod.debug.views import SYNC_TYPES, sync_state
from istiod.xds import types
from istiod.xds.cache import Resource
from istiod.xds.connection import Connection, WatchedResource

Status = dump_pb2.ClientResourceStatus


def config_dump(connection: Connection) -> dict[str, Any]:
    """Envoy's ConfigDump of the last response of each type: clusters, listeners, routes, endpoints (when watched)."""
    dump = config_dump_pb2.ConfigDump()
    for layout in DUMP_LAYOUT:
        watched = connection.watched.get(layout.type_url)
        if watched is not None:
            dump.configs.add().Pack(_dump(layout, watched))
        elif layout.type_url != types.ENDPOINT:  # istiod's dump always has these three, empty if need be
            dump.configs.add().Pack(getattr(dump_pb2, layout.dump_type)())
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


def _dump(layout: DumpLayout, watched: WatchedResource) -> Message:
    result = getattr(dump_pb2, layout.dump_type)()
    if watched.type_url == types.LISTENER:  # of these dumps, istiod fills the dump's own version for listeners only
        result.version_info = watched.version_sent
    *to_state, resource_field = layout.path
    for resource in watched.sent.values():
        status, error = _entry_state(watched, resource)
        entry = getattr(result, layout.entries).add(client_status=status)
        if error is not None:
            entry.error_state.CopyFrom(error)
        if "name" in entry.DESCRIPTOR.fields_by_name:  # a listener entry names its listener
            entry.name = resource.name
        state = entry
        for key in to_state:  # a listener's version and resource sit in its active_state
            state = getattr(state, key)
        state.version_info = watched.version_sent
        state.last_updated.CopyFrom(_time(watched.sent_at))
        getattr(state, resource_field).CopyFrom(_any(resource))
    return result
