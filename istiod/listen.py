"""A listening TCP socket for the HTTP servers (istiod's debug ports, the agent's status ports)."""

from __future__ import annotations

import socket


def listen_tcp(host: str, port: int) -> socket.socket:
    """Bound and listening, non-blocking; `host` "" is every IPv4 interface, `port` 0 a free port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host or "0.0.0.0", port))
    sock.listen(128)
    sock.setblocking(False)
    return sock
