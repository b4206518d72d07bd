"""The bench's figures: per condition the median and spread of each start's
figures, the ratios of oneshot and agent to alone, and the JSON that keeps them
with where, when and on what they were measured."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from typing import Any

from warmup_agent import __version__

# (key, what it is); each start's record has these (the first request's under "first").
FIGURES: tuple[tuple[str, str], ...] = (
    ("ready_seconds", "spawn to ready: /health 200 (alone), the 1-token request answered (oneshot), "
                      "the agent's /readyz 200 (agent)"),
    ("first_ttft_seconds", "the first request's time to first token, sent at ready"),
    ("first_total_seconds", "the first request's whole answer (end of its stream)"),
    ("steady_ttft_seconds", "median time to first token of the next requests, one at a time"),
    ("steady_total_seconds", "median whole answer of the next requests"),
    ("first_ttft_tax", "first request's time to first token / the steady median (1.0: no cold start)"),
    ("first_total_tax", "first request's whole answer / a steady answer as long: steady TTFT + (its tokens - 1) x "
                        "steady time per output token"),
    ("first_tpot_tax", "first request's time per output token / the steady median (a cold decode)"),
    ("warm_control_ttft_ratio", "a request of the same shape after the steady ones and a quiet pause (--idle), "
                                "over the steady median: what a warm server's 'first' request reads, the noise floor"),
    ("new_length_ttft_ratio", "a request a dozen words longer than any before it, over the steady median: what a "
                              "warm server pays at a prompt length it has not seen (its longer prefill included)"),
    ("new_length_after_background_ttft_tax", "a prompt length inside the traffic's range that no request of the "
                                             "start used, sent last (under the agent after its warm-up behind the "
                                             "users): its time to first token over that of the same length again"),
    ("burst_ttft_over_steady", "median time to first token of a burst of concurrent requests / steady median"),
    ("burst_total_max_seconds", "the burst's slowest whole answer"),
    ("sigterm_exit_seconds", "SIGTERM to exit"),
    ("orphans", "processes left after the exit (killed by the bench)"),
)
# Measured under the agent only, whose proxy carries every request of the start: its
# exported figures, read from its /metrics, beside what the bench measured on the same start.
AGENT_FIGURES: tuple[tuple[str, str], ...] = (
    ("agent_exported_ttft_tax", "the users' real first request through the proxy, as the agent exported it "
                                "(warmup_first_user_request_tax_ratio): the figure of record"),
    ("exported_over_measured_ttft_tax", "that exported first-TTFT tax / the client's, over the same answers after it "
                                        "(first_ttft_tax_users_window: the agent's default window)"),
    ("exported_over_measured_total_tax", "the exported whole-answer tax (warmup_first_user_request_total_tax_ratio) "
                                         "/ the bench's first_total_tax"),
    ("agent_predicted_ttft_tax", "the agent's probes' prediction of the first-TTFT tax "
                                 "(warmup_first_request_tax_ratio)"),
    ("predicted_over_measured_ttft_tax", "that prediction / the bench's first_ttft_tax"),
    ("predicted_over_measured_total_tax", "the predicted whole-answer tax (warmup_first_request_total_tax_ratio) / "
                                          "the bench's first_total_tax"),
    ("behind_users_seconds", "how long the agent's warm-up behind the users took after SERVING "
                             "(warmup_behind_users_seconds; 0: it had nothing left to warm)"),
    ("background_user_ttft_over_steady", "median time to first token of the steady requests sent while that warm-up "
                                         "had requests left, over steady_after_background_ttft_seconds"),
    ("steady_after_background_ttft_seconds", "median time to first token of steady requests sent after that "
                                             "warm-up finished"),
    ("warmup_budget_overspend_ratio", "seconds the agent's warm-up took before SERVING (warmup_budget_spent_seconds) "
                                      "over its budget (warmup_budget_seconds); above 1: it overran"),
)
# Measured in the spawn-alone and spawn-agent starts only (bench/spawn.py).
SPAWN_FIGURES: tuple[tuple[str, str], ...] = (
    ("spawn_arrival_seconds", "a user's request sent at the spawn, retried only when refused: spawn to its whole "
                              "answer"),
    ("spawn_arrival_ttft_seconds", "the same request: spawn to its first token"),
    ("spawn_arrival_503", "503 answers that user got before the answer"),
    ("spawn_arrival_refused", "connections that user had refused (nothing listening yet) before the answer"),
)
# Named figures over the whole run (bench.json's "headline"): what a server table reads.
HEADLINE: tuple[tuple[str, str], ...] = (
    ("exported_over_measured_ttft_tax_min", "lowest exported_over_measured_ttft_tax over the agent starts"),
    ("exported_over_measured_ttft_tax_max", "highest exported_over_measured_ttft_tax over the agent starts"),
    ("predicted_over_measured_ttft_tax_min", "lowest predicted_over_measured_ttft_tax over the agent starts"),
    ("predicted_over_measured_ttft_tax_max", "highest predicted_over_measured_ttft_tax over the agent starts"),
    ("agent_over_oneshot_ready_seconds", "median agent ready_seconds / median oneshot ready_seconds"),
    ("background_user_ttft_over_steady_median", "median background_user_ttft_over_steady over the agent starts"),
    ("background_user_ttft_over_steady_max", "highest background_user_ttft_over_steady over the agent starts"),
    ("new_length_after_background_ttft_tax_median", "median new_length_after_background_ttft_tax over the agent "
                                                    "starts"),
    ("new_length_after_background_ttft_tax_max", "highest new_length_after_background_ttft_tax over the agent "
                                                 "starts"),
    ("warmup_budget_overspend_ratio_max", "highest warmup_budget_overspend_ratio over the agent starts"),
)
#: The figures whose oneshot/alone and agent/alone ratios are reported.
RATIO_FIGURES = ("ready_seconds", "first_ttft_seconds", "first_total_seconds", "first_ttft_tax",
                 "first_total_tax", "burst_ttft_over_steady")


def figure(rec: dict[str, Any], key: str) -> float | None:
    """One figure of a start's record, or None where it was not measured."""
    if key in ("first_ttft_seconds", "first_total_seconds"):
        v = (rec.get("first") or {}).get(key.removeprefix("first_"))
    elif key.startswith("spawn_arrival_"):
        arrival = rec.get("spawn_arrival") or {}
        v = {"spawn_arrival_seconds": arrival.get("seconds"), "spawn_arrival_ttft_seconds": arrival.get("ttft_seconds"),
             "spawn_arrival_503": arrival.get("status_503"),
             "spawn_arrival_refused": arrival.get("refused_connections")}[key]
    elif key in ("sigterm_exit_seconds", "orphans"):
        v = (rec.get("sigterm") or {}).get(key.removeprefix("sigterm_"))
    else:
        v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(starts: list[dict[str, Any]], conditions: list[str]) -> dict[str, dict[str, Any]]:
    """Per condition, per figure: median, min, max and n over the starts that measured it."""
    out: dict[str, dict[str, Any]] = {}
    for cond in conditions:
        recs = [r for r in starts if r["condition"] == cond]
        out[cond] = {}
        figures = SPAWN_FIGURES + FIGURES[:1] + FIGURES[-2:] if cond.startswith("spawn-") else \
            FIGURES + (AGENT_FIGURES if cond == "agent" else ())
        for key, _ in figures:
            vals = [v for r in recs if (v := figure(r, key)) is not None]
            out[cond][key] = spread(vals) if vals else None
    return out


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """median(condition) / median(alone), for oneshot and agent."""
    out: dict[str, dict[str, float | None]] = {}
    base = summary.get("alone") or {}
    for cond in ("oneshot", "agent"):
        if cond not in summary:
            continue
        out[f"{cond}_over_alone"] = {}
        for key in RATIO_FIGURES:
            a, b = (summary[cond].get(key) or {}).get("median"), (base.get(key) or {}).get("median")
            out[f"{cond}_over_alone"][key] = a / b if a is not None and b else None
    return out


def headline(summary: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """HEADLINE's figures from the per-condition summary; None where a condition or a
    figure was not measured."""
    agent, oneshot = summary.get("agent") or {}, summary.get("oneshot") or {}

    def of(key: str, stat: str) -> float | None:
        return (agent.get(key) or {}).get(stat)
    ready_agent, ready_oneshot = of("ready_seconds", "median"), (oneshot.get("ready_seconds") or {}).get("median")
    out: dict[str, float | None] = {}
    for name, _ in HEADLINE:
        key, _, stat = name.rpartition("_")
        out[name] = of(key, stat) if stat in ("min", "max", "median") else None
    out["agent_over_oneshot_ready_seconds"] = ready_agent / ready_oneshot \
        if ready_agent is not None and ready_oneshot else None
    return out


def spawn_arrival(summary: dict[str, dict[str, Any]], starts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The user at the spawn: the agent's median seconds to their answer over alone's,
    and the most 503s one of them met through the agent (issue 71's names)."""
    if "spawn-agent" not in summary:
        return None
    agent = (summary["spawn-agent"].get("spawn_arrival_seconds") or {}).get("median")
    alone = ((summary.get("spawn-alone") or {}).get("spawn_arrival_seconds") or {}).get("median")
    seen = [v for r in starts if r["condition"] == "spawn-agent" and (v := figure(r, "spawn_arrival_503")) is not None]
    return {"spawn_arrival_agent_over_alone": agent / alone if agent is not None and alone else None,
            "spawn_arrival_agent_minus_alone_seconds": agent - alone if agent is not None and alone else None,
            "spawn_arrival_503": max(seen) if seen else None}


def commit() -> str:
    """The agent's commit: BENCH_COMMIT, else git HEAD of its checkout, else its version."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        r = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=here, capture_output=True, text=True,
                           timeout=5)
    except (OSError, subprocess.SubprocessError):
        return f"warmup-agent {__version__}"
    return r.stdout.strip() if r.returncode == 0 else f"warmup-agent {__version__}"


def gpu_name() -> str | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 -- no NVML, no GPU: a CPU host
        return None


def provenance() -> dict[str, Any]:
    return {"machine": platform.node(), "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "gpu": gpu_name(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "version": __version__}


def result(head: dict[str, Any], starts: list[dict[str, Any]], conditions: list[str]) -> dict[str, Any]:
    """The whole JSON: `head` (tool, server, seed, status, ...), the figures, the starts."""
    summary = summarize(starts, conditions)
    out = {**head, "summary": summary, "ratios": ratios(summary), "headline": headline(summary),
           "definitions": dict(FIGURES + AGENT_FIGURES + SPAWN_FIGURES + HEADLINE), "starts": starts}
    if (arrival := spawn_arrival(summary, starts)) is not None:
        out["spawn_arrival"] = arrival
    return out


def dumps(res: dict[str, Any]) -> str:
    """One top-level key per line, values compact (bench/results' form: diffs stay readable)."""
    lines = [f"  {json.dumps(str(k))}: {json.dumps(v, separators=(',', ':'), default=str)}" for k, v in res.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write(path: str, res: dict[str, Any]) -> None:
    """Write atomically: an interrupt never leaves half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps(res))
    os.replace(tmp, path)
