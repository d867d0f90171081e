"""AuthorizationPolicy and PeerAuthentication -> istio.security.Authorization, as istiod converts
them for ztunnel (pilot/pkg/serviceregistry/kube/controller/ambient/policies.go). Pure.

ztunnel enforces L4 only. What it cannot see (hosts, methods, paths, request principals, remote IPs,
non-L4 `when` keys) makes an ALLOW rule match nothing (the rule is dropped) and is left out of a
DENY rule (which then matches more): a policy is never made more permissive than written.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from google.protobuf import empty_pb2

from istiod.gen.istio.security import authorization_pb2 as pb
from istiod.model.config.common import selector_matches
from istiod.model.config.security import (
    Action, AuthorizationPolicy, Condition, MTLSMode, PeerAuthentication, Rule, Source,
)

# The DENY-plaintext policy istiod makes (in the root namespace) once any PeerAuthentication exists;
# workloads whose effective mode is STRICT name it. `_` cannot be in a Kubernetes name: no clash.
STATIC_STRICT_NAME = "istio_converted_static_strict"
CONVERTED_PREFIX = "converted_peer_authentication_"  # a workload PeerAuthentication with port-level modes


def authorization(policy: AuthorizationPolicy, root_namespace: str) -> pb.Authorization | None:
    """None for what ztunnel is not given: AUDIT and CUSTOM policies, and those attached to a waypoint by
    targetRefs (waypoints' business)."""
    if policy.target_refs:
        return None
    if policy.action is Action.ALLOW:
        action = pb.ALLOW
    elif policy.action is Action.DENY:
        action = pb.DENY
    else:
        return None
    if policy.selector:
        scope = pb.WORKLOAD_SELECTOR
    else:
        scope = pb.GLOBAL if policy.meta.namespace == root_namespace else pb.NAMESPACE
    result = pb.Authorization(name=policy.meta.name, namespace=policy.meta.namespace, scope=scope, action=action)
    for rule in policy.rules:
        clauses = _clauses(action, rule, policy.meta.namespace)
        if clauses is not None:
            result.rules.add().clauses.extend(clauses)
    return result


def _clauses(action: int, rule: Rule, namespace: str) -> list[pb.Clause] | None:
    """A rule's clauses (all must hold; a clause holds when any of its matches does), or None when an
    ALLOW rule names something only L7 can check (it can never match at L4) or ztunnel's matches
    lack (trust domains: left out, allowing less; a DENY ignores them, denying more)."""
    allow = action == pb.ALLOW
    to: list[pb.Match] = []
    for op in rule.operations:
        if allow and any((op.hosts, op.not_hosts, op.methods, op.not_methods, op.paths, op.not_paths)):
            return None
        to.append(pb.Match(destination_ports=op.ports, not_destination_ports=op.not_ports))
    sources: list[pb.Match] = []
    for source in rule.sources:
        if allow and any((source.remote_ip_blocks, source.not_remote_ip_blocks, source.request_principals,
                          source.not_request_principals, source.trust_domains, source.not_trust_domains)):
            return None
        sources.append(_source_match(source, namespace))
    clauses = [pb.Clause(matches=m) for m in (to, sources) if m]
    for condition in rule.when:
        if condition.key not in _WHEN_FIELDS:
            if allow:
                return None
            # As istiod: the condition becomes a match of nothing in particular (it matches all).
        clauses.append(pb.Clause(matches=[_when_match(condition)]))
    return clauses


def _source_match(source: Source, namespace: str) -> pb.Match:
    """`namespace`: the policy's, where a service account named without one lives."""
    return pb.Match(
        service_accounts=_service_accounts(source.service_accounts, namespace),
        not_service_accounts=_service_accounts(source.not_service_accounts, namespace),
        source_ips=_addresses(source.ip_blocks), not_source_ips=_addresses(source.not_ip_blocks),
        namespaces=_strings(source.namespaces), not_namespaces=_strings(source.not_namespaces),
        principals=_strings(source.principals), not_principals=_strings(source.not_principals),
    )


def _when_match(condition: Condition) -> pb.Match:
    match = pb.Match()
    fields = _WHEN_FIELDS.get(condition.key)
    if fields is not None:
        positive, negative, convert = fields
        getattr(match, positive).extend(convert(condition.values))
        getattr(match, negative).extend(convert(condition.not_values))
    return match


def _service_accounts(values: Iterable[str], namespace: str) -> list[pb.ServiceAccountMatch]:
    result = []
    for value in values:
        ns, found, sa = value.partition("/")
        result.append(pb.ServiceAccountMatch(namespace=ns, serviceAccount=sa) if found
                      else pb.ServiceAccountMatch(namespace=namespace, serviceAccount=value))
    return result


def _strings(values: Iterable[str]) -> list[pb.StringMatch]:
    """`*` is presence, `*x` a suffix, `x*` a prefix, anything else exact (Istio's string rules)."""
    result = []
    for value in values:
        if value == "*":
            result.append(pb.StringMatch(presence=empty_pb2.Empty()))
        elif value.startswith("*"):
            result.append(pb.StringMatch(suffix=value[1:]))
        elif value.endswith("*"):
            result.append(pb.StringMatch(prefix=value[:-1]))
        else:
            result.append(pb.StringMatch(exact=value))
    return result


def _addresses(values: Iterable[str]) -> list[pb.Address]:
    """IPs (full length) and CIDRs (the address as written, its prefix length); what parses as
    neither is left out, as istiod does (validation refuses it first)."""
    result = []
    for value in values:
        try:
            if "/" in value:
                interface = ipaddress.ip_interface(value)
                address, length = interface.ip, interface.network.prefixlen
            else:
                address = ipaddress.ip_address(value)
                length = address.max_prefixlen
        except ValueError:
            continue
        result.append(pb.Address(address=address.packed, length=length))
    return result


def _ports(values: Iterable[str]) -> list[int]:
    return [int(v) for v in values if v.isdigit() and int(v) <= 65535]


# A `when` key ztunnel can check -> the match fields of its values and notValues.
_WHEN_FIELDS: dict[str, tuple[str, str, Callable[[Iterable[str]], list[Any]]]] = {
    "source.namespace": ("namespaces", "not_namespaces", _strings),
    "source.principal": ("principals", "not_principals", _strings),
    "source.ip": ("source_ips", "not_source_ips", _addresses),
    "destination.ip": ("destination_ips", "not_destination_ips", _addresses),
    "destination.port": ("destination_ports", "not_destination_ports", _ports),
}


# --- PeerAuthentication ------------------------------------------------------------------------

def _no_principal() -> pb.Match:
    return pb.Match(not_principals=[pb.StringMatch(presence=empty_pb2.Empty())])


def static_strict(root_namespace: str) -> pb.Authorization:
    """Deny every connection without a peer identity (plaintext)."""
    return pb.Authorization(name=STATIC_STRICT_NAME, namespace=root_namespace, scope=pb.WORKLOAD_SELECTOR,
                            action=pb.DENY, rules=[pb.Rule(clauses=[pb.Clause(matches=[_no_principal()])])])


def converted(peer: PeerAuthentication, namespace_wide: PeerAuthentication | None,
              mesh_wide: PeerAuthentication | None, root_namespace: str) -> pb.Authorization | None:
    """A workload PeerAuthentication with port-level modes, as istiod converts it: a DENY of plaintext
    on the ports that must be mTLS, with the STRICT of the levels above merged in when it relaxes
    ports of them; None when the static STRICT policy (or nothing) says the same."""
    if peer.meta.namespace == root_namespace or not peer.selector or not peer.port_level:
        return None
    mode = peer.mode
    ns_mode = namespace_wide.mode if namespace_wide is not None else None
    mesh_mode = mesh_wide.mode if mesh_wide is not None else None
    # When a STRICT port needs no rule of its own. (As istiod's condition groups it: a STRICT mesh
    # under no namespace mode covers the port even below a PERMISSIVE workload policy.)
    covered = (mode is MTLSMode.STRICT or (mode is MTLSMode.UNSET and ns_mode is MTLSMode.STRICT)
               or (ns_mode in (None, MTLSMode.UNSET) and mesh_mode is MTLSMode.STRICT))
    rules = [pb.Clause(matches=[_no_principal()])] if mode is MTLSMode.STRICT else []
    strict_ports: list[pb.Rule] = []  # each its own rule: rules are OR'd
    relaxed = False
    for port, port_mode in sorted(peer.port_level):
        if port_mode is MTLSMode.STRICT:
            if covered:
                continue
            match = _no_principal()
            match.destination_ports.append(port)
            strict_ports.append(pb.Rule(clauses=[pb.Clause(matches=[match])]))
        elif port_mode in (MTLSMode.PERMISSIVE, MTLSMode.DISABLE):
            if mode in (MTLSMode.PERMISSIVE, MTLSMode.DISABLE):
                continue
            if mode is MTLSMode.UNSET and ((ns_mode is not None and ns_mode is not MTLSMode.STRICT)
                                           or (ns_mode is None and mesh_mode is not MTLSMode.STRICT)):
                continue  # not STRICT in force: nothing to relax
            relaxed = True
            rules.append(pb.Clause(matches=[pb.Match(not_destination_ports=[port])]))
    if (mode is MTLSMode.STRICT and not relaxed) or not (rules or strict_ports):
        return None
    merge = ((mesh_mode is MTLSMode.STRICT and ns_mode in (None, MTLSMode.UNSET, MTLSMode.STRICT))
             or ns_mode is MTLSMode.STRICT)
    if merge and relaxed:
        rules.append(pb.Clause(matches=[_no_principal()]))
    result = pb.Authorization(name=CONVERTED_PREFIX + peer.meta.name, namespace=peer.meta.namespace,
                              scope=pb.WORKLOAD_SELECTOR, action=pb.DENY, rules=strict_ports)
    if rules:
        result.rules.add().clauses.extend(rules)
    return result


def levels(peers: Iterable[PeerAuthentication], namespace: str,
           root_namespace: str) -> tuple[PeerAuthentication | None, PeerAuthentication | None]:
    """The namespace-wide and mesh-wide PeerAuthentications in force for a namespace: of several, the
    first (istiod: the oldest; here, by name)."""
    peers = list(peers)
    own = next((p for p in peers if p.meta.namespace == namespace and not p.selector), None)
    mesh = next((p for p in peers if p.meta.namespace == root_namespace and not p.selector), None)
    return own, mesh


def workload_policies(policies: Iterable[AuthorizationPolicy], peers: Sequence[PeerAuthentication],
                      namespace: str, labels: Mapping[str, str], root_namespace: str) -> list[str]:
    """The `namespace/name`s of the policies a workload names: selector-scoped AuthorizationPolicies
    of its namespace and the root namespace that select it, and the PeerAuthentication policy in
    force for it (static STRICT, or its own converted port-level one), sorted."""
    names = [f"{p.meta.namespace}/{p.meta.name}" for p in policies
             if p.selector and p.meta.namespace in (namespace, root_namespace)
             and selector_matches(p.selector, labels) and authorization(p, root_namespace) is not None]
    names += _peer_policies(peers, namespace, labels, root_namespace)
    return sorted(names)


def _peer_policies(peers: Sequence[PeerAuthentication], namespace: str, labels: Mapping[str, str],
                   root_namespace: str) -> list[str]:
    """istiod's convertedSelectorPeerAuthentications: mesh, namespace, then workload policy, each UNSET
    level inheriting; of several at one level the first (istiod: the oldest; here: by name)."""
    own, mesh = levels(peers, namespace, root_namespace)
    if own is not None and own.meta.namespace == root_namespace:
        own = None  # the root namespace's are mesh-wide
    workload = next((p for p in peers if p.meta.namespace == namespace != root_namespace and p.selector
                     and selector_matches(p.selector, labels)), None)
    strict = mesh is not None and mesh.mode is MTLSMode.STRICT
    if own is not None and own.mode is not MTLSMode.UNSET:
        strict = own.mode is MTLSMode.STRICT
    port_level = False
    if workload is not None:
        if workload.mode is MTLSMode.STRICT:
            strict = True
        elif workload.mode in (MTLSMode.PERMISSIVE, MTLSMode.DISABLE):
            strict = False
        modes = {mode for _, mode in workload.port_level}
        if workload.port_level:
            if workload.mode is MTLSMode.STRICT:
                port_level = bool(modes & {MTLSMode.PERMISSIVE, MTLSMode.DISABLE})
            elif workload.mode in (MTLSMode.PERMISSIVE, MTLSMode.DISABLE):
                port_level = MTLSMode.STRICT in modes
            elif strict:
                port_level = MTLSMode.PERMISSIVE in modes  # (istiod looks for PERMISSIVE only here)
            else:
                port_level = MTLSMode.STRICT in modes
            if port_level and workload.mode not in (MTLSMode.PERMISSIVE, MTLSMode.DISABLE):
                strict = False  # the converted policy carries the STRICT part
    names = [f"{root_namespace}/{STATIC_STRICT_NAME}"] if strict else []
    if port_level:
        names.append(f"{workload.meta.namespace}/{CONVERTED_PREFIX}{workload.meta.name}")  # type: ignore[union-attr]
    return sorted(names)
