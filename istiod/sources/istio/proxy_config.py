"""ProxyConfig (networking.istio.io/v1beta1) -> model, with Istio's validation (ValidateProxyConfig)."""

from __future__ import annotations

from istiod.model.config.proxy_config import ProxyConfig
from istiod.sources.fields import ObjectKey, _Fields
from istiod.sources.istio.common import fields, meta, only, spec, workload_selector

IMAGE_TYPES = ("default", "debug", "distroless")  # Istio's published proxy image variants


def proxy_config(key: ObjectKey, f: _Fields, domain: str) -> ProxyConfig:
    s = spec(f, ("selector", "concurrency", "environmentVariables", "image"))
    concurrency = s.get("concurrency", int, None)
    if concurrency is not None and concurrency < 0:
        raise s.fail("concurrency: concurrency must be greater than or equal to 0")
    image_type = None
    if (image := fields(s, "image")) is not None:
        only(image, ("imageType",))
        image_type = image.get("imageType", str, "")
    return ProxyConfig(
        meta=meta(key),
        selector=workload_selector(f),
        concurrency=concurrency,
        environment_variables=s.str_map("environmentVariables"),
        image_type=image_type,
        created=f.get("metadata.creationTimestamp", str, ""),
    )
