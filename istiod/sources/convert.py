"""Kubernetes objects (plain dicts, as the API serves them) -> mesh model values.

Every function is pure and raises ConversionError with the object's kind/namespace/name and the
field that is wrong, so a source can log it and keep the object's last good state.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from istiod.envvars import resolve_hostname_gateways
from istiod.model.batch import CronJob, Job
from istiod.model.cluster import Namespace, Node
from istiod.model.config.common import Meta
from istiod.model.config.gateway_api import DEFAULTS_FOR_CLASS, ConfigMap
from istiod.model.config.kinds import unimplemented
from istiod.model.credentials import TlsCredential
from istiod.model.endpointslice import EndpointSlice, SliceEndpoint
from istiod.model.names import DEFAULT_DOMAIN
from istiod.model.quantity import QuantityError, parse_quantity
from istiod.model.service import Locality, Port, Service
from istiod.model.storage import PersistentVolume, PersistentVolumeClaim
from istiod.model.workload import LOCALITY_LABEL, MESH_ANNOTATIONS, OwnerRef, Workload, workload_identity
from istiod.sources.fields import ConversionError, ObjectKey, _Fields
from istiod.sources.gateway_api import CLUSTER_SCOPED as GATEWAY_API_CLUSTER_SCOPED
from istiod.sources.gateway_api import gateway_api_converter, kind_name
from istiod.sources.istio import istio_converter

CLUSTER_SCOPED = frozenset({"Namespace", "Node", "PersistentVolume"}) | GATEWAY_API_CLUSTER_SCOPED
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
REGION_LABEL = "topology.kubernetes.io/region"
ZONE_LABEL = "topology.kubernetes.io/zone"
SUBZONE_LABEL = "topology.istio.io/subzone"


def object_key(body: Any) -> ObjectKey:
    """The identity of a raw object; raises ConversionError when it has none."""
    if not isinstance(body, Mapping):
        raise ConversionError(f"expected a Kubernetes object (a map), got {type(body).__name__}")
    kind = body.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ConversionError("object has no kind")
    kind = kind_name(kind, body.get("apiVersion"))
    fields = _Fields(kind, body)
    name = fields.get("metadata.name", str, "")
    if not name:
        raise ConversionError(f"{kind} has no metadata.name")
    namespace = "" if kind in CLUSTER_SCOPED else fields.get("metadata.namespace", str, "") or "default"
    return ObjectKey(kind, namespace, name)


# The API server's name rules: names become hosts and route domains, so one it would refuse
# must not reach a proxy (a client would NACK the whole route configuration).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_RULES = {"Service": (_DNS_1035_LABEL, "a DNS-1035 label"), "Namespace": (_DNS_LABEL, "a DNS-1123 label")}


def _check_names(key: ObjectKey) -> None:
    pattern, rule = _NAME_RULES.get(key.kind, (_DNS_SUBDOMAIN, "a DNS-1123 subdomain"))
    if not pattern.fullmatch(key.name):
        raise ConversionError(f"{key}: metadata.name {key.name!r} is not {rule}")
    if key.namespace and not _DNS_LABEL.fullmatch(key.namespace):
        raise ConversionError(f"{key}: metadata.namespace {key.namespace!r} is not a DNS-1123 label")


def convert(body: Mapping[str, Any], domain: str = DEFAULT_DOMAIN) -> tuple[ObjectKey, Any]:
    """One raw object -> (its key, its model value)."""
    key = object_key(body)
    converter = CONVERTERS.get(key.kind)
    if converter is None:
        converter = gateway_api_converter(key, body)
    if converter is None:
        converter = istio_converter(key, body)
    if converter is None:
        reason = unimplemented(key.kind, str(body.get("apiVersion", "")))
        raise ConversionError(f"{key}: {reason or f'kind {key.kind!r} is not one istiod reads'}")
    _check_names(key)
    return key, converter(key, _Fields(key, body), domain)


def _namespace(key: ObjectKey, f: _Fields, domain: str) -> Namespace:
    return Namespace(key.name, f.str_map("metadata.labels"))


def _node(key: ObjectKey, f: _Fields, domain: str) -> Node:
    labels = dict(f.str_map("metadata.labels"))
    return Node(key.name, Locality(labels.get(REGION_LABEL, ""), labels.get(ZONE_LABEL, ""), labels.get(SUBZONE_LABEL, "")))


def _service(key: ObjectKey, f: _Fields, domain: str) -> Service:
    ports = []
    for i, p in enumerate(f.items("spec.ports")):
        number = p.get("port", int, None)
        if number is None or not 0 < number < 65536:
            raise f.fail(f"spec.ports[{i}].port {number!r} is not in 1-65535")
        target: Any = p.body.get("targetPort", number)
        if isinstance(target, bool) or not isinstance(target, (int, str)):
            raise f.fail(f"spec.ports[{i}].targetPort must be a number or a name")
        if isinstance(target, str) and target.isdigit():
            target = int(target)
        if target in (0, ""):  # the API's "unset": the service port itself
            target = number
        if isinstance(target, int) and not 0 < target < 65536:
            raise f.fail(f"spec.ports[{i}].targetPort {target} is not in 1-65535")
        ports.append(Port(p.get("name", str, ""), number, p.get("protocol", str, "TCP"), target,
                          p.get("appProtocol", str, "")))
    if len({p.port for p in ports}) != len(ports):
        raise f.fail("spec.ports has the same port twice")
    external_name = ""
    if f.get("spec.type", str, "") == "ExternalName":
        external_name = f.get("spec.externalName", str, "").rstrip(".").lower()
        if not _DNS_SUBDOMAIN.fullmatch(external_name):
            raise f.fail(f"spec.externalName {external_name!r} is not a DNS-1123 subdomain")
    return Service(
        name=key.name,
        namespace=key.namespace,
        domain=domain,
        ports=tuple(ports),
        selector=() if external_name else f.str_map("spec.selector"),
        labels=f.str_map("metadata.labels"),
        cluster_ip="" if external_name else _cluster_ip(f),
        export_to=_service_export_to(f),
        external_name=external_name,
        external_addresses=_external_addresses(f),
    )


def _external_addresses(f: _Fields) -> tuple[str, ...]:
    """As istiod: a LoadBalancer's ingress IPs (or hostnames, which istiod resolves for network
    gateways with RESOLVE_HOSTNAME_GATEWAYS, its default), then spec.externalIPs."""
    addresses = []
    if f.get("spec.type", str, "") == "LoadBalancer":
        for i, ingress in enumerate(f.items("status.loadBalancer.ingress")):
            if ip := ingress.get("ip", str, ""):
                addresses.append(f.ip(f"status.loadBalancer.ingress[{i}].ip", ip))
            elif (hostname := ingress.get("hostname", str, "")) and resolve_hostname_gateways():
                addresses.append(hostname)
    for i, ip in enumerate(f.get("spec.externalIPs", list, [])):
        addresses.append(f.ip(f"spec.externalIPs[{i}]", str(ip)))
    return tuple(addresses)


EXPORT_TO_ANNOTATION = "networking.istio.io/exportTo"


def _service_export_to(f: _Fields) -> tuple[str, ...]:
    """The annotation's comma-separated namespaces, `.`, `*` or `~`, as istiod reads it (unchecked:
    a value that names no namespace exports to none)."""
    value = dict(f.str_map("metadata.annotations")).get(EXPORT_TO_ANNOTATION, "")
    return tuple(sorted({v.strip() for v in value.split(",") if v.strip()}))


def _cluster_ip(f: _Fields) -> str:
    value: str = f.get("spec.clusterIP", str, "")
    return value if value in ("", "None") else f.ip("spec.clusterIP", value)


def _pod_ip(f: _Fields) -> str:
    value: str = f.get("status.podIP", str, "")
    return value and f.ip("status.podIP", value)


def _pod(key: ObjectKey, f: _Fields, domain: str) -> Workload:
    labels = f.str_map("metadata.labels")
    owners = [
        OwnerRef(o.get("kind", str, ""), o.get("name", str, ""), o.get("controller", bool, False))
        for o in f.items("metadata.ownerReferences")
    ]
    name, kind = workload_identity(key.name, dict(labels), owners)
    ready = any(
        c.get("type", str, "") == "Ready" and c.get("status", str, "") == "True"
        for c in f.items("status.conditions")
    )
    container_ports = []
    for c in f.items("spec.containers"):
        for p in c.items("ports"):
            number = p.get("containerPort", int, 0)
            if not 0 < number < 65536:
                raise f.fail(f"containerPort {number} is not in 1-65535")
            container_ports.append((p.get("name", str, ""), number))
    service_account = f.get("spec.serviceAccountName", str, "") or "default"
    if not _DNS_LABEL.fullmatch(service_account):  # it becomes part of the workload's SPIFFE identity
        raise f.fail(f"spec.serviceAccountName {service_account!r} is not a DNS-1123 label")
    claims = tuple(
        v.get("persistentVolumeClaim.claimName", str, "")
        for v in f.items("spec.volumes")
        if v.get("persistentVolumeClaim.claimName", str, "")
    )
    return Workload(
        name=key.name,
        namespace=key.namespace,
        ip=_pod_ip(f),
        ready=ready,
        phase=f.get("status.phase", str, ""),
        labels=labels,
        service_account=service_account,
        workload_name=name,
        workload_kind=kind,
        node_name=f.get("spec.nodeName", str, ""),
        uid=f.get("metadata.uid", str, ""),
        owner=next((o for o in owners if o.controller), None),
        claims=claims,
        container_ports=tuple(container_ports),
        locality_label=dict(labels).get(LOCALITY_LABEL, ""),
        annotations=tuple((k, v) for k, v in f.str_map("metadata.annotations") if k in MESH_ANNOTATIONS),
        host_network=f.get("spec.hostNetwork", bool, False),
        terminating=bool(f.get("metadata.deletionTimestamp", str, "")),
    )


def _endpoint_slice(key: ObjectKey, f: _Fields, domain: str) -> EndpointSlice:
    address_type = f.get("addressType", str, "IPv4")
    if address_type not in ("IPv4", "IPv6"):
        return EndpointSlice(key.name, key.namespace, "", (), ())  # FQDN slices carry no IPs
    ports = []
    for i, p in enumerate(f.items("ports")):
        number = p.get("port", int, None)
        if number is not None and not 0 < number < 65536:
            raise f.fail(f"ports[{i}].port {number} is not in 1-65535")
        if number is not None:
            ports.append((p.get("name", str, ""), number))
    endpoints = []
    for i, e in enumerate(f.items("endpoints")):
        addresses = e.get("addresses", list, [])
        if not all(isinstance(a, str) for a in addresses):
            raise f.fail("endpoints[].addresses must be strings")
        for j, address in enumerate(addresses):
            f.ip(f"endpoints[{i}].addresses[{j}]", address, 4 if address_type == "IPv4" else 6)
        target_is_pod = e.get("targetRef.kind", str, "") == "Pod"
        endpoints.append(
            SliceEndpoint(
                addresses=tuple(addresses),
                # The API says a missing `ready` means ready.
                ready=e.get("conditions.ready", bool, True),
                pod=e.get("targetRef.name", str, "") if target_is_pod else "",
                node_name=e.get("nodeName", str, ""),
                zone=e.get("zone", str, ""),
            )
        )
    return EndpointSlice(
        key.name,
        key.namespace,
        dict(f.str_map("metadata.labels")).get(SERVICE_NAME_LABEL, ""),
        tuple(ports),
        tuple(endpoints),
    )


def _quantity(f: _Fields, path: str) -> Any:
    text = f.get(path, (str, int, float), None)
    if text is None:
        return None
    try:
        return parse_quantity(str(text))
    except QuantityError as error:
        raise f.fail(f"{path}: {error}") from None


def _access_modes(f: _Fields, path: str) -> tuple[str, ...]:
    modes = f.get(path, list, [])
    if not all(isinstance(m, str) for m in modes):
        raise f.fail(f"{path} must be strings")
    return tuple(modes)


def _persistent_volume(key: ObjectKey, f: _Fields, domain: str) -> PersistentVolume:
    claim_name = f.get("spec.claimRef.name", str, "")
    return PersistentVolume(
        name=key.name,
        capacity=_quantity(f, "spec.capacity.storage"),
        access_modes=_access_modes(f, "spec.accessModes"),
        claim=(f.get("spec.claimRef.namespace", str, ""), claim_name) if claim_name else None,
        storage_class=f.get("spec.storageClassName", str, ""),
        phase=f.get("status.phase", str, ""),
    )


def _persistent_volume_claim(key: ObjectKey, f: _Fields, domain: str) -> PersistentVolumeClaim:
    return PersistentVolumeClaim(
        name=key.name,
        namespace=key.namespace,
        volume_name=f.get("spec.volumeName", str, ""),
        requested=_quantity(f, "spec.resources.requests.storage"),
        access_modes=_access_modes(f, "spec.accessModes"),
    )


def _job(key: ObjectKey, f: _Fields, domain: str) -> Job:
    finished = any(
        c.get("type", str, "") in ("Complete", "Failed") and c.get("status", str, "") == "True"
        for c in f.items("status.conditions")
    )
    cronjob = next(
        (
            o.get("name", str, "")
            for o in f.items("metadata.ownerReferences")
            if o.get("kind", str, "") == "CronJob" and o.get("controller", bool, False)
        ),
        "",
    )
    return Job(key.name, key.namespace, finished, cronjob)


def _cronjob(key: ObjectKey, f: _Fields, domain: str) -> CronJob:
    return CronJob(key.name, key.namespace, f.get("spec.schedule", str, ""), f.get("spec.suspend", bool, False))


# The keys istiod reads a gateway's certificate and key from: a kubernetes.io/tls Secret's, else a
# generic Secret's `cert` and `key`.
_CREDENTIAL_KEYS = (("tls.crt", "tls.key"), ("cert", "key"))
_CA_KEYS = (("cacert", "crl"), ("ca.crt", "ca.crl"))


def _config_map(key: ObjectKey, f: _Fields, domain: str) -> ConfigMap:
    """What the gateway deployment reads: the string data (a Gateway's overlays) and the class label."""
    labels = dict(f.str_map("metadata.labels"))
    return ConfigMap(Meta(key.name, key.namespace), f.str_map("data"), labels.get(DEFAULTS_FOR_CLASS, ""),
                     f.get("metadata.creationTimestamp", str, ""))


def _secret(key: ObjectKey, f: _Fields, domain: str) -> TlsCredential:
    """Only the certificate and key are kept; errors name the field, never its content."""
    data: dict[str, bytes] = {}
    for name, value in f.get("data", dict, {}).items():
        if not isinstance(value, str):
            raise f.fail(f"data.{name}: expected a base64 string")
        try:
            data[name] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise f.fail(f"data.{name}: not valid base64") from None
    for name, value in f.get("stringData", dict, {}).items():  # as the API server merges it, on top
        if not isinstance(value, str):
            raise f.fail(f"stringData.{name}: expected a string")
        data[name] = value.encode()
    # istiod's ExtractRoot: `cacert` (with `crl`), else `ca.crt` (with `ca.crl`).
    ca, crl = next(((data[c], data.get(r, b"")) for c, r in _CA_KEYS if data.get(c)), (b"", b""))
    if ca:
        ca = _pem(f, "ca.crt" if "ca.crt" in data and not data.get("cacert") else "cacert", ca, certificate=True)
    for cert_key, key_key in _CREDENTIAL_KEYS:
        if cert_key in data or key_key in data:
            if not data.get(cert_key) or not data.get(key_key):
                raise f.fail(f"data: {cert_key} and {key_key} must both be set")
            return TlsCredential(key.name, key.namespace, _pem(f, cert_key, data[cert_key], certificate=True),
                                 _pem(f, key_key, data[key_key], certificate=False), ca, crl)
    return TlsCredential(key.name, key.namespace, ca_cert=ca, crl=crl)


def _pem(f: _Fields, name: str, value: bytes, certificate: bool) -> bytes:
    """Checked here, so a bad Secret is one log line instead of a NACK of every gateway's secrets."""
    try:
        if certificate:
            x509.load_pem_x509_certificates(value)
        else:
            load_pem_private_key(value, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise f.fail(f"data.{name}: not a PEM {'certificate chain' if certificate else 'private key'}") from None
    return value


CONVERTERS: dict[str, Callable[[ObjectKey, _Fields, str], Any]] = {
    "Namespace": _namespace,
    "Node": _node,
    "Service": _service,
    "Pod": _pod,
    "EndpointSlice": _endpoint_slice,
    "PersistentVolume": _persistent_volume,
    "PersistentVolumeClaim": _persistent_volume_claim,
    "Job": _job,
    "CronJob": _cronjob,
    "Secret": _secret,
    "ConfigMap": _config_map,
}
