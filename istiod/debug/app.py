"""The debug FastAPI app. It reads the snapshot and a read-only view of connections, nothing else."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Response

from istiod.model.service import Endpoint, Service
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.connection import Connection


@dataclass(frozen=True, slots=True)
class DebugView:
    snapshot: Callable[[], Snapshot]
    connections: Callable[[], Mapping[str, Connection]]
    ready: Callable[[], bool]


def create_app(view: DebugView) -> FastAPI:
    app = FastAPI(title="istiod debug", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/ready")
    def ready() -> Response:
        if view.ready():
            return Response("ready\n", media_type="text/plain")
        return Response("not ready: sources have not synced\n", status_code=503, media_type="text/plain")

    @app.get("/debug/registryz")
    def registryz() -> list[dict[str, Any]]:
        return [_service_json(s) for s in sorted(view.snapshot().services.values(), key=lambda s: s.hostname)]

    @app.get("/debug/endpointz")
    def endpointz() -> dict[str, dict[str, list[dict[str, Any]]]]:
        snapshot = view.snapshot()
        result: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for (hostname, port), endpoints in sorted(snapshot.endpoints.items()):
            result.setdefault(hostname, {})[str(port)] = [_endpoint_json(e) for e in endpoints]
        return result

    @app.get("/debug/syncz")
    def syncz() -> list[dict[str, Any]]:
        return [_sync_json(c) for c in sorted(view.connections().values(), key=lambda c: c.proxy.id)]

    return app


def _service_json(service: Service) -> dict[str, Any]:
    return {
        "Attributes": {
            "ServiceRegistry": "Kubernetes",
            "Name": service.name,
            "Namespace": service.namespace,
            "Labels": dict(service.labels),
            "LabelSelectors": dict(service.selector),
        },
        "ports": [
            {"name": p.name, "port": p.port, "protocol": p.protocol, "targetPort": p.target_port} for p in service.ports
        ],
        "hostname": service.hostname,
        "defaultAddress": service.cluster_ip or "0.0.0.0",
        "MeshExternal": False,
    }


def _endpoint_json(endpoint: Endpoint) -> dict[str, Any]:
    return {
        "address": endpoint.address,
        "port": endpoint.port,
        "healthy": endpoint.healthy,
        "locality": str(endpoint.locality),
        "workload": endpoint.workload_name,
        "workloadKind": endpoint.workload_kind,
        "serviceAccount": endpoint.service_account,
        "pod": endpoint.pod,
    }


def _sync_json(connection: Connection) -> dict[str, Any]:
    proxy = connection.proxy
    status: dict[str, Any] = {
        "cluster_id": proxy.cluster_id or "Kubernetes",
        "proxy": proxy.id,
        "proxy_type": proxy.type,
        "istio_version": proxy.istio_version,
        "connection_id": connection.id,
    }
    for type_url, prefix in ((types.CLUSTER, "cluster"), (types.LISTENER, "listener"),
                             (types.ROUTE, "route"), (types.ENDPOINT, "endpoint")):
        watched = connection.watched.get(type_url)
        status[f"{prefix}_sent"] = watched.nonce_sent if watched else ""
        status[f"{prefix}_acked"] = watched.nonce_acked if watched else ""
        if watched and watched.last_error:
            status[f"{prefix}_nacked_error"] = watched.last_error
    return status
