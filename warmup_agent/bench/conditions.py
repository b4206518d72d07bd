"""The bench's loop: N starts per condition, alternating (start i puts each
condition first in turn), the JSON rewritten after every start so an interrupt
or a failure keeps what was measured."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from warmup_agent.bench import report, summary
from warmup_agent.bench.start import Setup, StartFailed, StartInterrupted, run_start
from warmup_agent.bench.traffic import Traffic
from warmup_agent.run.progress import Progress


@dataclass
class Outcome:
    status: str                 # "complete", "failed" or "interrupted"
    error: str | None
    result: dict[str, Any]
    files: list[str] = field(default_factory=list)


def order(conditions: list[str], starts: int) -> list[tuple[str, int]]:
    """(condition, start index) in run order: each condition goes first in turn."""
    out = []
    for i in range(starts):
        k = i % len(conditions)
        out += [(c, i) for c in conditions[k:] + conditions[:k]]
    return out


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt    # the bench itself told to stop: the same clean stop as Ctrl-C


def _line(rec: dict[str, Any]) -> str:
    first = rec.get("first") or {}
    return (f"{rec['condition']} start {rec['start']}: ready {rec['ready_seconds']:.2f} s, first ttft "
            f"{first.get('ttft_seconds', 0) * 1000:.1f} ms (tax {rec.get('first_ttft_tax', 0):.2f}, warm control "
            f"{rec.get('warm_control_ttft_ratio', 0):.2f}), "
            f"whole answer tax {rec.get('first_total_tax', 0):.2f}, new length in range "
            f"{_x(rec.get('new_length_after_background_ttft_tax'))}, exit {rec['sigterm']['exit_seconds']:.2f} s, "
            f"orphans {rec['sigterm']['orphans']}" + (_agent_line(rec) if rec["condition"] == "agent" else ""))


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _agent_line(rec: dict[str, Any]) -> str:
    behind = f"{_x(rec.get('behind_users_seconds'))} s" if rec.get("behind_users_finished") else "not finished"
    return (f"; users' tax as exported {_x(rec.get('agent_exported_ttft_tax'))} (over measured "
            f"{_x(rec.get('exported_over_measured_ttft_tax'))}, predicted over measured "
            f"{_x(rec.get('predicted_over_measured_ttft_tax'))}), warm-up behind the users {behind} (requests "
            f"sent beside it {_x(rec.get('background_user_ttft_over_steady'))}x those after it), budget overspend "
            f"{_x(rec.get('warmup_budget_overspend_ratio'))}")


def run(setup: Setup, traffic: Traffic, conditions: list[str], starts: int, out_dir: str,
        head: dict[str, Any], progress: Progress) -> Outcome:
    """Every start in order; stops at the first failure or interrupt.  Writes
    out_dir/bench.json after each start and the report at the end."""
    plan = order(conditions, starts)
    done: list[dict[str, Any]] = []
    json_path = os.path.join(out_dir, "bench.json")
    status, error = "complete", None
    previous = signal.signal(signal.SIGTERM, _sigterm)
    progress.stage_started(1, 1, f"bench: {len(plan)} starts")
    t0 = time.monotonic()
    try:
        for n, (cond, i) in enumerate(plan):
            progress.step(n, len(plan), f"{cond} start {i + 1}")
            try:
                rec = run_start(setup, traffic, cond, i)
            except StartFailed as e:
                done.append({**e.record, "error": str(e)})
                status, error = "failed", str(e)
                break
            done.append(rec)
            progress.clear()
            progress.stream.write(_line(rec) + "\n")
            progress.redraw()
            summary.write(json_path, _result(head, done, conditions, "running", None))
        else:
            progress.step(len(plan), len(plan), "done")
    except KeyboardInterrupt as e:
        if isinstance(e, StartInterrupted):
            done.append({**e.record, "error": "interrupted"})
        status = "interrupted"
        finished = sum(1 for r in done if "error" not in r)
        error = f"interrupted after {finished} of {len(plan)} starts; the server was stopped"
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.stage_finished("bench", time.monotonic() - t0, ok=status == "complete")
    res = _result(head, done, conditions, status, error)
    summary.write(json_path, res)
    files = [json_path, *report.write_report(res, out_dir)]
    return Outcome(status, error, res, files)


def _result(head: dict[str, Any], done: list[dict[str, Any]], conditions: list[str], status: str,
            error: str | None) -> dict[str, Any]:
    counts = {c: sum(1 for r in done if r["condition"] == c and "error" not in r) for c in conditions}
    return summary.result({**head, "status": status, "error": error, "starts_done": counts}, done, conditions)
