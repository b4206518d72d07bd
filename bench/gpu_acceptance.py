"""GPU acceptance (issue 13): the agent's command line on a GPU host, as a user runs it.

One command, on the H200:
    python bench/gpu_acceptance.py --out bench/results/gpu_acceptance_h200.json

  1. starts `warmup-agent run` on CUDA (torch engine, default config) with a
     Qwen2-1.5B-shaped random bf16 model made locally (no download);
  2. waits for /readyz, lets it serve a while, scrapes /metrics (saved beside
     the JSON: it is the "healthy H200 pod" the alert tests replay);
  3. checks the exposition: `promtool check metrics` when promtool is on PATH
     (or given with --promtool), else prometheus_client's parser;
  4. replays the scrape through the shipped rules for 35+ minutes with
     `python -m alerts.replay` (needs promtool); without promtool the
     recorded file is evaluated later on a machine that has it
     (`python bench/gpu_acceptance.py --evaluate RESULT.json`);
  5. sends SIGTERM, watches /startupz for DRAINING, records exit code and time.
With `--server-command "..."` it does the same once more with
`--engine openai` supervising that server, and checks the server is gone.
With `--fp8` (issue 16) the torch run serves the FP8 checkpoint of the same model
(transformers' "fp8" layout, made locally) and keeps the quantization and FP8
range series of the scrape: a healthy FP8 pod, through the same alert replay.

Keys (issue 13): sigterm_exit_seconds (<= 5), sigterm_exit_code (0),
healthy_pod_alerts_firing (0).  CPU smoke run: `--model embedded`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.provenance import provenance, write_result  # noqa: E402


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_exposition(text: str, promtool: str | None) -> dict:
    if promtool:
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        return {"checker": "promtool check metrics", "ok": r.returncode == 0,
                "problems": (r.stdout + r.stderr).strip().splitlines()[:20]}
    from prometheus_client.parser import text_string_to_metric_families
    try:
        n = sum(1 for _ in text_string_to_metric_families(text))
        return {"checker": "prometheus_client parser (no promtool here)", "ok": True, "families": n}
    except Exception as e:  # noqa: BLE001 -- the parser's error is the finding
        return {"checker": "prometheus_client parser (no promtool here)", "ok": False, "problems": [str(e)]}


def replay_alerts(scrape_file: str, promtool: str | None) -> dict:
    """Replay the scrape through the shipped rules (alerts.replay); None firing
    count when promtool is absent (evaluated later with --evaluate)."""
    if not promtool:
        return {"evaluated": False, "why": "promtool not on this host; run --evaluate where it is"}
    env = dict(os.environ, PATH=os.path.dirname(promtool) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run([sys.executable, "-m", "alerts.replay", scrape_file], cwd=ROOT, capture_output=True,
                       text=True, env=env)
    out = (r.stdout + r.stderr).strip()
    # alerts.replay prints one line per alert: "FILE: ALERT fired at minutes ..."
    firing = [m.group(1) for m in re.finditer(r": (\w+) fired at minutes", out)]
    return {"evaluated": r.returncode == 0 or bool(firing), "exit_code": r.returncode, "firing": firing, "output": out[-3000:]}


def one_run(args, label: str, extra: list[str], server_command: list[str] | None, out_dir: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(out_dir, f"acceptance_{label}.log")
    record = os.path.join(out_dir, f"acceptance_{label}_record.json")
    cmd = [sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--listen", f"127.0.0.1:{port}",
           "--data-dir", args.data_dir, "--record", record, *extra]
    if server_command:
        cmd += ["--", *server_command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res: dict = {"command": shlex.join(cmd)}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        while time.time() - t0 < args.ready_timeout:
            if http_get(url + "/readyz")[0] == 200 or proc.poll() is not None:
                break
            time.sleep(0.1)
        res["spawn_to_ready_seconds"] = round(time.time() - t0, 3)
        res["reached_serving"] = proc.poll() is None and http_get(url + "/readyz")[0] == 200
        if not res["reached_serving"]:
            res["log_tail"] = open(log_path).read()[-3000:]
            return res
        time.sleep(args.serve_seconds)          # probes keep running: a pod in steady state
        code, text = http_get(url + "/metrics", timeout=10)
        scrape = os.path.join(out_dir, f"acceptance_{label}.prom")
        with open(scrape, "w") as f:
            f.write(text)
        res["scrape_file"] = os.path.basename(scrape)
        res["exposition"] = check_exposition(text, args.promtool)
        res["alerts"] = replay_alerts(scrape, args.promtool)
        res["startupz_serving"] = json.loads(http_get(url + "/startupz")[1] or "{}")
        server_pids = []
        if server_command:
            server_pids = [int(p) for p in subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True,
                                                          text=True).stdout.split() if int(p) != proc.pid]
            # the supervised server has its own session: find the agent's children
            server_pids += [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                           text=True).stdout.split()]
        res["threads_at_sigterm"] = len(os.listdir(f"/proc/{proc.pid}/task"))
        states: list[str] = []

        def watch():
            while proc.poll() is None:
                c, body = http_get(url + "/startupz", timeout=0.5)
                if c:
                    try:
                        s = json.loads(body)["state"]
                        if not states or states[-1] != s:
                            states.append(s)
                    except (ValueError, KeyError):
                        pass
                time.sleep(0.02)
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        t_term = time.time()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=args.sigterm_timeout)
        except subprocess.TimeoutExpired:
            pass
        res["sigterm_exit_seconds"] = round(time.time() - t_term, 3) if proc.poll() is not None else None
        res["sigterm_exit_code"] = proc.poll()
        w.join(1)
        res["states_after_sigterm"] = states
        res["draining_seen"] = "DRAINING" in states or "signal 15: draining" in open(log_path).read()
        if server_command:
            time.sleep(0.5)
            res["server_pids"] = server_pids
            res["server_gone"] = all(not os.path.exists(f"/proc/{p}") or
                                     open(f"/proc/{p}/stat").read().split()[2] == "Z" for p in server_pids)
        if os.path.exists(record):
            rec = json.load(open(record))
            res["stages"] = {s["name"]: {k: v for k, v in s.items() if k not in ("name", "phase")}
                             for s in rec.get("stages", [])}
            res["record_time_to_ready_seconds"] = rec.get("time_to_ready_seconds")
            res["record_first_request_tax_ratio"] = rec.get("first_request_tax_ratio")
        res["fragmentation_series"] = [ln for ln in text.splitlines() if ln.startswith("gpu_fragmentation_rate")]
        res["quantization_series"] = [ln for ln in text.splitlines()
                                      if ln.startswith(("warmup_model_quantization_info", "warmup_fp8_range_"))]
        res["reserve_phase_series"] = [ln for ln in text.splitlines()
                                       if ln.startswith("model_loading_phase_duration_seconds") and "reserve" in ln]
        return res
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        res["log_tail"] = open(log_path).read()[-2500:]


def summarise(runs: dict) -> dict:
    firing = [a for r in runs.values() for a in (r.get("alerts") or {}).get("firing", [])]
    evaluated = all((r.get("alerts") or {}).get("evaluated") for r in runs.values())
    exits = [r.get("sigterm_exit_seconds") for r in runs.values()]
    return {
        "sigterm_exit_seconds": max(exits) if exits and None not in exits else None,
        "sigterm_exit_code": max((r.get("sigterm_exit_code") or 0) if r.get("sigterm_exit_code") is not None else 99
                                 for r in runs.values()),
        "healthy_pod_alerts_firing": len(firing) if evaluated else None,
        "alerts_firing": firing,
        "targets": {"sigterm_exit_seconds": 5, "sigterm_exit_code": 0, "healthy_pod_alerts_firing": 0},
    }


def evaluate(result_path: str, promtool: str | None) -> int:
    """Replay the scrapes recorded by a run on a host without promtool."""
    res = json.load(open(result_path))
    base = os.path.dirname(os.path.abspath(result_path))
    for run in res["runs"].values():
        if run.get("scrape_file"):
            run["alerts"] = replay_alerts(os.path.join(base, run["scrape_file"]), promtool)
            run["alerts"]["evaluated_on"] = provenance()
    res.update(summarise(res["runs"]))
    write_result(result_path, res)
    print(json.dumps({k: res[k] for k in ("sigterm_exit_seconds", "sigterm_exit_code", "healthy_pod_alerts_firing",
                                          "alerts_firing")}, indent=2))
    return 0 if res["healthy_pod_alerts_firing"] == 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/qwen2-1.5b-random",
                    help="model dir (made if missing: Qwen2-1.5B-shaped random bf16), or 'embedded'")
    ap.add_argument("--data-dir", default="/tmp/warmup-acceptance")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_acceptance.json"))
    ap.add_argument("--promtool", default=shutil.which("promtool"))
    ap.add_argument("--serve-seconds", type=float, default=15.0)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--sigterm-timeout", type=float, default=30.0)
    ap.add_argument("--server-command", help="also run --engine openai supervising this server "
                                             "({model} and {port} are substituted)")
    ap.add_argument("--model-from-command", action="store_true",
                    help="the openai run gives no --model: the agent reads the model from the server command")
    ap.add_argument("--fp8", action="store_true", help="serve the model's FP8 checkpoint (made beside it, DIR-fp8) "
                                                       "with the torch engine")
    ap.add_argument("--evaluate", metavar="RESULT_JSON", help="only replay the recorded scrapes of a result")
    args = ap.parse_args()
    if args.evaluate:
        return evaluate(args.evaluate, args.promtool)
    if args.fp8 and (args.model == "embedded" or args.server_command):
        ap.error("--fp8 runs the torch engine on a model directory: give --model DIR, not 'embedded', "
                 "and no --server-command")

    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    extra: list[str] = []
    if args.model != "embedded":
        from bench.bench_gpu_cold_start import make_fp8_model, make_model
        make_model(args.model)
        if args.fp8:
            make_fp8_model(args.model, args.model + "-fp8")
            args.model += "-fp8"
        extra = ["--model", args.model]
    device = {}
    try:
        import torch
        if torch.cuda.is_available():
            device = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    except ImportError:
        pass
    label = "torch_fp8" if args.fp8 else "torch"
    runs = {label: one_run(args, label, extra, None, out_dir)}
    # Written now too, so a run cut short during the server part keeps the torch figures.
    write_result(args.out, {**provenance(), **device, **summarise(runs), "runs": runs})
    if args.server_command:
        sport = free_port()
        if args.model == "embedded":
            from warmup_agent.model.embedded import ensure_embedded_model
            model = ensure_embedded_model(args.data_dir)
        else:
            model = args.model
        server = shlex.split(args.server_command.format(model=model, port=sport))
        agent_model = [] if args.model_from_command else ["--model", model]
        runs["openai"] = one_run(args, "openai", ["--engine", "openai", *agent_model], server, out_dir)
    result = {**provenance(), **device, **summarise(runs), "runs": runs}
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("sigterm_exit_seconds", "sigterm_exit_code",
                                             "healthy_pod_alerts_firing", "alerts_firing")}, indent=2))
    ok = result["sigterm_exit_code"] == 0 and (result["sigterm_exit_seconds"] or 99) <= 5
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
