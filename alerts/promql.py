"""Find the metric names a PromQL expression reads, without a PromQL parser.

Used by the tests to check every name in dashboards and alert rules against the
catalogue, independently of how the generators built the expressions.  Enough
of PromQL for our expressions: strings, label matchers, ranges, grouping
clauses and template variables are removed, then every identifier that is not
a function call or a keyword is a metric name.
"""
from __future__ import annotations

import re

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan", "atan2"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?")


def metric_names(expr: str) -> set[str]:
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)       # string literals
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)            # Grafana variables
    s = re.sub(r"\{[^}]*\}", " ", s)                    # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                   # range / subquery brackets
    s = _GROUPING.sub(" ", s)
    names = set()
    for m in _IDENT.finditer(s):
        ident, call = m.group(1), m.group(2)
        if call or ident.lower() in _KEYWORDS:
            continue
        names.add(ident)
    return names


def base_name(name: str) -> str:
    """Histogram series (_bucket/_sum/_count) map to their family name."""
    return re.sub(r"_(bucket|sum|count)$", "", name)


# Labels Prometheus or the ServiceMonitor put on every series of a target.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "node", "model", "service", "container", "endpoint"}
_SELECTOR = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')


def selector_labels(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, label names matched on it) for every `metric{...}` in expr."""
    s = re.sub(r"\$\{[^}]*\}", " ", expr)
    return [(m.group(1), set(_MATCHER.findall(m.group(2)))) for m in _SELECTOR.finditer(s)]


def grouping_labels(expr: str) -> set[str]:
    """Label names used in by/without/on/ignoring/group_* clauses."""
    out: set[str] = set()
    for m in _GROUPING.finditer(expr):
        inner = m.group(0)[m.group(0).index("(") + 1:-1]
        out |= {x.strip() for x in inner.split(",") if x.strip()}
    return out


def label_problems(expr: str, by_name: dict) -> list[str]:
    """Label names in expr that no metric it reads carries (catalogue labels,
    target labels, and `le` of histogram buckets)."""
    problems = []
    known = set(TARGET_LABELS)
    for name in metric_names(expr):
        spec = by_name.get(name) or by_name.get(base_name(name))
        if spec is not None:
            known |= set(spec.labels) | ({"le"} if name.endswith("_bucket") else set())
    for metric, labels in selector_labels(expr):
        spec = by_name.get(metric) or by_name.get(base_name(metric))
        if spec is None:
            continue
        allowed = set(spec.labels) | TARGET_LABELS | ({"le"} if metric.endswith("_bucket") else set())
        problems += [f"{metric} has no label '{lab}'" for lab in sorted(labels - allowed)]
    problems += [f"grouping by unknown label '{lab}'" for lab in sorted(grouping_labels(expr) - known)]
    return problems
