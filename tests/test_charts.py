"""The Helm charts (deploy/charts/base, deploy/charts/istiod), linted and rendered by the real helm
(built from the Go module proxy by e2e/cluster/build-helm.sh: `make helm-bin`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from istiod.model.mesh import MeshConfig, ProxyConfig
from istiod.sources.meshconfig import parse_mesh_config
from istiod.webhooks.injection import inject, parse_injector
from tests.peers import ROOT

HELM = Path(os.environ.get("HELM", ROOT / ".cache" / "helm-bin" / "helm"))
CHARTS = ROOT / "deploy" / "charts"
RBAC = ROOT / "deploy" / "rbac" / "istiod.yaml"
INJECTION = ROOT / "deploy" / "webhooks" / "injection.yaml"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    if not HELM.exists():
        raise RuntimeError(f"{HELM} is missing; run `make helm-bin` (needs Go on PATH)")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)


def render(chart: Path | str, *args: str, namespace: str = "istio-system") -> list[dict[str, Any]]:
    done = helm("template", "istiod", str(chart), "--namespace", namespace, *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def container(objects: list[dict[str, Any]]) -> Any:
    [discovery] = by_kind(objects)["Deployment", "istiod"]["spec"]["template"]["spec"]["containers"]
    return discovery


@pytest.mark.parametrize("chart", ["base", "istiod", "cni", "ztunnel"])
def test_lint(chart: str) -> None:
    done = helm("lint", "--strict", str(CHARTS / chart))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_istiod_defaults() -> None:
    objects = by_kind(render(CHARTS / "istiod"))
    assert sorted(objects) == [
        ("ClusterRoleBinding", "istiod-ca"), ("ClusterRoleBinding", "istiod-discovery"),
        ("ClusterRoleBinding", "istiod-gateway-controller"),
        ("ConfigMap", "istio"), ("ConfigMap", "istio-sidecar-injector"), ("Deployment", "istiod"),
        ("HorizontalPodAutoscaler", "istiod"), ("MutatingWebhookConfiguration", "istio-sidecar-injector"),
        ("PodDisruptionBudget", "istiod"), ("Role", "istiod-ca"), ("RoleBinding", "istiod-ca"),
        ("Service", "istiod"), ("ServiceAccount", "istiod"),
        ("ValidatingWebhookConfiguration", "istio-validator-istio-system"),
    ]
    assert all(o["metadata"].get("namespace", "istio-system") == "istio-system" for o in objects.values())

    service = objects["Service", "istiod"]["spec"]
    assert [(p["port"], p["targetPort"]) for p in service["ports"]] == [(15010, 15010), (15012, 15012), (15014, 15014), (443, 15017)]
    assert service["selector"] == {"app": "istiod", "istio": "pilot"}

    deployment = objects["Deployment", "istiod"]["spec"]
    assert "replicas" not in deployment  # the autoscaler's
    assert deployment["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "100%", "maxUnavailable": "25%"}}
    pod = deployment["template"]["spec"]
    assert pod["serviceAccountName"] == "istiod"
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": service["selector"]}}
    assert deployment["selector"]["matchLabels"] == service["selector"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1337
    assert "nodeSelector" not in pod and "tolerations" not in pod and "priorityClassName" not in pod

    discovery = container(list(objects.values()))
    assert discovery["args"] == ["discovery"]
    assert discovery["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8080}
    assert discovery["securityContext"]["readOnlyRootFilesystem"] is True
    assert discovery["securityContext"]["allowPrivilegeEscalation"] is False
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in discovery["env"] if "valueFrom" in e} == {
        "POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert env_values(discovery) == {"CA_TRUSTED_NODE_ACCOUNTS": "", "REVISION": "default"}  # no ambient: nobody may impersonate
    assert discovery["resources"] == {"requests": {"cpu": "500m", "memory": "512Mi"}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    [token] = volumes["istio-token"]["projected"]["sources"]
    assert token["serviceAccountToken"]["audience"] == "istio-ca"
    assert {m["name"]: m["mountPath"] for m in discovery["volumeMounts"]}["istio-token"] == "/var/run/secrets/tokens"

    hpa = objects["HorizontalPodAutoscaler", "istiod"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 5)
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "istiod"}
    assert objects["PodDisruptionBudget", "istiod"]["spec"] == {"minAvailable": 1, "selector": {"matchLabels": service["selector"]}}
    mesh = parse_mesh_config(objects["ConfigMap", "istio"]["data"]["mesh"], MeshConfig(), "ConfigMap istio")
    # istiod's defaults, spelled out (defaultConfig's fields as written go to injected pods)
    assert mesh == MeshConfig(default_config=ProxyConfig(json='{"discoveryAddress": "istiod.istio-system.svc:15012"}'))

    [webhook] = objects["ValidatingWebhookConfiguration", "istio-validator-istio-system"]["webhooks"]
    assert webhook["clientConfig"]["service"] == {"name": "istiod", "namespace": "istio-system", "path": "/validate", "port": 443}
    assert webhook["failurePolicy"] == "Fail"


def env_values(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def daemonset_container(objects: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, its one container) of DaemonSet `name`."""
    pod = by_kind(objects)["DaemonSet", name]["spec"]["template"]["spec"]
    [main] = pod["containers"]
    return pod, main


@pytest.mark.parametrize("namespace", ["istio-system", "mesh-a"])
def test_istiod_ambient_switch_trusts_its_namespaces_ztunnel(namespace: str) -> None:
    discovery = container(render(CHARTS / "istiod", "--set", "ambient=true", namespace=namespace))
    assert env_values(discovery)["CA_TRUSTED_NODE_ACCOUNTS"] == f"{namespace}/ztunnel"


def test_ztunnel_chart() -> None:
    objects = render(CHARTS / "ztunnel")
    named = by_kind(objects)
    assert sorted(named) == [("DaemonSet", "ztunnel"), ("ServiceAccount", "ztunnel")]  # it reads no API: no RBAC
    assert {o["metadata"]["namespace"] for o in objects} == {"istio-system"}
    pod, ztunnel = daemonset_container(objects, "ztunnel")
    assert pod["serviceAccountName"] == "ztunnel"  # what istiod's ambient switch trusts
    assert ztunnel["image"] == "docker.io/istio/ztunnel:1.28.0" and ztunnel["args"] == ["proxy", "ztunnel"]
    env = env_values(ztunnel)
    assert env["CA_ADDRESS"] == env["XDS_ADDRESS"] == "istiod.istio-system.svc:15012"
    assert env["INPOD_ENABLED"] == "true" and env["ISTIO_META_CLUSTER_ID"] == "Kubernetes"
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in ztunnel["env"] if "valueFrom" in e} == {
        "POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "NODE_NAME": "spec.nodeName",
        "INSTANCE_IP": "status.podIP", "SERVICE_ACCOUNT": "spec.serviceAccountName"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    [token] = volumes["istio-token"]["projected"]["sources"]
    assert token["serviceAccountToken"]["audience"] == "istio-ca"  # a pod-bound token, for the node authorizer
    assert volumes["istiod-ca-cert"]["configMap"] == {"name": "istio-ca-root-cert"}
    assert volumes["cni-ztunnel-sock-dir"]["hostPath"]["path"] == "/var/run/ztunnel"
    mounts = {m["name"]: m["mountPath"] for m in ztunnel["volumeMounts"]}
    assert (mounts["istio-token"], mounts["istiod-ca-cert"]) == ("/var/run/secrets/tokens", "/var/run/secrets/istio")
    assert ztunnel["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "SYS_ADMIN", "NET_RAW"]}
    assert pod["priorityClassName"] == "system-node-critical"

    other = render(CHARTS / "ztunnel", "--set", "istiodAddress=istiod.mesh.example:15012,logLevel=debug",
                   "--set-json", 'env=[{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"}]', namespace="mesh-a")
    _, ztunnel = daemonset_container(other, "ztunnel")
    env = env_values(ztunnel)
    assert env["CA_ADDRESS"] == env["XDS_ADDRESS"] == "istiod.mesh.example:15012"
    assert (env["RUST_LOG"], env["ISTIO_META_DNS_CAPTURE"]) == ("debug", "true")
    assert {o["metadata"]["namespace"] for o in other} == {"mesh-a"}


def test_cni_chart() -> None:
    objects = render(CHARTS / "cni", namespace="mesh-a")
    named = by_kind(objects)
    assert sorted(named) == [
        ("ClusterRole", "istio-cni"), ("ClusterRole", "istio-cni-ambient"), ("ClusterRoleBinding", "istio-cni"),
        ("ClusterRoleBinding", "istio-cni-ambient"), ("DaemonSet", "istio-cni-node"), ("ServiceAccount", "istio-cni")]
    assert named["ClusterRole", "istio-cni"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods", "nodes", "namespaces"], "verbs": ["get", "list", "watch"]}]
    assert named["ClusterRole", "istio-cni-ambient"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    for binding in ("istio-cni", "istio-cni-ambient"):
        assert named["ClusterRoleBinding", binding]["subjects"] == [
            {"kind": "ServiceAccount", "name": "istio-cni", "namespace": "mesh-a"}]
    pod, agent = daemonset_container(objects, "istio-cni-node")
    assert pod["serviceAccountName"] == "istio-cni" and pod["hostNetwork"] is True
    assert agent["image"] == "istiod:0.1.0" and agent["args"] == ["cni"]  # `istiod cni`
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"] if "valueFrom" in e}["NODE_NAME"] == "spec.nodeName"
    env = env_values(agent)
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert (volumes["cni-net-dir"], mounts["cni-net-dir"], env["MOUNTED_CNI_NET_DIR"]) == (
        "/etc/cni/net.d", "/host/etc/cni/net.d", "/host/etc/cni/net.d")
    assert (volumes["cni-bin-dir"], mounts["cni-bin-dir"], env["CNI_BIN_DIR"]) == (
        "/opt/cni/bin", "/host/opt/cni/bin", "/host/opt/cni/bin")
    # The sockets shared with ztunnel and with the plugin the runtime runs, at their host paths.
    assert env["ZTUNNEL_UDS_ADDRESS"] == "/var/run/ztunnel/ztunnel.sock"
    assert volumes["cni-ztunnel-sock-dir"] == mounts["cni-ztunnel-sock-dir"] == "/var/run/ztunnel"
    assert volumes["cni-socket-dir"] == mounts["cni-socket-dir"] == env["CNI_AGENT_RUN_DIR"] == "/var/run/istio-cni"
    assert volumes["cni-netns-dir"] == mounts["cni-netns-dir"] == "/var/run/netns"

    other = render(CHARTS / "cni", "--set", "image=registry.example/istiod:1.2.3,cniConfDir=/etc/cni/multus/net.d")
    pod, agent = daemonset_container(other, "istio-cni-node")
    assert agent["image"] == "registry.example/istiod:1.2.3"
    assert {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}["cni-net-dir"] == "/etc/cni/multus/net.d"


def test_rbac_is_deploy_rbac() -> None:
    """Both charts together carry exactly deploy/rbac/istiod.yaml (the RBAC the e2e tests prove)."""
    def essentials(o: dict[str, Any]) -> tuple[str, str, str, Any]:
        return o["kind"], o["metadata"]["name"], o["metadata"].get("namespace", ""), o.get("rules", o.get("subjects"))

    rbac_kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    rendered = [o for o in render(CHARTS / "base") + render(CHARTS / "istiod") if o["kind"] in rbac_kinds]
    expected = [o for o in yaml.safe_load_all(RBAC.read_text()) if o]
    assert sorted(map(essentials, rendered), key=str) == sorted(map(essentials, expected), key=str)
    assert {o["kind"] for o in render(CHARTS / "base")} <= {"ClusterRole", "CustomResourceDefinition"}


def test_other_namespace() -> None:
    objects = render(CHARTS / "istiod", namespace="mesh-a")
    assert {o["metadata"].get("namespace", "mesh-a") for o in objects} == {"mesh-a"}
    named = by_kind(objects)
    mesh = parse_mesh_config(named["ConfigMap", "istio"]["data"]["mesh"], MeshConfig(), "ConfigMap istio")
    assert (mesh.root_namespace, mesh.default_config.discovery_address) == ("mesh-a", "istiod.mesh-a.svc:15012")
    assert named["ClusterRoleBinding", "istiod-ca"]["subjects"] == [{"kind": "ServiceAccount", "name": "istiod", "namespace": "mesh-a"}]
    [webhook] = named["ValidatingWebhookConfiguration", "istio-validator-mesh-a"]["webhooks"]
    assert webhook["clientConfig"]["service"]["namespace"] == "mesh-a"
    injector = named["ConfigMap", "istio-sidecar-injector"]
    assert json.loads(injector["data"]["values"])["global"]["istioNamespace"] == "mesh-a"
    assert {h["clientConfig"]["service"]["namespace"] for h in named["MutatingWebhookConfiguration", "istio-sidecar-injector"]["webhooks"]} == {"mesh-a"}


def test_injector_is_deploy_webhooks() -> None:
    """The sidecar injector's ConfigMap and webhooks are deploy/webhooks/injection.yaml's (what the e2e
    tests prove), with the chart's labels and proxy image; istiod reads the ConfigMap as it is rendered."""
    named = by_kind(render(CHARTS / "istiod", "--set", "proxyImage=registry.example/proxy:1.2.3"))
    expected = by_kind([o for o in yaml.safe_load_all(INJECTION.read_text()) if o])
    webhooks = named["MutatingWebhookConfiguration", "istio-sidecar-injector"]
    assert webhooks["webhooks"] == expected["MutatingWebhookConfiguration", "istio-sidecar-injector"]["webhooks"]
    assert webhooks["metadata"]["labels"]["app"] == "sidecar-injector"  # Istio's label, kept
    assert webhooks["metadata"]["labels"]["app.kubernetes.io/part-of"] == "istio"
    configmap = named["ConfigMap", "istio-sidecar-injector"]
    assert configmap["data"]["config"] == expected["ConfigMap", "istio-sidecar-injector"]["data"]["config"]
    injector = parse_injector(configmap["data"]["config"], configmap["data"]["values"], "rendered")
    assert injector.variables()["proxy_image"] == "registry.example/proxy:1.2.3"


def test_istiod_values(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": "registry.example/istiod:1.2.3",
        "replicas": 3,
        "autoscale": {"enabled": False},
        "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}},
        "nodeSelector": {"pool": "control"},
        "tolerations": [{"key": "control", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "priorityClassName": "system-cluster-critical",
        "meshConfig": {"trustDomain": "example.org", "discoverySelectors": [{"matchLabels": {"mesh": "on"}}]},
        "caMode": "plugged",
        "podDisruptionBudget": {"maxUnavailable": 1},
        "env": [{"name": "PILOT_DEBOUNCE_AFTER", "value": "200ms"}],
    }))
    objects = render(CHARTS / "istiod", "-f", str(values))
    named = by_kind(objects)
    assert ("HorizontalPodAutoscaler", "istiod") not in named
    deployment = named["Deployment", "istiod"]["spec"]
    assert deployment["replicas"] == 3
    assert deployment["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = deployment["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "control"}
    assert pod["tolerations"][0]["key"] == "control"
    assert list(pod["affinity"]) == ["nodeAffinity"]  # given whole, replacing the default
    assert pod["priorityClassName"] == "system-cluster-critical"
    discovery = container(objects)
    assert discovery["image"] == "registry.example/istiod:1.2.3"
    assert discovery["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}}
    assert discovery["args"] == ["discovery", "--plugged-ca-dir=/etc/cacerts"]
    assert {"name": "PILOT_DEBOUNCE_AFTER", "value": "200ms"} in discovery["env"]
    assert {v["name"]: v for v in pod["volumes"]}["cacerts"]["secret"] == {"secretName": "cacerts"}
    # Given maps replace the defaults whole (helm alone would merge minAvailable in: an invalid budget).
    assert named["PodDisruptionBudget", "istiod"]["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "istiod", "istio": "pilot"}}}
    assert yaml.safe_load(named["ConfigMap", "istio"]["data"]["mesh"]) == {
        "trustDomain": "example.org", "discoverySelectors": [{"matchLabels": {"mesh": "on"}}],
        "rootNamespace": "istio-system", "defaultConfig": {"discoveryAddress": "istiod.istio-system.svc:15012"}}
    mesh = parse_mesh_config(named["ConfigMap", "istio"]["data"]["mesh"], MeshConfig(), "ConfigMap istio")
    assert mesh.trust_domain == "example.org" and len(mesh.discovery_selectors) == 1


def test_bad_ca_mode_is_refused() -> None:
    done = helm("template", "istiod", str(CHARTS / "istiod"), "--set", "caMode=vault")
    assert done.returncode != 0
    assert 'caMode: "vault" is neither selfSigned nor plugged' in done.stderr


def test_base_carries_the_crds(tmp_path: Path) -> None:
    """Whatever crds/ holds at render time, and each CRD once (a copy of the chart with one more)."""
    in_repo = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    rendered = [o for o in render(CHARTS / "base") if o["kind"] == "CustomResourceDefinition"]
    expected = [o for p in sorted((ROOT / "crds").glob("*.yaml")) for o in yaml.safe_load_all(p.read_text()) if o]
    assert rendered == expected, in_repo

    chart = tmp_path / "base"
    shutil.copytree(CHARTS / "base", chart)  # links followed: a plain copy of crds/
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "widgets.example.io"},
           "spec": {"group": "example.io", "scope": "Namespaced",
                    "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
                    "versions": [{"name": "v1", "served": True, "storage": True,
                                  "schema": {"openAPIV3Schema": {"type": "object"}}}]}}
    (chart / "files" / "crds" / "zz-example.yaml").write_text(yaml.safe_dump(crd))
    rendered = [o for o in render(chart) if o["kind"] == "CustomResourceDefinition"]
    assert rendered == expected + [crd]


def test_istio_layout_switch() -> None:
    """sidecarLayout istio: the injector renders Istio's own layout with Istio's proxy image; other
    values are refused by name."""
    named = by_kind(render(CHARTS / "istiod", "--set", "sidecarLayout=istio", "--set", "nativeSidecars=true",
                           "--set", "istioProxyImage=registry.example/proxyv2:1.28.0", namespace="mesh-a"))
    configmap = named["ConfigMap", "istio-sidecar-injector"]
    injector = parse_injector(configmap["data"]["config"], configmap["data"]["values"], "rendered")
    assert injector.layout == "istio"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-1", "namespace": "app"},
           "spec": {"containers": [{"name": "web", "image": "web:1"}]}}
    patch = {op["path"]: op["value"] for op in inject(pod, injector)}
    init, proxy = patch["/spec/initContainers"]
    assert (init["name"], init["image"]) == ("istio-init", "registry.example/proxyv2:1.28.0")
    assert (proxy["name"], proxy["restartPolicy"], proxy["args"][:2]) == ("istio-proxy", "Always", ["proxy", "sidecar"])
    env = {e["name"]: e.get("value") for e in proxy["env"]}
    assert env["CA_ADDR"] == "istiod.mesh-a.svc:15012"
    assert json.loads(env["PROXY_CONFIG"]) == {"discoveryAddress": "istiod.mesh-a.svc:15012"}
    done = helm("template", "istiod", str(CHARTS / "istiod"), "--set", "sidecarLayout=envoy")
    assert done.returncode != 0
    assert 'sidecarLayout: "envoy" is neither istiod nor istio' in done.stderr
