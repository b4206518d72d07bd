"""What a person watching `warmup-agent run` sees: live stage progress, `[COLDSTART]` lines, a summary table."""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from warmup_agent.run.tracing import current_trace_id

coldstart_log = logging.getLogger("warmup_agent.coldstart")


def coldstart(event: str, stage: str, phase: int, **fields: Any) -> None:
    """One structured `[COLDSTART]` line, ending with the trace ID when tracing is on."""
    if (trace_id := current_trace_id()) is not None:
        fields["trace_id"] = trace_id
    text = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
    coldstart_log.info(f"[COLDSTART] phase{phase} {stage} {event}" + (f" {text}" if text else ""),
                       extra={"phase": phase, "stage": stage, "event": event, **fields})


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


class Progress:
    """Stage progress: one line redrawn in place on a TTY, else plain lines at each quarter."""

    def __init__(self, stream: Any = None, tty: bool | None = None, enabled: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.enabled = enabled
        self._line = ""
        self._last_draw = 0.0
        self._stage = ""
        self._stage_start = 0.0
        self._last_quarter = -1

    def _write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()

    def clear(self) -> None:
        if self.tty and self._line:
            self._write("\r\033[K")

    def redraw(self) -> None:
        if self.tty and self._line:
            self._write(self._line)

    def stage_started(self, index: int, total: int, name: str) -> None:
        self._stage = f"[{index}/{total}] {name}"
        self._stage_start = time.monotonic()
        self._last_quarter = -1
        if self.tty:
            self._set_line(f"{self._stage} ...")
        else:
            self._write(f"{self._stage} started\n")

    def step(self, done: int, total: int, detail: str = "") -> None:
        elapsed = time.monotonic() - self._stage_start
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < 0.1 and done < total:
                return
            self._last_draw = now
            width = 20
            filled = int(width * done / max(total, 1))
            bar = "#" * filled + "-" * (width - filled)
            self._set_line(f"{self._stage} [{bar}] {done}/{total} {detail} {elapsed:.1f}s")
        else:
            quarter = int(4 * done / max(total, 1))
            if quarter > self._last_quarter and quarter < 4:
                self._last_quarter = quarter
                self._write(f"{self._stage} {done}/{total} {detail}\n")

    def probe(self, probes: int, in_window: int, needed: int, limit: int, ttft: float) -> None:
        """One readiness probe, shown against `needed` samples, where most runs stop, not `limit`."""
        detail = f"ttft={ttft * 1000:.1f}ms"
        if in_window < needed or probes <= needed:
            self.step(min(in_window, needed), needed, f"probes {detail}")
            return
        # Enough samples but P50/P90 still over a threshold: say so and show the limit.
        text = f"{probes} probes, P50/P90 over threshold; gives up after {limit} {detail}"
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1:
                self._last_draw = now
                self._set_line(f"{self._stage} {text} {now - self._stage_start:.1f}s")
        elif probes == needed + 1 or probes % max(limit // 4, 1) == 0:
            self._write(f"{self._stage} {text}\n")

    def startup_finished(self, seconds: float) -> None:
        """Process start to the first stage: interpreter, imports, model creation."""
        self._write(f"startup (interpreter, imports, model set-up) done in {seconds:.3f}s\n")

    def stage_finished(self, name: str, seconds: float, ok: bool = True) -> None:
        mark = "done" if ok else "FAILED"
        if self.tty:
            self.clear()
            self._line = ""
        self._write(f"{self._stage} {mark} in {seconds:.3f}s\n")

    def _set_line(self, text: str) -> None:
        self.clear()
        self._line = text
        self._write(text)


class ProgressAwareHandler(logging.StreamHandler):
    """A log handler that moves the live progress line out of each log record's way."""

    def __init__(self, progress: Progress, stream: Any = None) -> None:
        super().__init__(stream or progress.stream)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.clear()
        super().emit(record)
        self.progress.redraw()


class JsonFormatter(logging.Formatter):
    _STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname.lower(), "logger": record.name,
               "message": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in self._STD})
        return json.dumps(out, default=str)


def summary_table(record: dict) -> str:
    """The end-of-run table: each stage's time, then first-request against steady time."""
    rows = [("stage", "phase", "seconds", "status")]
    total = 0.0
    if record.get("startup_seconds") is not None:  # process start to the first stage
        rows.append(("startup", "0", f"{record['startup_seconds']:.3f}", "ok"))
        total += record["startup_seconds"]
    for s in record["stages"]:
        # A re-warm can begin between SERVING and this table, leaving a stage without a duration.
        seconds = "-" if s["duration_seconds"] is None else f"{s['duration_seconds']:.3f}"
        rows.append((s["name"], str(s["phase"]), seconds, s["status"]))
        total += s["duration_seconds"] or 0.0
    rows.append(("total", "", f"{total:.3f}", record["final_state"]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    first, steady = record.get("first_request_seconds"), record.get("steady_first_token_seconds")
    tax = record.get("first_request_tax_ratio")
    if first is not None and steady and tax is not None:
        lines.append("")
        lines.append(f"first request after warmup: {first * 1000:.1f} ms time to first token; "
                     f"steady: {steady * 1000:.1f} ms (median of {record['probe_count'] - 1} probes); "
                     f"first-request tax {tax:.2f}x")
    elif first is not None and tax is not None and record.get("first_request_new_length_remembered"):
        lines.append("")
        lines.append(f"first request after warmup: {first * 1000:.1f} ms time to first token (sent alone); "
                     f"first-request tax {tax:.2f}x, as this server measured before")
    if record.get("failure_reason"):
        lines.append(f"failed: {record['failure_reason']}: {record.get('failure_message', '')}")
    return "\n".join(lines)
