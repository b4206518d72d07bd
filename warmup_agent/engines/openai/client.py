"""The openai engine's HTTP client: streamed requests on the two APIs, timed as a
client sees them (time to first token: the first chunk that carries text; the
whole answer: the end of the stream), agent traffic marked `X-Warmup: true` with
a `warmup-` request id, and the optional fields the server accepts.  It knows
nothing of prompts or of what the server is: the engine (engine.py) builds the
bodies, discovery (discovery.py) asks through it."""
from __future__ import annotations

import concurrent.futures
import json
import time
import uuid
from typing import TYPE_CHECKING, Callable, TypeVar

from warmup_agent.engines.base import EngineError, RequestResult
from warmup_agent.event_stream import EventStream

if TYPE_CHECKING:
    from warmup_agent.engines.openai.server_traffic import ServerTraffic

T = TypeVar("T")

# Optional fields that make a warmup answer exactly max_tokens long on servers
# that know them (vLLM); dropped for a server that rejects unknown fields.
# stream_options.include_usage gives the token counts; without it chunks are counted.
_OPTIONAL_FIELDS = {"ignore_eos": True, "stream_options": {"include_usage": True}}
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class _Rejected(Exception):
    """The server refused a request body (HTTP 400/422)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.message, self.detail = message, detail


class StreamingClient:
    """HTTP to one server, as httpx's transport is to its client: streamed requests
    timed as a client sees them, GET/POST of JSON, and a pool that sends a batch at
    once.  `model` is the served name every request carries (discovery settles it);
    `rejected_fields` the optional fields the server refused, dropped from then on.
    Each request leaves a credit in `traffic` (server_traffic.py), so that its line
    in the server's log counts as ours."""

    def __init__(self, url: str, timeout: float, traffic: ServerTraffic, model: str | None = None):
        self.url = url
        self.timeout = timeout
        self.traffic = traffic
        self.model = model
        self.rejected_fields: set[str] = set()   # our optional fields the server refused (ignore_eos, ...)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="openai-req")

    def headers(self, warmup: bool) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if warmup:
            h["X-Warmup"] = "true"
            h["X-Request-Id"] = f"warmup-{uuid.uuid4().hex}"
        else:
            h["X-Request-Id"] = f"req-{uuid.uuid4().hex}"
        return h

    def all_at_once(self, calls: list[Callable[[], T]]) -> list[T]:
        """Run `calls` concurrently (one request each), results in their order."""
        futures = [self._pool.submit(call) for call in calls]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def request(self, body: dict, api: str, warmup: bool, prompt_tokens: int | None = None) -> RequestResult:
        """POST one streamed request; fills model, stream options and the optional
        fields the server accepts.  A 400/422 naming one of our optional fields
        drops it for good and retries once."""
        full = {"model": self.model, **body, "stream": True}
        for k, v in _OPTIONAL_FIELDS.items():
            if k not in self.rejected_fields and (full.get("n", 1) == 1 or k != "ignore_eos"):
                full.setdefault(k, v)
        try:
            return self._stream(full, api, warmup, prompt_tokens)
        except _Rejected as e:
            dropped = {k for k in _OPTIONAL_FIELDS if k in full and k in e.detail}
            if not dropped:
                raise EngineError("request_failed", e.message) from None
            self.rejected_fields |= dropped
            for k in dropped:
                full.pop(k)
            try:
                return self._stream(full, api, warmup, prompt_tokens)
            except _Rejected as e2:
                raise EngineError("request_failed", e2.message) from None

    def _stream(self, body: dict, api: str, warmup: bool, prompt_tokens: int | None) -> RequestResult:
        # urllib.request (http.client, ssl, email: about 30 ms) is imported on the first
        # request, not with the module: the CLI imports this before it spawns the server.
        import urllib.error
        import urllib.request
        path = _PATHS[api]
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers=self.headers(warmup), method="POST")
        t0 = time.perf_counter()
        first = first_chunk = None
        usage = None
        timings: dict = {}
        chunks = 0
        credit = self.traffic.own_started()    # its line in the server's log is ours, not a user's
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                for msg in EventStream(r, f"POST {self.url}{path}"):
                    for choice in msg.get("choices") or ():
                        if first_chunk is None:
                            first_chunk = time.perf_counter()
                        # The first token is the first chunk with text: a chat stream
                        # opens with a role-only delta before any token exists.
                        text = choice.get("text") if api == "completions" else (choice.get("delta") or {}).get("content")
                        if text:
                            chunks += 1
                            if first is None:
                                first = time.perf_counter()
                    if msg.get("usage"):
                        usage = msg["usage"]
                    if isinstance(msg.get("timings"), dict):   # llama-server: its own prefill and decode times
                        timings = msg["timings"]
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:300]
            message = f"POST {self.url}{path}: HTTP {e.code}: {detail}"
            if e.code in (400, 422):
                raise _Rejected(message, detail) from None
            raise EngineError("request_failed", message) from None
        except (urllib.error.URLError, OSError) as e:
            raise EngineError("server_unreachable", f"POST {self.url}{path}: {getattr(e, 'reason', e)}") from None
        except ValueError as e:
            raise EngineError("request_failed", f"POST {self.url}{path}: not an event stream ({e})") from None
        finally:
            self.traffic.own_ended(credit)
        end = time.perf_counter()
        first = first or first_chunk
        if first is None:
            raise EngineError("request_failed", f"POST {self.url}{path}: stream ended without a token")
        prompt_ms = timings.get("prompt_ms")
        return RequestResult(first_token_seconds=first - t0, total_seconds=end - t0,
                             prompt_tokens=usage["prompt_tokens"] if usage and usage.get("prompt_tokens") else (prompt_tokens or 0),
                             output_tokens=usage["completion_tokens"] if usage and usage.get("completion_tokens") else chunks,
                             server_prefill_seconds=prompt_ms / 1e3 if isinstance(prompt_ms, (int, float)) and prompt_ms > 0 else None)

    def get_json(self, path: str) -> dict:
        import urllib.error  # see _stream
        import urllib.request
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise EngineError("server_unreachable", f"GET {self.url}{path}: {getattr(e, 'reason', e)}") from None

    def post_json(self, path: str, body: dict) -> dict:
        import urllib.error  # see _stream
        import urllib.request
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:300]
            raise EngineError("request_failed", f"POST {self.url}{path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise EngineError("server_unreachable", f"POST {self.url}{path}: {getattr(e, 'reason', e)}") from None
        try:
            return json.loads(text)
        except ValueError:
            return {"text": text.decode("utf-8", "replace")}
