"""`warmup-agent report` renders a PNG and a self-contained HTML page for a
recorded run of the real agent."""
from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.conftest import ROOT, run_agent
from warmup_agent import report

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
    r = subprocess.run([sys.executable, "-m", "warmup_agent.report", recorded_run, "--out", str(out)],
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
    r = subprocess.run([sys.executable, "-m", "warmup_agent.report", str(bad), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and str(bad) in r.stderr and expect in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_missing_record_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "warmup_agent.report", str(tmp_path / "nope.json")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "cannot read record" in r.stderr and "Traceback" not in r.stderr
