#!/usr/bin/env python3
"""Run the chart's pod for real with podman (issue 26, part 2): a MANUAL check, not in CI.

Builds the images of docker/ with podman on a locally made stand-in base, builds
llama.cpp's `llama-server` on the CPU into a test image, converts the embedded model to
GGUF, renders the chart with `helm template` (llamacpp preset, the GGUF mounted as the
model volume) in sidecar and entrypoint mode, plays it with `podman kube play`, and checks:
SERVING on /readyz, a chat answer through the server port, uid 1000, a read-only root
filesystem, the agent as PID 1 of its container, the chart's environment and arguments in
the processes, and the drain on stop (exit code and time within the grace period).

Then the apt Prometheus scrapes the pod with the ServiceMonitor's relabelling, loads the
rendered PrometheusRule, every dashboard panel's query is run against it (panels with
data: N of M, the empty ones listed; GPU and vLLM-only panels stay empty with llama.cpp on
a CPU) and no alert may fire (pending ones are listed).

What podman 4.3 (Debian bookworm) needs, all handled below:
  vfs storage, cgroupfs, file events logger, runc (crun fails here), default ulimits
  nofile/nproc (the default file limit is refused), catatonit for the pod's infra
  container; a ConfigMap mounted with subPath becomes a directory, so that one mount is
  rewritten to mount the ConfigMap's directory instead (same file path in the container).

Usage (root, Debian 12; about 10 min of downloads and 40-60 min of llama.cpp build on
2 shared cores the first time, cached under --work):
    .venv/bin/python tools/e2e_pod.py [--work /tmp/warmup-agent-e2e-pod] [--modes sidecar,entrypoint]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
HELM = ROOT / ".tools" / "helm"
LLAMA_SDIST = "llama-cpp-python==0.3.36"   # MIT; vendors llama.cpp (TESTING.md)
BASE_TAG = "docker.io/library/python:3.12-slim-bookworm"   # docker/agent.Dockerfile's FROM
SERVER_PORT, AGENT_PORT = 18080, 19400
APT = ["podman", "runc", "catatonit", "debootstrap", "containernetworking-plugins"]
STEPS: list[tuple[str, float]] = []


class StepFailed(Exception):
    pass


def version() -> str:
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise SystemExit("no version in pyproject.toml")


def sh(cmd: list[str], *, env: dict | None = None, cwd: Path | None = None, log: Path | None = None,
       check: bool = True, timeout: float = 3600) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if log:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}\n")
    if check and out.returncode != 0:
        raise StepFailed(f"`{' '.join(cmd)}` exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
    return out


class Podman:
    def __init__(self, work: Path):
        conf = work / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        (conf / "storage.conf").write_text(
            f'[storage]\ndriver = "vfs"\nrunroot = "{work}/run"\ngraphroot = "{work}/storage"\n')
        (conf / "containers.conf").write_text(
            '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n'
            '[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\nruntime = "runc"\n')
        self.env = dict(os.environ, CONTAINERS_STORAGE_CONF=str(conf / "storage.conf"),
                        CONTAINERS_CONF=str(conf / "containers.conf"))
        self.log = work / "podman.log"

    def __call__(self, *args: str, check: bool = True, timeout: float = 3600) -> subprocess.CompletedProcess:
        return sh(["podman", *args], env=self.env, log=self.log, check=check, timeout=timeout)

    def has_image(self, ref: str) -> bool:
        return self("image", "exists", ref, check=False).returncode == 0


def step(name: str):
    def wrap(fn):
        def run(*a, **k):
            print(f"--- {name}", flush=True)
            t0 = time.monotonic()
            try:
                result = fn(*a, **k)
            except StepFailed as e:
                raise StepFailed(f"step '{name}' failed: {e}") from None
            except Exception as e:  # noqa: BLE001 - any error names its step
                raise StepFailed(f"step '{name}' failed: {type(e).__name__}: {e}") from e
            took = time.monotonic() - t0
            STEPS.append((name, took))
            print(f"    {name}: {took:.1f} s", flush=True)
            return result
        return run
    return wrap


@step("apt: podman, runc, catatonit, debootstrap")
def install_tools() -> None:
    missing = [p for p in APT if sh(["dpkg-query", "-W", "-f=${Status}", p], check=False).stdout != "install ok installed"]
    if missing:
        sh(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


@step("stand-in base image (debootstrap, podman import)")
def base_image(work: Path, podman: Podman) -> None:
    if podman.has_image(BASE_TAG):
        return
    rootfs = work / "rootfs"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        sh(["debootstrap", "--variant=minbase", "--include=python3,python3-pip,python-is-python3,ca-certificates",
            "bookworm", str(rootfs), "http://deb.debian.org/debian"], log=work / "debootstrap.log")
    for f in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        f.unlink()   # pip installs system-wide, as in python:*-slim
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    out = subprocess.run(["podman", "import", "--change", "ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                          "-", BASE_TAG], stdin=tar.stdout, env=podman.env, capture_output=True, text=True)
    tar.wait()
    if out.returncode != 0:
        raise StepFailed(out.stderr)


@step("llama-server built on the CPU")
def llama_server(work: Path) -> Path:
    src = work / "llama"
    binary = src / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    dl = work / "sdist"
    dl.mkdir(exist_ok=True)
    if not list(dl.glob("llama_cpp_python-*.tar.gz")):
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dl), LLAMA_SDIST])
    if not (src / "CMakeLists.txt").exists():
        with tarfile.open(next(dl.glob("llama_cpp_python-*.tar.gz"))) as t:
            t.extractall(work / "sdist-x")
        vendored = next((work / "sdist-x").glob("llama_cpp_python-*/vendor/llama.cpp"))
        shutil.rmtree(src, ignore_errors=True)
        shutil.move(str(vendored), src)
    sh(["cmake", "-S", ".", "-B", "build", "-G", "Ninja", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
        "-DBUILD_SHARED_LIBS=OFF"], cwd=src, log=work / "llama-build.log")
    sh(["cmake", "--build", "build", "--target", "llama-server", "-j", str(os.cpu_count() or 2)], cwd=src,
       log=work / "llama-build.log", timeout=7200)
    return binary


CONVERT = '''
import runpy, sys
import conversion.base as base
def _no_file(self, *a, **k):
    raise FileNotFoundError("no sentencepiece model")
# A locally trained BPE tokenizer: name its pre-tokenizer, take the BPE (gpt2) vocabulary path.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
base.TextModel._set_vocab_sentencepiece = _no_file
base.TextModel._set_vocab_llama_hf = _no_file
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
'''


@step("embedded model converted to GGUF")
def gguf_model(work: Path) -> Path:
    out = work / "model" / "model.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    hf = sh([sys.executable, "-c", "import sys; from warmup_agent.embedded_model import ensure_embedded_model as e; "
             "print(e(sys.argv[1]))", str(work / "data")], env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout.split()[-1]
    (work / "convert.py").write_text(CONVERT)
    sh([sys.executable, str(work / "convert.py"), hf, "--outtype", "f32", "--outfile", str(out)], cwd=work / "llama",
       env=dict(os.environ, PYTHONPATH="gguf-py:."), log=work / "convert.log")
    return out


@step("images built with podman (docker/agent.Dockerfile, then llama-server added)")
def images(work: Path, podman: Podman, binary: Path, ver: str) -> str:
    ca = "/etc/ssl/certs/ca-certificates.crt"   # a TLS-intercepting proxy's CA, where there is one
    if not podman.has_image(f"localhost/warmup-agent:{ver}"):
        podman("build", "--pull=never", "--network", "host", "--isolation", "chroot", "-v", f"{ca}:{ca}:ro",
               "-f", str(ROOT / "docker" / "agent.Dockerfile"), "--build-arg", f"VERSION={ver}",
               "-t", f"warmup-agent:{ver}", str(ROOT))
    ref = f"localhost/warmup-agent-llamacpp:{ver}"
    ctx = work / "llamacpp-image"
    ctx.mkdir(exist_ok=True)
    shutil.copy(binary, ctx / "llama-server")
    gomp = sh(["sh", "-c", "ldd " + str(binary) + " | awk '/libgomp/ {print $3}'"]).stdout.strip()
    if gomp:
        shutil.copy(gomp, ctx / "libgomp.so.1")
    else:
        (ctx / "libgomp.so.1").write_bytes(b"")
    (ctx / "Containerfile").write_text(
        f"FROM localhost/warmup-agent:{ver}\n"
        "USER 0:0\n"
        "COPY llama-server /usr/local/bin/llama-server\n"
        "COPY libgomp.so.1 /usr/local/lib/libgomp.so.1\n"
        "RUN ldconfig && llama-server --version\n"
        "USER 1000:1000\n")
    podman("build", "--pull=never", "--network", "host", "--isolation", "chroot", "-t", ref, str(ctx))
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
    playfile = work / f"play-{mode}.yaml"
    playfile.write_text(yaml.safe_dump_all(play))
    podman("kube", "down", str(playfile), check=False)
    try:
        step(f"{mode}: podman kube play")(podman)("kube", "play", str(playfile))
        infra = podman("pod", "inspect", pod, "--format", "{{.InfraContainerID}}").stdout.strip()
        ip = podman("inspect", infra, "--format",
                    "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}").stdout.split()[0:1]
        ip = ip[0] if ip else ""
        if not ip:
            raise StepFailed(f"pod {pod} has no IP address (podman's default bridge network)")
        result["pod_ip"] = ip
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
                time.sleep(2)
            raise StepFailed(f"no SERVING within 600 s; last /readyz: {last[:500]}")
        startupz = serving()
        result["state"] = startupz.get("state")
        assert result["state"] == "SERVING", startupz

        @step(f"{mode}: chat through the server port")
        def chat() -> dict:
            code, body = http(f"http://{ip}:{SERVER_PORT}/v1/chat/completions",
                              {"model": "embedded", "max_tokens": 8,
                               "messages": [{"role": "user", "content": "hello there"}]}, timeout=60)
            if code != 200:
                raise StepFailed(f"chat answered {code}: {body[:500]}")
            answer = json.loads(body)
            assert answer["choices"][0]["message"] is not None and answer["usage"]["completion_tokens"] > 0, answer
            return answer
        result["chat_completion_tokens"] = chat()["usage"]["completion_tokens"]

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
    ap.add_argument("--work", default="/tmp/warmup-agent-e2e-pod", type=Path)
    ap.add_argument("--modes", default="sidecar,entrypoint")
    args = ap.parse_args()
    if not HELM.is_file():
        print(f"{HELM} is missing: run tools/fetch_helm.py", file=sys.stderr)
        return 2
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        install_tools()
        podman = Podman(work)
        base_image(work, podman)
        binary = llama_server(work)
        gguf_model(work)
        image = images(work, podman, binary, version())
        for mode in args.modes.split(","):
            results.append(run_mode(mode, image, work, podman))
    except StepFailed as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        return 1
    finally:
        print("\nstep timings:")
        for name, took in STEPS:
            print(f"  {took:7.1f} s  {name}")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
