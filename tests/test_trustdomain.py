"""The trust domain bundle: policies' identities renamed into the mesh's domain and its aliases."""

from __future__ import annotations

from istiod.model.config.common import Meta
from istiod.model.config.security import AuthorizationPolicy, Condition, Rule, Source
from istiod.model.trustdomain import expand_aliases, replace_aliases, with_trust_domains

DOMAINS = ("new.td", "old.td")


def test_principals_of_the_bundle_or_cluster_local_are_named_in_every_domain() -> None:
    assert replace_aliases(DOMAINS, ["cluster.local/ns/a/sa/b", "old.td/ns/a/sa/c"]) == (
        "new.td/ns/a/sa/b", "old.td/ns/a/sa/b", "new.td/ns/a/sa/c", "old.td/ns/a/sa/c")
    # Another domain, any domain (`*`), or not a SPIFFE path: as written.
    assert replace_aliases(DOMAINS, ["other.td/ns/a/sa/b", "*/ns/a/sa/b", "ns/a/sa/b", "*"]) == (
        "other.td/ns/a/sa/b", "*/ns/a/sa/b", "ns/a/sa/b", "*")
    # A wildcard domain matching the bundle stays as written, once.
    assert replace_aliases(("a-td", "b-td"), ["*-td/ns/a/sa/b"]) == ("*-td/ns/a/sa/b",)
    assert expand_aliases(DOMAINS, ["old.td", "x.td", "new.td"]) == ("new.td", "old.td", "x.td")


def test_a_policy_in_a_mesh_of_several_domains() -> None:
    policy = AuthorizationPolicy(Meta("p", "ns"), rules=(Rule(
        sources=(Source(principals=("cluster.local/ns/a/sa/b",), trust_domains=("old.td",)),),
        when=(Condition("source.principal", not_values=("old.td/ns/x/sa/y",)),
              Condition("source.trustDomain", values=("new.td",)), Condition("source.namespace", values=("a",)))),))
    renamed = with_trust_domains(policy, DOMAINS)
    (rule,) = renamed.rules
    assert rule.sources[0].principals == ("new.td/ns/a/sa/b", "old.td/ns/a/sa/b")
    assert rule.sources[0].trust_domains == DOMAINS
    assert rule.when[0].not_values == ("new.td/ns/x/sa/y", "old.td/ns/x/sa/y")
    assert rule.when[1].values == DOMAINS and rule.when[2] == policy.rules[0].when[2]
    assert with_trust_domains(policy, ("cluster.local",)) is policy
