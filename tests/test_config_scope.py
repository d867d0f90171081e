"""istiod's scoping rules over config values: exportTo, root namespace, lookup orders, selectors."""

from __future__ import annotations

from typing import Any

from istiod.model.config.common import Meta
from istiod.model.config.networking import (
    DestinationRule, EgressListener, Gateway, Server, ServiceEntry, ServicePort, Sidecar, VirtualService, WorkloadEntry,
)
from istiod.model.config.scope import (
    ExportToDefaults, destination_rule_for, exported_to, gateways_for, host_matches, most_specific, peer_authentication_mode,
    policies_for, service_entry_endpoints, sidecar_allows, sidecar_for, virtual_service_for_host,
    virtual_services_for,
)
from istiod.model.config.security import AuthorizationPolicy, MTLSMode, PeerAuthentication

ROOT = "istio-system"
REVIEWS = "reviews.demo.svc.cluster.local"


def dr(namespace: str, name: str, host: str = REVIEWS, **kwargs: Any) -> DestinationRule:
    return DestinationRule(Meta(name, namespace), host, **kwargs)


def test_export_to() -> None:
    assert exported_to((), "a", "b")  # the mesh default: everywhere
    assert exported_to((".",), "a", "a") and not exported_to((".",), "a", "b")
    assert exported_to(("*",), "a", "b") and exported_to(("b", "c"), "a", "b")
    assert not exported_to(("~",), "a", "a")


def test_host_matching() -> None:
    assert host_matches("*", "x.y") and host_matches("*.example.com", "a.example.com")
    assert not host_matches("*.example.com", "example.com") and not host_matches("a.b", "a.b.c")
    assert most_specific("a.b.example.com", ["*", "*.example.com", "*.b.example.com"]) == "*.b.example.com"
    assert most_specific("a.example.com", ["*", "a.example.com"]) == "a.example.com"
    assert most_specific("a.example.com", ["*.other.com"]) is None


def test_destination_rule_lookup_order() -> None:
    in_client_ns = dr("client", "local")
    in_service_ns = dr("demo", "svc")
    in_root = dr(ROOT, "mesh", host="*.svc.cluster.local")
    private_in_service_ns = dr("demo", "private", export_to=(".",))
    rules = [in_root, in_service_ns, in_client_ns]
    # 1. the proxy's own namespace, 2. the service's namespace, 3. the root namespace.
    assert destination_rule_for(rules, "client", {}, REVIEWS, "demo", ROOT) is in_client_ns
    assert destination_rule_for(rules, "other", {}, REVIEWS, "demo", ROOT) is in_service_ns
    assert destination_rule_for([in_root, private_in_service_ns], "other", {}, REVIEWS, "demo", ROOT) is in_root
    # A rule in the proxy's namespace applies even when not exported; the service's own proxies see private ones.
    assert destination_rule_for([private_in_service_ns], "demo", {}, REVIEWS, "demo", ROOT) is private_in_service_ns
    assert destination_rule_for([in_root], "x", {}, "other.host", "", ROOT) is None


def test_destination_rule_workload_selector_and_specificity() -> None:
    selecting = dr("client", "selecting", workload_selector=(("app", "a"),))
    namespace_wide = dr("client", "wide")
    wildcard = dr("client", "wild", host="*.demo.svc.cluster.local")
    rules = [namespace_wide, selecting, wildcard]
    assert destination_rule_for(rules, "client", {"app": "a"}, REVIEWS, "demo", ROOT) is selecting
    assert destination_rule_for(rules, "client", {"app": "b"}, REVIEWS, "demo", ROOT) is namespace_wide
    assert destination_rule_for([wildcard], "client", {}, REVIEWS, "demo", ROOT) is wildcard
    # A selecting rule in another namespace never applies across namespaces.
    assert destination_rule_for([dr("demo", "s", workload_selector=(("app", "a"),))], "client", {"app": "a"},
                                REVIEWS, "demo", ROOT) is None


def test_virtual_services_by_gateway_and_export() -> None:
    mesh = VirtualService(Meta("r", "demo"), (REVIEWS,))
    private = VirtualService(Meta("p", "demo"), ("p.demo.svc.cluster.local",), export_to=(".",))
    ingress = VirtualService(Meta("i", "demo"), ("*.example.com",), gateways=("demo/ingress",))
    all_vs = [ingress, private, mesh]
    assert virtual_services_for(all_vs, "demo") == [private, mesh]
    assert virtual_services_for(all_vs, "other") == [mesh]
    assert virtual_services_for(all_vs, "other", "demo/ingress") == [ingress]
    assert virtual_service_for_host(all_vs, "x", "a.example.com", "demo/ingress") is ingress
    assert virtual_service_for_host(all_vs, "x", REVIEWS) is mesh


def test_the_mesh_default_export_of_virtual_services() -> None:
    """meshConfig defaultVirtualServiceExportTo: the exportTo of those that set none, `.` being the
    object's own namespace (istiod's copyDefaultExportToSet)."""
    unset = VirtualService(Meta("r", "demo"), (REVIEWS,))
    everywhere = VirtualService(Meta("e", "demo"), ("e.demo.svc.cluster.local",), export_to=("*",))
    services = [unset, everywhere]
    private = ExportToDefaults(virtual_service=(".",))
    assert virtual_services_for(services, "other", defaults=private) == [everywhere]
    assert virtual_services_for(services, "demo", defaults=private) == [everywhere, unset]
    assert virtual_service_for_host(services, "other", REVIEWS, defaults=private) is None
    assert virtual_service_for_host(services, "demo", REVIEWS, defaults=private) is unset
    named = ExportToDefaults(virtual_service=("shop",))
    assert virtual_services_for(services, "shop", defaults=named) == [everywhere, unset]
    assert virtual_services_for(services, "demo", defaults=named) == [everywhere]  # not even its own namespace
    assert virtual_services_for(services, "demo", defaults=ExportToDefaults(virtual_service=("~",))) == [everywhere]
    assert virtual_services_for(services, "x", defaults=ExportToDefaults(virtual_service=("*",))) == [everywhere, unset]


def test_the_mesh_default_export_of_destination_rules() -> None:
    """meshConfig defaultDestinationRuleExportTo: istiod honours only `.` (the rule stays in its
    namespace); any other default leaves a rule without exportTo exported everywhere."""
    unset, root = dr("demo", "svc"), dr(ROOT, "mesh", host="*.svc.cluster.local")
    private = ExportToDefaults(destination_rule=(".",))
    assert destination_rule_for([unset, root], "other", {}, REVIEWS, "demo", ROOT, private) is None
    assert destination_rule_for([unset, root], "demo", {}, REVIEWS, "demo", ROOT, private) is unset
    assert destination_rule_for([root], ROOT, {}, REVIEWS, "demo", ROOT, private) is root
    exported = dr("demo", "exported", export_to=("other",))
    assert destination_rule_for([exported], "other", {}, REVIEWS, "demo", ROOT, private) is exported
    for default in (("shop",), ("~",), ("*",)):
        assert destination_rule_for([unset], "other", {}, REVIEWS, "demo", ROOT,
                                    ExportToDefaults(destination_rule=default)) is unset, default


def test_sidecar_selection_and_egress_hosts() -> None:
    default = Sidecar(Meta("default", "demo"), egress=(EgressListener(((".", "*"), (ROOT, "*"))),))
    selecting = Sidecar(Meta("narrow", "demo"), workload_selector=(("app", "a"),),
                        egress=(EgressListener((("demo", REVIEWS),), ServicePort(9080, "HTTP", "http")),
                                EgressListener((("~", "*"),))))
    root = Sidecar(Meta("default", ROOT), egress=(EgressListener((("*", "*.svc.cluster.local"),)),))
    sidecars = [root, default, selecting]
    assert sidecar_for(sidecars, "demo", {"app": "a"}, ROOT) is selecting
    assert sidecar_for(sidecars, "demo", {"app": "b"}, ROOT) is default
    assert sidecar_for(sidecars, "other", {}, ROOT) is root
    assert sidecar_for([default], "other", {}, ROOT) is None
    assert sidecar_allows(default, "demo", REVIEWS) and sidecar_allows(default, ROOT, "istiod.istio-system.svc.cluster.local")
    assert not sidecar_allows(default, "other", "x.other.svc.cluster.local")
    assert sidecar_allows(selecting, "demo", REVIEWS, 9080)
    assert not sidecar_allows(selecting, "demo", REVIEWS, 8080)  # the catch-all `~/*` imports nothing
    assert sidecar_allows(root, "any", "x.any.svc.cluster.local") and not sidecar_allows(root, "any", "api.example.com")
    assert sidecar_allows(None, "any", "api.example.com")


def test_peer_authentication_inheritance() -> None:
    mesh = PeerAuthentication(Meta("default", ROOT), mode=MTLSMode.STRICT)
    namespace = PeerAuthentication(Meta("default", "demo"), mode=MTLSMode.UNSET)
    workload = PeerAuthentication(Meta("w", "demo"), selector=(("app", "a"),), mode=MTLSMode.PERMISSIVE,
                                  port_level=((9080, MTLSMode.DISABLE),))
    policies = [mesh, namespace, workload]
    assert peer_authentication_mode(policies, "demo", {"app": "b"}, ROOT) is MTLSMode.STRICT  # UNSET inherits
    assert peer_authentication_mode(policies, "demo", {"app": "a"}, ROOT) is MTLSMode.PERMISSIVE
    assert peer_authentication_mode(policies, "demo", {"app": "a"}, ROOT, 9080) is MTLSMode.DISABLE
    assert peer_authentication_mode([], "demo", {}, ROOT) is MTLSMode.PERMISSIVE


def test_policies_from_root_and_own_namespace() -> None:
    root = AuthorizationPolicy(Meta("mesh", ROOT))
    root_selecting = AuthorizationPolicy(Meta("gw", ROOT), selector=(("istio", "ingressgateway"),))
    own = AuthorizationPolicy(Meta("own", "demo"), selector=(("app", "a"),))
    other = AuthorizationPolicy(Meta("other", "elsewhere"))
    policies = [other, own, root_selecting, root]
    assert policies_for(policies, "demo", {"app": "a"}, ROOT) == [root, own]
    assert policies_for(policies, "demo", {"istio": "ingressgateway"}, ROOT) == [root, root_selecting]


def test_gateways_by_selector() -> None:
    server = Server(ServicePort(80, "HTTP", "http"), (("*", "*"),))
    ingress = Gateway(Meta("ingress", "demo"), (server,), (("istio", "ingressgateway"),))
    assert gateways_for([ingress], {"istio": "ingressgateway", "app": "x"}) == [ingress]
    assert gateways_for([ingress], {"app": "x"}) == []


def test_service_entry_workload_selector() -> None:
    vm = WorkloadEntry(Meta("vm", "demo"), "10.0.0.1", labels=(("app", "backend"),))
    other_ns = WorkloadEntry(Meta("vm", "other"), "10.0.0.2", labels=(("app", "backend"),))
    unlabelled = WorkloadEntry(Meta("x", "demo"), "10.0.0.3")
    selecting = ServiceEntry(Meta("vms", "demo"), ("vms.internal",), workload_selector=(("app", "backend"),))
    inline = ServiceEntry(Meta("static", "demo"), ("s.internal",), endpoints=(unlabelled,))
    assert service_entry_endpoints(selecting, [other_ns, unlabelled, vm]) == (vm,)
    assert service_entry_endpoints(inline, [vm]) == (unlabelled,)


def test_config_set_indexed_lookups_agree_with_the_rules() -> None:
    from istiod.model.config import ConfigSet

    rules = (dr("client", "local"), dr("demo", "svc"), dr("other", "unrelated"), dr(ROOT, "mesh", host="*.svc.cluster.local"))
    services = (VirtualService(Meta("r", "demo"), (REVIEWS,)), VirtualService(Meta("w", "demo"), ("*.demo.svc.cluster.local",)))
    sidecars = (Sidecar(Meta("default", ROOT), egress=(EgressListener((("*", "*"),)),)),)
    config = ConfigSet(virtual_services=services, destination_rules=rules, sidecars=sidecars)
    for proxy_ns in ("client", "demo", "x"):
        assert config.destination_rule_for(proxy_ns, {}, REVIEWS, "demo", ROOT) is destination_rule_for(
            rules, proxy_ns, {}, REVIEWS, "demo", ROOT)
        assert config.sidecar_for(proxy_ns, {}, ROOT) is sidecars[0]
    assert config.virtual_service_for_host("x", REVIEWS) is services[0]
    assert config.virtual_service_for_host("x", "ratings.demo.svc.cluster.local") is services[1]
    assert config.virtual_service_for_host("x", "a.example.com") is None
