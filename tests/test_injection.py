"""Sidecar injection: the patch for istiod's ConfigMap (deploy/webhooks/injection.yaml) applied to
pods, the opt-outs, the resource annotations, CNI mode, bad configs; and /inject over HTTPS."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from istiod.webhooks.injection import InjectionError, Injector, inject, parse_injector, review, wants_injection
from istiod.webhooks.injector_source import read_injection_dir
from tests.peers import ROOT, Istiod, wait_until
from tests.test_webhook import post

MANIFEST = ROOT / "deploy" / "webhooks" / "injection.yaml"


def configmap_data() -> dict[str, str]:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    return next(d for d in docs if d["kind"] == "ConfigMap")["data"]


def injector(**values: Any) -> Injector:
    data = configmap_data()
    merged = {**json.loads(data["values"]), **values}
    return parse_injector(data["config"], json.dumps(merged), "test")


def pod(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "echo-", "labels": labels or {"app": "echo"}, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "echo", "image": "echo:1"}], "volumes": [{"name": "data", "emptyDir": {}}]}}


def apply(obj: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 `add` on an object member, the only operation the injector sends."""
    result = copy.deepcopy(obj)
    for op in patch:
        assert op["op"] == "add"
        *parents, last = op["path"].strip("/").split("/")
        target = result
        for part in parents:
            target = target[part]
        target[last] = op["value"]
    return result


def admission(obj: dict[str, Any], namespace: str = "demo") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "operation": "CREATE", "namespace": namespace, "object": obj}}


def test_patch_adds_the_sidecar() -> None:
    original = pod()
    injected = apply(original, inject(original, injector()))
    spec, metadata = injected["spec"], injected["metadata"]
    assert [c["name"] for c in spec["containers"]] == ["echo", "istio-proxy"]
    assert [c["name"] for c in spec["initContainers"]] == ["istio-init"]
    proxy = spec["containers"][1]
    assert proxy["image"] == "docker.io/istio/proxyv2:latest"
    assert proxy["args"][:1] == ["agent"] and "proxy" in proxy["args"]
    assert proxy["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"},
                                  "limits": {"cpu": "2000m", "memory": "1024Mi"}}
    assert proxy["securityContext"]["runAsUser"] == 1337
    assert {"name": "CA_ADDR", "value": "istiod.istio-system.svc:15012"} in proxy["env"]
    init = spec["initContainers"][0]
    assert init["args"][:2] == ["agent", "iptables"]
    assert init["args"][init["args"].index("-d") + 1] == "15090,15021,15020"
    assert init["securityContext"]["capabilities"]["add"] == ["NET_ADMIN", "NET_RAW"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "data" in volumes  # the pod's own stay
    assert volumes["istio-token"]["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "istio-ca"
    assert volumes["istiod-ca-cert"]["configMap"]["name"] == "istio-ca-root-cert"
    assert metadata["labels"] == {"app": "echo", "security.istio.io/tlsMode": "istio"}
    status = json.loads(metadata["annotations"]["sidecar.istio.io/status"])
    assert status["containers"] == ["istio-proxy"] and status["initContainers"] == ["istio-init"]
    assert "istio-token" in status["volumes"]
    assert metadata["annotations"]["kubectl.kubernetes.io/default-container"] == "echo"
    # An injected pod is never injected twice.
    assert not wants_injection(injected, "demo", injector())


def test_opt_in_and_out() -> None:
    enabled = injector()
    assert wants_injection(pod(), "demo", enabled)  # sent by the namespace's label: policy enabled
    assert not wants_injection(pod(labels={"sidecar.istio.io/inject": "false"}), "demo", enabled)
    assert not wants_injection(pod(annotations={"sidecar.istio.io/inject": "false"}), "demo", enabled)
    assert not wants_injection(pod(), "kube-system", enabled)
    host = pod()
    host["spec"]["hostNetwork"] = True
    assert not wants_injection(host, "demo", enabled)
    data = configmap_data()
    disabled = parse_injector(data["config"].replace("policy: enabled", "policy: disabled"), data["values"], "t")
    assert not wants_injection(pod(), "demo", disabled)
    assert wants_injection(pod(labels={"sidecar.istio.io/inject": "true"}), "demo", disabled)
    # The label wins over the annotation, as istiod's.
    assert wants_injection(pod(labels={"sidecar.istio.io/inject": "true"},
                               annotations={"sidecar.istio.io/inject": "false"}), "demo", disabled)


def test_resource_and_traffic_annotations() -> None:
    annotated = pod(annotations={"sidecar.istio.io/proxyCPU": "50m", "sidecar.istio.io/proxyMemoryLimit": "256Mi",
                                 "traffic.sidecar.istio.io/excludeOutboundPorts": "5432"})
    spec = apply(annotated, inject(annotated, injector()))["spec"]
    assert spec["containers"][1]["resources"] == {"requests": {"cpu": "50m", "memory": "128Mi"},
                                                  "limits": {"cpu": "2000m", "memory": "256Mi"}}
    args = spec["initContainers"][0]["args"]
    assert args[args.index("-o") + 1] == "5432"
    bad = pod(annotations={"sidecar.istio.io/proxyMemory": "lots"})
    answer = review(admission(bad), injector())["response"]
    print("refused:", answer["status"]["message"])
    assert answer["allowed"] is False
    assert answer["status"]["message"].startswith("injection failed: annotation sidecar.istio.io/proxyMemory: ")


@pytest.mark.parametrize(("annotation", "value", "reason"), [
    ("traffic.sidecar.istio.io/includeOutboundIPRanges", "10.0.0.0/33",
     "includeIPRanges invalid: failed parsing cidr '10.0.0.0/33': prefix length out of range"),
    ("traffic.sidecar.istio.io/excludeOutboundIPRanges", "10.0.0.0/8, 10.1.0.0/16",
     "excludeIPRanges invalid: failed parsing cidr ' 10.1.0.0/16': ' 10.1.0.0' is not an IP address"),
    ("traffic.sidecar.istio.io/excludeOutboundIPRanges", "10.0.0.1",
     "excludeIPRanges invalid: failed parsing cidr '10.0.0.1': no '/'"),
    ("traffic.sidecar.istio.io/excludeInboundPorts", "8080;9090",
     "excludeInboundPorts invalid: failed parsing port '8080;9090': parsing '8080;9090': invalid syntax"),
    ("traffic.sidecar.istio.io/includeInboundPorts", "--run-validation",
     "includeInboundPorts invalid: failed parsing port '--run-validation': parsing '--run-validation': invalid syntax"),
    ("traffic.sidecar.istio.io/excludeOutboundPorts", "70000",
     "excludeOutboundPorts invalid: failed parsing port '70000': parsing '70000': value out of range"),
    ("sidecar.istio.io/interceptionMode", "CAPTURE", "interceptionMode invalid, use REDIRECT,TPROXY,NONE: CAPTURE"),
    ("status.sidecar.istio.io/port", "-1",
     "excludeInboundPorts invalid: failed parsing port '-1': parsing '-1': invalid syntax"),
    ("readiness.status.sidecar.istio.io/periodSeconds", "1.5", "parsing '1.5': invalid syntax"),
    ("prometheus.istio.io/merge-metrics", "yes", "parsing 'yes': invalid syntax"),
])
def test_invalid_annotations_refuse_the_pod_with_istiods_message(annotation: str, value: str, reason: str) -> None:
    """The values istiod's injector refuses (a bad one would make istio-init fail on every start)."""
    answer = review(admission(pod(annotations={annotation: value})), injector())["response"]
    assert answer["allowed"] is False
    assert answer["status"]["message"] == f"injection failed: invalid value '{value}' for annotation '{annotation}': {reason}"


def test_valid_annotations_are_injected() -> None:
    annotations = {"traffic.sidecar.istio.io/includeOutboundIPRanges": "10.0.0.0/8,fd00::/8,0.0.0.0/0",
                   "traffic.sidecar.istio.io/excludeOutboundIPRanges": "",
                   "traffic.sidecar.istio.io/includeInboundPorts": "*",
                   "traffic.sidecar.istio.io/excludeInboundPorts": " 15020, 8080 ",
                   "sidecar.istio.io/interceptionMode": "TPROXY", "prometheus.istio.io/merge-metrics": "False",
                   "readiness.status.sidecar.istio.io/failureThreshold": "4294967295"}
    assert review(admission(pod(annotations=annotations)), injector())["response"]["allowed"]


@pytest.mark.parametrize(("change", "reason"), [
    ({"metadata": "echo"}, "request.object: metadata.name: expected a map above 'name'"),
    ({"metadata": {"annotations": {"a": 1}}}, "request.object: metadata.annotations: keys and values must be strings"),
    ({"metadata": {"labels": ["app"]}}, "request.object: metadata.labels: expected dict, got list"),
    ({"spec": {"containers": "echo"}}, "request.object: spec.containers: expected list, got str"),
    ({"spec": {"containers": [{"name": ["echo"]}]}}, "request.object spec.containers[0]: name: expected str, got list"),
    ({"spec": {"hostNetwork": "yes"}}, "request.object: spec.hostNetwork: expected bool, got str"),
])
def test_mistyped_pod_fields_are_a_bad_request(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError) as refused:
        review(admission({**pod(), **change}), injector())
    assert str(refused.value) == reason


def test_cni_mode_annotates_instead_of_an_init_container() -> None:
    original = pod(annotations={"traffic.sidecar.istio.io/excludeInboundPorts": "8080"})
    injected = apply(original, inject(original, injector(istio_cni={"enabled": True})))
    assert "initContainers" not in injected["spec"]
    annotations = injected["metadata"]["annotations"]
    assert annotations["sidecar.istio.io/interceptionMode"] == "REDIRECT"
    assert annotations["traffic.sidecar.istio.io/excludeInboundPorts"] == "8080"
    assert annotations["traffic.sidecar.istio.io/includeOutboundIPRanges"] == "*"


def test_review_answers_a_json_patch() -> None:
    answer = review(admission(pod()), injector())
    response = answer["response"]
    assert answer["kind"] == "AdmissionReview" and response["uid"] == "u-1" and response["allowed"]
    assert response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    assert [op["path"] for op in patch] == ["/metadata/labels", "/metadata/annotations", "/spec/containers",
                                            "/spec/initContainers", "/spec/volumes"]
    # An opted-out pod is allowed untouched; without a config the request fails (failurePolicy decides).
    assert review(admission(pod(labels={"sidecar.istio.io/inject": "false"})), injector())["response"] == \
        {"uid": "u-1", "allowed": True}
    with pytest.raises(LookupError, match="istio-sidecar-injector"):
        review(admission(pod()), None)
    clashing = pod()
    clashing["spec"]["containers"].append({"name": "istio-proxy", "image": "x"})
    assert "container istio-proxy exists already" in review(admission(clashing), injector())["response"]["status"]["message"]


@pytest.mark.parametrize(("config", "message"), [
    ("policy: maybe\ntemplates: {sidecar: 'containers: []'}", "config.policy: 'maybe' is not enabled or disabled"),
    ("templates: {sidecar: '{{ .Values }}'}", "Go template syntax"),
    ("templates: {sidecar: 'containers: [{name: app}]'}", "no container named istio-proxy"),
    ("templates: {sidecar: 'containers: [{name: istio-proxy, image: \"${nope}\"}]'}", "unknown placeholder ${nope}"),
    ("neverInjectSelector: [{matchLabels: {a: b}}]\ntemplates: {sidecar: x}", "config.neverInjectSelector: not implemented"),
    ("colour: blue", "config.colour: not a field"),
])
def test_bad_configs_are_refused_by_name(config: str, message: str) -> None:
    with pytest.raises(InjectionError, match=message.replace("$", r"\$").replace("{", r"\{").replace(".", r"\.")):
        parse_injector(config, "{}", "ConfigMap istio-system/istio-sidecar-injector")


def test_inject_over_https(mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod]) -> None:
    injection = tmp_path / "inject"
    injection.mkdir()
    for key, text in configmap_data().items():
        (injection / key).write_text(text)
    assert read_injection_dir(injection).enabled
    istiod = start_istiod(mesh_dir, "--injection-dir", str(injection))
    status, answer = post(istiod, admission(pod()), "/inject")
    assert status == 200 and answer["response"]["patchType"] == "JSONPatch"
    patched = apply(pod(), json.loads(base64.b64decode(answer["response"]["patch"])))
    assert [c["name"] for c in patched["spec"]["containers"]] == ["echo", "istio-proxy"]
    status, answer = post(istiod, admission({**pod(), "spec": {"containers": "echo"}}), "/inject")
    assert (status, answer["detail"]) == (400, "bad AdmissionReview: request.object: spec.containers: expected list, got str")
    wait_until(lambda: "bad AdmissionReview" in istiod.text(), 10, "the refusal logged")
    assert "Traceback" not in istiod.text()


def test_template_commands_parse_with_istiods_own_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The injected containers' args are flags `istiod` really has (the pod's env fills the rest)."""
    from istiod.cli import parse

    for name in ("POD_NAME", "POD_NAMESPACE", "INSTANCE_IP"):
        monkeypatch.setenv(name, "x")
    spec = apply(pod(), inject(pod(), injector()))["spec"]
    proxy = parse(spec["containers"][1]["args"])
    assert (proxy.command, proxy.agent_mode, str(proxy.workdir), str(proxy.output_dir)) == \
        ("agent", "proxy", "/", "/var/lib/istio/data")
    init_args = spec["initContainers"][0]["args"]
    try:
        capture = parse(init_args)
    except SystemExit:
        pytest.skip("`istiod agent iptables` is not in this build yet")
    assert capture.agent_mode == "iptables"


async def test_configmap_watcher_keeps_the_last_good_config(caplog: pytest.LogCaptureFixture) -> None:
    from kubernetes_asyncio import client

    from istiod.webhooks.injector_source import InjectorConfigMapWatcher

    async with client.ApiClient() as api:  # never called: the informer's writer side alone
        watcher = InjectorConfigMapWatcher(api, "istio-system")
    watcher.replace("ConfigMap", [{"data": configmap_data()}])
    good = watcher.current
    assert good is not None and good.enabled
    watcher.apply({"data": {"config": "policy: sometimes", "values": "{}"}})
    assert watcher.current is good
    assert "ConfigMap istio-system/istio-sidecar-injector: config.policy" in caplog.text
    watcher.delete({})
    assert watcher.current is None
