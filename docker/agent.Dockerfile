# warmup-agent alone: the image of the chart's `sidecar` mode, where vLLM runs unchanged
# from its own image and this container warms and gates it over localhost (engine openai).
# No torch and no transformers: the in-process engines (the `torch` extra) are not in it,
# and warmup prompts are sized with `tokenizers`.
#
#   docker/build.sh            # both images, tagged with the version in pyproject.toml
#   docker build -f docker/agent.Dockerfile --build-arg VERSION=0.1.0 -t warmup-agent:0.1.0 .
FROM python:3.12-slim-bookworm

# The project version (pyproject.toml); docker/build.sh passes it, a test checks the default.
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="warmup-agent" \
      org.opencontainers.image.description="Cold-start warmup agent for OpenAI-compatible LLM servers (sidecar mode: agent only, no torch)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/warmup-agent/warmup-agent" \
      org.opencontainers.image.licenses="Apache-2.0"

# A read-only root filesystem works: nothing is written outside /tmp and the cache
# directory, which the chart mounts as emptyDir volumes (and sets the same variables).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/var/cache/warmup-agent \
    HF_HOME=/var/cache/warmup-agent/huggingface

# uid/gid 1000: what the chart's podSecurityContext runs as.
RUN groupadd --gid 1000 warmup \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin warmup \
 && mkdir -p /var/cache/warmup-agent \
 && chown 1000:1000 /var/cache/warmup-agent

COPY pyproject.toml README.md /src/
COPY warmup_agent /src/warmup_agent
COPY exporter /src/exporter
# The agent with its core dependencies and the redis extra (shared kernel cache tier).
RUN python -m pip install --no-cache-dir "/src[redis]" \
 && rm -rf /src
COPY docker/agent-config.yaml /etc/warmup-agent/sidecar.yaml

USER 1000:1000
WORKDIR /tmp
# /metrics, /healthz, /readyz, /startupz
EXPOSE 9400
ENTRYPOINT ["warmup-agent"]
# Warm and gate the OpenAI-compatible server on localhost:8000 (docker/agent-config.yaml).
CMD ["run", "--config", "/etc/warmup-agent/sidecar.yaml"]
