"""Revisions: Istio's names, which webhook takes which pod (the selectors Istio's chart writes, as
the API server evaluates them), revision tags as istioctl builds them, config of another revision
left out, and the revision in what istiod writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from istiod import revision as rev
from istiod.cli import parse
from istiod.settings import settings_from_args
from istiod.sources.kube import KubeWriter
from istiod.sources.namespaces import NamespaceFilter
from istiod.sources.store import Store
from istiod.webhooks.injection import inject
from tests.peers import ROOT
from tests.test_injection import injector, pod

CLIENT = {"service": {"name": "istiod-py", "namespace": "istio-system", "path": "/inject", "port": 443}, "caBundle": "Q0E="}


def manifest_injector() -> dict[str, Any]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "webhooks" / "injection.yaml").read_text())
    return next(d for d in docs if d["kind"] == "MutatingWebhookConfiguration")


def configuration(name: str, hooks: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "webhooks": hooks}


def test_names_follow_istios_chart() -> None:
    for revision in ("", "default"):
        assert (rev.service_name(revision), rev.mesh_configmap(revision), rev.injector_configmap(revision),
                rev.injector_name(revision), rev.validator_name(revision)) == (
            "istiod", "istio", "istio-sidecar-injector", "istio-sidecar-injector", "istio-validator-istio-system")
    assert (rev.service_name("py"), rev.mesh_configmap("py"), rev.injector_name("py"), rev.validator_name("py"),
            rev.injector_name("py", "mesh"), rev.tag_webhook_name("prod"), rev.tag_webhook_name("prod", "mesh")) == (
        "istiod-py", "istio-py", "istio-sidecar-injector-py", "istio-validator-py-istio-system",
        "istio-sidecar-injector-py-mesh", "istio-revision-tag-prod", "istio-revision-tag-prod-mesh")


def test_labels_in_revision_as_istio() -> None:
    assert rev.labels_in_revision({}, "py") and rev.labels_in_revision(None, "default")
    assert rev.labels_in_revision({"istio.io/rev": "py"}, "py")
    assert not rev.labels_in_revision({"istio.io/rev": "py"}, "default")
    assert rev.labels_in_revision({"istio.io/rev": "py"}, "")  # no revision given: everything


def test_the_default_manifest_has_the_default_revisions_selectors() -> None:
    shipped = manifest_injector()
    assert shipped["metadata"]["labels"]["istio.io/rev"] == "default"
    generated = rev.injection_webhooks("default", {})
    assert [(h["name"], h["namespaceSelector"], h["objectSelector"]) for h in shipped["webhooks"]] == [
        (h["name"], h["namespaceSelector"], h["objectSelector"]) for h in generated]


def routing() -> list[dict[str, Any]]:
    """The default revision, revision py, and tag prod pointing at py, as a cluster would hold them."""
    py = configuration(rev.injector_name("py"), rev.injection_webhooks("py", CLIENT),
                       {"istio.io/rev": "py", "app": "sidecar-injector"})
    return [manifest_injector(), py, rev.tag_configuration("prod", py)]


@pytest.mark.parametrize(("namespace", "pod_labels", "called"), [
    ({"istio-injection": "enabled"}, {}, [("istio-sidecar-injector", "namespace.")]),
    ({"istio.io/rev": "default"}, {}, [("istio-sidecar-injector", "rev.namespace.")]),
    ({"istio.io/rev": "py"}, {}, [("istio-sidecar-injector-py", "rev.namespace.")]),
    ({"istio.io/rev": "prod"}, {}, [("istio-revision-tag-prod", "rev.namespace.")]),
    ({"istio.io/rev": "py"}, {"sidecar.istio.io/inject": "false"}, []),
    ({"istio.io/rev": "canary"}, {}, []),  # no such revision: nobody injects
    # Both labels: istio-injection wins, as Istio's chart gives the legacy label precedence.
    ({"istio-injection": "enabled", "istio.io/rev": "py"}, {}, [("istio-sidecar-injector", "namespace.")]),
    ({}, {"istio.io/rev": "py"}, [("istio-sidecar-injector-py", "rev.object.")]),
    ({}, {"sidecar.istio.io/inject": "true"}, [("istio-sidecar-injector", "object.")]),
    ({}, {"sidecar.istio.io/inject": "true", "istio.io/rev": "py"}, [("istio-sidecar-injector-py", "rev.object.")]),
    ({}, {}, []),
])
def test_exactly_one_revision_takes_a_pod(namespace: dict[str, str], pod_labels: dict[str, str],
                                          called: list[tuple[str, str]]) -> None:
    assert rev.injecting_webhooks(routing(), namespace, pod_labels) == [
        (name, f"{prefix}{rev.INJECTOR_WEBHOOK_SUFFIX}") for name, prefix in called]


def test_a_tag_copies_its_revisions_endpoint_and_labels() -> None:
    py = configuration("istio-sidecar-injector-py", rev.injection_webhooks("py", CLIENT),
                       {"istio.io/rev": "py", "app": "sidecar-injector", "release": "istiod-py"})
    tag = rev.tag_configuration("prod", py)
    assert tag["metadata"] == {"name": "istio-revision-tag-prod", "labels": {
        "istio.io/rev": "py", "istio.io/tag": "prod", "release": "istiod-py", "app": "sidecar-injector"}}
    assert {h["clientConfig"]["service"]["name"] for h in tag["webhooks"]} == {"istiod-py"}
    assert {h["clientConfig"]["caBundle"] for h in tag["webhooks"]} == {"Q0E="}
    assert [h["name"] for h in rev.tag_configuration("default", py)["webhooks"]] == [
        f"{p}sidecar-injector.istio.io" for p in ("rev.namespace.", "rev.object.", "namespace.", "object.")]
    with pytest.raises(ValueError, match="no istio.io/rev label"):
        rev.tag_configuration("prod", configuration("x", [], {}))
    with pytest.raises(ValueError, match="could not find sidecar-injector webhook"):
        rev.tag_configuration("prod", configuration("x", [{"name": "other.example.com"}], {"istio.io/rev": "py"}))


def test_tag_default_deactivates_the_default_injector() -> None:
    configs = routing()
    configs[0] = rev.deactivated(configs[0])
    configs.append(rev.tag_configuration("default", configs[1]))
    assert rev.injecting_webhooks(configs, {"istio-injection": "enabled"}, {}) == [
        ("istio-revision-tag-default", "namespace.sidecar-injector.istio.io")]
    assert rev.injecting_webhooks(configs, {"istio.io/rev": "default"}, {}) == [
        ("istio-revision-tag-default", "rev.namespace.sidecar-injector.istio.io")]
    assert manifest_injector()["webhooks"][0]["namespaceSelector"] != rev.NEVER_MATCH  # a copy was changed


def test_selector_operators() -> None:
    assert rev.selects(None, {}) and rev.selects({"matchLabels": {"a": "1"}}, {"a": "1"})
    assert not rev.selects({"matchLabels": {"a": "1"}}, {})
    assert rev.selects({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""})
    with pytest.raises(ValueError, match="unknown operator 'Gt'"):
        rev.selects({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}, {})


def vs(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
            "metadata": {"name": name, "namespace": "app", "labels": labels},
            "spec": {"hosts": ["echo"], "http": [{"route": [{"destination": {"host": "echo"}}]}]}}


def test_config_of_another_revision_is_left_out() -> None:
    stores = {revision: Store() for revision in ("default", "py")}
    writers = {revision: KubeWriter(store, NamespaceFilter(), revision) for revision, store in stores.items()}
    for writer in writers.values():
        writer.replace("VirtualService", [vs("shared", {}), vs("canary", {"istio.io/rev": "py"}),
                                          vs("stable", {"istio.io/rev": "default"})])
    names = {r: sorted(k.name for k in s.keys("VirtualService")) for r, s in stores.items()}
    assert names == {"default": ["shared", "stable"], "py": ["canary", "shared"]}
    writers["py"].apply(vs("shared", {"istio.io/rev": "default"}))  # relabelled away: gone from py
    assert sorted(k.name for k in stores["py"].keys("VirtualService")) == ["canary"]
    writers["py"].apply(vs("stable", {"istio.io/rev": "py"}))  # relabelled here: appears
    assert sorted(k.name for k in stores["py"].keys("VirtualService")) == ["canary", "stable"]


def test_the_status_names_the_injecting_revision_and_the_ca_follows_it() -> None:
    patch = inject(pod(), injector(revision="py"), "py")
    annotations = next(op["value"] for op in patch if op["path"] == "/metadata/annotations")
    assert json.loads(annotations["sidecar.istio.io/status"])["revision"] == "py"
    containers = next(op["value"] for op in patch if op["path"] == "/spec/containers")
    env = {e["name"]: e.get("value") for e in containers[-1]["env"]}
    assert env["CA_ADDR"] == "istiod-py.istio-system.svc:15012"
    assert {e["name"]: e.get("value") for e in next(op["value"] for op in inject(pod(), injector())
            if op["path"] == "/spec/containers")[-1]["env"]}["CA_ADDR"] == "istiod.istio-system.svc:15012"


def test_revision_flag_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["discovery", "--config-dir", str(tmp_path)]
    assert settings_from_args(parse(base)).revision == "default"
    assert settings_from_args(parse([*base, "--revision", "py"])).revision == "py"
    monkeypatch.setenv("REVISION", "canary")
    assert settings_from_args(parse(base)).revision == "canary"
    with pytest.raises(SystemExit, match="--revision 'Py_1': not a DNS-1123 label"):
        settings_from_args(parse([*base, "--revision", "Py_1"]))


def test_tag_without_a_cluster_is_one_line(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    done = subprocess.run([sys.executable, "-m", "istiod", "tag", "list", "--kubeconfig", str(kubeconfig)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert (done.returncode, done.stderr.count("\n")) == (1, 1) and done.stderr.startswith("Error: "), done.stderr
