# The SuperLink image: Flower's SuperLink with corrflow installed, so the corrflow ServerApp runs in this
# environment (runtime dependency installation is disabled in the command line of compose.yaml / the unit).
# Multi-arch base (linux/amd64, linux/arm64). No keys or certificates are baked in: they are mounted at run time.
# Build from the repository root:  docker build -f deploy/docker/superlink.Dockerfile -t corrflow-superlink .
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

# Persistent: the SuperLink database and the ServerApp's state directory, report and journal.
VOLUME ["/var/lib/corrflow"]
USER corrflow
EXPOSE 8000
ENTRYPOINT ["flower-superlink"]
CMD ["--help"]
