"""The metric catalogue: every metric the agent exports, in one place.

Collectors, dashboards, alert rules, docs and tests all read this module, so a
name is spelled once.  Names used by the seed articles are kept verbatim
(`model_loading_phase_duration_seconds`, `warmup_cost_ratio`,
`gpu_fragmentation_rate`, `model_loading_failures_total`) so their alert
expressions work as written; everything else carries the `warmup_` prefix.

`source` says where a value comes from:
  - "agent":  direct instrumentation by the agent while it works;
  - "scrape": read at scrape time (NVML, /proc, the allocator, engine /metrics);
  - "static": set once at start (build info).
`requires` names a condition without which the metric is legitimately absent
(decode_probes: probes that generate more than one token, the openai engine)
("gpu": only with an NVIDIA GPU visible; "breaker" etc. as features land).
"""
from __future__ import annotations

from exporter import (
    catalogue_cache,
    catalogue_engine,
    catalogue_gpu,
    catalogue_quantization,
    catalogue_readiness,
)
from exporter.metric_spec import FIRST_TOKEN_BUCKETS, STAGE_BUCKETS, MetricSpec

__all__ = ["BY_NAME", "CATALOGUE", "CORE", "FEATURE_MODULES", "FIRST_TOKEN_BUCKETS", "STAGE_BUCKETS",
           "MetricSpec", "spec"]

CORE: tuple[MetricSpec, ...] = (
    # --- identity -----------------------------------------------------------
    MetricSpec("warmup_build_info", "info",
               "Agent build and runtime facts; value is always 1.",
               labels=("version", "python", "torch", "engine"), source="static", unit="short"),
    # --- state machine ----------------------------------------------------------
    MetricSpec("warmup_state", "gauge",
               "1 for the state the agent is in now, 0 for every other state.",
               labels=("state",), unit="short",
               doc="States: INIT, PRELOAD, PRIME, SERVING, DEGRADED, SLEEPING, DRAINING, FAILED."),
    MetricSpec("warmup_state_transitions_total", "counter",
               "State transitions applied, by source and target state.",
               labels=("from", "to"), unit="short"),
    MetricSpec("warmup_illegal_transitions_total", "counter",
               "State transitions rejected because the transition table forbids them.",
               labels=("from", "to"), unit="short"),
    MetricSpec("warmup_state_deadline_exceeded_total", "counter",
               "States left because their deadline passed, by state.",
               labels=("state",), unit="short"),
    MetricSpec("warmup_time_to_ready_seconds", "gauge",
               "Seconds from process start to SERVING in the latest warmup, imports and model creation included (absent until SERVING).",
               unit="s"),
    # --- stages -------------------------------------------------------------------
    MetricSpec("model_loading_phase_duration_seconds", "gauge",
               "Duration of each warmup stage in the latest run, in seconds.",
               labels=("phase",), unit="s", seed_name=True,
               doc="phase is reserve, prewarm, solidify or ready (stages 1-4). Seed 003 alerts on phase1 > 0.5 s."),
    MetricSpec("warmup_reserve_step_duration_seconds", "gauge",
               "Duration of each sub-step of stage 1 (reserve) in the latest run, in seconds.",
               labels=("step",), unit="s",
               doc="step is host_facts (NVML), pin_cpus, model_check (config and shard headers), torch_import, "
                   "cuda_init (driver init, device enumeration), cuda_context or memory_reserve; the CUDA steps "
                   "only where the torch engine reserves a GPU.  They add up to nearly the whole reserve phase."),
    MetricSpec("warmup_stage_duration_seconds", "histogram",
               "Distribution of warmup stage durations across runs, in seconds.",
               labels=("stage",), buckets=STAGE_BUCKETS, unit="s"),
    MetricSpec("model_loading_failures_total", "counter",
               "Warmup failures by named reason (config, integrity, memory, deadline, validation...).",
               labels=("reason",), unit="short", seed_name=True),
    MetricSpec("warmup_cost_ratio", "gauge",
               "GPU-seconds spent warming (engine-busy seconds of synthetic traffic, solidify and probes) divided by GPU-seconds since the agent started (one device: seconds since start).",
               unit="percentunit", seed_name=True,
               doc="Seed 003 alerts above 0.15. It falls as the pod serves longer."),
    MetricSpec("warmup_engine_seconds_total", "counter",
               "Seconds the engine was busy on agent-generated work, by kind (warmup, solidify, probe).",
               labels=("kind",), unit="s"),
    # --- traffic ------------------------------------------------------------------
    MetricSpec("warmup_requests_total", "counter",
               "Synthetic requests the agent sent to the engine, by kind (warmup, probe).",
               labels=("kind",), unit="short"),
    MetricSpec("warmup_requests_file_bad_lines", "gauge",
               "Lines of prewarm.requests_file left out of the warmup as bad (prewarm.requests_file_bad_lines: skip), counted when the config was loaded; 0 without a file or with a clean one.",
               unit="short",
               doc="A bad line is not JSON, not UTF-8, truncated, or has a field of the wrong type or range; with policy "
                   "fail (the default) such a file is a config error (exit 2) and the agent never starts. The run "
                   "record's requests_file holds the count and the first line numbers; one warning names them."),
    MetricSpec("warmup_first_token_latency_seconds", "histogram",
               "Time to first token of requests the agent measured, by kind (warmup, probe).",
               labels=("kind",), buckets=FIRST_TOKEN_BUCKETS, unit="s"),
    MetricSpec("warmup_first_token_window_seconds", "gauge",
               "Exact percentile of time to first token over the readiness sliding window (probes).",
               labels=("percentile",), unit="s",
               doc="percentile is p50, p90 or p99; exact over the window (nearest-rank), no sketch error. "
                   "(Not a `quantile` label: Prometheus reserves that for summaries.)"),
    MetricSpec("warmup_readiness_threshold_seconds", "gauge",
               "Readiness thresholds on time to first token: percentile p50 (liveness) and p90 (tail).",
               labels=("percentile",), unit="s"),
    MetricSpec("warmup_first_request_tax_ratio", "gauge",
               "Predicted: the first probe after warmup, less what its control paid too, over the steady probe time: 1 + (first - control) / median of the later probes' time to first token; 1.0 means no cold-start tax. warmup_first_user_request_tax_ratio is what users met.",
               unit="short",
               doc="The control is the same shape with a fresh prompt after the same predecessor (benefit.Controlled): "
                   "a server's ordinary costs, which the control pays too, are not counted as cold start. Where each "
                   "new prompt length pays and this start sent its first probe alone because the server was measured "
                   "before (prewarm.remember_findings), it is 1 + what the second fresh length paid beyond its "
                   "control then: this start's first probe also paid one-time costs no user meets "
                   "(the run record: first_request_new_length_remembered)."),
    MetricSpec("warmup_first_request_tax_remembered", "gauge",
               "1 when warmup_first_request_tax_ratio and its whole-answer twin are remembered from an earlier start's measurement of this server (prewarm.remember_findings), 0 when this start measured them.",
               unit="short",
               doc="A remembering start sends its first probe alone, as a user's first request comes, and exports 1 + "
                   "what a fresh prompt length paid beyond its control when the server was measured (the run record's "
                   "first_request_new_length_remembered says when). Only the users' real figure "
                   "(warmup_first_user_request_tax_ratio) is measured at every start."),
    MetricSpec("warmup_time_per_output_token_window_seconds", "gauge",
               "Exact percentile of time per output token (decode) over the readiness sliding window of probes (openai engine).",
               labels=("percentile",), unit="s",
               doc="Per probe: (whole answer - time to first token) / (output tokens - 1), the interval between "
                   "streamed tokens. percentile is p50, p90 or p99, nearest-rank over the window, like "
                   "warmup_first_token_window_seconds. Only where probes decode (openai engine).",
               requires="decode_probes"),
    MetricSpec("warmup_first_request_total_tax_ratio", "gauge",
               "Predicted: the first probe's whole answer after warmup, less what its control paid too, over the steady whole answer of the same length; 1.0 means no cold-start tax on decode either.",
               unit="short",
               doc="openai engine: the first probe asks for the traffic profile's longest answer, the later ones "
                   "for readiness.probe_max_tokens; the steady whole answer is their median time to first token "
                   "+ (tokens - 1) x their median time per output token (warmup_agent/readiness/probes.py). Where prewarm "
                   "found that decode pays per sequence length, the first probe warms its own lengths, so the "
                   "figure is the first user's whole answer predicted from it: its extra cost per decode step "
                   "at a length nothing had reached, times the mean of such steps left at the profile's prompt "
                   "lengths after the probes (warmup_agent/readiness/cold_decode.py; the run record keeps the probe's own "
                   "as first_probe_total_tax_ratio). Where the second fresh length was remembered, not sent, 1 + "
                   "what it paid on the whole answer then, as warmup_first_request_tax_ratio. In-process engines' "
                   "probes are 1 token."),
    MetricSpec("warmup_first_user_request_tax_ratio", "gauge",
               "Time to first token of the users' real first request after SERVING (through the proxy) divided by the median of the users' answers after it; 0 until measured.",
               unit="short",
               doc="Measured where users' requests pass through the proxy (--proxy-listen): the first request the main "
                   "engine answers with 200 after the gate opened (a re-warm's gate starts again, and sets it back to 0), "
                   "over the median time to first token of the readiness.first_user_steady_requests answers after it "
                   "(warmup_agent/readiness/first_user.py). The real counterpart of warmup_first_request_tax_ratio; "
                   "WarmupAgentFirstRequestTaxHigh reads it when it is above 0."),
    MetricSpec("warmup_first_user_request_total_tax_ratio", "gauge",
               "Whole-answer time of the users' real first request after SERVING over the steady whole answer of the same length from the users' answers after it; 0 until measured.",
               unit="short",
               doc="Steady whole answer: the later answers' median time to first token + (the first answer's tokens - 1) x "
                   "their median time per output token. Tokens: the answer's usage, else for a stream without usage its "
                   "content chunks counted by the proxy (proxy/stream_tokens.py); 0 while unknown. The real counterpart of warmup_first_request_total_tax_ratio."),
    MetricSpec("warmup_per_length_decode_ratio", "gauge",
               "Time per output token at sequence lengths no earlier request reached, over that of their controls at the same lengths (prewarm's per-length test); above prewarm.per_length_ratio the server pays per sequence length.",
               unit="short",
               doc="0 until measured (the in-process engines never measure it). The better of two requests at new prompt lengths over their controls (the same lengths again). An eager "
                   "server whose attention builds a plan per shape (transformers serve on a GPU) measured "
                   "about 3; llama.cpp and vLLM about 1."),
    MetricSpec("warmup_per_length_remedy_info", "gauge",
               "1, with the remedy as a label, when prewarm measured that the server pays per sequence length; absent when it does not.",
               labels=("remedy",), unit="short", requires="decode_probes",
               doc="A gauge, not an info metric: an info metric without labels set would still expose a series "
                   "and read as a finding on every pod."),
    MetricSpec("warmup_server_remedy_applied_info", "gauge",
               "1, with the environment as a label, when the agent started its supervised server with the remedy for a per-sequence-length cost (openai.apply_server_remedy); absent otherwise.",
               labels=("remedy",), unit="short", requires="decode_probes",
               doc="A gauge, not an info metric, for the same reason as warmup_per_length_remedy_info."),
    MetricSpec("warmup_paths", "gauge",
               "Warmup paths (endpoint x sampling family x batch size x prompt length) by what the measured-benefit warmup did with them.",
               labels=("result",), unit="short", requires="decode_probes",
               doc="result: warm_on_first_call, converged, still_improving, skipped (budget or a refused family). "
                   "The run record's prewarm stage lists every path with its calls."),
    MetricSpec("warmup_budget_seconds", "gauge",
               "Time budget of the measured-benefit warmup: prewarm.budget_ratio x the server's own start-up, at least prewarm.budget_min_seconds (or prewarm.budget_seconds); 0 for the in-process engines, which warm their shape grid without one.",
               unit="s"),
    MetricSpec("warmup_budget_spent_seconds", "gauge",
               "Seconds the measured-benefit warmup took before SERVING, from its first request after discovery to its per-length test's last probe; over warmup_budget_seconds, it overspent.",
               unit="s",
               doc="The run record's warmup.budget.spent_seconds. The budget is checked before each request, so one "
                   "request (or the per-length test's probe pair, which measures rather than warms) can end past it. "
                   "Not counted: the server's own start-up and the gate's probes after prewarm. 0 for the in-process engines."),
    # --- process ------------------------------------------------------------------
    MetricSpec("warmup_memory_jitter_ratio", "gauge",
               "Resident-memory jitter of the agent process: (max RSS - min RSS) / mean RSS over the sampling window.",
               unit="percentunit", source="agent",
               doc="Seed 000 §2.3 (ΔRSS / mean RSS); SOTA line 0.023. Sampled every 100 ms over the last 60 s."),
    # prometheus_client's ProcessCollector(namespace="warmup") writes these, with its own
    # help texts (exporter/collectors.py process_collector); absent where there is no /proc.
    MetricSpec("warmup_process_resident_memory_bytes", "gauge",
               "Resident memory size in bytes.",
               unit="bytes", source="scrape",
               doc="Of the agent process: the model is included with an in-process engine (torch), not with the "
                   "openai engine, whose server is another process."),
    MetricSpec("warmup_process_virtual_memory_bytes", "gauge",
               "Virtual memory size in bytes.",
               unit="bytes", source="scrape", doc="Of the agent process."),
    MetricSpec("warmup_process_cpu_seconds_total", "counter",
               "Total user and system CPU time spent in seconds.",
               unit="s", source="scrape", doc="Of the agent process; rate() of it is the CPU cores it keeps busy."),
    MetricSpec("warmup_process_open_fds", "gauge",
               "Number of open file descriptors.",
               unit="short", source="scrape", doc="Of the agent process."),
    MetricSpec("warmup_process_max_fds", "gauge",
               "Maximum number of open file descriptors.",
               unit="short", source="scrape", doc="The agent process's soft limit (RLIMIT_NOFILE)."),
    MetricSpec("warmup_process_start_time_seconds", "gauge",
               "Start time of the process since unix epoch in seconds.",
               unit="s", source="scrape",
               doc="Of the agent process; a server the agent spawns has a start time of its own (`time() - "
                   "warmup_process_start_time_seconds` is the agent's uptime)."),
    # --- GPU (NVML / allocator), absent without a GPU --------------------------------
    MetricSpec("warmup_gpu_memory_used_bytes", "gauge",
               "GPU memory in use per device, from NVML.",
               labels=("gpu", "uuid"), unit="bytes", source="scrape", requires="gpu"),
    MetricSpec("warmup_gpu_memory_total_bytes", "gauge",
               "GPU memory size per device, from NVML.",
               labels=("gpu", "uuid"), unit="bytes", source="scrape", requires="gpu"),
    MetricSpec("warmup_gpu_utilization_ratio", "gauge",
               "GPU compute utilisation per device (0..1) over NVML's last sample period.",
               labels=("gpu", "uuid"), unit="percentunit", source="scrape", requires="gpu"),
    MetricSpec("gpu_fragmentation_rate", "gauge",
               "Free bytes stranded in caching-allocator segments that still hold a live allocation (torch.cuda.memory_stats inactive_split_bytes) divided by the bytes the allocator reserves, per GPU (0..1); close to 0 on a freshly warmed pod.",
               labels=("gpu", "uuid"), unit="percentunit", source="scrape", requires="gpu", seed_name=True,
               doc="From torch.cuda.memory_snapshot() of the agent's own process: a free block counts when its segment also holds a "
                   "live block (the allocator can neither release that segment nor reuse the hole for a larger request); a wholly "
                   "free segment does not.  gpu is the physical NVML index, uuid the GPU UUID.  Present with the torch engine on a GPU "
                   "(and with vllm only when its engine core runs in the agent's process); absent with the openai engine, whose server is another process (the agent's allocator "
                   "holds no GPU memory there), and for a GPU on which the allocator reserves nothing.  Measured on a GPU "
                   "(Qwen2-1.5B shape, default config): 0.0145 freshly warmed (the old 1 - largest free block / free bytes read "
                   "0.586 on the same pod).  Seed 003 alerts above 0.3 (seen rising 12 % -> 43 % in 30 days)."),
)

# Features add their metrics in a module of their own (exporter/catalogue_<feature>.py
# with a SPECS tuple, importing MetricSpec from exporter/metric_spec.py); import it
# above and list it here once, in the order docs/metrics.md shows them.
FEATURE_MODULES = (catalogue_engine, catalogue_cache, catalogue_readiness, catalogue_gpu, catalogue_quantization)

CATALOGUE: tuple[MetricSpec, ...] = CORE + tuple(s for m in FEATURE_MODULES for s in m.SPECS)
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOGUE}
assert len(BY_NAME) == len(CATALOGUE), "duplicate metric name in catalogue"


def spec(name: str) -> MetricSpec:
    return BY_NAME[name]
