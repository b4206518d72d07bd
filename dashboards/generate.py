"""Generate the Grafana dashboards from the metric catalogue, with Grafana's own SDK.

    .venv/bin/python -m dashboards.generate            # writes dashboards/*.json
    .venv/bin/python -m dashboards.generate --out DIR  # writes DIR/*.json

The dashboards are built with `grafana_foundation_sdk` (Grafana's Foundation SDK,
pinned in pyproject.toml's test extra; Python 3.11+): its builders set every panel,
query and variable, and its JSON encoder writes them, so the files follow the
Grafana schema that release targets.  No dashboard JSON is written by hand here
(tests/test_dashboards.py checks that this file holds no dict literal).

Every metric a panel reads goes through `m()`, which looks it up in
exporter/catalogue.py and stops generation with one line if it is missing, so a
renamed metric cannot leave a silently empty panel.  The kernel-cache dashboard
is generated once the kernel-cache specs are in the catalogue.  Threshold lines
come from alerts/thresholds.yaml so a panel and its alert agree.

The committed JSON must equal a fresh generation (tests/test_dashboards.py), and
the Helm chart's dashboard ConfigMaps are copies of it (tools/sync_chart_files.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import heatmap as heatmap_b
from grafana_foundation_sdk.builders import prometheus as prometheus_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import statetimeline as statetimeline_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dashboard_m
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models import prometheus as prometheus_m

from alerts.generate import Thresholds, load_thresholds
from exporter.catalogue import BY_NAME
from warmup_agent.states import STATE_NAMES

HERE = os.path.dirname(os.path.abspath(__file__))
DS = dashboard_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Chained label variables.  namespace/pod/node/model are target labels that the
# ServiceMonitor adds (see helm/); outside Kubernetes they are absent and the
# "All" value `.*` still matches.
SEL = 'namespace=~"$namespace", pod=~"$pod", model=~"$model"'
RATE = "$__rate_interval"
STATES = STATE_NAMES    # warmup_agent/states.py; one colour each, below, in the same order
STATE_COLOURS = ("blue", "purple", "orange", "green", "yellow", "super-light-green", "dark-blue", "red")

# The panel builders of the SDK that the dashboards use.
Panel = Union[timeseries_b.Panel, stat_b.Panel, statetimeline_b.Panel, heatmap_b.Panel]


class MissingMetric(Exception):
    pass


def m(name: str, matchers: str = "") -> str:
    """`name{<dashboard selector>, matchers}` after checking the catalogue has the name."""
    base = name
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in BY_NAME:
            base = name[: -len(suffix)]
    if base not in BY_NAME or (base != name and BY_NAME[base].type != "histogram"):
        raise MissingMetric(f"dashboard names metric '{name}', which is not in exporter/catalogue.py")
    return f"{name}{{{SEL}{', ' + matchers if matchers else ''}}}"


# Per-GPU series (docs/metrics.md "Per-GPU series"): NVML figures are readings of the
# whole device, so a GPU two agents share is exported twice; max by the GPU's own
# labels counts it once, and the legend names the physical GPU, not the pod.
PER_GPU_BY = "node, gpu, uuid"
GPU_LEGEND = "{{node}} GPU {{gpu}} {{uuid}}"


def per_gpu(expr: str) -> str:
    return f"max by ({PER_GPU_BY}) ({expr})"


def has(*names: str) -> bool:
    """Feature metrics (exporter/catalogue_<feature>.py) get panels once they exist."""
    return all(n in BY_NAME for n in names)


def about(name: str) -> str:
    """"name: help text" from the catalogue, so a panel's description follows the metric's definition."""
    m(name)
    return f"{name}: {BY_NAME[name].help}"


def lbl(name: str, value: str, op: str = "=") -> str:
    return f'{name}{op}"{value}"'


# --- the SDK's building blocks, as the dashboards use them ------------------------------

def target(expr: str, legend: str = "", fmt: str = "time_series", interval: str = "") -> prometheus_b.Dataquery:
    """One Prometheus query over a time range; panel() gives it its refId."""
    q = (prometheus_b.Dataquery().datasource(DS).expr(expr).legend_format(legend or "__auto").range()
         .format(prometheus_m.PromQueryFormat(fmt)))
    if interval:
        q.interval(interval)
    return q


def _thresholds(*steps: tuple[float, str]) -> dashboard_b.ThresholdsConfig:
    """steps: (value, colour) pairs after the base green."""
    return dashboard_b.ThresholdsConfig().mode(dashboard_m.ThresholdsMode.ABSOLUTE).steps(
        [dashboard_m.Threshold(value=None, color="green")] + [dashboard_m.Threshold(value=v, color=c) for v, c in steps])


@dataclass(frozen=True)
class Override:
    """A field override: the series it matches (by name or by regexp) and what it changes."""
    matcher: str                               # "name" or "regexp"
    pattern: str
    properties: tuple[dashboard_m.DynamicConfigValue, ...]


def right_axis(series: str, unit: str) -> Override:
    """The series named `series` in its own unit, on an axis on the right."""
    return Override("name", series, (dashboard_m.DynamicConfigValue(id_val="unit", value=unit),
                                     dashboard_m.DynamicConfigValue(id_val="custom.axisPlacement",
                                                                    value=common_m.AxisPlacement.RIGHT)))


def dashed(series_regexp: str) -> Override:
    """The series whose names match `series_regexp` drawn as dashed lines."""
    style = common_m.LineStyle(fill="dash", dash=[10, 10])
    return Override("regexp", series_regexp, (dashboard_m.DynamicConfigValue(id_val="custom.lineStyle", value=style),))


def panel(p: Panel, title: str, description: str, unit: str, targets: Sequence[prometheus_b.Dataquery],
          w: int = 12, h: int = 8, overrides: Iterable[Override] = ()) -> Panel:
    """What every panel has: title, description, the datasource variable, a unit, its
    queries (refIds A, B, ... in order), its size, and its overrides."""
    p.title(title).description(description).datasource(DS).unit(unit).span(w).height(h)
    for i, t in enumerate(targets):
        p.with_target(t.ref_id(chr(ord("A") + i)))
    for o in overrides:
        if o.matcher == "name":
            p.override_by_name(o.pattern, list(o.properties))
        else:
            p.override_by_regexp(o.pattern, list(o.properties))
    return p


def timeseries(title: str, description: str, unit: str, targets: Sequence[prometheus_b.Dataquery],
               stack: bool = False, bars: bool = False, thresholds: dashboard_b.ThresholdsConfig | None = None,
               **kw: Any) -> Panel:
    p = (timeseries_b.Panel()
         .legend(common_b.VizLegendOptions().display_mode(common_m.LegendDisplayMode.TABLE)
                 .placement(common_m.LegendPlacement.BOTTOM).show_legend(True))
         .tooltip(common_b.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI).sort(common_m.SortOrder.DESCENDING))
         .draw_style(common_m.GraphDrawStyle.BARS if bars else common_m.GraphDrawStyle.LINE)
         .fill_opacity(60 if (stack or bars) else 10)
         .stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL if stack else common_m.StackingMode.NONE)
                   .group("A"))
         .show_points(common_m.VisibilityMode.NEVER).line_width(1))
    if thresholds is not None:
        p.thresholds(thresholds).thresholds_style(
            common_b.GraphThresholdsStyleConfig().mode(common_m.GraphThresholdsStyleMode.DASHED))
    return panel(p, title, description, unit, targets, **kw)


def stat(title: str, description: str, unit: str, targets: Sequence[prometheus_b.Dataquery],
         thresholds: dashboard_b.ThresholdsConfig | None = None, decimals: int | None = None, **kw: Any) -> Panel:
    p = (stat_b.Panel().thresholds(thresholds or _thresholds())
         .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
         .color_mode(common_m.BigValueColorMode.BACKGROUND).graph_mode(common_m.BigValueGraphMode.AREA)
         .text_mode(common_m.BigValueTextMode.VALUE_AND_NAME))
    if decimals is not None:
        p.decimals(decimals)
    return panel(p, title, description, unit, targets, **kw)


def state_timeline(title: str, description: str, targets: Sequence[prometheus_b.Dataquery],
                   mappings: list[dashboard_m.ValueMapping], **kw: Any) -> Panel:
    p = (statetimeline_b.Panel().mappings(mappings)
         .color_scheme(dashboard_b.FieldColor().mode(dashboard_m.FieldColorModeId.THRESHOLDS))
         .thresholds(_thresholds())
         .show_value(common_m.VisibilityMode.AUTO).merge_values(True).row_height(0.8)
         .legend(common_b.VizLegendOptions().show_legend(True).display_mode(common_m.LegendDisplayMode.LIST)
                 .placement(common_m.LegendPlacement.BOTTOM)))
    return panel(p, title, description, "none", targets, **kw)


def heatmap(title: str, description: str, unit: str, targets: Sequence[prometheus_b.Dataquery], **kw: Any) -> Panel:
    p = (heatmap_b.Panel().calculate(False).cell_gap(1)
         .y_axis(heatmap_b.YAxisConfig().axis_placement(common_m.AxisPlacement.LEFT).unit(unit))
         .rows_frame(heatmap_b.RowsHeatmapOptions().layout(common_m.HeatmapCellLayout.AUTO))
         .color(heatmap_b.HeatmapColorOptions().mode(heatmap_m.HeatmapColorMode.SCHEME).scheme("Oranges")
                .exponent(0.5).steps(64))
         .mode(common_m.TooltipDisplayMode.SINGLE).hide_y_histogram().show_legend()
         .cell_values(heatmap_b.CellValues().unit(unit)))
    return panel(p, title, description, unit, targets, **kw)


def _value_mappings(names_colours: Iterable[tuple[str, str]]) -> list[dashboard_m.ValueMapping]:
    """Values 1, 2, ... shown as the given names in the given colours."""
    mapping = dashboard_m.ValueMap()
    for i, (name, colour) in enumerate(names_colours, start=1):
        mapping.options[str(i)] = dashboard_m.ValueMappingResult(text=name, color=colour, index=i - 1)
    return [mapping]


def _variables() -> list[dashboard_b.QueryVariable | dashboard_b.DatasourceVariable]:
    info = "warmup_build_info"
    assert info in BY_NAME

    def query_var(name: str, label: str, query: str) -> dashboard_b.QueryVariable:
        return (dashboard_b.QueryVariable(name).label(label).datasource(DS).query(query)
                .refresh(dashboard_m.VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True).multi(True)
                .all_value(".*").current(dashboard_m.VariableOption(selected=True, text=["All"], value=["$__all"]))
                .sort(dashboard_m.VariableSort.ALPHABETICAL_ASC))
    return [
        dashboard_b.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        query_var("namespace", "Namespace", f"label_values({info}, namespace)"),
        query_var("pod", "Pod", f'label_values({info}{{namespace=~"$namespace"}}, pod)'),
        query_var("model", "Model", f'label_values({info}{{namespace=~"$namespace", pod=~"$pod"}}, model)'),
    ]


def dashboard(uid: str, title: str, description: str, panels: list[Panel]) -> dashboard_b.Dashboard:
    """Ids in order; panels flow left to right, 24 columns wide (a panel that does not
    fit on the row starts the next one)."""
    d = (dashboard_b.Dashboard(title).uid(uid).description(description).tags(["warmup-agent"])
         .timezone("browser").editable().refresh("30s").tooltip(dashboard_m.DashboardCursorSync.CROSSHAIR)
         .time("now-6h", "now"))
    for v in _variables():
        d.with_variable(v)
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        pos = p.build().grid_pos
        assert pos is not None
        if x + pos.w > 24:
            x, y, row_h = 0, y + row_h, 0
        p.id(i).grid_pos(dashboard_m.GridPos(h=pos.h, w=pos.w, x=x, y=y))
        d.with_panel(p)
        x += pos.w
        row_h = max(row_h, pos.h)
    return d


def to_json(d: dashboard_b.Dashboard) -> dict[str, Any]:
    """The dashboard as the SDK's encoder writes it, read back as plain data."""
    out: dict[str, Any] = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    return out


# --- the dashboards --------------------------------------------------------------------

def cold_start_overview(th: Thresholds) -> dashboard_b.Dashboard:
    state_code = " or ".join(f'{m("warmup_state", lbl("state", s))} * {i}'
                             for i, s in enumerate(STATES, start=1))
    slo = th.get("first_token_slo.max_seconds", "number")
    tax = th.get("first_request_tax.max_ratio", "number")
    panels = [
        state_timeline(
            "State per pod",
            "The agent's state machine per pod (warmup_state): INIT -> PRELOAD -> PRIME -> SERVING, "
            "DEGRADED while the fallback serves, SLEEPING while the server sleeps as its operator asked, DRAINING, "
            "FAILED (terminal). A pod is in the Service while SERVING (and SLEEPING with readiness.ready_while_asleep).",
            [target(f"sum by (namespace, pod) ({state_code})", "{{namespace}}/{{pod}}")],
            _value_mappings(zip(STATES, STATE_COLOURS, strict=True)), w=24, h=7),
        timeseries(
            "Stage durations (latest warmup)",
            "Seconds each warmup stage took in the latest warmup (model_loading_phase_duration_seconds), stacked: "
            f"reserve (seed phase 1, budget {th.get('phase_budget_seconds.cpu.reserve', 'number'):g} s on a CPU pod, "
            f"{th.get('phase_budget_seconds.cuda.reserve', 'number'):g} s on a pod whose reserve creates a CUDA context and imports torch), "
            "prewarm, solidify, ready. Averaged over the selected pods; pick one pod to see its own.",
            "s", [target(f"avg by (phase) ({m('model_loading_phase_duration_seconds')})", "{{phase}}")],
            stack=True, bars=True,
            thresholds=_thresholds((th.get("phase_budget_seconds.cpu.reserve", "number"), "red"))),
        stat("Time to ready",
             "Seconds from process start to SERVING in each pod's latest warmup (warmup_time_to_ready_seconds).",
             "s", [target(f"max by (namespace, pod) ({m('warmup_time_to_ready_seconds')})", "{{pod}}")],
             decimals=2),
        heatmap(
            "Time to ready by node and hour",
            "Cold-start time heatmap (seed 003 §3): one row per node, one cell per hour, colour = the longest time to "
            "ready of a pod on that node in that hour (max_over_time of warmup_time_to_ready_seconds). "
            "Slow nodes show as a dark row, slow hours of the day as a dark column.",
            "s", [target(f"max by (node) (max_over_time({m('warmup_time_to_ready_seconds')}[1h]))", "{{node}}",
                         interval="1h")]),
        heatmap(
            "Stage duration distribution",
            "Distribution of warmup stage durations across all warmups in the time range "
            "(warmup_stage_duration_seconds histogram buckets, increase per interval).",
            "s", [target(f"sum by (le) (increase({m('warmup_stage_duration_seconds_bucket')}[{RATE}]))",
                         "{{le}}", fmt="heatmap")]),
        first_request_tax_panel(tax),
        timeseries(
            "Time to first token vs readiness thresholds",
            "Exact p50/p90/p99 of probe time to first token over the readiness sliding window "
            "(warmup_first_token_window_seconds), the P50/P90 readiness thresholds (warmup_readiness_threshold_seconds, "
            f"seed 0.85 s / 2.1 s), and P99 from the probe histogram. Dashed line: the {slo:g} s SLO. Worst selected pod.",
            "s", [
                target(f"max by (percentile) ({m('warmup_first_token_window_seconds')})", "window {{percentile}}"),
                target(f"max by (percentile) ({m('warmup_readiness_threshold_seconds')})", "threshold {{percentile}}"),
                target("histogram_quantile(0.99, sum by (le) (rate("
                       f"{m('warmup_first_token_latency_seconds_bucket', lbl('kind', 'probe'))}[{RATE}])))",
                       "probe histogram p99"),
            ], thresholds=_thresholds((slo, "red")),
            overrides=[dashed("threshold.*")]),
        timeseries(
            "Synthetic requests",
            "Requests the agent sent to the engine per second, by kind: warmup (the shape grid) and probe "
            "(readiness and the watch after SERVING) (warmup_requests_total). Never user traffic.",
            "reqps", [target(f"sum by (kind) (rate({m('warmup_requests_total')}[{RATE}]))", "{{kind}}")]),
        timeseries(
            "State transitions",
            "Transitions applied (warmup_state_transitions_total) and rejected by the transition table "
            "(warmup_illegal_transitions_total, a bug) per interval, by from -> to.",
            "short", [
                target(f"sum by (from, to) (increase({m('warmup_state_transitions_total')}[{RATE}]))", "{{from}} -> {{to}}"),
                target(f"sum by (from, to) (increase({m('warmup_illegal_transitions_total')}[{RATE}]))",
                       "illegal {{from}} -> {{to}}"),
            ], bars=True),
        timeseries(
            "Cold-start failures and deadlines",
            "Model loading failures in the last hour by reason (model_loading_failures_total; seed 003 ColdStartDegradation "
            "fires above 5 for 10 minutes) and states left because their deadline passed (warmup_state_deadline_exceeded_total).",
            "short", [
                target(f"sum by (reason) (increase({m('model_loading_failures_total')}[1h]))", "{{reason}}"),
                target(f"sum by (state) (increase({m('warmup_state_deadline_exceeded_total')}[1h]))", "deadline {{state}}"),
            ], thresholds=_thresholds((th.get("cold_start_degradation.failures_per_hour", "number"), "red"))),
    ]
    if has("warmup_breaker_state"):
        breaker_states = ("closed", "half_open", "open")
        code = " or ".join(f'{m("warmup_breaker_state", lbl("state", s))} * {i}'
                           for i, s in enumerate(breaker_states, start=1))
        panels.append(state_timeline(
            "Breaker state", "The latency breaker per pod (warmup_breaker_state): closed, half-open, open "
            "(P90 over threshold on 3 probes in a row; the fallback serves while open).",
            [target(f"sum by (namespace, pod) ({code})", "{{namespace}}/{{pod}}")],
            _value_mappings(zip(breaker_states, ("green", "yellow", "red"), strict=True)), w=24, h=6))
    if has("warmup_weight_load_bytes_per_second"):
        panels.append(stat(
            "Weight load throughput",
            about("warmup_weight_load_bytes_per_second") + " "
            "Compare with the storage's read bandwidth and the pinned host-to-device bandwidth.",
            "Bps", [target(f"max by (namespace, pod) ({m('warmup_weight_load_bytes_per_second')})", "{{pod}}")]))
    if has("warmup_breaker_trips_total", "warmup_fallback_active"):
        panels.append(timeseries(
            "Breaker trips and fallback",
            "Breaker trips in the last hour per pod (warmup_breaker_trips_total) and whether the fallback is active "
            "(warmup_fallback_active: 1 while the main engine is frozen, open or half-open).",
            "short", [
                target(f"sum by (namespace, pod) (increase({m('warmup_breaker_trips_total')}[1h]))", "trips {{pod}}"),
                target(f"max by (namespace, pod) ({m('warmup_fallback_active')})", "fallback {{pod}}"),
            ]))
    if has("warmup_server_asleep_seconds_total", "warmup_server_wakes_total", "warmup_server_restarts_total"):
        panels.append(timeseries(
            "Server sleep, wakes and restarts",
            "Share of time the model server slept as its operator asked (rate of warmup_server_asleep_seconds_total), "
            "wakes in the last hour by cause (warmup_server_wakes_total) and restarts noticed after SERVING, each "
            "warmed again (warmup_server_restarts_total). Sleep is not an outage.",
            "short", [
                target(f"max by (namespace, pod) (rate({m('warmup_server_asleep_seconds_total')}[$__rate_interval]))",
                       "asleep share {{pod}}"),
                target(f"sum by (cause) (increase({m('warmup_server_wakes_total')}[1h]))", "wakes {{cause}}"),
                target(f"sum by (detected_by) (increase({m('warmup_server_restarts_total')}[1h]))",
                       "restarts {{detected_by}}"),
            ]))
    if has("warmup_wake_duration_seconds", "warmup_wake_first_user_request_seconds"):
        panels.append(timeseries(
            "Wake: time to warm and the users' first request",
            "Seconds from the latest wake's start to SERVING again (warmup_wake_duration_seconds) and the time to "
            "first token of the users' first request after it, through the proxy, its hold included "
            "(warmup_wake_first_user_request_seconds); 0 before the first wake.",
            "s", [
                target(f"max by (namespace, pod) ({m('warmup_wake_duration_seconds')})", "wake {{pod}}"),
                target(f"max by (namespace, pod) ({m('warmup_wake_first_user_request_seconds')})",
                       "first request {{pod}}"),
            ]))
    if has("warmup_validation_checks_total"):
        panels.append(timeseries(
            "Validation checks before SERVING",
            "Pre-SERVING validation checks in the last hour by check (structure, numerics, performance) and result "
            "(warmup_validation_checks_total). A failed check keeps the pod out of the Service.",
            "short", [target(f"sum by (check, result) (increase({m('warmup_validation_checks_total')}[1h]))",
                             "{{check}} {{result}}")], bars=True))
    if has("warmup_engine_requests_running", "warmup_engine_requests_waiting", "warmup_engine_kv_cache_usage_ratio"):
        panels.append(timeseries(
            "Engine queue and KV cache",
            "Read from the server's own /metrics at scrape time, under each server kind's names "
            "(vLLM; llama.cpp with --metrics; SGLang with --enable-metrics; TGI): requests running and waiting "
            "(warmup_engine_requests_running, warmup_engine_requests_waiting) and KV-cache usage "
            "(warmup_engine_kv_cache_usage_ratio, right axis). Only with an engine that exports metrics.",
            "short", [
                target(f"sum({m('warmup_engine_requests_running')})", "running"),
                target(f"sum({m('warmup_engine_requests_waiting')})", "waiting"),
                target(f"max({m('warmup_engine_kv_cache_usage_ratio')})", "KV cache usage"),
            ],
            overrides=[right_axis("KV cache usage", "percentunit")]))
    return dashboard("warmup-cold-start", "Warmup agent / Cold start overview",
                     "Where each pod is in its warmup, how long stages take, and whether the first request is as fast as the thousandth.",
                     panels)


def first_request_tax_panel(tax: float) -> Panel:
    """The first request's tax the agent predicts from its first probe and, once the
    catalogue has them, the users' real first request beside it (through the proxy)."""
    predicted = "warmup_first_request_tax_ratio"
    if not has("warmup_first_user_request_tax_ratio"):
        return stat(
            "First-request tax",
            "Time to first token of the first probe after warmup divided by the steady (median) probe "
            f"(warmup_first_request_tax_ratio). 1.0 = no cold-start tax; the alert fires above {tax:g}.",
            "none", [target(f"max by (namespace, pod) ({m(predicted)})", "{{pod}}")],
            thresholds=_thresholds((tax * 0.75, "yellow"), (tax, "red")), decimals=2)
    # the users' figures are 0 until a user's first request was measured: shown from then on
    pairs = [(predicted, "warmup_first_user_request_tax_ratio", "first token")]
    total = "warmup_first_request_total_tax_ratio", "warmup_first_user_request_total_tax_ratio"
    if has(*total):
        pairs.append((*total, "whole answer"))
    targets = []
    for predicted_name, real_name, what in pairs:
        targets += [target(f"max by (namespace, pod) ({m(predicted_name)})", f"{{{{pod}}}} {what} predicted"),
                    target(f"max by (namespace, pod) ({m(real_name)} > 0)", f"{{{{pod}}}} {what} real")]
    return stat(
        "First-request tax",
        "The first request after warmup over the steady level, predicted and real. Predicted: the first probe's "
        "time to first token over the steady (median) probe (warmup_first_request_tax_ratio)"
        + (", and its whole answer over the steady whole answer (warmup_first_request_total_tax_ratio)"
           if len(pairs) > 1 else "")
        + ". Real: the users' first request through the readiness proxy over the users' answers after it "
        "(warmup_first_user_request_tax_ratio"
        + (", warmup_first_user_request_total_tax_ratio" if len(pairs) > 1 else "")
        + "), shown once measured. "
        f"1.0 = no cold-start tax; the alert fires above {tax:g}.",
        "none", targets, thresholds=_thresholds((tax * 0.75, "yellow"), (tax, "red")), decimals=2)


def ramp_slope_panel() -> Panel:
    if has("warmup_gpu_utilization_ramp_slope"):
        return timeseries(
            "GPU utilisation ramp slope",
            about("warmup_gpu_utilization_ramp_slope") + " "
            "Seed 000's SOTA line is 0.147/s (dashed): a steeper ramp means the GPU reaches full work sooner. GPU only.",
            "short", [target(m("warmup_gpu_utilization_ramp_slope"), "{{pod}} GPU {{gpu}}")],
            thresholds=_thresholds((0.147, "blue")))
    return timeseries(
        "GPU utilisation ramp slope",
        "Rate of change of GPU utilisation (deriv over 5 m of warmup_gpu_utilization_ratio, per second): "
        "a warm pod ramps to load quickly; a slow positive slope after SERVING means it is still warming. GPU only.",
        "short", [target(f"deriv({m('warmup_gpu_utilization_ratio')}[5m])", "{{pod}} GPU {{gpu}}")])


def warmup_economics(th: Thresholds) -> dashboard_b.Dashboard:
    cost = th.get("warmup_cost_ratio.max", "number")
    frag = th.get("gpu_fragmentation.max", "number")
    panels = [
        timeseries(
            "Warmup cost ratio",
            about("warmup_cost_ratio") + " "
            f"Seed 003 alerts above {cost:g}; it falls as a pod serves longer.",
            "percentunit", [target(m("warmup_cost_ratio"), "{{namespace}}/{{pod}}")],
            thresholds=_thresholds((cost, "red"))),
        timeseries(
            "Warmup benefit curve",
            "Seed 003 §3: what warmup costs against what it avoids, per hour over the selected pods. "
            "Engine seconds spent on warmup and solidify (warmup_engine_seconds_total; GPU-seconds on a GPU), "
            "cold-start failures (model_loading_failures_total) and pods whose first request still paid a tax "
            f"above {th.get('first_request_tax.max_ratio', 'number'):g}x (warmup_first_request_tax_ratio). "
            "More warmup seconds should buy fewer failures and slow first requests.",
            "short", [
                target(f'sum(increase({m("warmup_engine_seconds_total", lbl("kind", "warmup|solidify", "=~"))}[1h]))',
                       "warmup engine seconds / h"),
                target(f"sum(increase({m('model_loading_failures_total')}[1h]))", "cold-start failures / h"),
                target(f"count({m('warmup_first_request_tax_ratio')} > {th.get('first_request_tax.max_ratio', 'number'):g})",
                       "pods with a slow first request"),
            ],
            overrides=[right_axis("warmup engine seconds / h", "s")]),
        timeseries(
            "Engine time on agent work",
            "Seconds per hour the engine was busy on agent-generated work, by kind (warmup, solidify, probe) "
            "(warmup_engine_seconds_total).",
            "s", [target(f"sum by (kind) (increase({m('warmup_engine_seconds_total')}[1h]))", "{{kind}}")], stack=True),
        timeseries(
            "GPU memory fragmentation trend",
            about("gpu_fragmentation_rate") + " "
            f"Seed 003 saw 12 % rise to 43 % over 30 days and alerts above {frag:g}. GPU only.",
            "percentunit", [target(m("gpu_fragmentation_rate"), "{{pod}} GPU {{gpu}} ({{uuid}})")],
            thresholds=_thresholds((frag, "red"))),
        timeseries(
            "Memory jitter",
            "(max RSS - min RSS) / mean RSS of the agent process over the last 60 s, sampled every 100 ms "
            "(warmup_memory_jitter_ratio; seed 000's SOTA line is 0.023).",
            "percentunit", [target(m("warmup_memory_jitter_ratio"), "{{namespace}}/{{pod}}")],
            thresholds=_thresholds((0.023, "yellow"))),
        ramp_slope_panel(),
        timeseries(
            "GPU utilisation",
            "GPU compute utilisation per device over NVML's last sample period (warmup_gpu_utilization_ratio), "
            "one series per physical GPU (gpu = nvidia-smi's index, uuid; docs/metrics.md \"Per-GPU series\"). GPU only.",
            "percentunit", [target(per_gpu(m("warmup_gpu_utilization_ratio")), GPU_LEGEND)]),
        timeseries(
            "GPU memory used",
            "GPU memory in use per device as a fraction of its size, from NVML "
            "(warmup_gpu_memory_used_bytes / warmup_gpu_memory_total_bytes), one series per physical GPU. GPU only.",
            "percentunit", [target(f"{per_gpu(m('warmup_gpu_memory_used_bytes'))} / {per_gpu(m('warmup_gpu_memory_total_bytes'))}",
                                   GPU_LEGEND)]),
        *([timeseries(
            "Water level and user traffic",
            "The autoscaling signal T = a*T_prev + (1-a)*(Q*headroom) (warmup_water_level_requests_per_second, seed 000 "
            "§3.2) against user requests per second through the proxy by route (warmup_proxy_requests_total). "
            "Scaling on T adds warm pods before the queue builds. Only with the readiness proxy.",
            "reqps", [
                target(f"sum({m('warmup_water_level_requests_per_second')})", "water level T"),
                target(f"sum by (route) (rate({m('warmup_proxy_requests_total')}[{RATE}]))", "user {{route}}"),
            ])] if has("warmup_water_level_requests_per_second", "warmup_proxy_requests_total") else []),
        timeseries(
            "Agent resident memory",
            "Resident memory of the agent process, engine included when in-process (warmup_process_resident_memory_bytes).",
            "bytes", [target(m("warmup_process_resident_memory_bytes"), "{{namespace}}/{{pod}}")]),
        timeseries(
            "Agent CPU",
            "CPU cores the agent process keeps busy, user and system time, engine included when in-process "
            "(rate of warmup_process_cpu_seconds_total).",
            "short", [target(f"rate({m('warmup_process_cpu_seconds_total')}[{RATE}])", "{{namespace}}/{{pod}}")]),
    ]
    return dashboard("warmup-economics", "Warmup agent / Warmup economics",
                     "What warmup costs (engine time, memory) against what it buys (fewer failed and slow cold starts).",
                     panels)


KERNEL_CACHE_METRICS = ("warmup_kernel_cache_requests_total", "warmup_kernel_cache_bytes",
                        "warmup_kernel_cache_lock_waits_total", "warmup_kernel_cache_lock_wait_seconds",
                        "warmup_kernel_cache_publishes_total", "warmup_kernel_cache_degraded")


def kernel_cache(th: Thresholds) -> dashboard_b.Dashboard:
    req = "warmup_kernel_cache_requests_total"
    panels = [
        timeseries(
            "Hit ratio by tier",
            "Kernel-cache lookups that hit, as a fraction of all lookups, per tier (local directory, shared Redis) "
            "(warmup_kernel_cache_requests_total). A new pod with a warm shared tier should hit almost always.",
            "percentunit", [target(
                f"sum by (tier) (increase({m(req, lbl('result', 'hit'))}[{RATE}])) / "
                f"sum by (tier) (increase({m(req)}[{RATE}]))", "{{tier}}")]),
        timeseries(
            "Lookups by tier and result",
            "Kernel-cache lookups per interval by tier and result: hit, miss, rejected (signature/digest check failed), "
            "error (shared tier unreachable) (warmup_kernel_cache_requests_total).",
            "short", [target(f"sum by (tier, result) (increase({m(req)}[{RATE}]))", "{{tier}} {{result}}")],
            bars=True, stack=True),
        timeseries(
            "Rejections (possible tampering)",
            "Shared-tier entries rejected by the signature, digest or path check per interval "
            "(warmup_kernel_cache_requests_total{result=\"rejected\"}). Any value pages (WarmupAgentKernelCacheRejections).",
            "short", [target(f"sum by (tier) (increase({m(req, lbl('result', 'rejected'))}[{RATE}]))", "{{tier}}")],
            thresholds=_thresholds((1, "red"))),
        timeseries(
            "Compile lock waits",
            "Times this agent waited for another pod's compile of the same key (warmup_kernel_cache_lock_waits_total) "
            "and the P90 wait (warmup_kernel_cache_lock_wait_seconds).",
            "short", [
                target(f"sum(increase({m('warmup_kernel_cache_lock_waits_total')}[{RATE}]))", "waits"),
                target("histogram_quantile(0.9, sum by (le) (rate("
                       f"{m('warmup_kernel_cache_lock_wait_seconds_bucket')}[{RATE}])))", "P90 wait"),
            ],
            overrides=[right_axis("P90 wait", "s")]),
        timeseries(
            "Cache size by tier",
            "Bytes held by the kernel cache per tier (warmup_kernel_cache_bytes).",
            "bytes", [target(f"sum by (tier) ({m('warmup_kernel_cache_bytes')})", "{{tier}}")]),
        timeseries(
            "Publishes to the shared tier",
            "Entries this agent wrote to the shared tier per interval (warmup_kernel_cache_publishes_total).",
            "short", [target(f"sum(increase({m('warmup_kernel_cache_publishes_total')}[{RATE}]))", "publishes")],
            bars=True),
        stat("Shared tier degraded",
             "Pods whose shared tier is off or unreachable, so their cache runs local-only (warmup_kernel_cache_degraded).",
             "short", [target(f"sum({m('warmup_kernel_cache_degraded')})", "degraded pods")],
             thresholds=_thresholds((1, "red"))),
    ]
    return dashboard("warmup-kernel-cache", "Warmup agent / Kernel cache",
                     "The two-tier compiled-kernel cache: hit ratio, rejections, lock waits and size.", panels)


def build_all() -> dict[str, dict[str, Any]]:
    """File name -> the dashboard's JSON (as the SDK writes it), for every dashboard."""
    th = load_thresholds()
    boards = [("cold-start-overview.json", cold_start_overview(th)), ("warmup-economics.json", warmup_economics(th))]
    if has(*KERNEL_CACHE_METRICS):
        boards.append(("kernel-cache.json", kernel_cache(th)))
    return {name: to_json(d) for name, d in boards}


README_HEAD = """# Grafana dashboards

<!-- GENERATED by `python -m dashboards.generate` (with the JSON beside it); do not edit by hand. -->

The JSON files here are generated from the metric catalogue (`exporter/catalogue.py`) by
`dashboards/generate.py`; CI fails when regenerating changes them.  Alert rules are in
`alerts/warmup-agent.rules.yaml` (thresholds: `alerts/thresholds.yaml`, runbook:
`alerts/runbook.md`).

## Import the dashboards

- **Grafana UI:** Dashboards -> New -> Import -> upload a JSON file, then pick your Prometheus
  data source in the *Data source* variable.  No data source uid is hard-coded.
- **Provisioning:** point a file provider at this directory:
  `providers: [{name: warmup-agent, type: file, options: {path: /path/to/dashboards}}]`.
- **Kubernetes (Helm chart):** `--set dashboards.enabled=true` creates one ConfigMap per JSON
  labelled `grafana_dashboard: "1"` for the Grafana sidecar.

Variables: *Data source*, then *Namespace*, *Pod* and *Model*, chained (each lists the values
under the previous ones).  `namespace`, `pod`, `node` and `model` are target labels added by the
ServiceMonitor's relabelings; outside Kubernetes they are absent and *All* still matches.
Rates use `$__rate_interval`.

## Load the alert rules

- **Prometheus:** add `alerts/warmup-agent.rules.yaml` to `rule_files:`; check it with
  `promtool check rules alerts/warmup-agent.rules.yaml`.
- **Prometheus Operator (Helm chart):** `--set prometheusRule.enabled=true` renders the same
  groups as a PrometheusRule.
- **Change a threshold:** edit `alerts/thresholds.yaml`, run `.venv/bin/python -m alerts.generate`,
  update the promtool cases in `alerts/tests/`, commit.
"""


def render_readme(dashboards: dict[str, dict[str, Any]]) -> str:
    lines = [README_HEAD]
    for fname, d in dashboards.items():
        lines += [f"## {d['title']}", "", f"`dashboards/{fname}`, uid `{d['uid']}`. {d['description']}", ""]
        for p in d["panels"]:
            lines.append(f"- **{p['title']}** ({p['type']}, unit `{p['fieldConfig']['defaults']['unit']}`): {p['description']}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def render_all() -> dict[str, str]:
    dashboards = build_all()
    files = {name: json.dumps(d, indent=2, ensure_ascii=False) + "\n" for name, d in dashboards.items()}
    files["README.md"] = render_readme(dashboards)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=HERE, help="directory for the dashboard JSON files")
    args = ap.parse_args(argv)
    try:
        files = render_all()
    except MissingMetric as e:
        print(f"dashboards.generate: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            f.write(text)
    if "kernel-cache.json" not in files:
        print("dashboards.generate: kernel-cache metrics not in the catalogue yet; kernel-cache.json not generated",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
