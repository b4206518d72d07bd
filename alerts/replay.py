"""Replay a recorded /metrics exposition through the alert rules with promtool.

    python -m alerts.replay FILE.prom [FILE.prom ...] [--minutes 40] [--out TEST.yaml]

Turns one scrape of a pod into a `promtool test rules` file that replays that pod
for --minutes (default 40, so every `for:` of 15m has passed twice over) with its
series evolving as they do on a pod that keeps serving, then runs promtool and
expects no alert at any minute.  Exit 0: no alert fired; 1: alerts fired (one
line each on stdout: file, minute, alert, labels); 2: bad input or no promtool
(the test file is still written with --out, for promtool elsewhere).

How the series evolve from the recorded values (t = minutes after the scrape):
  - uptime u(t) = u0 + t, where u0 (seconds from agent start to the scrape) is
    the agent's own engine-busy seconds over its cost ratio
    (sum warmup_engine_seconds_total / warmup_cost_ratio), or --uptime-seconds;
  - probes go on at one per --probe-interval seconds (readiness default 5 s):
    every counter or histogram series labelled kind="probe" grows by its
    recorded value per probe (value / probes so far) per probe;
  - warmup_cost_ratio = (busy0 + probe busy seconds per second x t) / u(t): it
    decays as the pod serves, exactly as the agent computes it; a probe after
    SERVING asks for one token, so it costs its mean time to first token;
  - warmup_engine_requests_finished_total (read from the engine) grows by one
    request per probe; the agent process's CPU seconds
    (warmup_process_cpu_seconds_total) and counters outside the catalogue (an
    engine's own names) grow at their recorded average rate (value / u0);
  - every other counter (failures, transitions, warmup requests, cache
    requests) stays flat: nothing fails or re-warms on a healthy pod;
  - a pod recorded SLEEPING (warmup_server_sleeping 1: its server sleeps when idle,
    as its operator asked) stays asleep: no probes at all (the agent only reads),
    no engine requests, warmup_server_asleep_seconds_total grows 60 s a minute;
  - every other gauge keeps its recorded value (states, stage durations,
    thresholds, fragmentation, memory);
  - `up` is 1 throughout.
Each series gets target labels job="warmup-agent", instance, namespace, pod as
Prometheus and the ServiceMonitor add them.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml
from prometheus_client.parser import text_string_to_metric_families

from alerts.generate import RULES_FILE
from exporter.catalogue import BY_NAME

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = {"job": "warmup-agent", "instance": "10.0.0.1:9400", "namespace": "llm", "pod": "replayed"}


class ReplayError(Exception):
    """Bad input; str() is the one line to show."""


def parse(path: str) -> list[tuple[str, str, dict, float]]:
    """(family type, sample name, labels, value) of every sample in the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ReplayError(f"{path}: cannot read: {e.strerror}") from None
    try:
        out = [(fam.type, s.name, dict(s.labels), float(s.value))
               for fam in text_string_to_metric_families(text) for s in fam.samples]
    except Exception as e:  # noqa: BLE001 - the parser raises ValueError and friends on bad lines
        raise ReplayError(f"{path}: not a Prometheus text exposition: {e}") from None
    if not any(name.startswith("warmup_") for _, name, _, _ in out):
        raise ReplayError(f"{path}: no warmup_* series: not a scrape of the warmup agent")
    return out


def _value(samples, name: str, **labels) -> float | None:
    vals = [v for _, n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    return sum(vals) if vals else None


def _cumulative(ftype: str, name: str) -> bool:
    return ftype == "counter" or (ftype == "histogram" and re.search(r"_(bucket|sum|count)$", name) is not None)


def _ours(name: str) -> bool:
    base = re.sub(r"_(bucket|sum|count|total|info)$", "", name)
    return name in BY_NAME or base in BY_NAME or base + "_total" in BY_NAME or base + "_info" in BY_NAME


def evolve(samples, minutes: int, probe_interval: float = 5.0, uptime: float | None = None) -> dict[str, list[float]]:
    """Series selector -> one value per minute 0..minutes (see the module docstring)."""
    busy0 = _value(samples, "warmup_engine_seconds_total") or 0.0
    cost0 = _value(samples, "warmup_cost_ratio")
    if uptime is None:
        if not cost0 or not busy0:
            raise ReplayError("cannot tell the pod's uptime (warmup_cost_ratio or warmup_engine_seconds_total is "
                              "absent or 0): pass --uptime-seconds")
        uptime = busy0 / cost0
    probes = _value(samples, "warmup_requests_total", kind="probe") or 0.0
    asleep = (_value(samples, "warmup_server_sleeping") or 0.0) >= 1
    per_second = 1.0 / probe_interval if probes and probe_interval > 0 and not asleep else 0.0
    # A probe after SERVING asks for one token (StageContext.probe): it keeps the
    # engine busy for about its time to first token, not for the decoded probes of
    # the gate that the recorded engine seconds also hold.
    ttft_n = _value(samples, "warmup_first_token_latency_seconds_count", kind="probe")
    ttft_sum = _value(samples, "warmup_first_token_latency_seconds_sum", kind="probe")
    per_probe = (ttft_sum / ttft_n if ttft_n and ttft_sum is not None else
                 (_value(samples, "warmup_engine_seconds_total", kind="probe") or 0.0) / probes if probes else 0.0)
    probe_busy = per_probe * per_second
    out: dict[str, list[float]] = {}
    for ftype, name, labels, v in samples:
        if name.endswith("_created"):
            continue                                      # creation timestamps: not replayed
        if name == "warmup_cost_ratio":
            vals = [(busy0 + probe_busy * 60 * t) / (uptime + 60 * t) for t in range(minutes + 1)]
        elif name == "warmup_engine_seconds_total" and labels.get("kind") == "probe":
            vals = [v + probe_busy * 60 * t for t in range(minutes + 1)]    # one-token probes, as above
        elif _cumulative(ftype, name) and labels.get("kind") == "probe" and probes:
            vals = [v + v / probes * per_second * 60 * t for t in range(minutes + 1)]
        elif name == "warmup_server_asleep_seconds_total" and asleep:
            vals = [v + 60 * t for t in range(minutes + 1)]
        elif name == "warmup_engine_requests_finished_total":
            vals = [v + per_second * 60 * t for t in range(minutes + 1)]
        elif _cumulative(ftype, name) and (name == "warmup_process_cpu_seconds_total" or not _ours(name)):
            vals = [v + v / uptime * 60 * t for t in range(minutes + 1)]
        else:
            vals = [v] * (minutes + 1)
        out[_selector(name, {**labels, **TARGET})] = vals
    out[_selector("up", TARGET)] = [1.0] * (minutes + 1)
    return out


def _selector(name: str, labels: dict) -> str:
    inner = ", ".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    # Names with a colon (vllm:...) are valid metric names; promtool reads them as written.
    return f"{name}{{{inner}}}"


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "Inf" if v > 0 else "-Inf"
    return repr(float(v))


def alert_names(rules_path: str) -> list[str]:
    with open(rules_path, encoding="utf-8") as f:
        rules = yaml.safe_load(f)
    return [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]


def promtool_test(series: dict[str, list[float]], rules_path: str, minutes: int, every: int = 1) -> dict:
    """A promtool test that expects no alert at every `every` minutes (0..minutes)."""
    return {
        "rule_files": [os.path.abspath(rules_path)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": s, "values": " ".join(_num(v) for v in vals)} for s, vals in series.items()],
            "alert_rule_test": [{"eval_time": f"{t}m", "alertname": a, "exp_alerts": []}
                                for t in range(0, minutes + 1, every) for a in alert_names(rules_path)],
        }],
    }


_GOT = re.compile(r"alertname: (\S+), time: (\S+),.*?\n\s+exp:.*?\n\s+got:(.*?)(?=\n\s+alertname:|\Z)", re.S)
_LABELS = re.compile(r"Labels:(\{[^}]*\})")


def firing(promtool_output: str) -> list[tuple[str, str, str]]:
    """(alert, labels, minutes) of each alert promtool got where none was
    expected: one entry per alert and label set, with the minutes it fired at."""
    seen: dict[tuple[str, str], list[str]] = {}
    for alert, minute, got in _GOT.findall(promtool_output):
        for labels in _LABELS.findall(got) or [got.strip()]:
            seen.setdefault((alert, labels), []).append(minute)
    return [(a, labels, f"{m[0]}..{m[-1]} ({len(m)} evaluations)") for (a, labels), m in seen.items()]


def find_promtool(explicit: str | None = None) -> str | None:
    return explicit or os.environ.get("PROMTOOL") or shutil.which("promtool")


def replay(path: str, minutes: int = 40, probe_interval: float = 5.0, uptime: float | None = None,
           rules_path: str = os.path.join(HERE, RULES_FILE), out: str | None = None,
           promtool: str | None = None) -> list[tuple[str, str, str]]:
    """Replay one file; return (alert, labels, minutes) of the alerts that fired
    (empty: quiet).  Raises
    ReplayError on bad input or when promtool is missing."""
    spec = promtool_test(evolve(parse(path), minutes, probe_interval, uptime), rules_path, minutes)
    with tempfile.TemporaryDirectory() as tmp:
        target = out or os.path.join(tmp, "replay.test.yaml")
        with open(target, "w", encoding="utf-8") as f:
            yaml.safe_dump(spec, f, sort_keys=False, width=100_000)
        tool = find_promtool(promtool)
        if not tool:
            raise ReplayError("promtool not found (install prometheus, set PROMTOOL or pass --promtool)"
                              + (f"; the test file is {out}" if out else ""))
        r = subprocess.run([tool, "test", "rules", target], capture_output=True, text=True)
    if r.returncode == 0:
        return []
    got = firing(r.stdout + r.stderr)
    if not got:
        raise ReplayError(f"{path}: promtool failed: {(r.stdout + r.stderr).strip().splitlines()[-1:]}")
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", metavar="FILE.prom")
    ap.add_argument("--minutes", type=int, default=40, help="minutes to replay (default 40)")
    ap.add_argument("--probe-interval", type=float, default=5.0,
                    help="seconds between readiness probes after SERVING (readiness.watch_interval_seconds; default 5)")
    ap.add_argument("--uptime-seconds", type=float, help="agent uptime at the scrape (default: from the cost ratio)")
    ap.add_argument("--rules", default=os.path.join(HERE, RULES_FILE))
    ap.add_argument("--promtool", help="promtool binary (default: $PROMTOOL or promtool on PATH)")
    ap.add_argument("--out", help="also keep the generated promtool test file here (one input file only)")
    args = ap.parse_args(argv)
    if args.minutes < 35:
        print(f"alerts.replay: --minutes {args.minutes}: expected >= 35 (every 15m `for:` must pass twice)", file=sys.stderr)
        return 2
    if args.out and len(args.files) > 1:
        print("alerts.replay: --out takes one input file", file=sys.stderr)
        return 2
    fired = False
    for path in args.files:
        try:
            got = replay(path, args.minutes, args.probe_interval, args.uptime_seconds, args.rules, args.out, args.promtool)
        except ReplayError as e:
            print(f"alerts.replay: {e}", file=sys.stderr)
            return 2
        for alert, labels, minutes in got:
            print(f"{path}: {alert} fired at minutes {minutes}: {labels}")
        if got:
            fired = True
        else:
            print(f"{path}: no alert fired in {args.minutes} minutes")
    return 1 if fired else 0


if __name__ == "__main__":
    sys.exit(main())
