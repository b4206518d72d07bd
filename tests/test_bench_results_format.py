"""The committed benchmark results: written compactly, and read back as written.

The whole tracked tree travels to the device machine with the carried binaries under one
64 MiB limit; indented, bench/results took 11.8 MB and an H200 llama.cpp run could not
go. `bench.provenance.dumps_result` writes one top-level key per line and each value
without indentation (6.8 MB).
"""
from __future__ import annotations

import json
from pathlib import Path

from bench.provenance import dumps_result, write_result

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def test_a_result_reads_back_equal(tmp_path):
    result = {"benchmark": "x", "ratio": 0.1 + 0.2, "nested": {"runs": [{"a": 1e-9, "b": None}], "empty": {}},
              "words": "naïve – ünïcode", "list": [], "big": 2**63, 7: "an int key becomes a string, as json.dump does"}
    path = tmp_path / "sub" / "r.json"
    write_result(str(path), result)
    back = json.loads(path.read_text(encoding="utf-8"))
    expected = {str(k): v for k, v in result.items()}
    assert back == expected
    assert back["ratio"] == 0.1 + 0.2        # the float's exact repr, not a rounded one
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and len(lines) == len(result) + 2
    assert json.loads(dumps_result({})) == {}


def test_every_committed_result_is_compact():
    files = sorted(RESULTS.glob("*.json"))
    assert files, "no bench/results/*.json"
    loose = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        data = json.loads(text)
        if isinstance(data, dict) and text != dumps_result(data):
            loose.append(f.name)
    assert not loose, "written around bench.provenance.write_result (indented?): " + ", ".join(loose)
