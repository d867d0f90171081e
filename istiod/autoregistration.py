"""WorkloadEntry auto-registration and health, as Istio's istiod (pilot/pkg/autoregistration).

A proxy whose node metadata names a WorkloadGroup (`AUTO_REGISTER_GROUP`, a VM's agent) gets a
WorkloadEntry made from the group when it connects: `<group>-<ip>[-<network>]` in its namespace, the
group's template with the proxy's address, labels (template, then the group's metadata, then the
proxy's), network and locality, owned by the group, annotated with the group's name, this istiod
as its controller and when it connected. A proxy naming an existing entry (`WORKLOAD_ENTRY`) that
is annotated `proxy.istio.io/health-checks-enabled` becomes that entry's connected proxy instead.
Either way the identity the proxy proved must be of the entry's namespace and service account.

When its last stream ends the entry is marked disconnected; after the grace period
(PILOT_WORKLOAD_ENTRY_GRACE_PERIOD) an auto-registered entry still disconnected is deleted, and a
health-checked one loses its Healthy condition. A periodic sweep does the same for entries left by
an istiod that stopped.

A proxy whose agent runs a readiness probe reports each change of its result as a discovery request
of type HealthInformation (no error detail: healthy); the entry's status then carries condition
Healthy True or False with the message, and the registry counts an entry with health checks enabled
only while that condition is True (istiod/sources/istio/networking.py).

The writes go to the Kubernetes API (EntryStore); a config-dir istiod has nowhere to write, and a
proxy asking for registration there is refused with a status saying so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

import grpc

from istiod import logs
from istiod.model.config import ConfigSet
from istiod.model.config.kinds import BY_KIND
from istiod.model.config.networking import HEALTH_CHECKS_ANNOTATION, WorkloadGroup
from istiod.model.proxy import Proxy

log = logging.getLogger(__name__)

GROUP_ANNOTATION = "istio.io/autoRegistrationGroup"
CONTROLLER_ANNOTATION = "istio.io/workloadController"
CONNECTED_ANNOTATION = "istio.io/connectedAt"
DISCONNECTED_ANNOTATION = "istio.io/disconnectedAt"
LOCALITY_LABEL = "istio-locality"
TUNNEL_LABEL = "networking.istio.io/tunnel"
_KIND = BY_KIND["WorkloadEntry"]
_GROUP_KIND = BY_KIND["WorkloadGroup"]


class RegistrationError(Exception):
    """Why a proxy cannot be the entry it claims: its stream ends with this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Conflict(Exception):
    """The entry changed since it was read (its resourceVersion): read it again and retry."""


class EntryStore(Protocol):
    """WorkloadEntries as the Kubernetes API keeps them (whole objects, as JSON maps)."""

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def create(self, body: dict[str, Any]) -> None: ...

    async def replace(self, body: dict[str, Any]) -> None: ...

    async def replace_status(self, body: dict[str, Any]) -> None: ...

    async def delete(self, namespace: str, name: str, resource_version: str) -> None: ...

    async def list(self) -> list[dict[str, Any]]: ...


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _format(at: datetime) -> str:
    """Go's RFC3339Nano, which istiod writes and parses (nanoseconds as we have them: micro)."""
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def entry_name(proxy: Proxy) -> str:
    """Istio's autoregisteredWorkloadEntryName: `<group>-<ip>[-<network>]`, IPv6's colons as dashes,
    the last 253 characters."""
    parts = [proxy.auto_register_group, proxy.ip.replace(":", "-")]
    if proxy.network:
        parts.append(proxy.network)
    return "-".join(parts)[-253:]


def entry_from_group(name: str, proxy: Proxy, group: WorkloadGroup) -> dict[str, Any]:
    """Istio's workloadEntryFromGroup, as the object to create."""
    template = group.template
    labels = {**dict(template.labels), **dict(group.labels), **dict(proxy.labels)}
    labels.pop(LOCALITY_LABEL, None)  # the entry's locality says it (and `/` is no label value)
    spec: dict[str, Any] = {"address": proxy.ip}
    if template.ports:
        spec["ports"] = dict(template.ports)
    if labels:
        spec["labels"] = labels
    network = proxy.network or template.network
    if network:
        spec["network"] = network
    locality = str(proxy.locality) or template.locality  # the bootstrap's, as istiod's XdsNode locality
    if locality:
        spec["locality"] = locality
    if template.weight:
        spec["weight"] = template.weight
    if template.service_account:
        spec["serviceAccount"] = template.service_account
    annotations = {GROUP_ANNOTATION: group.meta.name, **dict(group.annotations)}
    if proxy.health_checked:
        annotations[HEALTH_CHECKS_ANNOTATION] = "true"
    return {
        "apiVersion": f"{_KIND.group}/v1", "kind": "WorkloadEntry",
        "metadata": {"name": name, "namespace": proxy.namespace, "labels": labels, "annotations": annotations,
                     "ownerReferences": [{"apiVersion": f"{_GROUP_KIND.group}/v1", "kind": "WorkloadGroup",
                                          "name": group.meta.name, "uid": group.uid, "controller": True}]},
        "spec": spec,
    }


def _identity_problem(proxy: Proxy, namespace: str, service_account: str) -> str | None:
    """Istio's ensureProxyCanControlEntry."""
    if not proxy.verified:
        return "registration of WorkloadEntry requires a verified identity"
    if proxy.namespace != namespace:
        return f'registration of WorkloadEntry namespace mismatch: "{proxy.namespace}" vs "{namespace}"'
    if service_account and proxy.verified_service_account != service_account:
        return (f'registration of WorkloadEntry service account mismatch: "{proxy.verified_service_account}" '
                f'vs "{service_account}"')
    return None


def _annotations(body: Mapping[str, Any]) -> dict[str, str]:
    return dict((body.get("metadata") or {}).get("annotations") or {})


@dataclass(frozen=True, slots=True)
class Registered:
    """What a connection controls: the entry and whether it made it (auto-registration)."""

    namespace: str
    name: str
    auto: bool


class Registrar(Protocol):
    """What the ADS server tells of its connections: this module's controller, or in an xDS worker
    process the main process's, asked over the worker's pipe."""

    async def connected(self, proxy: Proxy, connection: str, at: datetime) -> Registered | None: ...

    def disconnected(self, registered: Registered, connection: str, connected_at: datetime) -> None: ...

    def health(self, registered: Registered, healthy: bool, message: str) -> None: ...


class WorkloadEntryController:
    def __init__(self, store: EntryStore | None, config: Callable[[], ConfigSet], instance: str,
                 grace: float = 10.0, validate_identity: bool = True, max_connection_age: float = 30 * 60,
                 auto_register: bool = True, health_checks: bool = True) -> None:
        """`store`: None when istiod has no Kubernetes API (a proxy asking to register is refused);
        `config`: the Istio config in force (WorkloadGroups); `instance`: this istiod's name, the
        entries' controller; `auto_register`, `health_checks`: Istio's feature switches."""
        self.store = store
        self.auto_register = auto_register
        self.health_checks = health_checks
        self.config = config
        self.instance = instance
        self.grace = grace
        self.validate_identity = validate_identity
        # An entry connected longer ago than this (and never marked disconnected: both istiod and the
        # workload went down together) is swept, as istiod's maxConnectionAge check.
        self.max_connection_age = max_connection_age
        self._connections: dict[tuple[str, str], set[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def connected(self, proxy: Proxy, connection: str, at: datetime) -> Registered | None:
        """The entry this connection controls, if any; raises RegistrationError to refuse it."""
        if proxy.auto_register_group and self.auto_register:
            registered = Registered(proxy.namespace, entry_name(proxy), True)
        elif proxy.workload_entry and self.health_checks:
            registered = Registered(proxy.namespace, proxy.workload_entry, False)
        else:
            return None
        if self.store is None:
            raise RegistrationError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"WorkloadEntry {registered.namespace}/{registered.name}: registration needs the "
                                    "Kubernetes API (this istiod reads its config from a directory)")
        for _ in range(5):
            try:
                if registered.auto:
                    await self._register(registered, proxy, at)
                elif not await self._become_controller(registered, proxy, at):
                    return None
                break
            except Conflict:
                continue
        self._connections.setdefault((registered.namespace, registered.name), set()).add(connection)
        return registered

    async def _register(self, registered: Registered, proxy: Proxy, at: datetime) -> None:
        assert self.store is not None
        existing = await self.store.get(registered.namespace, registered.name)
        if existing is not None:
            self._check_identity(proxy, existing)
            if await self._mark_connected(existing, at):
                log.info(logs.event("updated auto-registered WorkloadEntry as connected",
                                    entry=f"{registered.namespace}/{registered.name}"))
            return
        group = next((g for g in self.config().workload_groups
                      if g.meta.namespace == proxy.namespace and g.meta.name == proxy.auto_register_group), None)
        if group is None:
            raise RegistrationError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"auto-registration WorkloadEntry of {proxy.id} failed: cannot find WorkloadGroup "
                                    f"{proxy.namespace}/{proxy.auto_register_group}")
        body = entry_from_group(registered.name, proxy, group)
        self._check_identity(proxy, body)
        body["metadata"]["annotations"].update({CONTROLLER_ANNOTATION: self.instance, CONNECTED_ANNOTATION: _format(at)})
        await self.store.create(body)
        log.info(logs.event("auto-registered WorkloadEntry", entry=f"{registered.namespace}/{registered.name}",
                            health_checks=proxy.health_checked))

    async def _become_controller(self, registered: Registered, proxy: Proxy, at: datetime) -> bool:
        assert self.store is not None
        existing = await self.store.get(registered.namespace, registered.name)
        if existing is None:
            raise RegistrationError(grpc.StatusCode.FAILED_PRECONDITION,
                                    "proxy metadata indicates that it must correspond to an existing WorkloadEntry, "
                                    f"however WorkloadEntry {registered.namespace}/{registered.name} is not found")
        if HEALTH_CHECKS_ANNOTATION not in _annotations(existing):
            return False  # not health-checked: the proxy is served as any other
        self._check_identity(proxy, existing)
        if await self._mark_connected(existing, at):
            log.info(logs.event("updated health-checked WorkloadEntry", entry=f"{registered.namespace}/{registered.name}"))
        return True

    def _check_identity(self, proxy: Proxy, body: Mapping[str, Any]) -> None:
        if not self.validate_identity:
            return
        problem = _identity_problem(proxy, body["metadata"]["namespace"],
                                    str((body.get("spec") or {}).get("serviceAccount") or ""))
        if problem is not None:
            raise RegistrationError(grpc.StatusCode.PERMISSION_DENIED, problem)

    async def _mark_connected(self, body: dict[str, Any], at: datetime) -> bool:
        """Istio's changeWorkloadEntryStateToConnected; False when there was nothing to change."""
        assert self.store is not None
        annotations = _annotations(body)
        disconnected = _parse(annotations.get(DISCONNECTED_ANNOTATION))
        if disconnected is not None and at < disconnected:
            return False  # a connect handled after the disconnect that followed it
        last = _parse(annotations.get(CONNECTED_ANNOTATION))
        if last is not None and at < last:
            return False  # it reconnected since, maybe to another istiod
        if annotations.get(CONTROLLER_ANNOTATION) == self.instance and last is not None and not at > last:
            return False
        annotations.update({CONTROLLER_ANNOTATION: self.instance, CONNECTED_ANNOTATION: _format(at)})
        annotations.pop(DISCONNECTED_ANNOTATION, None)
        body["metadata"]["annotations"] = annotations
        await self.store.replace(body)
        return True

    def disconnected(self, registered: Registered, connection: str, connected_at: datetime) -> None:
        """The connection's stream ended: once the entry's last one has, mark it and schedule its cleanup."""
        connections = self._connections.get((registered.namespace, registered.name), set())
        connections.discard(connection)
        if connections:
            return
        self._connections.pop((registered.namespace, registered.name), None)
        self._spawn(self._unregister(registered, _now(), connected_at))

    async def _unregister(self, registered: Registered, at: datetime, connected_at: datetime) -> None:
        assert self.store is not None
        for _ in range(5):
            body = await self.store.get(registered.namespace, registered.name)
            if body is None:
                return
            annotations = _annotations(body)
            last = _parse(annotations.get(CONNECTED_ANNOTATION))
            if last is not None and last > connected_at:
                return  # it reconnected before this disconnect was handled
            if annotations.get(CONTROLLER_ANNOTATION) != self.instance:
                return  # another istiod controls it now
            annotations.pop(CONNECTED_ANNOTATION, None)
            annotations[DISCONNECTED_ANNOTATION] = _format(at)
            body["metadata"]["annotations"] = annotations
            try:
                await self.store.replace(body)
                break
            except Conflict:
                continue
        else:
            return
        log.info(logs.event("updated WorkloadEntry as disconnected", entry=f"{registered.namespace}/{registered.name}"))
        await asyncio.sleep(self.grace)
        body = await self.store.get(registered.namespace, registered.name)
        if body is not None and self._expired(body):
            await self._clean_up(body, periodic=False)

    def _expired(self, body: Mapping[str, Any]) -> bool:
        """Istio's shouldCleanupEntry."""
        annotations = _annotations(body)
        if GROUP_ANNOTATION not in annotations and not (CONTROLLER_ANNOTATION in annotations and _healthy_condition(body)):
            return False
        connected = _parse(annotations.get(CONNECTED_ANNOTATION))
        if annotations.get(CONNECTED_ANNOTATION):
            return connected is not None and (_now() - connected).total_seconds() > self.max_connection_age
        disconnected = _parse(annotations.get(DISCONNECTED_ANNOTATION))
        if not annotations.get(DISCONNECTED_ANNOTATION):
            return False
        return disconnected is None or (_now() - disconnected).total_seconds() >= self.grace

    async def _clean_up(self, body: dict[str, Any], periodic: bool) -> None:
        assert self.store is not None
        metadata = body["metadata"]
        where = f"{metadata['namespace']}/{metadata['name']}"
        try:
            if GROUP_ANNOTATION in _annotations(body):
                await self.store.delete(metadata["namespace"], metadata["name"], str(metadata.get("resourceVersion", "")))
                log.info(logs.event("cleaned up auto-registered WorkloadEntry", entry=where, periodic=periodic))
            else:
                conditions = [c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") != "Healthy"]
                body["status"] = {**(body.get("status") or {}), "conditions": conditions}
                await self.store.replace_status(body)
                log.info(logs.event("cleaned up health-checked WorkloadEntry", entry=where, periodic=periodic))
        except Conflict:
            pass  # changed meanwhile (reconnected): the next sweep looks again

    def health(self, registered: Registered, healthy: bool, message: str) -> None:
        """A HealthInformation request: the entry's Healthy condition, as istiod's health controller."""
        if not self.health_checks:
            return
        self._spawn(self._update_health(registered, healthy, message, _now()))

    async def _update_health(self, registered: Registered, healthy: bool, message: str, at: datetime) -> None:
        assert self.store is not None
        for _ in range(5):
            body = await self.store.get(registered.namespace, registered.name)
            if body is None:
                log.warning(logs.event("health of a WorkloadEntry not found", entry=f"{registered.namespace}/{registered.name}"))
                return
            if _annotations(body).get(CONTROLLER_ANNOTATION) != self.instance:
                return  # reconnected to another istiod
            previous = _healthy_condition(body)
            if previous is not None and (_parse(previous.get("lastProbeTime")) or at) > at:
                return
            condition = {"type": "Healthy", "status": "True" if healthy else "False",
                         "lastProbeTime": _format(at), "lastTransitionTime": _format(at)}
            if not healthy:
                condition["message"] = message
            status = body.get("status") or {}
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Healthy"]
            body["status"] = {**status, "conditions": [*conditions, condition]}
            try:
                await self.store.replace_status(body)
            except Conflict:
                continue
            log.info(logs.event("WorkloadEntry health", entry=f"{registered.namespace}/{registered.name}",
                                healthy=healthy, message=message or None))
            return

    async def sweep(self) -> None:
        """Istio's periodicWorkloadEntryCleanup: entries whose proxies went with the istiod they used."""
        if self.store is None:
            return
        for body in await self.store.list():
            if self._expired(body):
                await self._clean_up(body, periodic=True)

    async def run(self) -> None:
        """The periodic sweep, every ten grace periods as istiod's."""
        while True:
            await asyncio.sleep(10 * self.grace)
            try:
                await self.sweep()
            except Exception as error:  # an API error: the next sweep tries again
                log.warning(logs.event("WorkloadEntry cleanup failed", error=str(error)))

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(self._logged(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _logged(work: Any) -> None:
        try:
            await work
        except Exception as error:  # an API error: one line, the entry keeps its last state
            log.warning(logs.event("WorkloadEntry update failed", error=str(error)))


def _healthy_condition(body: Mapping[str, Any]) -> dict[str, Any] | None:
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Healthy"), None)


# An xDS worker process's connections, told to the main process's controller over the worker's pipe.
@dataclass(frozen=True, slots=True)
class Connected:
    proxy: Proxy
    connection: str
    at: datetime


@dataclass(frozen=True, slots=True)
class Disconnected:
    registered: Registered
    connection: str
    connected_at: datetime


@dataclass(frozen=True, slots=True)
class Health:
    registered: Registered
    healthy: bool
    message: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """A RegistrationError as it crosses the pipe."""

    code: str  # a grpc.StatusCode's name
    message: str


Question = Connected | Disconnected | Health


async def answer(controller: Registrar, question: Question) -> Registered | Refusal | None:
    """The main process's side: the controller's answer to a worker's question."""
    if isinstance(question, Connected):
        try:
            return await controller.connected(question.proxy, question.connection, question.at)
        except RegistrationError as refused:
            return Refusal(refused.code.name, str(refused))
    if isinstance(question, Disconnected):
        controller.disconnected(question.registered, question.connection, question.connected_at)
    else:
        controller.health(question.registered, question.healthy, question.message)
    return None


class RemoteRegistrar:
    """A worker's Registrar: each call asks the main process (`ask` sends a question and awaits its answer)."""

    def __init__(self, ask: Callable[[Question], Awaitable[Any]]) -> None:
        self.ask = ask
        self._tasks: set[asyncio.Future[Any]] = set()

    async def connected(self, proxy: Proxy, connection: str, at: datetime) -> Registered | None:
        if not proxy.auto_register_group and not proxy.workload_entry:
            return None  # no need to ask
        answered = await self.ask(Connected(proxy, connection, at))
        if isinstance(answered, Refusal):
            raise RegistrationError(grpc.StatusCode[answered.code], answered.message)
        assert answered is None or isinstance(answered, Registered)
        return answered

    def disconnected(self, registered: Registered, connection: str, connected_at: datetime) -> None:
        self._tell(Disconnected(registered, connection, connected_at))

    def health(self, registered: Registered, healthy: bool, message: str) -> None:
        self._tell(Health(registered, healthy, message))

    def _tell(self, question: Question) -> None:
        task: asyncio.Future[Any] = asyncio.ensure_future(self.ask(question))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
