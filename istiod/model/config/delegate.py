"""VirtualService delegation, as istiod's mergeVirtualServices: a root's http route that names a
delegate (a VirtualService without hosts) is replaced by the delegate's routes, each with its
matches merged into the root's and what it leaves unset taken from the root. A delegate route
whose matches conflict with the root's is left out; a missing delegate, or one not exported to the
root's namespace, leaves out the delegating route. Each is one log line. Pure but for the log.

Done when the config set is collected: the merged root is a new value whenever a delegate
changes, so the proxies that use the root are rebuilt and pushed as for a change of the root.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from istiod.model.config.common import MatchKind, StringMatch
from istiod.model.config.networking import Headers, HTTPMatch, HTTPRoute, VirtualService
from istiod.model.config.scope import ExportToDefaults, exported_to

log = logging.getLogger(__name__)


def merge_delegates(services: Sequence[VirtualService],
                    defaults: ExportToDefaults = ExportToDefaults()) -> tuple[VirtualService, ...]:
    """`defaults`: a delegate without exportTo takes the mesh's, as istiod's."""
    delegates = {(vs.meta.namespace, vs.meta.name): vs for vs in services if not vs.hosts}
    result = []
    for vs in services:
        if not any(http.delegate for http in vs.http):
            result.append(vs)
            continue
        routes: list[HTTPRoute] = []
        for http in vs.http:
            if http.delegate is None:
                routes.append(http)
                continue
            namespace, name = http.delegate
            delegate = delegates.get(http.delegate)
            if delegate is None:
                log.warning("delegate virtual service %s/%s of %s not found", namespace, name, vs.meta)
            elif not exported_to(defaults.of_virtual_service(delegate), namespace, vs.meta.namespace):
                log.warning("delegate virtual service %s/%s of %s is not exported to %s", namespace, name, vs.meta,
                            vs.meta.namespace)
            else:
                for leaf in delegate.http:
                    merged = _merge_route(http, leaf)
                    if merged is None:
                        log.warning("HTTPMatchRequests conflict: root route %r of %s, delegate route %r of %s",
                                    http.name, vs.meta, leaf.name, delegate.meta)
                    else:
                        routes.append(merged)
        result.append(replace(vs, http=tuple(routes)))
    return tuple(result)


def _joined(root: str, leaf: str) -> str:
    return f"{root}-{leaf}" if root and leaf else root or leaf


def _merge_route(root: HTTPRoute, leaf: HTTPRoute) -> HTTPRoute | None:
    """istiod's mergeHTTPRoute: the leaf's own settings, else the root's."""
    matches = _merge_matches(root.match, leaf.match)
    if matches is None:
        return None
    return replace(
        leaf, name=_joined(root.name, leaf.name), match=matches,
        rewrite=leaf.rewrite or root.rewrite, direct_response=leaf.direct_response or root.direct_response,
        timeout=leaf.timeout if leaf.timeout is not None else root.timeout,
        retries=leaf.retries or root.retries, fault=leaf.fault or root.fault,
        mirrors=leaf.mirrors or root.mirrors, cors_policy=leaf.cors_policy or root.cors_policy,
        headers=leaf.headers if leaf.headers != Headers() else root.headers,
    )


def _merge_matches(root: tuple[HTTPMatch, ...], leaf: tuple[HTTPMatch, ...]) -> tuple[HTTPMatch, ...] | None:
    """Each leaf match within every root match it does not conflict with; None (a conflict) when a
    leaf match fits none."""
    if not root or not leaf:
        return root or leaf
    merged = []
    for sub in leaf:
        fits = [_merge_match(r, sub) for r in root if not _conflict(r, sub)]
        if not fits:
            return None
        merged += fits
    return tuple(merged)


def _merged_map(root: tuple[tuple[str, object], ...], leaf: tuple[tuple[str, object], ...]) -> tuple[tuple[str, object], ...]:
    return tuple(sorted({**dict(root), **dict(leaf)}.items()))


def _merge_match(root: HTTPMatch, leaf: HTTPMatch) -> HTTPMatch:
    return replace(
        leaf, name=_joined(root.name, leaf.name),
        uri=leaf.uri or root.uri, scheme=leaf.scheme or root.scheme, method=leaf.method or root.method,
        authority=leaf.authority or root.authority,
        headers=_merged_map(root.headers, leaf.headers),  # type: ignore[arg-type]
        without_headers=_merged_map(root.without_headers, leaf.without_headers),  # type: ignore[arg-type]
        query_params=_merged_map(root.query_params, leaf.query_params),  # type: ignore[arg-type]
        port=leaf.port or root.port,
        source_labels=_merged_map(root.source_labels, leaf.source_labels),  # type: ignore[arg-type]
        source_namespace=leaf.source_namespace or root.source_namespace,
        gateways=leaf.gateways or root.gateways, stat_prefix=leaf.stat_prefix or root.stat_prefix,
    )


def _conflict(root: HTTPMatch, leaf: HTTPMatch) -> bool:
    """istiod's hasConflict: the leaf must narrow the root, never widen or contradict it."""
    pairs = [(root.uri, leaf.uri), (root.scheme, leaf.scheme), (root.method, leaf.method),
             (root.authority, leaf.authority)]
    for root_map, leaf_map in ((root.headers, leaf.headers), (root.without_headers, leaf.without_headers),
                               (root.query_params, leaf.query_params)):
        pairs += [(dict(root_map).get(name), value) for name, value in leaf_map]
    if any(_string_conflict(r, v) for r, v in pairs):
        return True
    root_labels = dict(root.source_labels)
    return (root.ignore_uri_case != leaf.ignore_uri_case
            or (root.port > 0 and leaf.port > 0 and root.port != leaf.port)
            or (bool(root.source_namespace) and leaf.source_namespace != root.source_namespace)
            or any(k in root_labels and root_labels[k] != v for k, v in leaf.source_labels)
            or (bool(root.gateways) and bool(leaf.gateways) and not set(leaf.gateways) <= set(root.gateways)))


def _string_conflict(root: StringMatch | None, leaf: StringMatch | None) -> bool:
    """istiod's stringMatchConflict: a regex on either side conflicts with any match on the other;
    an exact root takes the same exact value only; a prefix root, a leaf within its prefix."""
    if root is None or leaf is None:
        return False
    if MatchKind.REGEX in (root.kind, leaf.kind):
        return True
    if root.kind is MatchKind.EXACT:
        return leaf.kind is not MatchKind.EXACT or leaf.value != root.value
    return not leaf.value.startswith(root.value)
