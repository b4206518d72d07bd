"""What an OpenAI-compatible server can do, learned with marked requests, never from its name."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from warmup_agent.engines.base import EngineError
from warmup_agent.engines.openai.client import _PATHS
from warmup_agent.server.kinds import BY_OWNER, KINDS

if TYPE_CHECKING:
    from warmup_agent.config_sections import OpenaiSection
    from warmup_agent.engines.openai.client import StreamingClient



class Discovery:
    """What the server answers, asked through `client`; `request_apis` skips APIs the traffic never uses.

    Two steps, because the model directory may only be known after the first:
    `find_model`, then `find_the_rest`."""

    def __init__(self, client: StreamingClient, openai: OpenaiSection, request_apis: Collection[str] = (),
                 log: logging.Logger | None = None):
        self.client = client
        self.api_setting = openai.api                      # auto | chat | completions
        self.configured_concurrency = openai.concurrency   # 0: ask the server
        self.request_apis = frozenset(request_apis)
        self.log = log or logging.getLogger("warmup_agent.engines.openai")
        self.apis: list[str] = []
        self.token_id_prompts = False          # /v1/completions takes token ids (vLLM)
        self.concurrency = 1
        self.capabilities: dict = {}
        self.models_info: dict = {}            # the served model's entry in /v1/models
        self.props: dict = {}                  # what a kind's slots_path answered (llama.cpp's /props)

    def listed_models(self) -> list[dict]:
        """/v1/models, or [] when it fails (`transformers serve` fails without a hub cache)."""
        try:
            data = self.client.get_json("/v1/models").get("data")
        except (EngineError, ValueError, AttributeError):
            return []
        return [m for m in data if isinstance(m, dict) and m.get("id")] if isinstance(data, list) else []

    def find_model(self, model_dir: str | None, command: list[str] | None) -> str | None:
        """Settle the served model name and `apis`; return the model's `root` from /v1/models, or None."""
        client = self.client
        models = self.listed_models()
        ids = [m["id"] for m in models]
        candidates = [client.model] if client.model else []
        if not candidates:
            local = model_dir and os.path.abspath(model_dir)
            # A server started on the model directory serves it under that path
            # (`transformers serve DIR`) even when /v1/models does not say so.
            if model_dir and model_dir in ids:
                candidates = [model_dir]
            elif model_dir and local and command and any(os.path.abspath(w) == local for w in command if os.path.isdir(w)):
                candidates = [model_dir] + ids[:1]
            elif ids:
                candidates = ids[:1]
            else:
                raise EngineError("no_model_name",
                                  f"no model name: {client.url}/v1/models lists none; set openai.model (WARMUP_AGENT_OPENAI_MODEL)")
        wanted = ["chat", "completions"] if self.api_setting == "auto" else [self.api_setting]
        if self.api_setting == "auto" and self.request_apis:
            # Asking about an API the traffic never uses costs start-up time and warms nothing.
            wanted = [a for a in wanted if a in self.request_apis]
        errors: dict[str, str] = {}
        for model in candidates:
            client.model = model
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
            # /v1/models is not authoritative everywhere (transformers serve), so it is only the hint.
            raise EngineError("model_not_served",
                              f"openai.model {candidates[-1]!r} is not served by {client.url} (it lists: " + ", ".join(ids)
                              + "; " + "; ".join(f"{_PATHS[a]}: {m}" for a, m in errors.items()) + ")")
        if not self.apis:
            raise EngineError("no_openai_api", f"{client.url} answers none of the OpenAI APIs: "
                              + "; ".join(f"{_PATHS[a]}: {m}" for a, m in errors.items()))
        self.models_info = next((m for m in models if m["id"] == client.model), {})
        root = self.models_info.get("root")
        return root if isinstance(root, str) and root else None

    def find_the_rest(self, tokenize: Callable[[str], list[int]], chat_template: bool) -> None:
        """After find_model: token-id prompts, concurrency and `capabilities`."""
        client = self.client
        if "completions" in self.apis:
            try:
                client.request({"prompt": tokenize("token id prompt")[:4] or [1], "max_tokens": 1}, "completions", True)
                self.token_id_prompts = True
            except EngineError:
                self.token_id_prompts = False
        self.concurrency = self._concurrency()
        self.capabilities = {"apis": list(self.apis), "model": client.model, "token_id_prompts": self.token_id_prompts,
                             "concurrency": self.concurrency,
                             "rejected_fields": sorted(client.rejected_fields),
                             "chat_template": chat_template}
        self.log.info("server %s: model %s, APIs %s, token-id prompts %s, rejected optional fields %s",
                      client.url, client.model, ", ".join(self.apis), self.token_id_prompts,
                      sorted(client.rejected_fields) or "none")

    def _concurrency(self) -> int:
        """openai.concurrency, else the slots a kind's `slots_path` gives, else the owner kind's
        default, else 1.  What that path answered is kept in `props` (the server's context)."""
        self.props = {}
        for path, key in dict.fromkeys((k.slots_path, k.slots_key) for k in KINDS if k.slots_path):
            try:
                props = self.client.get_json(path)
                slots = int(props.get(key) or 0)
                if slots > 0:
                    self.props = props
                    return self.configured_concurrency if self.configured_concurrency > 0 else slots
            except Exception:  # noqa: BLE001 - not that kind (404), or an old one
                pass
        if self.configured_concurrency > 0:
            return self.configured_concurrency
        kind = BY_OWNER.get(str(self.models_info.get("owned_by", "")))
        return kind.concurrency if kind is not None and kind.concurrency else 1

    def _ask(self, api: str) -> None:
        """One marked 1-token request on `api`; EngineError when not answered."""
        if api == "chat":
            self.client.request({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}, api, True)
        else:
            self.client.request({"prompt": "Hello", "max_tokens": 1}, api, True)
