"""`istiod manifest generate`: IstioOperator specs rendered by the real helm, compared with golden
files (tests/data/operator/<name>.golden.yaml; rewrite them with UPDATE_GOLDEN=1 and review the diff),
and every unmapped field refused with its path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from istiod.operator.spec import SpecError, to_install, with_sets
from tests.peers import ROOT
from tests.test_charts import HELM

DATA = ROOT / "tests" / "data" / "operator"
SPECS = sorted(p.name.removesuffix(".iop.yaml") for p in DATA.glob("*.iop.yaml"))


def generate(*args: str) -> subprocess.CompletedProcess[str]:
    if not HELM.exists():
        raise RuntimeError(f"{HELM} is missing; run `make helm-bin` (needs Go on PATH)")
    return subprocess.run([sys.executable, "-m", "istiod", "manifest", "generate", "--helm", str(HELM), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_without_helm_on_path_the_one_make_built_is_used_and_a_missing_one_is_named() -> None:
    env = {"PATH": "/nonexistent", "HOME": os.environ.get("HOME", "/root")}
    command = [sys.executable, "-m", "istiod", "manifest", "generate"]
    if HELM == ROOT / ".cache" / "helm-bin" / "helm":  # `make helm-bin`'s, where istiod looks for it
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        assert done.returncode == 0 and "kind: Deployment" in done.stdout, done.stderr
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**env, "HELM": "/no/helm"})
    assert (done.returncode, done.stderr) == (1, "istiod manifest generate: helm not found (/no/helm); set --helm or"
                                                " HELM, or build it in this checkout: `make helm-bin` (needs Go)\n")


@pytest.mark.parametrize("name", SPECS)
def test_golden(name: str) -> None:
    done = generate("-f", str(DATA / f"{name}.iop.yaml"))
    assert done.returncode == 0, done.stderr
    golden = DATA / f"{name}.golden.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(done.stdout)
    assert done.stdout == golden.read_text()


def test_set_overrides_the_file() -> None:
    done = generate("-f", str(DATA / "values.iop.yaml"), "--set", "values.pilot.replicaCount=5",
                    "--set", "meshConfig.trustDomain=example.org", "--set", "namespace=mesh-b")
    assert done.returncode == 0, done.stderr
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(done.stdout) if o}
    assert objects["Deployment", "istiod"]["spec"]["replicas"] == 5
    assert objects["Deployment", "istiod"]["metadata"]["namespace"] == "mesh-b"
    assert yaml.safe_load(objects["ConfigMap", "istio"]["data"]["mesh"]) == {
        "trustDomain": "example.org", "rootNamespace": "mesh-b", "defaultConfig": {"discoveryAddress": "istiod.mesh-b.svc:15012"}}


def test_base_and_istiod_by_default() -> None:
    done = generate()
    assert done.returncode == 0, done.stderr
    kinds = {o["kind"] for o in yaml.safe_load_all(done.stdout) if o}
    assert {"ClusterRole", "ClusterRoleBinding", "Deployment", "Service"} <= kinds


def test_ambient_profile_adds_cni_and_ztunnel() -> None:
    """istioctl's habit: `--set profile=ambient` installs istiod with its ambient switch, the istio-cni
    agent (istiod's image, `istiod cni`) and Istio's ztunnel, in that order after base."""
    done = generate("--set", "profile=ambient", "--set", "hub=registry.example", "--set", "tag=1.2.3")
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    order = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert order.index(("Deployment", "istiod")) < order.index(("DaemonSet", "istio-cni-node")) < \
        order.index(("DaemonSet", "ztunnel"))
    named = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    [discovery] = named["Deployment", "istiod"]["spec"]["template"]["spec"]["containers"]
    assert {"name": "CA_TRUSTED_NODE_ACCOUNTS", "value": "istio-system/ztunnel"} in discovery["env"]
    [agent] = named["DaemonSet", "istio-cni-node"]["spec"]["template"]["spec"]["containers"]
    assert agent["image"] == discovery["image"] == "registry.example/istiod:1.2.3"
    assert named["DaemonSet", "ztunnel"]["metadata"]["namespace"] == "istio-system"

    # Components override the profile, wherever they are written.
    install = to_install({"spec": {"components": {"cni": {"enabled": False}}, "profile": "ambient"}})
    assert (install.cni, install.ztunnel, install.values["ambient"]) == (False, True, True)
    assert (to_install({}).cni, to_install({}).ztunnel, "ambient" in to_install({}).values) == (False, False, False)


@pytest.mark.parametrize(("sets", "message"), [
    (["revision=Canary"], "spec.revision: 'Canary' is not a DNS-1123 label"),
    (["components.pilot.k8s.hpaSpec.behavior.scaleDown.stabilizationWindowSeconds=60"],
     "spec.components.pilot.k8s.hpaSpec.behavior: unknown field"),
    (["components.pilot.k8s.serviceAnnotations.a=b"], "spec.components.pilot.k8s.serviceAnnotations: unknown field"),
    (["components.ingressGateways=[]"], "spec.components.ingressGateways: unknown field"),
    (["values.pilot.traceSampling=1.0"], "spec.values.pilot.traceSampling: unknown field"),
    (["profile=demo"], "spec.profile: 'demo': only the profiles default, ambient exist"),
    (["components.pilot.k8s.replicaCount=three"], "spec.components.pilot.k8s.replicaCount: 'three' is not an int"),
    (["components.pilot.k8s.hpaSpec.metrics=[{type: Pods}]"], "spec.components.pilot.k8s.hpaSpec.metrics[0]: only a Resource cpu"),
    (["components.pilot.k8s.replicaCount"], "--set components.pilot.k8s.replicaCount: expected path=value"),
])
def test_unknown_or_bad_fields_are_refused(sets: list[str], message: str) -> None:
    with pytest.raises(SpecError) as raised:
        to_install(with_sets({}, sets))
    assert message in str(raised.value)


def test_refusal_is_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "iop.yaml"
    spec.write_text("apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec: {components: {egressGateways: []}}\n")
    done = generate("-f", str(spec))
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == ("istiod manifest generate: spec.components.egressGateways: unknown field (not supported by this "
                           "installer)\n")
