"""CUDA graphs for the warmed decode shapes (stage 3).

One decode step (one token per sequence against a static KV cache) is captured
per warmed batch size; a request of that batch then pays one graph launch per
generated token instead of hundreds of kernel launches.

With the native model (engines/torch/native_lm.py), which brings its own static cache
and the same call signature, the prefill is captured too: one graph per warmed
(prompt length, batch size).  A prompt of n tokens is right-padded to the
smallest captured length >= n and its logits are taken at position n - 1.  This
is exact: the static cache masks every key past a query's own position, so no
real token sees the padding, and the padding's keys (positions n..) are
overwritten by the decode steps before any query reaches them.  Why: an eager
short prefill is bound by the host launching hundreds of kernels and drifts from
one request to the next; the readiness probes and the first user request are
exactly such prefills.
Prompts longer than every captured length, and transformers' models, prefill
eagerly.

The static-cache decode also runs without graphs (`capture=False`), which is
how the CPU tests check it against the dynamic-cache path token for token.
When capture is impossible (no CUDA device, a model whose step synchronises
with the host, an API the installed transformers lacks) the caller gets a named
reason and keeps the eager path: never a crash.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("warmup_agent.gpu.graphs")


class StaticDecoder:
    """Static KV cache + (optionally) a captured decode step for one batch size."""

    def __init__(self, model: Any, batch: int, max_len: int, device: Any, capture: bool, pool: Any = None,
                 prefill_lengths: list[int] | tuple[int, ...] = ()) -> None:
        import torch
        self.model, self.batch, self.max_len, self.device = model, batch, max_len, device
        self.cache = _static_cache(model, batch, max_len)
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((1,), dtype=torch.long, device=device)
        self.graph = None
        self.logits = None
        #: Padded prefills by length (native model only; see the module docstring).
        self.prefills: dict[int, PaddedPrefill] = {}
        # Prefill once so the cache's tensors exist (lazily allocated), then warm the step.
        self.prefill(torch.zeros((batch, 4), dtype=torch.long, device=device))
        if capture:
            self._capture(pool)
        if _is_native(model):
            for length in sorted({n for n in prefill_lengths if 0 < n <= max_len}):
                self.prefills[length] = PaddedPrefill(self, length, capture, pool)

    def _step(self) -> Any:
        return self.model(input_ids=self.ids, past_key_values=self.cache, cache_position=self.pos,
                          use_cache=True).logits

    def _capture(self, pool: Any) -> None:
        self.graph, self.logits = _capture_graph(self._step, self.device, pool, warmups=2)

    def prefill_for(self, n: int) -> PaddedPrefill | None:
        """The padded prefill that serves an n-token prompt: the shortest captured length >= n."""
        fits = [length for length in self.prefills if length >= n]
        return self.prefills[min(fits)] if fits else None

    def prefill(self, ids: Any) -> Any:
        """Prefill of equal-length prompts into the static cache; logits of the last
        position.  Through a padded prefill where one fits, else eager."""
        import torch
        padded = self.prefill_for(ids.shape[1])
        if padded is not None:
            return padded(ids)
        n = ids.shape[1]
        with torch.inference_mode():
            if not _is_native(self.model):
                # transformers' StaticCache; the native one masks stale keys by position instead.
                self.cache.reset()
            out = self.model(input_ids=ids, past_key_values=self.cache,
                             cache_position=torch.arange(n, device=self.device), use_cache=True)
        return out.logits[:, -1, :]

    def decode(self, token: Any, position: int) -> Any:
        """One decode step for `token` ([batch, 1]) at `position`; logits [batch, vocab]."""
        import torch
        with torch.inference_mode():
            self.ids.copy_(token)
            self.pos.fill_(position)
        if self.graph is not None:
            self.graph.replay()
            return self.logits[:, -1, :]
        with torch.inference_mode():
            return self._step()[:, -1, :]


class PaddedPrefill:
    """The prefill of prompts of up to `length` tokens for one StaticDecoder,
    right-padded to `length` (native model only): static input buffers, the
    logits of one position, and (capture=True) a CUDA graph of it all."""

    def __init__(self, decoder: StaticDecoder, length: int, capture: bool, pool: Any) -> None:
        import torch
        self.decoder, self.length = decoder, length
        device = decoder.device
        self.ids = torch.zeros((decoder.batch, length), dtype=torch.long, device=device)
        self.positions = torch.arange(length, device=device)
        self.last = torch.zeros((1,), dtype=torch.long, device=device)
        self.graph: Any = None
        self.logits: Any = None
        self.served = 0           # prefills it served, graph or eager (tests check the path taken)
        if capture:
            self._capture(pool)

    def _run(self) -> Any:
        d = self.decoder
        return d.model(input_ids=self.ids, past_key_values=d.cache, cache_position=self.positions,
                       use_cache=True, logits_at=self.last).logits

    def _capture(self, pool: Any) -> None:
        import torch
        graph, self.logits = _capture_graph(self._run, self.decoder.device, pool, warmups=1)
        # The first launch of a graph also uploads it: pay that here, not in the first request.
        graph.replay()
        torch.cuda.synchronize(self.decoder.device)
        self.graph = graph

    def __call__(self, ids: Any) -> Any:
        """Logits [batch, vocab] of the last of `ids`' n <= length tokens."""
        import torch
        n = ids.shape[1]
        with torch.inference_mode():
            self.ids[:, :n].copy_(ids)
            self.last.fill_(n - 1)
        self.served += 1
        if self.graph is not None:
            self.graph.replay()
            return self.logits[:, -1, :]
        with torch.inference_mode():
            return self._run()[:, -1, :]


def _capture_graph(run: Callable[[], Any], device: Any, pool: Any, warmups: int) -> tuple[Any, Any]:
    """(graph, its output): `run` warmed `warmups` times on a side stream (cuBLAS
    handles, workspaces, plans: nothing lazy may happen inside a capture), then
    captured into `pool`."""
    import torch
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(warmups):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
        out = run()
    torch.cuda.synchronize(device)
    return graph, out


def _is_native(model: Any) -> bool:
    """A model that brings its own static cache (engines/native_lm.NativeCausalLM);
    asked by capability, not by class: gpu/ sits below engines/ and imports none of it."""
    return callable(getattr(model, "make_static_cache", None))


def _static_cache(model: Any, batch: int, max_len: int) -> Any:
    """The native model's own preallocated cache, else transformers' StaticCache
    (allocated lazily at the first prefill)."""
    if _is_native(model):
        return model.make_static_cache(batch, max_len)
    from transformers import StaticCache
    return StaticCache(config=model.config, max_cache_len=max_len)


def build(model: Any, batches: list[int], max_len: int, device: Any, capture: bool,
          prefill_lengths: dict[int, list[int]] | None = None) -> tuple[dict, str | None]:
    """StaticDecoders by batch size, each with padded prefills for its
    `prefill_lengths[batch]` (native model only); (decoders, None) or ({}, reason)
    where it failed."""
    import torch
    if capture and device.type != "cuda":
        return {}, "no_cuda_device"
    try:
        if not _is_native(model):
            from transformers import StaticCache  # noqa: F401
    except ImportError:
        return {}, "static_cache_unavailable"
    out = {}
    pool = torch.cuda.graph_pool_handle() if capture else None
    for b in sorted(set(batches)):
        try:
            out[b] = StaticDecoder(model, b, max_len, device, capture, pool, (prefill_lengths or {}).get(b, ()))
        except Exception as e:  # noqa: BLE001 - any capture failure means: stay eager, say why
            log.warning("CUDA graph capture for batch %d failed: %s", b, e)
            return {}, f"capture_failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return out, None
