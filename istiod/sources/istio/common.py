"""Reading and validating the parts Istio's kinds share, as istiod's validation does.

Every check raises ConversionError naming the object and the field; fields of Istio's API this
istiod does not implement are refused by name (UNSUPPORTED lists them), never silently ignored.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import durationpy

from istiod.model.config.common import Labels, MatchKind, Meta, StringMatch, regex_problem
from istiod.model.labels import EXPRESSION_OPERATORS, Requirement, Selector
from istiod.sources.fields import ObjectKey, _Fields

_DNS1123_LABEL = re.compile(r"[a-zA-Z0-9]([-a-zA-Z0-9]{0,61}[a-zA-Z0-9])?")
_WILDCARD_LABEL = re.compile(r"\*|(\*-?)?[a-zA-Z0-9]([-a-zA-Z0-9]{0,61}[a-zA-Z0-9])?|\*[a-zA-Z0-9]")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_LABEL_PREFIX = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _join(key: object, path: str) -> str:
    """`<object> spec.http[0].route` whether `key` is the object or a reader already below it."""
    return f"{key} {path}" if isinstance(key, ObjectKey) else f"{key}.{path}"


def fields(f: _Fields, path: str) -> _Fields | None:
    """A nested map as its own reader whose errors name `<object> <path>`; None when absent."""
    value = f.get(path, dict, None)
    return None if value is None else _Fields(_join(f.key, path), value)


def items(f: _Fields, path: str) -> list[_Fields]:
    """A list of maps, each a reader whose errors name `<object> <path>[i]`."""
    return [_Fields(f"{_join(f.key, path)}[{i}]", item.body) for i, item in enumerate(f.items(path))]


def only(f: _Fields, known: Iterable[str], unsupported: Iterable[str] = ()) -> None:
    """Refuse fields we do not know, and fields of Istio's API we do not implement (named as such)."""
    unsupported = set(unsupported)
    for name in f.body:
        if name in unsupported:
            raise f.fail(f"{name} is not supported by this istiod")
        if name not in known:
            raise f.fail(f"unknown field {name!r}")


def str_list(f: _Fields, path: str) -> tuple[str, ...]:
    values = f.get(path, list, [])
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise f.fail(f"{path}[{i}]: expected str, got {type(value).__name__}")
    return tuple(values)


def integer(f: _Fields, path: str, low: int = 0, high: int | None = None) -> int | None:
    """An integer field (YAML int, or a numeric string as protobuf's JSON allows for 64-bit values)."""
    value = f.get(path, (int, str), None)
    if isinstance(value, str):
        if not value.lstrip("-").isdigit():
            raise f.fail(f"{path}: {value!r} is not an integer")
        value = int(value)
    if value is not None and (value < low or (high is not None and value > high)):
        raise f.fail(f"{path}: {value} is not in {low}-{high}" if high is not None else f"{path}: {value} < {low}")
    return value


def port(f: _Fields, path: str) -> int | None:
    return integer(f, path, 1, 65535)


def duration(f: _Fields, path: str, check: bool = True) -> timedelta | None:
    """A duration in Go's grammar (`1.5s`, `1h30m`), as istiod reads Istio YAML; with `check`,
    istiod's rule: at least 1ms, whole milliseconds."""
    text = f.get(path, str, None)
    if text is None:
        return None
    try:
        value = durationpy.from_str(text)
    except (durationpy.DurationError, ValueError) as error:
        raise f.fail(f"{path}: {text!r} is not a duration ({error})") from None
    if check:
        if value < timedelta(milliseconds=1):
            raise f.fail(f"{path}: duration must be greater than 1ms (got {text})")
        if value % timedelta(milliseconds=1):
            raise f.fail(f"{path}: only durations to ms precision are supported (got {text})")
    return value


def percentage(f: _Fields, path: str) -> float | None:
    """`percentage: {value: 12.5}` (Istio's Percent), 0-100."""
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("value",))
    value = sub.get("value", (int, float), 0)
    if not 0 <= value <= 100:
        raise f.fail(f"{path}.value: percentage {value} is not in range 0..100")
    return float(value)


def string_match(f: _Fields, path: str) -> StringMatch | None:
    sub = fields(f, path)
    return None if sub is None else _string_match(sub)


def _string_match(sub: _Fields) -> StringMatch:
    only(sub, ("exact", "prefix", "regex"))
    if len(sub.body) != 1:
        raise sub.fail("exactly one of exact, prefix or regex is required")
    name, value = next(iter(sub.body.items()))
    if not isinstance(value, str):
        raise sub.fail(f"{name}: expected str")
    if name == "regex":
        if not value:
            raise sub.fail("regex: regex string match should not be empty")
        regex(sub, "regex", value)
    return StringMatch(MatchKind(name), value)


def string_match_list(f: _Fields, path: str) -> tuple[StringMatch, ...]:
    """A list of StringMatch (CORS allowOrigins)."""
    return tuple(_string_match(item) for item in items(f, path))


def string_matches(f: _Fields, path: str) -> tuple[tuple[str, StringMatch], ...]:
    """A map of name -> StringMatch (header and query-parameter matches; names may hold dots)."""
    result = []
    for name, value in sorted(str_keyed(f, path).items()):
        if not isinstance(value, dict):
            raise f.fail(f"{path}.{name}: expected a match (exact, prefix or regex)")
        result.append((name, _string_match(_Fields(f"{_join(f.key, path)}.{name}", value))))
    return tuple(result)


def str_keyed(f: _Fields, path: str) -> dict[str, Any]:
    """A map whose keys must be strings (names), whatever its values."""
    value = f.get(path, dict, {})
    if not all(isinstance(k, str) for k in value):
        raise f.fail(f"{path}: keys must be strings")
    return value


def regex(f: _Fields, path: str, pattern: str) -> None:
    """An RE2 pattern Envoy compiles: valid, and no larger than the program size our proxies allow."""
    problem = regex_problem(pattern)
    if problem:
        raise f.fail(f"{path}: {problem}")


def labels(f: _Fields, path: str) -> Labels:
    """A label map (source labels, subset labels, Gateway selector), with Kubernetes' rules."""
    value = f.str_map(path)
    for key, text in value:
        check_label(f, path, key, text)
    return value


def check_label(f: _Fields, path: str, key: str, value: str) -> None:
    prefix, _, name = key.rpartition("/")
    if (prefix and not _LABEL_PREFIX.fullmatch(prefix)) or not _LABEL_NAME.fullmatch(name):
        raise f.fail(f"{path}: invalid label key {key!r}")
    if not _LABEL_VALUE.fullmatch(value):
        raise f.fail(f"{path}: invalid label value {value!r} for {key!r}")


def workload_selector(f: _Fields, path: str = "spec.selector") -> Labels:
    """`{matchLabels: {...}}` as PeerAuthentication, AuthorizationPolicy, DestinationRule ... carry it."""
    sub = fields(f, path)
    if sub is None:
        return ()
    only(sub, ("matchLabels",))
    result = labels(f, f"{path}.matchLabels")
    for key, value in result:
        if "*" in key or "*" in value:
            raise f.fail(f"{path}.matchLabels: wildcard is not supported in selector")
    return result


def export_to(f: _Fields) -> tuple[str, ...]:
    values = str_list(f, "spec.exportTo")
    for value in values:
        if value not in (".", "*", "~") and not dns1123_label(value):
            raise f.fail(f"spec.exportTo: {value!r} is not a namespace, '.', '*' or '~'")
    if len(values) > 1 and ("*" in values or "~" in values):
        raise f.fail("spec.exportTo: '*' and '~' cannot be combined with other values")
    return tuple(sorted(set(values)))


def dns1123_label(text: str) -> bool:
    return bool(_DNS1123_LABEL.fullmatch(text))


def wildcard_domain_error(domain: str) -> str | None:
    """istiod's ValidateWildcardDomain: a wildcard only as (a prefix of) the first label."""
    if not domain:
        return "empty domain name not allowed"
    if len(domain) > 255:
        return f"domain name {domain!r} too long (max 255)"
    first, _, rest = domain.partition(".")
    if not _WILDCARD_LABEL.fullmatch(first):
        return f"domain name {domain!r} invalid (label {first!r} invalid)"
    return _labels_error(domain, rest) if rest else None


def fqdn_error(domain: str) -> str | None:
    if not domain or len(domain) > 255:
        return f"domain name {domain!r} is empty or too long"
    return _labels_error(domain, domain)


def _labels_error(domain: str, labels_text: str) -> str | None:
    parts = labels_text.split(".")
    if parts[-1].isdigit():
        return f"domain name {domain!r} invalid (top level domain {parts[-1]!r} cannot be all-numeric)"
    for i, label in enumerate(parts):
        if i == len(parts) - 1 and label == "" and i > 0:
            return None  # a trailing dot
        if not dns1123_label(label):
            return f"domain name {domain!r} invalid (label {label!r} invalid)"
    return None


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def ip_or_cidr(f: _Fields, path: str, text: str) -> None:
    try:
        ipaddress.ip_network(text, strict=False) if "/" in text else ipaddress.ip_address(text)
    except ValueError:
        raise f.fail(f"{path}: {text!r} is not an IP address or CIDR") from None


def resolve_host(host: str, namespace: str, domain: str) -> str:
    """istiod's ResolveShortnameToFQDN: a name without a dot is a Service in the object's namespace."""
    if host.startswith("*") or "." in host or is_ip(host):
        return host
    return f"{host}.{namespace}.svc.{domain}"


PROTOCOLS = frozenset({"TCP", "UDP", "GRPC", "GRPC-WEB", "HTTP", "HTTP_PROXY", "HTTP2", "HTTPS", "TLS",
                       "MONGO", "REDIS", "MYSQL"})


def protocol(f: _Fields, path: str, allow_empty: bool = False) -> str:
    """Istio's protocol names, case-insensitive as istiod parses them, stored upper-case; empty
    (protocol sniffing) only where istiod allows it (ServiceEntry ports)."""
    value = f.get(path, str, "")
    if not (allow_empty and value == "") and value.upper() not in PROTOCOLS:
        raise f.fail(f"{path}: {value!r} is not a valid protocol")
    return value.upper()


def raise_if(f: _Fields, error: str | None, path: str) -> None:
    if error:
        raise f.fail(f"{path}: {error}")


def meta(key: ObjectKey) -> Meta:
    return Meta(key.name, key.namespace)


def spec(f: _Fields, known: tuple[str, ...], unsupported: tuple[str, ...] = ()) -> _Fields:
    """The object's spec, with only the fields we know (and none of those we refuse)."""
    body = fields(f, "spec")
    if body is None:
        raise f.fail("spec is required")
    only(body, known, unsupported)
    return body


def enum_field(f: _Fields, path: str, enum_type: type, default: str) -> object:
    value = f.get(path, str, default)
    try:
        return enum_type(value)
    except ValueError:
        names = ", ".join(m.value for m in enum_type)  # type: ignore[attr-defined]
        raise f.fail(f"{path}: {value!r} is not one of {names}") from None


def label_selector(s: _Fields) -> Selector:
    """A Kubernetes label selector (matchLabels and matchExpressions), with its validation."""
    only(s, ("matchLabels", "matchExpressions"))
    match_labels = s.str_map("matchLabels")
    for key, value in match_labels:
        check_label(s, "matchLabels", key, value)
    expressions = []
    for e in items(s, "matchExpressions"):
        only(e, ("key", "operator", "values"))
        key, operator, values = e.get("key", str, ""), e.get("operator", str, ""), str_list(e, "values")
        if not key:
            raise e.fail("key is required")
        if operator not in EXPRESSION_OPERATORS:
            raise e.fail(f"operator: {operator!r} is not one of {', '.join(EXPRESSION_OPERATORS)}")
        if (operator in ("In", "NotIn")) != bool(values):
            raise e.fail(f"values: {operator} needs {'some values' if operator in ('In', 'NotIn') else 'no values'}")
        expressions.append(Requirement(key, EXPRESSION_OPERATORS[operator], values))
    return Selector(tuple(Requirement(k, "=", (v,)) for k, v in match_labels) + tuple(expressions))
