"""Generate the Prometheus alert rules from alerts/thresholds.yaml and the metric catalogue.

    .venv/bin/python -m alerts.generate            # writes alerts/warmup-agent.rules.yaml
    .venv/bin/python -m alerts.generate --out DIR  # writes DIR/warmup-agent.rules.yaml

Why generated: thresholds live in one commented file, `runbook_url` is added to
every alert in one place, and every metric an expression names is looked up in
exporter/catalogue.py, so a renamed metric breaks generation instead of
silently leaving an alert that can never fire.  Alerts on feature metrics
(breaker, kernel cache) are generated only once their specs are in the
catalogue.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import yaml

from exporter.catalogue import BY_NAME
from warmup_agent.states import WARMING, State

HERE = os.path.dirname(os.path.abspath(__file__))
THRESHOLDS_PATH = os.path.join(HERE, "thresholds.yaml")
RULES_FILE = "warmup-agent.rules.yaml"
_DURATION = re.compile(r"^\d+[smhd]$")


class ThresholdError(Exception):
    """A bad value in thresholds.yaml; str() is the one line to show."""


class Thresholds:
    def __init__(self, tree: dict, path: str):
        self.tree, self.path = tree, path

    def get(self, dotted: str, kind: str):
        node = self.tree
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ThresholdError(f"{self.path}: key '{dotted}' is missing")
            node = node[part]
        ok = {"number": isinstance(node, (int, float)) and not isinstance(node, bool) and node >= 0,
              "duration": isinstance(node, str) and bool(_DURATION.match(node)),
              "str": isinstance(node, str)}[kind]
        if not ok:
            want = {"number": "a number >= 0", "duration": "a duration like 30s, 10m or 1h",
                    "str": "a string"}[kind]
            raise ThresholdError(f"{self.path}: key '{dotted}': got {node!r}; expected {want}")
        return node


def load_thresholds(path: str = THRESHOLDS_PATH) -> Thresholds:
    try:
        with open(path, encoding="utf-8") as f:
            tree = yaml.safe_load(f)
    except OSError as e:
        raise ThresholdError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ThresholdError(f"{path}: YAML syntax error: {str(e).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ThresholdError(f"{path}: expected a mapping at the top level")
    return Thresholds(tree, path)


class MissingMetric(Exception):
    pass


def _metric(name: str) -> str:
    """The name, after checking the catalogue has it (histogram suffixes allowed)."""
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    if name not in BY_NAME and not (base in BY_NAME and BY_NAME[base].type == "histogram"):
        raise MissingMetric(f"metric '{name}' is not in exporter/catalogue.py")
    return name


def _fmt(value: float) -> str:
    return f"{value:g}"  # 5 -> "5", 0.38 -> "0.38"


class _Rules:
    """Builds one alert at a time; knows the selector and the runbook base."""

    def __init__(self, th: Thresholds):
        self.th = th
        self.selector = th.get("selector", "str").strip()
        self.runbook = th.get("runbook_base_url", "str")

    def sel(self, name: str, **matchers: str) -> str:
        parts = [f'{k}="{v}"' if not v.startswith("~") else f'{k}=~"{v[1:]}"' for k, v in matchers.items()]
        if self.selector:
            parts.append(self.selector)
        return _metric(name) + ("{" + ", ".join(parts) + "}" if parts else "")

    def alert(self, name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict:
        return {
            "alert": name,
            "expr": expr,
            "for": for_,
            "labels": {"severity": severity},
            "annotations": {
                "summary": summary,
                "description": description,
                "runbook_url": f"{self.runbook}#{name.lower()}",
            },
        }


def _phase_budget_expr(r: _Rules, th: Thresholds) -> str:
    """model_loading_phase_duration_seconds over its budget, where the budget
    depends on the device kind: a pod whose reserve created a CUDA context
    exports warmup_reserve_step_duration_seconds{step="cuda_context"} and gets
    the `cuda` budgets; every other pod (CPU, or a server engine on a GPU host)
    the `cpu` ones.  A phase with one budget for both is one plain comparison."""
    budgets = th.tree.get("phase_budget_seconds")
    kinds = ("cpu", "cuda")
    if not isinstance(budgets, dict) or set(budgets) != set(kinds) or not all(
            isinstance(budgets[k], dict) and budgets[k] for k in kinds):
        raise ThresholdError(f"{th.path}: key 'phase_budget_seconds': expected cpu: and cuda:, each a mapping of phase to seconds")
    if set(budgets["cpu"]) != set(budgets["cuda"]):
        raise ThresholdError(f"{th.path}: key 'phase_budget_seconds': cpu and cuda must budget the same phases "
                             f"(got {sorted(budgets['cpu'])} and {sorted(budgets['cuda'])})")
    cuda_pod = r.sel("warmup_reserve_step_duration_seconds", step="cuda_context")
    terms = []
    for phase in budgets["cpu"]:
        sel = r.sel("model_loading_phase_duration_seconds", phase=phase)
        cpu, cuda = (th.get(f"phase_budget_seconds.{k}.{phase}", "number") for k in kinds)
        if cpu == cuda:
            terms.append(f"{sel} > {_fmt(cpu)}")
        else:
            terms.append(f"({sel} > {_fmt(cpu)} unless on (job, instance) {cuda_pod})")
            terms.append(f"({sel} > {_fmt(cuda)} and on (job, instance) {cuda_pod})")
    return " or ".join(terms)


# Every description names where the alert comes from.
_WHO = "{{ $labels.namespace }}/{{ $labels.pod }} ({{ $labels.instance }})"


def build(th: Thresholds) -> dict:
    r = _Rules(th)
    g = th.get
    groups = []

    # --- cold start: the warmup itself --------------------------------------------
    phase_expr = _phase_budget_expr(r, th)
    warm_states = "~" + "|".join(s.name for s in WARMING)
    warm_words = ", ".join(s.name for s in WARMING[:-1]) + f" or {WARMING[-1].name}"
    groups.append({"name": "warmup-agent.cold-start", "rules": [
        r.alert("WarmupAgentColdStartDegradation",
                f'increase({r.sel("model_loading_failures_total")}[1h]) > {_fmt(g("cold_start_degradation.failures_per_hour", "number"))}',
                g("cold_start_degradation.for", "duration"), "critical",
                "Model loading keeps failing: cold starts are degrading.",
                f'{_WHO}: {{{{ printf "%.0f" $value }}}} model loading failures with reason '
                f'{{{{ $labels.reason }}}} in the last hour.'),
        r.alert("WarmupAgentPhaseOverBudget", phase_expr, g("phase_budget_for", "duration"), "warning",
                "A warmup stage took longer than its budget.",
                f'{_WHO}: stage {{{{ $labels.phase }}}} took {{{{ printf "%.2f" $value }}}} s, over its budget for this device kind in alerts/thresholds.yaml.'),
        r.alert("WarmupAgentWarmupStuck",
                f'sum without (state) ({r.sel("warmup_state", state=warm_states)}) == 1',
                g("warmup_stuck.for", "duration"), "warning",
                "The agent is still warming up and not SERVING.",
                f'{_WHO} has been in {warm_words} for more than {g("warmup_stuck.for", "duration")}; the pod is held out of the Service.'),
        r.alert("WarmupAgentFailed", f'{r.sel("warmup_state", state=State.FAILED.name)} == 1',
                g("failed.for", "duration"), "critical",
                "The warmup agent is in the terminal FAILED state.",
                f'{_WHO} is FAILED and will not become ready; see its log and model_loading_failures_total for the reason.'),
        r.alert("WarmupAgentIllegalTransitions",
                f'increase({r.sel("warmup_illegal_transitions_total")}[{g("illegal_transitions.window", "duration")}]) > 0',
                g("illegal_transitions.for", "duration"), "warning",
                "The state machine rejected an illegal transition.",
                f'{_WHO}: {{{{ printf "%.0f" $value }}}} rejected transitions {{{{ $labels.from }}}} -> {{{{ $labels.to }}}} '
                f'in the last {g("illegal_transitions.window", "duration")}.'),
    ]})

    # --- latency: what users feel once SERVING -------------------------------------
    serving = f'on (job, instance) {r.sel("warmup_state", state=State.SERVING.name)} == 1'
    q = g("first_token_slo.percentile", "str")
    latency = [
        r.alert("WarmupAgentFirstTokenSLOBreach",
                f'{r.sel("warmup_first_token_window_seconds", percentile=q)} > {_fmt(g("first_token_slo.max_seconds", "number"))} and {serving}',
                g("first_token_slo.for", "duration"), "warning",
                "Time to first token is over the SLO while SERVING.",
                f'{_WHO}: {q.upper()} time to first token over the readiness window is '
                f'{{{{ printf "%.3f" $value }}}} s, over the SLO of {_fmt(g("first_token_slo.max_seconds", "number"))} s.'),
        r.alert("WarmupAgentReadinessTailOverThreshold",
                f'{r.sel("warmup_first_token_window_seconds", percentile="p90")} > {r.sel("warmup_readiness_threshold_seconds", percentile="p90")} and {serving}',
                g("readiness_tail.for", "duration"), "warning",
                "First-token P90 is over the readiness threshold while SERVING.",
                f'{_WHO}: window P90 time to first token is {{{{ printf "%.3f" $value }}}} s, over the agent\'s own P90 readiness threshold.'),
        # The users' real first request when the proxy measured one (0 until then), else
        # the first probe's prediction: a fine real figure silences a high prediction.
        r.alert("WarmupAgentFirstRequestTaxHigh",
                f'({r.sel("warmup_first_user_request_tax_ratio")} > 0 or {r.sel("warmup_first_request_tax_ratio")}) '
                f'> {_fmt(g("first_request_tax.max_ratio", "number"))}',
                g("first_request_tax.for", "duration"), "warning",
                "The first request after warmup was much slower than steady requests.",
                f'{_WHO}: the first request after warmup took {{{{ printf "%.1f" $value }}}}x the steady time to first token '
                f'(the users\' real first request where the proxy measured one, else the first probe); '
                f'warmup misses shapes that traffic uses.'),
    ]
    if "warmup_breaker_state" in BY_NAME:
        latency.append(r.alert(
            "WarmupAgentBreakerOpen", f'{r.sel("warmup_breaker_state", state="open")} == 1',
            g("breaker_open.for", "duration"), "warning",
            "The latency breaker is open: the fallback is serving.",
            f'{_WHO}: the breaker has been open for more than {g("breaker_open.for", "duration")}: the main engine is slow '
            f'(P90 over its threshold) or does not answer; warmup_breaker_trips_total{{reason}} says which.'))
    groups.append({"name": "warmup-agent.latency", "rules": latency})

    # --- resources: what warmup costs ---------------------------------------------
    groups.append({"name": "warmup-agent.resources", "rules": [
        r.alert("WarmupAgentCostRatioHigh",
                f'{r.sel("warmup_cost_ratio")} > {_fmt(g("warmup_cost_ratio.max", "number"))}',
                g("warmup_cost_ratio.for", "duration"), "warning",
                "Warmup work is too large a share of engine time.",
                f'{_WHO}: warmup cost ratio is {{{{ printf "%.2f" $value }}}}, over {_fmt(g("warmup_cost_ratio.max", "number"))}.'),
        r.alert("WarmupAgentGpuFragmentationHigh",
                f'{r.sel("gpu_fragmentation_rate")} > {_fmt(g("gpu_fragmentation.max", "number"))}',
                g("gpu_fragmentation.for", "duration"), "warning",
                "GPU memory held by the allocator is fragmented.",
                f'{_WHO}: GPU {{{{ $labels.gpu }}}} fragmentation is {{{{ printf "%.2f" $value }}}}, '
                f'over {_fmt(g("gpu_fragmentation.max", "number"))}.'),
    ]})

    if "warmup_kernel_cache_requests_total" in BY_NAME:
        w = g("kernel_cache_rejections.window", "duration")
        groups.append({"name": "warmup-agent.kernel-cache", "rules": [
            r.alert("WarmupAgentKernelCacheRejections",
                    f'increase({r.sel("warmup_kernel_cache_requests_total", result="rejected")}[{w}]) > 0',
                    g("kernel_cache_rejections.for", "duration"), "critical",
                    "Kernel-cache entries failed their signature check: possible tampering.",
                    f'{_WHO}: {{{{ printf "%.0f" $value }}}} {{{{ $labels.tier }}}} kernel-cache entries rejected in the last {w}.'),
        ]})

    groups.append({"name": "warmup-agent.target", "rules": [
        r.alert("WarmupAgentTargetDown",
                f'up{{job=~"{g("target_job_regex", "str")}"}} == 0',
                g("target_down.for", "duration"), "critical",
                "Prometheus cannot scrape a warmup agent.",
                f'{{{{ $labels.job }}}} target {{{{ $labels.instance }}}} has been down for more than {g("target_down.for", "duration")}.'),
    ]})
    return {"groups": groups}


HEADER = ("# GENERATED by `python -m alerts.generate` from alerts/thresholds.yaml and\n"
          "# exporter/catalogue.py.  Do not edit by hand: change the thresholds and regenerate.\n")


def render(th: Thresholds | None = None) -> str:
    rules = build(th or load_thresholds())
    return HEADER + yaml.safe_dump(rules, sort_keys=False, width=10_000, allow_unicode=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=HERE, help="directory to write %s into" % RULES_FILE)
    ap.add_argument("--thresholds", default=THRESHOLDS_PATH)
    args = ap.parse_args(argv)
    try:
        text = render(load_thresholds(args.thresholds))
    except (ThresholdError, MissingMetric) as e:
        print(f"alerts.generate: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, RULES_FILE), "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
