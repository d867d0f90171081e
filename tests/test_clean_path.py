"""Paths cleaned as Go's net/http ServeMux cleans them, on every HTTP port (istioctl asks for `//version`)."""

from __future__ import annotations

from typing import Any

import pytest

from istiod.debug.serving import CleanPath, clean_path


@pytest.mark.parametrize(("path", "clean"), [
    ("/version", "/version"), ("//version", "/version"), ("/", "/"), ("//", "/"), ("/a/../b", "/b"),
    ("/debug/", "/debug/"), ("/a/./b//", "/a/b/"), ("/../x", "/x"), ("", "/"),
])
def test_clean_path_as_go(path: str, clean: str) -> None:
    assert clean_path(path) == clean


async def test_unclean_path_is_redirected_with_its_query() -> None:
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("an unclean path reached the app")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "//debug//syncz", "query_string": b"proxyID=a.b"}
    await CleanPath(app)(scope, None, send)
    assert sent[0]["status"] == 301
    assert dict(sent[0]["headers"])[b"location"] == b"/debug/syncz?proxyID=a.b"
