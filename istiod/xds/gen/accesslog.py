"""Envoy's access logs from meshConfig `accessLogFile`, as istiod's legacy mesh-config logging does:
a file access log (Istio's text or JSON format, or the mesh's `accessLogFormat`) on every HTTP
connection manager and TCP proxy of a sidecar's or gateway's listeners, and on each listener itself
for connections no filter chain took (response flag NR).

Added to what the listener generators make, once per listener and setting (ResourceCache.derived).
"""

from __future__ import annotations

import json
from functools import partial

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2, extension_pb2, substitution_format_string_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.formatter.cel.v3 import cel_pb2
from envoy.extensions.formatter.metadata.v3 import metadata_pb2
from envoy.extensions.formatter.req_without_query.v3 import req_without_query_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import Message

from istiod.model.mesh import AccessLogSettings
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.filters import HCM_FILTER, TCP_PROXY_FILTER, pack
from istiod.xds.gen.generator import Generator

FILE_ACCESS_LOG = "envoy.access_loggers.file"
# Istio's EnvoyTextLogFormat and EnvoyJSONLogFormatIstio.
TEXT_FORMAT = (
    '[%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%" %RESPONSE_CODE% %RESPONSE_FLAGS% '
    '%RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% "%UPSTREAM_TRANSPORT_FAILURE_REASON%" %BYTES_RECEIVED% '
    '%BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% "%REQ(X-FORWARDED-FOR)%" "%REQ(USER-AGENT)%" '
    '"%REQ(X-REQUEST-ID)%" "%REQ(:AUTHORITY)%" "%UPSTREAM_HOST%" %UPSTREAM_CLUSTER_RAW% %UPSTREAM_LOCAL_ADDRESS% '
    '%DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME% %ROUTE_NAME%\n')
JSON_FORMAT = {
    "start_time": "%START_TIME%", "route_name": "%ROUTE_NAME%", "method": "%REQ(:METHOD)%",
    "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%", "protocol": "%PROTOCOL%", "response_code": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%", "response_code_details": "%RESPONSE_CODE_DETAILS%",
    "connection_termination_details": "%CONNECTION_TERMINATION_DETAILS%", "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%", "duration": "%DURATION%",
    "upstream_service_time": "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%", "x_forwarded_for": "%REQ(X-FORWARDED-FOR)%",
    "user_agent": "%REQ(USER-AGENT)%", "request_id": "%REQ(X-REQUEST-ID)%", "authority": "%REQ(:AUTHORITY)%",
    "upstream_host": "%UPSTREAM_HOST%", "upstream_cluster": "%UPSTREAM_CLUSTER_RAW%",
    "upstream_local_address": "%UPSTREAM_LOCAL_ADDRESS%", "downstream_local_address": "%DOWNSTREAM_LOCAL_ADDRESS%",
    "downstream_remote_address": "%DOWNSTREAM_REMOTE_ADDRESS%", "requested_server_name": "%REQUESTED_SERVER_NAME%",
    "upstream_transport_failure_reason": "%UPSTREAM_TRANSPORT_FAILURE_REASON%",
}
# Command operators Envoy's core lacks, by the formatter extension that provides them (Istio adds each in use).
_FORMATTERS: tuple[tuple[str, str, Message], ...] = (
    ("%REQ_WITHOUT_QUERY", "envoy.formatter.req_without_query", req_without_query_pb2.ReqWithoutQuery()),
    ("%METADATA", "envoy.formatter.metadata", metadata_pb2.Metadata()),
    ("%CEL", "envoy.formatter.cel", cel_pb2.Cel()),
)


def logged(generate: Generator) -> Generator:
    """A listener generator whose listeners log as the mesh config says."""
    def generate_logged(snapshot: Snapshot, proxy: Proxy, names: list[str] | None,
                        cache: ResourceCache) -> list[Resource]:
        resources = generate(snapshot, proxy, names, cache)
        settings = snapshot.mesh.access_log
        if settings is None:
            return resources
        return [made for resource in resources
                if (made := cache.derived(resource, ("access log", settings), partial(with_access_log, resource,
                                                                                       settings))) is not None]
    return generate_logged


def with_access_log(resource: Resource, settings: AccessLogSettings) -> listener_pb2.Listener:
    """Pure: the listener with the file access log on its connection managers, TCP proxies and itself."""
    listener = listener_pb2.Listener.FromString(resource.value)
    log = file_access_log(settings)
    chains = [*listener.filter_chains, *([listener.default_filter_chain] if listener.HasField("default_filter_chain") else [])]
    for chain in chains:
        for network in chain.filters:
            if network.name == HCM_FILTER:
                manager = hcm_pb2.HttpConnectionManager()
                network.typed_config.Unpack(manager)
                manager.access_log.append(log)
                network.typed_config.Pack(manager)
            elif network.name == TCP_PROXY_FILTER:
                proxy = tcp_proxy_pb2.TcpProxy()
                network.typed_config.Unpack(proxy)
                proxy.access_log.append(log)
                network.typed_config.Pack(proxy)
    listener.access_log.append(file_access_log(settings, no_route_only=True))
    return listener


def file_access_log(settings: AccessLogSettings, no_route_only: bool = False) -> accesslog_pb2.AccessLog:
    """istiod's FileAccessLogFromMeshConfig (`no_route_only`: its listener log, filtered on NR)."""
    if settings.encoding == "JSON":
        fields = struct_pb2.Struct()
        fields.update(json.loads(settings.format) if settings.format else JSON_FORMAT)
        text = settings.format or ""
        log_format = substitution_format_string_pb2.SubstitutionFormatString(
            json_format=fields, json_format_options=substitution_format_string_pb2.JsonFormatOptions())
    else:
        text = settings.format or TEXT_FORMAT
        if not text.endswith("\n"):  # "Istio will insert a newline on all formats (if missing)"
            text += "\n"
        log_format = substitution_format_string_pb2.SubstitutionFormatString(
            text_format_source=base_pb2.DataSource(inline_string=text))
    log_format.formatters.extend(extension_pb2.TypedExtensionConfig(name=name, typed_config=pack(config))
                                 for operator, name, config in _FORMATTERS if operator in text)
    log = accesslog_pb2.AccessLog(name=FILE_ACCESS_LOG, typed_config=pack(file_pb2.FileAccessLog(
        path=settings.path, log_format=log_format)))
    if no_route_only:
        log.filter.response_flag_filter.flags.append("NR")
    return log
