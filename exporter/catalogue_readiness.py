"""Readiness gate, breaker, validation, water level and proxy metrics
(warmup_agent/readiness/, warmup_agent/proxy.py)."""
from exporter.metric_spec import FIRST_TOKEN_BUCKETS, MetricSpec

SPECS = (
    MetricSpec("warmup_breaker_state", "gauge",
               "1 for the breaker's current state (closed, open, half_open), 0 for the others.",
               labels=("state",), unit="short",
               doc="open: main path frozen for breaker.open_seconds; half_open: probes only; closed: normal."),
    MetricSpec("warmup_breaker_trips_total", "counter",
               "Times the breaker tripped, by reason: slow (window P90 over the tail threshold on breaker.trip_after consecutive samples), or a failed probe's reason (unreachable, timeout, server_error, bad_answer) on breaker.fail_after in a row.",
               labels=("reason",), unit="short",
               doc="Every reason is exported at 0 from the start. unreachable: connection refused or reset (probed again "
                   "every watch interval); timeout: no answer within readiness.watch_probe_timeout_seconds; "
                   "server_error: HTTP 5xx; bad_answer: another status or a stream without a token. "
                   "alerts/runbook.md says how long recovery takes for each."),
    MetricSpec("warmup_watch_probe_failures_total", "counter",
               "Probes of the main engine after SERVING (half-open probes included) that failed, by reason (unreachable, timeout, server_error, bad_answer).",
               labels=("reason",), unit="short",
               doc="While a dead server stays down it grows by one per watch interval (readiness.watch_interval_seconds)."),
    MetricSpec("warmup_breaker_transitions_total", "counter",
               "Breaker state changes, by source and target breaker state.",
               labels=("from", "to"), unit="short"),
    MetricSpec("warmup_fallback_active", "gauge",
               "1 while the breaker keeps the main engine frozen (open or half-open): user traffic goes to the fallback or gets 503.",
               unit="short"),
    MetricSpec("warmup_readiness_threshold_refits_total", "counter",
               "Adaptive re-fits of the readiness thresholds (readiness.adaptive).",
               unit="short"),
    MetricSpec("warmup_validation_checks_total", "counter",
               "Pre-SERVING validation checks by check (structure, numerics, fp8_ranges, performance) and result (passed, failed, skipped, recorded).",
               labels=("check", "result"), unit="short"),
    MetricSpec("warmup_water_level_requests_per_second", "gauge",
               "Water level T = a*T_prev + (1-a)*(Q*headroom) over user requests per second seen by the proxy (seed 000 §3.2).",
               unit="reqps",
               doc="Sampled every readiness.water_level_period_seconds; Q is the mean QPS over readiness.water_level_window_seconds. "
                   "0 without the proxy. An autoscaler target: see docs/readiness.md."),
    MetricSpec("warmup_proxy_requests_total", "counter",
               "User requests through the proxy by route (main, fallback, rejected) and HTTP status code; warmup-marked requests excluded.",
               labels=("route", "code"), unit="short", requires="proxy"),
    MetricSpec("warmup_proxy_first_token_seconds", "histogram",
               "Time to first streamed byte of user requests through the proxy, by route (main, fallback).",
               labels=("route",), buckets=FIRST_TOKEN_BUCKETS, unit="s", requires="proxy"),
)
