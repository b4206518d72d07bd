"""What the bench shows: the terminal table, and an HTML page with a PNG in the
style of `warmup-agent report` (each condition's medians and spread, the ratios
of oneshot and agent to alone).  The PNG needs matplotlib (the `report` extra)."""
from __future__ import annotations

import base64
import html
import io
import os
from typing import Any

from warmup_agent.bench.summary import AGENT_FIGURES, FIGURES, HEADLINE, RATIO_FIGURES, figure

COLOURS = {"alone": "#999999", "oneshot": "#e0a030", "agent": "#3b8f3b"}
FIG_SIZE = (10.0, 5.0)
DPI = 100
TABLE_FIGURES = ("ready_seconds", "first_ttft_seconds", "steady_ttft_seconds", "first_ttft_tax",
                 "warm_control_ttft_ratio", "first_total_tax", "new_length_ttft_ratio",
                 "new_length_after_background_ttft_tax", "burst_ttft_over_steady", "sigterm_exit_seconds", "orphans",
                 "agent_exported_ttft_tax", "exported_over_measured_ttft_tax", "predicted_over_measured_ttft_tax",
                 "behind_users_seconds", "background_user_ttft_over_steady", "steady_after_background_ttft_seconds",
                 "warmup_budget_overspend_ratio")


def _value(key: str, v: float | None) -> str:
    if v is None:
        return "-"
    if key == "orphans":
        return f"{v:.0f}"
    if key.endswith("_seconds"):
        return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"
    return f"{v:.2f}x"


def _cell(stats: dict[str, Any] | None, key: str) -> str:
    if not stats:
        return "-"
    text = _value(key, stats["median"])
    return text if stats["n"] < 2 else f"{text} ({_value(key, stats['min'])}-{_value(key, stats['max'])})"


def table(res: dict[str, Any]) -> str:
    """The terminal summary: one row per figure, one column per condition
    (median, then min-max), then the ratios to alone."""
    conds = list(res["summary"])
    rows = [["figure", *[f"{c} (n={res['starts_done'].get(c, 0)})" for c in conds]]]
    for key in TABLE_FIGURES:
        rows.append([key, *[_cell(res["summary"][c].get(key), key) for c in conds]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for name, figs in res["ratios"].items():
        shown = ", ".join(f"{k.removesuffix('_seconds')} {v:.2f}" for k, v in figs.items() if v is not None)
        lines.append(f"{name}: {shown or '-'}")
    for name, v in (res.get("headline") or {}).items():
        lines.append(f"{name}: {'-' if v is None else f'{v:.2f}'}")
    return "\n".join(lines)


def build_figure(res: dict[str, Any]) -> Any:
    """Ready time and first-request taxes per condition: a bar at the median, a
    line over the spread, every start as a dot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIG_SIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    panels = (("ready_seconds", "time to ready (s)"), ("first_ttft_tax", "first TTFT / steady"),
              ("first_total_tax", "first answer / steady"))
    axes = fig.subplots(1, len(panels))
    conds = list(res["summary"])
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, cond in enumerate(conds):
            stats = res["summary"][cond].get(key)
            if not stats:
                continue
            ax.bar(i, stats["median"], color=COLOURS.get(cond, "#4a6fa5"), edgecolor="black")
            ax.vlines(i, stats["min"], stats["max"], color="black", linewidth=1.5)
            dots = [r for r in res["starts"] if r["condition"] == cond]
            ys = [v for r in dots if (v := figure(r, key)) is not None]
            ax.plot([i] * len(ys), ys, "o", color="black", markersize=3)
        if key.endswith("_tax"):
            ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(conds)), conds)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"warmup-agent bench: {res.get('server') or 'server'}, {max(res['starts_done'].values(), default=0)} "
                 f"start(s) per condition (bar: median, line: spread, dots: starts)", fontsize=11)
    fig.tight_layout()
    return fig


def render_png(res: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    build_figure(res).savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def render_html(res: dict[str, Any], png: bytes | None) -> str:
    e = html.escape
    conds = list(res["summary"])
    head = "".join(f"<th>{e(c)}</th>" for c in conds)
    rows = "".join(f"<tr><th title=\"{e(doc)}\">{e(key)}</th>"
                   + "".join(f"<td>{e(_cell(res['summary'][c].get(key), key))}</td>" for c in conds) + "</tr>"
                   for key, doc in FIGURES + AGENT_FIGURES)
    ratio_head = "".join(f"<th>{e(k)}</th>" for k in RATIO_FIGURES)
    ratio_rows = "".join(f"<tr><th>{e(name)}</th>" + "".join(
        f"<td>{'-' if figs.get(k) is None else f'{figs[k]:.2f}'}</td>" for k in RATIO_FIGURES) + "</tr>"
        for name, figs in res["ratios"].items())
    head_rows = "".join(f"<tr><th title=\"{e(doc)}\">{e(name)}</th><td>"
                        f"{'-' if (v := (res.get('headline') or {}).get(name)) is None else f'{v:.2f}'}</td></tr>"
                        for name, doc in HEADLINE)
    facts = [("Server", res.get("server")), ("Command", " ".join(res.get("server_command") or [])),
             ("Status", res.get("status")), ("Error", res.get("error") or "-"), ("Seed", res.get("seed")),
             ("Machine", res.get("machine")), ("GPU", res.get("gpu") or "-"), ("Date", res.get("date")),
             ("Commit", res.get("commit"))]
    fact_rows = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in facts)
    img = (f'<img alt="ready time and first-request taxes per condition" '
           f'src="data:image/png;base64,{base64.b64encode(png).decode()}">' if png else
           "<p>(no picture: matplotlib is not installed)</p>")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>warmup-agent bench report</title>
<style>body{{font-family:sans-serif;max-width:1040px;margin:1em auto}}table{{border-collapse:collapse;margin:.5em 0 1.5em}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}img{{max-width:100%}}</style></head>
<body>
<h1>warmup-agent bench report</h1>
<table id="facts">{fact_rows}</table>
{img}
<h2>Per condition: median (min-max) over the starts</h2>
<table id="summary"><tr><th>Figure</th>{head}</tr>{rows}</table>
<h2>Ratios of medians to alone</h2>
<table id="ratios"><tr><th></th>{ratio_head}</tr>{ratio_rows}</table>
<h2>Over the run</h2>
<table id="headline">{head_rows}</table>
</body></html>
"""


def write_report(res: dict[str, Any], out_dir: str) -> list[str]:
    """report.html always; report.png where matplotlib is installed.  The paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    png: bytes | None = None
    try:
        png = render_png(res)
    except ImportError:
        png = None
    if png is not None:
        path = os.path.join(out_dir, "report.png")
        with open(path, "wb") as f:
            f.write(png)
        written.append(path)
    path = os.path.join(out_dir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(res, png))
    return [path, *written]
