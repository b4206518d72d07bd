"""Configuration: one YAML file, `WARMUP_AGENT_*` environment overrides, CLI flags.

Precedence: built-in defaults < YAML file < environment < command-line flags.
Every key is declared once in `KEYS` (type, default, check, doc); the YAML
reference in docs/config.md, `warmup-agent config-reference` and the typed
sections of config_sections.py are generated from it (so
`cfg.readiness.p90_threshold_seconds` is an attribute that mypy checks, beside
`cfg["readiness.p90_threshold_seconds"]`).  A bad value raises `ConfigError`, whose message is one line naming
the file, the key, the value and what was expected.
"""
from __future__ import annotations

import difflib
import keyword
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

from warmup_agent import config_sections
from warmup_agent.config_sections import Sections

if TYPE_CHECKING:
    from warmup_agent.warmup.requests_file import FileCheck


class ConfigError(Exception):
    """A user mistake in configuration.  `str(e)` is the one line to show."""

    reason = "invalid_config"

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class Key:
    """One configuration key.  A plain class, not a dataclass: this module is imported
    before a supervised server is spawned (server/early_spawn.py), and `dataclasses`
    (with `inspect`) plus one generated __init__ per class cost tens of milliseconds
    on that path."""
    __slots__ = ("path", "kind", "default", "doc", "check", "expected", "choices")

    def __init__(self, path: str, kind: str, default: Any, doc: str, check: Callable[[Any], bool] | None = None,
                 expected: str = "", choices: tuple[str, ...] | None = None) -> None:
        self.path = path            # dotted key, e.g. "readiness.p50_threshold_seconds"
        self.kind = kind            # str | int | float | bool | int_list | str_or_null
        self.default = default
        self.doc = doc
        self.check = check
        self.expected = expected    # what the check wants, for the error line
        self.choices = choices

    @property
    def env(self) -> str:
        return "WARMUP_AGENT_" + self.path.upper().replace(".", "_")


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _positive_list(v: Any) -> bool:
    return len(v) > 0 and all(x > 0 for x in v)


def _listen(v: Any) -> bool:
    host, _, port = v.rpartition(":")
    return bool(host) and port.isdigit() and 0 <= int(port) <= 65535


def _default_data_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "warmup-agent")


KEYS: tuple[Key, ...] = (
    Key("engine", "str", "torch", "Engine adapter: torch (in-process PyTorch: its own Llama/Qwen2 forward, transformers for other models), vllm (in-process vLLM) or openai (an OpenAI-compatible server).",
        choices=("torch", "vllm", "openai")),
    Key("data_dir", "str", None, "Directory for the embedded model, caches and records. Default: $XDG_CACHE_HOME/warmup-agent or ~/.cache/warmup-agent."),
    Key("model.path", "str_or_null", None, "Hugging Face-layout model directory (config.json, tokenizer, *.safetensors). Empty: the embedded default, a small Llama with random weights created once under data_dir."),
    Key("model.dtype", "str", "auto", "Weight dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16.",
        choices=("auto", "float32", "bfloat16", "float16")),
    Key("model.device", "str", "auto", "Device: auto (cuda if available, else cpu), cpu, cuda or cuda:N.",
        check=lambda v: v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()),
        expected="auto, cpu, cuda or cuda:N"),
    Key("model.implementation", "str", "auto", "Torch engine forward: auto (native for Llama and Qwen2 models it runs exactly, else transformers), native (plain torch, no transformers import; fails with native_unsupported for other models) or transformers (every architecture and FP8). engine_facts.extra names the one that ran.",
        choices=("auto", "native", "transformers")),
    Key("exporter.listen", "str", "127.0.0.1:9400", "HOST:PORT of the exporter (/metrics, /healthz, /readyz, /startupz). Use 0.0.0.0:9400 in a pod.",
        check=_listen, expected="HOST:PORT with a port in 0..65535 (0: any free port)"),
    Key("exporter.tls_cert_file", "str_or_null", None, "PEM certificate; with tls_key_file, serve HTTPS (TLS 1.2+). Older form of exporter.web_config_file's tls_server_config; do not set both."),
    Key("exporter.tls_key_file", "str_or_null", None, "PEM private key for tls_cert_file."),
    Key("exporter.basic_auth_username", "str_or_null", None, "If set, every endpoint but /healthz, /readyz and /startupz requires HTTP basic auth (one user, plain password file). Prefer exporter.web_config_file's basic_auth_users (bcrypt hashes); do not set both."),
    Key("exporter.basic_auth_password_file", "str_or_null", None, "File holding the basic-auth password (kept out of the config and the environment)."),
    Key("reserve.pin_cpus", "bool", True, "Pin the process to the CPUs local to its GPU (intersected with the allowed cpuset)."),
    Key("prewarm.prompt_lengths", "int_list", [16, 32, 64, 128], "Prompt lengths (tokens) of the synthetic warmup grid; cover what real traffic sends.",
        check=_positive_list, expected="a non-empty list of integers > 0"),
    Key("prewarm.batch_sizes", "int_list", [1, 2, 4], "Batch sizes of the synthetic warmup grid.",
        check=_positive_list, expected="a non-empty list of integers > 0"),
    Key("prewarm.requests_per_shape", "int", 1, "torch and vllm engines: the least cap on warmup calls per (prompt length, batch size) shape; each shape is sent until its calls stop getting faster or match the steady level (prewarm.converge_tolerance), at most max(this, prewarm.max_calls_per_path) times.",
        check=_positive, expected="an integer > 0"),
    Key("prewarm.max_new_tokens", "int", 2, "Tokens generated per warmup request (>= 2 also warms the decode step).",
        check=_positive, expected="an integer > 0"),
    Key("solidify.mode", "str", "auto", "auto (best the engine supports), none, replay (run the warmed shapes once more), compile (torch.compile) or cuda_graphs.",
        choices=("auto", "none", "replay", "compile", "cuda_graphs")),
    Key("readiness.p50_threshold_seconds", "float", 0.85, "Ready only when the window's P50 time to first token is at or under this (seed: 850 ms).",
        check=_positive, expected="a number > 0"),
    Key("readiness.p90_threshold_seconds", "float", 2.1, "Ready only when the window's P90 time to first token is at or under this (seed: 2100 ms).",
        check=_positive, expected="a number > 0"),
    Key("readiness.min_probes", "int", 10, "Probes needed in the window before readiness is decided.",
        check=_positive, expected="an integer > 0"),
    Key("readiness.window_size", "int", 100, "Sliding-window length in probes (quantiles are exact over it).",
        check=_positive, expected="an integer > 0"),
    Key("readiness.max_probes", "int", 200, "Give up (reason readiness_thresholds_not_met) after this many probes.",
        check=_positive, expected="an integer > 0"),
    Key("readiness.probe_prompt_length", "int", 16, "Prompt length (tokens) of a readiness probe.",
        check=_positive, expected="an integer > 0"),
    Key("readiness.probe_interval_seconds", "float", 0.0, "Pause between probes while gating readiness.",
        check=_non_negative, expected="a number >= 0"),
    Key("readiness.watch_interval_seconds", "float", 5.0, "After SERVING, one probe every this many seconds keeps the window fresh (0: no probes after SERVING); paused while a supervised server's log shows other clients' requests in the last two intervals (or two of the longest answers a probe timed).",
        check=_non_negative, expected="a number >= 0"),
    Key("deadlines.init_seconds", "float", 60.0, "Deadline of INIT (reserve). 0 disables.",
        check=_non_negative, expected="a number >= 0"),
    Key("deadlines.preload_seconds", "float", 30.0, "Deadline of PRELOAD (weights, tokenizer, warmup traffic); seed default 30 s. Left at the default with engine openai or vllm, openai.ready_timeout_seconds is added (PRELOAD then includes the server's start-up). 0 disables.",
        check=_non_negative, expected="a number >= 0"),
    Key("deadlines.prime_seconds", "float", 300.0, "Deadline of PRIME (solidify and readiness gate). 0 disables.",
        check=_non_negative, expected="a number >= 0"),
    Key("log.level", "str", "info", "Log level.", choices=("debug", "info", "warning", "error")),
    Key("log.format", "str", "text", "text, or json (one object per line).", choices=("text", "json")),
    # --- openai / vllm / lora (engines openai and vllm) ---------------------------
    Key("openai.url", "str_or_null", None, "Base URL of an OpenAI-compatible server already running (e.g. http://127.0.0.1:8000). Empty with a server command after --: derived from its --host/--port (default 127.0.0.1:8000)."),
    Key("openai.model", "str_or_null", None, "Served model name sent in requests. Empty: the first model listed by the server's /v1/models."),
    Key("openai.ready_timeout_seconds", "float", 600.0, "How long the server may take to answer /health with 200 after it was started (vLLM imports and loads weights first).",
        check=_positive, expected="a number > 0"),
    Key("openai.request_timeout_seconds", "float", 120.0, "Timeout of one HTTP request to the server.",
        check=_positive, expected="a number > 0"),
    Key("openai.restart_backoff_initial_seconds", "float", 1.0, "Wait before the first restart of a crashed server; doubles after each crash.",
        check=_non_negative, expected="a number >= 0"),
    Key("openai.restart_backoff_max_seconds", "float", 30.0, "Cap of the restart backoff.",
        check=_non_negative, expected="a number >= 0"),
    Key("openai.drain_seconds", "float", 10.0, "On stop, time the server gets after SIGTERM to finish in-flight requests before SIGKILL.",
        check=_non_negative, expected="a number >= 0"),
    Key("vllm.kv_cache_memory_bytes", "int", 0, "KV cache size handed to vLLM. 0: computed by reserve from measured free memory (CPU build: a quarter of available memory, at most 4 GiB). Added as --kv-cache-memory-bytes to a supervised vLLM command that sets neither it nor --gpu-memory-utilization.",
        check=_non_negative, expected="an integer >= 0"),
    Key("vllm.gpu_memory_utilization", "float", 0.9, "In-process vllm engine on a GPU: fraction of GPU memory vLLM may use (ignored when kv_cache_memory_bytes is set).",
        check=lambda v: 0 < v <= 1, expected="a number in (0, 1]"),
    Key("vllm.max_model_len", "int", 0, "In-process vllm engine: maximum context length. 0: the model's own.",
        check=_non_negative, expected="an integer >= 0"),
    Key("vllm.max_num_seqs", "int", 0, "In-process vllm engine: maximum concurrent sequences. 0: vLLM's default.",
        check=_non_negative, expected="an integer >= 0"),
    Key("vllm.enforce_eager", "bool", False, "In-process vllm engine: disable CUDA graphs and torch.compile (always eager on the CPU build)."),
    Key("lora.adapters", "str_or_null", None, "LoRA adapters to register and warm, as NAME=PATH[,NAME=PATH...] (PEFT layout). The server needs --enable-lora; the agent sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for a supervised one.",
        check=lambda v: all("=" in part and part.split("=", 1)[0].strip() and part.split("=", 1)[1].strip() for part in v.split(",")),
        expected="NAME=PATH pairs separated by commas"),
    Key("lora.max_rank", "int", 16, "In-process vllm engine: largest LoRA rank to support.",
        check=_positive, expected="an integer > 0"),
    # --- kernel_cache (warmup_agent/kernel_cache) -------------------------------------
    Key("kernel_cache.dir", "str_or_null", None, "Local tier of the kernel cache: one directory per kind (inductor, triton, vllm) under <dir>/<namespace>/. Default: <data_dir>/kernel-cache."),
    Key("kernel_cache.max_local_bytes", "int", 10 << 30, "Size bound of the local tier in bytes; least recently used files are evicted beyond it.",
        check=_positive, expected="an integer > 0 (bytes)"),
    Key("kernel_cache.redis_url", "str_or_null", None, "Redis of the shared tier, e.g. redis://redis.cache:6379/0. Empty: local tier only.",
        check=lambda v: v.startswith(("redis://", "rediss://", "unix://")), expected="a URL starting with redis://, rediss:// or unix://"),
    Key("kernel_cache.secret_file", "str_or_null", None, "File holding the HMAC-SHA256 key (>= 16 bytes) that signs shared entries (the Helm chart mounts it from a Secret). Without a key the shared tier is off."),
    Key("kernel_cache.secret", "str_or_null", None, "The HMAC key itself, for development; prefer secret_file (which wins when both are set)."),
    Key("kernel_cache.key_prefix", "str", "warmup:kc", "Prefix of every Redis key of the cache (separate deployments sharing one Redis).",
        check=lambda v: bool(v) and not any(c.isspace() for c in v), expected="a non-empty string without spaces"),
    Key("kernel_cache.ttl_seconds", "int", 7 * 24 * 3600, "Lifetime of shared entries in seconds, refreshed when published or restored; unused namespaces (old versions) expire.",
        check=_positive, expected="an integer > 0 (seconds)"),
    Key("kernel_cache.max_entry_bytes", "int", 64 << 20, "Largest artifact file published to the shared tier, in bytes; larger ones stay local.",
        check=_positive, expected="an integer > 0 (bytes)"),
    Key("kernel_cache.socket_timeout_seconds", "float", 1.0, "Redis connect and read timeout; a slower Redis counts as unavailable (local tier only).",
        check=_positive, expected="a number > 0"),
    Key("kernel_cache.retry_interval_seconds", "float", 30.0, "After a Redis failure, skip the shared tier for this long before trying again.",
        check=_non_negative, expected="a number >= 0"),
    Key("kernel_cache.lock_ttl_seconds", "float", 600.0, "Expiry of the fleet-wide compile lock; longer than one compile, so a crashed winner frees it.",
        check=_positive, expected="a number > 0"),
    Key("kernel_cache.lock_wait_seconds", "float", 300.0, "How long a pod that lost the compile race waits for the winner's publish before compiling itself.",
        check=_non_negative, expected="a number >= 0"),
    # --- readiness gate extras, breaker, proxy, validation (warmup_agent/readiness, proxy.py) ---
    Key("readiness.window_seconds", "float", 0.0, "Also bound the sliding window in time: only samples of the last this many seconds count (0: the last window_size samples only).",
        check=_non_negative, expected="a number >= 0"),
    Key("readiness.adaptive", "bool", False, "Re-fit the thresholds every adaptive_every_samples samples to adaptive_margin x the observed P50/P90, between adaptive_min_seconds and the configured thresholds (which stay the ceiling)."),
    Key("readiness.adaptive_every_samples", "int", 50, "Samples between two adaptive re-fits.",
        check=_positive, expected="an integer > 0"),
    Key("readiness.adaptive_margin", "float", 1.5, "Adaptive threshold = this x the observed percentile.",
        check=lambda v: v >= 1, expected="a number >= 1"),
    Key("readiness.adaptive_min_seconds", "float", 0.01, "Lower bound of an adaptive threshold.",
        check=_positive, expected="a number > 0"),
    Key("readiness.water_level_alpha", "float", 0.85, "Water level T = alpha*T_prev + (1-alpha)*(Q*headroom): smoothing factor (seed 0.85).",
        check=lambda v: 0 <= v < 1, expected="a number in [0, 1)"),
    Key("readiness.water_level_window_seconds", "int", 60, "Window of the QPS average Q of the water level (seed 60 s).",
        check=_positive, expected="an integer > 0 (seconds)"),
    Key("readiness.water_level_period_seconds", "float", 5.0, "The water level is updated once per this many seconds (seed 5 s).",
        check=_positive, expected="a number > 0"),
    Key("readiness.water_level_headroom", "float", 1.2, "Headroom factor on Q in the water level (seed 1.2).",
        check=_positive, expected="a number > 0"),
    Key("readiness.ready_while_asleep", "bool", True, "While the server sleeps, /readyz stays 200 (users' requests wake it and the first pays the reload) or, false, the pod leaves its Service until a wake (POST /admin/wake) has warmed it.",),
    Key("readiness.watch_probe_timeout_seconds", "float", 0.0, "A probe after SERVING (or a half-open probe) that has not answered within this many seconds counts as failed, reason timeout (0: the larger of readiness.watch_interval_seconds and twice readiness.p90_threshold_seconds).",
        check=_non_negative, expected="a number >= 0"),
    Key("readiness.first_user_steady_requests", "int", 5, "The users' real first request (through the proxy) is compared with the median of this many users' answers after it; its figures are exported once they are in.",
        check=_positive, expected="an integer > 0"),
    Key("breaker.enabled", "bool", True, "After SERVING, trip to DEGRADED (fallback) when the window P90 exceeds readiness.p90_threshold_seconds on trip_after consecutive samples, or when fail_after probes in a row fail."),
    Key("breaker.trip_after", "int", 3, "Consecutive samples with the window P90 over the tail threshold that trip the breaker (seed 3).",
        check=_positive, expected="an integer > 0"),
    Key("breaker.open_seconds", "float", 30.0, "How long a tripped breaker freezes the main path before half-open probes (seed 30 s).",
        check=_positive, expected="a number > 0"),
    Key("breaker.fail_after", "int", 1, "Consecutive failed probes after SERVING (server unreachable, timeout, HTTP 5xx, an answer without a token) that trip the breaker.",
        check=_positive, expected="an integer > 0"),
    Key("breaker.unreachable_open_seconds", "float", 0.0, "The freeze after a probe found the server unreachable (connection refused or reset): 0 probes it again at the next watch interval, so a restarted server is back after its half-open probes; other causes freeze for open_seconds.",
        check=_non_negative, expected="a number >= 0"),
    Key("breaker.half_open_probes", "int", 3, "Consecutive half-open probes at or under the tail threshold that close the breaker (back to SERVING).",
        check=_positive, expected="an integer > 0"),
    Key("proxy.listen", "str_or_null", None, "HOST:PORT of the OpenAI-compatible routing proxy (/v1/completions, /v1/chat/completions). Empty: no proxy.",
        check=_listen, expected="HOST:PORT with a port in 0..65535 (0: any free port)"),
    Key("proxy.upstream_url", "str_or_null", None, "Base URL of the main engine's OpenAI-compatible server. Empty: openai.url."),
    Key("proxy.fallback_url", "str_or_null", None, "Base URL of a fallback server (a smaller model) used while warming or DEGRADED. Empty: answer 503 with Retry-After.",
        check=lambda v: v.startswith(("http://", "https://")), expected="a URL starting with http:// or https://"),
    Key("proxy.hold_seconds", "float", 120.0, "Without proxy.fallback_url, a user request that arrives while the pod warms (a start, a restart, a wake) waits up to this long and is served as soon as the gate opens, as Knative's activator holds requests; past it, 503 with Retry-After (0: refuse at once).",
        check=_non_negative, expected="a number >= 0 (seconds)"),
    Key("proxy.retry_after_seconds", "int", 5, "Retry-After of a 503 (past proxy.hold_seconds while warming; while the breaker is open: the seconds left in the freeze).",
        check=_positive, expected="an integer > 0 (seconds)"),
    Key("proxy.timeout_seconds", "float", 300.0, "The longest the proxy waits for the next byte of an upstream's answer (its head, or the next chunk of its body): then 504 with an OpenAI error body (mid-stream: an error event, and the stream ends).",
        check=_positive, expected="a number > 0"),
    Key("proxy.max_body_bytes", "int", 8388608, "The largest request body the proxy takes (bytes); a larger one is answered 413 with an OpenAI error body.",
        check=_positive, expected="an integer > 0 (bytes)"),
    Key("proxy.batch_window_seconds", "float", 0.003, "torch engine behind --proxy-listen: users' requests that arrive within this many seconds of each other run as one batch, padded to a warmed batch size (0: no wait; every lone request pays the window).",
        check=lambda v: 0 <= v <= 1, expected="seconds between 0 and 1"),
    Key("validation.enabled", "bool", True, "Validate structure, numerics and performance before SERVING; a failure is a named reason (validation_structure, validation_numerics, validation_performance; for an FP8 model fp8_saturation, fp8_roundtrip_error)."),
    Key("validation.logits_mean_min", "float", -5.0, "Numerics: the mean logit on each fixed prompt must be above this (seed -5).",
        expected="a number"),
    Key("validation.logits_mean_max", "float", 5.0, "Numerics: the mean logit on each fixed prompt must be below this (seed 5).",
        expected="a number"),
    Key("validation.logits_abs_max", "float", 1000.0, "Numerics: no logit may exceed this in absolute value.",
        check=_positive, expected="a number > 0"),
    Key("validation.performance_factor", "float", 1.2, "Performance: the gate's P50 time to first token may be at most this times the recorded baseline (seed 1.2).",
        check=lambda v: v >= 1, expected="a number >= 1"),
    Key("validation.fp8_ranges", "bool", True, "Numerics of an FP8 model (seed 003 §3): put the seed's activation, weight and attention-score cases through every FP8 layer's quantize/dequantize path with the model's scales (docs/fp8.md); reasons fp8_saturation, fp8_roundtrip_error."),
    Key("validation.fp8_max_saturated_ratio", "float", 0.0, "FP8 ranges: largest share of a range's checked values that may saturate e4m3 (|x / scale| > 448) before validation fails with fp8_saturation.",
        check=lambda v: 0 <= v <= 1, expected="a number from 0 to 1"),
    Key("validation.fp8_max_roundtrip_error", "float", 0.0625, "FP8 ranges: largest round-trip error, max |dequantize(quantize(x)) - x| / the range's largest |x|, before validation fails with fp8_roundtrip_error (0.0625 = 2^-4: e4m3 rounding at a scale that fits).",
        check=lambda v: 0 < v <= 1, expected="a number > 0 and <= 1"),
    Key("validation.baseline_file", "str_or_null", None, "JSON file of recorded baseline P50s per model, device and dtype (e.g. on a persistent volume). Empty: no performance check. A model with no entry records one."),
    # --- GPU-grade torch engine: reserve / prewarm / solidify on CUDA (warmup_agent/gpu) ---
    Key("reserve.gpu_memory", "bool", True, "Reserve and touch GPU memory up front for the weights, the KV cache of the warmup grid and activations (fails fast with insufficient_gpu_memory when it cannot fit)."),
    Key("reserve.activation_factor", "float", 1.0, "Multiplier on the activation headroom of the largest warmup shape when sizing the reservation.",
        check=_positive, expected="a number > 0"),
    Key("prewarm.progressive_load", "bool", True, "Load weights progressively (embeddings first, then layer by layer) through pinned staging buffers with overlapped host-to-device copies; false: transformers from_pretrained (the transformers implementation only: the native one always loads this way)."),
    Key("prewarm.staging_chunk_bytes", "int", 64 << 20, "Size of one pinned staging buffer (bytes) of the progressive loader.",
        check=_positive, expected="an integer > 0 (bytes)"),
    Key("prewarm.staging_buffers", "int", 4, "Pinned staging buffers in flight (>= 2: reads overlap copies).",
        check=lambda v: v >= 2, expected="an integer >= 2"),
    Key("prewarm.loader_threads", "int", 4, "Threads reading checkpoint chunks into the staging buffers.",
        check=_positive, expected="an integer > 0"),
    Key("prewarm.weights_manifest", "str_or_null", None, "Optional SHA-256 manifest of the shards (sha256sum format, names relative to the model directory); checked before loading, reason weights_corrupt on mismatch."),
    Key("prewarm.length_source", "str", "grid", "Where warmup prompt lengths come from: grid (prewarm.prompt_lengths only), gaussian (seed 003: draws from N(mean, sd)) or sample_file (drawn from the token lengths of prewarm.prompts_file); gaussian and sample_file add the power-of-two grid up to prewarm.max_prompt_length.",
        choices=("grid", "gaussian", "sample_file")),
    Key("prewarm.length_mean", "float", 23.0, "Mean prompt length (tokens) of the gaussian source (seed 003: 23).",
        check=_positive, expected="a number > 0"),
    Key("prewarm.length_sd", "float", 5.0, "Standard deviation (tokens) of the gaussian source (seed 003: 5).",
        check=_non_negative, expected="a number >= 0"),
    Key("prewarm.sampled_lengths", "int", 8, "How many lengths the gaussian or sample_file source draws.",
        check=_non_negative, expected="an integer >= 0"),
    Key("prewarm.prompts_file", "str_or_null", None, "File of real prompts, one per line, for length_source sample_file."),
    Key("prewarm.max_prompt_length", "int", 0, "Warm the power-of-two prompt lengths up to this (0: none beyond the configured and drawn lengths).",
        check=_non_negative, expected="an integer >= 0"),
    Key("prewarm.batch_sizes_from_memory", "bool", False, "Derive the warmup batch sizes from free GPU memory and the real KV bytes per token (seed 000 §4.2: 0.7 x free / (max length x KV bytes per token)), powers of two up to prewarm.max_batch; else prewarm.batch_sizes."),
    Key("prewarm.max_batch", "int", 8, "Largest batch size derived from memory (the engine's concurrency).",
        check=_positive, expected="an integer > 0"),
    Key("solidify.graph_max_length", "int", 512, "Static KV-cache length (tokens) of the captured CUDA graphs (the decode step; with the native model also the prefill of each warmed prompt length); longer requests run eagerly.",
        check=_positive, expected="an integer > 0"),
    Key("gpu.cuda_context_timeout_seconds", "float", 60.0, "Deadline of CUDA context creation; past it the warmup fails with reason cuda_context_timeout. 0 disables.",
        check=_non_negative, expected="a number >= 0"),
    Key("gpu.kernel_compile_timeout_seconds", "float", 600.0, "Deadline of CUDA-graph capture / torch.compile in solidify; past it the warmup fails with reason kernel_compile_timeout. 0 disables.",
        check=_non_negative, expected="a number >= 0"),
    Key("gpu.ramp_sample_interval_seconds", "float", 0.05, "NVML utilisation sampling interval while warming, for warmup_gpu_utilization_ramp_slope (seed 000 §2.3: 50 ms). 0 disables sampling.",
        check=_non_negative, expected="a number >= 0"),
    # --- reliability and security (issue 9) --------------------------------------
    Key("exporter.web_config_file", "str_or_null", None, "Web config file in the Prometheus exporter toolkit's format: tls_server_config (cert_file, key_file, client_auth_type, client_ca_file, min_version) and basic_auth_users (user: bcrypt hash). Replaces the exporter.tls_* and basic_auth_* keys (set one or the other). Probe endpoints stay open."),
    Key("exporter.admin_token_file", "str_or_null", None, "File holding the bearer token (>= 16 characters) for POST /admin/rewarm and POST /admin/drain. Empty: those endpoints do not exist (404)."),
    Key("prewarm.memory_budget_bytes", "int", 0, "Memory the warmup grid may use on top of the loaded model, in bytes (0: no budget). Batch sizes whose measured cost exceeds it are dropped, largest first, instead of failing; a shape that runs out of memory drops its batch size and every larger one.",
        check=_non_negative, expected="an integer >= 0 (bytes)"),
    # --- any OpenAI-compatible server, traffic profile, decode readiness (issue 19) ---
    Key("openai.health_path", "str", "/health", "Path of the server's health endpoint, polled until it answers 200 (vLLM, SGLang, TGI, transformers serve: /health).",
        check=lambda v: bool(v.strip()), expected="a URL path such as /health"),
    Key("openai.api", "str", "auto", "Which API the warmup speaks: auto (every one the server answers of /v1/chat/completions and /v1/completions; with prewarm.requests_file, the ones its requests use), chat or completions.",
        choices=("auto", "chat", "completions")),
    Key("openai.concurrency", "int", 0, "Requests the server serves at once; the warmup sends that many of its paths' calls together (0: ask the server: llama-server's /props slots; 4 where /v1/models says vLLM or SGLang; else 1).",
        check=lambda v: v >= 0, expected="an integer >= 0"),
    Key("openai.apply_server_remedy", "str", "auto", "A supervised server's known per-length remedy (transformers serve: TORCH_CUDNN_SDPA_DEPRIORITIZED=1) in its environment. auto: once a start measured it paying per length without it, kept while steady decode is no slower with it; always; never. Details: docs/config.md, \"openai.apply_server_remedy\".",
        choices=("auto", "always", "never")),
    Key("openai.server_sleeps", "str", "auto", "Whether the server sleeps when idle (llama-server --sleep-idle-seconds): then the agent sends it no probe after SERVING and watches it by reads that do not wake it. auto: from the supervised command; a sidecar needs yes.",
        choices=("auto", "yes", "no")),
    Key("prewarm.requests_file", "str_or_null", None, "JSON Lines of OpenAI request bodies as a gateway logs them (one chat or completions body per line). Warmup follows their endpoints, prompt lengths, max_tokens and sampling; checked line by line at load for every engine. Details: docs/config.md, \"prewarm.requests_file\"."),
    Key("prewarm.requests_file_bad_lines", "str", "fail", "A bad line of prewarm.requests_file (not JSON or UTF-8, truncated, a field of the wrong type or range). fail: the config is invalid, naming the line and field (exit 2). skip: the line is left out, counted and warned about once; a file without a good line still fails.",
        choices=("fail", "skip")),
    Key("prewarm.decode_coverage", "str", "auto", "openai engine: warmup decodes at every sequence length real answers reach. auto: only where prewarm measured that the server pays per sequence length (per_length_ratio); always; never. Details: docs/config.md, \"prewarm.decode_coverage\".",
        choices=("auto", "always", "never")),
    # --- warmup by measured benefit (issue 30) ---
    Key("prewarm.budget_ratio", "float", 0.3, "openai engine: the warmup may take at most this x the server's own start-up (spawn to healthy). When the budget runs out, the paths not yet warmed are skipped (recorded with reason budget) and readiness probes decide as usual.",
        check=_non_negative, expected="a number >= 0"),
    Key("prewarm.behind_users", "bool", True, "openai engine: the gate opens once the users' own shapes answer warm; the other paths (larger batches; without learned or file traffic, the other endpoints and families) are warmed after SERVING, only while no user request is in flight. false: all before SERVING."),
    Key("prewarm.budget_min_seconds", "float", 1.0, "openai engine: the warmup budget is at least this many seconds.",
        check=_non_negative, expected="a number >= 0"),
    Key("prewarm.budget_seconds", "float", 0.0, "openai engine: a fixed warmup budget in seconds instead of budget_ratio (0: derived; a server already running, whose start-up is unknown, gets 30 s).",
        check=_non_negative, expected="a number >= 0"),
    Key("prewarm.converge_tolerance", "float", 0.2, "A warmup path (openai engine) or grid shape (torch, vllm) is warm when its call is within this fraction (plus 2 ms) of the steady level other paths measured, or no faster than its previous call by more than this; the per-length test's prefill judgement uses half of it.",
        check=_positive, expected="a number > 0"),
    Key("prewarm.max_calls_per_path", "int", 4, "At most this many calls per warmup path (openai engine: endpoint x family x batch size x prompt length; torch and vllm: per grid shape, or prewarm.requests_per_shape if larger); a path still getting faster then is recorded as still_improving.",
        check=_positive, expected="an integer > 0"),
    Key("prewarm.warm_answer_tokens", "int", 2, "openai engine: output tokens of a warmup call (2: the fewest that take the decode path); the per-length test's probe pairs ask for prewarm.per_length_tokens and decode coverage for the profile's longest answer.",
        check=lambda v: v >= 2, expected="an integer >= 2"),
    Key("prewarm.per_length_ratio", "float", 1.5, "openai engine: the server pays per sequence length when decode at two new lengths is slower than steady by more than this factor (then decode_coverage auto covers the profile's lengths, and the finding is logged with its remedy and exported as warmup_per_length_remedy_info).",
        check=lambda v: v >= 1, expected="a number >= 1"),
    Key("prewarm.per_length_tokens", "int", 8, "openai engine: output tokens of the per-length test's probe pairs, the gate's first (enough to time decode at new sequence lengths against their controls).",
        check=lambda v: v >= 3, expected="an integer >= 3"),
    Key("prewarm.remember_findings", "bool", True, "openai engine: keep the per-length test's outcome in <data_dir>/server-findings.json (shared, signed, through the kernel cache's Redis) and reuse it on the same server's next start: the gate's first probe then goes alone. Details: docs/config.md, \"prewarm.remember_findings\"."),
    Key("prewarm.length_ladder", "bool", False, "openai engine: where the per-length test's first fresh length paid in prefill, one 1-token request at each rung of a length ladder (48 tokens up, 1.5x apart) before its second fresh length. Off: it costs requests before ready. Details: docs/config.md, \"prewarm.length_ladder\"."),
    Key("readiness.min_probes_server", "int", 2, "openai engine: probes before the gate may open (instead of min_probes). The first stands for the first user request, the second is its control, later ones give the steady level. 2: the first pair alone. Details: docs/config.md, \"readiness.min_probes_server\".",
        check=lambda v: v >= 2, expected="an integer >= 2"),
    Key("prewarm.max_output_tokens", "int", 64, "openai engine, without a requests file: the longest answer warmed; each sampling family is sent once per batch size with this many output tokens.",
        check=_positive, expected="an integer > 0"),
    Key("readiness.probe_max_tokens", "int", 8, "openai engine: output tokens of the readiness probes before SERVING, so that they also time decode. Probes after SERVING ask for one token: the breaker judges time to first token. Details: docs/config.md, \"readiness.probe_max_tokens\".",
        check=_positive, expected="an integer > 0"),
    Key("readiness.require_decode", "bool", True, "openai engine: the gate also waits until decode has converged: the time-per-output-token window holds min_probes samples, its P90 is at most tpot_p90_threshold_seconds, and decode is no longer getting faster (tpot_convergence_ratio)."),
    Key("readiness.settle_before_serving", "bool", True, "openai engine: one short request just before SERVING, so that the users' first request follows a short request as the gate's first probe did (false: it follows the gate's last probe, a request of a profile length)."),
    Key("readiness.tpot_p90_threshold_seconds", "float", 0.5, "Gate on decode: the window's P90 time per output token must be at or under this.",
        check=_positive, expected="a number > 0"),
    Key("readiness.tpot_convergence_ratio", "float", 1.5, "Gate on decode: over the last min_probes probes, the median time per output token of the older half may be at most this x the median of the newer half (decode no longer getting faster probe after probe).",
        check=lambda v: v >= 1, expected="a number >= 1"),
    # --- start-up traces over OTLP (issue 27; warmup_agent/run/tracing.py) -------------
    Key("tracing.enabled", "bool", False, "Export one OpenTelemetry span per stage and timed step of the start (root warmup.startup) over OTLP. Needs the [otel] extra. Off: OpenTelemetry is not even imported. A collector that is down never delays or fails the start. OTEL_SDK_DISABLED=true also turns it off."),
    Key("tracing.endpoint", "str_or_null", None, "OTLP endpoint, e.g. http://otel-collector:4317 (grpc) or :4318 (http/protobuf; /v1/traces is appended). Empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT, else localhost. Other settings: the standard OTEL_* variables (docs/tracing.md)."),
    Key("tracing.protocol", "str_or_null", None, "OTLP transport. Empty: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else grpc.",
        choices=("grpc", "http/protobuf")),
    Key("tracing.export_timeout_seconds", "float", 2.0, "Timeout of one export to the collector, and the longest the agent waits at exit to flush the spans it still holds.",
        check=_positive, expected="a number > 0"),
)

BY_PATH: dict[str, Key] = {k.path: k for k in KEYS}
BY_ENV: dict[str, Key] = {k.env: k for k in KEYS}
assert len(BY_ENV) == len(KEYS), "two keys map to one environment variable"

_TYPE_WORDS = {"str": "a string", "str_or_null": "a string or null", "int": "an integer",
               "float": "a number", "bool": "true or false", "int_list": "a list of integers"}


def _coerce(key: Key, value: Any, where: str) -> Any:
    """Return value converted to key.kind or raise ConfigError naming where it came from."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{where}: key '{key.path}': got {value!r}; expected {expected}", key.path)

    k = key.kind
    if k == "str_or_null":
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise bad(_TYPE_WORDS[k])
    elif k == "str":
        if value is None and key.default is None:
            return None
        if key.choices and {"always", "never"} <= set(key.choices) and value in (True, False, "true", "false"):
            value = "always" if value in (True, "true") else "never"    # an older boolean key that grew an "auto"
        if not isinstance(value, str):
            raise bad(_TYPE_WORDS[k] if not key.choices else "one of " + ", ".join(key.choices))
    elif k == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(key.expected or _TYPE_WORDS[k])
    elif k == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(key.expected or _TYPE_WORDS[k])
        value = float(value)
    elif k == "bool":
        if not isinstance(value, bool):
            raise bad(_TYPE_WORDS[k])
    elif k == "int_list":
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise bad(key.expected or _TYPE_WORDS[k])
    if key.choices and value not in key.choices:
        raise bad("one of " + ", ".join(key.choices))
    if key.check and value is not None and not key.check(value):
        raise bad(key.expected)
    return value


def _flatten(tree: dict, prefix: str, source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in tree.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict) and not any(k.path == path for k in KEYS):
            if not any(k.path.startswith(path + ".") for k in KEYS):
                raise _unknown(path, source)
            out.update(_flatten(value, path + ".", source))
        else:
            out[path] = value
    return out


def _known_names_at(depth: int) -> list[str]:
    """Known sections and keys with `depth` dots: a typo is compared with names of
    its own kind, so `readyness` (a section) suggests `readiness`, not one of the
    keys inside it."""
    return sorted({".".join(k.path.split(".")[:depth + 1]) for k in KEYS if k.path.count(".") >= depth})


def _unknown(path: str, source: str) -> ConfigError:
    close = (difflib.get_close_matches(path, _known_names_at(path.count(".")), n=1, cutoff=0.5)
             or difflib.get_close_matches(path, list(BY_PATH), n=1, cutoff=0.5))
    hint = f"; did you mean '{close[0]}'?" if close else "; see docs/config.md for the keys"
    return ConfigError(f"{source}: unknown key '{path}'{hint}", path)


class Config(Sections):
    """Validated configuration.  Read values as typed attributes of sections,
    `cfg.readiness.min_probes` (declared in config_sections.py, generated from
    KEYS), or by dotted key, `cfg["readiness.min_probes"]` (config.py only: outside
    it tests/test_typed_config.py fails on a string lookup)."""
    data_dir: str     # load() fills the default ($XDG_CACHE_HOME/warmup-agent)

    def __init__(self, values: dict[str, Any], sources: dict[str, str]):
        self._values = values
        self.sources = sources    # key -> where its value came from (default, file, env, flag)
        # prewarm.requests_file as config.load checked it (None: no file), and the
        # warnings of that check, each one line, for the CLI to log once logging is set up.
        self.requests_check: FileCheck | None = None
        self.warnings: list[str] = []
        for name in config_sections.TOP_LEVEL:
            setattr(self, name, values[name])
        for name, cls in config_sections.SECTIONS.items():
            prefix = name + "."
            try:
                section = cls(**{p[len(prefix):]: v for p, v in values.items() if p.startswith(prefix)})
            except TypeError:
                raise ConfigError(f"warmup_agent/config_sections.py does not match KEYS (section {name}): "
                                  "run `python -m warmup_agent.config`") from None
            setattr(self, name, section)

    def __getitem__(self, path: str) -> Any:
        return self._values[path]

    def as_dict(self) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for path, value in self._values.items():
            node = tree
            *parents, leaf = path.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return tree


def _env_value(raw: str) -> Any:
    """An environment override's value, read as YAML (`[1, 4]`, `true`, `0.5`); a value
    that is not YAML stays the string.  Numbers, booleans, null and plain words skip the
    YAML import (a start configured by the environment alone spawns its server sooner),
    and so do lists of whole numbers."""
    text = raw.strip()
    if not text:
        return None
    if text in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[text]
    digits = text[1:] if text.startswith("-") else text
    if digits.isdigit() and (digits == "0" or not digits.startswith("0")):
        return int(text)
    whole, dot, frac = digits.partition(".")
    if dot and whole.isdigit() and (frac.isdigit() or not frac):
        return float(text)
    if (text[0].isalpha() or text[0] == "/") and text.replace("_", "").replace("-", "").replace("/", "").replace(".", "").isalnum() \
            and text.lower() not in ("yes", "no", "on", "off", "true", "false", "null", "~"):
        return raw
    if text.startswith("[") and text.endswith("]"):
        # a list of whole numbers (`[1, 4]`, the batch sizes and lengths): JSON reads it as
        # YAML does, without the YAML import (~25 ms on a 2-core host, before the spawn)
        import json
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if isinstance(items, list) and all(type(i) is int for i in items):
            return items
    import yaml
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def load(path: str | None = None, env: dict[str, str] | None = None,
         flags: dict[str, Any] | None = None) -> Config:
    """Build a Config from defaults, a YAML file, the environment and flags.
    Raises ConfigError (one line) on any problem."""
    environ: Mapping[str, str] = os.environ if env is None else env
    values = {k.path: k.default for k in KEYS}
    sources = {k.path: "default" for k in KEYS}

    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
        import yaml  # here, not at the top: a start without a file spawns its server sooner
        try:
            tree = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{path}: YAML syntax error{where}: {problem}") from None
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(tree).__name__}")
        for p, v in _flatten(tree, "", path).items():
            if p not in BY_PATH:
                raise _unknown(p, path)
            values[p] = _coerce(BY_PATH[p], v, path)
            sources[p] = "file"

    for name, raw in environ.items():
        if not name.startswith("WARMUP_AGENT_"):
            continue
        key = BY_ENV.get(name)
        if key is None:
            close = difflib.get_close_matches(name, list(BY_ENV), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"environment: unknown variable {name}{hint}", name)
        parsed = _env_value(raw)
        if key.kind in ("str", "str_or_null") and parsed is not None:
            parsed = raw  # keep strings verbatim ("0123" stays a string)
        values[key.path] = _coerce(key, parsed, f"environment {name}")
        sources[key.path] = "env"

    for p, v in (flags or {}).items():
        if v is None:
            continue
        values[p] = _coerce(BY_PATH[p], v, f"command line ({p})")
        sources[p] = "flag"

    if values["data_dir"] is None:
        values["data_dir"] = _default_data_dir()
    _cross_checks(values, path or "configuration")
    cfg = Config(values, sources)
    cfg.requests_check, cfg.warnings = _check_requests_file(values)
    return cfg


def _cross_checks(v: dict[str, Any], where: str) -> None:
    if v["readiness.p50_threshold_seconds"] > v["readiness.p90_threshold_seconds"]:
        raise ConfigError(
            f"{where}: key 'readiness.p50_threshold_seconds': got {v['readiness.p50_threshold_seconds']}; "
            f"expected at most readiness.p90_threshold_seconds ({v['readiness.p90_threshold_seconds']})",
            "readiness.p50_threshold_seconds")
    if v["readiness.min_probes"] > v["readiness.window_size"]:
        raise ConfigError(
            f"{where}: key 'readiness.min_probes': got {v['readiness.min_probes']}; "
            f"expected at most readiness.window_size ({v['readiness.window_size']})", "readiness.min_probes")
    if v["readiness.min_probes"] > v["readiness.max_probes"]:
        raise ConfigError(
            f"{where}: key 'readiness.min_probes': got {v['readiness.min_probes']}; "
            f"expected at most readiness.max_probes ({v['readiness.max_probes']})", "readiness.min_probes")
    if v["validation.logits_mean_min"] >= v["validation.logits_mean_max"]:
        raise ConfigError(
            f"{where}: key 'validation.logits_mean_min': got {v['validation.logits_mean_min']}; "
            f"expected less than validation.logits_mean_max ({v['validation.logits_mean_max']})", "validation.logits_mean_min")
    if bool(v["exporter.tls_cert_file"]) != bool(v["exporter.tls_key_file"]):
        raise ConfigError(f"{where}: key 'exporter.tls_key_file': TLS needs both exporter.tls_cert_file and exporter.tls_key_file",
                          "exporter.tls_key_file")
    if bool(v["exporter.basic_auth_username"]) != bool(v["exporter.basic_auth_password_file"]):
        raise ConfigError(f"{where}: key 'exporter.basic_auth_password_file': basic auth needs both a username and a password file",
                          "exporter.basic_auth_password_file")


def _check_requests_file(v: dict[str, Any]) -> tuple[FileCheck | None, list[str]]:
    """prewarm.requests_file, every line, before any server starts and for every
    engine (warmup_agent/warmup/requests_file.py): a file that cannot be read, holds no
    request, or (policy fail) has a bad line is a ConfigError naming the file, the
    line and the field.  Returns the check and the warnings to log."""
    key, path = "prewarm.requests_file", v["prewarm.requests_file"]
    if not path:
        return None, []
    from warmup_agent.warmup import requests_file
    try:
        check = requests_file.check_file(path, keep_good=False)
    except OSError as e:
        raise ConfigError(f"key '{key}': {requests_file.read_error(path, e)}", key) from None
    policy = v["prewarm.requests_file_bad_lines"]
    error = check.error() if policy == "fail" else check.skip_error()
    if error:
        raise ConfigError(f"key '{key}': {error}", key)
    warnings = [w for w in [check.skip_warning()] if w]
    if v["engine"] != "openai":
        warnings.append(f"key '{key}': engine {v['engine']} does not use it (only engine openai warms the traffic "
                        f"a requests file describes); {path} was checked "
                        f"({check.good_count} request{'' if check.good_count == 1 else 's'}) and is ignored")
    return check, warnings


def keys_by_section() -> list[Key]:
    """KEYS with each section's keys together (features append keys to KEYS in
    blocks of their own), sections in order of first appearance."""
    first: dict[str, int] = {}
    for i, k in enumerate(KEYS):
        first.setdefault(k.path.split(".")[0] if "." in k.path else "", i)
    return sorted(KEYS, key=lambda k: first[k.path.split(".")[0] if "." in k.path else ""])


def _sections() -> dict[str, list[Key]]:
    """Section name -> its keys, in keys_by_section() order (top-level keys left out)."""
    out: dict[str, list[Key]] = {}
    for k in keys_by_section():
        if "." in k.path:
            out.setdefault(k.path.split(".")[0], []).append(k)
    return out


_PY_TYPES = {"str": "str", "str_or_null": "str | None", "int": "int", "float": "float", "bool": "bool",
             "int_list": "list[int]"}


def _py_type(k: Key) -> str:
    t = _PY_TYPES[k.kind]
    return t + " | None" if k.kind == "str" and k.default is None else t


def _class_name(section: str) -> str:
    return "".join(part.capitalize() for part in section.split("_")) + "Section"


def sections_source() -> str:
    """warmup_agent/config_sections.py: one read-only class per section of KEYS, and
    `Sections`, the typed attributes that Config carries."""
    for k in KEYS:
        leaf = k.path.split(".")[-1]
        if not leaf.isidentifier() or keyword.iskeyword(leaf):
            raise ValueError(f"key {k.path!r}: {leaf!r} cannot be a Python attribute")
    sections = _sections()
    top = [k for k in keys_by_section() if "." not in k.path]
    lines = ['"""Typed sections of the configuration: one read-only class per section of',
             "`KEYS`, so that `cfg.readiness.p90_threshold_seconds` is an attribute mypy",
             "checks.  Config (warmup_agent/config.py) inherits `Sections`.  Plain classes with",
             "__slots__, not dataclasses: this module is imported before a supervised server is",
             "spawned (server/early_spawn.py), where `dataclasses` and 17 generated classes cost",
             "tens of milliseconds.", "",
             "GENERATED by `python -m warmup_agent.config` from KEYS in warmup_agent/config.py;",
             "do not edit by hand (tests/test_config.py fails when it is stale).", '"""',
             "from __future__ import annotations", "", "from typing import Any", "", "",
             "class _Section:",
             '    """Keyword construction with exactly the declared keys; read-only after."""',
             "    __slots__: tuple[str, ...] = ()", "",
             "    def __init__(self, **values: Any) -> None:",
             "        if set(values) != set(self.__slots__):",
             "            raise TypeError(f\"{type(self).__name__}: keys {sorted(set(values) ^ set(self.__slots__))} "
             "do not match\")",
             "        for name, value in values.items():",
             "            object.__setattr__(self, name, value)", "",
             "    def __setattr__(self, name: str, value: Any) -> None:",
             "        raise AttributeError(f\"{type(self).__name__} is read-only\")", "",
             "    def _items(self) -> list[tuple[str, Any]]:",
             "        return [(n, object.__getattribute__(self, n)) for n in self.__slots__]", "",
             "    def __repr__(self) -> str:",
             "        return f\"{type(self).__name__}(\" + \", \".join(f\"{n}={v!r}\" for n, v in self._items()) + \")\"",
             "",
             "    def __eq__(self, other: object) -> bool:",
             "        return type(other) is type(self) and self._items() == other._items()",
             "",
             "    __hash__ = None  # type: ignore[assignment]", ""]
    for name, keys in sections.items():
        leaves = [k.path.split(".", 1)[1] for k in keys]
        lines += ["", f"class {_class_name(name)}(_Section):", f'    """`{name}.*` (docs/config.md)."""',
                  "    __slots__ = (" + ", ".join(f'"{leaf}"' for leaf in leaves) + ("," if len(leaves) == 1 else "") + ")"]
        lines += [f"    {leaf}: {_py_type(k)}" for leaf, k in zip(leaves, keys, strict=True)]
        lines.append("")
    lines += ["", "class Sections:", '    """The typed attributes of Config, set in its __init__."""']
    lines += [f"    {k.path}: {_py_type(k)}" for k in top]
    lines += [f"    {name}: {_class_name(name)}" for name in sections]
    lines += ["", "",
              "TOP_LEVEL: tuple[str, ...] = (" + ", ".join(f'"{k.path}"' for k in top) + ("," if len(top) == 1 else "") + ")",
              "SECTIONS: dict[str, type] = {",
              *[f'    "{name}": {_class_name(name)},' for name in sections], "}"]
    return "\n".join(lines) + "\n"


def reference_yaml() -> str:
    """The documented YAML reference with every key at its default."""
    lines = ["# warmup-agent configuration: every key with its default.",
             "# Each key can be overridden by the environment variable shown.", ""]
    section = None
    for k in keys_by_section():
        parts = k.path.split(".")
        if len(parts) == 2 and parts[0] != section:
            section = parts[0]
            lines += ["", f"{section}:"]
        elif len(parts) == 1:
            section = None
        indent = "  " if len(parts) == 2 else ""
        import yaml  # the docs only
        default = "null" if k.default is None else yaml.safe_dump(k.default, default_flow_style=True).strip()
        if default.endswith("\n...") or default.endswith("..."):
            default = default.replace("\n...", "").replace("...", "").strip()
        lines.append(f"{indent}# {k.doc}")
        lines.append(f"{indent}# env: {k.env}")
        lines.append(f"{indent}{parts[-1]}: {default}")
    return "\n".join(lines).strip() + "\n"


DETAILS_MARK = "<!-- Details of the keys, written by hand: `python -m warmup_agent.config` keeps everything below this line. -->"


def _details(path: str | None = None) -> str:
    """The hand-written part of docs/config.md, from DETAILS_MARK on ("" without one)."""
    path = path or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config.md")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return ""
    i = text.find(DETAILS_MARK)
    return text[i:] if i >= 0 else ""


def reference_markdown() -> str:
    """docs/config.md: the reference YAML plus a table of keys and environment variables,
    then the details written by hand (kept from the current file)."""
    rows = ["| Key | Environment variable | Default | Meaning |", "|---|---|---|---|"]
    for k in keys_by_section():
        default = "(see meaning)" if k.default is None and k.path == "data_dir" else repr(k.default) if k.default is not None else "null"
        allowed = f" One of: {', '.join(k.choices)}." if k.choices else ""
        rows.append(f"| `{k.path}` | `{k.env}` | `{default}` | {k.doc}{allowed} |")
    return "\n".join([
        "# Configuration reference", "",
        "<!-- GENERATED by `python -m warmup_agent.config` from warmup_agent/config.py; do not edit by hand. -->", "",
        "Precedence: built-in defaults < YAML file (`--config`) < `WARMUP_AGENT_*` environment variables < command-line flags.",
        "Environment values are parsed as YAML (`[16, 64]` is a list, `true` a boolean).",
        "`warmup-agent check-config FILE` validates a file; a bad value is reported as one line naming the file, the key,",
        "the value and what was expected, with exit code 2.", "",
        *rows, "",
        "## The whole file with defaults", "",
        "`warmup-agent config-reference` prints this:", "",
        "```yaml", reference_yaml().rstrip(), "```", ""]) + ("\n" + _details() if _details() else "")


if __name__ == "__main__":
    # python -m warmup_agent.config [CONFIG_MD [SECTIONS_PY]]: docs/config.md and config_sections.py
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(here), "docs", "config.md")
    text = reference_markdown()     # before the file is truncated: it keeps the file's details
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "config_sections.py")
    with open(out, "w", encoding="utf-8") as f:
        f.write(sections_source())
