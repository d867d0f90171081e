"""Istio's own sidecar layout (`layout: istio`) against Istio's injector golden files
(pkg/kube/inject/testdata/inject at the version build-istio.sh builds), and its refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from istiod.webhooks.injection import InjectionError, inject, parse_injector
from tests.peers import istio_source
from tests.test_injection import apply

CONFIG = "policy: enabled\ndefaultTemplates: [sidecar]\nlayout: istio\n"
# Istio's golden tests run with native sidecars on (EnableNativeSidecars) and trust domain cluster.local.
GOLDEN_VALUES: dict[str, dict[str, Any]] = {"global": {"nativeSidecar": True}, "meshConfig": {"trustDomain": "cluster.local"}}
# Env Istio's webhook adds beyond the template from mesh/ProxyConfig features we do not set.
ISTIO_ONLY_ENV = {"OTEL_RESOURCE_ATTRIBUTES", "COMPLIANCE_POLICY", "GODEBUG"}


def injector(values: dict[str, Any]) -> Any:
    return parse_injector(CONFIG, json.dumps(values), "test")


def golden_pod(name: str) -> dict[str, Any]:
    """The pod template of an Istio testdata Deployment, as a Pod."""
    doc = next(d for d in yaml.safe_load_all(istio_source(f"pkg/kube/inject/testdata/inject/{name}").read_text()) if d)
    template = doc if doc["kind"] == "Pod" else doc["spec"]["template"]
    for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
        if container.get("resources") == {}:
            del container["resources"]  # Go prints the empty struct
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "hello-1", "namespace": "default", **template["metadata"]},
            "spec": template["spec"]}


def by_name(containers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in containers}


CASES = [
    ("hello-probes.yaml", "hello-probes.yaml.injected", {}),
    ("hello-probes.yaml", "hello-probes.proxyHoldsApplication.yaml.injected",
     {"global": {"proxy": {"holdApplicationUntilProxyStarts": True}}}),
    ("hello-probes-proxyHoldApplication-ProxyConfig.yaml", "hello-probes-proxyHoldApplication-ProxyConfig.yaml.injected", {}),
    ("tcp-probes.yaml", "tcp-probes.yaml.injected", {}),
    ("https-probes.yaml", "https-probes.yaml.injected", {}),
    ("native-sidecar-opt-out.yaml", "native-sidecar-opt-out.yaml.injected", {}),
    ("native-sidecar.yaml", "native-sidecar-old-version.yaml.injected", {"global": {"nativeSidecar": False}}),
    ("hello-probes-localhost.yaml", "hello-probes-localhost.yaml.injected",
     {"meshConfig": {"inboundTrafficPolicy": {"mode": "LOCALHOST"}}}),
]


@pytest.mark.parametrize(("source", "golden", "values"), CASES, ids=[c[1] for c in CASES])
def test_matches_istios_golden(source: str, golden: str, values: dict[str, Any]) -> None:
    values = {"global": {**GOLDEN_VALUES["global"], **values.get("global", {})},
              "meshConfig": {**GOLDEN_VALUES["meshConfig"], **values.get("meshConfig", {})}}
    original = golden_pod(source)
    ours = apply(original, inject(original, injector(values)))
    want = golden_pod(golden)
    # Container and init container order, each app container whole (its probes rewritten).
    assert [c["name"] for c in ours["spec"]["containers"]] == [c["name"] for c in want["spec"]["containers"]]
    assert [c["name"] for c in ours["spec"].get("initContainers", [])] == [
        c["name"] for c in want["spec"].get("initContainers", [])]
    ours_all = by_name(ours["spec"]["containers"] + ours["spec"].get("initContainers", []))
    want_all = by_name(want["spec"]["containers"] + want["spec"].get("initContainers", []))
    for name, container in want_all.items():
        if name not in ("istio-proxy", "istio-init"):
            assert ours_all[name] == container, name
    assert ours_all["istio-init"]["args"] == want_all["istio-init"]["args"]
    assert ours_all["istio-init"]["securityContext"] == want_all["istio-init"]["securityContext"]
    proxy, want_proxy = ours_all["istio-proxy"], want_all["istio-proxy"]
    for key in ("args", "ports", "restartPolicy", "lifecycle", "readinessProbe", "startupProbe", "securityContext",
                "volumeMounts"):
        assert proxy.get(key) == want_proxy.get(key), key
    env = {e["name"]: e for e in proxy["env"]}
    want_env = {e["name"]: e for e in want_proxy["env"]}
    assert set(want_env) - ISTIO_ONLY_ENV == set(env) - ISTIO_ONLY_ENV
    for name in ("ISTIO_KUBE_APP_PROBERS", "REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION", "ISTIO_META_POD_PORTS", "ISTIO_META_APP_CONTAINERS", "POD_NAME",
                 "INSTANCE_IP", "GOMAXPROCS", "ISTIO_META_INTERCEPTION_MODE", "CA_ADDR"):
        if name in want_env:
            got, expected = env[name], want_env[name]
            if name == "ISTIO_META_POD_PORTS":  # Go's template prints it spread over lines
                got, expected = json.loads(got["value"]), json.loads(expected["value"])
            assert got == expected, name
    assert [v["name"] for v in ours["spec"]["volumes"]] == [v["name"] for v in want["spec"]["volumes"]]
    assert ours["metadata"]["labels"] == want["metadata"]["labels"]
    assert ours["metadata"]["annotations"] == want["metadata"]["annotations"]


def pod(annotations: dict[str, str] | None = None, **container: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "namespace": "app", "labels": {"app": "web"}, "annotations": annotations or {}},
            "spec": {"serviceAccountName": "web",
                     "containers": [{"name": "web", "image": "web:1", "ports": [{"containerPort": 8080}], **container}]}}


PROBED: dict[str, Any] = {"readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "timeoutSeconds": 2}}


def test_probe_rewrite_can_be_turned_off_per_pod_and_by_values() -> None:
    on = apply(pod(**PROBED), inject(pod(**PROBED), injector({})))
    assert on["spec"]["containers"][0]["readinessProbe"]["httpGet"] == {"path": "/app-health/web/readyz", "port": 15020}
    probers = next(e["value"] for e in on["spec"]["containers"][1]["env"] if e["name"] == "ISTIO_KUBE_APP_PROBERS")
    assert json.loads(probers) == {"/app-health/web/readyz": {"httpGet": {"path": "/ready", "port": 8080},
                                                              "timeoutSeconds": 2}}
    off_pod = pod({"sidecar.istio.io/rewriteAppHTTPProbers": "false"}, **PROBED)
    for injected in (apply(off_pod, inject(off_pod, injector({}))),
                     apply(pod(**PROBED), inject(pod(**PROBED), injector({"sidecarInjectorWebhook": {
                         "rewriteAppHTTPProbe": False}})))):
        assert injected["spec"]["containers"][0]["readinessProbe"] == PROBED["readinessProbe"]
        assert "ISTIO_KUBE_APP_PROBERS" not in {e["name"] for e in injected["spec"]["containers"][1]["env"]}


def test_cni_mode_validates_instead_of_capturing_and_annotates_the_pod() -> None:
    injected = apply(pod(), inject(pod(), injector({"istio_cni": {"enabled": True}})))
    init = injected["spec"]["initContainers"][0]
    assert init["name"] == "istio-validation"
    assert init["args"][-2:] == ["--run-validation", "--skip-rule-apply"]
    assert init["securityContext"]["runAsUser"] == 1337 and "add" not in init["securityContext"]["capabilities"]
    annotations = injected["metadata"]["annotations"]
    assert annotations["sidecar.istio.io/interceptionMode"] == "REDIRECT"
    assert annotations["traffic.sidecar.istio.io/excludeInboundPorts"] == "15020"


def test_proxy_config_annotation_reaches_proxy_config_env() -> None:
    annotated = pod({"proxy.istio.io/config": "holdApplicationUntilProxyStarts: true\nconcurrency: 2"})
    injected = apply(annotated, inject(annotated, injector({})))
    proxy = injected["spec"]["containers"][0]
    assert proxy["name"] == "istio-proxy"  # held: first, with pilot-agent wait
    assert proxy["lifecycle"] == {"postStart": {"exec": {"command": ["pilot-agent", "wait"]}}}
    config = json.loads(next(e["value"] for e in proxy["env"] if e["name"] == "PROXY_CONFIG"))
    assert config == {"concurrency": 2, "discoveryAddress": "istiod.istio-system.svc:15012",
                      "holdApplicationUntilProxyStarts": True}


@pytest.mark.parametrize(("annotations", "message"), [
    ({"proxy.istio.io/config": "[1, 2"}, "annotation proxy.istio.io/config: not YAML"),
    ({"proxy.istio.io/config": "- 1"}, "annotation proxy.istio.io/config: not a ProxyConfig map"),
    ({"sidecar.istio.io/nativeSidecar": "maybe"}, "annotation sidecar.istio.io/nativeSidecar: 'maybe' is not a boolean"),
    ({"sidecar.istio.io/proxyCPU": "lots"}, "annotation sidecar.istio.io/proxyCPU"),
    ({"status.sidecar.istio.io/port": "x"}, "status.sidecar.istio.io/port"),
])
def test_bad_annotations_refuse_the_pod(annotations: dict[str, str], message: str) -> None:
    with pytest.raises(InjectionError, match=message):
        inject(pod(annotations), injector({}))


def test_layout_istio_with_a_template_or_an_unknown_layout_is_refused() -> None:
    with pytest.raises(InjectionError, match="config.templates: layout istio renders Istio's own template"):
        parse_injector(CONFIG + "templates: {sidecar: 'containers: []'}\n", "{}", "cm")
    with pytest.raises(InjectionError, match="config.layout: 'envoy' is not one of istiod, istio"):
        parse_injector("layout: envoy\n", "{}", "cm")


def test_workload_name_and_owner_follow_the_pods_controller() -> None:
    owned = pod()
    owned["metadata"]["labels"]["pod-template-hash"] = "5d4f8b"
    owned["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d4f8b",
                                             "controller": True, "uid": "u"}]
    proxy = apply(owned, inject(owned, injector({})))["spec"]["containers"][1]
    env = {e["name"]: e.get("value") for e in proxy["env"]}
    assert env["ISTIO_META_WORKLOAD_NAME"] == "web"
    assert env["ISTIO_META_OWNER"] == "kubernetes://apis/apps/v1/namespaces/app/deployments/web"


def test_network_comes_from_the_pods_label_then_values() -> None:
    def network(labelled: str | None, values: dict[str, Any]) -> str | None:
        p = pod()
        if labelled is not None:
            p["metadata"]["labels"]["topology.istio.io/network"] = labelled
        proxy = apply(p, inject(p, injector(values)))["spec"]["containers"][1]
        return {e["name"]: e.get("value") for e in proxy["env"]}.get("ISTIO_META_NETWORK")

    assert network(None, {}) is None
    assert network(None, {"global": {"network": "n1"}}) == "n1"
    assert network("n2", {"global": {"network": "n1"}}) == "n2"  # the label wins, as in istiod
