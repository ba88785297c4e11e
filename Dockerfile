# syntax=docker/dockerfile:1
# The relay image: `docker run IMAGE` runs `outbox-kafka relay`; `docker run IMAGE migrate` migrates.

# ---- build: the package and every dependency as wheels
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY outbox_kafka ./outbox_kafka
RUN pip wheel --wheel-dir /wheels .

# ---- runtime: the wheels installed, nothing else (no compiler, no dev or embedded extras)
FROM python:3.11-slim
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels outbox-kafka \
    && groupadd --system --gid 10001 outbox \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin outbox

# The metrics, /healthz and /readyz port; bound on every interface so Prometheus can scrape it.
ENV OUTBOX_METRICS_HOST=0.0.0.0 OUTBOX_METRICS_PORT=9400
EXPOSE 9400

# Numeric, so Kubernetes can check runAsNonRoot against the image.
USER 10001:10001
WORKDIR /tmp

# slim has no curl: python's urllib asks the relay's own health endpoint.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('OUTBOX_METRICS_PORT', '9400'), timeout=4)"]

ENTRYPOINT ["outbox-kafka"]
CMD ["relay"]
