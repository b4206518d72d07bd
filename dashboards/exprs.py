"""Panel expressions of a dashboard, with Grafana's variables substituted so that
Prometheus (promtool, or a live server) can evaluate them."""
from __future__ import annotations

import re

# What "All" means for our label variables (their allValue), and a rate window
# that holds several samples at the tests' 1 s scrape interval.
DEFAULTS = {"namespace": ".*", "pod": ".*", "model": ".*", "node": ".*"}


def panel_expressions(dashboard: dict):
    """(panel id, panel title, refId, expr) for every target of every panel."""
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            yield p["id"], p["title"], t["refId"], t["expr"]


def substitute(expr: str, rate_interval: str = "15s", variables: dict | None = None) -> str:
    values = {**DEFAULTS, **(variables or {})}
    out = expr.replace("$__rate_interval", rate_interval)
    out = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda mt: values[mt.group(1) or mt.group(2)], out)
    return out
