"""The one engine interface.

Stages never know which engine they drive: every engine call goes through
`Engine`.  Adapters: `torch` (in-process transformers, the embedded default),
`vllm` (in-process vLLM) and `openai` (an OpenAI-compatible server, supervised
or already running).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

from warmup_agent.errors import EngineError

__all__ = ["Engine", "EngineError", "EngineFacts", "RequestResult", "SolidifyReport"]


@dataclass
class EngineFacts:
    """What an engine knows about the model it serves.  Sizes in bytes."""
    engine: str
    model: str                       # path or served name
    device: str                      # "cpu", "cuda:0", "remote"
    dtype: str                       # "float32", "bfloat16", ...
    parameter_count: int | None = None
    weight_bytes: int | None = None
    kv_bytes_per_token: int | None = None   # 2 x layers x kv_heads x head_dim x dtype bytes
    max_context: int | None = None
    vocab_size: int | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class RequestResult:
    """One measured request (or one request of a batch).  Times in seconds."""
    first_token_seconds: float       # time to first token, measured by the engine adapter
    total_seconds: float             # until the last token
    prompt_tokens: int
    output_tokens: int


@dataclass
class SolidifyReport:
    """What solidify did.  `method` is e.g. "replay", "torch.compile", "cuda_graphs"."""
    method: str
    shapes: int = 0
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)


class Engine(abc.ABC):
    """Abstract engine.  Call order: load_tokenizer, load_weights, then any of
    generate/solidify/weight_fingerprint, finally close."""

    name: str = "abstract"

    @abc.abstractmethod
    def load_tokenizer(self) -> None:
        """Load and warm the tokenizer (encode/decode once so its caches are built)."""

    @abc.abstractmethod
    def load_weights(self) -> None:
        """Load weights onto the target device, checking integrity.  Raise EngineError."""

    @abc.abstractmethod
    def facts(self) -> EngineFacts:
        """Model and engine facts; valid after load_weights."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens)."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 1,
                 warmup: bool = False) -> list[RequestResult]:
        """Run one batch of prompts (token ids), measure time to first token.
        `warmup=True` marks agent-generated traffic so that it never counts as user
        traffic (an HTTP engine sends `X-Warmup: true`)."""

    def solidify(self, shapes: list[tuple[int, int]], mode: str = "auto") -> SolidifyReport:
        """Freeze what can be frozen for the warmed (prompt_length, batch) shapes:
        CUDA graphs / torch.compile where supported (`mode` is solidify.mode).
        Default: nothing."""
        return SolidifyReport(method="none")

    @abc.abstractmethod
    def weight_fingerprint(self) -> str:
        """A digest of the weights as loaded, re-checked before SERVING."""

    def interrupt(self) -> None:
        """The agent started draining during warmup (SIGTERM in PRELOAD): stop any
        wait that would otherwise run to its own timeout, such as a server that is
        still starting.  Called from the signal-watcher thread.  In-process engines
        have no such wait: the pipeline stops at the next stage boundary."""
        return None

    def close(self) -> None:
        """Release the engine (threads, child processes, device memory)."""
        return None
