"""The engine interface.  Optional capabilities default to "not this engine", so callers
never probe an engine with hasattr."""
from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable

from warmup_agent.errors import EngineError

if TYPE_CHECKING:
    import threading

    from warmup_agent.engines.text_prompts import TextPrompts
    from warmup_agent.gpu.loader import LoadReport
    from warmup_agent.proxy import Backend
    from warmup_agent.quantization import QuantizationInfo
    from warmup_agent.server.context import ServerContext
    from warmup_agent.server.signals import ServerSignals
    from warmup_agent.warmup.traffic import WarmRequest

__all__ = ["Engine", "EngineError", "EngineFacts", "RequestResult", "SolidifyReport"]


@dataclass
class EngineFacts:
    """What an engine knows about the model it serves.  Sizes in bytes."""
    engine: str
    model: str                       # path or served name
    device: str                      # "cpu", "cuda:0", "remote"
    dtype: str
    parameter_count: int | None = None
    weight_bytes: int | None = None
    kv_bytes_per_token: int | None = None   # 2 x layers x kv_heads x head_dim x dtype bytes
    max_context: int | None = None
    vocab_size: int | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class RequestResult:
    """One measured request (or one request of a batch).  Times in seconds."""
    first_token_seconds: float
    total_seconds: float             # until the last token
    prompt_tokens: int
    output_tokens: int
    #: The server's own prefill time, where it reports one.
    server_prefill_seconds: float | None = None


@dataclass
class SolidifyReport:
    """What solidify did.  `method` is e.g. "replay", "torch.compile", "cuda_graphs"."""
    method: str
    shapes: int = 0
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)


class Engine(abc.ABC):
    """Call order: load_tokenizer, load_weights, then any of generate, solidify and
    weight_fingerprint, finally close."""

    name: str = "abstract"

    #: How the model is quantized as this engine runs it; None: not said.
    quantization: QuantizationInfo | None = None
    #: How load_weights read the weights (gpu/loader.py); None: no report.
    load_report: LoadReport | None = None
    #: Seconds load_weights waited for the background transformers import.
    skeleton_wait_seconds: float | None = None

    @property
    def model_path(self) -> str | None:
        """The local model directory, which reserve checks; None: reserve skips the checks."""
        return None

    #: The lock shared with users served in this process; None: the driver makes its own.
    lock: threading.Lock | None = None

    def openai_backend(self) -> Backend | None:
        """The in-process OpenAI-compatible responder for the proxy; None: none."""
        return None

    @property
    def metrics_url(self) -> str | None:
        """The engine's own Prometheus endpoint, scraped by exporter.engine_metrics; None: none."""
        return None

    def torch_model(self) -> Any:
        """The loaded in-process torch module for readiness/validation.py; None: checks skipped."""
        return None

    #: True when reserve sets up the device itself (init_device, reserve_memory).
    sets_up_device: bool = False
    #: Seconds init_device spent creating the CUDA context.
    context_seconds: float | None = None

    def configure(self, **options: Any) -> None:
        """Loader options and deadlines from the config (passed by reserve)."""
        return None

    def init_device(self) -> object:
        """Resolve the device and create its context; return the device."""
        return None

    def reserve_memory(self, nbytes: int) -> int:
        """Reserve and touch `nbytes` of device memory; return the bytes reserved."""
        return 0

    #: True when the engine takes traffic-profile requests (generate_requests).
    speaks_profile: bool = False
    #: Exact-length text prompts, needed to learn a profile from prewarm.requests_file.
    text: TextPrompts | None = None

    @property
    def apis(self) -> Sequence[str]:
        """The APIs the engine answers ("chat", "completions")."""
        return ()

    @property
    def capabilities(self) -> Mapping[str, Any]:
        """What the engine learned its server accepts (recorded with the profile)."""
        return MappingProxyType({})

    @property
    def concurrency(self) -> int:
        """Requests the engine serves at once; the profile warmup sends that many together."""
        return 1

    @property
    def server_context(self) -> ServerContext | None:
        """The context the server gives each request sent at once (server/context.py): the
        profile warmup sizes what it sends together to fit it; None: unknown, not sized."""
        return None

    @property
    def server_start_seconds(self) -> float | None:
        """Spawn-to-healthy seconds of a server the agent started (sizes the warmup budget)."""
        return None

    @property
    def server_name(self) -> str | None:
        """The server's kind from its command line ("llamacpp", "vllm", ...: a name of server/kinds.py), for remedies."""
        return None

    @property
    def applied_remedy(self) -> dict[str, str]:
        """Environment given to the supervised server against a known per-length cost."""
        return {}

    @property
    def remedy_why(self) -> str | None:
        """Why the supervised server was (not) given its kind's remedy; None: it has none."""
        return None

    def learn_remedy(self, pays: bool | None, decode_tpots: list[float]) -> dict | None:
        """After SERVING: keep what this start measured for the next start's remedy (warmup/remedy.py)."""
        return None

    def others_served_within(self, seconds: float) -> float | None:
        """Seconds since another client's last request, if at most `seconds` ago; else None."""
        return None

    def give_way(self, to_users: Callable[[], bool] | None) -> None:
        """While `to_users()`, a warm-up stream stops (EngineError "gave_way"); None: off.
        In-process engines run one batch at a time: nothing to stop."""
        return None

    def server_signals(self) -> ServerSignals | None:
        """Reads of the server's own restarts, sleep and wake (server/signals.py); None: no server."""
        return None

    def sleeps_when_idle(self) -> bool:
        """Whether its server was told to sleep on its own when idle."""
        return False

    def generate_requests(self, requests: list[WarmRequest], warmup: bool = True) -> list[RequestResult]:
        """One batch of traffic-profile requests, sent at once (only when `speaks_profile`)."""
        raise NotImplementedError(f"engine {self.name} does not speak the traffic profile")

    #: True when load_weights starts a server.
    loads_by_starting_server: bool = False

    def prestart(self) -> None:
        """Start slow work that needs nothing from the agent, without waiting; load_weights waits."""
        return None

    def has_compile_artifacts(self) -> bool:
        """Whether anything compiled is there to share through the kernel cache (in-process: always)."""
        return True

    def set_server_callbacks(self, on_exit: Callable[[int], None] | None,
                             on_ready: Callable[[], None] | None) -> None:
        """Call `on_exit(returncode)` when a supervised server crashes, `on_ready()` when it is back."""
        return None

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
        """Run one batch of token-id prompts and time them; `warmup` marks agent traffic."""

    def solidify(self, shapes: list[tuple[int, int]], mode: str = "auto") -> SolidifyReport:
        """Freeze what can be frozen (CUDA graphs, torch.compile) for the warmed shapes."""
        return SolidifyReport(method="none")

    @abc.abstractmethod
    def weight_fingerprint(self) -> str:
        """A digest of the weights as loaded, re-checked before SERVING."""

    def interrupt(self) -> None:
        """SIGTERM during warmup: stop any wait that would run to its own timeout (from the signal thread)."""
        return None

    def close(self) -> None:
        """Release the engine (threads, child processes, device memory)."""
        return None
