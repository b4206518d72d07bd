"""What an OpenAI-compatible server can do, learned by asking it (never from its
name): which of the two APIs answer, whether `/v1/completions` takes token-id
prompts (vLLM; then prompt lengths are exact by construction), whether it
accepts vLLM's `ignore_eos`, `/tokenize`, LoRA endpoints, `vllm:` metrics; the
model's config and quantization."""
from __future__ import annotations

import json
import os
import time
from typing import Any

from warmup_agent.engines.base import EngineError, EngineFacts
from warmup_agent.engines.openai.client import _PATHS, StreamingClient
from warmup_agent.gpu import sizing
from warmup_agent.server.command import parse_adapters

#: Requests at once where the server batches them but does not say how many: by the
#: `owned_by` its /v1/models gives the model (openai.concurrency overrides).
SERVER_CONCURRENCY = {"vllm": 4, "sglang": 4}


class Discovery(StreamingClient):
    """Discovery and capabilities (the middle layer of OpenAIEngine)."""

    def _detect_quantization(self) -> Any:
        """What the server runs quantized (issue 16): its flags (--quantization,
        --kv-cache-dtype) over the model directory's config.json when we can read it.
        The agent cannot see a server's scales: docs/fp8.md says what is not checked."""
        from warmup_agent import quantization
        model_info = None
        if self.model_dir:
            try:
                model_info = quantization.from_config(quantization.read_model_config(self.model_dir),
                                                      f"{self.model_dir}/config.json")
            except EngineError as e:   # the server reads that file too, and says so in its own words
                self.log.warning("%s", e)
        return quantization.from_command_line(self.command, model_info)

    # -- environment for a supervised server ------------------------------------------

    def _listed_models(self) -> list[dict]:
        """/v1/models, or [] when the server has none or cannot list them
        (`transformers serve` lists its hub cache, and fails without one)."""
        try:
            data = self._get_json("/v1/models").get("data")
        except (EngineError, ValueError, AttributeError):
            return []
        return [m for m in data if isinstance(m, dict) and m.get("id")] if isinstance(data, list) else []

    def _discover(self) -> None:
        """Ask the server what it serves and answers: model name, APIs, token-id
        prompts, vLLM's optional fields.  Every question is a marked 1-token request."""
        self.load_tokenizer()      # prompts of exact lengths from here on
        models = self._listed_models()
        ids = [m["id"] for m in models]
        candidates = [self.model] if self.model else []
        if not candidates:
            local = self.model_dir and os.path.abspath(self.model_dir)
            # A server started on the model directory serves it under that path
            # (`transformers serve DIR`) even when /v1/models does not say so.
            if self.model_dir and self.model_dir in ids:
                candidates = [self.model_dir]
            elif self.model_dir and local and self.command and any(os.path.abspath(w) == local for w in self.command if os.path.isdir(w)):
                candidates = [self.model_dir] + ids[:1]
            elif ids:
                candidates = ids[:1]
            else:
                raise EngineError("no_model_name",
                                  f"no model name: {self.url}/v1/models lists none; set openai.model (WARMUP_AGENT_OPENAI_MODEL)")
        wanted = ["chat", "completions"] if self.api_setting == "auto" else [self.api_setting]
        used = self.cfg.requests_check.endpoints if self.cfg.requests_check is not None else set()
        if self.api_setting == "auto" and used:
            # The requests file says which APIs the traffic uses: a question about the
            # other one is a request on the critical path that warms nothing the
            # users will send (on llama.cpp two of discovery's four, 60 ms of 130).
            wanted = [a for a in wanted if a in used]
        errors: dict[str, str] = {}
        for model in candidates:
            self.model = model
            self.apis, errors = [], {}
            for api in wanted:
                try:
                    self._ask(api)
                    self.apis.append(api)
                except EngineError as e:
                    errors[api] = e.message
            if self.apis:
                break
        if not self.apis and ids and candidates[-1] not in ids:
            # /v1/models is not authoritative everywhere (transformers serve lists its
            # hub cache), so the name was asked first; refused, the list is the hint.
            raise EngineError("model_not_served",
                              f"openai.model {candidates[-1]!r} is not served by {self.url} (it lists: " + ", ".join(ids)
                              + "; " + "; ".join(f"{_PATHS[a]}: {m}" for a, m in errors.items()) + ")")
        if not self.apis:
            raise EngineError("no_openai_api", f"{self.url} answers none of the OpenAI APIs: "
                              + "; ".join(f"{_PATHS[a]}: {m}" for a, m in errors.items()))
        info = next((m for m in models if m["id"] == self.model), None)
        self._models_info = info or {}
        if self.model_dir is None and info and info.get("root") and os.path.isdir(info["root"]):
            self.model_dir = info["root"]
            self.load_tokenizer()
        if "completions" in self.apis:
            try:
                self._request({"prompt": self.tokenize("token id prompt")[:4] or [1], "max_tokens": 1}, "completions", True)
                self.token_id_prompts = True
            except EngineError:
                self.token_id_prompts = False
        self.concurrency = self._concurrency()
        self.capabilities = {"apis": list(self.apis), "model": self.model, "token_id_prompts": self.token_id_prompts,
                             "concurrency": self.concurrency,
                             "rejected_fields": sorted(self.rejected_fields),
                             "chat_template": bool(self.text and self.text.has_chat_template)}
        self.log.info("server %s: model %s, APIs %s, token-id prompts %s, rejected optional fields %s",
                      self.url, self.model, ", ".join(self.apis), self.token_id_prompts, sorted(self.rejected_fields) or "none")

    def _concurrency(self) -> int:
        """Requests the server serves at once: openai.concurrency when set, else
        llama-server's slots (its /props), else 4 where /v1/models says vLLM or SGLang
        owns the model (they batch), else 1."""
        if self.cfg.openai.concurrency > 0:
            return self.cfg.openai.concurrency
        try:
            slots = int(self._get_json("/props").get("total_slots") or 0)
            if slots > 0:
                return slots
        except Exception:  # noqa: BLE001 - not llama.cpp (404), or an old one
            pass
        return SERVER_CONCURRENCY.get(str(self._models_info.get("owned_by", "")), 1)

    def _ask(self, api: str) -> None:
        """One marked 1-token request on `api`; raises EngineError when it is not answered."""
        if api == "chat":
            self._request({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}, api, True)
        else:
            self._request({"prompt": "Hello", "max_tokens": 1}, api, True)

    def _wait_remote_healthy(self) -> None:
        import urllib.error  # here, not at the top: see OpenAIClient (engines/openai/client.py)
        import urllib.request
        deadline = time.monotonic() + self.cfg.openai.ready_timeout_seconds
        last = ""
        while time.monotonic() < deadline:
            if self._interrupted.is_set():
                raise EngineError("stopped", "stopped before the server became healthy")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(getattr(e, "reason", e))
            self._interrupted.wait(0.5)
        raise EngineError("server_never_healthy",
                          f"{self.url}{self.health_path} did not answer 200 within {self.cfg.openai.ready_timeout_seconds:g} s"
                          + (f" (last error: {last})" if last else ""))

    def load_lora_adapters(self) -> None:
        """Register each adapter of `lora.adapters` (POST /v1/load_lora_adapter) and
        warm it with one marked request, one by one."""
        # A restarted server has forgotten its adapters: ask it what it serves.
        served = {m["id"] for m in self._get_json("/v1/models")["data"]}
        self.adapters = [a for a in self.adapters if a in served]
        for name, path in parse_adapters(self.cfg.lora.adapters):
            if name in served:
                if name not in self.adapters:
                    self.adapters.append(name)
                continue
            try:
                self._post_json("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            except EngineError as e:
                raise EngineError("lora_load_failed", f"LoRA adapter {name!r} ({path}): {e.message}") from None
            self.adapters.append(name)
            self._one_request(self.tokenize("warm the adapter")[:8] or [1], 1, True, model=name)
            self.log.info("LoRA adapter %s registered and warmed", name)

    def facts(self) -> EngineFacts:
        cfg = self._model_config()
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "unknown"
        kv = sizing.kv_bytes_per_token_if_known(cfg, dtype)
        extra: dict[str, Any] = {"url": self.url, "startup_seconds": dict(self.startup),
                                 "lora_adapters": list(self.adapters)}
        if self.supervisor is not None:
            extra.update(server_pid=self.supervisor.pid, server_restarts=self.supervisor.restarts,
                         server_spawn={**self.spawn, "after_process_start_seconds": self.supervisor.first_spawn_process_age,
                                       "healthy_after_spawn_seconds": self.supervisor.start_seconds})
        try:
            from exporter.engine_metrics import fetch_engine_stats
            stats = fetch_engine_stats(self.metrics_url, timeout=2)
            extra.update(kv_cache_blocks=stats.kv_cache_blocks, kv_block_size=stats.kv_block_size,
                         kv_cache_usage_ratio=stats.kv_cache_usage_ratio)
        except Exception as e:  # noqa: BLE001 - facts stay useful without engine metrics
            extra["engine_metrics_error"] = str(e)
        return EngineFacts(engine=self.name, model=self.model or "", device="remote", dtype=dtype,
                           kv_bytes_per_token=kv, max_context=self._models_info.get("max_model_len"),
                           vocab_size=cfg.get("vocab_size"), extra=extra)

    @property
    def metrics_url(self) -> str:
        """The server's Prometheus endpoint (read at scrape time by exporter.engine_metrics)."""
        return self.url + "/metrics"

    def _model_config(self) -> dict:
        if self.model_dir:
            try:
                with open(os.path.join(self.model_dir, "config.json")) as f:
                    return json.load(f)
            except (OSError, ValueError):
                pass
        return {}
