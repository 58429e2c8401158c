# syntax=docker/dockerfile:1.7
# The dispatcher / operator CLI image. Default command: `llmbatch dispatcher run`; any other
# `llmbatch` command works too (`docker run --rm IMAGE jobs list`, `... dlq list`, `... api`).
#
# Build from the repository root (the build context is the whole checkout, trimmed by .dockerignore):
#   docker build -f deploy/docker/dispatcher.Dockerfile -t llmbatch-dispatcher:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- build: a virtual environment with llmbatch and its locked dependencies ----------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/llmbatch
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/lock/base.txt requirements/lock/base.txt
COPY llmbatch/ llmbatch/
COPY schemas/ schemas/
COPY adapters/ adapters/
COPY producer/ producer/
COPY ray_job/ ray_job/
COPY dispatcher/ dispatcher/
COPY api/ api/
# exactly the locked packages (uv.lock, exported with hashes by `make lock`); the lock pins ray, so the
# dispatcher's Jobs API client matches the cluster's Ray
RUN /opt/llmbatch/bin/pip install --no-cache-dir --require-hashes --no-deps -r requirements/lock/base.txt \
    && /opt/llmbatch/bin/pip install --no-cache-dir --no-deps ./schemas ./adapters ./producer ./ray_job \
       ./dispatcher ./api . \
    && /opt/llmbatch/bin/llmbatch --help > /dev/null

# --- runtime: the venv only, as an unprivileged user -----------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="llmbatch-dispatcher" \
      org.opencontainers.image.description="llmbatch dispatcher and operator CLI" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 llmbatch \
    && useradd --system --uid 10001 --gid llmbatch --create-home --home-dir /home/llmbatch \
       --shell /usr/sbin/nologin llmbatch
COPY --from=build /opt/llmbatch /opt/llmbatch
ENV PATH=/opt/llmbatch/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LLMBATCH_DISPATCHER__METRICS_HOST=0.0.0.0 \
    LLMBATCH_DISPATCHER__METRICS_PORT=9464
WORKDIR /home/llmbatch
USER 10001:10001
# /livez /readyz /metrics
EXPOSE 9464
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9464/livez', timeout=4).status != 200)"]
# SIGTERM drains: commit offsets, leave the group, release the tracker lease (dispatcher/service.py)
STOPSIGNAL SIGTERM
ENTRYPOINT ["llmbatch"]
CMD ["dispatcher", "run"]
