"""`istiod agent wait`: pilot-agent's wait, the postStart hook of holdApplicationUntilProxyStarts. Kubernetes
starts the pod's next container only when istio-proxy's hook returns, so apps start with the proxy ready."""

from __future__ import annotations

import argparse
import logging
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)


def add_wait_flags(parser: argparse.ArgumentParser) -> None:
    """pilot-agent wait's flags, by its names."""
    parser.add_argument("--timeoutSeconds", type=int, default=60, help="maximum number of seconds to wait for Envoy "
                        "to be ready (default 60)")
    parser.add_argument("--requestTimeoutMillis", type=int, default=500,
                        help="number of milliseconds to wait for response (default 500)")
    parser.add_argument("--periodMillis", type=int, default=500,
                        help="number of milliseconds to wait between attempts (default 500)")
    parser.add_argument("--url", default="http://localhost:15021/healthz/ready", help="URL to use in requests")


def _ready(url: str, timeout: float) -> str | None:
    """None when `url` answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return None if reply.status == 200 else f"HTTP status code {reply.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP status code {error.code}"
    except OSError as error:
        return str(getattr(error, "reason", error))


def run_wait(args: argparse.Namespace) -> int:
    log.info("Waiting for Envoy proxy to be ready (timeout: %d seconds)...", args.timeoutSeconds)
    deadline = time.monotonic() + args.timeoutSeconds
    while True:
        error = _ready(args.url, args.requestTimeoutMillis / 1000)
        if error is None:
            log.info("Envoy is ready!")
            return 0
        if time.monotonic() >= deadline:
            log.error("timeout waiting for Envoy proxy to become ready. Last error: %s", error)
            return 1
        time.sleep(args.periodMillis / 1000)
