"""The `openai` engine: any OpenAI-compatible server over HTTP, started and supervised
by the agent or already running (`openai.url`).

It composes a server handle (server.py), a streaming client (client.py) and
discovery (discovery.py), which learns what the server can do by asking it, never
from its name.  This module keeps the tokenizer and prompts, LoRA adapters, facts
and fingerprint; server/command.py's helpers stay importable from here.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Callable

from warmup_agent.engines.base import Engine, EngineError, EngineFacts, RequestResult, SolidifyReport
from warmup_agent.engines.openai.client import StreamingClient
from warmup_agent.engines.openai.discovery import Discovery
from warmup_agent.engines.openai.server import ServerHandle
from warmup_agent.engines.openai.server_traffic import ServerTraffic
from warmup_agent.engines.text_prompts import TextPrompts
from warmup_agent.gpu import sizing
from warmup_agent.server.command import parse_adapters
from warmup_agent.server.context import ServerContext, of_server
from warmup_agent.server.kinds import BY_OWNER, kind_of_command, sleeps_when_idle
from warmup_agent.warmup.traffic import _SEED_TEXT, WarmRequest

if TYPE_CHECKING:
    from warmup_agent.config_sections import LoraSection, OpenaiSection, VllmSection
    from warmup_agent.server.signals import ServerSignals
    from warmup_agent.server.supervisor import Supervisor

__all__ = ["Discovery", "OpenAIEngine", "ServerHandle", "StreamingClient"]


class OpenAIEngine(Engine):
    """An Engine over a ServerHandle, a StreamingClient and a Discovery.

    `server_command` is the server to supervise (None: use `openai.url`);
    `model_path` defaults to the command's --model; `request_apis` limits what
    discovery asks about."""

    name = "openai"
    speaks_profile = True
    loads_by_starting_server = True

    def __init__(self, openai: OpenaiSection, *, data_dir: str, lora: LoraSection, vllm: VllmSection,
                 server_command: list[str] | None = None, model_path: str | None = None,
                 request_apis: Collection[str] = (), log: logging.Logger | None = None,
                 on_server_exit: Callable[[int], None] | None = None,
                 on_server_ready: Callable[[], None] | None = None,
                 base_env: dict[str, str] | None = None):
        self.log = log or logging.getLogger("warmup_agent.engines.openai")
        self.traffic = ServerTraffic()
        self.server = ServerHandle(openai, data_dir=data_dir, lora=lora, vllm=vllm, command=server_command,
                                   traffic=self.traffic, base_env=base_env, log=self.log)
        self.server.set_callbacks(on_server_exit, on_server_ready)
        self.client = StreamingClient(self.server.url, openai.request_timeout_seconds, self.traffic,
                                      model=openai.model or self.server.served_model_name)
        self.discovery = Discovery(self.client, openai, request_apis, log=self.log)
        self.lora_adapters = lora.adapters
        self.model_dir: str | None = model_path or self.server.model_option
        self.quantization = self._detect_quantization()
        self.adapters: list[str] = []          # registered LoRA adapter names
        self._tokenizer: Any = None
        self.text: TextPrompts | None = None
        self._variant = 0
        self._chars_per_token: float | None = None    # the server's, for prompts without a local tokenizer
        self._tokenize_key = "prompt"      # what the server's /tokenize reads the text from
        self._lock = threading.Lock()
        self._signals: ServerSignals | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def health_path(self) -> str:
        return self.server.health_path

    @property
    def command(self) -> list[str] | None:
        """The supervised server's command (vLLM's rewritten); None: not ours."""
        return self.server.command

    @property
    def supervisor(self) -> Supervisor | None:
        return self.server.supervisor

    @property
    def model(self) -> str | None:
        """The served model name requests carry (openai.model, else discovered)."""
        return self.client.model

    @model.setter
    def model(self, name: str | None) -> None:
        self.client.model = name

    @property
    def apis(self) -> list[str]:
        return self.discovery.apis

    @property
    def concurrency(self) -> int:
        return self.discovery.concurrency

    @property
    def capabilities(self) -> dict:
        return self.discovery.capabilities

    @property
    def server_context(self) -> ServerContext | None:
        """What discovery read (/props, /v1/models), completed by the command line."""
        return of_server(self.discovery.props, self.discovery.models_info, self.command)

    @property
    def server_start_seconds(self) -> float | None:
        return self.server.start_seconds

    @property
    def server_name(self) -> str | None:
        return self.server.name

    @property
    def applied_remedy(self) -> dict[str, str]:
        return self.server.applied_remedy

    @property
    def remedy_why(self) -> str | None:
        return self.server.remedy.why

    def learn_remedy(self, pays: bool | None, decode_tpots: list[float]) -> dict | None:
        return self.server.learn_remedy(pays, decode_tpots)

    @property
    def metrics_url(self) -> str:
        return self.url + "/metrics"

    @property
    def model_path(self) -> str | None:
        """The local model directory, when known and present."""
        return self.model_dir if self.model_dir and os.path.isdir(self.model_dir) else None

    def others_served_within(self, seconds: float) -> float | None:
        return self.traffic.others_within(seconds)

    def give_way(self, to_users: Callable[[], bool] | None) -> None:
        self.client.give_way = to_users

    def server_signals(self) -> ServerSignals:
        """Signals for the server kind its command names, else the model's owner in /v1/models."""
        if self._signals is None:
            # Imported late: urllib.request must not load before a server's early spawn.
            from warmup_agent.server.signals import ServerSignals
            kind = kind_of_command(self.command) or BY_OWNER.get(str(self.discovery.models_info.get("owned_by", "")))
            self._signals = ServerSignals(self.url, kind, self.health_path)
        return self._signals

    def sleeps_when_idle(self) -> bool:
        return sleeps_when_idle(self.server_signals().kind, self.command)

    def has_compile_artifacts(self) -> bool:
        kind = self.server_signals().kind
        if kind is not None and not kind.compiles:
            return False
        return self.server.has_compile_artifacts()

    def set_server_callbacks(self, on_exit: Callable[[int], None] | None,
                             on_ready: Callable[[], None] | None) -> None:
        self.server.set_callbacks(on_exit, on_ready)

    def prestart(self) -> None:
        self.server.prestart()

    def start_server(self) -> None:
        """Start the server (or wait for the given one) until healthy, loading the tokenizer meanwhile."""
        self.server.start(while_starting=self.load_tokenizer)

    def load_weights(self) -> None:
        """Start the server, learn what it serves, then register and warm the LoRA adapters."""
        self.start_server()
        self._discover()
        self.load_lora_adapters()

    def interrupt(self) -> None:
        self.server.interrupt()

    def close(self) -> None:
        self.server.close()
        self.client.close()

    def _discover(self) -> None:
        """Ask the server what it serves; a model root it names gives the local tokenizer if none was known."""
        self.load_tokenizer()
        root = self.discovery.find_model(self.model_dir, self.command)
        if self.model_dir is None and root and os.path.isdir(root):
            self.model_dir = root
            self.load_tokenizer()
        self.discovery.find_the_rest(self.tokenize, chat_template=bool(self.text and self.text.has_chat_template))

    def _detect_quantization(self) -> Any:
        """Quantization from the server's flags over the model's config.json (its scales stay unseen)."""
        from warmup_agent import quantization
        model_info = None
        if self.model_dir:
            try:
                model_info = quantization.from_config(quantization.read_model_config(self.model_dir),
                                                      f"{self.model_dir}/config.json")
            except EngineError as e:   # the server reads that file too, and says so in its own words
                self.log.warning("%s", e)
        return quantization.from_command_line(self.command, model_info)

    def load_tokenizer(self) -> None:
        """The model directory's tokenizer when known; otherwise tokenize() asks the server."""
        if self._tokenizer is not None or not self.model_dir or not os.path.isdir(self.model_dir):
            return
        path = os.path.join(self.model_dir, "tokenizer.json")
        if os.path.exists(path):
            self.text = TextPrompts.from_model_dir(self.model_dir, _SEED_TEXT)
            self._tokenizer = self.text.tok
        else:
            try:
                from transformers import AutoTokenizer
            except ImportError:  # the small install: the server's /tokenize sizes prompts
                return
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenize("warm the tokenizer caches")

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            enc = self._tokenizer.encode(text, add_special_tokens=False)
            return list(enc.ids) if hasattr(enc, "ids") else list(enc)
        # vLLM and SGLang read "prompt"; llama.cpp reads "content" and answers [] for "prompt".
        for key in dict.fromkeys((self._tokenize_key, "prompt", "content")):
            out = self.client.post_json("/tokenize", {"model": self.model, key: text, "add_special_tokens": False})
            if out.get("tokens") or not text:
                self._tokenize_key = key
                return list(out.get("tokens") or [])
        return []

    def load_lora_adapters(self) -> None:
        """Register each adapter of `lora.adapters` and warm it with one marked request."""
        # A restarted server has forgotten its adapters: ask it what it serves.
        served = {m["id"] for m in self.client.get_json("/v1/models")["data"]}
        self.adapters = [a for a in self.adapters if a in served]
        for name, path in parse_adapters(self.lora_adapters):
            if name in served:
                if name not in self.adapters:
                    self.adapters.append(name)
                continue
            try:
                self.client.post_json("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            except EngineError as e:
                raise EngineError("lora_load_failed", f"LoRA adapter {name!r} ({path}): {e.message}") from None
            self.adapters.append(name)
            self._one_request(self.tokenize("warm the adapter")[:8] or [1], 1, True, model=name)
            self.log.info("LoRA adapter %s registered and warmed", name)

    def _one_request(self, prompt: list[int], max_new_tokens: int, warmup: bool,
                     model: str | None = None) -> RequestResult:
        """A greedy request of these token ids, sent as ids where the server takes them, else as text."""
        body: dict = {"max_tokens": max_new_tokens, "temperature": 0.0}
        if model:
            body["model"] = model
        if self.discovery.token_id_prompts or not self.apis:
            body["prompt"] = list(prompt)
            return self.client.request(body, "completions", warmup, len(prompt))
        text = self._tokenizer.decode(list(prompt)) if self._tokenizer is not None else _SEED_TEXT[:len(prompt) * 4]
        if "completions" in self.apis:
            body["prompt"] = text
            return self.client.request(body, "completions", warmup, len(prompt))
        body["messages"] = [{"role": "user", "content": text}]
        return self.client.request(body, "chat", warmup, len(prompt))

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 1,
                 warmup: bool = False) -> list[RequestResult]:
        return self.client.all_at_once([functools.partial(self._one_request, p, max_new_tokens, warmup) for p in prompts])

    def generate_requests(self, requests: list[WarmRequest], warmup: bool = True) -> list[RequestResult]:
        bodies = [self.body_for(r) for r in requests]
        return self.client.all_at_once([functools.partial(self.client.request, body, r.endpoint, warmup, n)
                                        for r, (body, n) in zip(requests, bodies, strict=True)])

    def body_for(self, r: WarmRequest) -> tuple[dict, int]:
        """The request body of a WarmRequest and its exact prompt length in tokens."""
        with self._lock:
            self._variant += 1
            variant = self._variant
        body = {"max_tokens": r.max_tokens, **r.sampling}
        if r.endpoint == "chat":
            if self.text is None or not self.text.has_chat_template:
                # No local template: the server's template adds tokens we cannot count.
                text = self._tokenizer.decode(self._ids(r.prompt_tokens, variant)) if self._tokenizer \
                    else self._plain_text(r.prompt_tokens, variant)
                body["messages"] = [{"role": "user", "content": text}]
                return body, r.prompt_tokens
            body["messages"], n = self.text.messages(r.prompt_tokens, variant)
            return body, n
        if self.discovery.token_id_prompts and self._tokenizer is not None:
            body["prompt"] = self._ids(r.prompt_tokens, variant)
            return body, r.prompt_tokens
        if self.text is not None:
            body["prompt"], n = self.text.text(r.prompt_tokens, variant)
            return body, n
        body["prompt"] = self._tokenizer.decode(self._ids(r.prompt_tokens, variant)) if self._tokenizer \
            else self._plain_text(r.prompt_tokens, variant)
        return body, r.prompt_tokens

    def _plain_text(self, length: int, variant: int) -> str:
        """About `length` tokens without a local tokenizer, sized by the server's, numbered
        so that none is answered from its prompt cache (tests/test_prompts_without_tokenizer.py)."""
        if self._chars_per_token is None:
            try:
                self._chars_per_token = len(_SEED_TEXT) / max(1, len(self.tokenize(_SEED_TEXT)))
            except (EngineError, KeyError, TypeError, ValueError):
                self._chars_per_token = 4.0
        words = _SEED_TEXT.split()
        out, i = [f"{variant}."], variant
        size = len(out[0]) + 1      # characters plus one separator per word, as joined
        while size < length * self._chars_per_token:
            out.append(words[i % len(words)])
            size += len(out[-1]) + 1
            i += 1
        return " ".join(out)

    def _ids(self, length: int, variant: int) -> list[int]:
        from warmup_agent.warmup.traffic import PromptFactory
        return PromptFactory(self.tokenize).prompt(length, variant)

    def facts(self) -> EngineFacts:
        cfg = self._model_config()
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "unknown"
        kv = sizing.kv_bytes_per_token_if_known(cfg, dtype)
        server = self.server
        extra: dict[str, Any] = {"url": self.url, "startup_seconds": dict(server.startup),
                                 "lora_adapters": list(self.adapters)}
        if server.supervisor is not None:
            extra.update(server_pid=server.supervisor.pid, server_restarts=server.supervisor.restarts,
                         server_spawn={**server.spawn, "after_process_start_seconds": server.supervisor.first_spawn_process_age,
                                       "healthy_after_spawn_seconds": server.supervisor.start_seconds})
        try:
            from exporter.engine_metrics import fetch_engine_stats
            from warmup_agent.server.signals import engine_metric_names
            stats = fetch_engine_stats(self.metrics_url, engine_metric_names(), timeout=2)
            extra.update(kv_cache_blocks=stats.kv_cache_blocks, kv_block_size=stats.kv_block_size,
                         kv_cache_usage_ratio=stats.kv_cache_usage_ratio)
        except Exception as e:  # noqa: BLE001 - facts stay useful without engine metrics
            extra["engine_metrics_error"] = str(e)
        return EngineFacts(engine=self.name, model=self.model or "", device="remote", dtype=dtype,
                           kv_bytes_per_token=kv, max_context=self.discovery.models_info.get("max_model_len"),
                           vocab_size=cfg.get("vocab_size"), extra=extra)

    def _model_config(self) -> dict:
        if self.model_dir:
            try:
                with open(os.path.join(self.model_dir, "config.json")) as f:
                    return json.load(f)
            except (OSError, ValueError):
                pass
        return {}

    def solidify(self, shapes: list[tuple[int, int]], mode: str = "auto") -> SolidifyReport:
        """Report the compile and graph-capture time the server's start-up log gives."""
        startup = self.server.startup
        seconds = startup.get("compile_seconds", 0.0) + startup.get("graph_capture_seconds", 0.0)
        return SolidifyReport(method="engine_startup", shapes=len(shapes), seconds=seconds,
                              detail=dict(startup))

    def weight_fingerprint(self) -> str:
        """Digest of the served model id and length, and each local safetensors file's name,
        size and header (headers only, so it stays cheap for large models)."""
        h = hashlib.sha256()
        h.update(json.dumps({"id": self.model, "max_model_len": self.discovery.models_info.get("max_model_len")},
                            sort_keys=True).encode())
        if self.model_dir and os.path.isdir(self.model_dir):
            for name in sorted(os.listdir(self.model_dir)):
                if not name.endswith(".safetensors"):
                    continue
                path = os.path.join(self.model_dir, name)
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    header = f.read(min(n, 100 << 20))
                h.update(name.encode() + str(os.path.getsize(path)).encode() + header)
        return h.hexdigest()
