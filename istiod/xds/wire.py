"""Responses as the bytes gRPC sends, built from entries serialized once per resource.

A resource's element of a response's repeated `resources` field is the same bytes for every connection
it goes to (Resource.sotw_entry, .delta_entry); only the nonce is the connection's own. Protobuf's wire
format is a concatenation of fields, in any order, so a small per-connection header (version, type,
nonce, removals) followed by the shared entries parses as the one response a client would otherwise
be sent. The ADS handlers send these bytes as they are (server.add_to_server).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from envoy.service.discovery.v3 import discovery_pb2

from istiod.xds.cache import Resource


# Nonces need only differ between this process's responses (and from another istiod's or worker's, to
# which a client may carry one over): a random prefix and a counter, not a uuid4 per response (a
# getrandom call and a UUID object each, a few percent of a connect storm's CPU).
_nonce_prefix = os.urandom(6).hex()
_nonce_numbers = itertools.count(1)


def nonce() -> str:
    return f"{_nonce_prefix}{next(_nonce_numbers):x}"


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One response to one connection, serialized when it is sent (`bytes()`): a connection's responses to
    one event are built together, and only the one on the wire need be held as bytes."""

    type_url: str
    nonce: str
    header: bytes  # every field but `resources`
    resources: list[Resource]  # what it carries
    delta: bool

    @property
    def size(self) -> int:
        """Bytes of the resources it carries (pilot_xds_config_size_bytes)."""
        return sum(len(r.value) for r in self.resources)

    def __bytes__(self) -> bytes:
        entries = (r.delta_entry for r in self.resources) if self.delta else (r.sotw_entry for r in self.resources)
        return b"".join([self.header, *entries])


def sotw(version: str, type_url: str, nonce: str, resources: list[Resource], control_plane: str = "") -> Outgoing:
    """`control_plane`: the identifier istiod sets in its answers to istio.io/debug/syncz."""
    header = discovery_pb2.DiscoveryResponse(version_info=version, type_url=type_url, nonce=nonce)
    if control_plane:
        header.control_plane.identifier = control_plane
    return Outgoing(type_url, nonce, header.SerializeToString(), resources, delta=False)


def delta(version: str, type_url: str, nonce: str, resources: list[Resource], removed: list[str]) -> Outgoing:
    header = discovery_pb2.DeltaDiscoveryResponse(system_version_info=version, type_url=type_url, nonce=nonce,
                                                  removed_resources=removed)
    return Outgoing(type_url, nonce, header.SerializeToString(), resources, delta=True)


def names_key(data: bytes, request: discovery_pb2.DiscoveryRequest) -> int | None:
    """A fingerprint of a state-of-the-world ACK's bytes but its version_info and response_nonce, which
    Envoy, gRPC and Go write first and last: two such requests of one stream with the same fingerprint
    name the same resources of the same type. An idle Envoy's EDS ACK names every cluster it knows;
    telling it from the last request by this (a hash of its bytes, 10 us for 1000 names) is four to
    eight times cheaper than comparing the names as strings. None when the request has no nonce or is
    not laid out so. A client that crafts a request to collide only keeps its own stream on the names it
    asked for before."""
    if not request.response_nonce:
        return None
    head = discovery_pb2.DiscoveryRequest(version_info=request.version_info).SerializeToString()
    tail = discovery_pb2.DiscoveryRequest(response_nonce=request.response_nonce).SerializeToString()
    if not data.startswith(head) or not data.endswith(tail) or len(data) < len(head) + len(tail):
        return None
    return hash(data[len(head):len(data) - len(tail)])
