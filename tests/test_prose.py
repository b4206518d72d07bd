"""Prose that serves the reader: short config help, no machine names in the code, and
comments and docstrings in proportion to the code.

`python -m tests.test_prose` prints the comment-and-docstring ratio of warmup_agent/ and
exporter/ and the files furthest over it.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize

from tests.helpers.paths import ROOT_PATH as ROOT
from warmup_agent import config

PACKAGES = ("warmup_agent", "exporter")
MAX_HELP_CHARS = 300
#: Issue 59's goal (0.311 when this test came); lower it as files are rewritten, never raise it.
MAX_PROSE_RATIO = 0.2


def prose_and_code_lines(source: str) -> tuple[int, int]:
    """(comment or docstring lines, other non-blank lines) of a Python source.  A line
    holding code and a trailing comment counts as both."""
    tree = ast.parse(source)
    doc: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                doc.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    comments: set[int] = set()
    code: set[int] = set()
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in skip:
            code.update(ln for ln in range(tok.start[0], tok.end[0] + 1) if ln not in doc)
    return len(comments | doc), len(code)


def per_file() -> dict[str, tuple[int, int]]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[str(path.relative_to(ROOT))] = prose_and_code_lines(path.read_text(encoding="utf-8"))
    return out


def ratio() -> float:
    counts = per_file().values()
    return sum(p for p, _ in counts) / sum(c for _, c in counts)


def test_counting_tells_prose_from_code():
    source = '"""Module.\n\nMore."""\nx = 1  # why\n\n\ndef f():\n    """Doc."""\n    # a comment\n    return "not a docstring"\n'
    assert prose_and_code_lines(source) == (6, 3)


def test_comments_and_docstrings_stay_under_the_ceiling():
    assert ratio() <= MAX_PROSE_RATIO, (
        f"comment and docstring lines are {ratio():.3f} of the code lines (ceiling {MAX_PROSE_RATIO}): "
        "say what and why, and move measurements to docs/benchmarks.md")


def test_no_config_help_text_is_over_300_characters():
    long = {k.path: len(k.doc) for k in config.KEYS if len(k.doc) > MAX_HELP_CHARS}
    assert not long, f"help texts over {MAX_HELP_CHARS} characters (put the detail in docs/config.md's Details): {long}"


def test_the_code_names_no_machine():
    """Machine names, run numbers and result files belong in docs/benchmarks.md."""
    hits: dict[str, list[int]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*")):
            if path.suffix in (".py", ".md") and path.is_file():
                for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    if re.search(r"\bH[12]00\b", line):
                        hits.setdefault(str(path.relative_to(ROOT)), []).append(n)
    assert not hits, f"GPU names in the code (move the figure to docs/benchmarks.md): {hits}"


if __name__ == "__main__":
    rows = sorted(per_file().items(), key=lambda kv: kv[1][0] - 0.2 * kv[1][1], reverse=True)
    for name, (p, c) in rows[:30]:
        print(f"{p:5d} {c:5d} {p / max(c, 1):5.2f}  {name}")
    print(f"ratio {ratio():.3f}")
