"""Where the agent's stats become metric updates (issue 42), as in vLLM's
`PrometheusStatLogger.record()` (vllm/v1/metrics/loggers.py).

The driver, readiness and the stages fill the small records below; `Recorder`
turns each into the gauge, histogram and counter updates it feeds, here and
nowhere else.  A probe's time to first token, for one, reaches every metric it
feeds through this module:
  - `batch(BatchStats)`: warmup_requests_total, warmup_first_token_latency_seconds
    and warmup_engine_seconds_total{kind} (the driver, per batch of agent traffic);
  - `decode_window(WindowStats)`: warmup_time_per_output_token_window_seconds
    (the probe log's decode window, StageContext.probe);
  - `first_token_window(WindowStats)` and `thresholds(ThresholdStats)`:
    warmup_first_token_window_seconds, warmup_readiness_threshold_seconds and
    warmup_readiness_threshold_refits_total (readiness/runtime.py);
  - `first_request(TaxStats)`: the first-request tax gauges (the ready stage, once
    the gate opens).

A record carries plain values (numbers, strings, mappings), never an agent
object: exporter/ imports nothing of the agent's internals
(tests/test_import_graph.py), so the records are declared here and the agent
imports them.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only
    from exporter.metrics import AgentMetrics


def percentile_label(q: float) -> str:
    """0.5 -> "p50", 0.99 -> "p99" (the `percentile` label of the window gauges)."""
    return f"p{q * 100:g}"


# -- agent traffic and the probes ---------------------------------------------------------
@dataclass(frozen=True)
class BatchStats:
    """One call into the engine by the agent (driver.py).  With `first_token_seconds`,
    a batch of `requests` requests (the slowest first token of the batch); without,
    a stage's own engine calls, whose engine-seconds alone count."""
    kind: str
    engine_seconds: float
    requests: int = 0
    first_token_seconds: float | None = None


@dataclass(frozen=True)
class WindowStats:
    """A window's quantiles, {0.5: s, 0.9: s, ...}."""
    quantiles: Mapping[float, float]


@dataclass(frozen=True)
class ThresholdStats:
    """The readiness thresholds in force, {"p50": s, "p90": s}; `refit`: the adaptive
    thresholds were just re-fitted."""
    in_force: Mapping[str, float]
    refit: bool = False


@dataclass(frozen=True)
class TaxStats:
    """A first request's figures: its time-to-first-token and whole-answer tax
    (ratios over the steady level); None: not measured."""
    ttft_tax: float | None
    total_tax: float | None
    #: the probe's figures are 1 + an earlier start's measured excess (probes.FirstRequest.new_length)
    remembered: bool = False


@dataclass(frozen=True)
class LifeStats:
    """The server's life after SERVING (readiness/life.py): a restart noticed (how),
    its sleep state now, seconds asleep since the last record, a wake started
    (`wake_cause`) or finished (`wake_seconds`), the users' first request after it."""
    restart: str | None = None
    sleeping: bool | None = None
    asleep_seconds: float = 0.0
    wake_cause: str | None = None
    wake_seconds: float | None = None
    wake_first_user_seconds: float | None = None


@dataclass(frozen=True)
class LearnedStats:
    """The traffic profile learned from users (readiness/traffic_memory.py): its shape
    bins, its decayed request weight, and when its newest request came (Unix seconds)."""
    shapes: int
    requests: float
    updated_at: float | None


RESTART_SIGNALS = ("start_time", "came_back", "supervisor")
WAKE_CAUSES = ("request", "ahead", "other")


# -- the state machine, the breaker, the watch probes ---------------------------------------
@dataclass(frozen=True)
class StateStats:
    """The state machine (states.py): the state now; `before` when a transition
    before -> state was applied, `rejected` when an illegal state -> rejected was
    refused, `deadline_exceeded` when the state's deadline passed."""
    state: str
    before: str | None = None
    rejected: str | None = None
    deadline_exceeded: bool = False


@dataclass(frozen=True)
class FailureStats:
    """A named failure (failures.REASONS): the run failed, or the supervised server crashed."""
    reason: str


@dataclass(frozen=True)
class BreakerStats:
    """The fallback breaker (readiness/runtime.py): its state now (one of `states`) and
    whether the main path is frozen; `before` when it moved before -> state, `trip`
    (the cause) when that move was a trip from closed."""
    state: str
    states: Sequence[str]
    main_frozen: bool
    before: str | None = None
    trip: str | None = None


@dataclass(frozen=True)
class ProbeFailureStats:
    """A failed probe of the main engine, by cause (readiness/runtime.FAILURE_CAUSES)."""
    cause: str


@dataclass(frozen=True)
class StageStats:
    """One stage's duration, as it ended (pipeline.py)."""
    stage: str
    seconds: float


@dataclass(frozen=True)
class ServingStats:
    """The run reached SERVING, `time_to_ready_seconds` after its start."""
    time_to_ready_seconds: float


@dataclass(frozen=True)
class CacheStats:
    """The kernel cache (kernel_cache/cache.py): lookups by (tier, result), entries
    published or skipped (the reason), a lock waited on and for how long, an
    invalidation applied, local entries evicted, bytes per tier, the shared tier's state."""
    lookups: Mapping[tuple[str, str], int] = field(default_factory=dict)
    published: int = 0
    publish_skipped: str | None = None
    lock_waited: bool = False
    lock_wait_seconds: float | None = None
    invalidated: bool = False
    evicted_local: int = 0
    bytes_by_tier: Mapping[str, int] = field(default_factory=dict)
    degraded: bool | None = None


CACHE_RESULTS = {"local": ("hit", "miss"), "shared": ("hit", "miss", "rejected", "error")}


@dataclass(frozen=True)
class Known:
    """Label values known before their first event.  `declare_series` starts their
    series at 0 (Prometheus practice: increase() and absent() need the series before
    the first event, and on-call reads these first)."""
    states: Sequence[str] = ()
    initial_state: str | None = None
    failure_reasons: Sequence[str] = ()
    illegal_transitions: Sequence[tuple[str, str]] = ()
    breaker_moves: Sequence[tuple[str, str]] = ()
    trip_causes: Sequence[str] = ()
    probe_failure_causes: Sequence[str] = ()
    checks: Sequence[str] = ()
    check_results: Sequence[str] = ()
    life: bool = False
    kernel_cache: bool = False


@dataclass(frozen=True)
class BuildInfo:
    """warmup_build_info's labels."""
    version: str
    python: str
    torch: str
    engine: str


@dataclass(frozen=True)
class LiveGauges:
    """Gauges read at scrape time: each callable returns the value then."""
    memory_jitter: Callable[[], float] | None = None
    cost: Callable[[], float] | None = None
    water_level: Callable[[], float] | None = None


# -- the stages -------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuId:
    """The `gpu` and `uuid` labels of a per-GPU gauge."""
    index: int
    uuid: str


@dataclass(frozen=True)
class ReserveStats:
    """reserve: one timed sub-step, or the bytes reserved on a GPU."""
    step: str | None = None
    step_seconds: float = 0.0
    gpu: GpuId | None = None
    reserved_bytes: int | None = None


@dataclass(frozen=True)
class LoadStats:
    """prewarm, loading: the remedy the server was started with, the model's
    quantization labels, the weights' load rate (bytes over seconds)."""
    server_remedy: str | None = None
    quantization: Mapping[str, str] | None = None
    weight_bytes: int = 0
    weight_seconds: float = 0.0


@dataclass(frozen=True)
class WarmupStats:
    """prewarm, the measured-benefit warmup: its budget, the per-length test's decode
    ratios and remedy, how many paths ended how ({result: n})."""
    budget_seconds: float | None = None
    budget_spent_seconds: float | None = None
    per_length_ratios: list[float] = field(default_factory=list)
    per_length_remedy: str | None = None
    paths: Mapping[str, int] | None = None


@dataclass(frozen=True)
class SolidifyStats:
    """solidify: why it fell back (its text before the first ":" is the label), the
    CUDA graphs captured on `gpu`, the GPU utilisation ramp's slope."""
    fallback_reason: str | None = None
    gpu: GpuId | None = None
    cuda_graphs: int | None = None
    ramp_slope: float | None = None


@dataclass(frozen=True)
class CheckStats:
    """ready: one validation check's outcome; for the FP8 range check, its ranges
    ({name: {"checked": n, "saturated": n, "max_error": r}})."""
    check: str
    result: str | None = None
    fp8_ranges: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


class Recorder:
    """Turns the records above into updates of the agent's metrics (`AgentMetrics`)."""

    def __init__(self, metrics: AgentMetrics):
        self.metrics = metrics

    # -- agent traffic and the probes -------------------------------------------------
    def batch(self, s: BatchStats) -> None:
        m = self.metrics
        if s.first_token_seconds is not None:
            m.warmup_requests_total.labels(kind=s.kind).inc(s.requests)
            m.warmup_first_token_latency_seconds.labels(kind=s.kind).observe(s.first_token_seconds)
        m.warmup_engine_seconds_total.labels(kind=s.kind).inc(s.engine_seconds)

    def decode_window(self, s: WindowStats) -> None:
        for q, v in s.quantiles.items():
            self.metrics.warmup_time_per_output_token_window_seconds.labels(percentile=percentile_label(q)).set(v)

    def first_token_window(self, s: WindowStats) -> None:
        for q, v in s.quantiles.items():
            self.metrics.warmup_first_token_window_seconds.labels(percentile=percentile_label(q)).set(v)

    def thresholds(self, s: ThresholdStats) -> None:
        if s.refit:
            self.metrics.warmup_readiness_threshold_refits_total.inc()
        for label, v in s.in_force.items():
            self.metrics.warmup_readiness_threshold_seconds.labels(percentile=label).set(v)

    def first_request(self, s: TaxStats) -> None:
        """The gate's first probe, standing for the first user request (probes.py)."""
        if s.ttft_tax is not None:
            self.metrics.warmup_first_request_tax_ratio.set(s.ttft_tax)
        if s.total_tax is not None:
            self.metrics.warmup_first_request_total_tax_ratio.set(s.total_tax)
        if s.ttft_tax is not None or s.total_tax is not None:
            self.metrics.warmup_first_request_tax_remembered.set(1 if s.remembered else 0)

    def first_user_request(self, s: TaxStats) -> None:
        """The users' real first request (first_user.py); 0 means "not measured yet"
        (the alert then reads the predicted figure)."""
        self.metrics.warmup_first_user_request_tax_ratio.set(s.ttft_tax or 0.0)
        self.metrics.warmup_first_user_request_total_tax_ratio.set(s.total_tax or 0.0)

    def life(self, s: LifeStats) -> None:
        m = self.metrics
        if s.restart is not None:
            m.warmup_server_restarts_total.labels(detected_by=s.restart).inc()
        if s.sleeping is not None:
            m.warmup_server_sleeping.set(1 if s.sleeping else 0)
        if s.asleep_seconds > 0:
            m.warmup_server_asleep_seconds_total.inc(s.asleep_seconds)
        if s.wake_cause is not None:
            m.warmup_server_wakes_total.labels(cause=s.wake_cause).inc()
        if s.wake_seconds is not None:
            m.warmup_wake_duration_seconds.set(s.wake_seconds)
        if s.wake_first_user_seconds is not None:
            m.warmup_wake_first_user_request_seconds.set(s.wake_first_user_seconds)

    def behind_users(self, pending: bool, seconds: float | None = None) -> None:
        """The warm-up behind the users: whether it has requests left, and how long the last one took."""
        m = self.metrics
        m.warmup_behind_users_pending.set(1 if pending else 0)
        if seconds is not None:
            m.warmup_behind_users_seconds.set(seconds)

    def learned(self, s: LearnedStats) -> None:
        m = self.metrics
        m.warmup_learned_profile_shapes.set(s.shapes)
        m.warmup_learned_profile_requests.set(s.requests)
        if s.updated_at is not None:
            m.warmup_learned_profile_updated_timestamp_seconds.set(s.updated_at)

    # -- the state machine, the breaker, the watch probes -------------------------------
    def state(self, s: StateStats) -> None:
        m = self.metrics
        if s.rejected is not None:
            m.warmup_illegal_transitions_total.labels(**{"from": s.state, "to": s.rejected}).inc()
            return
        if s.deadline_exceeded:
            m.warmup_state_deadline_exceeded_total.labels(state=s.state).inc()
            return
        if s.before is not None:
            m.warmup_state_transitions_total.labels(**{"from": s.before, "to": s.state}).inc()
            m.warmup_state.labels(state=s.before).set(0)
        m.warmup_state.labels(state=s.state).set(1)

    def failure(self, s: FailureStats) -> None:
        self.metrics.model_loading_failures_total.labels(reason=s.reason).inc()

    def breaker(self, s: BreakerStats) -> None:
        m = self.metrics
        if s.before is not None:
            m.warmup_breaker_transitions_total.labels(**{"from": s.before, "to": s.state}).inc()
        if s.trip is not None:
            m.warmup_breaker_trips_total.labels(reason=s.trip).inc()
        for state in s.states:
            m.warmup_breaker_state.labels(state=state).set(1 if state == s.state else 0)
        m.warmup_fallback_active.set(1 if s.main_frozen else 0)

    def probe_failure(self, s: ProbeFailureStats) -> None:
        self.metrics.warmup_watch_probe_failures_total.labels(reason=s.cause).inc()

    # -- the run ----------------------------------------------------------------------
    def stage(self, s: StageStats) -> None:
        self.metrics.model_loading_phase_duration_seconds.labels(phase=s.stage).set(s.seconds)
        self.metrics.warmup_stage_duration_seconds.labels(stage=s.stage).observe(s.seconds)

    def serving(self, s: ServingStats) -> None:
        self.metrics.warmup_time_to_ready_seconds.set(s.time_to_ready_seconds)

    def build(self, s: BuildInfo) -> None:
        self.metrics.warmup_build_info.info({"version": s.version, "python": s.python, "torch": s.torch,
                                             "engine": s.engine})

    def requests_file(self, bad_lines: int) -> None:
        """prewarm.requests_file: lines that could not be read."""
        self.metrics.warmup_requests_file_bad_lines.set(bad_lines)

    def live(self, s: LiveGauges) -> None:
        m = self.metrics
        if s.memory_jitter is not None:
            m.warmup_memory_jitter_ratio.set_function(s.memory_jitter)
        if s.cost is not None:
            m.warmup_cost_ratio.set_function(s.cost)
        if s.water_level is not None:
            m.warmup_water_level_requests_per_second.set_function(s.water_level)

    def cache(self, s: CacheStats) -> None:
        m = self.metrics
        for (tier, result), n in s.lookups.items():
            if n:
                m.warmup_kernel_cache_requests_total.labels(tier=tier, result=result).inc(n)
        if s.published:
            m.warmup_kernel_cache_publishes_total.inc(s.published)
        if s.publish_skipped is not None:
            m.warmup_kernel_cache_publish_skipped_total.labels(reason=s.publish_skipped).inc()
        if s.lock_waited:
            m.warmup_kernel_cache_lock_waits_total.inc()
        if s.lock_wait_seconds is not None:
            m.warmup_kernel_cache_lock_wait_seconds.observe(s.lock_wait_seconds)
        if s.invalidated:
            m.warmup_kernel_cache_invalidations_total.inc()
        if s.evicted_local:
            m.warmup_kernel_cache_evictions_total.labels(tier="local").inc(s.evicted_local)
        for tier, n in s.bytes_by_tier.items():
            m.warmup_kernel_cache_bytes.labels(tier=tier).set(n)
        if s.degraded is not None:
            m.warmup_kernel_cache_degraded.set(1 if s.degraded else 0)

    # -- zero series --------------------------------------------------------------------
    def declare_series(self, k: Known) -> None:
        """Every series of `k` at 0 (see Known); the one place that sets up zero series."""
        m = self.metrics
        for state in k.states:
            m.warmup_state.labels(state=state).set(1 if state == k.initial_state else 0)
        for reason in k.failure_reasons:
            m.model_loading_failures_total.labels(reason=reason)
        for frm, to in k.illegal_transitions:
            m.warmup_illegal_transitions_total.labels(**{"from": frm, "to": to})
        for frm, to in k.breaker_moves:
            m.warmup_breaker_transitions_total.labels(**{"from": frm, "to": to})
        for cause in k.trip_causes:
            m.warmup_breaker_trips_total.labels(reason=cause)
        for cause in k.probe_failure_causes:
            m.warmup_watch_probe_failures_total.labels(reason=cause)
        for check in k.checks:
            for result in k.check_results:
                m.warmup_validation_checks_total.labels(check=check, result=result)
        if k.life:
            for signal in RESTART_SIGNALS:
                m.warmup_server_restarts_total.labels(detected_by=signal)
            for cause in WAKE_CAUSES:
                m.warmup_server_wakes_total.labels(cause=cause)
            m.warmup_server_sleeping.set(0)
            m.warmup_wake_duration_seconds.set(0)
            m.warmup_wake_first_user_request_seconds.set(0)
        if k.kernel_cache:
            for tier, results in CACHE_RESULTS.items():
                for result in results:
                    m.warmup_kernel_cache_requests_total.labels(tier=tier, result=result)
            m.warmup_kernel_cache_degraded.set(0)

    # -- the stages ---------------------------------------------------------------------
    def reserve(self, s: ReserveStats) -> None:
        if s.step is not None:
            self.metrics.warmup_reserve_step_duration_seconds.labels(step=s.step).set(s.step_seconds)
        if s.gpu is not None and s.reserved_bytes is not None:
            self.metrics.warmup_gpu_memory_reserved_bytes.labels(gpu=str(s.gpu.index), uuid=s.gpu.uuid).set(
                s.reserved_bytes)

    def load(self, s: LoadStats) -> None:
        m = self.metrics
        if s.server_remedy:
            m.warmup_server_remedy_applied_info.labels(remedy=s.server_remedy).set(1)
        if s.quantization is not None:
            m.warmup_model_quantization_info.info(dict(s.quantization))
        if s.weight_seconds > 0:
            m.warmup_weight_load_bytes_per_second.set(s.weight_bytes / s.weight_seconds)

    def warmup(self, s: WarmupStats) -> None:
        m = self.metrics
        if s.budget_seconds is not None:
            m.warmup_budget_seconds.set(s.budget_seconds)
        if s.budget_spent_seconds is not None:
            m.warmup_budget_spent_seconds.set(s.budget_spent_seconds)
        if s.per_length_ratios:
            m.warmup_per_length_decode_ratio.set(min(s.per_length_ratios))
        if s.per_length_remedy is not None:
            m.warmup_per_length_remedy_info.labels(remedy=s.per_length_remedy).set(1)
        for result, n in (s.paths or {}).items():
            m.warmup_paths.labels(result=result).set(n)

    def solidify(self, s: SolidifyStats) -> None:
        m = self.metrics
        if s.fallback_reason:
            m.warmup_solidify_fallbacks_total.labels(reason=s.fallback_reason.split(":")[0]).inc()
        if s.gpu is not None and s.cuda_graphs is not None:
            m.warmup_cuda_graphs.labels(gpu=str(s.gpu.index), uuid=s.gpu.uuid).set(s.cuda_graphs)
        if s.gpu is not None and s.ramp_slope is not None:
            m.warmup_gpu_utilization_ramp_slope.labels(gpu=str(s.gpu.index), uuid=s.gpu.uuid).set(s.ramp_slope)

    def check(self, s: CheckStats) -> None:
        """A validation outcome (with `result`), and/or the FP8 ranges it measured."""
        m = self.metrics
        for name, r in s.fp8_ranges.items():
            m.warmup_fp8_range_checked_values.labels(range=name).set(r["checked"])
            m.warmup_fp8_range_saturated_values.labels(range=name).set(r["saturated"])
            m.warmup_fp8_range_roundtrip_error_ratio.labels(range=name).set(r["max_error"])
        if s.result is not None:
            m.warmup_validation_checks_total.labels(check=s.check, result=s.result).inc()
