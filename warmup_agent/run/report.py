"""`warmup-agent report`: a picture of one run from its record (`run --record FILE`).

Writes report.png (stage timeline and probe latencies) and a self-contained report.html.
Needs the `report` extra (matplotlib).
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import json
import os
import sys
from typing import Any

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


def timeline(record: dict) -> list[dict]:
    """The record's stages, after a "startup" bar where the record has one."""
    stages = list(record["stages"])
    if record.get("startup_seconds") is not None:
        stages.insert(0, {"name": "startup", "phase": 0, "start_seconds": 0.0,
                          "duration_seconds": record["startup_seconds"], "status": "ok"})
    return stages


def _duration_label(ax: Any, row: int, start: float, dur: float, xmax: float) -> None:
    """Place a stage's duration label after its bar, or inside or before it near the right edge."""
    text = f"{dur:.3f} s"
    end = start + dur
    room = 0.13 * xmax  # what "100.000 s" takes at 8 pt on this axis width, with a margin
    if end + room <= xmax:
        ax.text(end + 0.01 * xmax, row, text, va="center", ha="left", fontsize=8)
    elif dur >= room:
        ax.text(end - 0.01 * xmax, row, text, va="center", ha="right", fontsize=8, color="white")
    else:
        ax.text(start - 0.01 * xmax, row, text, va="center", ha="right", fontsize=8)


def build_figure(record: dict, thresholds: dict[str, float]) -> Any:
    """The figure: the stage timeline above, probes against thresholds below, no label overlapping."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # no display on servers
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        raise ReportError("warmup-agent report needs matplotlib: pip install 'warmup-agent[report]'") from None

    stages = timeline(record)
    probes = [p * 1000 for p in record["probes_seconds"]]
    fig = Figure(figsize=FIG_SIZE, dpi=DPI)  # not pyplot: no global figure state to leak
    FigureCanvasAgg(fig)
    gantt, lat = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1, 1.3]})
    title = f"warmup-agent run: {record['final_state']}"
    if record.get("time_to_ready_seconds") is not None:
        title += f" in {record['time_to_ready_seconds']:.2f} s"
    fig.suptitle(title)

    # State changes are unlabelled dotted lines: they fall within milliseconds of each other.
    xmax = max([(s.get("start_seconds") or 0.0) + (s.get("duration_seconds") or 0.0) for s in stages] + [1e-3])
    for i, s in enumerate(stages):
        start = s.get("start_seconds") or 0.0
        dur = s.get("duration_seconds") or 0.0
        gantt.barh(i, dur, left=start, color=STAGE_COLOURS.get(s.get("status") or "", "#4a6fa5"), edgecolor="black")
        _duration_label(gantt, i, start, dur, xmax)
    for t in record.get("transitions", []):
        gantt.axvline(t["at_seconds"], color="grey", linestyle=":", linewidth=0.8)
    gantt.set_xlim(0, xmax * 1.02)
    gantt.set_ylim(len(stages) - 0.5, -0.5)  # first stage on top
    gantt.set_yticks(range(len(stages)), [f"{s.get('phase', '')} {s['name']}" for s in stages])
    gantt.set_xlabel("seconds since process start" if record.get("startup_seconds") is not None
                     else "seconds since agent start")
    gantt.set_title("Stage timeline (dotted: state changes)", fontsize=10)

    # The legend sits outside the plot so it covers no line.
    if probes:
        lat.plot(range(1, len(probes) + 1), probes, marker="o", markersize=3, linewidth=1, label="probe time to first token")
        lat.plot([1], [probes[0]], marker="o", markersize=7, color="#c0392b", linestyle="none", label="first probe")
    for name, colour in (("p50", "#e0a030"), ("p90", "#c0392b")):
        lat.axhline(thresholds[name] * 1000, color=colour, linestyle="--",
                    label=f"{name} threshold {thresholds[name] * 1000:.0f} ms")
    measured = window_percentiles(record["probes_seconds"])
    for name, style in (("p50", ":"), ("p90", "-.")):
        if name in measured:
            lat.axhline(measured[name] * 1000, color="#4a6fa5", linestyle=style, linewidth=1,
                        label=f"measured {name} {_ms(measured[name])}")
    lat.set_yscale("log")  # thresholds are often 10-100x the probes: keep both readable
    values = probes + [thresholds[n] * 1000 for n in ("p50", "p90")]
    lat.set_ylim(min(values) / 2, max(values) * 2)
    lat.set_xlim(0.5, max(len(probes), 1) + 0.5)
    lat.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _ms(v / 1000, "g")))
    lat.yaxis.set_minor_formatter(NullFormatter())  # minor labels crowd a decade
    lat.set_xlabel("probe")
    lat.set_ylabel("time to first token (log)")
    lat.set_title("Readiness probes against the thresholds", fontsize=10)
    lat.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    fig.tight_layout()
    return fig


def _ms(seconds: float, spec: str = ".1f") -> str:
    ms = seconds * 1000
    return f"{ms:{spec}} ms" if ms < 1000 else f"{ms / 1000:{'.2f' if spec == '.1f' else spec}} s"


def render_png(record: dict, thresholds: dict[str, float]) -> bytes:
    fig = build_figure(record, thresholds)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _fmt(v: Any, unit: Any = "s") -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if unit == "ms" else f"{v:.3f} s"


def render_html(record: dict, thresholds: dict[str, float], png: bytes) -> str:
    e = html.escape
    pct = window_percentiles(record["probes_seconds"])
    rows = "".join(
        f"<tr><td>{e(str(s.get('phase', '')))}</td><td>{e(s['name'])}</td><td>{e(str(s.get('status', '')))}</td>"
        f"<td>{_fmt(s.get('start_seconds'))}</td><td>{_fmt(s.get('duration_seconds'))}</td></tr>"
        for s in timeline(record))
    transition_rows = "".join(f"<tr><td>{e(str(t.get('state')))}</td><td>{_fmt(t.get('at_seconds'))}</td></tr>"
                              for t in record.get("transitions", []))
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
<h2>State changes</h2>
<table id="transitions"><tr><th>State</th><th>At</th></tr>{transition_rows}</table>
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


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(prog="warmup-agent report", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
