"""Istio's config kinds: every field we read, and istiod's validation messages naming object and field."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from istiod.model.config.common import MatchKind
from istiod.model.config.kinds import CONFIG_KINDS
from istiod.model.config.networking import DestinationRule, Resolution, Sidecar, TunnelSettings, VirtualService
from istiod.model.config.security import Action, AuthorizationPolicy, MTLSMode, PeerAuthentication
from istiod.sources.convert import ConversionError, convert

DATA = Path(__file__).parent / "data" / "istio"
VALID = list(yaml.safe_load_all((DATA / "valid.yaml").read_text()))
INVALID = yaml.safe_load((DATA / "invalid.yaml").read_text())


def converted(kind: str, name: str) -> Any:
    body = next(o for o in VALID if o["kind"] == kind and o["metadata"]["name"] == name)
    return convert(body)[1]


def test_every_kind_has_a_valid_fixture() -> None:
    assert {k.kind for k in CONFIG_KINDS} == {o["kind"] for o in VALID}


@pytest.mark.parametrize("body", VALID, ids=lambda o: f"{o['kind']}-{o['metadata']['name']}")
def test_valid_objects_convert(body: dict[str, Any]) -> None:
    convert(body)


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c["error"][:60])
def test_invalid_objects_are_refused_naming_object_and_field(case: dict[str, Any]) -> None:
    with pytest.raises(ConversionError) as error:
        convert(case["object"])
    assert case["error"] in str(error.value)


def test_virtual_service_values() -> None:
    vs: VirtualService = converted("VirtualService", "reviews")
    assert vs.hosts == ("reviews.demo.svc.cluster.local",)  # a short name resolves in the object's namespace
    assert vs.gateways == ("mesh", "demo/ingress", "istio-system/shared-gw")
    canary = vs.http[0]
    assert canary.match[0].uri is not None and canary.match[0].uri.kind is MatchKind.REGEX
    assert canary.match[0].uri.matches("/reviews.v1.Reviews/Get")
    assert [(r.destination.subset, r.weight) for r in canary.route] == [("v2", 90), ("v1", 10)]
    assert canary.route[0].destination.port == 9080
    assert canary.timeout == timedelta(seconds=90)  # Go's grammar: 1m30s
    assert canary.retries is not None and canary.retries.retry_on == ("unavailable", "connect-failure", "503")
    assert canary.retries.per_try_timeout == timedelta(milliseconds=250)
    assert canary.fault is not None and canary.fault.abort is not None and canary.fault.abort.grpc_status == "UNAVAILABLE"
    assert canary.fault.abort.percentage == 0.5
    assert vs.http[1].match == () and vs.tcp[0].match[0].port == 3306


def test_destination_rule_and_service_entry_values() -> None:
    dr: DestinationRule = converted("DestinationRule", "reviews")
    assert dr.host == "reviews.demo.svc.cluster.local"
    assert [s.name for s in dr.subsets] == ["v1", "v2"] and dr.subset("v2") is not None
    policy = dr.traffic_policy
    assert policy is not None and policy.load_balancer is not None
    assert policy.load_balancer.consistent_hash is not None and policy.load_balancer.consistent_hash.http_header_name == "x-user"
    assert policy.connection_pool is not None and policy.connection_pool.http is not None
    assert policy.connection_pool.http.http2_max_requests == 100
    tunneled: DestinationRule = converted("DestinationRule", "corp-proxy")
    assert tunneled.traffic_policy is not None and tunneled.traffic_policy.tunnel == TunnelSettings("db.example.com", 5432)
    assert tunneled.traffic_policy.tunnel.hostname == "db.example.com:5432"
    post = tunneled.subsets[0].traffic_policy
    assert post is not None and post.tunnel == TunnelSettings("2001:db8::1", 443, use_post=True)
    assert post.tunnel.hostname == "[2001:db8::1]:443"  # Go's net.JoinHostPort, as istiod writes it
    se = converted("ServiceEntry", "static-backend")
    assert se.resolution is Resolution.STATIC and se.endpoints[0].ports == (("grpc", 7070),)


def test_security_values() -> None:
    pa: PeerAuthentication = converted("PeerAuthentication", "reviews")
    assert pa.mode is MTLSMode.UNSET and pa.port_level == ((9080, MTLSMode.DISABLE), (9081, MTLSMode.STRICT))
    ap: AuthorizationPolicy = converted("AuthorizationPolicy", "reviews-deny")
    assert ap.action is Action.DENY and ap.rules[0].operations[0].ports == (9080,)
    assert ap.rules[0].when[0].key == "request.headers[x-token]"
    sidecar: Sidecar = converted("Sidecar", "default")
    assert sidecar.egress[0].hosts == ((".", "reviews.demo.svc.cluster.local"),)


def test_values_are_immutable_and_hashable() -> None:
    for body in VALID:
        value = convert(body)[1]
        hash(value)
        with pytest.raises(AttributeError):
            value.meta = None
