"""The README as a newcomer reads it: its commands work as written, its usage lines
match the command line, and every benchmark figure it quotes (it, or the docs its
measurement history moved to: docs/benchmarks.md, docs/servers.md) is in a committed
bench/results/*.json.

The slow test copies the working tree to a scratch directory (a fresh checkout,
without .venv), follows the README's own set-up there (`make run`, which makes
.venv) and runs every command of the "Two commands on a fresh machine" and
"Command line" sections in order.  The only environment it adds are documented
overrides: WARMUP_AGENT_EXPORTER_LISTEN (a free port instead of 9400, which other
tests on the machine may hold) and WARMUP_AGENT_DATA_DIR (a scratch directory
instead of ~/.cache/warmup-agent).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from tests.conftest import ROOT
from tests.helpers.servers import free_port, http_get

README = os.path.join(ROOT, "README.md")
QUICK_START = "Two commands on a fresh machine"
COMMAND_LINE = "Command line"
# Commands shown but not run here, each with the reason.
NOT_RUN = {"make test": "it is the test suite this test belongs to (CI runs it: .ci/run)"}


def readme_text() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def section(title: str) -> str:
    text = readme_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README has no section '## {title}'"
    return m.group(1)


def code_blocks(text: str) -> list[list[str]]:
    """Indented (4-space) code blocks, as lists of lines without the indent."""
    blocks, current = [], []
    prev_blank = True
    for line in text.splitlines():
        if line.startswith("    ") and (current or prev_blank):
            current.append(line[4:])
        else:
            if current:
                blocks.append(current)
                current = []
        prev_blank = not line.strip()
    if current:
        blocks.append(current)
    return blocks


def is_synopsis(block: list[str]) -> bool:
    return any("[" in line for line in block)


def commands(title: str) -> list[str]:
    """The runnable commands of a section: every line of its code blocks that are
    not usage synopses."""
    return [line.strip() for block in code_blocks(section(title)) if not is_synopsis(block)
            for line in block if line.strip()]


def prose(text: str) -> str:
    """The text outside code blocks (those hold example output, not figures)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("    "))


# -- fast checks ------------------------------------------------------------------------

def test_the_sections_hold_commands():
    quick, cli = commands(QUICK_START), commands(COMMAND_LINE)
    assert "make run" in quick and any(c.startswith(". .venv/bin/activate") for c in quick)
    assert any(c.startswith("warmup-agent report") for c in quick)
    assert len(cli) >= 5
    assert all(c.split()[0] in ("make", ".", "warmup-agent") for c in quick + cli), quick + cli


def _flags(parser) -> set[str]:
    import argparse
    out = set()
    for action in parser._actions:  # argparse has no public list of a parser's options
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flags(sub)
        else:
            out |= {o for o in action.option_strings if o.startswith("--") and o != "--help"}
    return out


def test_usage_lines_name_exactly_the_flags_the_cli_has():
    import argparse

    from warmup_agent.cli import build_parser
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    synopsis = next(b for b in code_blocks(section(COMMAND_LINE)) if is_synopsis(b))
    usage: dict[str, str] = {}
    name = None
    for line in synopsis:
        if line.startswith("warmup-agent "):
            name = line.split()[1]
            usage[name] = line
        else:
            usage[name] += " " + line  # a wrapped usage line
    assert set(usage) == set(subparsers) | {"--version"}, f"README usage lines: {sorted(usage)}"
    for name, sub in subparsers.items():
        shown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", usage[name]))
        assert shown == _flags(sub), f"`warmup-agent {name}`: README shows {sorted(shown)}, the CLI has {sorted(_flags(sub))}"


def _measured_ratios() -> list[float]:
    """Every ratio a committed benchmark result holds (keys naming a tax, an
    x-over-y, an overhead or a ratio; targets are not measurements)."""
    ratio_key = re.compile(r"tax|_over_|^over|overhead|ratio")
    values: list[float] = []

    def walk(o, key: str, path: str) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                # `warmup-agent bench`'s summary: {"first_ttft_tax": {"median": ..., "min": ...}}
                walk(v, key if k in ("median", "min", "max") else k, f"{path}.{k}")
        elif isinstance(o, list):
            for v in o:
                walk(v, key, path)
        elif isinstance(o, (int, float)) and not isinstance(o, bool):
            if ratio_key.search(key) and "target" not in path:
                values.append(float(o))
    for f in glob.glob(os.path.join(ROOT, "bench", "results", "**", "*.json"), recursive=True):  # bench.json in its folder too
        with open(f, encoding="utf-8") as fh:
            walk(json.load(fh), "", "")
    return values


# The measurement history moved out of the README (issue 42); its figures are checked where they went.
FIGURE_DOCS = ("README.md", "docs/benchmarks.md", "docs/servers.md")


def test_every_benchmark_figure_the_readme_quotes_is_in_a_results_file():
    measured = _measured_ratios()
    assert measured, "no ratios found in bench/results/*.json"
    pattern = r"(?<![\w.])(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?x\b"
    figures: dict[str, list] = {}
    for rel in FIGURE_DOCS:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            figures[rel] = re.findall(pattern, prose(f.read()))
    assert len(figures["README.md"]) >= 4, figures["README.md"]  # the introduction's at least
    assert len(figures["docs/benchmarks.md"]) >= 8, figures["docs/benchmarks.md"]  # the GPU figures at least
    missing = []
    for rel, found in figures.items():
        for lo, hi in found:
            for quoted in filter(None, (lo, hi)):
                decimals = len(quoted.partition(".")[2])
                if not any(round(v, decimals) == float(quoted) for v in measured):
                    missing.append(f"{rel}: {quoted}x (in {lo}{'-' + hi if hi else ''}x)")
    assert not missing, "figures no committed bench/results/*.json holds: " + ", ".join(missing)


def test_sections_other_files_point_to_exist():
    """A pointer to a README section in a comment (README, then the quoted heading)
    names a section a reader can find."""
    headings = set()
    for path in glob.glob(os.path.join(ROOT, "**", "README.md"), recursive=True):
        if "/." in os.path.relpath(path, ROOT):
            continue
        with open(path, encoding="utf-8") as f:
            headings |= set(re.findall(r"^#+ (.+?)\s*$", f.read(), re.M))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    dangling = []
    for rel in files:
        if rel.endswith((".png", ".json", ".tgz")) or not os.path.isfile(os.path.join(ROOT, rel)):
            continue
        try:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        for name in re.findall(r'README[,:]?\s+(?:section\s+)?"([^"]+)"', text):
            if name not in headings:
                dangling.append(f"{rel}: README section \"{name}\"")
    assert not dangling, "\n".join(dangling)


# -- the commands, run as written in a fresh set-up ---------------------------------------

def _copy_tree(dst: str) -> None:
    """The working tree as a fresh clone would have it (tracked and new files; no venvs)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src) and not os.path.islink(src):
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel))


def _agent_children(pid: int) -> list:
    import psutil
    try:
        return [p for p in psutil.Process(pid).children(recursive=True)
                if any("warmup-agent" in part for part in p.cmdline()[:2])]
    except psutil.Error:
        return []


def _make_run(repo: str, env: dict, port: int, log) -> int:
    """`make run` serves until Ctrl-C: wait for SERVING, then Ctrl-C the agent (SIGINT)
    and expect make to finish with 0."""
    proc = subprocess.Popen(["bash", "-c", "make run"], cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 1500  # a fresh .venv: torch, transformers, matplotlib
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if http_get(f"http://127.0.0.1:{port}/readyz", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert proc.poll() is None, f"make run exited with {proc.returncode} before SERVING"
        agents = _agent_children(proc.pid)
        assert agents, "no warmup-agent process under make run"
        for a in agents:
            a.send_signal(signal.SIGINT)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_every_readme_command_runs_as_written_in_a_fresh_setup(tmp_path):
    repo = tmp_path / "warmup-agent"
    _copy_tree(str(repo))
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WARMUP_AGENT_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    env.update(WARMUP_AGENT_EXPORTER_LISTEN=f"127.0.0.1:{port}", WARMUP_AGENT_DATA_DIR=str(tmp_path / "data"))
    prefix: list[str] = []  # lines that change the shell (activating the venv) carry over
    failures, ran = [], []
    log_path = tmp_path / "log"
    with open(log_path, "w") as log:
        for cmd in commands(QUICK_START) + commands(COMMAND_LINE):
            if cmd in NOT_RUN:
                continue
            log.write(f"\n$ {cmd}\n")
            log.flush()
            if cmd == "make run":
                rc = _make_run(str(repo), env, port, log)
            else:
                rc = subprocess.run(["bash", "-c", "\n".join(prefix + [cmd])], cwd=repo, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=900).returncode
            ran.append(cmd)
            if cmd.startswith((". ", "source ")):
                prefix.append(cmd)
            if rc != 0:
                failures.append(f"{cmd!r} exited {rc}" + (" (not found)" if rc == 127 else ""))
    tail = log_path.read_text()[-4000:]
    assert not failures, "\n".join(failures) + "\n--- log tail ---\n" + tail
    assert "make run" in ran and any(c.startswith("warmup-agent report") for c in ran)
    # the commands did what the README says they do
    assert (repo / ".venv" / "bin" / "warmup-agent").exists()
    assert (repo / "report" / "report.png").stat().st_size > 10_000
    record = json.loads((repo / "run.json").read_text())
    assert record["final_state"] == "SERVING"


def test_the_probe_counts_the_docs_give_are_the_configs_defaults():
    """README.md and docs/readiness.md name the gate's probe counts with their defaults
    in brackets, `readiness.min_probes` (10); each must be the default in config.KEYS
    (issue 72: the README said 10 where the openai engine needs 2, readiness.md 3)."""
    from warmup_agent import config
    defaults = {k.path: k.default for k in config.KEYS}
    found = 0
    for doc in ("README.md", "docs/readiness.md"):
        text = open(os.path.join(ROOT, doc)).read()
        for key, value in re.findall(r"`(readiness\.(?:min_probes\w*|probe_max_tokens))` \((\d+)", text):
            assert int(value) == defaults[key], f"{doc}: `{key}` ({value}), but its default is {defaults[key]}"
            found += 1
    assert found >= 3, "the docs no longer name the probe counts with their defaults"


def test_the_readme_is_a_guide_of_at_most_300_lines():
    """A user's guide (issue 72): what is longer belongs in docs/, linked from here."""
    assert len(readme_text().splitlines()) <= 300
