# Goodput Gateway image: `docker build -t goodput-gateway .`
# Two stages: the build stage installs the package (pip install .) into a venv, its per-request
# decision modules compiled with mypyc (scripts/compile.py, as `make install` does); the runtime
# stage copies only that venv onto a clean slim base and runs it as an unprivileged user.

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# mypyc's C compiler; the runtime stage has none.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential=12.9 \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
# .dockerignore keeps everything else out of the context.
COPY pyproject.toml README.md ./
COPY app ./app
COPY scripts/__init__.py scripts/compile.py ./scripts/
# The dependencies first (mypyc type-checks against them), then the compiled modules, then the
# package with its extensions (package data); mypy, a build tool only, leaves the venv.
RUN /opt/venv/bin/pip install --no-cache-dir . \
    && /opt/venv/bin/pip install --no-cache-dir "mypy>=1.11,<2.5" "setuptools>=69" \
    && /opt/venv/bin/python -m scripts.compile \
    && /opt/venv/bin/pip uninstall -y mypy mypy_extensions pathspec librt ast-serialize
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --force-reinstall .

FROM python:3.11-slim-bookworm AS runtime
LABEL org.opencontainers.image.title="goodput-gateway" \
      org.opencontainers.image.description="OpenAI-compatible, SLO-aware gateway for vLLM workers"
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid gateway --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin gateway
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8000
WORKDIR /app
USER 10001:10001
EXPOSE 8000
# Liveness only (/healthz); readiness (/readyz, a worker is reachable) is for orchestrators.
# The slim image has no curl: Python's urllib does the probe.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('GATEWAY_PORT', '8000') + '/healthz', timeout=2)"]
ENTRYPOINT ["goodput-gateway"]
