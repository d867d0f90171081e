"""Pods injected with Istio's own layout (the injector config's `layout: istio`), run as a kubelet
would run them, with Istio's REAL pilot-agent and a real Envoy against an istiod started here.

For pods a-1 and b-1 of deploy/sidecars/mesh.yaml the webhook's patch is applied; then, in network
namespaces made here: the volumes the injected istio-proxy container mounts are laid out under a pod
root (projected istio-token, the root from istio-ca-root-cert, the downward-API pod info, emptyDirs),
istio-init's args run as `pilot-agent istio-iptables ...`, and istio-proxy's args run with its env
(fieldRefs resolved, $(VAR) expanded) as uid 1337 in that root (pilot-agent's paths are relative to
its working directory, `/` in Istio's image). istiod runs STRICT mTLS; tokens are the CA's static ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from istiod.demo.pods import ENVOY_UID, Netns, Node, sweep
from istiod.webhooks.injection import inject, parse_injector
from tests.envoy_peer import envoy_binary
from tests.peers import ROOT, Istiod, Process, free_port, istio_binary, istio_source, wait_until
from tests.pods import admin, app, shared_dir, wait_serving
NAMESPACE = "sidecars"
HOST = f"b.{NAMESPACE}.svc.cluster.local"
VIP = "10.96.0.3"
NODE_IP = "10.44.0.1"
TOKENS = {"a-s3cret": f"{NAMESPACE}/a", "b-s3cret": f"{NAMESPACE}/b"}
A_ID = f"spiffe://cluster.local/ns/{NAMESPACE}/sa/a"
ISTIOD_IN_POD = "127.0.0.1"  # istiod.istio-system.svc inside each pod: the tunnel's end
XDS_TYPES = ("cluster", "listener", "endpoint", "route")


def injector_values() -> dict[str, Any]:
    """The chart's values for layout istio; the image's Envoy path is where this machine has it."""
    return {"global": {"hub": "docker.io/istio", "tag": "1.28.0", "istioNamespace": "istio-system",
                       "proxy": {"image": "proxyv2"}},
            "meshConfig": {"defaultConfig": {"discoveryAddress": "istiod.istio-system.svc:15012",
                                             "binaryPath": envoy_binary()}}}


def injected(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod after the webhook's JSONPatch (each op an `add` of a whole field)."""
    config = "policy: enabled\ndefaultTemplates: [sidecar]\nlayout: istio\n"
    injector = parse_injector(config, json.dumps(injector_values()), "test")
    out = json.loads(json.dumps(pod))
    for op in inject(pod, injector):
        assert op["op"] == "add"
        _, section, key = op["path"].split("/")
        out.setdefault(section, {})[key] = op["value"]
    return out


def kube_env(container: Mapping[str, Any], pod: Mapping[str, Any], node: str) -> dict[str, str]:
    """A container's env as the kubelet gives it: fieldRefs and resourceFieldRefs resolved."""
    fields = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
              "status.podIP": pod["status"]["podIP"], "status.hostIP": NODE_IP,
              "spec.serviceAccountName": pod["spec"]["serviceAccountName"], "spec.nodeName": node}
    limits = container.get("resources", {}).get("limits", {})
    resources = {"limits.cpu": str(-(-int(limits["cpu"].rstrip("m")) // 1000)),  # ceil of cores, divisor 1
                 "limits.memory": str(int(limits["memory"].rstrip("Mi")) << 20)}
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = item["value"]
        elif "fieldRef" in source:
            env[item["name"]] = fields[source["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = resources[source["resourceFieldRef"]["resource"]]
    return env


def expand(arg: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion in args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def lay_out_volumes(root: Path, pod: Mapping[str, Any], container: Mapping[str, Any], token: str,
                    root_cert: Path) -> None:
    """What the kubelet mounts for `container`, as files under `root` (its `/`), over what Istio's
    proxy image holds there (the Envoy bootstrap template pilot-agent fills)."""
    template = root / "var" / "lib" / "istio" / "envoy" / "envoy_bootstrap_tmpl.json"
    template.parent.mkdir(parents=True)
    shutil.copyfile(istio_source("tools/packaging/common/envoy_bootstrap.json"), template)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    labels = "\n".join(f'{k}="{v}"' for k, v in sorted(pod["metadata"]["labels"].items()))
    annotations = "\n".join(f'{k}={json.dumps(v)}' for k, v in sorted(pod["metadata"]["annotations"].items()))
    for mount in container["volumeMounts"]:
        target = root / mount["mountPath"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        volume = volumes[mount["name"]]
        if "projected" in volume:
            source = volume["projected"]["sources"][0]["serviceAccountToken"]
            assert source["audience"] == "istio-ca"
            (target / source["path"]).write_text(token)
        elif "configMap" in volume and volume["configMap"]["name"] == "istio-ca-root-cert":
            shutil.copyfile(root_cert, target / "root-cert.pem")
        elif "downwardAPI" in volume:
            assert [i["path"] for i in volume["downwardAPI"]["items"]] == ["labels", "annotations"]
            (target / "labels").write_text(labels)
            (target / "annotations").write_text(annotations)
        else:
            assert "emptyDir" in volume or volume["configMap"].get("optional"), volume
    for path in (root, *root.rglob("*")):
        os.chown(path, ENVOY_UID, ENVOY_UID)


@dataclass
class Pods:
    istiod: Istiod
    node: Node
    a: Netns
    b: Netns
    specs: dict[str, dict[str, Any]]
    agents: dict[str, Process]


def mesh_pods() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "sidecars" / "mesh.yaml").read_text()) if d]
    pods = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Pod"}
    # b-1's app has an HTTP readiness probe: under STRICT mTLS only the agent's rewrite can answer it.
    pods["b-1"]["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/ready", "port": 8080},
                                                            "timeoutSeconds": 2}
    return pods


@contextlib.contextmanager
def istio_pods(workdir: Path, *istiod_flags: str) -> Iterator[Pods]:
    """istiod (STRICT mTLS, static tokens, `istiod_flags`) and pods a-1 and b-1 running pilot-agent and
    Envoy, b-1 serving HTTP on 8080 with a readiness probe; all removed at the end, even on failure."""
    pilot_agent = istio_binary("pilot-agent")
    sweep()
    (workdir / "mesh").mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "sidecars" / "mesh.yaml", workdir / "mesh" / "mesh.yaml")
    (workdir / "tokens.json").write_text(json.dumps(TOKENS))
    secure_port = free_port()
    home = shared_dir("sp-istio-")
    node = Node()
    processes: list[Process] = []
    istiod = None
    try:
        istiod = Istiod(workdir, "--config-dir", str(workdir / "mesh"), "--poll-interval", "100ms",
                        "--ca-static-tokens", str(workdir / "tokens.json"),
                        "--secure-grpc-addr", f"127.0.0.1:{secure_port}", "--mtls", *istiod_flags)
        hosts = {HOST: VIP, f"b.{NAMESPACE}": VIP, "istiod.istio-system.svc": ISTIOD_IN_POD}
        netns = {"a-1": node.add_pod("a", 2, hosts), "b-1": node.add_pod("b", 3, hosts)}
        specs = {name: injected(pod) for name, pod in mesh_pods().items()}
        agents = {}
        for name, token in (("a-1", "a-s3cret"), ("b-1", "b-s3cret")):
            spec, ns = specs[name], netns[name]
            init = next(c for c in spec["spec"]["initContainers"] if c["name"] == "istio-init")
            capture = ns.run(pilot_agent, *init["args"], timeout=60)  # the image's entrypoint is pilot-agent
            assert capture.returncode == 0, capture.stdout + capture.stderr
            tunnel = Process([sys.executable, "-m", "istiod.demo.pods", "tunnel", "--netns", ns.name,
                              "--listen", f"{ISTIOD_IN_POD}:15012", "--to", f"127.0.0.1:{secure_port}"],
                             name=f"tunnel-{name}")
            processes.append(tunnel)
            wait_serving(tunnel)
            proxy = next(c for c in spec["spec"]["containers"] if c["name"] == "istio-proxy")
            root = home / name
            lay_out_volumes(root, spec, proxy, token, istiod.root_cert)
            env = kube_env(proxy, spec, "node")
            args = [expand(a, env) for a in proxy["args"]]
            agents[name] = Process(ns.exec_args("env", "-i", "-C", str(root), *(f"{k}={v}" for k, v in env.items()),
                                                pilot_agent, *args, uid=ENVOY_UID), name=f"pilot-agent-{name}")
            processes.append(agents[name])
        b_http = app(netns["b-1"], "http-server", "--address", "10.44.0.3:8080", "--name", "b-1", name="b-http")
        processes.append(b_http)
        wait_serving(b_http)
        for name in agents:
            wait_until(lambda: admin(netns[name], "/ready").strip() == "LIVE" or agents[name].proc.poll() is not None,
                       90, f"Envoy of {name} to be ready")
            assert agents[name].proc.poll() is None, agents[name].log()
        yield Pods(istiod, node, netns["a-1"], netns["b-1"], specs, agents)
    finally:
        for process in reversed(processes):
            process.stop()
            if process.name.startswith("pilot-agent"):
                print(f"--- {process.name}:\n{process.log()}")
        if istiod is not None:
            istiod.stop()
        node.delete()
        shutil.rmtree(home, ignore_errors=True)


def proxy_id(name: str, ip: str) -> str:
    return f"sidecar~{ip}~{name}.{NAMESPACE}~{NAMESPACE}.svc.cluster.local"
