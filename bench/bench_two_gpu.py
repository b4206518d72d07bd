"""Two GPUs, one agent each (issue 15): topology, CPU and memory isolation, per-GPU
labels, drain and the first-request tax, on a real two-GPU host.

One command on the host (about 3-4 minutes; writes the JSON even when a step fails):
    python bench/bench_two_gpu.py --out-dir bench/results --copy-to "$OUT"

What it does, each step recorded (a failed step is recorded and the rest goes on):
  1. host: `nvidia-smi topo -m`, `nvidia-smi -q`, `nvidia-smi nvlink -s`, sysfs NUMA
     facts and the raw NVML answers (the format tests/test_multi_gpu.py replays);
     the agent's topology report (hardware.topology, the code the agent runs, and
     the report each agent writes in its --record) compared with nvidia-smi and sysfs.
  2. the Qwen2-1.5B-shaped random bf16 model (bench_gpu_cold_start.make_model).
  3. --pairs starts of the pair: `python -m warmup_agent run` (the CLI) twice at
     once, CUDA_VISIBLE_DEVICES=0 and =1 on two ports, swapped on every other
     start (=1 on the first port, =0 on the second).  Per start: both SERVING
     (seconds), CPU sets of every thread (/proc) vs NVML affinity, NVML per-process
     memory on both GPUs, every sample of /metrics with a gpu or uuid label vs the
     GPU the agent really uses (where NVML sees its memory), gpu_fragmentation_rate,
     the first-request tax, then SIGTERM to both at once (exit code, seconds).
  multi_gpu_first_request_tax_p99 = p99 over agents x starts of (time to first token
  of the first request the engine serves after SERVING / median of the next 20).
  With the torch engine the model runs inside the agent and has no request
  endpoint of its own, so those requests are the agent's readiness-watch probes
  (one every 0.1 s after SERVING, each a different prompt of the probe length),
  taken from the agent's --record; no outside process can send one.

--dry-run: the same code on this machine without a GPU: host facts replayed from
a recorded (or constructed) answer file, two CPU agents with the embedded model,
one start of the pair.  It checks the parsing, the comparisons, the process
handling and the JSON, not the GPU figures.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from types import SimpleNamespace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import provenance, write_result  # noqa: E402

# Every child: no NVLink multicast (the device machines require it; see the device README).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WATCH_INTERVAL = 0.1      # seconds between post-SERVING probes
NEXT = 20                 # requests after the first that make the steady median
TAX_TARGET = 1.10
CONSTRUCTED = os.path.join(ROOT, "bench", "results", "two_gpu_answers_constructed.json")
T0 = time.time()


# --- small parsers ----------------------------------------------------------------------------
def cpu_list(text: str | None) -> list[int]:
    """'0-15,32-47' -> [0..15, 32..47]; '' or None -> []."""
    out: list[int] = []
    for part in (text or "").replace(" ", "").split(","):
        if not part or part.upper() == "N/A":
            continue
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def parse_topo(text: str) -> dict:
    """`nvidia-smi topo -m` -> {gpu index: {"links": {peer index: "NV18"|"SYS"|...},
    "cpu_affinity": [...], "numa_affinity": int|None}}.  Columns are tab-separated."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)      # it underlines the header with ANSI codes
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if "GPU0" in ln and ln.split("\t")[0].strip() == ""), None)
    if header is None:
        return {}
    cols = [c.strip() for c in header.split("\t")]
    out = {}
    for ln in lines:
        m = re.match(r"^GPU(\d+)\s", ln)
        if not m:
            continue
        cells = [c.strip() for c in ln.split("\t")]
        row = dict(zip(cols[1:], cells[1:], strict=False)) if cols[0] == "" else dict(zip(cols, cells, strict=False))
        i = int(m.group(1))
        numa = row.get("NUMA Affinity", "")
        out[i] = {"links": {int(c[3:]): v for c, v in row.items() if re.fullmatch(r"GPU\d+", c) and int(c[3:]) != i},
                  "cpu_affinity": cpu_list(row.get("CPU Affinity")),
                  "numa_affinity": int(numa) if numa.strip().lstrip("-").isdigit() else None}
    return out


def nvlink_count(cell: str) -> int:
    """'NV18' -> 18; anything else (SYS, PIX, NODE, X) -> 0 NVLink links."""
    m = re.fullmatch(r"NV(\d+)", cell or "")
    return int(m.group(1)) if m else 0


def parse_query(text: str) -> list[dict]:
    """`nvidia-smi -q` -> per GPU: bus id, UUID, minor number, product, memory total (MiB)."""
    gpus: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    section = ""
    for ln in text.splitlines():
        m = re.match(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f])\s*$", ln)
        if m:
            cur = {"bus_id": _bus(m.group(1))}
            gpus.append(cur)
            continue
        if cur is None or ":" not in ln:
            if ln.strip() and ":" not in ln:
                section = ln.strip()
            continue
        key, _, val = (s.strip() for s in ln.partition(":"))
        if key == "GPU UUID":
            cur["uuid"] = val
        elif key == "Minor Number":
            cur["minor_number"] = int(val) if val.isdigit() else None
        elif key == "Product Name":
            cur["product"] = val
        elif key == "Total" and section == "FB Memory Usage":
            cur["memory_total_mib"] = int(val.split()[0]) if val.split()[0].isdigit() else None
    return gpus


def parse_nvlink_status(text: str) -> dict:
    """`nvidia-smi nvlink -s` -> {gpu index: {"links": n listed, "active": n with a speed}}."""
    out: dict[int, dict[str, int]] = {}
    cur: dict[str, int] | None = None
    for ln in text.splitlines():
        m = re.match(r"^GPU (\d+):", ln)
        if m:
            cur = out.setdefault(int(m.group(1)), {"links": 0, "active": 0})
            continue
        m = re.match(r"^\s+Link \d+:\s*(.*)$", ln)
        if m and cur is not None:
            cur["links"] += 1
            cur["active"] += 1 if re.search(r"\d+(\.\d+)?\s*GB/s", m.group(1)) else 0
    return out


def _bus(v) -> str:
    from warmup_agent.host.hardware import _bus as norm
    return norm(v)


# --- NVML: record the answers, replay them ----------------------------------------------------
def record_nvml(nv, cpu_count: int) -> list[dict]:
    """The NVML answers the agent reads, per GPU, in the format ReplayNVML replays."""
    from warmup_agent.host.hardware import _cpus_from_mask, _str, _try
    words = (cpu_count + 63) // 64
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        links = None
        states = []
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                states.append(nv.nvmlDeviceGetNvLinkState(h, link))
            except Exception:  # noqa: BLE001
                break
        if states:
            links = [(_str(_try(lambda: nv.nvmlDeviceGetNvLinkRemotePciInfo(h, k).busId) or "") if s == 1 else None)
                     for k, s in enumerate(states)]
        # what the far end of each active link is (GPU 0, IBM NPU 1, switch 2), and whether
        # NVML calls the pair NVLink-P2P capable: to tell a peer GPU from a switch when the
        # remote PCI id is not one this host enumerates (a VM)
        types = [_try(lambda: int(nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, k))) if s == 1 else None
                 for k, s in enumerate(states)] if states else None
        p2p = {}
        for j in range(nv.nvmlDeviceGetCount()):
            if j != i:
                p2p[str(j)] = _try(lambda: int(nv.nvmlDeviceGetP2PStatus(h, nv.nvmlDeviceGetHandleByIndex(j),
                                                                         nv.NVML_P2P_CAPS_INDEX_NVLINK)))
        out.append({"uuid": _str(nv.nvmlDeviceGetUUID(h)), "name": _str(nv.nvmlDeviceGetName(h)),
                    "nvml_bus_id": _str(nv.nvmlDeviceGetPciInfo(h).busId),
                    "memory_total_bytes": int(mem.total), "memory_free_bytes": int(mem.free),
                    "memory_used_bytes": int(mem.used),
                    "numa_node": _try(lambda: int(nv.nvmlDeviceGetNumaNodeId(h))),
                    "local_cpus": _try(lambda: _cpus_from_mask(list(nv.nvmlDeviceGetCpuAffinity(h, words)))) or [],
                    "pcie_generation": _try(lambda: int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h))),
                    "pcie_width": _try(lambda: int(nv.nvmlDeviceGetCurrPcieLinkWidth(h))),
                    "links": links, "link_remote_types": types, "p2p_nvlink_status": p2p})
    return out


class ReplayNVML:
    """NVML answering from record_nvml()'s output (None links: NVLink unsupported;
    None in the list: an inactive link)."""
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, gpus: list[dict]):
        self.gpus = gpus

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, i): return self.gpus[i]
    def nvmlDeviceGetUUID(self, h): return h["uuid"]
    def nvmlDeviceGetName(self, h): return h["name"]
    def nvmlDeviceGetPciInfo(self, h): return SimpleNamespace(busId=h["nvml_bus_id"])
    def nvmlDeviceGetNumaNodeId(self, h):
        if h["numa_node"] is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return h["numa_node"]
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h): return h["pcie_generation"]
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): return h["pcie_width"]
    def nvmlDeviceGetUtilizationRates(self, h): return SimpleNamespace(gpu=0, memory=0)
    def nvmlDeviceGetComputeRunningProcesses(self, h): return []

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["memory_total_bytes"], free=h["memory_free_bytes"],
                               used=h.get("memory_used_bytes", h["memory_total_bytes"] - h["memory_free_bytes"]))

    def nvmlDeviceGetCpuAffinity(self, h, words):
        mask = [0] * words
        for c in h["local_cpus"]:
            mask[c // 64] |= 1 << (c % 64)
        return mask

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h["links"] is None or link >= len(h["links"]):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED" if h["links"] is None else "NVML_ERROR_INVALID_ARGUMENT")
        return 1 if h["links"][link] is not None else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=h["links"][link])

    NVML_P2P_CAPS_INDEX_NVLINK = 3

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        types = h.get("link_remote_types")
        if not types or types[link] is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return types[link]

    def nvmlDeviceGetP2PStatus(self, h, other, index):
        v = h.get("p2p_nvlink_status", {}).get(str(self.gpus.index(other)))
        if v is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return v


# --- the host step ----------------------------------------------------------------------------
def run_cmd(cmd: list[str], timeout: float = 60) -> dict:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return {"cmd": " ".join(cmd), "rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr[-2000:]}
    except Exception as e:  # noqa: BLE001 - no nvidia-smi: recorded, not fatal
        return {"cmd": " ".join(cmd), "rc": None, "stdout": "", "stderr": f"{type(e).__name__}: {e}"}


def sysfs_facts(bus_ids: list[str], root: str = "/sys/bus/pci/devices") -> dict:
    """NUMA node and local CPUs of each PCI device, from the kernel (independent of NVML)."""
    out: dict[str, dict[str, Any]] = {}
    for bus in bus_ids:
        d = os.path.join(root, bus)
        try:
            numa = int(open(os.path.join(d, "numa_node")).read().strip())
            out[bus] = {"numa_node": None if numa < 0 else numa,
                        "local_cpus": cpu_list(open(os.path.join(d, "local_cpulist")).read().strip())}
        except OSError as e:
            out[bus] = {"error": f"{type(e).__name__}: {e.strerror}"}
    return out


def compare_topology(agent_topo: dict, smi_topo: dict, smi_q: list[dict], nvlink_s: dict, sysfs: dict) -> list[dict]:
    """One row per fact: the agent's value, the other source's, and whether they agree."""
    rows = []

    def row(gpu, what, agent, other, source, match=None):
        rows.append({"gpu": gpu, "what": what, "agent": agent, source: other,
                     "match": (agent == other) if match is None else match})
    gpus = {g["index"]: g for g in agent_topo.get("gpus", [])}
    nvlink = {int(k): {int(p): n for p, n in v.items()} for k, v in agent_topo.get("nvlink", {}).items()}
    by_bus = {q["bus_id"]: q for q in smi_q}
    row(None, "gpu_count", len(gpus), len(smi_topo) if smi_topo else len(smi_q), "nvidia_smi")
    for i, g in sorted(gpus.items()):
        t = smi_topo.get(i, {})
        for peer, n in sorted(nvlink.get(i, {}).items()):
            cell = t.get("links", {}).get(peer)
            row(i, f"nvlink_links_to_gpu{peer}", n, cell, "nvidia_smi_topo", match=n == nvlink_count(cell or ""))
        if t:
            row(i, "local_cpus", g["local_cpus"], t["cpu_affinity"], "nvidia_smi_topo")
            row(i, "numa_node", g["numa_node"], t["numa_affinity"], "nvidia_smi_topo")
        q = by_bus.get(g["pci_bus_id"], {})
        row(i, "uuid_at_bus_id", g["uuid"], q.get("uuid"), "nvidia_smi_q")
        if i in nvlink_s:
            row(i, "nvlinks_active", g["nvlinks_active"], nvlink_s[i]["active"], "nvidia_smi_nvlink_s")
        s = sysfs.get(g["pci_bus_id"], {})
        if "local_cpus" in s:
            row(i, "local_cpus", g["local_cpus"], s["local_cpus"], "sysfs")
            row(i, "numa_node", g["numa_node"], s["numa_node"], "sysfs")
    return rows


def host_step(result: dict, replay: dict | None) -> None:
    from warmup_agent.host import hardware
    cpus = os.cpu_count() or 1
    if replay is None:
        smi = {k: run_cmd(c) for k, c in (("topo_m", ["nvidia-smi", "topo", "-m"]), ("q", ["nvidia-smi", "-q"]),
                                          ("nvlink_s", ["nvidia-smi", "nvlink", "-s"]))}
        import pynvml
        pynvml.nvmlInit()
        answers = record_nvml(pynvml, cpus)
    else:
        smi = replay["nvidia_smi"]
        answers = replay["nvml_answers"]
    gpus, err = hardware.read_gpus(ReplayNVML(answers), cpu_count=cpus)
    topo = json.loads(json.dumps(hardware.topology(gpus)))      # str keys, as in an agent's --record
    sysfs = replay.get("sysfs", {}) if replay else sysfs_facts([g.pci_bus_id for g in gpus])
    result["host"] = {"nvidia_smi": smi, "nvml_answers": answers, "sysfs": sysfs, "cpu_count": cpus,
                      "agent_topology": topo, "nvml_error": err,
                      "cpu_plan": {str(k): v for k, v in hardware.assign_cpus(gpus, sorted(os.sched_getaffinity(0))).items()}}
    topo_m, q, nvlink_s = (parse_topo(smi["topo_m"]["stdout"]), parse_query(smi["q"]["stdout"]),
                           parse_nvlink_status(smi["nvlink_s"]["stdout"]))
    result["host"]["nvidia_smi_parsed"] = {"topo_m": topo_m, "q": q, "nvlink_s": nvlink_s}
    rows = compare_topology(topo, topo_m, q, nvlink_s, sysfs)
    result["topology_comparison"] = {"rows": rows, "all_match": all(r["match"] for r in rows),
                                     "mismatches": [r for r in rows if not r["match"]]}


# --- agents -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - not up yet
        return None, f"{type(e).__name__}: {e}"


class AgentProc:
    """One `python -m warmup_agent run` with its own CUDA_VISIBLE_DEVICES, port, data dir and record."""

    def __init__(self, name: str, cvd: str, model: str | None, work: str, extra_env: dict, data_dir: str | None = None):
        self.name, self.cvd, self.port = name, cvd, free_port()
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir, exist_ok=True)
        self.record_path = os.path.join(self.dir, "record.json")
        self.log_path = os.path.join(self.dir, "agent.log")
        env = dict(os.environ, **CHILD_ENV, **extra_env, CUDA_VISIBLE_DEVICES=cvd, PYTHONPATH=ROOT,
                   WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS=str(WATCH_INTERVAL))
        cmd = [sys.executable, "-m", "warmup_agent", "run", "--listen", f"127.0.0.1:{self.port}",
               "--no-progress", "--record", self.record_path, "--data-dir", data_dir or self.dir]
        if model:
            cmd += ["--model", model]
        self.cmd = cmd
        self.spawned = time.time()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)
        self.ready_seconds: float | None = None
        self.state: str | None = None
        self.probes_at_serving: int | None = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def poll_ready(self) -> bool:
        """True once SERVING with its --record written; False while warming; raises once it failed or exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before SERVING")
        code, body = http_get(self.url("/startupz"))
        status = {}
        if code is not None:
            try:
                status = json.loads(body)
                self.state = status.get("state")
            except ValueError:
                pass
        if self.state == "FAILED":
            raise RuntimeError(f"{self.name} FAILED: {status.get('failure_reason')}: {status.get('failure_message')}")
        if http_get(self.url("/readyz"))[0] != 200:
            return False
        if self.ready_seconds is None:
            self.ready_seconds = time.time() - self.spawned
        rec = self.record()
        if rec and rec.get("final_state") == "SERVING":
            # (a /startupz that timed out under load may have left an older state above)
            self.probes_at_serving, self.state = rec["probe_count"], "SERVING"
            return True
        return False

    def record(self) -> dict | None:
        try:
            with open(self.record_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def probes(self) -> int:
        code, body = http_get(self.url("/startupz"))
        try:
            return json.loads(body)["probes"] if code == 200 else -1
        except (ValueError, KeyError):
            return -1

    def log_tail(self, n: int = 3000) -> str:
        try:
            return open(self.log_path, errors="replace").read()[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def cpus_of(pid: int) -> dict:
    """Cpus_allowed_list of the main thread and of every thread of the process."""
    def read(path):
        for ln in open(path):
            if ln.startswith("Cpus_allowed_list:"):
                return cpu_list(ln.split(":", 1)[1].strip())
        return []
    main = read(f"/proc/{pid}/status")
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            threads[tid] = read(f"/proc/{pid}/task/{tid}/status")
        except OSError:
            pass
    return {"main": main, "threads": len(threads),
            "threads_outside_main_set": sum(1 for c in threads.values() if set(c) != set(main)),
            "union": sorted(set().union(*threads.values())) if threads else main}


def nvml_processes(nv) -> dict:
    """{NVML index: {pid: used bytes (None: NVML cannot say)}} of the compute processes on every GPU."""
    out: dict[int, dict] = {}     # {pid: bytes}, or {"error": why} where NVML would not say
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
            out[i] = {int(p.pid): None if p.usedGpuMemory is None else int(p.usedGpuMemory) for p in procs}
        except Exception as e:  # noqa: BLE001
            out[i] = {"error": f"{type(e).__name__}: {e}"}
    return out


def parse_metrics(text: str) -> list[dict]:
    from prometheus_client.parser import text_string_to_metric_families
    return [{"name": s.name, "labels": dict(s.labels), "value": s.value}
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def check_labels(samples: list[dict], gpu_index: int | None, uuid: str | None) -> dict:
    """Every sample with a gpu or uuid label must name this agent's GPU: gpu = its
    physical NVML index, uuid = its UUID.  Returns the per-metric label sets and the
    samples that break the convention."""
    per_metric: dict[str, set] = {}
    wrong = []
    for s in samples:
        lab = s["labels"]
        if "gpu" not in lab and "uuid" not in lab:
            continue
        per_metric.setdefault(s["name"], set()).add((lab.get("gpu"), lab.get("uuid")))
        ok = lab.get("gpu") == (None if gpu_index is None else str(gpu_index)) and lab.get("uuid") == uuid
        if not ok:
            wrong.append({"name": s["name"], "labels": lab})
    return {"per_metric": {k: sorted([list(x) for x in v]) for k, v in sorted(per_metric.items())},
            "wrong": wrong, "ok": not wrong and bool(per_metric)}


def tax_from_record(rec: dict | None, probes_at_serving: int | None) -> dict:
    """First probe after SERVING / median of the next NEXT (from the final --record)."""
    if not rec or probes_at_serving is None:
        return {"error": "no record"}
    after = rec.get("probes_seconds", [])[probes_at_serving:]
    if len(after) < NEXT + 1:
        return {"error": f"only {len(after)} probes after SERVING (need {NEXT + 1})"}
    steady = statistics.median(after[1:NEXT + 1])
    return {"first_seconds": after[0], "steady_median_seconds": steady, "tax": after[0] / steady,
            "agent_gauge_tax_before_serving": rec.get("first_request_tax_ratio")}


def p99(xs: list[float]) -> float | None:
    """Nearest-rank p99 (with fewer than 100 values: the largest)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-99 * len(s) // 100) - 1))]


def hard_deadline(args) -> float:
    """Past this no step waits any longer (the device command has 9 minutes)."""
    return T0 + args.hard_limit_seconds


def run_pair(k: int, args, nv, answers: list[dict], work: str) -> dict:
    """Start two agents (swapped on odd k), check them, measure, drain them."""
    order = ["0", "1"] if k % 2 == 0 else ["1", "0"]
    out: dict[str, Any] = {"start": k, "cuda_visible_devices": order, "agents": {}, "errors": []}
    env: dict[str, str] = {}
    data_dir: str | None = None
    if args.dry_run:   # the embedded model (made once, before the pair) on the CPU
        env["WARMUP_AGENT_MODEL_DEVICE"], data_dir = "cpu", os.path.join(work, "data")
        env.update({"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8, 16]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
                    "WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "0"})   # a shared 2-core machine: no deadline
    else:   # the grid of bench_gpu_cold_start's agent runs
        env.update({"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[16, 32, 64, 128]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1, 2, 4]",
                    "WARMUP_AGENT_PREWARM_LENGTH_SOURCE": "gaussian", "WARMUP_AGENT_PREWARM_SAMPLED_LENGTHS": "4"})
    agents = [AgentProc(f"start{k}_port{j}_cvd{cvd}", cvd, None if args.dry_run else args.model, work, env, data_dir)
              for j, cvd in enumerate(order)]
    ready_by = min(time.time() + args.ready_timeout, hard_deadline(args))
    try:
        pending = set(range(2))
        while pending and time.time() < ready_by:
            for j in list(pending):
                try:
                    if agents[j].poll_ready():
                        pending.discard(j)
                except RuntimeError as e:
                    out["errors"].append(str(e))
                    pending.discard(j)
            time.sleep(0.1)
        serving = [a for a in agents if a.probes_at_serving is not None]
        out["both_serving"] = len(serving) == 2
        if pending:
            out["errors"].append(f"not SERVING within {args.ready_timeout:g} s: {[agents[j].name for j in pending]}")
        # --- isolation, while both are up -------------------------------------------------------
        procs = nvml_processes(nv) if nv is not None else {}
        out["nvml_processes"] = {str(i): {str(p): b for p, b in v.items()} if isinstance(v, dict) else v
                                 for i, v in procs.items()}
        uuid_by_index = {i: g["uuid"] for i, g in enumerate(answers)}
        for a in agents:
            info: dict[str, Any] = {"cvd": a.cvd, "port": a.port, "pid": a.proc.pid, "spawn_to_serving_seconds": a.ready_seconds,
                    "state": a.state}
            try:
                info["cpus"] = cpus_of(a.proc.pid)
            except OSError as e:
                info["cpus"] = {"error": str(e)}
            # the GPU it really uses: where NVML sees its memory (independent of the agent's own mapping)
            held = {i: v[a.proc.pid] for i, v in procs.items() if isinstance(v, dict) and a.proc.pid in v}
            info["nvml_memory_bytes_by_gpu"] = {str(i): b for i, b in held.items()}
            on = sorted(held)
            info["gpus_holding_memory"] = on
            if len(on) == 1:
                info["physical_gpu"], info["physical_gpu_from"] = on[0], "NVML per-process memory"
            elif not on:   # NVML lists no process with this PID (another PID namespace, or a CPU dry run)
                info["physical_gpu"], info["physical_gpu_from"] = int(a.cvd), "CUDA_VISIBLE_DEVICES digit (NVML lists no process with its PID)"
            else:
                info["physical_gpu"], info["physical_gpu_from"] = None, f"memory on GPUs {on}"
            g = info["physical_gpu"]
            local = answers[g]["local_cpus"] if g is not None and g < len(answers) else []
            cpus = info["cpus"].get("main", [])
            info["cpus_local_to_gpu"] = bool(cpus) and set(cpus) <= set(local)
            code, text = http_get(a.url("/metrics"), timeout=10)
            samples = parse_metrics(text) if code == 200 else []
            info["labels"] = check_labels(samples, g, uuid_by_index.get(g))
            info["gpu_fragmentation_rate"] = [s for s in samples if s["name"] == "gpu_fragmentation_rate"]
            info["nvml_series"] = [s for s in samples if s["name"] == "warmup_gpu_memory_used_bytes"]
            info["agent_gauges"] = {s["name"]: s["value"] for s in samples if s["name"] in (
                "warmup_first_request_tax_ratio", "warmup_time_to_ready_seconds")}
            rec = a.record() or {}
            reserve: dict[str, Any] = next((s for s in rec.get("stages", []) if s.get("name") == "reserve"), {})
            info["agent_reserve"] = {k: reserve.get(k) for k in ("gpu_uuid", "pinned_cpus", "reserved_bytes", "cuda_context_seconds")}
            info["agent_topology"] = (rec.get("host") or {}).get("topology")
            out["agents"][a.name] = info
        infos = list(out["agents"].values())
        c0, c1 = (set(i["cpus"].get("main", [])) for i in infos)
        out["cpu_sets_disjoint"] = bool(c0) and bool(c1) and not (c0 & c1)
        u0, u1 = (set(i["cpus"].get("union", [])) for i in infos)
        out["cpu_sets_disjoint_all_threads"] = bool(u0) and bool(u1) and not (u0 & u1)
        out["cpu_sets_local"] = all(i["cpus_local_to_gpu"] for i in infos)
        out["no_memory_on_other_gpu"] = all(len(i["gpus_holding_memory"]) <= 1 for i in infos) and \
            len({i["physical_gpu"] for i in infos}) == 2
        if not all(i["gpus_holding_memory"] for i in infos):
            out["no_memory_on_other_gpu"] = None      # NVML showed no memory of an agent: not verified
        out["labels_ok"] = all(i["labels"]["ok"] for i in infos)
        # --- first-request tax: wait for NEXT+1 probes after SERVING on both ----------------------
        t_wait = min(time.time() + 30, hard_deadline(args))
        need = [(a, a.probes_at_serving + NEXT + 1) for a in serving if a.probes_at_serving is not None]
        while need and time.time() < t_wait and any(a.probes() < n for a, n in need):
            time.sleep(0.2)
    except Exception as e:  # noqa: BLE001 - keep what was measured, drain, go on
        out["errors"].append(f"start {k}: {type(e).__name__}: {e}")
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        # --- drain: SIGTERM to both at once --------------------------------------------------------
        t: dict[str, float] = {}
        for a in agents:
            if a.proc.poll() is None:
                a.proc.send_signal(signal.SIGTERM)
                t[a.name] = time.time()
        draining_seen = {a.name: False for a in agents}
        exited: dict[str, float] = {}
        while len(exited) < len(t) and any(time.time() - t0 < args.drain_timeout for t0 in t.values()):
            for a in agents:
                if a.name in t and a.name not in exited and a.proc.poll() is not None:
                    exited[a.name] = time.time()
                if a.proc.poll() is None and not draining_seen[a.name]:
                    code, body = http_get(a.url("/startupz"), timeout=0.5)
                    draining_seen[a.name] = code is not None and '"DRAINING"' in body
            time.sleep(0.02)
        for a in agents:
            info = out["agents"].setdefault(a.name, {"cvd": a.cvd})
            rc = a.proc.poll()
            info["sigterm"] = {"exit_code": rc, "state_when_sent": a.state,
                               "seconds": (exited[a.name] - t[a.name]) if a.name in exited else None,
                               "draining_seen_on_startupz": draining_seen[a.name]}
            if rc is None:
                info["sigterm"]["killed_after_seconds"] = args.drain_timeout
                a.kill()
            info["tax"] = tax_from_record(a.record(), a.probes_at_serving)
            info["log_tail"] = a.log_tail(1500 if info["sigterm"]["exit_code"] == 0 and not out["errors"] else 4000)
    return out


def summarise(result: dict) -> dict:
    pairs = result.get("pairs", [])
    agents = [a for p in pairs for a in p["agents"].values()]
    taxes = [a["tax"]["tax"] for a in agents if "tax" in a.get("tax", {})]
    # labels the same across the swap: per physical GPU, the same label sets in every start
    by_gpu: dict[str, list] = {}
    for a in agents:
        if a.get("physical_gpu") is not None and "labels" in a:
            by_gpu.setdefault(str(a["physical_gpu"]), []).append(json.dumps(a["labels"]["per_metric"], sort_keys=True))
    frag = [{"start": p["start"], "cvd": a["cvd"], "physical_gpu": a.get("physical_gpu"),
             "samples": [[s["labels"], s["value"]] for s in a.get("gpu_fragmentation_rate", [])]}
            for p in pairs for a in p["agents"].values()]
    frag_labels = sorted({tuple(sorted(s[0])) for f in frag for s in f["samples"]})
    drains = [a["sigterm"] for a in agents if "sigterm" in a and a["sigterm"].get("state_when_sent") == "SERVING"]
    return {
        "pair_starts": len(pairs),
        "both_serving_every_start": bool(pairs) and all(p.get("both_serving") for p in pairs),
        "spawn_to_serving_seconds": [a.get("spawn_to_serving_seconds") for a in agents],
        "cpu_sets_disjoint_every_start": bool(pairs) and all(p.get("cpu_sets_disjoint") for p in pairs),
        "cpu_sets_disjoint_all_threads_every_start": bool(pairs) and all(p.get("cpu_sets_disjoint_all_threads") for p in pairs),
        "cpu_sets_local_every_start": bool(pairs) and all(p.get("cpu_sets_local") for p in pairs),
        "no_memory_on_other_gpu_every_start": bool(pairs) and all(p.get("no_memory_on_other_gpu") for p in pairs),
        "labels_right_every_start": bool(pairs) and all(p.get("labels_ok") for p in pairs),
        "metrics_with_wrong_labels": sorted({w["name"] for a in agents for w in a.get("labels", {}).get("wrong", [])}),
        "labels_same_across_swap": bool(by_gpu) and all(len(set(v)) == 1 for v in by_gpu.values())
        and any(p["cuda_visible_devices"] == ["1", "0"] for p in pairs),
        "sigterm_exit_codes": [d["exit_code"] for d in drains],
        "sigterm_exit_seconds_max": max((d["seconds"] for d in drains if d["seconds"] is not None), default=None),
        "multi_gpu_first_request_tax_p99": p99(taxes),
        "first_request_taxes": taxes,
        "gpu_fragmentation_rate": frag,
        "gpu_fragmentation_rate_label_sets": [list(x) for x in frag_labels],
        "topology_matches_nvidia_smi": result.get("topology_comparison", {}).get("all_match"),
        # what each agent wrote in its --record is what the bench computed from the same NVML answers
        "agents_topology_reports_match": bool(agents) and all(
            a.get("agent_topology") == result.get("host", {}).get("agent_topology") for a in agents),
        "errors": [e for p in pairs for e in p.get("errors", [])] + result.get("errors", []),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/qwen2-1.5b-random")
    ap.add_argument("--pairs", type=int, default=6, help="starts of the pair (swapped on every other)")
    ap.add_argument("--budget-seconds", type=float, default=400, help="no new start of the pair after this minus 60 s")
    ap.add_argument("--hard-limit-seconds", type=float, default=500, help="no wait goes past this; the JSON is written anyway")
    ap.add_argument("--ready-timeout", type=float, default=150)
    ap.add_argument("--drain-timeout", type=float, default=20)
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--copy-to", default=os.environ.get("OUT"), help="also write the JSON here ($OUT)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: replayed host answers, CPU agents, one start")
    ap.add_argument("--replay", default=CONSTRUCTED, help="answer file for --dry-run (a two_gpu_h200x2_*.json works)")
    args = ap.parse_args()
    deadline = T0 + args.budget_seconds
    kind = "dryrun_cpu" if args.dry_run else "h200x2"
    stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    path = os.path.join(args.out_dir, f"two_gpu_{kind}_{stamp}.json")
    result: dict[str, Any] = {"provenance": provenance(), "kind": kind, "argv": sys.argv[1:], "child_env": CHILD_ENV,
              "targets": {"multi_gpu_first_request_tax_p99": TAX_TARGET},
              "definitions": {"multi_gpu_first_request_tax_p99": __doc__.split("multi_gpu_first_request_tax_p99 = ")[1].split("\n\n")[0]},
              "errors": [], "pairs": []}

    def save():
        result["summary"] = summarise(result)
        result["elapsed_seconds"] = time.time() - T0
        write_result(path, result)
        if args.copy_to:
            write_result(os.path.join(args.copy_to, os.path.basename(path)), result)

    def step(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - record and go on: the JSON must come back
            result["errors"].append(f"{name}: {type(e).__name__}: {e}")
            result.setdefault("tracebacks", {})[name] = traceback.format_exc()[-3000:]
            print(f"[{time.time() - T0:6.1f}s] {name} FAILED: {e}", flush=True)
        save()

    replay = None
    if args.dry_run:
        with open(args.replay) as f:
            data = json.load(f)
        replay = data.get("host", data)
        result["replayed_from"] = os.path.relpath(args.replay, ROOT)
    step("host", lambda: host_step(result, replay))
    print(f"[{time.time() - T0:6.1f}s] topology matches nvidia-smi: {result.get('topology_comparison', {}).get('all_match')}", flush=True)
    nv = None
    if not args.dry_run:
        def model():
            t = time.time()
            r = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                                f"from bench.bench_gpu_cold_start import make_model; make_model({args.model!r})"],
                               cwd=ROOT, env=dict(os.environ, **CHILD_ENV, CUDA_VISIBLE_DEVICES="0"), timeout=300,
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"making the model exited {r.returncode}: {r.stderr[-2000:]}")
            result["model"] = {"path": args.model, "shape": "Qwen2-1.5B", "dtype": "bfloat16", "weights": "random",
                               "make_seconds": time.time() - t}
        step("model", model)
        try:
            import pynvml
            pynvml.nvmlInit()
            nv = pynvml
        except Exception as e:  # noqa: BLE001 - no per-process memory then; recorded
            result["errors"].append(f"nvml: {type(e).__name__}: {e}")
    answers = result.get("host", {}).get("nvml_answers", [])
    work = tempfile.mkdtemp(prefix="two-gpu-")
    if args.dry_run:
        def embedded():
            from warmup_agent.model.embedded import ensure_embedded_model
            ensure_embedded_model(os.path.join(work, "data"))
        step("embedded_model", embedded)
    pairs = 1 if args.dry_run else args.pairs
    for k in range(pairs):
        if time.time() > deadline - (60 if k else 0):
            result["errors"].append(f"budget: stopped after {k} starts of the pair")
            break
        step(f"pair{k}", lambda: result["pairs"].append(run_pair(k, args, nv, answers, work)))
        p = result["pairs"][-1] if result["pairs"] else {}
        print(f"[{time.time() - T0:6.1f}s] start {k} {p.get('cuda_visible_devices')}: serving {p.get('both_serving')}, "
              f"cpus disjoint {p.get('cpu_sets_disjoint')} local {p.get('cpu_sets_local')}, "
              f"mem isolated {p.get('no_memory_on_other_gpu')}, labels {p.get('labels_ok')}, "
              f"taxes {[a.get('tax', {}).get('tax') for a in p.get('agents', {}).values()]}, "
              f"sigterm {[a.get('sigterm') for a in p.get('agents', {}).values()]}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    save()
    s = result["summary"]
    print(json.dumps({k: v for k, v in s.items() if k not in ("gpu_fragmentation_rate",)}, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
