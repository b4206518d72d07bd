"""The `openai` engine: any OpenAI-compatible server, over HTTP.

Either the agent starts and supervises the server (`warmup-agent run --engine
openai -- <server command...>`), or it talks to one already running
(`openai.url`).  Requests are streamed `/v1/chat/completions` and
`/v1/completions`; time to first token is measured as a client sees it, from
sending the request to the first streamed chunk that carries text, and the
whole answer to the end of the stream.

What the server can do is learned by asking it, never from its name: which of
the two APIs answer, whether `/v1/completions` takes token-id prompts (vLLM;
then prompt lengths are exact by construction), whether it accepts vLLM's
`ignore_eos` (answers of exactly max_tokens), `/tokenize`, LoRA endpoints and
`vllm:` metrics.  Text prompts are sized to an exact token length with the
model's own tokenizer and chat template (engines/text_prompts.py).

The class is built in layers, each in its own module: the HTTP client
(engines/openai/client.py), discovery and capabilities (engines/openai/discovery.py), the
server glue (engines/openai/server.py), the command-line helpers (server/command.py);
this module adds what makes it an Engine.  Its public names stay importable
from here.

Agent traffic carries `X-Warmup: true` and a request id starting with
`warmup-` (vLLM takes `X-Request-Id` as its request id, so its request log shows
which requests were ours).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import threading
import urllib.parse
from typing import TYPE_CHECKING, Callable

from warmup_agent.engines.base import EngineError, SolidifyReport
from warmup_agent.engines.openai.client import StreamingClient, _Rejected
from warmup_agent.engines.openai.discovery import Discovery
from warmup_agent.engines.openai.server import ServerGlue
from warmup_agent.engines.openai.server_traffic import ServerTraffic
from warmup_agent.engines.text_prompts import TextPrompts
from warmup_agent.server.command import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    describe_command,
    fix_vllm_command,
    listen_address,
    option,
    parse_adapters,
)
from warmup_agent.warmup.traffic import _SEED_TEXT

if TYPE_CHECKING:
    from warmup_agent.config import Config
    from warmup_agent.server.supervisor import Supervisor

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "Discovery", "OpenAIEngine", "ServerGlue", "StreamingClient", "_Rejected",
           "describe_command", "fix_vllm_command", "option", "parse_adapters"]


class OpenAIEngine(ServerGlue):
    """`server_command`: the server to start and supervise (None: use `openai.url`).
    `on_server_exit(returncode)` / `on_server_ready()` are called when a supervised
    server crashes and when it is healthy again after a restart (given here or
    through set_server_callbacks)."""

    name = "openai"
    speaks_profile = True   # generate_requests, apis, text, capabilities (Engine)
    loads_by_starting_server = True   # load_weights is the server's start-up (Engine)

    def __init__(self, cfg: Config, server_command: list[str] | None = None, log: logging.Logger | None = None,
                 on_server_exit: Callable[[int], None] | None = None,
                 on_server_ready: Callable[[], None] | None = None,
                 base_env: dict[str, str] | None = None, model_path: str | None = None):
        self.cfg = cfg
        self.base_env = base_env          # the server's environment before ours (default: os.environ)
        self.log = log or logging.getLogger("warmup_agent.engines.openai")
        self.command = fix_vllm_command(server_command) if server_command else None
        if self.command:
            host, port = listen_address(self.command)
            self.host: str = host
            self.port: int | None = port
            self.url = (cfg.openai.url or f"http://{host}:{port}").rstrip("/")
        elif cfg.openai.url:
            self.url = cfg.openai.url.rstrip("/")
            parsed = urllib.parse.urlparse(self.url)
            self.host, self.port = parsed.hostname or "", parsed.port   # "": a URL without a host
        else:
            raise EngineError("server_command_missing",
                              "engine openai needs a server command after -- or openai.url (WARMUP_AGENT_OPENAI_URL)")
        self.on_server_exit = on_server_exit
        self.on_server_ready = on_server_ready
        self.timeout = cfg.openai.request_timeout_seconds
        self.model: str | None = cfg.openai.model or (option(self.command, "--served-model-name") if self.command else None)
        self.model_dir: str | None = (model_path or cfg.model.path
                                      or (option(self.command, "--model") if self.command else None))
        self.quantization = self._detect_quantization()
        self.supervisor: Supervisor | None = None   # the server we started (server_command), once started
        self._start_thread: threading.Thread | None = None   # prestart(): waiting for the first health 200
        self._start_error: EngineError | None = None
        self._interrupted = threading.Event()  # set by interrupt(): the agent drains during warmup
        self.startup: dict[str, float] = {}
        self.spawn: dict = {}                  # the supervised server's spawn: early (server/early_spawn.py) or not, and why
        self.adapters: list[str] = []      # registered LoRA adapter names
        self.health_path = "/" + cfg.openai.health_path.lstrip("/")
        self.api_setting = cfg.openai.api   # auto | chat | completions
        self._tokenizer = None
        self.text: TextPrompts | None = None   # exact-length text prompts (local tokenizer)
        self.apis: list[str] = []              # "chat", "completions": what the server answers
        self.token_id_prompts = False          # /v1/completions takes token ids (vLLM)
        self.rejected_fields: set[str] = set() # our optional fields the server refused (ignore_eos, ...)
        self.capabilities: dict = {}
        self._variant = 0
        self._models_info: dict = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="openai-req")
        self._lock = threading.Lock()
        self.traffic = ServerTraffic()         # other clients' requests, from the supervised server's log

    def has_compile_artifacts(self) -> bool:
        """Whether the supervised server wrote anything into the compile-cache
        folders server_env() gave it (solidify shares them through the kernel cache)."""
        if not self.command:
            return True
        env = self.server_env()
        for var in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            for _, _, files in os.walk(env[var]):
                if files:
                    return True
        return False

    def others_served_within(self, seconds: float) -> float | None:
        return self.traffic.others_within(seconds)

    def load_tokenizer(self) -> None:
        """Local tokenizer of the model directory when we know it, else the server's
        /tokenize (checked once the server is up)."""
        if self._tokenizer is not None or not self.model_dir or not os.path.isdir(self.model_dir):
            return
        path = os.path.join(self.model_dir, "tokenizer.json")
        if os.path.exists(path):
            # The `tokenizers` library alone: no transformers import in the agent.
            self.text = TextPrompts.from_model_dir(self.model_dir, _SEED_TEXT)
            self._tokenizer = self.text.tok
        else:
            try:
                from transformers import AutoTokenizer
            except ImportError:  # the small install (no [torch] extra): the server's /tokenize sizes prompts
                return
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenize("warm the tokenizer caches")

    def load_weights(self) -> None:
        """Start the server (or wait for the given one) until healthy, learn the
        served model, then register and warm the LoRA adapters."""
        self.start_server()
        self._discover()
        self.load_lora_adapters()

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            enc = self._tokenizer.encode(text, add_special_tokens=False)
            return list(enc.ids) if hasattr(enc, "ids") else list(enc)
        out = self._post_json("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return list(out["tokens"])

    @property
    def model_path(self) -> str | None:
        """Local model directory when known (reserve checks that its weights fit)."""
        return self.model_dir if self.model_dir and os.path.isdir(self.model_dir) else None

    def solidify(self, shapes: list[tuple[int, int]], mode: str = "auto") -> SolidifyReport:
        """vLLM compiles and captures graphs itself at start-up, into the cache
        directories the agent gave it: report what its log says that took."""
        seconds = self.startup.get("compile_seconds", 0.0) + self.startup.get("graph_capture_seconds", 0.0)
        return SolidifyReport(method="engine_startup", shapes=len(shapes), seconds=seconds,
                              detail=dict(self.startup))

    def weight_fingerprint(self) -> str:
        """Digest of what the server serves: model id and max length from the server,
        plus name, size and safetensors header (dtypes, shapes, offsets) of each weight
        file in the model directory when it is readable here.  Header-only, so it costs
        milliseconds even for a 70B model; a changed or swapped file changes it."""
        h = hashlib.sha256()
        h.update(json.dumps({"id": self.model, "max_model_len": self._models_info.get("max_model_len")},
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
