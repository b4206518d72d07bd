"""`warmup-agent report`: a picture of one run from its record (`run --record FILE`).

    .venv/bin/python -m warmup_agent.report run.json --out report/
    -> report/report.png   stage timeline (Gantt) and probe latencies against the thresholds
    -> report/report.html  the same picture embedded, plus the numbers, in one self-contained file

Needs matplotlib (the `report` extra); the agent itself does not.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import json
import os
import sys

from warmup_agent.config import BY_PATH
from warmup_agent.readiness.window import nearest_rank

STAGE_COLOURS = {"ok": "#3b8f3b", "failed": "#c0392b", "running": "#e0a030", "skipped": "#999999"}
FIG_SIZE = (10.0, 6.0)   # inches
DPI = 100                # so the PNG is 1000 x 600 pixels


class ReportError(Exception):
    """A bad record or argument; str() is the one line to show."""


def load_record(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except OSError as e:
        raise ReportError(f"{path}: cannot read record: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not a JSON run record (line {e.lineno}: {e.msg})") from None
    if not isinstance(record, dict):
        raise ReportError(f"{path}: expected a JSON object written by `warmup-agent run --record`")
    for key, kind in (("stages", list), ("probes_seconds", list), ("final_state", str)):
        if not isinstance(record.get(key), kind):
            raise ReportError(f"{path}: key '{key}' missing or not a {kind.__name__}; "
                              "expected a record written by `warmup-agent run --record`")
    return record


def thresholds_of(record: dict, p50: float | None = None, p90: float | None = None) -> dict[str, float]:
    """Readiness thresholds: flags win, then the record, then the config defaults."""
    rec = record.get("readiness_thresholds_seconds") or {}
    return {
        "p50": p50 if p50 is not None else rec.get("p50", BY_PATH["readiness.p50_threshold_seconds"].default),
        "p90": p90 if p90 is not None else rec.get("p90", BY_PATH["readiness.p90_threshold_seconds"].default),
    }


def window_percentiles(probes: list[float]) -> dict[str, float]:
    """Exact nearest-rank percentiles over all probes, the agent's own definition."""
    vals = sorted(probes)
    return {f"p{round(q * 100)}": nearest_rank(vals, q) for q in (0.5, 0.9, 0.99)} if vals else {}


def render_png(record: dict, thresholds: dict[str, float]) -> bytes:
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on servers
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("warmup-agent report needs matplotlib: pip install 'warmup-agent[report]'") from None

    stages = record["stages"]
    probes = [p * 1000 for p in record["probes_seconds"]]
    fig, (gantt, lat) = plt.subplots(2, 1, figsize=FIG_SIZE, dpi=DPI, gridspec_kw={"height_ratios": [1, 1.3]})
    title = f"warmup-agent run: {record['final_state']}"
    if record.get("time_to_ready_seconds") is not None:
        title += f" in {record['time_to_ready_seconds']:.2f} s"
    fig.suptitle(title)

    # Stage timeline: one bar per stage from its start to its end.
    for i, s in enumerate(stages):
        start = s.get("start_seconds") or 0.0
        dur = s.get("duration_seconds") or 0.0
        gantt.barh(i, dur, left=start, color=STAGE_COLOURS.get(s.get("status"), "#4a6fa5"), edgecolor="black")
        gantt.text(start + dur, i, f" {dur:.3f} s", va="center", fontsize=8)
    for t in record.get("transitions", []):
        gantt.axvline(t["at_seconds"], color="grey", linestyle=":", linewidth=0.8)
        gantt.text(t["at_seconds"], -0.45, f" {t['state']}", rotation=90, fontsize=7, va="top", color="grey")
    gantt.set_yticks(range(len(stages)), [f"{s.get('phase', '')} {s['name']}" for s in stages])
    gantt.invert_yaxis()
    gantt.set_xlabel("seconds since agent start")
    gantt.set_title("Stage timeline", fontsize=10)

    # Probe latencies against the readiness thresholds.
    if probes:
        lat.plot(range(1, len(probes) + 1), probes, marker="o", markersize=3, linewidth=1, label="probe time to first token")
        lat.plot([1], [probes[0]], marker="o", markersize=7, color="#c0392b", linestyle="none", label="first probe")
    for name, colour in (("p50", "#e0a030"), ("p90", "#c0392b")):
        lat.axhline(thresholds[name] * 1000, color=colour, linestyle="--", label=f"{name} threshold {thresholds[name] * 1000:.0f} ms")
    for name, v in window_percentiles(record["probes_seconds"]).items():
        if name in ("p50", "p90"):
            lat.axhline(v * 1000, color="#4a6fa5", linestyle=":", linewidth=0.8)
            lat.text(len(probes) + 0.5, v * 1000, f" {name} {v * 1000:.1f} ms", fontsize=7, va="center")
    lat.set_yscale("log")  # thresholds are often 10-100x the probes: keep both readable
    lat.set_xlabel("probe")
    lat.set_ylabel("ms (log)")
    lat.set_title("Readiness probes against the thresholds", fontsize=10)
    lat.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def _fmt(v, unit="s") -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if unit == "ms" else f"{v:.3f} s"


def render_html(record: dict, thresholds: dict[str, float], png: bytes) -> str:
    e = html.escape
    pct = window_percentiles(record["probes_seconds"])
    rows = "".join(
        f"<tr><td>{e(str(s.get('phase', '')))}</td><td>{e(s['name'])}</td><td>{e(str(s.get('status', '')))}</td>"
        f"<td>{_fmt(s.get('start_seconds'))}</td><td>{_fmt(s.get('duration_seconds'))}</td></tr>"
        for s in record["stages"])
    probe_rows = "".join(
        f"<tr><td>{name}</td><td>{_fmt(pct.get(name), 'ms')}</td>"
        f"<td>{_fmt(thresholds.get(name), 'ms') if name in thresholds else '-'}</td></tr>"
        for name in ("p50", "p90", "p99"))
    tax = record.get("first_request_tax_ratio")
    facts = [("Final state", record["final_state"]),
             ("Time to ready", _fmt(record.get("time_to_ready_seconds"))),
             ("Engine", record.get("engine") or "-"),
             ("Model", record.get("model") or "-"),
             ("Warmup requests", record.get("warmup_requests", "-")),
             ("Probes", len(record["probes_seconds"])),
             ("First request", _fmt(record.get("first_request_seconds"), "ms")),
             ("Steady first token (median)", _fmt(record.get("steady_first_token_seconds"), "ms")),
             ("First-request tax", f"{tax:.2f}x" if tax else "-")]
    if record.get("failure_reason"):
        facts.append(("Failure", f"{record['failure_reason']}: {record.get('failure_message') or ''}"))
    fact_rows = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in facts)
    img = base64.b64encode(png).decode()
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>warmup-agent run report</title>
<style>body{{font-family:sans-serif;max-width:1040px;margin:1em auto}}table{{border-collapse:collapse;margin:.5em 0 1.5em}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}img{{max-width:100%}}</style></head>
<body>
<h1>warmup-agent run report</h1>
<table id="facts">{fact_rows}</table>
<img alt="stage timeline and probe latencies" src="data:image/png;base64,{img}">
<h2>Stages</h2>
<table id="stages"><tr><th>Phase</th><th>Stage</th><th>Status</th><th>Start</th><th>Duration</th></tr>{rows}</table>
<h2>Probe time to first token (exact, all probes)</h2>
<table id="probes"><tr><th>Percentile</th><th>Measured</th><th>Readiness threshold</th></tr>{probe_rows}</table>
</body></html>
"""


def write_report(record: dict, out_dir: str, thresholds: dict[str, float]) -> tuple[str, str]:
    png = render_png(record, thresholds)
    os.makedirs(out_dir, exist_ok=True)
    png_path, html_path = os.path.join(out_dir, "report.png"), os.path.join(out_dir, "report.html")
    with open(png_path, "wb") as f:
        f.write(png)
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_html(record, thresholds, png))
    return png_path, html_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("record", metavar="RECORD", help="JSON written by `warmup-agent run --record`")
    p.add_argument("--out", default="warmup-report", metavar="DIR", help="directory for report.png and report.html")
    p.add_argument("--p50-threshold", type=float, help="P50 readiness threshold in seconds (default: the record's, else 0.85)")
    p.add_argument("--p90-threshold", type=float, help="P90 readiness threshold in seconds (default: the record's, else 2.1)")


def run(args: argparse.Namespace) -> int:
    """Entry point for the CLI's `report` subcommand; returns the exit code."""
    try:
        record = load_record(args.record)
        png, page = write_report(record, args.out, thresholds_of(record, args.p50_threshold, args.p90_threshold))
    except ReportError as e:
        print(f"warmup-agent report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {png} and {page}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="warmup-agent report", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
