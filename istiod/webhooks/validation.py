"""The validating admission webhook (istiod's `validation.istio.io`): an AdmissionReview in, the
verdict out. Istio's kinds are validated by the same conversion the store uses, so the API server
refuses exactly what istiod would skip; any other object is allowed (the webhook's rules send
only Istio's groups)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from istiod.model.config.kinds import BY_KIND
from istiod.sources.convert import ConversionError, convert

log = logging.getLogger(__name__)
PATHS = ("/validate", "/admitpilot")  # istiod serves both; /admitpilot is the older name


def review(body: Any, domain: str) -> dict[str, Any]:
    """An AdmissionReview (v1 or v1beta1) -> the AdmissionReview answer; ValueError if malformed."""
    request, uid = admission_request(body)
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    obj = request.get("object")
    if request.get("operation") in ("CREATE", "UPDATE") and isinstance(obj, dict) and obj.get("kind") in BY_KIND:
        metadata = obj.get("metadata") or {}
        if not metadata.get("namespace") and request.get("namespace"):
            obj = {**obj, "metadata": {**metadata, "namespace": request["namespace"]}}
        try:
            convert(obj, domain)
        except ConversionError as error:
            log.info("webhook refused %s: %s", request.get("operation"), error)
            response = {"uid": uid, "allowed": False,
                        "status": {"code": 400, "reason": "BadRequest", "message": f"configuration is invalid: {error}"}}
    return admission_answer(body, response)


def admission_request(body: Any) -> tuple[dict[str, Any], str]:
    """An AdmissionReview's request and uid; ValueError if malformed."""
    if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
        raise ValueError("expected an AdmissionReview with a request")
    request = body["request"]
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ValueError("request.uid is missing")
    return request, uid


def admission_answer(body: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview answer, in the version it was asked in."""
    return {"apiVersion": body.get("apiVersion", "admission.k8s.io/v1"), "kind": "AdmissionReview", "response": response}


def create_webhook_app(domain: str) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    async def validate(request: Request) -> dict[str, Any]:
        try:
            return review(await request.json(), domain)
        except ValueError as error:  # JSON that does not parse is a ValueError too
            raise HTTPException(400, f"bad AdmissionReview: {error}") from None

    for path in PATHS:
        app.add_api_route(path, validate, methods=["POST"])
    return app
