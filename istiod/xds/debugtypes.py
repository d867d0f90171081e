"""istiod's xDS debug types, which istioctl reads instead of the debug HTTP ports.

- `istio.io/debug/syncz`: every proxy's sync state as CSDS ClientConfigs (`istioctl proxy-status`,
  `istioctl x version`); the response names the control plane in `control_plane.identifier`.
- `istio.io/debug/config_dump`, one resource name `<pod>.<namespace>` (or a proxy ID): what that
  proxy was sent, as the Any configs of an Envoy ConfigDump (`istioctl proxy-status <pod>`).
- any other `istio.io/debug/...`: an empty response (istiod's "event" generator).
- `istio.io/debug`, one resource name `<path>?<query>`: the debug HTTP handler `/debug/<path>` run
  in-process, its body as one resource (`istioctl x internal-debug`); `404 page not found` for a path
  without a handler, as Go's ServeMux answers.

Authentication and authorization are istiod's: the caller must have proven an identity (the secure
port, 15012: client certificate or token) unless ENABLE_DEBUG_ENDPOINT_AUTH=false turns that off for
the `istio.io/debug/` types; `istio.io/debug` always needs it. An identity outside the system
namespace (and DEBUG_ENDPOINT_AUTH_ALLOWED_NAMESPACES) sees only proxies of its own namespace, and of
`istio.io/debug` only config_dump, ndsz and edsz. A refusal ends the stream with the gRPC status
istiod sends: UNAUTHENTICATED "authentication required", INVALID_ARGUMENT, PERMISSION_DENIED.
"""

from __future__ import annotations

import json
import logging
import platform
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.admin.v3 import config_dump_pb2
from envoy.service.status.v3 import csds_pb2
from google.protobuf import json_format
from starlette.routing import Match

from istiod import __version__
from istiod.debug.connections import Question
from istiod.model.proxy import NodeIdError, Proxy, parse_node_id
from istiod.xds.cache import Resource
from istiod.xds.connection import Closed, StreamClosed

log = logging.getLogger(__name__)

DEBUG = "istio.io/debug"
SYNCZ = f"{DEBUG}/syncz"
CONFIG_DUMP = f"{DEBUG}/config_dump"
CLIENT_CONFIG = "type.googleapis.com/envoy.service.status.v3.ClientConfig"
# Of `istio.io/debug`, what an identity outside the system namespace may read (istiod's activeNamespaceDebuggers).
_NAMESPACED = frozenset({"config_dump", "ndsz", "edsz"})
_NOT_FOUND = b"404 page not found\n"  # Go's http.NotFound body


def is_debug(type_url: str) -> bool:
    return type_url == DEBUG or type_url.startswith(f"{DEBUG}/")


def control_plane_identifier(pod_name: str) -> str:
    """istiod's IstioControlPlaneInstance JSON: `istioctl x version` prints Info.version per ID."""
    info = {"version": __version__, "revision": "unknown", "golang_version": f"python{platform.python_version()}",
            "status": "Clean", "tag": __version__}
    return json.dumps({"Component": "istiod", "ID": pod_name, "Info": info}, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class DebugTypes:
    ask: Callable[[Question], Awaitable[Any]]  # the debug views' combined answer (every xDS process's)
    app: Any  # the debug HTTP app (ASGI), run in-process for `istio.io/debug` as istiod's internal mux
    control_plane: str  # control_plane_identifier()
    system_namespace: str = "istio-system"
    endpoint_auth: bool = True  # ENABLE_DEBUG_ENDPOINT_AUTH
    allowed_namespaces: frozenset[str] = field(default_factory=frozenset)  # DEBUG_ENDPOINT_AUTH_ALLOWED_NAMESPACES

    async def generate(self, proxy: Proxy, type_url: str, names: list[str]) -> list[Resource]:
        """The resources answering one request of a debug type; raises StreamClosed to refuse it."""
        if type_url == DEBUG:
            return await self._internal_debug(proxy, names)
        if self.endpoint_auth and not proxy.verified:
            raise _refused(proxy, grpc.StatusCode.UNAUTHENTICATED, "authentication required")
        # The namespace the caller is restricted to; "" for none.
        restricted = "" if (not self.endpoint_auth or proxy.namespace == self.system_namespace
                            or proxy.namespace in self.allowed_namespaces) else proxy.namespace
        if type_url == SYNCZ:
            return self._syncz(await self.ask(Question("csds")), restricted)
        if type_url == CONFIG_DUMP:
            return await self._config_dump(names, restricted)
        return []

    def _syncz(self, configs: list[bytes], restricted: str) -> list[Resource]:
        resources = []
        for value in configs:
            config = csds_pb2.ClientConfig.FromString(value)
            namespace = config.node.metadata.fields["NAMESPACE"].string_value
            if not restricted or namespace == restricted:
                resources.append(Resource(config.node.id, CLIENT_CONFIG, value))
        return resources

    async def _config_dump(self, names: list[str], restricted: str) -> list[Resource]:
        if len(names) != 1:
            log.info("%s with %d resource names: not answered", CONFIG_DUMP, len(names))
            return []
        found = await self.ask(Question("config_dump", names[0]))
        # Not connected here: an empty answer, the client may ask another istiod (as istiod does).
        if found is None or (restricted and _namespace_of(names[0]) != restricted):
            log.info("%s: no connection for proxy %r", CONFIG_DUMP, names[0])
            return []
        dump = json_format.ParseDict(_without_client_state(found), config_dump_pb2.ConfigDump())
        return [Resource("", config.type_url, config.value) for config in dump.configs]

    async def _internal_debug(self, proxy: Proxy, names: list[str]) -> list[Resource]:
        if not proxy.verified:
            raise _refused(proxy, grpc.StatusCode.UNAUTHENTICATED, "authentication required")
        if len(names) != 1:
            raise StreamClosed(Closed(grpc.StatusCode.INVALID_ARGUMENT, "exactly one debug request is required"))
        name = names[0]
        target = urlsplit(name)
        if proxy.namespace != self.system_namespace and (
            target.path not in _NAMESPACED
            # Its proxies only: the caller's namespace must be the one config_dump names.
            or (target.path == "config_dump" and _namespace_of(_query_value(target.query, "proxyID")) != proxy.namespace)
        ):
            identity = f"ns/{proxy.namespace}" + (f"/sa/{proxy.service_account}" if proxy.service_account else "")
            raise _refused(proxy, grpc.StatusCode.PERMISSION_DENIED,
                           f"the debug info is not available for current identity: {json.dumps(identity)}")
        return [Resource(name, DEBUG, await _get(self.app, f"/debug/{target.path}", target.query))]


def _refused(proxy: Proxy, code: grpc.StatusCode, message: str) -> StreamClosed:
    log.warning("proxy %s is not authorized to receive debug info (%s). Ensure you are connecting over "
                "the TLS port and are authenticated.", proxy.id, message)
    return StreamClosed(Closed(code, message))


def _without_client_state(value: Any) -> Any:
    """The dump without what the proxy made of each resource (client_status, error_state): istiod's
    has neither, and istioctl compares it with the Envoy's own, which has neither for these either."""
    if isinstance(value, dict):
        return {k: _without_client_state(v) for k, v in value.items() if k not in ("client_status", "error_state")}
    if isinstance(value, list):
        return [_without_client_state(v) for v in value]
    return value


def _namespace_of(proxy_id: str) -> str:
    """The namespace a proxy ID or istioctl's `<pod>.<namespace>` names ("" if neither)."""
    try:
        return parse_node_id(proxy_id)[3]
    except NodeIdError:
        pod, dot, namespace = proxy_id.partition(".")
        return namespace if dot and pod and "." not in namespace else ""


def _query_value(query: str, key: str) -> str:
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        if name == key:
            return value
    return ""


async def _get(app: Any, path: str, query: str) -> bytes:
    """The body the debug app answers a GET from loopback with (istiod's internal mux: no HTTP auth,
    the xDS stream was checked); Go's 404 body for a path that no handler serves."""
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query.encode(),
        "headers": [(b"host", b"localhost")], "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }
    if not any(route.matches(scope)[0] is Match.FULL for route in app.router.routes):
        return _NOT_FOUND
    body: list[bytes] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    return b"".join(body)
