"""Record the /metrics of a healthy pod, for the alert replays in alerts/tests/recorded/.

    python -m alerts.record OUT.prom [--serve-seconds S] -- <warmup-agent run arguments...>

Starts `python -m warmup_agent run --listen 127.0.0.1:PORT ARGS...`, waits for
/readyz to answer 200 (SERVING), lets it serve for S seconds (its probes keep
running, as in a pod), scrapes /metrics into OUT.prom, then stops it (SIGTERM,
SIGKILL after 10 s).  Exit 0 when the scrape was written, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def record(out: str, agent_args: list[str], serve_seconds: float = 30.0, ready_timeout: float = 600.0) -> int:
    port = _free_port()
    cmd = [sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--listen", f"127.0.0.1:{port}", *agent_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while _get(base + "/readyz")[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"alerts.record: agent never became ready (exit {proc.poll()})", file=sys.stderr)
                return 1
            time.sleep(0.5)
        time.sleep(serve_seconds)
        status, text = _get(base + "/metrics")
        if status != 200:
            print(f"alerts.record: /metrics answered {status}", file=sys.stderr)
            return 1
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"alerts.record: wrote {out} ({len(text.splitlines())} lines)")
        return 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, agent_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--serve-seconds", type=float, default=30.0)
    args = ap.parse_args(ours)
    return record(args.out, agent_args, args.serve_seconds)


if __name__ == "__main__":
    sys.exit(main())
