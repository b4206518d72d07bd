#!/usr/bin/env python3
"""Copy the committed alert rules and dashboards into the Helm chart's files/ directory.

Helm can only read files inside the chart, so the PrometheusRule and the dashboard
ConfigMaps are rendered from copies:

    alerts/*.rules.yaml, alerts/rules/*.yaml -> helm/warmup-agent/files/alerts/
    dashboards/*.json                         -> helm/warmup-agent/files/dashboards/

The copies are committed (so `helm package` and a chart checkout work alone), and never
edited by hand: run this after changing alerts/ or dashboards/.  Copies whose source is
gone are removed.  `--check` changes nothing and exits 1, naming each stale file, when
the copies differ from their sources (CI runs it).

Usage: python tools/sync_chart_files.py [--check]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART_FILES = ROOT / "helm" / "warmup-agent" / "files"

# destination subdirectory -> source globs (relative to the repository root)
SOURCES: dict[str, tuple[str, ...]] = {
    "alerts": ("alerts/*.rules.yaml", "alerts/rules/*.yaml"),
    "dashboards": ("dashboards/*.json",),
}


def wanted(root: Path = ROOT) -> dict[Path, bytes]:
    """Destination path (relative to files/) -> content it must have."""
    out: dict[Path, bytes] = {}
    for sub, globs in SOURCES.items():
        for pattern in globs:
            for src in sorted(root.glob(pattern)):
                dest = Path(sub) / src.name
                if dest in out:
                    sys.exit(f"sync_chart_files: two sources map to files/{dest}; rename one of them ({src})")
                out[dest] = src.read_bytes()
    return out


def present(files_dir: Path) -> dict[Path, bytes]:
    out: dict[Path, bytes] = {}
    for sub in SOURCES:
        d = files_dir / sub
        if d.is_dir():
            for f in sorted(d.iterdir()):
                if f.is_file():
                    out[Path(sub) / f.name] = f.read_bytes()
    return out


def differences(root: Path = ROOT, files_dir: Path = CHART_FILES) -> list[str]:
    """One line per copy that is missing, stale or has no source any more."""
    want, have = wanted(root), present(files_dir)
    lines = []
    for p in sorted(set(want) | set(have)):
        if p not in have:
            lines.append(f"missing: files/{p}")
        elif p not in want:
            lines.append(f"no source any more: files/{p}")
        elif want[p] != have[p]:
            lines.append(f"differs from its source: files/{p}")
    return lines


def sync(root: Path = ROOT, files_dir: Path = CHART_FILES) -> list[str]:
    want, have = wanted(root), present(files_dir)
    changed = []
    for p, data in want.items():
        if have.get(p) != data:
            (files_dir / p).parent.mkdir(parents=True, exist_ok=True)
            (files_dir / p).write_bytes(data)
            changed.append(f"wrote files/{p}")
    for p in set(have) - set(want):
        (files_dir / p).unlink()
        changed.append(f"removed files/{p}")
    return sorted(changed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the copies are stale")
    args = ap.parse_args(argv)
    if args.check:
        diffs = differences()
        for line in diffs:
            print(f"sync_chart_files: {line}", file=sys.stderr)
        if diffs:
            print("sync_chart_files: run `python tools/sync_chart_files.py` and commit helm/warmup-agent/files/",
                  file=sys.stderr)
            return 1
        print("sync_chart_files: chart files match alerts/ and dashboards/")
        return 0
    for line in sync():
        print(f"sync_chart_files: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
