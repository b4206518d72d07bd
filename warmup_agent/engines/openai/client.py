"""The openai engine's HTTP client: streamed requests timed as a client sees them, agent
traffic marked `X-Warmup: true` with a `warmup-` request id (vLLM logs it as the request id)."""
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

# Optional fields: ignore_eos makes answers exactly max_tokens long (vLLM), include_usage
# gives token counts.  Dropped for a server that rejects them.
_OPTIONAL_FIELDS = {"ignore_eos": True, "stream_options": {"include_usage": True}}
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class _Rejected(Exception):
    """The server refused a request body (HTTP 400/422)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.message, self.detail = message, detail


class StreamingClient:
    """HTTP to one server: streamed requests, JSON GET/POST, and a pool that sends a batch at once.

    Each request leaves a credit in `traffic`, so its line in the server's log counts as ours."""

    def __init__(self, url: str, timeout: float, traffic: ServerTraffic, model: str | None = None):
        self.url = url
        self.timeout = timeout
        self.traffic = traffic
        self.model = model
        self.rejected_fields: set[str] = set()   # optional fields the server refused
        self.give_way: Callable[[], bool] | None = None   # Engine.give_way: closed, the server drops the stream
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
        """Run `calls` concurrently; results in their order."""
        futures = [self._pool.submit(call) for call in calls]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def request(self, body: dict, api: str, warmup: bool, prompt_tokens: int | None = None) -> RequestResult:
        """POST one streamed request; a 400/422 naming an optional field drops it for good and retries."""
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
        # Imported late: urllib.request is slow to import and the CLI imports this before spawning the server.
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
        credit = self.traffic.own_started()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                for msg in EventStream(r, f"POST {self.url}{path}"):
                    for choice in msg.get("choices") or ():
                        if first_chunk is None:
                            first_chunk = time.perf_counter()
                        # A chat stream opens with a role-only delta before any token.
                        text = choice.get("text") if api == "completions" else (choice.get("delta") or {}).get("content")
                        if text:
                            chunks += 1
                            if first is None:
                                first = time.perf_counter()
                    if msg.get("usage"):
                        usage = msg["usage"]
                    if isinstance(msg.get("timings"), dict):   # llama-server's own timings
                        timings = msg["timings"]
                    if warmup and self.give_way is not None and self.give_way():
                        raise EngineError("gave_way", f"POST {self.url}{path}: stopped for a user's request")
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
