# vLLM and warmup-agent in one image: the image of the chart's default `entrypoint` mode,
# where the agent starts and supervises `vllm serve` as its child (all four stages).
# Built on vLLM's own OpenAI-server image, pinned: the agent is added with --no-deps, so
# the image's CUDA torch, transformers and vLLM stay exactly as vLLM ships them, and then
# the agent's own small dependencies (pip keeps any the image already satisfies).
# The agent is PID 1 here: it forks and stays behind as the init that forwards signals
# and reaps vLLM's orphaned processes (warmup_agent/server/reaper.py), so no tini is needed.
#
#   docker/build.sh            # both images, tagged with the version in pyproject.toml
#   docker build -f docker/vllm.Dockerfile --build-arg VERSION=0.1.0 -t warmup-agent-vllm:0.1.0 .
FROM vllm/vllm-openai:v0.32.0

# The project version (pyproject.toml); docker/build.sh passes it, a test checks the default.
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="warmup-agent-vllm" \
      org.opencontainers.image.description="vLLM OpenAI server supervised and warmed by warmup-agent (entrypoint mode)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.base.name="docker.io/vllm/vllm-openai:v0.32.0" \
      org.opencontainers.image.source="https://github.com/warmup-agent/warmup-agent" \
      org.opencontainers.image.licenses="Apache-2.0"

# Read-only root filesystem: every cache vLLM, PyTorch, Triton and Hugging Face write
# goes under /tmp or the cache directory, both emptyDir volumes in the chart (which sets
# the same variables). No usage statistics are sent from a pod.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/var/cache/warmup-agent \
    HF_HOME=/var/cache/warmup-agent/huggingface \
    VLLM_CACHE_ROOT=/var/cache/warmup-agent/vllm \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/warmup-agent/torchinductor \
    TRITON_CACHE_DIR=/var/cache/warmup-agent/triton \
    VLLM_NO_USAGE_STATS=1

# uid/gid 1000 (the chart's podSecurityContext); some bases already have a user with it.
RUN (getent group 1000 >/dev/null || groupadd --gid 1000 warmup) \
 && (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin warmup) \
 && mkdir -p /var/cache/warmup-agent \
 && chown 1000:1000 /var/cache/warmup-agent

COPY pyproject.toml README.md /src/
COPY warmup_agent /src/warmup_agent
COPY exporter /src/exporter
# --no-deps: nothing of vLLM's environment is replaced.  The second line is the agent's
# core dependencies and its redis extra, as in pyproject.toml (a test keeps them equal).
RUN python3 -m pip install --no-cache-dir --no-deps /src \
 && python3 -m pip install --no-cache-dir "prometheus-client>=0.20" "nvidia-ml-py>=12.535" "psutil>=5.9" "tokenizers>=0.19" "jinja2>=3.1.6" "pyyaml>=6.0" "bcrypt>=4.0" "aiohttp>=3.9" "uvloop>=0.19; sys_platform != 'win32'" "redis>=5.0" \
 && rm -rf /src

USER 1000:1000
WORKDIR /tmp
# 8000: vLLM's OpenAI API; 9400: the agent's /metrics, /healthz, /readyz, /startupz.
EXPOSE 8000 9400
# `docker run IMAGE MODEL [vllm serve args]` as with vLLM's own image; the chart sets
# the whole command (warmup-agent run --config ... -- vllm serve ...).
ENTRYPOINT ["warmup-agent", "run", "--engine", "openai", "--listen", "0.0.0.0:9400", "--", "vllm", "serve"]
CMD ["/models/model", "--host", "0.0.0.0", "--port", "8000"]
