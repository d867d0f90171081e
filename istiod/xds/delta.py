"""Incremental xDS (DeltaAggregatedResources): what to send a delta client, as pure steps over its state.

A delta connection keeps the same per-type WatchedResource as a state-of-the-world one, with `sent`
being everything the client holds after the last response (not just what that response carried),
so the debug views, proxy-status and NACK handling read both kinds alike. A response carries only
the resources whose content differs from `sent`, and the names that left.
"""

from __future__ import annotations

import sys
import time

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from istiod.model.snapshot import Snapshot
from istiod.xds import wire
from istiod.xds.cache import Resource
from istiod.xds.connection import Closed, StreamClosed, Held, WatchedResource

WILDCARD = "*"


def subscribe(
    watched: WatchedResource | None, request: discovery_pb2.DeltaDiscoveryRequest, max_names: int
) -> tuple[WatchedResource, bool]:
    """The watch after the request's subscription changes, and whether they change what it covers.

    A first request with no names is a wildcard (the legacy form Envoy uses for CDS and LDS), as is `*`.
    A client that reconnects says what it holds in `initial_resource_versions`: what still matches is
    taken as sent, so only what differs goes.
    """
    subscribed = list(dict.fromkeys(map(sys.intern, request.resource_names_subscribe)))
    if watched is None:
        # `*` subscribed and unsubscribed at once asks for nothing yet (ztunnel on demand: xDS has no other way).
        wildcard = (not subscribed or WILDCARD in subscribed) and WILDCARD not in request.resource_names_unsubscribe
        watched = WatchedResource(request.type_url, None if wildcard else [n for n in subscribed if n != WILDCARD])
        changed = True
    else:
        changed = False
        if watched.names is not None:
            if WILDCARD in subscribed:
                watched.names, changed = None, True
            else:
                held = set(watched.names)  # not a search of the list per name: 100k names would take minutes
                added = [n for n in subscribed if n not in held]
                watched.names.extend(added)
                changed = bool(added)
        unsubscribed = set(request.resource_names_unsubscribe)
        if WILDCARD in unsubscribed and watched.names is None:
            watched.names, changed = [], True  # explicit names only from now on, none yet
        elif watched.names is not None and unsubscribed:
            kept = [n for n in watched.names if n not in unsubscribed]
            if len(kept) < len(watched.names):
                watched.names = kept
                # The client forgets what it unsubscribed from: no removal is due for it. (A copy:
                # `sent` may be shared with other connections.)
                watched.sent = {n: r for n, r in watched.sent.items() if n not in unsubscribed}
                changed = True
    if watched.names is not None and len(watched.names) > max_names:
        raise StreamClosed(Closed(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"{len(watched.names)} resource names subscribed; at most {max_names}"))
    return watched, changed


def held(watched: WatchedResource, current: list[Resource], versions: dict[str, str]) -> None:
    """Takes a reconnecting client's `initial_resource_versions` as what it was sent: the current
    resources whose version matches, and, for a removal, the names that no longer exist."""
    by_name = {r.name: r for r in current}
    for name, version in versions.items():
        resource = by_name.get(name)
        if resource is not None and resource.version == version:
            watched.sent[name] = resource
        elif resource is None:
            watched.sent[name] = Resource(name, watched.type_url, b"")  # held, gone: to be removed


def respond(
    watched: WatchedResource, snapshot: Snapshot, current: list[Resource], always: bool = False,
    resend: frozenset[str] = frozenset(), held: Held | None = None, unknown: tuple[str, ...] = (),
) -> wire.Outgoing | None:
    """The resources that differ from what the client holds (or are named in `resend`) and the names
    it holds that are gone; None when there are none (unless `always`: the first answer of a watch,
    which the client awaits). `current` is all the client watches of the type; or, given `held` (what
    it holds after this response), only what may have changed of that (a push of some endpoints), so
    that only those are compared and nothing is gone. `unknown`: names just subscribed that name
    nothing, sent as removed (the xDS spec's answer for a resource that does not exist)."""
    removed: list[str] = list(unknown)
    if held is None and not resend and isinstance(watched.sent, Held):
        changed, gone, held = watched.sent.delta_to(current)
        removed += [n for n in gone if n not in unknown]
    else:
        changed = [r for r in current if r.name in resend or not r.same_as(watched.sent.get(r.name))]
        if held is None:
            names = {r.name for r in current}
            removed += [n for n in watched.sent if n not in names and n not in unknown]
    if not changed and not removed and not always:
        return None
    watched.nonce_sent = wire.nonce()
    watched.version_sent = snapshot.version
    watched.sent = Held.of(current) if held is None else held
    watched.sent_at = time.time()
    return wire.delta(snapshot.version, watched.type_url, watched.nonce_sent, changed, removed)


def acked(watched: WatchedResource, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
    """A delta ACK carries no version: the client took the version of the response it names."""
    watched.nonce_acked, watched.version_acked = request.response_nonce, watched.version_sent
    watched.acked = watched.sent  # never changed in place once sent
    watched.last_error = ""
