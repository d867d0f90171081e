"""The node agent's reconciler: the ambient pods of this node, captured and handed to ztunnel.

Desired state comes from the store (pods of this node and their namespaces, fed by the informers or
the config dir); actual state is what this agent captured. Each pass brings them together: a pod
entering ambient gets the in-pod rules, goes to ztunnel over ZDS, then is annotated; a pod leaving
(deleted, opted out, its network namespace gone, or deleted through the CNI plugin) is told to
ztunnel, its rules removed and its annotation cleared. Failures are logged once per pod and retried
on the next pass. On startup, rules left in pods that are no longer ambient are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from istiod.agent.iptables import IptablesError
from istiod.cni import redirect
from istiod.cni.membership import NodePod, PodKey, node_pods
from istiod.cni.netns import NetnsError, NetnsIndex
from istiod.cni.zds import ZdsError, ZdsWorkload
from istiod.sources.kube import API_ERRORS, describe_error
from istiod.sources.store import Change, Store

log = logging.getLogger(__name__)


class CaptureError(Exception):
    """A pod could not be captured or handed to ztunnel; the message names the pod and why."""


class Annotator(Protocol):
    async def mark(self, namespace: str, name: str, enabled: bool) -> None: ...


class Ztunnel(Protocol):
    @property
    def connected(self) -> bool: ...

    async def add(self, workload: ZdsWorkload) -> None: ...

    async def delete(self, uid: str) -> None: ...


@dataclass
class Captured:
    pod: NodePod
    netns: str
    handed: bool = False  # ztunnel acked its AddWorkload

    def workload(self) -> ZdsWorkload:
        return ZdsWorkload(self.pod.uid, self.pod.name, self.pod.namespace, self.pod.service_account, self.netns)


class NodeAgent:
    def __init__(self, node: str, store: Store, ztunnel: Ztunnel, annotator: Annotator | None, netns_dir: Path,
                 dns_capture: bool = True, resync: float = 5.0, pod_wait: float = 10.0) -> None:
        self.node = node
        self.store = store
        self.ztunnel = ztunnel
        self.annotator = annotator
        self.netns_dir = netns_dir
        self.dns_capture = dns_capture
        self.resync = resync
        self.pod_wait = pod_wait  # how long a CNI ADD waits for the informer to show its pod
        self.captured: dict[PodKey, Captured] = {}
        self.plugin_netns: dict[PodKey, str] = {}  # network namespaces the CNI plugin named
        self.released: set[PodKey] = set()  # deleted through the plugin while the pod object lives on
        self.lock = asyncio.Lock()
        self.changed = asyncio.Event()
        self._errors: dict[PodKey, str] = {}  # the last error logged per pod: each is logged once
        self._netns = NetnsIndex(netns_dir)
        store.subscribe(self._on_change)

    def _on_change(self, change: Change) -> None:
        if change.key.kind in ("Pod", "Namespace"):
            self.changed.set()

    # What the ZDS server sends on every new ztunnel connection, and learns back.
    def snapshot(self) -> list[ZdsWorkload]:
        return [c.workload() for c in self.captured.values()]

    def handed(self, uid: str, error: str) -> None:
        self.changed.set()  # annotate it without waiting for the next pass
        for key, captured in self.captured.items():
            if captured.pod.uid == uid:
                captured.handed = not error
                if error:
                    self._report(key, f"ztunnel did not take it: {error}")

    async def run(self, synced: asyncio.Event, started: asyncio.Event | None = None) -> None:
        await synced.wait()
        await self.reconcile(startup=True)
        if started is not None:
            started.set()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), self.resync)
            self.changed.clear()
            await self.reconcile()

    async def reconcile(self, startup: bool = False) -> None:
        async with self.lock:
            pods = node_pods(self.store, self.node)
            self._netns = NetnsIndex(self.netns_dir)  # read at most once per pass
            self.released &= pods.keys()
            for key in list(self.captured):
                pod, captured = pods.get(key), self.captured[key]
                why = self._leaving(pod, captured)
                if why:
                    await self._release(key, pod, why)
            for key, pod in pods.items():
                if not pod.ambient or key in self.released:
                    if startup or pod.annotated and self.annotator is not None:
                        await self._clean_stale(pod)
                    continue
                try:
                    await self._ensure(pod)
                except CaptureError as error:
                    self._report(key, str(error))

    def _leaving(self, pod: NodePod | None, captured: Captured) -> str:
        if pod is None:
            return "deleted"
        if pod.uid != captured.pod.uid:
            return "replaced by a new pod of the same name"
        if pod.key in self.released:
            return "deleted through the CNI plugin"
        if not pod.ambient:
            return "no longer in the ambient mesh"
        if not os.path.exists(captured.netns):
            return f"its network namespace {captured.netns} is gone"
        return ""

    async def _ensure(self, pod: NodePod, plugin: bool = False) -> None:
        """Capture, hand over and annotate one ambient pod, as far as it is not yet; CaptureError if stuck.

        For the plugin's ADD, the pod must be with ztunnel before the call returns; otherwise what
        cannot be done yet (no IP to find its namespace by, no ztunnel) waits for the next pass."""
        captured = self.captured.get(pod.key)
        if captured is None:
            captured = await self._capture(pod)
            if captured is None:
                return
        captured.pod = pod
        if not captured.handed:
            if not self.ztunnel.connected:
                if not plugin:  # ztunnel's snapshot will carry it
                    return
                raise CaptureError(f"pod {_name(pod)}: captured, but no ztunnel is connected")
            try:
                await self.ztunnel.add(captured.workload())
            except ZdsError as error:
                raise CaptureError(f"pod {_name(pod)}: captured, but ztunnel did not take it: {error}") from None
            captured.handed = True
            log.info("pod %s handed to ztunnel", _name(pod))
        if self.annotator is not None and not pod.annotated:
            try:
                await self.annotator.mark(pod.namespace, pod.name, True)
            except API_ERRORS as error:
                raise CaptureError(f"pod {_name(pod)}: annotating it failed: {describe_error(error)}") from None
        self._errors.pop(pod.key, None)

    async def _capture(self, pod: NodePod) -> Captured | None:
        netns = self.plugin_netns.get(pod.key)
        if netns is None:
            if not pod.ip:
                return None  # not started yet: the plugin's ADD, or its IP, will name its namespace
            try:
                netns = await self._netns.find(pod.ip)
            except NetnsError as error:
                raise CaptureError(f"pod {_name(pod)}: no network namespace: {error}") from None
        try:
            await asyncio.to_thread(redirect.install, netns, self.dns_capture)
        except IptablesError as error:
            self.plugin_netns.pop(pod.key, None)
            raise CaptureError(f"pod {_name(pod)}: installing its redirection in {netns} failed: {error}") from None
        captured = self.captured[pod.key] = Captured(pod, netns)
        log.info("pod %s captured: redirection installed in %s", _name(pod), netns)
        return captured

    async def _release(self, key: PodKey, pod: NodePod | None, why: str) -> None:
        captured = self.captured.pop(key)
        self._errors.pop(key, None)
        if captured.handed and self.ztunnel.connected:
            try:
                await self.ztunnel.delete(captured.pod.uid)
            except ZdsError as error:  # its next snapshot leaves the pod out
                log.warning("pod %s: telling ztunnel of its removal failed: %s", _name(captured.pod), error)
        if os.path.exists(captured.netns):
            try:
                await asyncio.to_thread(redirect.remove, captured.netns)
            except IptablesError as error:
                log.error("pod %s: removing its redirection failed: %s", _name(captured.pod), error)
        if pod is not None and pod.annotated and self.annotator is not None:
            await self._unmark(pod)
        log.info("pod %s released: %s", _name(captured.pod), why)

    async def _clean_stale(self, pod: NodePod) -> None:
        """A pod not in the mesh that an earlier run of the agent may have left captured or annotated."""
        try:
            netns = self.plugin_netns.get(pod.key) or await self._netns.find(pod.ip)
            if await asyncio.to_thread(redirect.remove, netns):
                log.info("pod %s: removed redirection left from before (not in the ambient mesh)", _name(pod))
        except (NetnsError, IptablesError):
            pass  # nothing found to clean
        if pod.annotated and self.annotator is not None:
            await self._unmark(pod)

    async def _unmark(self, pod: NodePod) -> None:
        assert self.annotator is not None
        try:
            await self.annotator.mark(pod.namespace, pod.name, False)
        except API_ERRORS as error:
            self._report(pod.key, f"clearing its annotation failed: {describe_error(error)}")

    # The CNI plugin's calls (a sandbox is being made, or torn down).
    async def cni_add(self, namespace: str, name: str, netns: str) -> bool:
        """Capture a new pod before its containers start; False if it is not ambient. CaptureError if it fails."""
        key = (namespace, name)
        pod = await self._wait_pod(key)
        if not pod.ambient:
            return False
        if not os.path.exists(netns):
            message = f"pod {namespace}/{name}: network namespace {netns} does not exist"
            self._report(key, message)
            raise CaptureError(message)
        async with self.lock:
            self.released.discard(key)
            self.plugin_netns[key] = netns
            captured = self.captured.get(key)
            if captured is not None and captured.netns != netns:
                await self._release(key, pod, "a new sandbox replaces it")
            try:
                await self._ensure(pod, plugin=True)
            except CaptureError as error:
                self._report(key, str(error))
                raise
        return True

    async def cni_del(self, namespace: str, name: str) -> bool:
        """Release a pod whose sandbox is torn down; False if it was not captured."""
        key = (namespace, name)
        async with self.lock:
            self.plugin_netns.pop(key, None)
            if key not in self.captured:
                return False
            self.released.add(key)
            pods = node_pods(self.store, self.node)
            await self._release(key, pods.get(key), "deleted through the CNI plugin")
        return True

    async def _wait_pod(self, key: PodKey) -> NodePod:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.pod_wait
        while True:
            pod = node_pods(self.store, self.node).get(key)
            if pod is not None:
                return pod
            if loop.time() > deadline:
                raise CaptureError(f"pod {key[0]}/{key[1]} is not known on node {self.node} "
                                   f"after {self.pod_wait:g}s")
            await asyncio.sleep(0.05)

    def _report(self, key: PodKey, message: str) -> None:
        if self._errors.get(key) != message:
            self._errors[key] = message
            log.error("%s", message)


def _name(pod: NodePod) -> str:
    return f"{pod.namespace}/{pod.name}"
