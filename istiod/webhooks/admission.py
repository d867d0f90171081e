"""What both webhooks share: an AdmissionReview request read (3 MiB at most), parsed and answered
off the event loop, and the answer's envelope.

The port is unauthenticated and shares its event loop with ADS. A body is read only up to the cap;
parsing and the review run in a small thread pool, so the Python work of a large review yields to
the loop every switch interval instead of holding it. (The JSON parse itself is one C call that
holds the GIL: the cap is what bounds it.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from istiod import logs

log = logging.getLogger(__name__)
_refusals = logs.Throttled(log)  # any client can send garbage, as often as it likes
# The API server's own request limit; an AdmissionReview above it is not one it sends.
MAX_REQUEST_BODY = 3 * 1024 * 1024
# Two at a time: reviews are CPU work under one GIL, and each holds its parsed body.
_REVIEWS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="admission-review")

Review = Callable[[Any], dict[str, Any]]


def admission_request(body: Any) -> tuple[dict[str, Any], str]:
    """An AdmissionReview's request and uid; ValueError names a field that is missing or mistyped."""
    if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
        raise ValueError("expected an AdmissionReview with a request")
    if not isinstance(body.get("apiVersion", ""), str):
        raise ValueError("apiVersion: expected a string")
    request = body["request"]
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ValueError("request.uid is missing")
    for name in ("operation", "namespace", "name"):
        if not isinstance(request.get(name, ""), str):
            raise ValueError(f"request.{name}: expected a string")
    if not isinstance(request.get("object") or {}, dict):
        raise ValueError("request.object: expected an object")
    return request, uid


def admission_answer(body: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview answer, in the version it was asked in."""
    return {"apiVersion": body.get("apiVersion", "admission.k8s.io/v1"), "kind": "AdmissionReview", "response": response}


def add_review_route(app: FastAPI, paths: Iterable[str], review: Review) -> None:
    """POST `paths` -> `review` of the parsed body. A ValueError (a body that is not JSON or not an
    AdmissionReview, or nested deeper than Python parses) is a 400 with the reason; a LookupError (no
    config to review with) a 500 with the reason, so the API server applies the failurePolicy."""

    async def handle(request: Request) -> dict[str, Any]:
        body = await _read(request)
        try:
            return await asyncio.get_running_loop().run_in_executor(_REVIEWS, _answer, review, body)
        except ValueError as error:  # JSON that does not parse is a ValueError too
            _refusals.warning(logs.event("webhook: bad AdmissionReview", path=request.url.path,
                                         client=request.client.host if request.client else "", reason=str(error)))
            raise HTTPException(400, f"bad AdmissionReview: {error}") from None
        except LookupError as error:
            raise HTTPException(500, str(error)) from None

    for path in paths:
        app.add_api_route(path, handle, methods=["POST"])


def _answer(review: Review, body: bytes) -> dict[str, Any]:
    try:
        return review(json.loads(body))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


async def _read(request: Request) -> bytes:
    """The body, or 413 as soon as it is known to pass the cap (the connection is then closed, so
    the rest is never read)."""
    too_large = HTTPException(413, f"Request entity too large: limit is {MAX_REQUEST_BODY}",
                              headers={"Connection": "close"})
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_REQUEST_BODY:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_REQUEST_BODY:
            raise too_large
    return bytes(body)
