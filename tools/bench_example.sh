#!/usr/bin/env bash
# `make bench-example`: the README's "measure your own server" example on this machine's
# CPU, with nothing to download: llama-server (CPU build, built once and cached) serving
# the embedded model as a GGUF.  STARTS (default 2) starts per condition, OUT the output;
# arguments go to the bench (--seed S, --no-progress).
set -eu
PY=${PY:-.venv/bin/python}
model=$($PY -c 'from warmup_agent.model.embedded import ensure_embedded_model as e; print(e(".cache/test-data"))' | tail -n 1)
server=$($PY tools/build_llama_server.py --cuda off | tail -n 1)
gguf=$($PY tools/gguf_convert.py "$model" --outtype bf16 | tail -n 1)
# The prompts fit llama-server's -c 2048, shared by its 4 slots: the bench reads it from the command line
exec "$PY" -m warmup_agent bench --starts "${STARTS:-2}" --agent-model "$model" --out "${OUT:-warmup-bench}" "$@" \
    -- "$server" -m "$gguf" -c 2048 --host 127.0.0.1 --port '{port}'
