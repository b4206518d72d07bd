"""The proxy in a process of its own, where the main engine is an HTTP server.

In the agent's process the relay and the agent's threads (/readyz, /metrics, watch
probes) share one GIL, so under load each waits behind the other.  Here the agent
keeps the listening socket (kept across a restart of the child) and runs
`python -m warmup_agent.proxy.child` with it, an ordinary RoutingProxy whose gate and
metrics are stand-ins:

  - the agent publishes the gate's facts into shared memory (`SharedGate`) on every
    change and at least every PUBLISH_SECONDS; the child reads them per request;
  - the child batches what the proxy reports every FLUSH_SECONDS onto a pipe, and an
    agent thread applies it to the real metrics and gate.

The child exits when the agent closes a lifeline pipe; a child that dies is restarted
on the same socket.  With an engine in the agent's process the proxy stays there too.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from warmup_agent.proxy.routing import DEFAULT_MAX_BODY_BYTES, Backend, RoutedAgent, RoutingProxy, _bind
from warmup_agent.server import listener
from warmup_agent.states import State
from warmup_agent.warmup.learned import Shape

if TYPE_CHECKING:
    from warmup_agent.config_sections import ProxySection

log = logging.getLogger("warmup_agent.proxy")

PUBLISH_SECONDS = 0.02        # a backstop: every change of state is published at once (sm.on_change)
FLUSH_SECONDS = 0.01
START_SECONDS = 60.0
_STATES = [s.name for s in State]
# A sequence number (odd while a write is under way), then the state's index, whether the
# main engine is open, the breaker's remaining freeze (< 0: none) and when it was read (monotonic).
_SEQ = struct.Struct("<q")
_LAYOUT = struct.Struct("<iidd")
_SIZE = _SEQ.size + _LAYOUT.size
_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(Shape))


class SharedGate:
    """The gate's few facts the proxy routes by, in shared memory: one writer (the agent),
    readers that retry while a write is under way (a sequence lock).  Bytes are copied in
    whole (slice assignment), never packed in place: struct.pack_into clears a field
    before it writes it, and a reader saw state INIT for that instant."""

    def __init__(self, fd: int):
        self.fd = fd
        self.mm = mmap.mmap(fd, _SIZE)
        self.seq = _SEQ.unpack_from(self.mm, 0)[0]

    @classmethod
    def create(cls) -> SharedGate:
        fd = os.memfd_create("warmup-agent-proxy-gate", 0)
        os.ftruncate(fd, _SIZE)
        return cls(fd)

    def write(self, state: str, main_open: bool, frozen: float) -> None:
        data = _LAYOUT.pack(_STATES.index(state), int(main_open), frozen, time.monotonic())
        mm = self.mm
        self.seq += 1
        mm[0:_SEQ.size] = _SEQ.pack(self.seq)        # odd: writing
        mm[_SEQ.size:_SIZE] = data
        self.seq += 1
        mm[0:_SEQ.size] = _SEQ.pack(self.seq)        # even: done

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)

    def read(self) -> tuple[str, bool, float]:
        mm = self.mm
        while True:
            before = mm[0:_SEQ.size]
            data = mm[_SEQ.size:_SIZE]
            if before == mm[0:_SEQ.size] and not _SEQ.unpack(before)[0] & 1:
                break
        state, main_open, frozen, at = _LAYOUT.unpack(data)
        if frozen >= 0:
            frozen = max(0.0, frozen - (time.monotonic() - at))
        return _STATES[state], bool(main_open), frozen


class ProxyProcess:
    """RoutingProxy's life cycle (start, stop, host, port, main_name) for a proxy that
    runs in a child process; `agent` is the real one (its gate and metrics)."""

    def __init__(self, agent: RoutedAgent, upstream_url: str, fallback_url: str | None = None,
                 listen: tuple[str, int] | socket.socket = ("127.0.0.1", 0), retry_after_seconds: int = 5,
                 timeout_seconds: float = 300.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 hold_seconds: float = 0.0):
        self.gate, self.metrics = agent.readiness, agent.metrics
        self.main_name = upstream_url
        self.sock = _bind(listen) if isinstance(listen, tuple) else listen   # or one bound early (listener.py)
        self.host, self.port = self.sock.getsockname()[:2]
        self.settings = {"upstream": upstream_url, "fallback": fallback_url, "retry_after_seconds": retry_after_seconds,
                         "timeout_seconds": timeout_seconds, "max_body_bytes": max_body_bytes,
                         "hold_seconds": hold_seconds}
        self.shared = SharedGate.create()
        self.proc: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None
        self._stopping = threading.Event()
        self._changed = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> ProxyProcess:
        self._publish()
        sm = getattr(self.gate, "sm", None)
        if sm is not None and hasattr(sm, "on_change"):
            sm.on_change(lambda _was, _now: self._changed.set())   # a new state reaches the child at once
        if hasattr(self.gate, "on_let_in"):
            self.gate.on_let_in(self._changed.set)                 # so do users let in before SERVING
        events = self._spawn()
        self._threads = [threading.Thread(target=self._publisher, name="proxy-gate", daemon=True),
                         threading.Thread(target=self._reader, args=(events,), name="proxy-events", daemon=True)]
        for t in self._threads:
            t.start()
        log.info("routing proxy on %s:%d (process %d) -> main %s, fallback %s", self.host, self.port,
                 self.proc.pid if self.proc else -1, self.main_name,
                 self.settings["fallback"] or
                 f"none (held up to {self.settings['hold_seconds']:g} s while warming, then 503)")
        return self

    def _spawn(self) -> Any:
        ev_r, ev_w = os.pipe()
        life_r, life_w = os.pipe()
        args = {**self.settings, "sock": self.sock.fileno(), "gate": self.shared.fd, "events": ev_w,
                "lifeline": life_r, "log_level": logging.getLogger().getEffectiveLevel()}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "warmup_agent.proxy.child", json.dumps(args)],
                                         pass_fds=(self.sock.fileno(), self.shared.fd, ev_w, life_r),
                                         stdin=subprocess.DEVNULL)
        finally:
            os.close(ev_w)
            os.close(life_r)
        self._lifeline = life_w
        events = os.fdopen(ev_r, "rb")
        ready, _, _ = select.select([events], [], [], START_SECONDS)
        line = events.readline() if ready else b""
        if not line.startswith(b'{"ready"'):
            events.close()
            self._end_child()
            raise RuntimeError(f"the proxy process did not start (exit code {self.proc.poll()})")
        return events

    def stop(self) -> None:
        self._stopping.set()
        self._changed.set()
        self._end_child()
        for t in self._threads:
            t.join(10)
        self.sock.close()
        self.shared.close()

    def _end_child(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)     # the child sees EOF and stops
            self._lifeline = None
        if self.proc is not None:
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # -- the agent's side ------------------------------------------------------------------------
    def _publish(self) -> None:
        frozen = self.gate.retry_after(-1.0) if self.gate.state_name == "DEGRADED" else -1.0
        self.shared.write(self.gate.state_name, self.gate.main_open(), frozen)

    def _publisher(self) -> None:
        while not self._stopping.is_set():
            self._changed.wait(PUBLISH_SECONDS)
            self._changed.clear()
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - keep publishing
                log.exception("proxy: publishing the gate failed")

    def _reader(self, events: Any) -> None:
        while True:
            for line in events:
                try:
                    self._apply(json.loads(line))
                except Exception:  # noqa: BLE001 - one bad batch must not stop the figures
                    log.exception("proxy: applying the proxy process's report failed")
            events.close()
            if self._stopping.is_set():
                return
            code = self.proc.wait() if self.proc is not None else None
            log.error("the proxy process exited (code %s); starting it again on %s:%d", code, self.host, self.port)
            time.sleep(1.0)
            if self._stopping.is_set():
                return
            try:
                if self._lifeline is not None:
                    os.close(self._lifeline)
                    self._lifeline = None
                events = self._spawn()
            except Exception:  # noqa: BLE001 - tried again after a second
                log.exception("proxy: restarting the proxy process failed")
                events = open(os.devnull, "rb")

    def _apply(self, batch: dict) -> None:
        m, gate = self.metrics, self.gate
        for _ in range(batch.get("u", 0)):
            gate.user_request()
        for _ in range(batch.get("d", 0)):
            gate.user_done()
        for route, code, n in batch.get("c", ()):
            m.warmup_proxy_requests_total.labels(route=route, code=code).inc(n)
        for outcome, seconds in batch.get("h", ()):
            m.warmup_proxy_held_requests_total.labels(outcome=outcome).inc()
            m.warmup_proxy_hold_seconds.labels(outcome=outcome).observe(seconds)
        for route, ttft in batch.get("f", ()):
            m.warmup_proxy_first_token_seconds.labels(route=route).observe(ttft)
        if ttfts := batch.get("o"):
            gate.first_tokens(ttfts)
        for ttft, total, tokens, held in batch.get("a", ()):
            try:
                gate.user_answer(ttft, total, output_tokens=tokens, held=held)
            except Exception:  # noqa: BLE001 - as in process
                log.exception("gate.user_answer failed")
        for *fields, params in batch.get("s", ()):
            try:
                gate.user_shape(Shape(*fields), params)
            except Exception:  # noqa: BLE001 - as in process
                log.exception("gate.user_shape failed")
        for level, name, message in batch.get("l", ()):
            logging.getLogger(name).log(level, "%s", message)


# -- the child's side ------------------------------------------------------------------------------

class _Report:
    """What the child's proxy reports, until the next flush."""

    def __init__(self) -> None:
        self.clear()
        self.flush_now: Callable[[], None] | None = None

    def clear(self) -> None:
        self.u = self.d = 0
        self.c: dict[tuple[str, str], int] = {}
        self.f: list[tuple[str, float]] = []
        self.o: list[float] = []
        self.a: list[tuple[float, float, int | None, float]] = []
        self.h: list[tuple[str, float]] = []
        self.s: list[list[Any]] = []
        self.logs: list[tuple[int, str, str]] = []

    def take(self) -> bytes | None:
        if not (self.u or self.d or self.c or self.f or self.o or self.a or self.h or self.s or self.logs):
            return None
        logs, self.logs = self.logs, []
        batch = {"u": self.u, "d": self.d, "c": [[r, c, n] for (r, c), n in self.c.items()], "f": self.f, "o": self.o, "a": self.a,
                 "h": self.h, "s": self.s, "l": logs}
        self.u, self.d, self.c, self.f, self.o, self.a, self.h, self.s = 0, 0, {}, [], [], [], [], []
        return json.dumps(batch).encode() + b"\n"


class _ChildGate:
    """The Gate as the child sees it: routing facts from SharedGate, reports to _Report."""

    def __init__(self, shared: SharedGate, report: _Report):
        self.shared, self.report = shared, report

    @property
    def state_name(self) -> str:
        return self.shared.read()[0]

    def main_open(self) -> bool:
        return self.shared.read()[1]

    def retry_after(self, default: float) -> float:
        frozen = self.shared.read()[2]
        return frozen if frozen > 0 else default

    def user_request(self) -> None:
        self.report.u += 1
        if self.report.flush_now is not None and self.state_name == "SLEEPING":
            self.report.flush_now()      # now, not a FLUSH_SECONDS later: this request starts the wake

    def user_done(self) -> None:
        self.report.d += 1

    def first_tokens(self, ttfts: list[float]) -> None:
        self.report.o.extend(ttfts)

    def user_answer(self, ttft: float, total: float, output_tokens: int | None = None, held: float = 0.0) -> None:
        self.report.a.append((ttft, total, output_tokens, held))

    def user_shape(self, shape: Shape, params: dict[str, Any]) -> None:
        # Its fields in order, as dataclasses.astuple gives them (all plain values), without its deep copy.
        self.report.s.append([getattr(shape, name) for name in _SHAPE_FIELDS] + [params])


class _Counter:
    def __init__(self, report: _Report, key: tuple[str, str]):
        self.report, self.key = report, key

    def inc(self, n: int = 1) -> None:
        self.report.c[self.key] = self.report.c.get(self.key, 0) + n


class _Histogram:
    def __init__(self, report: _Report, route: str):
        self.report, self.route = report, route

    def observe(self, value: float) -> None:
        self.report.f.append((self.route, value))


class _Held:
    """A held request's outcome and wait: counted with the hold's seconds when observed."""

    def __init__(self, report: _Report):
        self.report, self.outcome = report, "served"

    def labels(self, outcome: str) -> _Held:
        self.outcome = outcome
        return self

    def inc(self, n: int = 1) -> None:
        pass

    def observe(self, seconds: float) -> None:
        self.report.h.append((self.outcome, seconds))


class _Family:
    def __init__(self, make: Any):
        self.make = make
        self.children: dict[tuple, Any] = {}

    def labels(self, **labels: str) -> Any:
        key = tuple(labels.items())      # a call site names its labels in one order
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = self.make(**labels)
        return child


class _ChildMetrics:
    """The proxy's metrics, as the proxy uses them, reported to the agent."""

    def __init__(self, report: _Report):
        self.warmup_proxy_requests_total = _Family(lambda route, code: _Counter(report, (route, code)))
        self.warmup_proxy_first_token_seconds = _Family(lambda route: _Histogram(report, route))
        # RoutingProxy._wait_for_gate counts the outcome, then observes the wait: one record.
        self.warmup_proxy_held_requests_total = self.warmup_proxy_hold_seconds = _Held(report)


class _ChildAgent:
    def __init__(self, shared: SharedGate, report: _Report):
        self.readiness = _ChildGate(shared, report)
        self.metrics = _ChildMetrics(report)


class _LogToReport(logging.Handler):
    def __init__(self, report: _Report):
        super().__init__()
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            self.report.logs.append((record.levelno, record.name, message))
        except Exception:  # noqa: BLE001 - logging must not fail the proxy
            self.handleError(record)


def child_main(args: dict) -> int:
    import asyncio
    import socket
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # a terminal's Ctrl-C is the agent's to handle
    report = _Report()
    root = logging.getLogger()
    root.handlers[:] = [_LogToReport(report)]
    root.setLevel(args["log_level"])
    sock = socket.socket(fileno=args["sock"])
    shared = SharedGate(args["gate"])
    proxy = RoutingProxy(_ChildAgent(shared, report), args["upstream"], args["fallback"], listen=sock,  # type: ignore[arg-type]
                         retry_after_seconds=args["retry_after_seconds"], timeout_seconds=args["timeout_seconds"],
                         max_body_bytes=args["max_body_bytes"], tune_gc=True, hold_seconds=args["hold_seconds"])
    proxy.start()
    loop = proxy.loop
    assert loop is not None
    events = args["events"]

    def write(data: bytes) -> None:
        # Blocking, and small (one batch per FLUSH_SECONDS): the agent's reader thread does nothing else.
        view = memoryview(data)
        while view:
            view = view[os.write(events, view):]

    def flush_now() -> None:
        if (data := report.take()) is not None:
            write(data)

    async def flusher() -> None:
        write(b'{"ready": true}\n')
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            flush_now()

    report.flush_now = flush_now
    asyncio.run_coroutine_threadsafe(flusher(), loop)
    while os.read(args["lifeline"], 1):      # until the agent closes it (or dies)
        pass
    proxy.stop()                              # in-flight requests answered or cancelled, their reports taken
    flush_now()
    return 0


def from_config(agent: RoutedAgent, pc: ProxySection, openai_url: str | None = None,
                local_backend: Backend | None = None,
                bound: socket.socket | None = None) -> RoutingProxy | ProxyProcess | None:
    """The proxy the `proxy.*` section asks for, not started; None without proxy.listen.
    The main engine is proxy.upstream_url, else `local_backend`, else `openai_url`; an
    HTTP one gets a ProxyProcess.  `bound`: proxy.listen's socket, bound early
    (listener.py).  Raises ConfigError for a missing upstream or an address in use."""
    from warmup_agent.config import ConfigError
    if not pc.listen:
        return None
    upstream: str | Backend | None = pc.upstream_url or local_backend or openai_url
    if not upstream:
        raise ConfigError("key 'proxy.upstream_url': the proxy needs the main engine's URL (proxy.upstream_url; "
                          "with --engine openai, openai.url or a server command after --)", "proxy.upstream_url")
    if isinstance(upstream, str) and not upstream.startswith(("http://", "https://")):
        raise ConfigError(f"key 'proxy.upstream_url': got {upstream!r}; expected a URL starting with http:// or https://",
                          "proxy.upstream_url")
    listen: tuple[str, int] | socket.socket = bound if bound is not None else listener.parse(pc.listen)
    try:
        if isinstance(upstream, str):
            return ProxyProcess(agent, upstream, pc.fallback_url, listen, retry_after_seconds=pc.retry_after_seconds,
                                timeout_seconds=pc.timeout_seconds, max_body_bytes=pc.max_body_bytes,
                                hold_seconds=pc.hold_seconds)
        return RoutingProxy(agent, upstream, pc.fallback_url, listen,
                            retry_after_seconds=pc.retry_after_seconds, timeout_seconds=pc.timeout_seconds,
                            max_body_bytes=pc.max_body_bytes, hold_seconds=pc.hold_seconds)
    except OSError as e:
        raise ConfigError(f"key 'proxy.listen': cannot listen on {pc.listen}: {e.strerror}",
                          "proxy.listen") from None

