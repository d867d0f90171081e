"""The mesh's trust domain and its aliases, as AuthorizationPolicies see them (Istio's trust domain
bundle): an identity in any of them is the same workload, so a policy naming
`cluster.local/ns/a/sa/b` (the default domain, which a policy may use for the local one) or an alias
matches that workload under every domain of the bundle. Pure: policies in, policies out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from istiod.model.config.security import AuthorizationPolicy, Condition, Rule, Source

DEFAULT_TRUST_DOMAIN = "cluster.local"


def _prefix_match(value: str, pattern: str) -> bool:
    return pattern.endswith("*") and value.startswith(pattern[:-1])


def _suffix_match(value: str, pattern: str) -> bool:
    return pattern.startswith("*") and value.endswith(pattern[1:])


def _matches(domain: str, domains: Iterable[str]) -> bool:
    return any(domain == d or d == "*" or _prefix_match(domain, d) or _prefix_match(d, domain)
               or _suffix_match(domain, d) or _suffix_match(d, domain) for d in domains)


def replace_aliases(domains: tuple[str, ...], principals: Iterable[str]) -> tuple[str, ...]:
    """Each `<td>/ns/<ns>/sa/<sa>` principal whose domain is one of `domains` (the mesh's first) or
    `cluster.local`, once per domain of the bundle; others (`*/...`, other domains) as written."""
    result: list[str] = []
    for principal in principals:
        parts = principal.split("/")
        if len(parts) != 5 or parts[0] == "*" or not (
                _matches(parts[0], domains) or parts[0] == DEFAULT_TRUST_DOMAIN):
            result.append(principal)
            continue
        for domain in domains:
            # A wildcard domain (`*-td`) matching this one stays as written, once.
            renamed = principal if _suffix_match(domain, parts[0]) else "/".join((domain, *parts[1:]))
            if renamed not in result:
                result.append(renamed)
    return tuple(result)


def expand_aliases(domains: tuple[str, ...], values: Iterable[str]) -> tuple[str, ...]:
    """Trust domain values, each one of the bundle standing for all of it."""
    return tuple(dict.fromkeys(v for value in values for v in (domains if value in domains else (value,))))


def with_trust_domains(policy: AuthorizationPolicy, domains: tuple[str, ...]) -> AuthorizationPolicy:
    """The policy as it applies in a mesh of `domains` (its trust domain, then its aliases)."""
    if domains == (DEFAULT_TRUST_DOMAIN,):
        return policy  # nothing to rename or expand

    def source(s: Source) -> Source:
        return dataclasses.replace(
            s, principals=replace_aliases(domains, s.principals), not_principals=replace_aliases(domains, s.not_principals),
            trust_domains=expand_aliases(domains, s.trust_domains),
            not_trust_domains=expand_aliases(domains, s.not_trust_domains))

    def condition(c: Condition) -> Condition:
        if c.key == "source.principal":
            return dataclasses.replace(c, values=replace_aliases(domains, c.values),
                                       not_values=replace_aliases(domains, c.not_values))
        if c.key == "source.trustDomain":
            return dataclasses.replace(c, values=expand_aliases(domains, c.values),
                                       not_values=expand_aliases(domains, c.not_values))
        return c

    rules = tuple(Rule(tuple(map(source, r.sources)), r.operations, tuple(map(condition, r.when))) for r in policy.rules)
    return dataclasses.replace(policy, rules=rules)
