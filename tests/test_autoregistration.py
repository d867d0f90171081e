"""WorkloadEntry auto-registration and health (istiod/autoregistration.py) against an in-memory
store of entries; the real API server's side is e2e/test_workload_groups.py. Also WorkloadGroup's
validation and the registry's reading of an entry's health."""

from __future__ import annotations

import asyncio
import copy
from datetime import datetime, timedelta, timezone
from typing import Any

import grpc
import pytest

from istiod.autoregistration import (
    CONNECTED_ANNOTATION, CONTROLLER_ANNOTATION, DISCONNECTED_ANNOTATION, GROUP_ANNOTATION, Conflict,
    RegistrationError, WorkloadEntryController, entry_name,
)
from istiod.model.config import ConfigSet
from istiod.model.probe import HttpGet, ProbeError, parse_readiness_probe
from istiod.model.proxy import proxy_from_node
from istiod.model.service import Locality
from istiod.sources.fields import ConversionError, ObjectKey, _Fields
from istiod.sources.istio.networking import workload_entry, workload_group

NS = "vms"
GROUP = {"apiVersion": "networking.istio.io/v1", "kind": "WorkloadGroup",
         "metadata": {"name": "db", "namespace": NS, "uid": "u-1"},
         "spec": {"metadata": {"labels": {"app": "db"}, "annotations": {"team": "data"}},
                  "template": {"serviceAccount": "db", "ports": {"tcp": 5432}, "labels": {"tier": "x"}},
                  "probe": {"httpGet": {"port": 8080, "path": "/ready"}, "periodSeconds": 2}}}


def _group(body: dict[str, Any]) -> Any:
    key = ObjectKey("WorkloadGroup", body["metadata"]["namespace"], body["metadata"]["name"])
    return workload_group(key, _Fields(key, body), "cluster.local")


def _proxy(group: str = "db", verified: bool = True, account: str = "db", probe: bool = True, **metadata: Any) -> Any:
    meta = {"AUTO_REGISTER_GROUP": group, "LABELS": {"version": "v1"}, "NETWORK": "vm-net", **metadata}
    if probe:
        meta["PROXY_CONFIG"] = {"readinessProbe": {"tcpSocket": {"port": 5432}}}
    proxy = proxy_from_node(f"sidecar~10.9.0.4~db-vm.{NS}~{NS}.svc.cluster.local", meta, Locality("eu", "a"))
    return proxy.__class__(**{**{f: getattr(proxy, f) for f in proxy.__dataclass_fields__},
                              "verified": verified, "verified_service_account": account})


class Entries:
    """The API server's keeping of WorkloadEntries: resourceVersions, conflicts, status apart."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 0

    def _key(self, body: dict[str, Any]) -> tuple[str, str]:
        return body["metadata"]["namespace"], body["metadata"]["name"]

    def _stored(self, body: dict[str, Any]) -> None:
        self.version += 1
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(self.version)
        self.objects[self._key(body)] = body

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((namespace, name))
        return copy.deepcopy(found) if found else None

    async def list(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for o in self.objects.values()]

    async def create(self, body: dict[str, Any]) -> None:
        if self._key(body) in self.objects:
            raise Conflict("exists")
        self._stored(body)

    async def replace(self, body: dict[str, Any]) -> None:
        current = self.objects[self._key(body)]
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise Conflict("changed")
        self._stored({**body, "status": current.get("status")})

    async def replace_status(self, body: dict[str, Any]) -> None:
        current = self.objects[self._key(body)]
        self._stored({**current, "status": body["status"]})

    async def delete(self, namespace: str, name: str, resource_version: str) -> None:
        self.objects.pop((namespace, name), None)


def _controller(entries: Entries | None, grace: float = 0.05) -> WorkloadEntryController:
    config = ConfigSet(workload_groups=(_group(GROUP),))
    return WorkloadEntryController(entries, lambda: config, "istiod-a", grace=grace)


NOW = datetime(2026, 12, 5, 10, 0, tzinfo=timezone.utc)


async def test_a_connecting_proxy_registers_an_entry_made_from_its_group() -> None:
    entries = Entries()
    controller = _controller(entries)
    proxy = _proxy()
    assert entry_name(proxy) == "db-10.9.0.4-vm-net"
    registered = await controller.connected(proxy, "c1", NOW)
    assert registered is not None and registered.auto
    entry = entries.objects[(NS, "db-10.9.0.4-vm-net")]
    assert entry["spec"] == {"address": "10.9.0.4", "ports": {"tcp": 5432},
                             "labels": {"tier": "x", "app": "db", "version": "v1"}, "network": "vm-net",
                             "locality": "eu/a", "serviceAccount": "db"}
    annotations = entry["metadata"]["annotations"]
    assert annotations[GROUP_ANNOTATION] == "db" and annotations["team"] == "data"
    assert annotations[CONTROLLER_ANNOTATION] == "istiod-a"
    assert annotations[CONNECTED_ANNOTATION] == "2026-12-05T10:00:00.000000Z"
    assert annotations["proxy.istio.io/health-checks-enabled"] == "true"
    assert entry["metadata"]["ownerReferences"] == [{"apiVersion": "networking.istio.io/v1", "kind": "WorkloadGroup",
                                                     "name": "db", "uid": "u-1", "controller": True}]

    # Healthy, then not: the entry's status says so, with the agent's message.
    controller.health(registered, True, "")
    await asyncio.sleep(0.01)
    assert entries.objects[(NS, "db-10.9.0.4-vm-net")]["status"]["conditions"][0]["status"] == "True"
    controller.health(registered, False, "connection refused")
    await asyncio.sleep(0.01)
    (condition,) = entries.objects[(NS, "db-10.9.0.4-vm-net")]["status"]["conditions"]
    assert (condition["type"], condition["status"], condition["message"]) == ("Healthy", "False", "connection refused")

    # A second stream of the same proxy; the entry is disconnected only when both ended, then deleted.
    await controller.connected(proxy, "c2", NOW + timedelta(seconds=1))
    controller.disconnected(registered, "c1", NOW)
    await asyncio.sleep(0.1)
    assert CONNECTED_ANNOTATION in entries.objects[(NS, "db-10.9.0.4-vm-net")]["metadata"]["annotations"]
    controller.disconnected(registered, "c2", NOW + timedelta(seconds=1))
    await asyncio.sleep(0.02)
    assert DISCONNECTED_ANNOTATION in entries.objects[(NS, "db-10.9.0.4-vm-net")]["metadata"]["annotations"]
    await asyncio.sleep(0.2)
    assert (NS, "db-10.9.0.4-vm-net") not in entries.objects


async def test_a_reconnect_within_the_grace_period_keeps_the_entry() -> None:
    entries = Entries()
    controller = _controller(entries, grace=0.2)
    registered = await controller.connected(_proxy(), "c1", NOW)
    assert registered is not None
    controller.disconnected(registered, "c1", NOW)
    await asyncio.sleep(0.05)
    await controller.connected(_proxy(), "c2", datetime.now(timezone.utc))
    await asyncio.sleep(0.3)
    annotations = entries.objects[(NS, registered.name)]["metadata"]["annotations"]
    assert CONNECTED_ANNOTATION in annotations and DISCONNECTED_ANNOTATION not in annotations


@pytest.mark.parametrize(("proxy", "code", "message"), [
    (_proxy(verified=False), grpc.StatusCode.PERMISSION_DENIED, "registration of WorkloadEntry requires a verified identity"),
    (_proxy(account="web"), grpc.StatusCode.PERMISSION_DENIED,
     'registration of WorkloadEntry service account mismatch: "web" vs "db"'),
    (_proxy(group="nope"), grpc.StatusCode.FAILED_PRECONDITION, "cannot find WorkloadGroup vms/nope"),
])
async def test_a_proxy_that_may_not_register_is_refused(proxy: Any, code: grpc.StatusCode, message: str) -> None:
    entries = Entries()
    with pytest.raises(RegistrationError) as refused:
        await _controller(entries).connected(proxy, "c1", NOW)
    assert refused.value.code is code and message in str(refused.value)
    assert not entries.objects


async def test_registration_without_the_kubernetes_api_is_refused_and_other_proxies_are_not_concerned() -> None:
    controller = _controller(None)
    with pytest.raises(RegistrationError) as refused:
        await controller.connected(_proxy(), "c1", NOW)
    assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "registration needs the Kubernetes API" in str(refused.value)
    assert await controller.connected(_proxy(group=""), "c2", NOW) is None


async def test_an_existing_health_checked_entry_is_controlled_by_its_proxy() -> None:
    entries = Entries()
    await entries.create({"metadata": {"name": "vm-1", "namespace": NS,
                                       "annotations": {"proxy.istio.io/health-checks-enabled": "true"}},
                          "spec": {"address": "10.9.0.4", "serviceAccount": "db"}})
    await entries.create({"metadata": {"name": "vm-2", "namespace": NS}, "spec": {"address": "10.9.0.5"}})
    controller = _controller(entries)
    registered = await controller.connected(_proxy(group="", WORKLOAD_ENTRY="vm-1"), "c1", NOW)
    assert registered is not None and not registered.auto
    assert entries.objects[(NS, "vm-1")]["metadata"]["annotations"][CONTROLLER_ANNOTATION] == "istiod-a"
    assert await controller.connected(_proxy(group="", WORKLOAD_ENTRY="vm-2"), "c2", NOW) is None  # not health-checked
    with pytest.raises(RegistrationError, match="WorkloadEntry vms/vm-3 is not found"):
        await controller.connected(_proxy(group="", WORKLOAD_ENTRY="vm-3"), "c3", NOW)
    # Disconnected past the grace period: its health condition is removed, the entry stays.
    controller.health(registered, True, "")
    await asyncio.sleep(0.01)
    controller.disconnected(registered, "c1", NOW)
    await asyncio.sleep(0.2)
    assert entries.objects[(NS, "vm-1")]["status"]["conditions"] == []


async def test_the_sweep_removes_entries_left_disconnected_by_another_istiod() -> None:
    entries = Entries()
    old = (datetime.now(timezone.utc) - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    await entries.create({"metadata": {"name": "db-10.9.0.9", "namespace": NS, "annotations": {
        GROUP_ANNOTATION: "db", DISCONNECTED_ANNOTATION: old, CONTROLLER_ANNOTATION: "istiod-gone"}}, "spec": {}})
    await entries.create({"metadata": {"name": "manual", "namespace": NS}, "spec": {}})
    await _controller(entries).sweep()
    assert list(entries.objects) == [(NS, "manual")]


def test_workload_group_validation() -> None:
    group = _group(GROUP)
    assert group.labels == (("app", "db"),) and group.template.service_account == "db"
    assert group.probe is not None and group.probe.method == HttpGet(8080, "/ready") and group.probe.period == 2
    for spec, message in (
        ({"metadata": {"labels": {"app": "db"}}}, "spec.template: template is required"),
        ({"template": {}, "probe": {"httpGet": {"port": 70000}}}, "port number 70000 must be in the range 1..65535"),
        ({"template": {}, "probe": {"periodSeconds": -1, "tcpSocket": {"port": 1}}}, "periodSeconds must be non-negative"),
        ({"template": {}, "probe": {}}, "exactly one of httpGet, tcpSocket or exec is required"),
        ({"template": {}, "probe": {"exec": {"command": []}}}, "exec.command is required"),
        ({"template": {}, "probe": {"httpGet": {"port": 1, "scheme": "FTP"}}}, 'httpGet.scheme must be one of "HTTPS", "HTTP"'),
        ({"template": {"address": "not an address!"}}, "is not a valid FQDN or an IP address"),
        ({"template": {}, "metadata": {"labels": {"bad key!": "x"}}}, "invalid label key"),
    ):
        with pytest.raises(ConversionError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            _group({**GROUP, "spec": spec})


def test_probe_defaults_are_pilot_agents() -> None:
    probe = parse_readiness_probe({"tcpSocket": {"port": 22}})
    assert (probe.initial_delay, probe.timeout, probe.period, probe.success_threshold, probe.failure_threshold) == (0, 1, 10, 1, 1)
    with pytest.raises(ProbeError, match="grpc"):
        parse_readiness_probe({"grpc": {"port": 1}})


def test_an_entry_with_health_checks_counts_only_while_its_condition_is_true() -> None:
    def entry(annotations: dict[str, str], conditions: list[dict[str, str]]) -> Any:
        body = {"apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry",
                "metadata": {"name": "vm", "namespace": NS, "annotations": annotations},
                "spec": {"address": "10.9.0.4"}, "status": {"conditions": conditions}}
        key = ObjectKey("WorkloadEntry", NS, "vm")
        return workload_entry(key, _Fields(key, body), "cluster.local")

    checked = {"proxy.istio.io/health-checks-enabled": "true"}
    assert entry({}, []).healthy
    assert not entry(checked, []).healthy  # unhealthy until a probe succeeded
    assert entry(checked, [{"type": "Healthy", "status": "True"}]).healthy
    assert not entry(checked, [{"type": "Healthy", "status": "False"}]).healthy
    assert entry({"proxy.istio.io/health-checks-enabled": "false"}, [{"type": "Healthy", "status": "False"}]).healthy
