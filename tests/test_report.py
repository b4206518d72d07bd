"""`warmup-agent report` renders a PNG and a self-contained HTML page for a
recorded run of the real agent."""
from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.conftest import ROOT, run_agent
from warmup_agent.run import report

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, data_dir):
    path = tmp_path_factory.mktemp("rec") / "run.json"
    r = run_agent("run", "--once", "--no-progress", "--listen", "127.0.0.1:0", "--data-dir", data_dir,
                  "--record", str(path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return str(path)


def test_report_renders_png_and_html(recorded_run, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "warmup_agent.run.report", recorded_run, "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    with Image.open(out / "report.png") as img:
        assert img.format == "PNG"
        assert img.size == (int(report.FIG_SIZE[0] * report.DPI), int(report.FIG_SIZE[1] * report.DPI))
    page = (out / "report.html").read_text(encoding="utf-8")
    # self-contained: the picture is inline and nothing is fetched from elsewhere
    assert not re.search(r'(src|href)="(?!data:)', page)
    inline = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(inline) == (out / "report.png").read_bytes()

    record = json.loads(open(recorded_run).read())
    stages = re.search(r'<table id="stages">(.*?)</table>', page, re.S).group(1)
    for s in record["stages"]:
        assert f"<td>{s['name']}</td>" in stages
        assert f"{s['duration_seconds']:.3f} s" in stages
    # the page's percentiles are exact over the recorded probes (numpy's inverted_cdf
    # is the same nearest-rank definition, computed independently)
    probes = re.search(r'<table id="probes">(.*?)</table>', page, re.S).group(1)
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        exact = np.percentile(record["probes_seconds"], q, method="inverted_cdf")
        assert f"<td>{name}</td><td>{exact * 1000:.1f} ms</td>" in probes
    assert "<td>850.0 ms</td>" in probes and "<td>2100.0 ms</td>" in probes  # default thresholds
    assert f"<td>{record['final_state']}</td>" in page


def test_thresholds_from_flags_win(recorded_run, tmp_path):
    assert report.main([recorded_run, "--out", str(tmp_path), "--p50-threshold", "0.5", "--p90-threshold", "1.0"]) == 0
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<td>500.0 ms</td>" in page and "<td>1000.0 ms</td>" in page


@pytest.mark.parametrize("content, expect", [
    ("{not json", "not a JSON run record"),
    ('{"stages": [], "final_state": "SERVING"}', "key 'probes_seconds' missing"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_record_is_one_clear_line(tmp_path, content, expect):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = subprocess.run([sys.executable, "-m", "warmup_agent.run.report", str(bad), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and str(bad) in r.stderr and expect in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_missing_record_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "warmup_agent.run.report", str(tmp_path / "nope.json")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "cannot read record" in r.stderr and "Traceback" not in r.stderr


# -- readability: measured with matplotlib's own text bounding boxes -------------------

def drawn_texts(fig) -> list:
    """Every text the renderer draws: titles, axis labels, tick labels inside the
    view, annotations, legend entries."""
    texts = list(fig.texts)
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts,
                  ax.xaxis.get_offset_text(), ax.yaxis.get_offset_text()]
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if lo <= tick.get_loc() <= hi:
                    texts += [tick.label1, tick.label2]
        legend = ax.get_legend()
        if legend is not None:
            texts += legend.get_texts() + [legend.get_title()]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def overlap_problems(fig) -> list[str]:
    """Pairs of labels whose boxes intersect, and labels outside the picture."""
    from matplotlib.transforms import Bbox
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in drawn_texts(fig)]
    problems = []
    page = Bbox.from_bounds(0, 0, fig.bbox.width, fig.bbox.height)
    for text, box in boxes:
        if not (box.x0 >= page.x0 and box.y0 >= page.y0 and box.x1 <= page.x1 and box.y1 <= page.y1):
            problems.append(f"cut off at the edge: {text!r} {box.bounds}")
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1:]:
            inter = Bbox.intersection(ba, bb)
            if inter is not None and inter.width > 0.5 and inter.height > 0.5:
                problems.append(f"overlap: {a!r} and {b!r}")
    # the stage durations stay inside the timeline's axes
    gantt = fig.axes[0]
    for t in gantt.texts:
        box = t.get_window_extent(renderer)
        if box.x0 < gantt.bbox.x0 or box.x1 > gantt.bbox.x1:
            problems.append(f"outside the timeline: {t.get_text()!r}")
    # the legend is outside the plot, so it covers no threshold line, and readable
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            inter = Bbox.intersection(legend.get_window_extent(renderer), ax.bbox)
            if inter is not None and inter.width > 0 and inter.height > 0:
                problems.append("the legend covers the plot")
            if min(t.get_fontsize() for t in legend.get_texts()) < 8:
                problems.append("legend text under 8 pt")
    return problems


def synthetic_record(durations: list[float], probes: list[float], startup: float | None = None) -> dict:
    stages, t = [], startup or 0.0
    transitions = [{"state": "INIT", "at_seconds": t}]
    for i, (name, d) in enumerate(zip(("reserve", "prewarm", "solidify", "ready"), durations, strict=True)):
        stages.append({"name": name, "phase": i + 1, "start_seconds": t, "end_seconds": t + d,
                       "duration_seconds": d, "status": "ok"})
        t += d
        transitions.append({"state": ("PRELOAD", "PRIME", "PRIME", "SERVING")[i], "at_seconds": t})
    return {"stages": stages, "startup_seconds": startup, "probes_seconds": probes, "final_state": "SERVING",
            "time_to_ready_seconds": t, "transitions": transitions}


EXTREMES = {
    "short stages first, one long": ([0.01, 0.013, 0.02, 100.0], [0.001, 0.0043, 0.0039, 10.0, 0.002] * 4, None),
    "long stages first, short last": ([100.0, 50.0, 0.01, 0.01], [10.0, 0.001] + [0.0039, 0.0043] * 50, 0.01),
    "all tiny, close p50/p90": ([0.01, 0.011, 0.012, 0.013], [0.0039, 0.0043, 0.0041, 0.0040] * 50, 4.6),
    "startup dominates": ([0.002, 1.0, 1.27, 0.46], [0.0184, 0.0057, 0.027, 0.018, 0.039, 0.012], 100.0),
    "one probe": ([0.5, 0.5, 0.5, 0.5], [10.0], None),
}


@pytest.mark.parametrize("case", list(EXTREMES))
def test_labels_never_overlap_nor_leave_the_picture(case):
    durations, probes, startup = EXTREMES[case]
    record = synthetic_record(durations, probes, startup)
    fig = report.build_figure(record, {"p50": 0.85, "p90": 2.1})
    problems = overlap_problems(fig)
    assert not problems, "\n".join(problems)
    # the check sees the labels that matter (a checker that sees nothing passes everything)
    texts = {t.get_text() for t in drawn_texts(fig)}
    assert {f"{d:.3f} s" for d in durations} <= texts
    assert "p50 threshold 850 ms" in texts and "p90 threshold 2100 ms" in texts


def test_the_checker_finds_overlaps():
    """The seed's old layout (rotated state names on the timeline, percentile text at
    the right edge) fails the check: the test can fail."""
    record = synthetic_record([0.01, 0.013, 0.02, 100.0], [0.0039, 0.0043] * 20)
    fig = report.build_figure(record, {"p50": 0.85, "p90": 2.1})
    gantt, lat = fig.axes
    for t in record["transitions"]:
        gantt.text(t["at_seconds"], -0.45, f" {t['state']}", rotation=90, fontsize=7, va="top")
    lat.text(20, 3.9, " p50 3.9 ms", fontsize=7, va="center")
    lat.text(20, 4.3, " p90 4.3 ms", fontsize=7, va="center")
    fig.text(0.995, 0.5, "p90 4.3 ms")  # runs off the right edge
    problems = overlap_problems(fig)
    assert any(p.startswith("overlap") for p in problems), problems
    assert any(p.startswith("cut off") for p in problems), problems


def test_recorded_run_png_passes_the_check(recorded_run, tmp_path):
    record = json.loads(open(recorded_run).read())
    assert record["startup_seconds"] > 0  # the CLI's run starts at process start
    fig = report.build_figure(record, report.thresholds_of(record))
    assert not overlap_problems(fig)
    png = report.render_png(record, report.thresholds_of(record))
    with Image.open(io.BytesIO(png)) as img:  # the PNG is the figure the check measured
        assert img.size == (int(fig.bbox.width), int(fig.bbox.height))
