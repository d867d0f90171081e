"""A canary upgrade on the real kube-apiserver, as Istio's: the default revision's istiod and a
second istiod started with `--revision py` (its own CA, so whose caBundle is whose can be told),
each with its webhooks (Istio's names and selectors) addressed by URL. The API server calls exactly
one revision's /inject per pod: relabelling a namespace istio.io/rev=py moves new pods to py, and
back rolls back; a revision tag (`istiod tag set prod --revision py`) sends istio.io/rev=prod to py.
Each istiod fills only the caBundles of its own revision's webhooks, reads only the config of its
revision, and holds the shared leader lock under its own revision key."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import Cluster
from e2e.istio_crds import create_istio_object, install_crds
from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace
from e2e.test_injection import app_pod, by_url, manifests
from e2e.test_rbac import istiod_kubeconfig
from istiod import revision as rev
from tests.peers import ROOT, Istiod, Process, eventually, free_port
from tests.pki import write_plugged

NS = "e2e-canary"
TAGGED = "e2e-canary-tag"


def revision_configmap(configmap: dict[str, Any], revision: str) -> dict[str, Any]:
    """The injector ConfigMap of a revision, as the chart renders it: its name, and values.revision."""
    configmap = copy.deepcopy(configmap)
    configmap["metadata"]["name"] = rev.injector_configmap(revision)
    values = json.loads(configmap["data"]["values"])
    configmap["data"]["values"] = json.dumps({**values, "revision": revision})
    return configmap


FOREIGN = "someone-else.example.com"  # a webhook in py's configuration that is not istiod's to patch
FOREIGN_BUNDLE = "-----BEGIN CERTIFICATE-----\nnot istiod's\n-----END CERTIFICATE-----\n"


def py_injector(port: int) -> dict[str, Any]:
    client_config = {"url": f"https://127.0.0.1:{port}/inject"}
    foreign = {**rev.injection_webhooks("py", {"url": "https://127.0.0.1:1/other",
                                                "caBundle": base64.b64encode(FOREIGN_BUNDLE.encode()).decode()})[0],
               "name": FOREIGN, "objectSelector": {"matchLabels": {"never": "matches"}}}
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": rev.injector_name("py"), "labels": {"app": "sidecar-injector", "istio.io/rev": "py"}},
            "webhooks": [*rev.injection_webhooks("py", client_config), foreign]}


def validator(revision: str, port: int) -> dict[str, Any]:
    """A revision's validator, failurePolicy Ignore so that no other test meets it."""
    config = yaml.safe_load((ROOT / "deploy" / "webhooks" / "validation.yaml").read_text())
    config["metadata"]["name"] = rev.validator_name(revision)
    config["metadata"]["labels"]["istio.io/rev"] = revision
    hook = config["webhooks"][0]
    hook.update(clientConfig={"url": f"https://127.0.0.1:{port}/validate"}, failurePolicy="Ignore",
                namespaceSelector={"matchLabels": {"kubernetes.io/metadata.name": NS}})
    return config


def injected_by(pod: client.V1Pod) -> dict[str, Any]:
    """Which revision injected a stored pod, and which istiod its proxy would connect to."""
    status = (pod.metadata.annotations or {}).get("sidecar.istio.io/status")
    proxy = next((c for c in pod.spec.containers if c.name == "istio-proxy"), None)
    ca = next((e.value for e in proxy.env if e.name == "CA_ADDR"), None) if proxy else None
    return {"revision": json.loads(status)["revision"] if status else None, "CA_ADDR": ca}


async def relabel(core: client.CoreV1Api, name: str, labels: dict[str, str]) -> None:
    await core.patch_namespace(name, [{"op": "replace", "path": "/metadata/labels",
                                       "value": {"kubernetes.io/metadata.name": name, **labels}}])


def bundle_of(config: Any) -> set[str]:
    """The PEM each of istiod's webhooks trusts (the client returns the bytes base64-encoded)."""
    return {base64.b64decode(h.client_config.ca_bundle or "").decode() for h in config.webhooks if h.name != FOREIGN}


def tag_cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "istiod", "tag", *args, "--kubeconfig", str(cluster.kubeconfig)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


async def test_canary_revision_takes_relabelled_namespaces_and_tags(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]
) -> None:
    core, admission = client.CoreV1Api(kube), client.AdmissionregistrationV1Api(kube)
    await install_crds(kube)
    await ensure_namespace(kube, NS, {"istio-injection": "enabled"})
    await ensure_namespace(kube, TAGGED)
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    webhooks, configmap = manifests()
    default_port, py_port = free_port(), free_port()
    created: list[tuple[str, str]] = []
    try:
        for cm in (configmap, revision_configmap(configmap, "py")):
            await core.create_namespaced_config_map(ISTIO_NAMESPACE, cm)
            created.append(("ConfigMap", cm["metadata"]["name"]))
        for mutating in (by_url(webhooks, default_port), py_injector(py_port)):
            await admission.create_mutating_webhook_configuration(mutating)
            created.append(("Mutating", mutating["metadata"]["name"]))
        for validating in (validator("default", default_port), validator("py", py_port)):
            await admission.create_validating_webhook_configuration(validating)
            created.append(("Validating", validating["metadata"]["name"]))
        py_root, _ = write_plugged(tmp_path / "py-ca", "py")
        (tmp_path / "default").mkdir()
        (tmp_path / "py").mkdir()
        default = Istiod(tmp_path / "default", "--kubeconfig", str(kubeconfig), "--webhook-addr",
                         f"127.0.0.1:{default_port}", ready_timeout=60)
        processes.append(default)
        py = Istiod(tmp_path / "py", "--kubeconfig", str(kubeconfig), "--webhook-addr", f"127.0.0.1:{py_port}",
                    "--revision", "py", "--plugged-ca-dir", str(tmp_path / "py-ca"), ready_timeout=60)
        processes.append(py)
        py_pem = (tmp_path / "py-ca" / "root-cert.pem").read_text()

        # Each istiod fills its own revision's webhooks, and only those.
        read_mwc, read_vwc = admission.read_mutating_webhook_configuration, admission.read_validating_webhook_configuration

        async def bundles() -> dict[str, set[str]] | None:
            found = {"default injector": bundle_of(await read_mwc(rev.injector_name("default"))),
                     "py injector": bundle_of(await read_mwc(rev.injector_name("py"))),
                     "default validator": bundle_of(await read_vwc(rev.validator_name("default"))),
                     "py validator": bundle_of(await read_vwc(rev.validator_name("py")))}
            return found if all(len(b) == 1 and "" not in b for b in found.values()) else None

        found = await eventually(bundles, 20, "both istiods to fill their webhooks' caBundle")
        print("caBundle roots:", {k: [x509_subject(p) for p in v] for k, v in found.items()})
        assert found["py injector"] == found["py validator"] == {py_pem}
        assert found["default injector"] == found["default validator"] != {py_pem}
        foreign = next(h for h in (await read_mwc(rev.injector_name("py"))).webhooks if h.name == FOREIGN)
        assert base64.b64decode(foreign.client_config.ca_bundle).decode() == FOREIGN_BUNDLE  # not istiod's: untouched

        async def injected(namespace: str, name: str, revision: str | None) -> dict[str, Any]:
            """A pod created until `revision` injects it: the API server sees a namespace's new labels
            through its own informer, a moment after the change (a pod it sent elsewhere is deleted)."""
            async def attempt() -> dict[str, Any] | None:
                try:
                    pod = await core.create_namespaced_pod(namespace, app_pod(name))
                except ApiException as error:  # until the injector ConfigMap is read, /inject fails (Fail)
                    print("not yet:", json.loads(error.body)["message"])
                    return None
                await core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
                print(f"{namespace}/{name} injected by:", injected_by(pod))
                return injected_by(pod) if injected_by(pod)["revision"] == revision else None
            return await eventually(attempt, 15, f"pod {namespace}/{name} to be injected by {revision}", interval=0.3)

        assert await injected(NS, "before", "default") == {"revision": "default", "CA_ADDR": "istiod.istio-system.svc:15012"}
        await relabel(core, NS, {"istio.io/rev": "py"})
        assert await injected(NS, "canary", "py") == {"revision": "py", "CA_ADDR": "istiod-py.istio-system.svc:15012"}
        await relabel(core, NS, {"istio-injection": "enabled"})  # the rollback
        assert (await injected(NS, "rolled-back", "default"))["CA_ADDR"] == "istiod.istio-system.svc:15012"
        await relabel(core, NS, {"istio.io/rev": "canary"})  # no such revision: nobody injects
        assert await injected(NS, "orphan", None) == {"revision": None, "CA_ADDR": None}

        # A tag: `istiod tag set prod --revision py`, and istio.io/rev=prod goes to py.
        done = tag_cli(cluster, "set", "prod", "--revision", "py")
        print(done.stdout, done.stderr)
        assert done.returncode == 0 and "Revision tag 'prod' created, referencing control plane revision 'py'" in done.stdout
        created.append(("Mutating", rev.tag_webhook_name("prod")))
        tag = await read_mwc(rev.tag_webhook_name("prod"))
        assert (tag.metadata.labels["istio.io/tag"], tag.metadata.labels["istio.io/rev"]) == ("prod", "py")
        again = tag_cli(cluster, "set", "prod", "--revision", "py")
        assert again.returncode == 1 and "revision tag 'prod' already exists, and --overwrite is false" in again.stderr
        missing = tag_cli(cluster, "set", "prod", "--revision", "nope", "--overwrite")
        assert missing.returncode == 1 and "cannot find MutatingWebhookConfiguration with revision 'nope'" in missing.stderr
        await relabel(core, TAGGED, {"istio.io/rev": "prod"})
        assert (await injected(TAGGED, "tagged", "py"))["CA_ADDR"] == "istiod-py.istio-system.svc:15012"
        listed = tag_cli(cluster, "list")
        print(listed.stdout)
        assert listed.stdout.splitlines() == ["TAG  REVISION NAMESPACES", f"prod py       {TAGGED}"]
        refused = tag_cli(cluster, "remove", "prod")
        assert refused.returncode == 1 and f"still injected by tag 'prod': {TAGGED}" in refused.stderr
        removed = tag_cli(cluster, "remove", "prod", "-y")
        assert removed.stdout == "Revision tag prod removed\n"
        created.remove(("Mutating", rev.tag_webhook_name("prod")))

        # `tag set default --revision py`: py becomes the default revision; the old default injector
        # is kept but matches nothing (as istioctl), so istio-injection=enabled goes to py alone.
        done = tag_cli(cluster, "set", "default", "--revision", "py")
        assert done.returncode == 0, done.stderr
        created.append(("Mutating", rev.tag_webhook_name("default")))
        old = await read_mwc(rev.injector_name("default"))
        assert {json.dumps(h.namespace_selector.match_labels) for h in old.webhooks} == {'{"istio.io/deactivated": "never-match"}'}
        await relabel(core, NS, {"istio-injection": "enabled"})
        assert await injected(NS, "promoted", "py") == {"revision": "py", "CA_ADDR": "istiod-py.istio-system.svc:15012"}

        # Config labelled for a revision is that revision's only.
        await create_istio_object(kube, vs("canary-route", {"istio.io/rev": "py"}))
        await create_istio_object(kube, vs("shared-route", {}))

        def names(istiod: Istiod) -> set[str] | None:
            status, objects = istiod.get("/debug/configz")
            # This test's namespace only: other tests of the session may leave VirtualServices elsewhere.
            found = ({o["metadata"]["name"] for o in objects
                      if o.get("kind") == "VirtualService" and o["metadata"].get("namespace") == NS}
                     if status == 200 else set())
            return found if "shared-route" in found else None

        assert await eventually(lambda: names(py), 10, "py to read its config") == {"canary-route", "shared-route"}
        assert await eventually(lambda: names(default), 10, "default to read its config") == {"shared-route"}

        # One leader across revisions, recording its revision as istiod's holderKey.
        async def holder() -> str | None:
            try:
                lock = await core.read_namespaced_config_map("istio-namespace-controller-election", ISTIO_NAMESPACE)
            except ApiException:
                return None
            record = json.loads((lock.metadata.annotations or {}).get("control-plane.alpha.kubernetes.io/leader", "{}"))
            return f"{record.get('holderKey')}" if record.get("holderIdentity") else None

        key = await eventually(holder, 20, "a leader")
        print("leader's holderKey:", key)
        assert key in ("default", "py")
        for istiod in (default, py):
            assert "Forbidden" not in istiod.text()
    finally:
        for kind, name in reversed(created):
            try:
                if kind == "ConfigMap":
                    await core.delete_namespaced_config_map(name, ISTIO_NAMESPACE)
                elif kind == "Mutating":
                    await admission.delete_mutating_webhook_configuration(name)
                else:
                    await admission.delete_validating_webhook_configuration(name)
            except ApiException as error:
                print("cleanup:", kind, name, error.status)


def vs(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
            "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"hosts": ["echo"], "http": [{"route": [{"destination": {"host": "echo"}}]}]}}


def x509_subject(pem: str) -> str:
    from cryptography import x509
    return x509.load_pem_x509_certificate(pem.encode()).subject.rfc4514_string()
