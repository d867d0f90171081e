"""`istiod cni`: the istio-cni node agent, assembled. Pods and namespaces come from the config dir
or from two informers (this node's pods only); the reconciler runs its first pass, then ztunnel is
served (so its first snapshot is complete), then the plugin's endpoint, then the CNI config is
chained in. SIGTERM takes the plugin out of the CNI config and stops; captured pods stay captured
(ztunnel keeps serving them, and the next agent's snapshot takes them over)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from kubernetes_asyncio import client

from istiod.agent.agent import run_until_signalled
from istiod.cni.agent import NodeAgent
from istiod.cni.install import CniInstall
from istiod.cni.pluginevents import EVENT_SOCKET, serve
from istiod.cni.settings import CniSettings
from istiod.cni.zds import ZdsServer
from istiod.sources.configdir import ConfigDirSource
from istiod.sources.kube import Informer, KubeWriter
from istiod.sources.namespaces import NamespaceFilter
from istiod.sources.store import Store

log = logging.getLogger(__name__)


class NodeSource:
    """The kube informers the node agent needs: namespaces, and the pods scheduled on its node."""

    def __init__(self, api: client.ApiClient, store: Store, node: str) -> None:
        core = client.CoreV1Api(api)
        writer = KubeWriter(store, NamespaceFilter())
        pods = functools.partial(core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}")
        self.informers = [Informer("Namespace", core.list_namespace, writer), Informer("Pod", pods, writer)]
        self.synced = asyncio.Event()

    async def run(self) -> None:
        tasks = [asyncio.create_task(i.run(), name=f"informer-{i.kind}") for i in self.informers]
        try:
            await asyncio.gather(*(i.synced.wait() for i in self.informers))
            self.synced.set()
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def run_cni(settings: CniSettings) -> int:
    from kubernetes_asyncio.config import ConfigException

    try:
        return await run_until_signalled(lambda stop: _run(settings, stop))
    except (OSError, ConfigException) as error:  # a socket that cannot be served, a bad kubeconfig
        log.error("istio-cni node agent: %s", error)
        return 1


async def _run(settings: CniSettings, stop: asyncio.Event) -> int:
    from istiod.cni.annotate import KubeAnnotator
    from istiod.kubeapi import api_client

    store = Store()
    api = None
    source: ConfigDirSource | NodeSource
    if settings.config_dir is not None:
        source, annotator = ConfigDirSource(settings.config_dir, store), None
        log.info("pods from %s: captured pods are not annotated (no Kubernetes API to write to)", settings.config_dir)
    else:
        api = await api_client(settings.kubeconfig)
        source, annotator = NodeSource(api, store, settings.node_name), KubeAnnotator(api)
    zds = ZdsServer(settings.ztunnel_socket, settings.ack_timeout)
    agent = NodeAgent(settings.node_name, store, zds, annotator, settings.netns_dir, settings.dns_capture,
                      settings.resync)
    install = CniInstall(settings.conf_dir, settings.conf_name, settings.bin_dir, (
        ("log_level", settings.log_level), ("cni_agent_run_dir", str(settings.run_dir)), ("ambient_enabled", True),
        ("exclude_namespaces", list(settings.exclude_namespaces))))
    started = asyncio.Event()
    tasks = [asyncio.create_task(source.run(), name="source"),
             asyncio.create_task(agent.run(source.synced, started), name="reconciler")]
    runner = None
    try:
        waiting = asyncio.create_task(started.wait())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([waiting, stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if started.is_set() and not stop.is_set():
            tasks.append(asyncio.create_task(zds.run(agent), name="zds"))
            runner = await serve(agent, settings.run_dir / EVENT_SOCKET)
            install.install_binary()
            if settings.chained:
                tasks.append(asyncio.create_task(install.keep_installed(), name="cni-config"))
            log.info("istio-cni node agent on node %s ready: %d pods captured", settings.node_name, len(agent.captured))
            await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        for task in failed:
            log.error("%s failed: %s", task.get_name(), task.exception())
        return 1 if failed else 0
    finally:
        # The plugin leaves the CNI config first (its keeper stopped so it cannot add it back): the
        # other tasks may take a while to stop, and a runtime must not call a plugin nobody serves.
        keeper = [t for t in tasks if t.get_name() == "cni-config"]
        for task in keeper:
            task.cancel()
        await asyncio.gather(*keeper, return_exceptions=True)
        if settings.chained:
            with contextlib.suppress(OSError):
                install.uninstall()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if runner is not None:
            await runner.cleanup()
        if api is not None:
            await api.close()
