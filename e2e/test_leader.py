"""Leader election with istiod's ConfigMap lock against the real API: one leader at a time, a
hand-over when the leader lets go, a lock taken by another or left to lapse, and renewals the API
refuses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from e2e.harness import Cluster
from e2e.kube_objects import ensure_namespace
from e2e.test_rbac import token_kubeconfig
from istiod.kubeapi import api_client
from istiod.leader import RECORD, LeaderElection, LeaseTimings
from tests.peers import eventually

NS = "e2e-leader"
TIMINGS = LeaseTimings(duration=2.0, renew_deadline=1.5, retry_period=0.25)


class Candidate:
    """One replica: its election, and whether its leader's work is running right now."""

    def __init__(self, api: client.ApiClient, lease: str, identity: str) -> None:
        self.election = LeaderElection(api, NS, lease, identity, TIMINGS)
        self.working = False
        self.terms = 0
        self.task: asyncio.Task[None] | None = None

    async def work(self) -> None:
        self.working, self.terms = True, self.terms + 1
        try:
            await asyncio.Future()
        finally:
            self.working = False

    def start(self) -> None:
        self.task = asyncio.create_task(self.election.run(self.work))

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@contextlib.asynccontextmanager
async def running(*candidates: Candidate) -> AsyncIterator[None]:
    for candidate in candidates:
        candidate.start()
    try:
        yield
    finally:
        for candidate in candidates:
            if candidate.task is not None and not candidate.task.done():
                await candidate.stop()


async def timed(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `check` holds (tests.peers.eventually polling every 20 ms)."""
    start = time.monotonic()
    await eventually(check, timeout, what, interval=0.02)
    return time.monotonic() - start


async def record(kube: client.ApiClient, name: str) -> dict[str, Any]:
    """The leader record, as client-go (and istiod) read it from the lock's annotation."""
    configmap = await client.CoreV1Api(kube).read_namespaced_config_map(name, NS)
    return json.loads(configmap.metadata.annotations[RECORD])


async def rewrite(kube: client.ApiClient, name: str, change: Callable[[client.V1ConfigMap], object]) -> None:
    """Another writer: the lock's ConfigMap read, changed and written back."""
    core = client.CoreV1Api(kube)
    configmap = await core.read_namespaced_config_map(name, NS)
    change(configmap)
    await core.replace_namespaced_config_map(name, NS, configmap)


async def test_one_leader_then_a_hand_over(kube: client.ApiClient) -> None:
    await ensure_namespace(kube, NS)
    a, b = Candidate(kube, "hand-over", "a"), Candidate(kube, "hand-over", "b")
    async with running(a):
        await eventually(lambda: a.working, 5, "a to lead")
        async with running(b):
            await asyncio.sleep(1.0)  # b tries four times
            assert a.working and not b.working
            held = await record(kube, "hand-over")
            assert (held["holderIdentity"], held["holderKey"], held["leaderTransitions"],
                    held["leaseDurationSeconds"]) == ("a", "default", 0, 2)
            await a.stop()  # releases the lock on the way out
            assert not a.working and (await record(kube, "hand-over"))["holderIdentity"] == ""
            took = await timed(lambda: b.working, 1.0, "b to take over")
            print(f"hand-over in {took:.2f}s")
            held = await record(kube, "hand-over")
            assert (held["holderIdentity"], held["leaderTransitions"]) == ("b", 1)


async def test_a_release_that_finds_the_lock_moved_on_still_releases(kube: client.ApiClient) -> None:
    """A renewal cancelled in flight can land just before the release, which then conflicts: the
    release reads the lock again and, the record still being its own, releases it."""
    await ensure_namespace(kube, NS)
    a = Candidate(kube, "moved-on", "a")
    async with running(a):
        await eventually(lambda: a.working, 5, "a to lead")
        await rewrite(kube, "moved-on", lambda c: setattr(c.metadata, "labels", {"touched": "yes"}))  # a's record, newer
        await a.stop()
        assert (await record(kube, "moved-on"))["holderIdentity"] == ""


async def test_a_lock_taken_by_another_ends_leadership_and_lapses_back(kube: client.ApiClient) -> None:
    await ensure_namespace(kube, NS)
    a = Candidate(kube, "stolen", "a")
    async with running(a):
        await eventually(lambda: a.working, 5, "a to lead")
        await rewrite(kube, "stolen", lambda c: c.metadata.annotations.update({RECORD: json.dumps(
            {**json.loads(c.metadata.annotations[RECORD]), "holderIdentity": "intruder"})}))
        await eventually(lambda: not a.working, TIMINGS.retry_period * 3, "a to stop at its next renewal")
        # The intruder never renews: a whole lease duration later, a takes the lock again.
        took = await timed(lambda: a.working, TIMINGS.duration + 1.0, "a to lead again")
        assert took >= TIMINGS.duration - TIMINGS.retry_period and a.terms == 2
        assert (await record(kube, "stolen"))["holderIdentity"] == "a"


async def test_renewals_the_api_refuses_end_leadership_by_the_deadline(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path
) -> None:
    """A replica whose RBAC is withdrawn while it leads: 403 on every renewal, so it stops within the renew
    deadline, before the lease duration could let another replica in."""
    await ensure_namespace(kube, NS)
    core, rbac = client.CoreV1Api(kube), client.RbacAuthorizationV1Api(kube)
    await core.create_namespaced_service_account(NS, {"metadata": {"name": "elector"}})
    await rbac.create_namespaced_role(NS, {"metadata": {"name": "elector"}, "rules": [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "update"]}]})
    binding = {"metadata": {"name": "elector"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                            "name": "elector"},
               "subjects": [{"kind": "ServiceAccount", "name": "elector", "namespace": NS}]}
    await rbac.create_namespaced_role_binding(NS, binding)
    token = await core.create_namespaced_service_account_token("elector", NS, {"spec": {"expirationSeconds": 600}})
    async with await api_client(token_kubeconfig(cluster, token.status.token, tmp_path / "kubeconfig")) as api:
        a = Candidate(api, "refused", "a")
        async with running(a):
            await eventually(lambda: a.working, 5, "a to lead")
            await rbac.delete_namespaced_role_binding("elector", NS)
            took = await timed(lambda: not a.working, TIMINGS.renew_deadline + TIMINGS.retry_period + 0.5,
                               "a to stop leading")
            print(f"stopped {took:.2f}s after losing its RBAC")
            assert (await record(kube, "refused"))["holderIdentity"] == "a"  # lost, so nothing to hand back


async def test_the_default_revision_takes_the_lock_from_another_revision(kube: client.ApiClient) -> None:
    """istiod's prioritized election: revisions share the lock; the one `istio-revision-tag-default`
    names takes it from another revision at once, and a third never steals."""
    await ensure_namespace(kube, NS)
    admission = client.AdmissionregistrationV1Api(kube)
    slow = LeaseTimings(duration=60.0, renew_deadline=1.5, retry_period=0.25)  # a lapse would take a minute
    canary = Candidate(kube, "revisions", "canary-pod")
    canary.election = LeaderElection(kube, NS, "revisions", "canary-pod", slow, key="py")
    async with running(canary):
        await eventually(lambda: canary.working, 5, "the py revision to lead")
        assert (await record(kube, "revisions"))["holderKey"] == "py"
        other = Candidate(kube, "revisions", "other-pod")
        other.election = LeaderElection(kube, NS, "revisions", "other-pod", slow, key="stable")
        await admission.create_mutating_webhook_configuration({
            "metadata": {"name": "istio-revision-tag-default", "labels": {"istio.io/rev": "stable"}}, "webhooks": []})
        try:
            async with running(other):
                await eventually(lambda: other.working and not canary.working, 5, "the default revision to take over")
                taken = await record(kube, "revisions")
                print("record after the takeover:", taken)
                assert (taken["holderKey"], taken["holderIdentity"]) == ("stable", "other-pod")
                await asyncio.sleep(1.0)  # four retry periods: py does not take it back
                assert other.working and not canary.working
        finally:
            await admission.delete_mutating_webhook_configuration("istio-revision-tag-default")
