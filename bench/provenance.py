"""Where and when a benchmark ran: every bench/results/*.json carries these."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
    """HEAD, or BENCH_COMMIT where the tree was copied without its .git (a device machine)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    r = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def provenance() -> dict:
    return {"machine": platform.node(), "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit()}


def gpu_name() -> str | None:
    """The first GPU's name as NVML gives it; None on a machine without one."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception:  # noqa: BLE001 - no NVML, no driver or no GPU: all mean "none"
        return None


def dumps_result(result: dict) -> str:
    """A benchmark's JSON as committed: one top-level key per line (the figures stay
    readable and diff line by line), each value on its line without indentation.  The
    per-start detail of a GPU run is most of its bytes, and the whole tracked tree goes
    to the device with the carried binaries under one 64 MiB limit
    (/work/.library/device/README.md): indented, bench/results took 11.8 MB; so, 6.8 MB."""
    import json
    lines = [f"  {json.dumps(str(k))}: {json.dumps(v, separators=(',', ':'), default=str)}" for k, v in result.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_result(path: str, result: dict) -> None:
    """Write one benchmark's JSON (bench/results/*.json), creating the folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(dumps_result(result))
