"""Start-up traces: one OpenTelemetry span per stage and timed step, exported over OTLP.

The root `warmup.startup` spans process start to SERVING or FAILED, with a child per stage;
a re-warm is a trace of its own, rooted at `warmup.rewarm`.  The agent's thread only queues
plain dicts; after the start ends, a background thread imports the SDK and makes the spans
with the record's timestamps, so tracing costs the start nothing, not even the import.
The trace ID is chosen up front so the `[COLDSTART]` lines carry it from the first line.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # types only
    from warmup_agent.config_sections import OpenaiSection, TracingSection
    from warmup_agent.engines.base import Engine
    from warmup_agent.host.hardware import GPUFacts
    from warmup_agent.run.timeline import StageTiming
    from warmup_agent.states import StateMachine


class _Context(Protocol):
    @property
    def gpu(self) -> GPUFacts | None: ...


class _RunSettings(Protocol):
    """What the tracer reads of the run's configuration."""
    @property
    def engine(self) -> str: ...
    @property
    def openai(self) -> OpenaiSection: ...


class _Driver(Protocol):
    def engine_seconds(self, kind: str | None = None) -> float: ...


class Agent(Protocol):
    """What the tracer reads of the run, declared here so tracing imports nothing of the pipeline."""
    @property
    def cfg(self) -> _RunSettings: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def driver(self) -> _Driver: ...
    @property
    def sm(self) -> StateMachine: ...
    @property
    def context(self) -> _Context: ...
    @property
    def started(self) -> float: ...
    @property
    def startup(self) -> StageTiming | None: ...
    @property
    def serving_at(self) -> float | None: ...
    @property
    def probes(self) -> list[float]: ...
    @property
    def probe_totals(self) -> list[float]: ...
    def clock(self) -> float: ...
    def record(self) -> dict: ...

log = logging.getLogger("warmup_agent.tracing")

PROTOCOLS = ("grpc", "http/protobuf")
EXPORTERS = {"grpc": "opentelemetry-exporter-otlp-proto-grpc", "http/protobuf": "opentelemetry-exporter-otlp-proto-http"}
ROOT_SPAN = "warmup.startup"
REWARM_SPAN = "warmup.rewarm"
# The order of prewarm's timed steps (its `seconds` dict may be filled in another order).
PREWARM_STEPS = ("weights", "tokenizer", "fingerprint", "traffic")
MAX_ATTRIBUTES = 100          # per span; the SDK's default limit is 128
IMPORT_WAIT_SECONDS = 10.0    # at exit: the longest wait for the SDK import


@dataclass(frozen=True)
class Settings:
    protocol: str             # grpc | http/protobuf
    endpoint: str             # full URL (http/protobuf: ending in the traces path)
    service_name: str
    timeout: float            # seconds: one export, and the wait at exit


def enabled(tracing: TracingSection, environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return bool(tracing.enabled) and env.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def settings(tracing: TracingSection, environ: Mapping[str, str] | None = None) -> Settings:
    """The exporter's settings: `tracing.*` keys, else OTEL_EXPORTER_OTLP_* variables, else OTLP defaults."""
    env = os.environ if environ is None else environ
    protocol = (tracing.protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    if protocol not in PROTOCOLS:
        log.warning("OTLP protocol %r is not supported (only %s): using grpc", protocol, ", ".join(PROTOCOLS))
        protocol = "grpc"
    http = protocol == "http/protobuf"
    if tracing.endpoint:
        endpoint = _base(tracing.endpoint, http)
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        endpoint = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip()   # used as given (OTLP spec)
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = _base(env["OTEL_EXPORTER_OTLP_ENDPOINT"], http)
    else:
        endpoint = "http://localhost:4318/v1/traces" if http else "http://localhost:4317"
    service = env.get("OTEL_SERVICE_NAME", "").strip() or "warmup-agent"
    return Settings(protocol, endpoint, service, tracing.export_timeout_seconds)


def _base(url: str, http: bool) -> str:
    """A base endpoint with /v1/traces appended for HTTP; gRPC takes it as it is."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    if http and not url.rstrip("/").endswith("/v1/traces"):
        url = url.rstrip("/") + "/v1/traces"
    return url


class Tracing:
    """No tracing: every hook does nothing.  `OtlpTracing` overrides them."""

    trace_id: str | None = None       # the start-up trace (the run record)

    @property
    def current_trace_id(self) -> str | None:
        """The trace now open: the start-up's or a re-warm's."""
        return None

    def run_started(self, agent: Agent) -> None:
        pass

    def stage_finished(self, agent: Agent, timing: StageTiming) -> None:
        pass

    def run_finished(self, agent: Agent) -> None:
        pass

    def shutdown(self) -> None:
        pass


NOOP = Tracing()
_active: Tracing = NOOP


def active() -> Tracing:
    """The tracer the CLI set up (`setup`), else NOOP; the Agent takes it at construction."""
    return _active


def current_trace_id() -> str | None:
    return _active.current_trace_id


def setup(tracing: TracingSection, env: Mapping[str, str] | None = None) -> Tracing:
    """Make the process's tracer from the `tracing.*` section; NOOP, importing nothing, when off."""
    global _active
    if not enabled(tracing, env):
        return NOOP
    s = settings(tracing, env)
    missing = [d for d in ("opentelemetry-sdk", EXPORTERS[s.protocol]) if not installed(d)]
    if missing:
        log.warning("tracing.enabled is set but %s is not installed: no start-up traces "
                    "(pip install 'warmup-agent[otel]')", " and ".join(missing))
        return NOOP
    _active = OtlpTracing(s)
    log.info("start-up traces on: OTLP %s to %s (service.name %s)", s.protocol, s.endpoint, s.service_name)
    return _active


def installed(distribution: str) -> bool:
    """Whether a distribution is installed, read from its metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


def shutdown() -> None:
    """Flush and stop the active tracer (at most its export timeout); NOOP after."""
    global _active
    tracer, _active = _active, NOOP
    tracer.shutdown()


@dataclass
class SpanSpec:
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: str | None = None               # status ERROR with this description
    children: list[SpanSpec] | None = None


@dataclass
class _Trace:
    trace_id: int
    name: str
    origin_ns: int | None = None           # epoch ns of the agent's clock origin (agent.started)
    root_start_ns: int | None = None
    last_end_ns: int = 0                   # the root ends no earlier than its last child
    open: bool = True


def _new_id(bits: int) -> int:
    while True:
        value = secrets.randbits(bits)
        if value:
            return value


def attribute_value(v: Any) -> Any:
    """An OTLP attribute value, or None when `v` has no faithful one (nested data)."""
    if isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and v:
        kinds = {type(x) for x in v}
        if len(kinds) == 1 and kinds <= {bool, int, float, str}:
            return list(v)
        if kinds <= {int, float}:
            return [float(x) for x in v]
    return None


def flatten(prefix: str, data: dict, out: dict[str, Any] | None = None, depth: int = 3) -> dict[str, Any]:
    """Scalar and list-of-scalar values of `data` as `prefix.key[.subkey...]` attributes."""
    out = {} if out is None else out
    for key, value in data.items():
        if len(out) >= MAX_ATTRIBUTES:
            break
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            if depth > 1:
                flatten(name, value, out, depth - 1)
            continue
        v = attribute_value(value)
        if v is not None:
            out[name] = v
    return out


def model_name(agent: Agent) -> str | None:
    """gen_ai.request.model: the served name sent in requests, else the model directory's name."""
    served = agent.cfg.openai.model if agent.cfg.engine == "openai" else None
    path = agent.engine.model_path
    return served or (os.path.basename(os.path.normpath(path)) if path else None)


def _sequential(prefix: str, start_ns: int, steps: list[tuple[str, float]], attrs: dict[str, dict]) -> list[SpanSpec]:
    """Spans for timed steps laid end to end from `start_ns`: the record holds only durations."""
    out, t = [], start_ns
    for name, seconds in steps:
        if not isinstance(seconds, (int, float)) or seconds < 0:
            continue
        end = t + round(seconds * 1e9)
        out.append(SpanSpec(f"{prefix}.{name}", t, end, {"warmup.step": name, "warmup.step.seconds": float(seconds),
                                                         **attrs.get(name, {})}))
        t = end
    return out


class OtlpTracing(Tracing):
    """Spans for the start-up and each re-warm, exported from a background thread."""

    def __init__(self, s: Settings):
        self.settings = s
        self._lock = threading.Lock()
        self._trace: _Trace | None = None             # the open trace
        self._startup: _Trace | None = None
        self._probe_mark = 0                          # agent.probes already in a span
        self._solidify_mark = 0.0                     # warmup_engine_seconds_total{solidify} already in a span
        self._queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._worker = _Worker(s, self._queue)
        self._thread = threading.Thread(target=self._worker.run, name="otel-traces", daemon=True)
        self._thread.start()

    # Hooks run on the agent's thread and never raise.
    @property
    def current_trace_id(self) -> str | None:
        tr = self._trace if self._trace is not None and self._trace.open else self._startup
        return None if tr is None else format(tr.trace_id, "032x")

    def run_started(self, agent: Agent) -> None:
        with self._lock:
            self._startup = self._trace = _Trace(_new_id(128), ROOT_SPAN)
            self.trace_id = format(self._trace.trace_id, "032x")

    def stage_finished(self, agent: Agent, timing: StageTiming) -> None:
        try:
            with self._lock:
                self._stage_finished(agent, timing)
        except Exception:  # noqa: BLE001 - tracing never fails a start
            log.debug("tracing: stage %s not traced", timing.name, exc_info=True)

    def run_finished(self, agent: Agent) -> None:
        try:
            with self._lock:
                tr = self._trace
                if tr is None or not tr.open:
                    return
                self._origin(agent, tr)
                self._end_root(agent, tr, end_ns=self._ns(tr, (agent.serving_at or agent.clock()) - agent.started))
        except Exception:  # noqa: BLE001 - tracing never fails a start
            log.debug("tracing: root span not traced", exc_info=True)

    def shutdown(self) -> None:
        self._queue.put(("stop",))
        # Only the collector's part is bounded by the export timeout.
        self._worker.ready.wait(IMPORT_WAIT_SECONDS)
        self._thread.join(self.settings.timeout + 0.5)
        if self._thread.is_alive():
            log.warning("start-up traces: not all spans were exported within %.1fs", self.settings.timeout)

    def _origin(self, agent: Agent, tr: _Trace) -> int:
        if tr.origin_ns is None:   # agent.started is final once run() has begun
            tr.origin_ns = time.time_ns() - round((agent.clock() - agent.started) * 1e9)
        return tr.origin_ns

    def _ns(self, tr: _Trace, seconds: float) -> int:
        assert tr.origin_ns is not None
        return tr.origin_ns + round(seconds * 1e9)

    def _stage_finished(self, agent: Agent, timing: StageTiming) -> None:
        tr = self._trace
        if tr is None or not tr.open:          # a re-warm: a trace of its own
            tr = self._trace = _Trace(_new_id(128), REWARM_SPAN)
        first = tr.origin_ns is None
        self._origin(agent, tr)
        if tr.root_start_ns is None:
            tr.root_start_ns = tr.origin_ns if tr.name == ROOT_SPAN else self._ns(tr, timing.start)
            self._queue.put(("root", tr.trace_id, tr.name, tr.root_start_ns))
        if first and tr.name == ROOT_SPAN and agent.startup is not None and agent.startup.end is not None:
            self._queue.put(("child", tr.trace_id, SpanSpec(
                "warmup.stage.startup", self._ns(tr, 0.0), self._ns(tr, agent.startup.end),
                {"warmup.stage": "startup", "warmup.stage.phase": 0, "warmup.stage.status": "ok",
                 "warmup.stage.seconds": agent.startup.end})))
        span = self._stage_span(agent, tr, timing)
        tr.last_end_ns = max(tr.last_end_ns, span.end_ns)
        self._queue.put(("child", tr.trace_id, span))
        if tr.name == REWARM_SPAN and (timing.status != "ok" or timing.name == "ready"):
            self._end_root(agent, tr, end_ns=self._ns(tr, timing.end if timing.end is not None else timing.start))

    def _stage_span(self, agent: Agent, tr: _Trace, timing: StageTiming) -> SpanSpec:
        end = timing.end if timing.end is not None else timing.start
        start_ns, end_ns = self._ns(tr, timing.start), self._ns(tr, end)
        attrs: dict[str, Any] = {"warmup.stage": timing.name, "warmup.stage.phase": timing.phase,
                                 "warmup.stage.status": timing.status, "warmup.stage.seconds": end - timing.start}
        flatten(f"warmup.{timing.name}", timing.detail, attrs)
        error = None
        if timing.status != "ok":
            reason = agent.sm.failure_reason or ("exception" if timing.status == "running" else "failed")
            if agent.sm.state.name != "DRAINING":
                error = f"{reason}: {agent.sm.failure_message or ''}".rstrip(": ")
                attrs["error.type"] = reason
        children = self._steps(agent, timing, start_ns)
        self._probe_mark = len(agent.probes)
        return SpanSpec(f"warmup.stage.{timing.name}", start_ns, end_ns, attrs, error, children)

    def _steps(self, agent: Agent, timing: StageTiming, start_ns: int) -> list[SpanSpec]:
        d = timing.detail
        prefix = f"warmup.{timing.name}"
        if timing.name == "reserve":
            return _sequential(prefix, start_ns, list(d.get("steps_seconds", {}).items()), {})
        if timing.name == "prewarm":
            seconds = d.get("seconds", {})
            order = [k for k in PREWARM_STEPS if k in seconds] + [k for k in seconds if k not in PREWARM_STEPS]
            weights = flatten("warmup.weight_load", d.get("weight_load") or {}, depth=1)
            traffic = {f"warmup.{k}": v for k in ("requests", "shapes", "lengths", "batches", "dropped_batches")
                       if (v := attribute_value(d.get(k))) is not None}
            return _sequential(prefix, start_ns, [(k, seconds[k]) for k in order],
                               {"weights": weights, "traffic": traffic})
        if timing.name == "solidify":
            total = agent.driver.engine_seconds("solidify")
            seconds, self._solidify_mark = total - self._solidify_mark, total
            method = d.get("method")
            if not method or seconds <= 0:
                return []
            spans = _sequential(prefix, start_ns, [(str(method), seconds)], {})
            for s in spans:
                s.attributes.update({"warmup.solidify.method": str(method), "warmup.solidify.shapes": d.get("shapes", 0)})
            return spans
        if timing.name == "ready":
            totals = agent.probe_totals[self._probe_mark:]
            ttfts = agent.probes[self._probe_mark:]
            spans = _sequential(prefix, start_ns, [("probe", t) for t in totals], {})
            for i, s in enumerate(spans):
                s.attributes["warmup.probe.index"] = i
                if i < len(ttfts):
                    s.attributes["gen_ai.server.time_to_first_token"] = ttfts[i]
            return spans
        return []

    def _end_root(self, agent: Agent, tr: _Trace, end_ns: int) -> None:
        tr.open = False
        if tr.root_start_ns is None:
            tr.root_start_ns = tr.origin_ns
            self._queue.put(("root", tr.trace_id, tr.name, tr.root_start_ns))
        sm = agent.sm
        attrs: dict[str, Any] = {"warmup.engine": agent.cfg.engine, "warmup.state": sm.state.name}
        for key, value in (("gen_ai.request.model", model_name(agent)),
                           ("warmup.model.path", agent.engine.model_path),
                           ("warmup.gpu.uuid", agent.context.gpu.uuid if agent.context.gpu is not None else None),
                           ("warmup.failure.reason", sm.failure_reason),
                           ("warmup.failure.message", sm.failure_message)):
            if value:
                attrs[key] = value
        record = agent.record()
        for key in ("startup_seconds", "time_to_ready_seconds", "warmup_requests", "probe_count",
                    "first_request_seconds", "steady_first_token_seconds", "first_request_tax_ratio",
                    "first_request_total_tax_ratio", "version"):
            v = attribute_value(record.get(key))
            if v is not None:
                attrs[f"warmup.{key}"] = v
        error = None
        if sm.state.name == "FAILED":
            error = f"{sm.failure_reason}: {sm.failure_message or ''}".rstrip(": ")
            attrs["error.type"] = sm.failure_reason or "failed"
        self._queue.put(("end", tr.trace_id, attrs, error, max(end_ns, tr.last_end_ns)))


# The background thread is the only code that touches OpenTelemetry.
class _Worker:
    def __init__(self, s: Settings, events: queue.SimpleQueue[tuple]):
        self.s = s
        self.events = events
        self.roots: dict[int, Any] = {}
        self.next_trace_id = 0
        self.ready = threading.Event()     # the SDK is imported (or could not be)

    def run(self) -> None:
        # Nothing is imported or sent before the first root span ends, so the SDK import
        # never competes with the warmup for the interpreter.
        pending: list[tuple] = []
        while True:
            event = self.events.get()
            pending.append(event)
            if event[0] in ("end", "stop"):
                break
        try:
            provider, tracer = self._setup()
        except Exception as e:  # noqa: BLE001 - a missing extra or bad setting: no traces, the start goes on
            log.warning("start-up traces off: %s: %s (pip install 'warmup-agent[otel]')", type(e).__name__, e)
            self.ready.set()
            while pending[-1][0] != "stop":
                pending.append(self.events.get())
            return
        self.ready.set()
        try:
            while True:
                event = pending.pop(0) if pending else self.events.get()
                if event[0] == "stop":
                    break
                try:
                    self._handle(tracer, event)
                except Exception:  # noqa: BLE001 - one bad span is dropped, the others go on
                    log.debug("tracing: event %s dropped", event[0], exc_info=True)
        finally:
            provider.force_flush(int(self.s.timeout * 1000))
            provider.shutdown()

    def _setup(self) -> Any:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        from warmup_agent import __version__
        worker = self

        class PresetTraceIds(RandomIdGenerator):
            """The root's trace ID is the one chosen before the SDK was imported."""

            def generate_trace_id(self) -> int:
                return worker.next_trace_id or super().generate_trace_id()

        if self.s.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        attrs = {"service.version": __version__}
        if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
            attrs["service.name"] = self.s.service_name
        # The SDK warns on every failed retry; _LoggedExporter says it once.
        logging.getLogger("opentelemetry.exporter").setLevel(logging.ERROR)
        logging.getLogger("opentelemetry.sdk").setLevel(logging.ERROR)
        exporter = _logged(OTLPSpanExporter(endpoint=self.s.endpoint, timeout=self.s.timeout), self.s)
        # The SDK's atexit hook would wait 30 s for a collector that is down.
        provider = TracerProvider(resource=Resource.create(attrs), id_generator=PresetTraceIds(),
                                  shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
        return provider, provider.get_tracer("warmup_agent", __version__)

    def _handle(self, tracer: Any, event: tuple) -> None:
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.trace import Status, StatusCode
        kind, trace_id = event[0], event[1]
        if kind == "root":
            _, _, name, start_ns = event
            self.next_trace_id = trace_id
            try:
                self.roots[trace_id] = tracer.start_span(name, context=Context(), start_time=start_ns)
            finally:
                self.next_trace_id = 0
        elif kind == "child":
            self._span(tracer, trace.set_span_in_context(self.roots[trace_id]), event[2], trace, Status, StatusCode)
        elif kind == "end":
            _, _, attrs, error, end_ns = event
            root = self.roots.pop(trace_id)
            root.set_attributes(attrs)
            if error:
                root.set_status(Status(StatusCode.ERROR, error))
            root.end(end_time=end_ns)

    def _span(self, tracer: Any, parent: Any, spec: SpanSpec, trace: Any, Status: Any, StatusCode: Any) -> None:  # noqa: N803 - the SDK's classes
        span = tracer.start_span(spec.name, context=parent, start_time=spec.start_ns, attributes=spec.attributes)
        if spec.error:
            span.set_status(Status(StatusCode.ERROR, spec.error))
        context = trace.set_span_in_context(span)
        for child in spec.children or ():
            self._span(tracer, context, child, trace, Status, StatusCode)
        span.end(end_time=spec.end_ns)


def _logged(inner: Any, s: Settings) -> Any:
    """The OTLP exporter, logging once when the collector becomes unreachable and once when it is back."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class LoggedExporter(SpanExporter):
        failing = False

        def export(self, spans: Any) -> Any:
            result = inner.export(spans)
            ok = result == SpanExportResult.SUCCESS
            if not ok and not self.failing:
                log.warning("start-up traces: export to %s (%s) failed; spans are dropped until it answers",
                            s.endpoint, s.protocol)
            elif ok and self.failing:
                log.info("start-up traces: export to %s works again", s.endpoint)
            self.failing = not ok
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    return LoggedExporter()
