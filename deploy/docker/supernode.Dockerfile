# The SuperNode image (one per edge device): Flower's SuperNode with corrflow installed, so the corrflow
# ClientApp runs in this environment (SuperNodes never install dependencies at run time by default).
# Multi-arch base (linux/amd64, linux/arm64). No keys or certificates are baked in: they are mounted at run time.
# Build from the repository root:  docker build -f deploy/docker/supernode.Dockerfile -t corrflow-supernode .
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_HOME=/var/lib/corrflow/flwr

WORKDIR /opt/corrflow
COPY pyproject.toml README.md ./
COPY corrflow ./corrflow
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /var/lib/corrflow corrflow \
    && mkdir -p /var/lib/corrflow && chown corrflow:corrflow /var/lib/corrflow

# Persistent: Flower's home (installed app bundles) and any local data the device trains on.
VOLUME ["/var/lib/corrflow"]
USER corrflow
ENTRYPOINT ["flower-supernode"]
CMD ["--help"]
