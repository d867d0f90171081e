"""A service port's application protocol, by Istio's rules: `appProtocol` if set, else the port
name's prefix before the first `-` (`http-web` is HTTP), case-insensitive; UDP from the port's
protocol. What these leave open (UNSUPPORTED) sidecars sniff, as Istio's (see the README)."""

from __future__ import annotations

from enum import Enum

from istiod.model.service import Port


class Protocol(str, Enum):
    HTTP = "HTTP"
    HTTP2 = "HTTP2"
    GRPC = "GRPC"
    GRPC_WEB = "GRPC-Web"
    HTTP_PROXY = "HTTP_PROXY"
    HTTPS = "HTTPS"
    TLS = "TLS"
    TCP = "TCP"
    UDP = "UDP"
    MONGO = "Mongo"
    REDIS = "Redis"
    MYSQL = "MySQL"
    UNSUPPORTED = "UnsupportedProtocol"  # Istio's "sniff it"

    @property
    def is_http(self) -> bool:
        """Served by an HTTP connection manager (routes), not a TCP proxy."""
        return self in _HTTP

    @property
    def is_http2(self) -> bool:
        """Talks HTTP/2 to its upstream."""
        return self in (Protocol.HTTP2, Protocol.GRPC, Protocol.GRPC_WEB)


_HTTP = frozenset({Protocol.HTTP, Protocol.HTTP2, Protocol.GRPC, Protocol.GRPC_WEB, Protocol.HTTP_PROXY})
_NAMES = {
    "tcp": Protocol.TCP, "udp": Protocol.UDP, "grpc": Protocol.GRPC, "grpc-web": Protocol.GRPC_WEB,
    "http": Protocol.HTTP, "http_proxy": Protocol.HTTP_PROXY, "http2": Protocol.HTTP2, "https": Protocol.HTTPS,
    "tls": Protocol.TLS, "mongo": Protocol.MONGO, "redis": Protocol.REDIS, "mysql": Protocol.MYSQL,
}
# appProtocol values Kubernetes defines (a port name cannot hold them).
_KUBERNETES_APP_PROTOCOLS = {
    "kubernetes.io/h2c": Protocol.HTTP2, "kubernetes.io/ws": Protocol.HTTP, "kubernetes.io/wss": Protocol.HTTP,
}


def parse(name: str) -> Protocol:
    return _NAMES.get(name.lower(), Protocol.UNSUPPORTED)


def port_protocol(port: Port) -> Protocol:
    if port.protocol.upper() == "UDP":
        return Protocol.UDP
    name = port.app_protocol or port.name
    if port.app_protocol in _KUBERNETES_APP_PROTOCOLS:
        return _KUBERNETES_APP_PROTOCOLS[port.app_protocol]
    if name.lower().startswith("grpc-web"):  # before the prefix cut: its own name has a `-`
        return Protocol.GRPC_WEB
    return parse(name.partition("-")[0])
