"""The one engine interface.

Stages never know which engine they drive: every engine call goes through
`Engine`.  Adapters: `torch` (in-process transformers, the embedded default),
`vllm` (in-process vLLM) and `openai` (an OpenAI-compatible server, supervised
or already running).

What only some engines can do is declared here too, with a default that means
"not this engine" (see "Optional capabilities" on `Engine`).  Callers use those
declarations; nothing asks an engine with hasattr/getattr what it has.
"""
from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable

from warmup_agent.errors import EngineError

if TYPE_CHECKING:  # types only: none of these is imported at run time from here
    import threading

    from warmup_agent.engines.text_prompts import TextPrompts
    from warmup_agent.gpu.loader import LoadReport
    from warmup_agent.proxy import Backend
    from warmup_agent.quantization import QuantizationInfo
    from warmup_agent.server.signals import ServerSignals
    from warmup_agent.warmup.traffic import WarmRequest

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
    #: The server's own prefill time, where it reports one (llama-server's
    #: timings.prompt_ms): free of the HTTP and client noise in first_token_seconds.
    server_prefill_seconds: float | None = None


@dataclass
class SolidifyReport:
    """What solidify did.  `method` is e.g. "replay", "torch.compile", "cuda_graphs"."""
    method: str
    shapes: int = 0
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)


class Engine(abc.ABC):
    """Abstract engine.  Call order: load_tokenizer, load_weights, then any of
    generate/solidify/weight_fingerprint, finally close.

    Optional capabilities.  Every engine has the members below; the defaults say
    "this engine cannot" and make the calling code do nothing (or skip a step).
    An adapter that can overrides them:

    ==========================  ==============================  ===================================
    member                      default                         overridden by, used by
    ==========================  ==============================  ===================================
    model_path                  None (no local model dir)       torch, vllm, openai (when local);
                                                                reserve checks and sizes it
    quantization                None (not said)                 all three; prewarm, validation, record
    configure(**options)        ignores the options             torch; reserve (GPU loader options)
    sets_up_device              False                           torch; reserve then calls
    init_device(), context_     no device, None, reserves 0     init_device (CUDA context) and
    seconds, reserve_memory(n)                                  reserve_memory
    load_report                 None                            torch (gpu/loader.py); prewarm
    skeleton_wait_seconds       None                            torch; prewarm
    prestart()                  nothing                         openai (the server), torch (the transformers
                                                                import); cli, as soon as the engine exists
    server_start_seconds,       None, None                      openai; prewarm's budget, remedies
    server_name
    loads_by_starting_server    False                           openai; prewarm loads the tokenizer
                                                                first and starts the ramp after
                                                                load_weights (the server's start)
    speaks_profile              False                           openai; prewarm warms the traffic
    generate_requests(), apis,  raises, (), None, {}            profile and probes are profile
    text, capabilities                                          requests (StageContext.probe)
    has_compile_artifacts()     True                            openai; solidify skips the cache
    set_server_callbacks(x, r)  ignores them (no server)        openai; cli (crash -> PRELOAD)
    metrics_url                 None (no engine /metrics)       openai; cli registers the collector
    torch_model()               None                            torch; readiness/validation.py
    interrupt()                 nothing to stop                 openai; cli on SIGTERM in warmup
    lock                        None (the driver makes its own) torch (users' batches in process);
                                                                driver.EngineDriver takes turns on it
    openai_backend()            None (no in-process answers)    torch; cli: the proxy's main engine
                                                                when proxy.upstream_url is not set
    ==========================  ==============================  ===================================
    """

    name: str = "abstract"

    # -- what the engine knows about its model ------------------------------------------
    #: How the model is quantized as this engine runs it (warmup_agent/quantization/,
    #: issue 16).  None: the engine does not say (the agent exports no quantization info).
    quantization: QuantizationInfo | None = None
    #: How load_weights read the weights (the torch engine's loader, gpu/loader.py):
    #: path, order, bytes, seconds.  None: no report (prewarm records nothing).
    load_report: LoadReport | None = None
    #: Seconds load_weights waited for the background transformers import (torch
    #: engine).  None: it did not wait, or the engine has no such import.
    skeleton_wait_seconds: float | None = None

    @property
    def model_path(self) -> str | None:
        """The Hugging Face-layout model directory on this machine, when the engine
        has one: reserve checks its files (warmup_agent/model/directory.py) and that the
        weights fit.  Default None: no local directory, and reserve skips both."""
        return None

    # -- users served in this process (the proxy) ---------------------------------------
    #: The engine lock, when the engine also serves users in this process (the torch
    #: engine's batcher): the agent's driver takes turns with those users on it.  None
    #: (default): the engine serves only the agent, and the driver makes a lock of its own.
    lock: threading.Lock | None = None

    def openai_backend(self) -> Backend | None:
        """The in-process OpenAI-compatible responder the proxy sends users to when no
        upstream URL is set (the torch engine's).  Default None: no such responder."""
        return None

    @property
    def metrics_url(self) -> str | None:
        """The engine's own Prometheus endpoint (a server's /metrics), read at scrape
        time by exporter.engine_metrics.  Default None: no such endpoint, and the
        CLI registers no engine collector."""
        return None

    def torch_model(self) -> Any:
        """The loaded model as an in-process torch module (transformers), which
        readiness/validation.py checks for structure and numerics.  Default None:
        the engine does not expose its model, and those checks are skipped."""
        return None

    # -- the device (stage reserve) -----------------------------------------------------
    #: True when the agent sets up the engine's device itself: reserve then creates the
    #: CUDA context (init_device) under its deadline and reserves memory
    #: (reserve_memory).  False (default): the engine or its server does that.
    sets_up_device: bool = False
    #: Seconds init_device spent creating the CUDA context; None: none was created.
    context_seconds: float | None = None

    def configure(self, **options: Any) -> None:
        """Options of the config for the engine's own loader (reserve passes the
        prewarm.* staging options and the gpu.* deadlines).  Default: ignored."""
        return None

    def init_device(self) -> object:
        """Resolve the device and create its context; return the device.  Called by
        reserve only when `sets_up_device`.  Default: nothing to create, None."""
        return None

    def reserve_memory(self, nbytes: int) -> int:
        """Reserve (and touch) `nbytes` of device memory; return the bytes reserved.
        Called by reserve only when `sets_up_device`.  Default: reserves nothing, 0."""
        return 0

    # -- the traffic profile (prewarm, probes) ------------------------------------------
    #: True when the engine takes whole traffic-profile requests (generate_requests:
    #: chat or completions, sampling parameters, answer lengths).  Prewarm then warms
    #: the profile (warmup/traffic.py) instead of the token-id grid, and readiness probes are
    #: real-looking requests that time decode too.  False (default): token ids only.
    speaks_profile: bool = False
    #: Exact-length text prompts from the model's own tokenizer and chat template
    #: (engines/text_prompts.py), needed to learn a profile from prewarm.requests_file.
    #: None: not available.
    text: TextPrompts | None = None

    @property
    def apis(self) -> Sequence[str]:
        """The APIs the engine answers ("chat", "completions"), known once an engine
        that speaks the profile has asked its server.  Default: none."""
        return ()

    @property
    def capabilities(self) -> Mapping[str, Any]:
        """What the engine learned its server accepts (recorded with the profile).
        Default: nothing."""
        return MappingProxyType({})

    @property
    def concurrency(self) -> int:
        """Requests the engine serves at once (llama.cpp's slots, vLLM's batch): the
        profile warmup sends that many of its paths' calls together.  Default 1."""
        return 1

    @property
    def server_start_seconds(self) -> float | None:
        """Seconds the supervised server took from spawn to healthy (its own start-up,
        which sizes the warmup budget).  Default None: no server started by the agent."""
        return None

    @property
    def server_name(self) -> str | None:
        """What server the engine talks to, from its command line ("transformers serve",
        "llama.cpp", "vllm", "sglang"), for remedies in log lines.  None: unknown."""
        return None

    @property
    def applied_remedy(self) -> dict[str, str]:
        """The environment the engine gave its supervised server to remove a known
        per-sequence-length cost (openai.apply_server_remedy).  Default: none."""
        return {}

    def others_served_within(self, seconds: float) -> float | None:
        """Seconds since the server last took a request from another client, when that
        is at most `seconds` ago, else None (engines/openai/server_traffic.py). Default None:
        the engine cannot tell."""
        return None

    def server_signals(self) -> ServerSignals | None:
        """What the engine's server says of its own life without a task (restarts,
        sleep, wake; server/signals.py), and whether its command makes it sleep when
        idle.  Default None: an engine in this process has no such life."""
        return None

    def sleeps_when_idle(self) -> bool:
        """Whether its server was told to sleep on its own when idle.  Default False."""
        return False

    def generate_requests(self, requests: list[WarmRequest], warmup: bool = True) -> list[RequestResult]:
        """One batch of traffic-profile requests (traffic.WarmRequest), sent at once;
        only called when `speaks_profile`.  Default: not supported."""
        raise NotImplementedError(f"engine {self.name} does not speak the traffic profile")

    # -- a model server (solidify, the CLI) ---------------------------------------------
    #: True when load_weights is a model server's own start-up (the openai engine's
    #: supervised or adopted server): prewarm then loads the tokenizer first, while the
    #: server starts, and starts the GPU-ramp sampler only once the server is healthy.
    #: False (default): the agent loads the weights itself, weights first.
    loads_by_starting_server: bool = False

    def prestart(self) -> None:
        """Start what takes long and needs nothing from the agent (a supervised
        server's process) without waiting for it; load_weights waits.  The CLI calls
        it as soon as the engine exists.  Default: nothing to start early."""
        return None

    def has_compile_artifacts(self) -> bool:
        """Whether there is anything compiled to share through the kernel cache
        (solidify opens the cache only then).  Default True: in-process engines
        compile into the cache folders themselves."""
        return True

    def set_server_callbacks(self, on_exit: Callable[[int], None] | None,
                             on_ready: Callable[[], None] | None) -> None:
        """For an engine that supervises a model server: call `on_exit(returncode)`
        when the server crashes and `on_ready()` when it answers again.  Default:
        there is no server, so they are never called (and not kept)."""
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
