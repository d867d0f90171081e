"""Automated deployment without a cluster: the objects istiod makes for a Gateway of class `istio` or
`istio-waypoint` (names, labels, owner references, ports, spec.infrastructure). On a real API server,
applied and deleted by the leader only: e2e/test_gateway_deployment.py."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from istiod.model.config.common import Meta
from istiod.model.config.gateway_api import ConfigMap, KubernetesGateway, Listener, ObjectRef
from istiod.model.config.gateway_deployment import (
    ParametersError, customized, deployed, infrastructure_of, objects, overlays,
)
from tests.test_gateway_api import _converted, _documents

VARIABLES = {"proxy_image": "example.com/istiod-proxy:1", "ca_address": "istiod.istio-system.svc:15012",
             "cluster_id": "Kubernetes"}
GATEWAY = KubernetesGateway(Meta("web", "ingress"), "istio", (
    Listener("http", 80, "HTTP"), Listener("https.secure", 443, "HTTPS"), Listener("again", 80, "HTTP"),
    Listener("status-port", 8080, "HTTP")))
RAW: dict[str, Any] = {"metadata": {"name": "web", "namespace": "ingress", "uid": "1234",
                                    "annotations": {"networking.istio.io/service-type": "ClusterIP"}},
                       "spec": {"infrastructure": {"labels": {"team": "a"},
                                                   "annotations": {"note": "x", "gateway.istio.io/name-override": "n"}}}}


def test_a_gateway_gets_istios_service_account_deployment_and_service() -> None:
    service_account, deployment, service = objects(GATEWAY, infrastructure_of(RAW), VARIABLES)[:3]
    for body in (service_account, deployment, service):
        meta = body["metadata"]
        assert (meta["name"], meta["namespace"]) == ("web-istio", "ingress")
        assert meta["ownerReferences"] == [{"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                                            "name": "web", "uid": "1234"}]
        assert meta["labels"]["gateway.networking.k8s.io/gateway-name"] == "web"
        assert meta["labels"]["gateway.networking.k8s.io/gateway-class-name"] == "istio"
        assert meta["labels"]["team"] == "a" and meta["annotations"] == {"note": "x"}
    assert deployment["metadata"]["labels"]["gateway.istio.io/managed"] == "istio.io-gateway-controller"
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["gateway.networking.k8s.io/gateway-name"] == "web"
    assert pod["metadata"]["labels"]["sidecar.istio.io/inject"] == "false"
    assert pod["spec"]["serviceAccountName"] == "web-istio"
    [proxy] = pod["spec"]["containers"]
    assert proxy["image"] == "example.com/istiod-proxy:1" and proxy["args"][3:5] == ["proxy", "router"]
    assert {"name": "CA_ADDR", "value": "istiod.istio-system.svc:15012"} in proxy["env"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == {"gateway.networking.k8s.io/gateway-name": "web"}
    # istiod's extractServicePorts: status-port first, one per port, names made unique.
    assert [(p["name"], p["port"], p["appProtocol"]) for p in service["spec"]["ports"]] == [
        ("status-port", 15021, "tcp"), ("http", 80, "http"), ("https-secure", 443, "https"),
        ("status-port-8080", 8080, "http")]


def test_only_our_classes_without_addresses_are_deployed() -> None:
    assert deployed(GATEWAY) and deployed(WAYPOINT)
    assert not deployed(KubernetesGateway(Meta("w", "n"), "other", ()))
    assert not deployed(KubernetesGateway(Meta("w", "n"), "istio", (), addresses=(("Hostname", "x.n.svc"),)))
    # One IPAddress: still deployed (istiod's IsManaged), the address the Service's loadBalancerIP.
    pinned = KubernetesGateway(Meta("w", "n"), "istio", (Listener("http", 80, "HTTP"),), addresses=(("IPAddress", "192.0.2.9"),))
    assert deployed(pinned)
    service = objects(pinned, infrastructure_of({"metadata": {"uid": "1"}}), VARIABLES)[2]
    assert (service["spec"]["type"], service["spec"]["loadBalancerIP"]) == ("LoadBalancer", "192.0.2.9")
    assert infrastructure_of({"metadata": {}}).service_type == ""  # the class's default
    assert infrastructure_of({"metadata": {}, "spec": {"infrastructure": {"labels": {"a": 1}}}}).labels == ()


WAYPOINT = KubernetesGateway(Meta("waypoint", "shop"), "istio-waypoint", (Listener("mesh", 15008, "HBONE"),))


def test_a_waypoint_gets_istios_waypoint_objects() -> None:
    """waypoint.yaml: named as the Gateway (its class disables the suffix), kept out of the mesh, the
    mesh controller's managed label, our agent as a waypoint, a ClusterIP Service on 15021 and 15008."""
    raw = {"metadata": {"name": "waypoint", "namespace": "shop", "uid": "77"}}
    service_account, deployment, service = objects(WAYPOINT, infrastructure_of(raw), VARIABLES)[:3]
    assert {b["metadata"]["name"] for b in (service_account, deployment, service)} == {"waypoint"}
    assert deployment["metadata"]["labels"]["gateway.istio.io/managed"] == "istio.io-mesh-controller"
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["istio.io/dataplane-mode"] == "none"
    assert pod["metadata"]["labels"]["gateway.networking.k8s.io/gateway-name"] == "waypoint"
    assert pod["spec"]["containers"][0]["args"][3:5] == ["proxy", "waypoint"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["metadata"]["annotations"] == {"networking.istio.io/traffic-distribution": "PreferClose"}
    assert [(p["name"], p["port"], p["appProtocol"]) for p in service["spec"]["ports"]] == [
        ("status-port", 15021, "tcp"), ("mesh", 15008, "hbone")]
    # The class's default Service type, unless annotated.
    annotated = {"metadata": {**raw["metadata"], "annotations": {"networking.istio.io/service-type": "NodePort"}}}
    assert objects(WAYPOINT, infrastructure_of(annotated), VARIABLES)[2]["spec"]["type"] == "NodePort"
    assert objects(GATEWAY, infrastructure_of(raw), VARIABLES)[2]["spec"]["type"] == "LoadBalancer"


def test_a_hostname_address_makes_the_gateway_that_services_and_not_deployed() -> None:
    """A manual deployment (istiod's extractGatewayServices): the Gateway runs on the pods of the
    Service its Hostname address names, and its status follows that Service."""
    web = next(d for d in _documents() if d["kind"] == "Gateway")
    web["spec"]["addresses"] = [{"type": "Hostname", "value": "edge.istio-ingress.svc.cluster.local"}]
    edge = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "edge", "namespace": "istio-ingress"},
            "spec": {"clusterIP": "10.96.0.81", "selector": {"app": "edge"},
                     "ports": [{"name": "http", "port": 8080}, {"name": "https", "port": 8443}]}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "edge-1", "namespace": "istio-ingress",
                                                           "labels": {"app": "edge"}},
           "spec": {"containers": [{"name": "istio-proxy"}]},
           "status": {"podIP": "127.0.0.71", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    converted = _converted(web, edge, pod)
    status = converted.statuses[("KubernetesGateway", "istio-ingress", "web")]
    programmed = next(c for c in status["conditions"] if c["type"] == "Programmed")
    assert programmed["status"] == "True" and "edge.istio-ingress.svc.cluster.local" in programmed["message"]
    assert status["addresses"] == [{"type": "IPAddress", "value": "10.96.0.81"}]
    assert all(g.selector == (("app", "edge"),) for g in converted.gateways)
    # Two IP addresses name no Service: refused, as istiod's ("only Hostname is supported").
    web["spec"]["addresses"] = [{"type": "IPAddress", "value": "192.0.2.1"}, {"type": "IPAddress", "value": "192.0.2.2"}]
    status = _converted(web).statuses[("KubernetesGateway", "istio-ingress", "web")]
    programmed = next(c for c in status["conditions"] if c["type"] == "Programmed")
    assert (programmed["status"], programmed["reason"]) == ("False", "AddressNotUsable")


def _accepted(*extra: dict[str, Any], ref: dict[str, str]) -> tuple[str, str, str]:
    web = next(d for d in _documents() if d["kind"] == "Gateway")
    web["spec"]["infrastructure"] = {"parametersRef": ref}
    status = _converted(web, *extra).statuses[("KubernetesGateway", "istio-ingress", "web")]
    accepted = next(c for c in status["conditions"] if c["type"] == "Accepted")
    return accepted["status"], accepted["reason"], accepted["message"]


def test_a_parameters_ref_is_accepted_when_its_config_map_is_there_as_istiod() -> None:
    """istiod's validateParametersRef: a ConfigMap of the Gateway's namespace, which must exist."""
    ref = {"group": "", "kind": "ConfigMap", "name": "params"}
    assert _accepted(ref=ref) == ("False", "InvalidParameters",
                                  "parametersRef ConfigMap istio-ingress/params does not exist")
    params = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "params", "namespace": "istio-ingress"},
              "data": {"deployment": "spec: {replicas: 2}"}}
    assert _accepted(params, ref=ref)[0] == "True"  # (ListenersNotValid: one of the fixture's listeners is)
    assert _accepted(params, ref={"group": "", "kind": "Secret", "name": "params"}) == (
        "False", "InvalidParameters", "Unsupported parametersRef group/kind /Secret, only ConfigMap is supported")


def _config_map(name: str, namespace: str, data: dict[str, str], defaults_for: str = "", created: str = "") -> ConfigMap:
    return ConfigMap(Meta(name, namespace), tuple(sorted(data.items())), defaults_for, created)


def test_overlays_of_the_class_defaults_then_the_parameters_as_istiod() -> None:
    """The oldest defaults ConfigMap of istiod's namespace for the class, then parametersRef's; each
    overlay a strategic merge patch of its kind; the autoscaler and budget only when asked for."""
    gateway = replace(GATEWAY, parameters_ref=ObjectRef("", "ConfigMap", "params"))
    config_maps = [
        _config_map("newer", "istio-system", {"deployment": "spec: {replicas: 9}"}, "istio", "2026-02-01T00:00:00Z"),
        _config_map("defaults", "istio-system", {
            "deployment": "spec:\n  replicas: 3\n  template:\n    spec:\n      containers:\n      - name: istio-proxy\n"
                          "        resources: {limits: {cpu: '2'}}\n",
            "horizontalPodAutoscaler": "spec: {minReplicas: 2, maxReplicas: 5}"}, "istio", "2026-01-01T00:00:00Z"),
        _config_map("defaults", "other", {"service": "spec: {type: NodePort}"}, "istio"),  # not istiod's namespace
        _config_map("params", "ingress", {
            "deployment": "metadata: {annotations: {team: edge}}\nspec: {replicas: 4}",
            "service": "spec: {type: ClusterIP, ports: [{port: 80, nodePort: 30080}]}"}),
    ]
    found = overlays(gateway, config_maps, "istio-system")
    assert [sorted(o) for o in found] == [["deployment", "horizontalPodAutoscaler"], ["deployment", "service"]]
    bodies = {b["kind"]: b for b in customized(objects(gateway, infrastructure_of(RAW), VARIABLES), found)}
    assert sorted(bodies) == ["Deployment", "HorizontalPodAutoscaler", "Service", "ServiceAccount"]
    deployment = bodies["Deployment"]
    assert deployment["spec"]["replicas"] == 4 and deployment["metadata"]["annotations"] == {"note": "x", "team": "edge"}
    [proxy] = deployment["spec"]["template"]["spec"]["containers"]
    assert proxy["resources"] == {"limits": {"cpu": "2"}} and proxy["image"] == VARIABLES["proxy_image"]
    assert bodies["Service"]["spec"]["type"] == "ClusterIP"
    assert {"name": "http", "port": 80, "protocol": "TCP", "appProtocol": "http", "nodePort": 30080} in bodies["Service"]["spec"]["ports"]
    autoscaler = bodies["HorizontalPodAutoscaler"]
    assert autoscaler["metadata"]["name"] == "web-istio" and autoscaler["metadata"]["ownerReferences"][0]["uid"] == "1234"
    assert autoscaler["spec"] == {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web-istio"},
                                  "minReplicas": 2, "maxReplicas": 5}
    budget = customized(objects(gateway, infrastructure_of(RAW), VARIABLES),
                        [{"podDisruptionBudget": "spec: {minAvailable: 1}"}])[-1]
    assert budget["kind"] == "PodDisruptionBudget"
    assert budget["spec"] == {"selector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "web"}}, "minAvailable": 1}


@pytest.mark.parametrize("data, message", [
    ({"pod": "spec: {}"}, "unsupported overlay 'pod'"),
    ({"deployment": "metadata: {name: other}"}, "overlay 'deployment': illegal metadata change"),
    ({"service": "metadata: {ownerReferences: null}"}, "overlay 'service': illegal metadata change"),
    ({"deployment": "spec: [1"}, "overlay 'deployment': not YAML"),
    ({"deployment": "- 1"}, "overlay 'deployment': not a map"),
    ({"deployment": "spec: {template: {spec: {containers: [{image: x}]}}}"},
     "strategic merge patch failed: spec.template.spec.containers: an element does not contain the merge key 'name'"),
])
def test_overlays_istiod_cannot_apply_are_refused_with_a_reason(data: dict[str, str], message: str) -> None:
    with pytest.raises(ParametersError, match=re.escape(message)):
        customized(objects(GATEWAY, infrastructure_of(RAW), VARIABLES), [data])


def test_parameters_that_are_not_there_leave_the_gateway_undeployed() -> None:
    missing = replace(GATEWAY, parameters_ref=ObjectRef("", "ConfigMap", "params"))
    with pytest.raises(ParametersError, match="parametersRef targeting configmap ingress/params, but configmap does not exist"):
        overlays(missing, [], "istio-system")
    with pytest.raises(ParametersError, match="unknown infrastructure parameters type example.com/Params"):
        overlays(replace(GATEWAY, parameters_ref=ObjectRef("example.com", "Params", "p")), [], "istio-system")
    assert overlays(GATEWAY, [], "istio-system") == []


def test_name_override_and_service_account_annotations_name_the_objects_as_istiod() -> None:
    gateway = replace(GATEWAY, name_override="edge", service_account="edge-sa")
    service_account, deployment, service = objects(gateway, infrastructure_of(RAW), VARIABLES)[:3]
    assert service_account["metadata"]["name"] == "edge-sa"
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == "edge"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "edge-sa"
    assert GATEWAY.deployment_name == "web-istio"


def test_status_looks_for_the_overridden_service() -> None:
    web = next(d for d in _documents() if d["kind"] == "Gateway")
    web["metadata"].setdefault("annotations", {})["gateway.istio.io/name-override"] = "edge"
    status = _converted(web).statuses[("KubernetesGateway", "istio-ingress", "web")]
    programmed = next(c for c in status["conditions"] if c["type"] == "Programmed")
    assert '"edge.istio-ingress.svc.cluster.local" not found' in programmed["message"]
