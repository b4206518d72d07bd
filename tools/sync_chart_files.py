#!/usr/bin/env python3
"""Copy the committed alert rules and dashboards into the Helm chart's files/ directory,
and write the chart's server presets from warmup_agent/server/kinds.py.

Helm can only read files inside the chart, so the PrometheusRule and the dashboard
ConfigMaps are rendered from copies:

    alerts/*.rules.yaml, alerts/rules/*.yaml -> helm/warmup-agent/files/alerts/
    dashboards/*.json                         -> helm/warmup-agent/files/dashboards/

and the presets (server.preset) from the table of server kinds:

    KINDS' presets -> helm/warmup-agent/files/presets.yaml (read by _helpers.tpl),
                      the server.preset enum of values.schema.json,
                      the "Servers" table of the chart's README (between its markers)

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
CHART = ROOT / "helm" / "warmup-agent"
CHART_FILES = CHART / "files"
README_BEGIN = "<!-- presets: generated from warmup_agent/server/kinds.py by tools/sync_chart_files.py -->"
README_END = "<!-- end of presets -->"

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


def presets_yaml() -> bytes:
    """files/presets.yaml: each preset's command-line parts, default image and health path."""
    import yaml

    sys.path.insert(0, str(ROOT))
    from warmup_agent.server.kinds import KINDS

    out = {}
    for k in KINDS:
        if k.preset is None:
            continue
        p = k.preset
        out[k.name] = {"label": k.label, "executable": list(p.executable), "modelFlag": p.model_flag,
                       "hostFlag": p.host_flag, "portFlag": p.port_flag, "servedNameFlag": p.served_name_flag or "",
                       "healthPath": p.health_path, "image": p.image, "imageTag": p.image_tag,
                       "inAgentImage": p.in_agent_image, "givesModelPath": p.gives_model_path}
    head = ("# Generated from warmup_agent/server/kinds.py by tools/sync_chart_files.py (make regenerate):\n"
            "# do not edit. The server presets that _helpers.tpl looks up by server.preset.\n")
    return (head + yaml.safe_dump(out, sort_keys=False, default_flow_style=None, width=200)).encode()


def _preset_rows(chart: Path) -> str:
    import yaml

    from warmup_agent.server.kinds import KINDS

    default_preset = yaml.safe_load((chart / "values.yaml").read_text(encoding="utf-8"))["server"]["preset"]

    rows = ["| `server.preset` | Command line | Served-model-name flag | Health path |", "| --- | --- | --- | --- |"]
    for k in KINDS:
        if k.preset is None:
            continue
        p = k.preset
        cmd = " ".join([*p.executable, *([p.model_flag] if p.model_flag else []),
                        p.model_example, p.host_flag, "0.0.0.0", p.port_flag, "PORT"])
        flag = (f"`{p.served_name_flag}`" if p.served_name_flag else
                "none: it serves the model under `server.model` (`servedModelName` must stay empty)")
        default = " (default)" if k.name == default_preset else ""
        rows.append(f"| `{k.name}`{default} | `{cmd}` | {flag} | `{p.health_path}` |")
    rows.append("| `custom` | `server.command` then `server.args` (lists, required command) | put it in "
                "`server.args` and set `servedModelName` for the agent | `server.healthPath` (default `/health`) |")
    return "\n".join(rows)


def generated_presets(chart: Path = CHART) -> dict[Path, bytes]:
    """Chart path -> the content the presets give it: files/presets.yaml, the schema with
    the enum of server.preset, the README with its "Servers" table."""
    import json

    sys.path.insert(0, str(ROOT))
    from warmup_agent.server.kinds import PRESETS

    out = {Path("files/presets.yaml"): presets_yaml()}
    schema_text = (chart / "values.schema.json").read_text(encoding="utf-8")
    schema = json.loads(schema_text)
    schema["properties"]["server"]["properties"]["preset"]["enum"] = [*PRESETS, "custom"]
    out[Path("values.schema.json")] = (json.dumps(schema, indent=2, ensure_ascii=False) + "\n").encode()
    readme = (chart / "README.md").read_text(encoding="utf-8")
    a, b = readme.find(README_BEGIN), readme.find(README_END)
    if a < 0 or b < a:
        sys.exit(f"sync_chart_files: {chart / 'README.md'} lacks the markers {README_BEGIN} ... {README_END}")
    readme = readme[:a + len(README_BEGIN)] + "\n" + _preset_rows(chart) + "\n" + readme[b:]
    out[Path("README.md")] = readme.encode()
    return out


def preset_differences(chart: Path = CHART) -> list[str]:
    """One line per chart file that the presets of warmup_agent/server/kinds.py would change."""
    return [f"not generated from warmup_agent/server/kinds.py: {p}" for p, data in generated_presets(chart).items()
            if not (chart / p).is_file() or (chart / p).read_bytes() != data]


def sync_presets(chart: Path = CHART) -> list[str]:
    changed = []
    for p, data in generated_presets(chart).items():
        if not (chart / p).is_file() or (chart / p).read_bytes() != data:
            (chart / p).parent.mkdir(parents=True, exist_ok=True)
            (chart / p).write_bytes(data)
            changed.append(f"wrote {p}")
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the copies are stale")
    args = ap.parse_args(argv)
    if args.check:
        diffs = differences() + preset_differences()
        for line in diffs:
            print(f"sync_chart_files: {line}", file=sys.stderr)
        if diffs:
            print("sync_chart_files: run `python tools/sync_chart_files.py` and commit helm/warmup-agent/",
                  file=sys.stderr)
            return 1
        print("sync_chart_files: chart files match alerts/, dashboards/ and the server kinds")
        return 0
    for line in sync() + sync_presets():
        print(f"sync_chart_files: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
