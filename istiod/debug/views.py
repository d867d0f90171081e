"""JSON shapes of the debug endpoints, with istiod's field names where istiod has them.

Pure functions of model values and read-only connection state; no web framework here, so the CLI
can share the sync-state rule.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from istiod.model.service import Endpoint, Service
from istiod.model.snapshot import Snapshot, VolumeMount
from istiod.model.workload import Workload
from istiod.sources.store import StoredObject
from istiod.sources.yamldocs import count_values
from istiod.xds import types
from istiod.xds.connection import Connection
from istiod.xds.monitor import PushStatus

# (type URL, the prefix of its fields in /debug/syncz), in the order istioctl prints them.
SYNC_TYPES = ((types.CLUSTER, "cluster"), (types.LISTENER, "listener"), (types.ENDPOINT, "endpoint"),
              (types.ROUTE, "route"))
# Kinds whose objects may hold credentials; the CA will store Secrets, configz never shows them.
_SECRET_KINDS = frozenset({"Secret"})


def sync_state(sent: str, acked: str, error: str = "") -> str:
    """istioctl's per-type status from the nonces sent and acknowledged (and a pending NACK)."""
    if not sent:
        return "NOT SENT"
    if sent == acked:
        return "SYNCED"
    return "NACKED" if error else "STALE"


def rfc3339(timestamp: float | None) -> str | None:
    if not timestamp:
        return None
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def service_json(service: Service) -> dict[str, Any]:
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


def endpointz(snapshot: Snapshot) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Endpoints by service host and port, with health, locality, workload and service account."""
    result: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for (hostname, port), endpoints in sorted(snapshot.endpoints.items()):
        result.setdefault(hostname, {})[str(port)] = [_endpoint_json(e) for e in endpoints]
    return result


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


def instancesz(snapshot: Snapshot) -> list[dict[str, Any]]:
    """Every workload, with the Job and CronJob that own it and the PersistentVolumes it mounts."""
    volumes: dict[tuple[str, str], list[VolumeMount]] = defaultdict(list)
    for mount in snapshot.volumes:
        for workload in mount.mounted_by:
            volumes[(workload.namespace, workload.name)].append(mount)
    return [_workload_json(w, snapshot, volumes[key]) for key, w in sorted(snapshot.workloads.items())]


def _workload_json(workload: Workload, snapshot: Snapshot, mounts: list[VolumeMount]) -> dict[str, Any]:
    owner = workload.owner
    result: dict[str, Any] = {
        "name": workload.name,
        "namespace": workload.namespace,
        "address": workload.ip,
        "phase": workload.phase,
        "ready": workload.ready,
        "serviceAccount": workload.service_account,
        "workloadName": workload.workload_name,
        "workloadKind": workload.workload_kind,
        "nodeName": workload.node_name,
        "labels": dict(workload.labels),
        "owner": {"kind": owner.kind, "name": owner.name} if owner else None,
        "volumes": [_volume_json(m) for m in mounts],
    }
    if owner is not None and owner.kind == "Job":
        job = snapshot.jobs.get((workload.namespace, owner.name))
        result["job"] = {"name": owner.name, "finished": job.finished if job else None}
        cron_name = job.cronjob if job and job.cronjob else (
            workload.workload_name if workload.workload_kind == "CronJob" else "")
        if cron_name:
            cron = snapshot.cronjobs.get((workload.namespace, cron_name))
            result["cronJob"] = {
                "name": cron_name,
                "schedule": cron.schedule if cron else None,
                "suspended": cron.suspended if cron else None,
            }
    return result


def _volume_json(mount: VolumeMount) -> dict[str, Any]:
    volume, claim = mount.volume, mount.claim
    return {
        "persistentVolume": volume.name,
        "claim": claim.name if claim else None,
        "capacity": str(volume.capacity) if volume.capacity else None,
        "capacityBytes": volume.capacity.ceil() if volume.capacity else None,
        "accessModes": list(volume.access_modes),
        "storageClass": volume.storage_class,
        "phase": volume.phase,
    }


def configz(objects: Iterable[StoredObject]) -> list[Mapping[str, Any]]:
    return [_bounded(o) for o in objects if o.key.kind not in _SECRET_KINDS]


# Values one object may expand to on /debug/configz: a Kubernetes object of the largest size the
# API server stores has fewer; shared references (YAML aliases) must not expand on the event loop.
CONFIGZ_MAX_VALUES = 200_000


def _bounded(stored: StoredObject) -> Mapping[str, Any]:
    if count_values(stored.raw, CONFIGZ_MAX_VALUES) <= CONFIGZ_MAX_VALUES:
        return _redacted(stored.raw)
    key = stored.key
    return {"kind": key.kind, "metadata": {"name": key.name, **({"namespace": key.namespace} if key.namespace else {})},
            "omitted": f"expands to more than {CONFIGZ_MAX_VALUES} values"}


_CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def _redacted(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """Pods carry environment values (often credentials) and kubectl's copy of the whole object:
    neither is shown. Everything else is the object as stored."""
    annotations = (raw.get("metadata") or {}).get("annotations") or {}
    spec = raw.get("spec") if raw.get("kind") == "Pod" else None
    if _LAST_APPLIED not in annotations and not isinstance(spec, Mapping):
        return raw
    result = dict(raw)
    if _LAST_APPLIED in annotations:
        result["metadata"] = {**raw["metadata"],
                              "annotations": {k: v for k, v in annotations.items() if k != _LAST_APPLIED}}
    if isinstance(spec, Mapping):
        result["spec"] = {**spec, **{
            field: [_without_env_values(c) for c in spec[field]]
            for field in _CONTAINER_LISTS if isinstance(spec.get(field), list)
        }}
    return result


def _without_env_values(container: Any) -> Any:
    if not isinstance(container, Mapping) or not isinstance(container.get("env"), list):
        return container
    env = [{**e, "value": "<redacted>"} if isinstance(e, Mapping) and "value" in e else e for e in container["env"]]
    return {**container, "env": env}


def ads_client(connection: Connection, detail: bool) -> dict[str, Any]:
    """One of istiod's AdsClients: /debug/adsz (detail: labels, metadata) and /debug/connections."""
    proxy = connection.proxy
    client: dict[str, Any] = {
        "connectionId": connection.id,
        "proxy": proxy.id,
        "connectedAt": rfc3339(connection.connected_at),
        "address": peer_address(connection.peer),
        "watches": {
            type_url: ["*"] if watched.names is None else sorted(watched.names)
            for type_url, watched in sorted(connection.watched.items())
        },
    }
    if detail:
        client["labels"] = dict(proxy.labels)
        client["metadata"] = {
            "NAMESPACE": proxy.namespace,
            "GENERATOR": proxy.generator,
            "SERVICE_ACCOUNT": proxy.service_account,
            "WORKLOAD_NAME": proxy.workload_name,
            "CLUSTER_ID": proxy.cluster_id,
            "ISTIO_VERSION": proxy.istio_version,
            "INSTANCE_IPS": ",".join(proxy.ip_addresses),
        }
    return client


def peer_address(peer: str) -> str:
    """gRPC's `ipv4:127.0.0.1:5000` / `ipv6:[::1]:5000` -> the address istiod shows."""
    scheme, sep, address = peer.partition(":")
    return address if sep and scheme in ("ipv4", "ipv6") else peer


def sync_json(connection: Connection) -> dict[str, Any]:
    proxy = connection.proxy
    status: dict[str, Any] = {
        "cluster_id": proxy.cluster_id or "Kubernetes",
        "proxy": proxy.id,
        "proxy_type": proxy.type,
        "istio_version": proxy.istio_version,
        "connection_id": connection.id,
    }
    for type_url, prefix in SYNC_TYPES:
        watched = connection.watched.get(type_url)
        status[f"{prefix}_sent"] = watched.nonce_sent if watched else ""
        status[f"{prefix}_acked"] = watched.nonce_acked if watched else ""
        if watched and watched.rejection:
            status[f"{prefix}_nacked_error"] = watched.rejection
    return status


def push_status_json(status: PushStatus) -> dict[str, Any]:
    return {
        "version": status.version,
        "reason": dict(status.reason),
        "configs": list(status.configs),
        "full": status.full,
        "start": rfc3339(status.start),
        "end": rfc3339(status.end),
        "in_progress": status.end is None,
        "duration_seconds": round(status.end - status.start, 6) if status.end is not None else None,
        "debounce_seconds": round(status.debounce_seconds, 6),
        "build_seconds": round(status.build_seconds, 6),
        "proxies_connected": status.proxies_connected,
        "proxies_pushed": status.proxies_pushed,
        "responses_sent": status.responses_sent,
        "errors": [{"proxy": e.proxy, "type": e.type, "message": e.message} for e in status.errors],
    }


def find_connection(connections: Mapping[str, Connection], proxy_id: str) -> Connection | None:
    """A connection by proxy ID, connection ID, or istioctl's `<pod>.<namespace>`; the newest wins."""
    matches = [
        c for c in connections.values()
        if proxy_id in (c.proxy.id, c.id, f"{c.proxy.pod_name}.{c.proxy.namespace}")
    ]
    return max(matches, key=lambda c: c.connected_at, default=None)
