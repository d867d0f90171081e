"""security.istio.io values: PeerAuthentication, AuthorizationPolicy, RequestAuthentication."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from istiod.model.config.common import Labels, Meta


class MTLSMode(enum.Enum):
    UNSET = "UNSET"  # inherit from the parent (namespace, then mesh)
    DISABLE = "DISABLE"
    PERMISSIVE = "PERMISSIVE"
    STRICT = "STRICT"


@dataclass(frozen=True, slots=True)
class PeerAuthentication:
    meta: Meta
    selector: Labels = ()
    mode: MTLSMode = MTLSMode.UNSET
    port_level: tuple[tuple[int, MTLSMode], ...] = ()


class Action(enum.Enum):
    ALLOW = "ALLOW"
    DENY = "DENY"
    AUDIT = "AUDIT"
    CUSTOM = "CUSTOM"


@dataclass(frozen=True, slots=True)
class Source:
    principals: tuple[str, ...] = ()
    not_principals: tuple[str, ...] = ()
    request_principals: tuple[str, ...] = ()
    not_request_principals: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    not_namespaces: tuple[str, ...] = ()
    ip_blocks: tuple[str, ...] = ()
    not_ip_blocks: tuple[str, ...] = ()
    remote_ip_blocks: tuple[str, ...] = ()
    not_remote_ip_blocks: tuple[str, ...] = ()
    service_accounts: tuple[str, ...] = ()  # `sa` (the policy's namespace) or `ns/sa`
    not_service_accounts: tuple[str, ...] = ()
    trust_domains: tuple[str, ...] = ()  # of the peer's SPIFFE identity; `*` at either end matches any
    not_trust_domains: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Operation:
    hosts: tuple[str, ...] = ()
    not_hosts: tuple[str, ...] = ()
    ports: tuple[int, ...] = ()
    not_ports: tuple[int, ...] = ()
    methods: tuple[str, ...] = ()
    not_methods: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    not_paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Condition:
    key: str
    values: tuple[str, ...] = ()
    not_values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Rule:
    """Matches when any `from` and any `to` and every `when` holds (an empty list holds)."""

    sources: tuple[Source, ...] = ()
    operations: tuple[Operation, ...] = ()
    when: tuple[Condition, ...] = ()


@dataclass(frozen=True, slots=True)
class AuthorizationPolicy:
    meta: Meta
    selector: Labels = ()
    action: Action = Action.ALLOW
    rules: tuple[Rule, ...] = ()  # ALLOW with no rules allows nothing; DENY with none denies nothing
    provider: str = ""  # CUSTOM only
    # targetRef(s): (kind, name) in the policy's namespace, `Gateway` (a waypoint, or a gateway the
    # Gateway API deployed) or `Service` (on its waypoint). Such a policy applies there only, never by
    # selector or namespace-wide.
    target_refs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class JWTHeader:
    name: str
    prefix: str = ""


@dataclass(frozen=True, slots=True)
class JWTRule:
    issuer: str
    audiences: tuple[str, ...] = ()
    jwks: str = ""  # inline JSON Web Key Set; wins over jwks_uri (and the issuer's OpenID discovery)
    from_headers: tuple[JWTHeader, ...] = ()
    from_params: tuple[str, ...] = ()
    from_cookies: tuple[str, ...] = ()
    output_payload_to_header: str = ""
    forward_original_token: bool = False
    output_claim_to_headers: tuple[tuple[str, str], ...] = ()  # (header, claim)
    jwks_uri: str = ""  # istiod fetches it (istiod/jwks.py) and serves the keys inline
    timeout: float = 5.0  # seconds, for fetching jwks_uri (istiod's default)


@dataclass(frozen=True, slots=True)
class RequestAuthentication:
    meta: Meta
    selector: Labels = ()
    jwt_rules: tuple[JWTRule, ...] = ()
    # (kind, name): a Gateway (a waypoint, or a gateway the Gateway API deployed) or a Service (its
    # waypoint), instead of a selector.
    target_refs: tuple[tuple[str, str], ...] = ()
