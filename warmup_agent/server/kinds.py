"""The one table of model server kinds: what the agent knows about each server.

One entry per server, as node_exporter registers one collector per name.  The
code reads it (command recognition, remedies, concurrency, the pod's-life
signals in server/signals.py) and the Helm chart's presets are checked against
it (tests/test_server_kinds.py).  Adding a server means adding an entry here,
a preset in the chart, and a line in docs/servers.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerKind:
    """One model server.

    `name`: what logs, metrics and docs call it; `chart_name`: the Helm preset
    (`server.preset`); `command_words`: words that identify its command line.
    `remedy_env`: environment that removes a per-prompt-length cost the warmup
    finds (openai.apply_server_remedy).  `concurrency`: requests it serves at
    once when it does not say (0: ask it, else 1).

    The pod's-life signals (DESIGN.md, "The pod's whole life"), all read without
    sending the server a task:
    `start_time_metric`: a gauge in its /metrics holding the process start time
    (a new value means a new, cold process); `sleep_path`/`sleep_key`: a GET
    endpoint and JSON key that say whether it sleeps; `sleep_option`: the command
    line option that makes it sleep when idle; `wake_path`: a POST that wakes it
    (None: its next request wakes it)."""
    name: str
    chart_name: str
    command_words: tuple[str, ...]
    remedy_env: dict[str, str] = field(default_factory=dict)
    concurrency: int = 0
    start_time_metric: str | None = None
    sleep_path: str | None = None
    sleep_key: str = "is_sleeping"
    sleep_option: str | None = None
    wake_path: str | None = None

    @property
    def can_sleep(self) -> bool:
        return self.sleep_path is not None

    @property
    def wakes_on_request(self) -> bool:
        """Whether a user's request wakes it (else only its wake call does)."""
        return self.can_sleep and self.wake_path is None


KINDS: tuple[ServerKind, ...] = (
    ServerKind("vllm", "vllm", ("vllm",), concurrency=4,
               start_time_metric="process_start_time_seconds",
               # vLLM serves these only with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode.
               sleep_path="/is_sleeping", sleep_option="--enable-sleep-mode", wake_path="/wake_up"),
    ServerKind("llama.cpp", "llamacpp", ("llama-server", "llama_cpp"),
               sleep_path="/props", sleep_option="--sleep-idle-seconds"),
    ServerKind("sglang", "sglang", ("sglang",), concurrency=4,
               start_time_metric="process_start_time_seconds"),
    ServerKind("transformers serve", "transformers", ("transformers",),
               # PyTorch's cuDNN attention builds a plan per sequence length.
               remedy_env={"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}),
    ServerKind("tgi", "tgi", ("text-generation-launcher",)),
)

BY_NAME = {k.name: k for k in KINDS}
BY_CHART_NAME = {k.chart_name: k for k in KINDS}
#: What /v1/models says owns the model, for a server the agent did not start.
BY_OWNER = {"vllm": BY_NAME["vllm"], "llamacpp": BY_NAME["llama.cpp"], "sglang": BY_NAME["sglang"]}


def kind_of_command(command: list[str] | None) -> ServerKind | None:
    """The server a command line starts, or None."""
    words = [os.path.basename(w) for w in (command or [])[:4]]
    if "transformers" in words and "serve" in words:
        return BY_NAME["transformers serve"]
    text = " ".join(words)
    for kind in KINDS:
        if kind.name != "transformers serve" and any(w in text for w in kind.command_words):
            return kind
    return None


def sleeps_when_idle(kind: ServerKind | None, command: list[str] | None) -> bool:
    """Whether the command asks its server to sleep when idle (llama.cpp's
    --sleep-idle-seconds N with N >= 0; vLLM's --enable-sleep-mode)."""
    if kind is None or kind.sleep_option is None or not command:
        return False
    for i, word in enumerate(command):
        if word == kind.sleep_option or word.startswith(kind.sleep_option + "="):
            if kind.name == "vllm":
                return True
            value = word.split("=", 1)[1] if "=" in word else (command[i + 1] if i + 1 < len(command) else "")
            try:
                return int(value) >= 0
            except ValueError:
                return False
    return False
