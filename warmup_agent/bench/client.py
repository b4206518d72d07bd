"""The bench's outside client: plain HTTP, as a user's client meets the server.

Times a streamed chat request from sending it to the first streamed token (or
the end of an answer that has none) and to the end of the stream.  A chunk counts whether or not it has text: a random
model's tokens past its tokenizer's vocabulary stream as empty text.  The stream is read
as the agent reads every stream (warmup_agent/event_stream.py): an error event, what a
server (or the agent's proxy, on a 504 upstream) sends when a request fails mid-stream,
and a stream cut off (its connection closed mid-chunk, or its end reached before both
`data: [DONE]` and a finish_reason) are failed requests, never answers.  A finish_reason
without `[DONE]` is a whole answer: transformers serve sends no `[DONE]`.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from warmup_agent.errors import EngineError
from warmup_agent.event_stream import EventStream

REQUEST_TIMEOUT = 300.0   # seconds for one whole answer


class RequestFailed(Exception):
    """A request the server did not answer; str() says how, `status` is the HTTP
    status where the server answered with an error, `kind` which failure it was:
    "refused" (an HTTP error status), "error_event" (an error event mid-stream),
    "cut_off" (the stream ended before its answer did) or "no_answer"."""

    def __init__(self, message: str, status: int | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind or ("refused" if status is not None else "no_answer")


@dataclass
class Answer:
    ttft: float          # seconds from sending to the first streamed token
    total: float         # seconds from sending to the end of the stream
    chunks: int          # streamed token chunks
    tokens: int | None   # completion tokens, where the server reports usage

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None for an answer of one chunk."""
        return (self.total - self.ttft) / (self.chunks - 1) if self.chunks > 1 else None

    def as_dict(self) -> dict[str, Any]:
        return {"ttft_seconds": self.ttft, "total_seconds": self.total, "chunks": self.chunks, "tokens": self.tokens,
                "tpot_seconds": self.tpot}


def get_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def gauge(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The first sample named `name` (with these `labels` among its own) in a Prometheus
    text exposition, or None (prometheus_client's parser, as exporter/engine_metrics.py and
    alerts/replay.py read one)."""
    from prometheus_client.parser import text_string_to_metric_families
    want = (labels or {}).items()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and want <= sample.labels.items():
                    return float(sample.value)
    except ValueError:     # not an exposition (an error page)
        return None
    return None


def get_text(url: str, timeout: float = 5.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return str(r.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _is_token_chunk(msg: dict[str, Any]) -> bool:
    for c in msg.get("choices") or ():
        delta = c.get("delta") or {}
        if "content" in delta or "reasoning_content" in delta or c.get("text") is not None:
            return delta.get("role") is None or bool(delta.get("content"))
    return False


def stream_chat(base_url: str, model: str | None, body: dict[str, Any]) -> Answer:
    """One streamed chat request; raises RequestFailed when it gets no whole answer."""
    full = {**body, "stream": True}
    if model:
        full["model"] = model
    url = f"{base_url}/v1/chat/completions"
    req = urllib.request.Request(url, data=json.dumps(full).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    first: float | None = None
    chunks, events, tokens, finished = 0, 0, None, False
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
            stream = EventStream(r, f"POST {url}")
            for msg in stream:
                events += 1
                ends = any(c.get("finish_reason") for c in msg.get("choices") or ())
                if _is_token_chunk(msg):
                    chunks += 1
                    first = first or time.perf_counter()
                elif first is None and ends:
                    first = time.perf_counter()    # an answer that ended before any token (EOS first)
                finished = finished or ends
                tokens = (msg.get("usage") or {}).get("completion_tokens", tokens)
    except urllib.error.HTTPError as e:
        detail = e.read()[:200].decode("utf-8", "replace").strip()
        raise RequestFailed(f"HTTP {e.code} from {url}: {detail}", e.code) from None
    except EngineError as e:
        raise RequestFailed(f"{e}; after {chunks} token chunk(s)", kind="error_event") from None
    except http.client.IncompleteRead:   # a chunked stream whose connection closed mid-way
        raise _cut_off(url, chunks, events, "its connection closed mid-stream") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise RequestFailed(f"no answer from {url}: {reason}") from None
    if not (stream.done or finished):
        raise _cut_off(url, chunks, events, "it ended with neither a finish_reason nor data: [DONE]")
    end = time.perf_counter()
    return Answer((first or end) - t0, end - t0, chunks, tokens)


def _cut_off(url: str, chunks: int, events: int, how: str) -> RequestFailed:
    return RequestFailed(f"POST {url}: a stream cut off: {how}, after {events} event(s), {chunks} token chunk(s)",
                         kind="cut_off")
