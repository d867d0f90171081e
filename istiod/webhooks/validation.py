"""The validating admission webhook (istiod's `validation.istio.io`): an AdmissionReview in, the
verdict out. Istio's kinds are validated by the same conversion the store uses, so the API server
refuses exactly what istiod would skip; any other object is allowed (the webhook's rules send
only Istio's groups), those of Istio's kinds this istiod does not implement with a warning saying so."""

from __future__ import annotations

import functools
import logging
from typing import Any

from fastapi import FastAPI

from istiod.model.config import envoyfilter
from istiod.model.config.kinds import BY_KIND, unimplemented
from istiod.sources.convert import ConversionError, convert
from istiod.webhooks.admission import add_review_route, admission_answer, admission_request

log = logging.getLogger(__name__)
PATHS = ("/validate", "/admitpilot")  # istiod serves both; /admitpilot is the older name


def review(body: Any, domain: str) -> dict[str, Any]:
    """An AdmissionReview (v1 or v1beta1) -> the AdmissionReview answer; ValueError if malformed."""
    request, uid = admission_request(body)
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    obj = request.get("object") or {}
    kind = obj.get("kind")
    if request.get("operation") in ("CREATE", "UPDATE") and isinstance(kind, str) and kind in BY_KIND:
        metadata = obj.get("metadata") or {}
        # A mistyped metadata is convert's to name.
        if isinstance(metadata, dict) and not metadata.get("namespace") and request.get("namespace"):
            obj = {**obj, "metadata": {**metadata, "namespace": request["namespace"]}}
        try:
            convert(obj, domain)
        except ConversionError as error:
            log.info("webhook refused %s: %s", request.get("operation"), error)
            response = {"uid": uid, "allowed": False,
                        "status": {"code": 400, "reason": "BadRequest", "message": f"configuration is invalid: {error}"}}
        else:
            if kind == "EnvoyFilter":  # as istiod's validation warns
                response["warnings"] = [envoyfilter.WARNING]
    elif request.get("operation") in ("CREATE", "UPDATE") and isinstance(kind, str) and (
            warning := unimplemented(kind, str(obj.get("apiVersion", "")))) is not None:
        response["warnings"] = [warning]
    return admission_answer(body, response)


def create_webhook_app(domain: str) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    add_review_route(app, PATHS, functools.partial(review, domain=domain))
    return app
