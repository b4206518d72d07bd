"""The bench's outside client: plain HTTP, as a user's client meets the server.

Times a streamed chat request from sending it to the first streamed token (or
the end of an answer that has none) and to the end of the stream.  A chunk counts whether or not it has text: a random
model's tokens past its tokenizer's vocabulary stream as empty text.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

REQUEST_TIMEOUT = 300.0   # seconds for one whole answer


class RequestFailed(Exception):
    """A request the server did not answer; str() says how, `status` is the HTTP
    status where the server answered with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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


def gauge(text: str, name: str) -> float | None:
    """The first sample named `name` in a Prometheus text exposition, or None
    (prometheus_client's parser, as exporter/engine_metrics.py and alerts/replay.py read one)."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
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
    """One streamed chat request; raises RequestFailed when it gets no answer."""
    full = {**body, "stream": True}
    if model:
        full["model"] = model
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(full).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    first: float | None = None
    chunks, tokens = 0, None
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                msg = json.loads(line[5:])
                if _is_token_chunk(msg):
                    chunks += 1
                    first = first or time.perf_counter()
                elif first is None and any(c.get("finish_reason") for c in msg.get("choices") or ()):
                    first = time.perf_counter()    # an answer that ended before any token (EOS first)
                tokens = (msg.get("usage") or {}).get("completion_tokens", tokens)
    except urllib.error.HTTPError as e:
        detail = e.read()[:200].decode("utf-8", "replace").strip()
        raise RequestFailed(f"HTTP {e.code} from {base_url}/v1/chat/completions: {detail}", e.code) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise RequestFailed(f"no answer from {base_url}/v1/chat/completions: {reason}") from None
    end = time.perf_counter()
    return Answer((first or end) - t0, end - t0, chunks, tokens)
