"""The openai engine's HTTP client: request bodies for the two APIs, streamed
requests timed as a client sees them (time to first token: the first chunk that
carries text; the whole answer: the end of the stream), agent traffic marked
`X-Warmup: true` with a `warmup-` request id."""
from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from warmup_agent.engines.base import Engine, EngineError, RequestResult
from warmup_agent.warmup.traffic import _SEED_TEXT, WarmRequest

if TYPE_CHECKING:
    from warmup_agent.config import Config
    from warmup_agent.engines.openai.server_traffic import ServerTraffic
    from warmup_agent.engines.text_prompts import TextPrompts
    from warmup_agent.server.supervisor import Supervisor

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


class StreamingClient(Engine):
    """Requests to the server (the bottom layer of OpenAIEngine)."""

    # The engine's state, set in OpenAIEngine.__init__ (engines/openai/engine.py) and shared
    # by the layers: this client, discovery (engines/openai/discovery.py), the server glue
    # (engines/openai/server.py).
    cfg: Config
    log: logging.Logger
    url: str
    timeout: float
    model: str | None
    model_dir: str | None
    command: list[str] | None
    host: str
    port: int | None
    base_env: dict[str, str] | None
    on_server_exit: Callable[[int], None] | None
    on_server_ready: Callable[[], None] | None
    supervisor: Supervisor | None
    startup: dict[str, float]
    spawn: dict
    adapters: list[str]
    health_path: str
    api_setting: str
    text: TextPrompts | None
    apis: list[str]
    token_id_prompts: bool
    rejected_fields: set[str]
    capabilities: dict
    _variant: int
    _models_info: dict
    _pool: concurrent.futures.ThreadPoolExecutor
    _lock: threading.Lock
    _start_thread: threading.Thread | None
    _start_error: EngineError | None
    _interrupted: threading.Event
    _tokenizer: Any
    traffic: ServerTraffic

    def headers(self, warmup: bool) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if warmup:
            h["X-Warmup"] = "true"
            h["X-Request-Id"] = f"warmup-{uuid.uuid4().hex}"
        else:
            h["X-Request-Id"] = f"req-{uuid.uuid4().hex}"
        return h

    def _one_request(self, prompt: list[int], max_new_tokens: int, warmup: bool,
                     model: str | None = None) -> RequestResult:
        """A greedy request of these token ids: as ids where the server takes them,
        else as their text (completions, or one chat message)."""
        body: dict = {"max_tokens": max_new_tokens, "temperature": 0.0}
        if model:
            body["model"] = model
        if self.token_id_prompts or not self.apis:
            body["prompt"] = list(prompt)
            return self._request(body, "completions", warmup, len(prompt))
        text = self._tokenizer.decode(list(prompt)) if self._tokenizer is not None else _SEED_TEXT[:len(prompt) * 4]
        if "completions" in self.apis:
            body["prompt"] = text
            return self._request(body, "completions", warmup, len(prompt))
        body["messages"] = [{"role": "user", "content": text}]
        return self._request(body, "chat", warmup, len(prompt))

    # -- traffic-profile requests ------------------------------------------------------------

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 1,
                 warmup: bool = False) -> list[RequestResult]:
        """All prompts at once (one concurrent request each), streamed."""
        futures = [self._pool.submit(self._one_request, p, max_new_tokens, warmup) for p in prompts]
        return [f.result() for f in futures]

    def generate_requests(self, requests: list[WarmRequest], warmup: bool = True) -> list[RequestResult]:
        """One batch of profile requests, sent concurrently (streamed)."""
        bodies = [self.body_for(r) for r in requests]
        futures = [self._pool.submit(self._request, body, r.endpoint, warmup, n) for r, (body, n) in zip(requests, bodies, strict=True)]
        return [f.result() for f in futures]

    def body_for(self, r: WarmRequest) -> tuple[dict, int]:
        """The request body of a WarmRequest and its exact prompt length in tokens."""
        with self._lock:
            self._variant += 1
            variant = self._variant
        body = {"max_tokens": r.max_tokens, **r.sampling}
        if r.endpoint == "chat":
            if self.text is None or not self.text.has_chat_template:
                # No local template: a one-message chat of n tokens of text; the
                # server's template adds its own tokens.
                text = self._tokenizer.decode(self._ids(r.prompt_tokens, variant)) if self._tokenizer else _SEED_TEXT
                body["messages"] = [{"role": "user", "content": text}]
                return body, r.prompt_tokens
            body["messages"], n = self.text.messages(r.prompt_tokens, variant)
            return body, n
        if self.token_id_prompts and self._tokenizer is not None:
            body["prompt"] = self._ids(r.prompt_tokens, variant)
            return body, r.prompt_tokens
        if self.text is not None:
            body["prompt"], n = self.text.text(r.prompt_tokens, variant)
            return body, n
        body["prompt"] = self._tokenizer.decode(self._ids(r.prompt_tokens, variant)) if self._tokenizer else _SEED_TEXT
        return body, r.prompt_tokens

    def _ids(self, length: int, variant: int) -> list[int]:
        from warmup_agent.warmup.traffic import PromptFactory
        return PromptFactory(self.tokenize).prompt(length, variant)

    def _request(self, body: dict, api: str, warmup: bool, prompt_tokens: int | None = None) -> RequestResult:
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
                for raw in r:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    msg = json.loads(data)
                    if msg.get("error"):
                        raise EngineError("request_failed", f"POST {self.url}{path}: {str(msg['error'])[:300]}")
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

    def _get_json(self, path: str) -> dict:
        import urllib.error  # see _stream
        import urllib.request
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise EngineError("server_unreachable", f"GET {self.url}{path}: {getattr(e, 'reason', e)}") from None

    def _post_json(self, path: str, body: dict) -> dict:
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
