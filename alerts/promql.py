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
