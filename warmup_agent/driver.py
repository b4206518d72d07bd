"""The engine driver: the one way agent traffic reaches the loaded engine (issue 24).

It owns
  - the engine lock: held around each call into the engine (a warmup batch or
    probe, solidify, the validation checks, the fingerprint before SERVING), so
    the watch thread's probes after SERVING and a re-warm's stages take turns;
  - `send`: one batch of token-id prompts or of traffic-profile requests
    (traffic.WarmRequest), counted as agent traffic in
    warmup_requests_total{kind}, warmup_first_token_latency_seconds{kind} and
    the engine-seconds behind warmup_cost_ratio (a BatchStats record, written by
    exporter/recorder.py);
  - `busy`: the lock around a stage's own engine calls, with their
    engine-seconds counted too where asked (solidify);
  - probe prompts: a fresh prompt for every probe (an engine with prefix caching
    would skip the prefill of a repeated one and look faster than real traffic).
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from exporter.recorder import BatchStats, Recorder
from warmup_agent.warmup.traffic import PromptFactory, TrafficProfile, WarmRequest, probe_request

if TYPE_CHECKING:  # types only
    from warmup_agent.engines.base import Engine, RequestResult


class EngineDriver:
    def __init__(self, engine: Engine, recorder: Recorder, probe_prompt_length: int):
        self.engine = engine
        #: Where its batches' stats become metrics (exporter/recorder.py).
        self.recorder = recorder
        #: Engine-seconds of agent traffic by kind (warmup_cost_ratio, the traces).
        self.seconds_by_kind: collections.defaultdict[str, float] = collections.defaultdict(float)
        #: The engine lock (see the module docstring).  An engine that serves users in
        #: process too (the torch engine: engines/torch/batcher.py) owns it, so its users'
        #: batches and the agent's calls take turns; otherwise the driver's own.
        self.lock: threading.Lock = engine.lock or threading.Lock()
        #: Requests of kind "warmup" sent so far (the run record's warmup_requests).
        self.warmup_requests = 0
        #: The last batch `send` got back.
        self.last_results: list[RequestResult] = []
        #: The prompt factory, made by prewarm once the tokenizer is loaded (`start_prompts`).
        self.prompts: PromptFactory | None = None
        self._probe_prompt_length = probe_prompt_length
        self._probe_seq = 0

    def start_prompts(self) -> PromptFactory:
        """Make the prompt factory from the engine's tokenizer (prewarm, once it is loaded)."""
        self.prompts = PromptFactory(self.engine.tokenize)
        return self.prompts

    def send(self, batch: Sequence[list[int]] | Sequence[WarmRequest], kind: str,
             max_new_tokens: int = 1, give_way: Callable[[], bool] | None = None) -> list[RequestResult]:
        """Send one batch as agent traffic: token-id prompts (each answered with `max_new_tokens`
        tokens) or traffic-profile requests (each carries its own answer length; engines that
        speak the profile).  `give_way`: Engine.give_way for this batch only, set under the lock."""
        with self.lock:
            t0 = time.perf_counter()
            if give_way is not None:
                self.engine.give_way(give_way)
            try:
                if batch and isinstance(batch[0], WarmRequest):
                    results = self.engine.generate_requests(list(batch), warmup=True)  # type: ignore[arg-type]
                else:
                    results = self.engine.generate(list(batch), max_new_tokens=max_new_tokens,  # type: ignore[arg-type]
                                                   warmup=True)
            finally:
                if give_way is not None:
                    self.engine.give_way(None)
            busy = time.perf_counter() - t0
        self.last_results = results
        ttft = max(r.first_token_seconds for r in results)
        self._count(BatchStats(kind, busy, requests=len(batch), first_token_seconds=ttft))
        if kind == "warmup":
            self.warmup_requests += len(batch)
        return results

    @contextlib.contextmanager
    def busy(self, kind: str | None = None) -> Iterator[None]:
        """Hold the engine lock around a stage's own engine calls; with `kind`,
        count their engine-seconds (warmup_engine_seconds_total{kind}) when they
        return normally."""
        with self.lock:
            t0 = time.perf_counter()
            yield
            busy = time.perf_counter() - t0
        if kind is not None:
            self._count(BatchStats(kind, busy))

    def _count(self, s: BatchStats) -> None:
        self.seconds_by_kind[s.kind] += s.engine_seconds
        self.recorder.batch(s)

    def engine_seconds(self, kind: str | None = None) -> float:
        """Engine-seconds of agent traffic so far: of one kind, or of every kind."""
        return self.seconds_by_kind.get(kind, 0.0) if kind is not None else sum(self.seconds_by_kind.values())

    def probe_prompt(self) -> list[int]:
        """A different prompt of readiness.probe_prompt_length tokens for every probe."""
        self._probe_seq += 1
        assert self.prompts is not None, "prewarm makes the prompt factory before any probe"
        return self.prompts.prompt(self._probe_prompt_length, variant=self._probe_seq)

    def send_probe(self, profile: TrafficProfile | None, prompt_tokens: int, max_tokens: int) -> RequestResult:
        """One readiness probe: with an engine that speaks the traffic profile, a
        request as a user sends it (the profile's endpoint and sampling, a prompt of
        `prompt_tokens`, `max_tokens` output tokens); else a fresh prompt of token
        ids answered with one token."""
        if self.engine.speaks_profile and profile is not None:
            return self.send([probe_request(profile, prompt_tokens, max_tokens)], "probe")[0]
        return self.send([self.probe_prompt()], "probe")[0]
