"""A small client for istiod's debug endpoints: GET, parse JSON, turn failures into one message."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

TIMEOUT_SECONDS = 10.0


class ToolError(Exception):
    """A failure to show the user as one line, without a traceback."""


class DebugClient:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    @property
    def address(self) -> str:
        """host:port of istiod, shown in the ISTIOD column."""
        return urllib.parse.urlsplit(self.base_url).netloc

    def get(self, path: str, **query: str) -> Any:
        url = f"{self.base_url}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as reply:
                body = reply.read()
        except urllib.error.HTTPError as error:
            raise ToolError(f"{path}: HTTP {error.code}: {_reason(error.read())}") from None
        except (urllib.error.URLError, OSError) as error:
            raise ToolError(f"cannot reach istiod at {self.base_url}: {getattr(error, 'reason', error)}") from None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            raise ToolError(f"{path}: istiod answered with something that is not JSON") from None


def _reason(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace").strip() or "no reason given"
