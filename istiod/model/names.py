"""Istio's naming rules for hosts, clusters, listeners and identities."""

from __future__ import annotations

import re
from functools import lru_cache

DEFAULT_DOMAIN = "cluster.local"
DEFAULT_CLUSTER_ID = "Kubernetes"  # istiod's --clusterID default; part of workload uids
INBOUND_LISTENER_PREFIX = "xds.istio.io/grpc/lds/inbound/"


def service_hostname(name: str, namespace: str, domain: str = DEFAULT_DOMAIN) -> str:
    return f"{name}.{namespace}.svc.{domain}"


def outbound_cluster_name(port: int, hostname: str, subset: str = "") -> str:
    return f"outbound|{port}|{subset}|{hostname}"


def inbound_cluster_name(port: int) -> str:
    return f"inbound|{port}||"


# Parsed per requested name, per proxy, per push: cached, bounded in count and in length (clients choose
# the names: the caches keep at most a few MB of theirs after they go, however long the names they sent).
# Longer than any name of a DNS host (253) and its port or subset (63) is parsed each time.
CACHED_NAME_LENGTH = 400


def parse_cluster_name(name: str) -> tuple[str, int, str, str]:
    """Split `direction|port|subset|host`; raises ValueError for anything else."""
    return _parse_cluster_name_cached(name) if len(name) <= CACHED_NAME_LENGTH else _parse_cluster_name(name)


def _parse_cluster_name(name: str) -> tuple[str, int, str, str]:
    parts = name.split("|")
    if len(parts) != 4 or parts[0] not in ("inbound", "outbound"):
        raise ValueError(f"not an Istio cluster name: {name!r}")
    return parts[0], int(parts[1]), parts[2], parts[3]


_parse_cluster_name_cached = lru_cache(maxsize=16384)(_parse_cluster_name)


def inbound_listener_name(ip: str, port: int) -> str:
    return f"{INBOUND_LISTENER_PREFIX}{join_host_port(ip, port)}"


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(value: str, *, allow_empty_host: bool = False, allow_zero_port: bool = False) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); raises ValueError.

    A listen address may leave the host empty (`:15010`, every interface) and use port 0 (a free
    port): the flags allow those, a name to connect to does not.
    """
    split = _split_host_port_cached if len(value) <= CACHED_NAME_LENGTH else _split_host_port
    return split(value, allow_empty_host=allow_empty_host, allow_zero_port=allow_zero_port)


def _split_host_port(value: str, *, allow_empty_host: bool, allow_zero_port: bool) -> tuple[str, int]:
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]:")
        if not sep:
            raise ValueError(f"bad host:port {value!r}")
        port_text = rest
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep or not (host or allow_empty_host):
            raise ValueError(f"bad host:port {value!r}")
    if not port_text.isdigit() or not (0 if allow_zero_port else 1) <= int(port_text) < 65536:
        raise ValueError(f"bad port in {value!r}")
    return host, int(port_text)


_split_host_port_cached = lru_cache(maxsize=16384)(_split_host_port)


def listener_host_aliases(name: str, namespace: str, domain: str = DEFAULT_DOMAIN) -> tuple[str, ...]:
    """The host spellings a proxyless client may use for one Service, longest first."""
    return (
        service_hostname(name, namespace, domain),
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}",
    )


DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def check_account(namespace: str, service_account: str) -> None:
    """An identity's parts must be DNS-1123 labels, or text like `ns/../sa/x` or `demo?x=1#` would
    become a SPIFFE URI that names another account, or none; ValueError says which part is wrong."""
    for what, value in (("namespace", namespace), ("service account", service_account)):
        if not DNS_1123_LABEL.fullmatch(value):
            raise ValueError(f"{what} {value!r} is not a DNS-1123 label")


def parse_account(text: str) -> tuple[str, str]:
    """`namespace/serviceaccount` -> its two parts, both checked; ValueError says what is wrong."""
    namespace, slash, service_account = text.partition("/")
    if not slash:
        raise ValueError(f"{text!r} is not 'namespace/serviceaccount'")
    check_account(namespace, service_account)
    return namespace, service_account


def spiffe_identity(trust_domain: str, namespace: str, service_account: str) -> str:
    check_account(namespace, service_account)
    return f"spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}"


def parse_spiffe_identity(uri: str) -> tuple[str, str, str] | None:
    """`spiffe://<trust domain>/ns/<namespace>/sa/<service account>` -> its three parts, else None."""
    prefix = "spiffe://"
    if not uri.startswith(prefix):
        return None
    parts = uri[len(prefix):].split("/")
    if len(parts) != 5 or parts[1] != "ns" or parts[3] != "sa" or not parts[0]:
        return None
    try:
        check_account(parts[2], parts[4])
    except ValueError:
        return None
    return parts[0], parts[2], parts[4]
