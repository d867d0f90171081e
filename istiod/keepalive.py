"""istiod's gRPC server keepalive (pkg/keepalive), the same on the plaintext and the secure port.

As in istiod: the server pings a connection quiet for `time` and closes it when no answer comes
within `timeout`; clients may ping every `time / 2` at most; a connection older than
`max_connection_age` is sent a GOAWAY and closed after a grace period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_MAX_MS = 2**31 - 1  # gRPC core's "never"


@dataclass(frozen=True, slots=True)
class Keepalive:
    time: float = 30.0  # --keepaliveInterval
    timeout: float = 10.0  # --keepaliveTimeout
    max_connection_age: float = math.inf  # --keepaliveMaxServerConnectionAge
    max_connection_age_grace: float = 10.0

    def server_options(self) -> list[tuple[str, int]]:
        """grpcio server options with grpc-go's server semantics, which istiod has."""
        return [
            ("grpc.keepalive_time_ms", _ms(self.time)),
            ("grpc.keepalive_timeout_ms", _ms(self.timeout)),
            # grpcio 1.85 times a keepalive ping out only after this (default 1 min), whatever the above.
            ("grpc.http2.ping_timeout_ms", _ms(self.timeout)),
            # grpc-go servers ping connections without streams too, so a dead idle peer goes as well.
            ("grpc.keepalive_permit_without_calls", 1),
            # gRPC core stops pinging after two pings without data in between; grpc-go never does.
            ("grpc.http2.max_pings_without_data", 0),
            # istiod's EnforcementPolicy{MinTime: Time / 2}: a client pinging more often gets a GOAWAY.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", _ms(self.time / 2)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.max_connection_age_ms", _ms(self.max_connection_age)),
            ("grpc.max_connection_age_grace_ms", _ms(self.max_connection_age_grace)),
        ]


def _ms(seconds: float) -> int:
    return _MAX_MS if seconds == math.inf else min(_MAX_MS, max(1, round(seconds * 1000)))
