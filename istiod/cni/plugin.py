"""`istio-cni`: the chained CNI plugin the container runtime runs for every pod sandbox.

CNI spec: the command in CNI_COMMAND (ADD, DEL, CHECK, VERSION, STATUS, GC), the sandbox in
CNI_CONTAINERID/CNI_NETNS/CNI_IFNAME, the pod in CNI_ARGS (`K8S_POD_NAME=..;K8S_POD_NAMESPACE=..`),
our entry of the network config list on stdin with the previous plugin's result as `prevResult`.
ADD hands the pod to the node agent (HTTP on its Unix socket, `pluginevent.sock` under
`cni_agent_run_dir`), which captures it if it is ambient, before any container runs; then the
previous result goes back unchanged. DEL tells the agent the pod's sandbox is gone. Errors are the
spec's JSON (`code`, `msg`) on stdout with exit status 1. Only the standard library is loaded here:
the runtime starts this for every pod.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn

from istiod.unixhttp import UnixHTTPConnection

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
DEFAULT_RUN_DIR = "/var/run/istio-cni"
EVENT_SOCKET = "pluginevent.sock"
AGENT_TIMEOUT = 30.0  # the agent may wait for its informer, then for ztunnel's Ack
# The spec's well-known error codes.
INCOMPATIBLE_VERSION, INVALID_ENV, DECODE_FAILED, INVALID_CONFIG, TRY_AGAIN_LATER = 1, 4, 6, 7, 11
AGENT_FAILED = 999  # the agent refused or failed the capture (Go's libcni uses 999 for plugin errors)


class CniError(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


def _post(run_dir: str, path: str, event: dict[str, Any]) -> tuple[int, str]:
    connection = UnixHTTPConnection(os.path.join(run_dir, EVENT_SOCKET), AGENT_TIMEOUT)
    try:
        connection.request("POST", path, json.dumps(event), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace").strip()
    finally:
        connection.close()


def _config(stdin: str) -> dict[str, Any]:
    try:
        config = json.loads(stdin)
    except json.JSONDecodeError as error:
        raise CniError(DECODE_FAILED, f"network config on stdin is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise CniError(DECODE_FAILED, "network config on stdin is not a JSON object")
    version = config.get("cniVersion")
    if not isinstance(version, str) or not version:
        raise CniError(INVALID_CONFIG, "network config has no cniVersion")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(INCOMPATIBLE_VERSION, f"cniVersion {version} is not supported ({', '.join(SUPPORTED_VERSIONS)})")
    return config


def _env(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise CniError(INVALID_ENV, f"{name} is not set")
    return value


def _pod(cni_args: str) -> tuple[str, str]:
    """(namespace, name) from CNI_ARGS; empty when the sandbox is not a Kubernetes pod's."""
    pairs = dict(part.partition("=")[::2] for part in cni_args.split(";") if part)
    return pairs.get("K8S_POD_NAMESPACE", ""), pairs.get("K8S_POD_NAME", "")


def _prev_result(config: dict[str, Any]) -> dict[str, Any]:
    result = config.get("prevResult")
    if not isinstance(result, dict):
        raise CniError(INVALID_CONFIG, f"{config.get('type', 'istio-cni')} must be chained after the primary "
                                       "network plugin: no prevResult in its config")
    return result


def _excluded(config: dict[str, Any], namespace: str) -> bool:
    excluded = config.get("exclude_namespaces") or []
    return not namespace or isinstance(excluded, list) and namespace in excluded


def run(command: str, stdin: str) -> str:
    """What the plugin prints for `command`; CniError on failure."""
    if command == "VERSION":
        version = _config(stdin).get("cniVersion") if stdin.strip() else SUPPORTED_VERSIONS[-1]
        return json.dumps({"cniVersion": version, "supportedVersions": list(SUPPORTED_VERSIONS)})
    config = _config(stdin)
    run_dir = str(config.get("cni_agent_run_dir") or DEFAULT_RUN_DIR)
    if command == "ADD":
        result = _prev_result(config)
        netns, _, _ = _env("CNI_NETNS"), _env("CNI_CONTAINERID"), _env("CNI_IFNAME")
        namespace, name = _pod(os.environ.get("CNI_ARGS", ""))
        if not _excluded(config, namespace) and name:
            ips = [ip.get("address", "") for ip in result.get("ips") or [] if isinstance(ip, dict)]
            event = {"Netns": netns, "PodName": name, "PodNamespace": namespace, "IPs": ips}
            try:
                status, reason = _post(run_dir, "/cmdadd", event)
            except OSError as error:
                raise CniError(TRY_AGAIN_LATER, f"istio-cni node agent at {run_dir}/{EVENT_SOCKET}: {error}") from None
            if status != 200:
                raise CniError(AGENT_FAILED, f"istio-cni node agent: pod {namespace}/{name}: {reason}")
        return json.dumps({**result, "cniVersion": config["cniVersion"]})
    if command == "DEL":
        _env("CNI_CONTAINERID")
        namespace, name = _pod(os.environ.get("CNI_ARGS", ""))
        if not _excluded(config, namespace) and name:
            try:
                status, reason = _post(run_dir, "/cmddel", {"PodName": name, "PodNamespace": namespace,
                                                             "Netns": os.environ.get("CNI_NETNS", "")})
            except OSError as error:  # DEL must succeed: the agent releases pods it finds gone
                print(f"istio-cni: DEL {namespace}/{name}: node agent unreachable: {error}", file=sys.stderr)
                return ""
            if status != 200:
                print(f"istio-cni: DEL {namespace}/{name}: node agent: {reason}", file=sys.stderr)
        return ""
    if command == "CHECK":
        _env("CNI_CONTAINERID")
        _prev_result(config)
        return ""
    if command in ("STATUS", "GC"):
        return ""
    raise CniError(INVALID_ENV, f"CNI_COMMAND {command!r} is not one of ADD, DEL, CHECK, VERSION, STATUS, GC")


def main() -> NoReturn:
    command = os.environ.get("CNI_COMMAND", "")
    stdin = "" if command == "VERSION" and sys.stdin.isatty() else sys.stdin.read()
    try:
        output = run(command, stdin)
    except CniError as error:
        version = "1.0.0"
        try:
            version = json.loads(stdin).get("cniVersion") or version
        except (json.JSONDecodeError, AttributeError):
            pass
        print(json.dumps({"cniVersion": version, "code": error.code, "msg": error.msg}))
        sys.exit(1)
    if output:
        print(output)
    sys.exit(0)


if __name__ == "__main__":
    main()
