"""Readiness gate, breaker, validation, water level and proxy metrics
(warmup_agent/readiness/, warmup_agent/proxy.py)."""
from exporter.metric_spec import FIRST_TOKEN_BUCKETS, MetricSpec

# A hold lasts from a few milliseconds (the gate was about to open) to proxy.hold_seconds.
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

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
    MetricSpec("warmup_proxy_held_requests_total", "counter",
               "User requests the proxy held while the pod warmed (a start, a restart, a wake), by outcome: served (the gate opened), timed_out (503 after proxy.hold_seconds), refused (the pod left the warming states: FAILED, DRAINING, DEGRADED), client_gone.",
               labels=("outcome",), unit="short", requires="proxy",
               doc="Only without proxy.fallback_url: with one, users are answered by the fallback instead."),
    MetricSpec("warmup_proxy_hold_seconds", "histogram",
               "How long each held user request waited for the gate, by outcome (as warmup_proxy_held_requests_total).",
               labels=("outcome",), buckets=HOLD_BUCKETS, unit="s", requires="proxy"),
    # --- the traffic profile learned from users' requests (shapes, never text) ------
    MetricSpec("warmup_learned_profile_shapes", "gauge",
               "Shape bins (endpoint, sampling family, model, stream, prompt-length bin, max_tokens) in the traffic profile learned from users' requests through the proxy.",
               unit="short",
               doc="Bounded whatever the traffic (warmup/learned.py); loaded from the data dir and the kernel cache's Redis at start. 0 without the proxy, or before any user request."),
    MetricSpec("warmup_learned_profile_requests", "gauge",
               "Users' requests the learned traffic profile holds, decayed (half-life 5000 requests).",
               unit="short"),
    MetricSpec("warmup_learned_profile_updated_timestamp_seconds", "gauge",
               "Unix time of the newest user request in the learned traffic profile; time() minus it is the profile's age (0: none yet).",
               unit="s"),
    # --- the warm-up behind the users (prewarm.behind_users) ----------------------
    MetricSpec("warmup_behind_users_pending", "gauge",
               "1 while the warm-up behind the users (after SERVING, only while no user request is in flight) has requests left to send, else 0.",
               unit="short",
               doc="Set at SERVING when prewarm left paths for later, back to 0 when they are sent or the warm-up "
                   "stops (the pod left SERVING). A benchmark polls it to tell the users' requests sent while it ran "
                   "from those after."),
    MetricSpec("warmup_behind_users_seconds", "gauge",
               "Seconds the last warm-up behind the users took, from SERVING (its quiet wait included) to its last answer; 0 until one finished.",
               unit="s"),
    # --- the pod's life after SERVING: restarts, sleep and wake --------------------
    MetricSpec("warmup_server_restarts_total", "counter",
               "Restarts of the model server noticed after SERVING (a new process, cold), each followed by a re-warm, by how it was noticed.",
               labels=("detected_by",), unit="short",
               doc="detected_by: start_time (the server's process start time changed), came_back (it was unreachable "
                   "and answers again), supervisor (the agent's own child process exited)."),
    MetricSpec("warmup_server_sleeping", "gauge",
               "1 while the model server sleeps as its operator asked (llama-server --sleep-idle-seconds, vLLM /sleep), else 0.",
               unit="short"),
    MetricSpec("warmup_server_asleep_seconds_total", "counter",
               "Seconds the model server has spent asleep, as seen by the agent's reads every watch interval.",
               unit="s"),
    MetricSpec("warmup_server_wakes_total", "counter",
               "Wakes of the sleeping model server, by cause: request (a user request through the proxy), ahead (POST /admin/wake), other (a client the agent did not see).",
               labels=("cause",), unit="short"),
    MetricSpec("warmup_wake_duration_seconds", "gauge",
               "Seconds from the start of the latest wake to SERVING again (the server awake and warmed); 0 before the first wake.",
               unit="s"),
    MetricSpec("warmup_wake_first_user_request_seconds", "gauge",
               "Time to first token of the users' first request after the latest wake, through the proxy, as the user met it: the seconds the proxy held it included; 0 until measured.",
               unit="s"),
)
