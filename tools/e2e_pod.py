#!/usr/bin/env python3
"""Run the chart's pod for real with podman (issue 26, part 2); CI runs it after the tests.

Builds the images of docker/ with podman on a locally made stand-in base, puts llama.cpp's
`llama-server` (the static CPU build of tools/build_llama_server.py) into a test image,
converts the embedded model to GGUF, renders the chart with `helm template` (llamacpp
preset, the GGUF mounted as the model volume, proxy.enabled) in sidecar and entrypoint mode,
plays it with `podman kube play`, and checks: the Service's http port targets the agent's
routing proxy and no Service port the server's (rendered), SERVING on /readyz, users'
requests through the Service's port (the pod port it targets: podman has no Service), the
server's own port closed to the pod's address in entrypoint mode (it listens on 127.0.0.1),
the users' real first request exported on /metrics (warmup_first_user_request_tax_ratio
and its whole-answer twin, once readiness.first_user_steady_requests answers followed it),
uid 1000, a read-only root filesystem, the agent as PID 1 of its container, the chart's
environment and arguments in the processes, and the drain on stop (exit code and time
within the grace period).  A user who arrives at the pod's start (sent as soon as the
proxy accepts a connection) is reported, not judged: what the proxy answered and when,
against when /readyz first said SERVING.

Then the apt Prometheus scrapes the pod with the ServiceMonitor's relabelling, loads the
rendered PrometheusRule, every dashboard panel's query is run against it (panels with
data: N of M, the empty ones listed; GPU and vLLM-only panels stay empty with llama.cpp on
a CPU) and no alert may fire (pending ones are listed).

Each step prints its time, and a failure names its step (and prints the pod's container
logs once a pod runs); the exit status is 1.  Nothing is built twice:
  - llama-server: tools/build_llama_server.py's cache (<data_dir>/llama.cpp/0.3.36-cpu;
    `make test-setup` builds it, else this run does, about 30 min on 2 cores).  It links
    llama.cpp and ggml statically; ldd shows what it still needs beyond glibc (libgomp,
    libstdc++, libgcc_s), and only what the image lacks (libgomp) is copied in beside it.
  - the stand-in base: Debian bookworm minbase with python3 and pip (mmdebstrap, no
    documentation), kept as a tarball under <data_dir>/e2e-pod and imported into podman,
    tagged as docker/agent.Dockerfile's FROM.  About 1-2 min to make, once.
  - the images carry a label e2e.inputs, a hash of what they were built from (Dockerfile,
    the files it copies, the base, the binary); one is rebuilt only when that changes.
    The agent image's pip installs from the index (about 25 s in all: pip downloading here
    and copying in would not pay, and this Python, 3.11.7, is not the stand-in's 3.11.2,
    whose markers ask for other packages).
  - the GGUF: tools/gguf_convert.py, redone only when the model changed.
Measured on 2 shared cores (Debian 12): 168-216 s with an empty --work and no cached base
(podman's apt packages 12-14 s when missing, the base 56-110 s), about 65 s with everything
cached; the pods take about 30 s per mode, 20 s of that waiting for Prometheus's rate
windows.  On the llamacpp preset with a CPU and the proxy, 43 (sidecar) and 39 (entrypoint)
of 52 panels have data: GPU, vLLM-only and failure panels stay empty, and in entrypoint mode
the kernel cache too (the agent skips the cache for a supervised server that compiles
nothing).  The user sent at the start (0-0.2 s after the play) was held by the proxy and
answered 200 0.9-1.0 s after the play; /readyz first read SERVING 1.0-1.3 s after it
(polled every 0.25 s), and the first-request figures then read 0.99-1.05 (time to first
token) and 1.00-1.06 (whole answer).

What podman 4.3 (Debian bookworm) needs, all handled below:
  overlay storage where the kernel has it (else vfs: each container a full copy, about 5 s),
  cgroupfs, file events logger, runc (crun fails here), default ulimits nofile/nproc (the
  default file limit is refused), catatonit for the pod's infra container; a ConfigMap
  mounted with subPath becomes a directory, so that one mount is rewritten to mount the
  ConfigMap's directory instead (same file path in the container).  Not checked: the
  probes (podman runs healthchecks through systemd timers, which are not there).

Usage (root, Debian 12; installs its apt packages; `make e2e-pod`):
    .venv/bin/python tools/e2e_pod.py [--work /tmp/warmup-agent-e2e-pod] [--data-dir DIR] [--modes sidecar,entrypoint]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
HELM = ROOT / ".tools" / "helm"
sys.path.insert(0, str(ROOT))
from tools.build_llama_server import default_data_dir  # noqa: E402 (after the sys.path line)

BASE_TAG = "docker.io/library/python:3.12-slim-bookworm"   # docker/agent.Dockerfile's FROM
# The stand-in base: pip for the Dockerfile's install, CA certificates for its index.
BASE_PACKAGES = ["python3", "python3-pip", "python-is-python3", "ca-certificates"]
GLIBC = ("linux-vdso", "libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "ld-linux")
SERVER_PORT, AGENT_PORT, PROXY_PORT = 18080, 19400, 18001
USER_REQUESTS = 8   # through the Service's port after SERVING: the first user's request and more than the 5 steady ones
# podman and what it needs on Debian 12; mmdebstrap for the base; the Prometheus that scrapes
# the pod; cmake, ninja and g++ only if llama-server is not built yet (make test-setup builds it).
APT = ["podman", "runc", "catatonit", "containernetworking-plugins", "mmdebstrap", "prometheus", "file",
       "cmake", "ninja-build", "g++"]
STEPS: list[tuple[str, float]] = []


class StepFailed(Exception):
    pass


def version() -> str:
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise SystemExit("no version in pyproject.toml")


def sh(cmd: list[str], *, env: dict | None = None, cwd: Path | None = None, log: Path | None = None,
       check: bool = True, timeout: float = 3600, attempts: int = 1) -> subprocess.CompletedProcess:
    """Run CMD; ATTEMPTS > 1 retries a failure (after 10 s) for the steps that download."""
    for attempt in range(1, attempts + 1):
        out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if log:
            with open(log, "a") as f:
                f.write(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}\n")
        if out.returncode == 0 or attempt == attempts:
            break
        print(f"    `{' '.join(cmd[:3])} ...` exited {out.returncode} (attempt {attempt} of {attempts}): "
              f"{(out.stdout + out.stderr).strip()[-400:]}\n    retrying in 10 s", flush=True)
        time.sleep(10)
    if check and out.returncode != 0:
        raise StepFailed(f"`{' '.join(cmd)}` exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
    return out


def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (the stand-in base comes from it)."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        if not f.is_file() or f.suffix not in (".list", ".sources", ""):
            continue
        for line in f.read_text(errors="replace").splitlines():
            words = line.split()
            if f.suffix == ".sources" and words[:1] == ["URIs:"]:
                uris = words[1:]
            elif words[:1] == ["deb"]:
                uris = [w for w in words[1:] if not w.startswith("[")][:1]
            else:
                continue
            for uri in uris:
                if uri.rstrip("/").endswith("/debian"):
                    return uri
    return "http://deb.debian.org/debian"


class Podman:
    """podman with its own storage under WORK/podman: overlay where the kernel has it (a
    container starts in well under a second), else vfs (every container and image layer a
    full copy of the image: about 5 s each here)."""

    def __init__(self, work: Path):
        conf = work / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        driver = "overlay" if "overlay" in Path("/proc/filesystems").read_text() else "vfs"
        store = work / "podman"
        (conf / "storage.conf").write_text(
            f'[storage]\ndriver = "{driver}"\nrunroot = "{store}/run"\ngraphroot = "{store}/storage-{driver}"\n')
        (conf / "containers.conf").write_text(
            '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n'
            '[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\nruntime = "runc"\n')
        self.env = dict(os.environ, CONTAINERS_STORAGE_CONF=str(conf / "storage.conf"),
                        CONTAINERS_CONF=str(conf / "containers.conf"))
        self.log = work / "podman.log"

    def __call__(self, *args: str, check: bool = True, timeout: float = 3600, attempts: int = 1) -> subprocess.CompletedProcess:
        return sh(["podman", *args], env=self.env, log=self.log, check=check, timeout=timeout, attempts=attempts)

    def label(self, ref: str, name: str) -> str | None:
        out = self("image", "inspect", ref, "--format", "{{index .Labels \"" + name + "\"}}", check=False)
        return out.stdout.strip() if out.returncode == 0 else None


def step(name: str):
    def wrap(fn):
        def run(*a, **k):
            print(f"--- {name}", flush=True)
            t0 = time.monotonic()
            try:
                result = fn(*a, **k)
            except StepFailed as e:
                STEPS.append((f"{name}: FAILED", time.monotonic() - t0))
                raise StepFailed(f"step '{name}' failed: {e}") from None
            except Exception as e:  # noqa: BLE001 - any error names its step
                STEPS.append((f"{name}: FAILED", time.monotonic() - t0))
                raise StepFailed(f"step '{name}' failed: {type(e).__name__}: {e}") from e
            took = time.monotonic() - t0
            STEPS.append((name, took))
            print(f"    {name}: {took:.1f} s", flush=True)
            return result
        return run
    return wrap


@step("apt: podman, runc, catatonit, mmdebstrap, prometheus")
def install_tools() -> None:
    missing = [p for p in APT if sh(["dpkg-query", "-W", "-f=${Status}", p], check=False).stdout != "install ok installed"]
    if missing:
        print(f"    installing {' '.join(missing)}", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        sh(["apt-get", "update", "-q"], env=env)
        sh(["apt-get", "install", "-y", "-q", "--no-install-recommends", "--no-upgrade", *missing], env=env)


def digest(*parts: str | bytes | Path) -> str:
    """A short hash of strings, bytes, files and directory trees (the inputs of a cached output)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            files = sorted(f for f in part.rglob("*") if f.is_file() and "__pycache__" not in f.parts) \
                if part.is_dir() else [part]
            for f in files:
                h.update(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f).encode())
                h.update(f.read_bytes())
        else:
            h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


@step("stand-in base image (mmdebstrap, cached tarball, podman import)")
def base_image(cache: Path, podman: Podman) -> str:
    """Debian bookworm with its python3 and pip, tagged as docker/agent.Dockerfile's FROM.
    The root filesystem is made once with mmdebstrap (minbase, no documentation) and kept
    as a tarball under the data dir; the image is imported again only when missing."""
    cmd = ["mmdebstrap", "--variant=minbase", "--format=tar", "--include=" + ",".join(BASE_PACKAGES), "--dpkgopt=force-unsafe-io",
           *[f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "info", "locale")],
           "--customize-hook=rm -f \"$1\"/usr/lib/python3*/EXTERNALLY-MANAGED",   # pip installs system-wide, as in python:*-slim
           "bookworm"]
    key = digest(*cmd)
    if up_to_date(podman, BASE_TAG, key):
        return key
    tar = cache / f"standin-bookworm-{key}.tar"
    if not tar.is_file():
        for old in cache.glob("standin-bookworm-*.tar"):
            old.unlink()
        part = tar.with_name(tar.name + ".part")
        part.unlink(missing_ok=True)
        sh([*cmd, str(part), apt_mirror()], log=cache / "mmdebstrap.log", timeout=1800, attempts=2)
        part.rename(tar)
    podman("import", "--change", "ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "--change", f"LABEL e2e.inputs={key}", str(tar), BASE_TAG)
    return key


@step("llama-server: tools/build_llama_server.py's static CPU build (cached)")
def llama_server(data_dir: Path) -> tuple[Path, list[Path]]:
    """The binary `make test-setup` builds (llama.cpp and ggml linked in statically); built
    here only when missing.  Returns it and the shared libraries it still needs beyond
    glibc (ldd), which the image gets beside it."""
    out = sh([sys.executable, str(ROOT / "tools" / "build_llama_server.py"), "--cuda", "off",
              "--data-dir", str(data_dir)], timeout=7200)
    binary = Path(out.stdout.strip().splitlines()[-1])
    kind = sh(["file", "-b", str(binary)], check=False).stdout.strip() if shutil.which("file") else ""
    libs = []
    for line in sh(["ldd", str(binary)], check=False).stdout.splitlines():
        parts = line.split()
        if "=>" in parts and "not" in parts:
            raise StepFailed(f"{binary}: shared library not found: {line.strip()}")
        if "=>" in parts and not parts[0].startswith(GLIBC):
            libs.append(Path(parts[2]))
    kind = ", ".join(w.strip() for w in kind.split(",")[:4])
    print(f"    {binary}: {kind or 'file(1) missing'}; llama.cpp and ggml linked in, beyond glibc it needs: "
          f"{' '.join(lib.name for lib in libs) or 'nothing'}", flush=True)
    return binary, libs


@step("embedded model converted to GGUF (tools/gguf_convert.py)")
def gguf_model(work: Path, data_dir: Path) -> Path:
    out = work / "model" / "model.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    sh([sys.executable, str(ROOT / "tools" / "gguf_convert.py"), "--outtype", "f32", "--outfile", str(out),
        "--data-dir", str(data_dir)], env=dict(os.environ, PYTHONPATH=str(ROOT)), log=work / "convert.log",
       timeout=900)
    return out


def up_to_date(podman: Podman, ref: str, key: str) -> bool:
    """REF exists and was built from the same inputs (its label e2e.inputs is KEY)."""
    if podman.label(ref, "e2e.inputs") == key:
        print(f"    {ref}: up to date (inputs {key})", flush=True)
        return True
    return False


def build(podman: Podman, ref: str, key: str, *args: str, attempts: int = 1) -> None:
    podman("build", "--pull=never", "--network", "host", "--isolation", "chroot", "--label", f"e2e.inputs={key}",
           "-t", ref, *args, attempts=attempts)


@step("agent image: docker/agent.Dockerfile, unmodified, on the stand-in base")
def agent_image(podman: Podman, base_key: str, ver: str) -> str:
    ref = f"localhost/warmup-agent:{ver}"
    inputs = [ROOT / p for p in ("docker/agent.Dockerfile", "docker/agent-config.yaml", "pyproject.toml",
                                 "README.md", "warmup_agent", "exporter", ".dockerignore")]
    key = digest(base_key, ver, *inputs)
    if up_to_date(podman, ref, key):
        return key
    mounts = []
    ca = "/etc/ssl/certs/ca-certificates.crt"   # a TLS-intercepting proxy's CA, where there is one
    if Path(ca).is_file():
        mounts += ["-v", f"{ca}:{ca}:ro"]
    build(podman, ref, key, *mounts, "-f", str(ROOT / "docker" / "agent.Dockerfile"),
          "--build-arg", f"VERSION={ver}", str(ROOT), attempts=2)   # its pip downloads
    return key


@step("llama.cpp image: the agent image plus llama-server")
def llama_image(work: Path, podman: Podman, agent_key: str, binary: Path, libs: list[Path], ver: str) -> str:
    ref = f"localhost/warmup-agent-llamacpp:{ver}"
    ctx = work / "llamacpp-image"
    shutil.rmtree(ctx, ignore_errors=True)
    (ctx / "lib").mkdir(parents=True)
    shutil.copy(binary, ctx / "llama-server")
    # the image's own libraries stay; only what it lacks is copied (libgomp, say)
    have = podman("run", "--rm", "--network", "none", "--entrypoint", "ldconfig", f"localhost/warmup-agent:{ver}",
                  "-p").stdout
    for lib in libs:
        if f"{lib.name} (" not in have:
            shutil.copy(lib, ctx / "lib" / lib.name)
    copied = sorted(p.name for p in (ctx / "lib").iterdir())
    print(f"    libraries copied into the image: {copied or 'none'}", flush=True)
    (ctx / "Containerfile").write_text(
        f"FROM localhost/warmup-agent:{ver}\n"
        "USER 0:0\n"
        "COPY llama-server /usr/local/bin/llama-server\n"
        "COPY lib/ /usr/local/lib/\n"
        "RUN ldconfig && ! ldd /usr/local/bin/llama-server | grep 'not found' && llama-server --version\n"
        "USER 1000:1000\n")
    key = digest(agent_key, ctx / "Containerfile", ctx / "llama-server", *sorted((ctx / "lib").iterdir()))
    if not up_to_date(podman, ref, key):
        build(podman, ref, key, str(ctx))
        podman("image", "prune", "-f")   # the images these replaced
    return ref


def render(mode: str, image: str, work: Path) -> tuple[list[dict], dict, list[dict]]:
    repo, tag = image.rsplit(":", 1)
    values = {
        "mode": mode,
        "server": {"preset": "llamacpp", "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
                   "model": "/models/model.gguf", "servedModelName": "embedded", "port": SERVER_PORT,
                   "extraArgs": ["-c", "2048", "-t", "1", "--metrics"], "resources": {},
                   "loadTimeoutSeconds": 300, "shmSizeLimit": "64Mi",
                   "env": [{"name": "E2E_SERVER_MARK", "value": f"server-{mode}"}]},
        "agent": {"image": {"repository": repo, "tag": tag, "pullPolicy": "Never"}, "port": AGENT_PORT,
                  "resources": {}, "env": [{"name": "E2E_AGENT_MARK", "value": f"agent-{mode}"}]},
        "proxy": {"enabled": True, "port": PROXY_PORT},
        "model": {"volume": {"hostPath": {"path": str(work / "model"), "type": "Directory"}}},
        "cache": {"sizeLimit": "1Gi"}, "tmpSizeLimit": "256Mi",
        "podDisruptionBudget": {"enabled": False}, "serviceAccount": {"create": False, "name": "default"},
        "terminationGracePeriodSeconds": 30,
    }
    vf = work / f"values-{mode}.yaml"
    vf.write_text(yaml.safe_dump(values))
    home = work / "helm-home"
    out = sh([str(HELM), "template", "e2e", str(ROOT / "helm" / "warmup-agent"), "-f", str(vf),
              "--set", "serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true",
              "--set", "dashboards.enabled=true", "--api-versions", "monitoring.coreos.com/v1"],
             env=dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / "c"), XDG_CONFIG_HOME=str(home / "f"),
                      XDG_DATA_HOME=str(home / "d")))
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (work / f"rendered-{mode}.yaml").write_text(out.stdout)
    play = [d for d in docs if d["kind"] == "Deployment"
            or (d["kind"] == "ConfigMap" and "grafana_dashboard" not in d["metadata"].get("labels", {}))]
    dep = next(d for d in play if d["kind"] == "Deployment")
    for c in dep["spec"]["template"]["spec"]["containers"]:
        for m in c.get("volumeMounts", []):
            if m.get("subPath"):   # podman 4.3 mounts a subPath ConfigMap as a directory
                assert m["mountPath"].endswith("/" + m["subPath"]), m
                m["mountPath"] = m["mountPath"][: -len(m["subPath"]) - 1]
                del m["subPath"]
    return play, dep, docs


class Prometheus:
    """The apt Prometheus scraping the pod with the ServiceMonitor's relabelling (and the
    labels prometheus-operator adds: job = the Service, namespace, pod, container) and the
    rendered PrometheusRule's rules as they are, evaluated every 2 s. No alert may fire;
    pending ones (condition true, `for` not yet passed) are reported. With every `for` at
    0 s, WarmupAgentCostRatioHigh fired on the idle healthy pod (warmup_cost_ratio is
    near 1 before any user traffic): its 15 minutes are what keeps it quiet."""

    RATE = "15s"   # Grafana's $__rate_interval at 4 x a 2 s scrape, rounded up

    def __init__(self, d: Path, docs: list[dict], ip: str, pod: str):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        sm = next(x for x in docs if x["kind"] == "ServiceMonitor")
        svc = next(x for x in docs if x["kind"] == "Service" and x["metadata"]["name"] == sm["metadata"]["name"])
        (ep,) = sm["spec"]["endpoints"]
        names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}   # the CRD's to Prometheus'
        relabel = [{names.get(k, k): v for k, v in r.items()} for r in ep.get("relabelings", [])]
        operator = [{"source_labels": [f"__meta_kubernetes_{m}"], "target_label": t}
                    for m, t in (("namespace", "namespace"), ("pod_name", "pod"), ("pod_container_name", "container"),
                                 ("service_name", "service"), ("service_name", "job"))]
        meta = {"__meta_kubernetes_namespace": sm["metadata"]["namespace"], "__meta_kubernetes_pod_name": pod,
                "__meta_kubernetes_pod_container_name": "warmup-agent", "__meta_kubernetes_service_name": svc["metadata"]["name"],
                "__meta_kubernetes_pod_node_name": os.uname().nodename}
        rules = next(x for x in docs if x["kind"] == "PrometheusRule")["spec"]
        self.alert_names = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
        (d / "rules.yaml").write_text(yaml.safe_dump(rules))
        self.dashboards = {k: json.loads(v) for x in docs if x["kind"] == "ConfigMap"
                           and x["metadata"].get("labels", {}).get("grafana_dashboard") == "1" for k, v in x["data"].items()}
        cfg = {"global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
               "rule_files": [str(d / "rules.yaml")],
               "scrape_configs": [{"job_name": "servicemonitor", "metrics_path": ep.get("path", "/metrics"),
                                   "scrape_timeout": "2s",
                                   "static_configs": [{"targets": [f"{ip}:{AGENT_PORT}"], "labels": meta}],
                                   "relabel_configs": operator + relabel}]}
        (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        sh(["promtool", "check", "config", str(d / "prometheus.yml")])
        port = int(sh([sys.executable, "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                       "print(s.getsockname()[1])"]).stdout)
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(["prometheus", f"--config.file={d / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={d / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                     stdout=subprocess.DEVNULL, stderr=open(d / "prometheus.log", "w"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if http(self.url + "/-/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise StepFailed("Prometheus did not become ready")

    def query(self, q: str) -> list:
        code, body = http(self.url + "/api/v1/query?query=" + urllib.parse.quote(q))
        data = json.loads(body)
        if data.get("status") != "success":
            raise StepFailed(f"query {q!r}: {body[:300]}")
        return data["data"]["result"]

    def check(self) -> dict:
        from dashboards.exprs import panel_expressions, substitute

        up: list = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not up:
            up = self.query('up{job="e2e-warmup-agent"} == 1')
            time.sleep(1)
        if not up:
            raise StepFailed("the pod's /metrics was not scraped (up == 1)")
        labels = up[0]["metric"]
        missing = [k for k in ("node", "pod", "model", "namespace", "job") if not labels.get(k)]
        if missing:
            raise StepFailed(f"scraped series lack the labels {missing}: {labels}")
        time.sleep(20)   # enough scrapes for every rate window, and several rule evaluations
        empty, total = [], 0
        for fname, d in self.dashboards.items():
            for _pid, title, ref, expr in panel_expressions(d):
                total += 1
                if not self.query(substitute(expr, self.RATE)):
                    empty.append(f"{fname} {title!r} {ref}")
        firing = [a["metric"]["alertname"] for a in self.query('ALERTS{alertstate="firing"}')]
        pending = [a["metric"]["alertname"] for a in self.query('ALERTS{alertstate="pending"}')]
        out = {"labels": {k: labels[k] for k in ("node", "pod", "model", "namespace", "job")},
               "panels_with_data": f"{total - len(empty)} of {total}", "empty_panels": empty,
               "alert_rules": len(self.alert_names), "firing": firing, "pending": pending}
        print(f"    panels with data: {total - len(empty)} of {total}; alerts firing: {len(firing)}, "
              f"pending: {pending or 'none'}")
        for e in empty:
            print(f"    empty: {e}")
        if firing:
            raise StepFailed(f"alerts firing on the healthy pod: {firing}")
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def http(url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def service_http_port(docs: list[dict], dep: dict) -> tuple[str, int]:
    """(container, port) of the pod port the Service's http port targets, read from the
    rendered objects as a Service resolves a named targetPort; it must be the agent's
    routing proxy, and no Service port may target the server's own port."""
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == dep["metadata"]["name"])
    containers = dep["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: (c["name"], p["containerPort"]) for c in containers for p in c.get("ports", [])}
    targets: dict[str, tuple[str, int]] = {}
    for sp in svc["spec"]["ports"]:
        tp = sp["targetPort"]
        targets[sp["name"]] = named[tp] if isinstance(tp, str) else ("", int(tp))
    agent = next(c["name"] for c in containers if c["command"][0] == "warmup-agent")
    if targets["http"] != (agent, PROXY_PORT):
        raise StepFailed(f"the Service's http port targets {targets['http']}, not the agent's proxy ({agent}, {PROXY_PORT})")
    if any(port == SERVER_PORT for _c, port in targets.values()):
        raise StepFailed(f"a Service port targets the server's own port {SERVER_PORT}: {targets}")
    return targets["http"]


def stream_chat(url: str, prompt: str, max_tokens: int = 8, timeout: float = 60) -> dict:
    """One streamed chat as a user's client sends it: status, time to the first event and to
    the end (client side), the content chunks and their text."""
    body = json.dumps({"model": "embedded", "max_tokens": max_tokens, "stream": True,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first, chunks, text = None, 0, []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                if first is None:
                    first = time.monotonic() - t0
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                for choice in json.loads(data).get("choices", []):
                    content = (choice.get("delta") or {}).get("content")
                    if isinstance(content, str):
                        chunks += 1
                        text.append(content)
            status = r.status
    except urllib.error.HTTPError as e:
        return {"status": e.code, "seconds": round(time.monotonic() - t0, 3), "body": e.read().decode()[:300],
                "retry_after": e.headers.get("Retry-After")}
    return {"status": status, "ttft": round(first or 0.0, 4), "seconds": round(time.monotonic() - t0, 4),
            "chunks": chunks, "text": "".join(text)}


def metric_values(url: str, names: tuple[str, ...]) -> dict:
    """Samples of NAMES on the agent's /metrics: {name or name{labels}: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(http(url + "/metrics")[1]):
        for s in fam.samples:
            if s.name in names:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
                out[key] = s.value
    return out


class EarlyUser:
    """A user who arrives as the pod starts: one streamed chat sent to the Service's port as
    soon as the proxy accepts a connection (the agent is then still warming).  What it met
    is reported beside when /readyz first said SERVING; it is not judged here (the hold is
    the agent's: proxy.hold_seconds)."""

    def __init__(self, url: str):
        import threading

        self.url = url
        self.result: dict = {}
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.t0 = time.monotonic()
        self.thread.start()

    def run(self) -> None:
        import socket

        where = urllib.parse.urlsplit(self.url)
        host, port = where.hostname, where.port or 80
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        sent = time.monotonic() - self.t0
        try:
            r = stream_chat(self.url, "a user at the start of the pod says hello", timeout=300)
        except OSError as e:
            r = {"status": None, "error": str(e)}
        self.result = {"sent_after_play_seconds": round(sent, 2), **{k: v for k, v in r.items() if k != "text"}}

    def report(self, serving_after: float) -> dict:
        self.thread.join(timeout=330)
        out = dict(self.result, serving_after_play_seconds=round(serving_after, 2))
        print(f"    a user at the start: sent {out.get('sent_after_play_seconds')} s after play, answered "
              f"{out.get('status')} after {out.get('seconds')} s; /readyz SERVING {out['serving_after_play_seconds']} s "
              "after play", flush=True)
        return out


def proc_cmdline(podman: Podman, ctr: str, pid: str = "1") -> list[str]:
    return podman("exec", ctr, "cat", f"/proc/{pid}/cmdline").stdout.split("\0")[:-1]


def proc_environ(podman: Podman, ctr: str, pid: str = "1") -> dict:
    pairs = podman("exec", ctr, "cat", f"/proc/{pid}/environ").stdout.split("\0")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def run_mode(mode: str, image: str, work: Path, podman: Podman) -> dict:
    result: dict = {"mode": mode}
    play, dep, docs = step(f"{mode}: render the chart")(render)(mode, image, work)
    spec = dep["spec"]["template"]["spec"]
    pod = f"{dep['metadata']['name']}-pod-0"
    agent_ctr = f"{pod}-{'warmup-agent' if mode == 'sidecar' else 'server'}"
    server_ctr = f"{pod}-server"
    grace = spec["terminationGracePeriodSeconds"]
    _proxy_ctr, service_port = step(f"{mode}: the Service's http port targets the agent's proxy")(service_http_port)(docs, dep)
    playfile = work / f"play-{mode}.yaml"
    playfile.write_text(yaml.safe_dump_all(play))
    podman("kube", "down", str(playfile), check=False)
    try:
        step(f"{mode}: podman kube play")(podman)("kube", "play", str(playfile))
        played = time.monotonic()
        infra = podman("pod", "inspect", pod, "--format", "{{.InfraContainerID}}").stdout.strip()
        ip = podman("inspect", infra, "--format",
                    "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}").stdout.split()[0:1]
        ip = ip[0] if ip else ""
        if not ip:
            raise StepFailed(f"pod {pod} has no IP address (podman's default bridge network)")
        result["pod_ip"] = ip
        users = f"http://{ip}:{service_port}"   # the Service's http port, as it resolves to the pod
        early = EarlyUser(users)
        prom = step(f"{mode}: Prometheus scraping the pod as the ServiceMonitor says")(Prometheus)(
            work / f"prometheus-{mode}", docs, ip, pod)

        @step(f"{mode}: /readyz SERVING")
        def serving() -> dict:
            deadline = time.monotonic() + 600
            last = ""
            while time.monotonic() < deadline:
                try:
                    code, body = http(f"http://{ip}:{AGENT_PORT}/readyz", timeout=3)
                    last = body
                    if code == 200:
                        return json.loads(http(f"http://{ip}:{AGENT_PORT}/startupz")[1])
                except OSError as e:
                    last = str(e)
                time.sleep(0.25)   # often enough to say when SERVING came, for the user sent at the start
            raise StepFailed(f"no SERVING within 600 s; last /readyz: {last[:500]}")
        startupz = serving()
        serving_after = time.monotonic() - played
        result["state"] = startupz.get("state")
        assert result["state"] == "SERVING", startupz
        result["user_at_start"] = early.report(serving_after)

        @step(f"{mode}: users' requests through the Service's port (the proxy); the server's port")
        def users_requests() -> dict:
            # fresh prompts of about the same length, so that no prefix cache answers one
            answers = [stream_chat(users, f"user {i} asks about the {w} in the garden today")
                       for i, w in enumerate(("roses", "bees", "fence", "pond", "path", "trees", "shed", "birds")[:USER_REQUESTS])]
            bad = [a for a in answers if a["status"] != 200 or a["chunks"] < 1]
            if bad:
                raise StepFailed(f"users' requests through the proxy: {bad}")
            out: dict = {"requests": len(answers), "client_ttft_seconds": [a["ttft"] for a in answers],
                         "client_first_over_median_ttft": round(answers[0]["ttft"] / sorted(a["ttft"] for a in answers[1:])[
                             (len(answers) - 1) // 2], 2)}
            # the server's own port: entrypoint mode binds it to 127.0.0.1, so the pod's address refuses it
            try:
                code, _ = http(f"http://{ip}:{SERVER_PORT}/health", timeout=5)
                out["server_port_from_outside"] = code
            except OSError as e:
                out["server_port_from_outside"] = f"refused ({type(e).__name__})"
            if mode == "entrypoint" and isinstance(out["server_port_from_outside"], int):
                raise StepFailed(f"the server's port {SERVER_PORT} answers on the pod's address ({out['server_port_from_outside']}): "
                                 "with the proxy it should listen on 127.0.0.1 only")
            return out
        result["users"] = users_requests()

        @step(f"{mode}: the pod exports the users' real first request")
        def first_user() -> dict:
            names = ("warmup_first_user_request_tax_ratio", "warmup_first_user_request_total_tax_ratio",
                     "warmup_proxy_requests_total")
            deadline = time.monotonic() + 30
            got: dict = {}
            while time.monotonic() < deadline:   # the proxy's reports reach the agent every 10 ms
                got = metric_values(f"http://{ip}:{AGENT_PORT}", names)
                if got.get("warmup_first_user_request_tax_ratio", 0) > 0 and got.get("warmup_first_user_request_total_tax_ratio", 0) > 0:
                    break
                time.sleep(0.5)
            main_ok = sum(v for k, v in got.items() if k.startswith("warmup_proxy_requests_total{code=200,route=main"))
            print(f"    first user request tax {got.get('warmup_first_user_request_tax_ratio')}, whole answer "
                  f"{got.get('warmup_first_user_request_total_tax_ratio')}; user requests answered by the server "
                  f"through the proxy: {main_ok:.0f}", flush=True)
            if not got.get("warmup_first_user_request_tax_ratio", 0) > 0 or not got.get("warmup_first_user_request_total_tax_ratio", 0) > 0:
                raise StepFailed(f"the users' real first request is not exported after {USER_REQUESTS} requests through the proxy: {got}")
            if main_ok < USER_REQUESTS:
                raise StepFailed(f"warmup_proxy_requests_total counts {main_ok:.0f} users' answers of the server, "
                                 f"{USER_REQUESTS} were sent: {got}")
            return got
        result["first_user_request"] = first_user()

        @step(f"{mode}: uid 1000, read-only root, PID 1, environment and arguments")
        def security() -> dict:
            checks: dict = {}
            for ctr in {agent_ctr, server_ctr}:
                uid = podman("exec", ctr, "sh", "-c", "id -u; id -g").stdout.split()
                assert uid == ["1000", "1000"], (ctr, uid)
                assert podman("inspect", ctr, "--format", "{{.HostConfig.ReadonlyRootfs}}").stdout.strip() == "true", ctr
                touch = podman("exec", ctr, "touch", "/e2e-probe", check=False)
                assert touch.returncode != 0 and "Read-only file system" in touch.stderr, (ctr, touch.stderr)
                checks[ctr] = {"uid": 1000, "read_only_root": True}
            # the agent is PID 1 of its container, with the chart's command line
            rendered_agent = next(c for c in spec["containers"] if c["command"][0] == "warmup-agent")
            cmd1 = proc_cmdline(podman, agent_ctr)
            assert "warmup-agent" in " ".join(cmd1[:2]), cmd1
            # /proc shows the interpreter: python /usr/local/bin/warmup-agent ARGS
            assert cmd1[-len(rendered_agent["command"]) + 1:] == rendered_agent["command"][1:], (cmd1, rendered_agent)
            checks["agent_pid1"] = True
            env1 = proc_environ(podman, agent_ctr)
            for e in rendered_agent["env"]:
                assert env1.get(e["name"]) == e["value"], (e, env1.get(e["name"]))
            # the server process: PID 1 of its container (sidecar), or the agent's child (entrypoint)
            if mode == "sidecar":
                rendered = next(c for c in spec["containers"] if c["name"] == "server")
                want, spid = rendered["command"] + rendered.get("args", []), "1"
                want_env = rendered["env"]
            else:
                want = rendered_agent["command"][rendered_agent["command"].index("--") + 1:]
                want_env = rendered_agent["env"]
                pids = podman("exec", agent_ctr, "sh", "-c",
                              "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline | grep -q '^llama-server' "
                              "&& basename $p; done; true").stdout.split()
                assert len(pids) == 1, pids
                spid = pids[0]
            got = proc_cmdline(podman, server_ctr if mode == "sidecar" else agent_ctr, spid)
            assert got == want, (got, want)
            senv = proc_environ(podman, server_ctr if mode == "sidecar" else agent_ctr, spid)
            for e in want_env:
                assert senv.get(e["name"]) == e["value"], (e, senv.get(e["name"]))
            checks["server_cmdline"] = got
            return checks
        result["checks"] = security()
        result["monitoring"] = step(f"{mode}: dashboard panels and alerts on the live pod")(prom.check)()

        @step(f"{mode}: drain on stop (SIGTERM, grace {grace} s)")
        def drain() -> dict:
            t0 = time.monotonic()
            podman("pod", "stop", "-t", str(grace), pod, timeout=grace + 60)
            took = time.monotonic() - t0
            code = int(podman("inspect", agent_ctr, "--format", "{{.State.ExitCode}}").stdout.strip())
            left = podman("ps", "--filter", f"pod={pod}", "--filter", "status=running", "-q").stdout.split()
            stray = sh(["pgrep", "-f", f"llama-server .*--port {SERVER_PORT}"], check=False).stdout.split()
            if code != 0 or took > grace or left or stray:
                raise StepFailed(f"agent exit {code} after {took:.1f} s (grace {grace}); running: {left}; "
                                 f"llama-server left on the host: {stray}")
            return {"exit_code": code, "seconds": round(took, 1)}
        result["drain"] = drain()
    except (StepFailed, AssertionError) as e:
        for ctr in (agent_ctr, server_ctr):
            logs = podman("logs", "--tail", "60", ctr, check=False)
            print(f"=== logs of {ctr}\n{logs.stdout}{logs.stderr}", file=sys.stderr)
        raise StepFailed(f"{mode}: {e}") from None
    finally:
        podman("kube", "down", str(playfile), check=False)
        if "prom" in locals():
            prom.stop()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/warmup-agent-e2e-pod", type=Path,
                    help="podman's storage, the rendered files, logs (default %(default)s)")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="where llama-server, the embedded model and this run's caches (stand-in base tarball, "
                         "wheels) live: as tools/build_llama_server.py (default ~/.cache/warmup-agent)")
    ap.add_argument("--modes", default="sidecar,entrypoint")
    args = ap.parse_args()
    if not HELM.is_file():
        print(f"{HELM} is missing: run tools/fetch_helm.py", file=sys.stderr)
        return 2
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data_dir = (args.data_dir or default_data_dir()).resolve()
    cache = data_dir / "e2e-pod"
    cache.mkdir(parents=True, exist_ok=True)
    ver = version()
    results = []
    t0 = time.monotonic()
    try:
        install_tools()
        podman = Podman(work)
        base_key = base_image(cache, podman)
        binary, libs = llama_server(data_dir)
        gguf_model(work, data_dir)
        agent_key = agent_image(podman, base_key, ver)
        image = llama_image(work, podman, agent_key, binary, libs, ver)
        for mode in args.modes.split(","):
            results.append(run_mode(mode, image, work, podman))
    except StepFailed as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        return 1
    finally:
        print("\nstep timings:")
        for name, took in STEPS:
            print(f"  {took:7.1f} s  {name}")
        print(f"  {time.monotonic() - t0:7.1f} s  in all")
    (work / "result.json").write_text(json.dumps({"steps": STEPS, "modes": results}, indent=1))
    print(json.dumps(results, indent=1))
    print(f"e2e-pod: passed in {', '.join(r['mode'] for r in results)} mode ({work / 'result.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
