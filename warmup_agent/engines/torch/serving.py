"""The torch engine's OpenAI-compatible responder: the proxy's backend for users' requests.

Serves /v1/chat/completions and /v1/completions (streamed or not) and /v1/models;
closing a response body cancels its request.  Unlike OpenAI, a chat answer without
max_tokens gets at most 256 tokens, so it stays inside the CUDA graphs' static cache.
Bad requests get OpenAI's error body.  The batcher runs the model; this module only
speaks HTTP and JSON, on the proxy's event loop.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from warmup_agent.engines import chat_template
from warmup_agent.engines.torch.batcher import Batcher, Delta, Done, Event, Failed, Job, Sampling, ServedEngine
from warmup_agent.proxy import BackendResponse

#: Used when the tokenizer has no chat template.
FALLBACK_TEMPLATE = ("{% for message in messages %}{{ message['role'] + '\\n' + message['content'] + '\\n\\n' }}"
                     "{% endfor %}{% if add_generation_prompt %}{{ 'assistant\\n' }}{% endif %}")
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 256
JSON = {"content-type": "application/json"}
SSE = {"content-type": "text/event-stream", "cache-control": "no-cache"}


class BadRequest(Exception):
    """A request this responder refuses: 400 with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.code, self.status, self.kind = param, code, status, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _json_response(status: int, payload: dict, headers: Mapping[str, str] | None = None) -> BackendResponse:
    data = json.dumps(payload).encode()
    return BackendResponse(status, {**JSON, "content-length": str(len(data)), **(headers or {})}, _once(data))


def _sse(payload: dict | str) -> bytes:
    return b"data: " + (payload if isinstance(payload, str) else json.dumps(payload)).encode() + b"\n\n"


class ChatTemplate:
    """The model's chat template, compiled once and rendered as transformers does (engines/chat_template.py)."""

    def __init__(self, model_dir: str):
        from jinja2 import TemplateError
        self.source = chat_template.read_source(model_dir)
        self.fallback = self.source is None
        self._special = chat_template.special_tokens(model_dir)
        self._broken: str | None = None
        try:
            self._template = chat_template.compile_template(self.source or FALLBACK_TEMPLATE)
        except TemplateError as e:
            # Chat answers 500 saying so; completions still work.
            self._broken = f"the model's chat template does not compile: {e}"
            self._template = chat_template.compile_template(FALLBACK_TEMPLATE)

    def render(self, messages: list[dict]) -> str:
        from jinja2 import TemplateError
        if self._broken:
            raise BadRequest(self._broken, status=500, kind="server_error")
        try:
            return chat_template.render(self._template, messages, self._special)
        except chat_template.TemplateRefused as e:
            raise BadRequest(f"the chat template refused the messages: {e}", "messages") from None
        except TemplateError as e:
            raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from None


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{name}' must be a number", name, "invalid_type")
    if value < low or value > high or (low_open and value == low):
        raise BadRequest(f"'{name}' must be {'>' if low_open else '>='} {low:g} and <= {high:g}, got {value}", name,
                         "invalid_value")
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", name, "invalid_type")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("'stop' must be a string or a list of strings", "stop", "invalid_type")
    return tuple(s for s in value if s)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is a required property", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"{where} must be an object with a string 'role'", where, "invalid_type")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise BadRequest(f"{where}.content: only text parts are supported", f"{where}.content",
                                     "invalid_type")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"{where}.content must be a string or a list of text parts", f"{where}.content",
                             "invalid_type")
        out.append({**m, "content": content})
    return out


class TorchOpenAIBackend:
    """The proxy's backend for the torch engine (see the module docstring)."""

    def __init__(self, engine: ServedEngine, lock: Any, window: float):
        self.engine = engine
        path = engine.model_path
        #: The name /v1/models lists; requests may also name the model directory.
        self.served_name = os.path.basename(os.path.normpath(path))
        self._names = {self.served_name, path, os.path.normpath(path)}
        self.template = ChatTemplate(path)
        self.context = _context_length(path)
        self.batcher = Batcher(engine, lock, window)
        self.created = int(time.time())

    def served_within(self, seconds: float) -> float | None:
        return self.batcher.served_within(seconds)

    async def close(self) -> None:
        await asyncio.to_thread(self.batcher.close)

    async def request(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> BackendResponse:
        route = path.split("?", 1)[0].rstrip("/")
        try:
            if route == "/v1/models":
                if method != "GET":
                    raise BadRequest(f"{method} is not allowed on {route}", status=405)
                return _json_response(200, self.models())
            if route not in ("/v1/chat/completions", "/v1/completions"):
                raise BadRequest(f"no such endpoint: {route} (this model serves /v1/chat/completions, "
                                 "/v1/completions and /v1/models)", code="not_found", status=404)
            if method != "POST":
                raise BadRequest(f"{method} is not allowed on {route}", status=405)
            return await self._generate(route == "/v1/chat/completions", self._parse(body))
        except BadRequest as e:
            return _json_response(e.status, error_body(str(e), e.kind, e.param, e.code))

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.served_name, "object": "model", "created": self.created,
                                            "owned_by": "warmup-agent", "root": self.engine.model_path,
                                            "max_model_len": self.context}]}

    @staticmethod
    def _parse(body: bytes) -> dict:
        try:
            payload = json.loads(body or b"")
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise BadRequest("the request body must be a JSON object", code="invalid_json")
        return payload

    def _prompt(self, chat: bool, body: dict) -> list[int]:
        tokenizer = self.engine.tokenizer
        if chat:
            return tokenizer.encode(self.template.render(_messages(body)), add_special_tokens=False)
        prompt = body.get("prompt")
        if prompt is None:
            raise BadRequest("'prompt' is a required property", "prompt", "missing_required_parameter")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = _vocab_size(self.engine)
            if any(t < 0 or t >= vocab for t in prompt):
                raise BadRequest(f"'prompt' token ids must be in [0, {vocab})", "prompt", "invalid_value")
            ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise BadRequest("one prompt per request: send several requests (they are batched)", "prompt",
                             "invalid_value")
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
        if not ids:
            raise BadRequest("'prompt' is empty", "prompt", "invalid_value")
        return ids

    def _sampling(self, chat: bool, body: dict, prompt_tokens: int) -> Sampling:
        room = self.context - prompt_tokens
        if room < 1:
            raise BadRequest(f"this model's maximum context length is {self.context} tokens; the prompt has "
                             f"{prompt_tokens}", "messages" if chat else "prompt", "context_length_exceeded")
        requested = _integer(body, "max_completion_tokens")
        name = "max_completion_tokens"
        if requested is None:
            requested, name = _integer(body, "max_tokens"), "max_tokens"
        if requested is not None and requested < 1:
            raise BadRequest(f"'{name}' must be at least 1, got {requested}", name, "invalid_value")
        if requested is not None and requested > room:
            raise BadRequest(f"this model's maximum context length is {self.context} tokens; you asked for "
                             f"{prompt_tokens + requested} ({prompt_tokens} in the prompt, {requested} to generate)",
                             name, "context_length_exceeded")
        default = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
        return Sampling(max_tokens=requested if requested is not None else min(default, room),
                        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                        seed=_integer(body, "seed"), stop=_stop(body))

    def _check_model(self, body: dict) -> str:
        model = body.get("model")
        if model is None:
            return self.served_name
        if not isinstance(model, str):
            raise BadRequest("'model' must be a string", "model", "invalid_type")
        if model not in self._names:
            raise BadRequest(f"the model '{model}' does not exist here; this server serves '{self.served_name}'",
                             "model", "model_not_found")
        return model

    async def _generate(self, chat: bool, body: dict) -> BackendResponse:
        model = self._check_model(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean", "stream", "invalid_type")
        n = _integer(body, "n")
        if n not in (None, 1):
            raise BadRequest("only n=1 is supported: send several requests (they are batched)", "n", "invalid_value")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object", "stream_options", "invalid_type")
        include_usage = bool((options or {}).get("include_usage")) and stream
        prompt = self._prompt(chat, body)
        sampling = self._sampling(chat, body, len(prompt))

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(event: Event) -> None:   # from the scheduler thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:             # the loop is closed: nobody is listening any more
                job.cancel()
        job = Job(prompt, sampling, deliver)
        answer = _Answer(chat, model, len(prompt))
        self.batcher.submit(job)
        if stream:
            return BackendResponse(200, dict(SSE), _Stream(answer.stream(events, include_usage), job))
        try:
            text, end = await answer.collect(events)
        finally:
            job.cancel()      # the client may have gone away while it ran
        if isinstance(end, Failed):
            return _json_response(500, error_body(f"the model failed: {end.message}", "server_error"))
        return _json_response(200, answer.whole(text, end))


class _Stream:
    """The stream's body: closing it cancels the request, even before the generator ran."""

    def __init__(self, chunks: AsyncIterator[bytes], job: Job):
        self._chunks, self._job = chunks, job

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        self._job.cancel()
        close = getattr(self._chunks, "aclose", None)
        if close is not None:
            await close()


class _Answer:
    """One answer's OpenAI JSON: the whole answer, or its stream's chunks."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int):
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    @staticmethod
    def _finish(end: Done) -> str:
        return "length" if end.finish_reason == "length" else "stop"

    async def collect(self, events: asyncio.Queue[Event]) -> tuple[str, Done | Failed]:
        parts = []
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                parts.append(event.text)
            else:
                return "".join(parts), event

    def whole(self, text: str, end: Done) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self._finish(end)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self._finish(end)}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(end.completion_tokens)}

    def chunk(self, choices: list[dict], include_usage: bool, usage: dict | None = None) -> bytes:
        payload: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                   "created": self.created, "model": self.model, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return _sse(payload)

    def _choice(self, text: str | None, first: bool, finish: str | None) -> dict:
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    async def stream(self, events: asyncio.Queue[Event], include_usage: bool) -> AsyncIterator[bytes]:
        """One chunk per Delta, then the finish chunk, the usage chunk if asked, and [DONE]."""
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                yield self.chunk([self._choice(event.text, event.first, None)], include_usage)
                continue
            if isinstance(event, Failed):
                yield _sse(error_body(f"the model failed: {event.message}", "server_error"))
            elif event.finish_reason != "cancelled":
                yield self.chunk([self._choice(None, event.completion_tokens == 0, self._finish(event))], include_usage)
                if include_usage:
                    yield self.chunk([], True, self.usage(event.completion_tokens))
            yield _sse("[DONE]")
            return


def _context_length(model_dir: str) -> int:
    """The model's context from config.json (max_position_embeddings), else 2048."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        value = cfg.get("max_position_embeddings") or cfg.get("max_sequence_length")
        return int(value) if isinstance(value, int) and value > 0 else 2048
    except (OSError, ValueError, AttributeError):
        return 2048


def _vocab_size(engine: ServedEngine) -> int:
    return int(engine.model.lm_head.weight.shape[0]) if engine.model is not None else 0
