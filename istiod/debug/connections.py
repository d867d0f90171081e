"""The debug questions about xDS connections, answered by each process that serves some, and the
answers of several processes combined (with --xds-workers, the main process's and every worker's).

An answer is JSON-ready or a model value, so it pickles between processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from istiod import metrics
from istiod.debug import views
from istiod.debug.config_dump import config_dump, sync_diff
from istiod.debug.csds import QUERY_GENERATOR, client_config
from istiod.xds.connection import Connection
from istiod.xds.monitor import MAX_PUSH_ERRORS, PushStatus

# csds: each proxy's serialized ClientConfig (the xDS type istio.io/debug/syncz)
Kind = Literal["adsz", "connections", "syncz", "csds", "config_dump", "sync_diff", "push_status", "metrics"]
_BY_PROXY = {"config_dump": config_dump, "sync_diff": sync_diff}


@dataclass(frozen=True, slots=True)
class Question:
    kind: Kind
    proxy_id: str = ""  # config_dump and sync_diff: a proxy ID, connection ID or `<pod>.<namespace>`


class Unanswered(Exception):
    """A process that serves connections did not answer: the view would be incomplete."""


def answer(question: Question, connections: Mapping[str, Connection], last_push: PushStatus | None) -> Any:
    """This process's answer, from its own connections."""
    kind = question.kind
    if kind in ("adsz", "connections"):
        return [views.ads_client(c, detail=kind == "adsz") for c in connections.values()]
    if kind == "syncz":
        return [views.sync_json(c) for c in connections.values() if c.proxy.generator != QUERY_GENERATOR]
    if kind == "csds":
        return [config for config in map(client_config, connections.values()) if config is not None]
    if kind in _BY_PROXY:
        connection = views.find_connection(connections, question.proxy_id)
        return None if connection is None else (connection.connected_at, _BY_PROXY[kind](connection))
    if kind == "push_status":
        return last_push
    return metrics.connection_families()


def combined(question: Question, answers: Sequence[Any]) -> Any:
    """One answer from every process's (the main process's first)."""
    kind = question.kind
    if kind in ("adsz", "connections"):
        clients = sorted((c for one in answers for c in one), key=lambda c: c["connectionId"])
        return {"totalClients": len(clients), "clients": clients}
    if kind == "syncz":
        return sorted((s for one in answers for s in one), key=lambda s: s["connection_id"])
    if kind == "csds":
        return [config for one in answers for config in one]
    if kind in _BY_PROXY:  # the newest connection of the proxy, whichever process holds it
        found = [one for one in answers if one is not None]
        return max(found, key=lambda one: one[0])[1] if found else None
    if kind == "push_status":
        return _push_status(answers[0], answers[1:])
    return answers


def _push_status(main: PushStatus | None, others: Sequence[PushStatus | None]) -> PushStatus | None:
    """The main process's last push, with the proxies every process pushed it to. Another process
    that has not applied it yet (its last push is an older one) still has it in progress."""
    if main is None:
        return None
    status = main
    for other in others:
        if other is None or other.version != main.version:
            status = dataclasses.replace(status, end=None)
            continue
        status = dataclasses.replace(
            status,
            proxies_connected=status.proxies_connected + other.proxies_connected,
            proxies_pushed=status.proxies_pushed + other.proxies_pushed,
            responses_sent=status.responses_sent + other.responses_sent,
            end=None if status.end is None or other.end is None else max(status.end, other.end),
            errors=(*status.errors, *other.errors)[:MAX_PUSH_ERRORS],
        )
    return status
