"""CUDA graphs for the warmed decode shapes (stage 3): one graph launch per token instead of many kernels.

With the native model the prefill is captured too, per warmed (length, batch): a prompt is
right-padded to the shortest captured length, which is exact because the static cache masks
keys past each query's position and decode overwrites the padding's keys.  Short eager
prefills are launch-bound and jittery, and the readiness probes are exactly such prefills.
When capture is impossible the caller gets a named reason and stays eager.
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
        self.prefills: dict[int, PaddedPrefill] = {}
        # Prefill once so the lazily allocated cache tensors exist.
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
        """The padded prefill of the shortest captured length >= n, or None."""
        fits = [length for length in self.prefills if length >= n]
        return self.prefills[min(fits)] if fits else None

    def prefill(self, ids: Any) -> Any:
        """Prefill equal-length prompts into the static cache; return the last position's logits."""
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
    """A prefill of prompts right-padded to `length` (native model only), optionally as a CUDA graph."""

    def __init__(self, decoder: StaticDecoder, length: int, capture: bool, pool: Any) -> None:
        import torch
        self.decoder, self.length = decoder, length
        device = decoder.device
        self.ids = torch.zeros((decoder.batch, length), dtype=torch.long, device=device)
        self.positions = torch.arange(length, device=device)
        self.last = torch.zeros((1,), dtype=torch.long, device=device)
        self.graph: Any = None
        self.logits: Any = None
        self.served = 0           # prefills served, for the tests
        if capture:
            self._capture(pool)

    def _run(self) -> Any:
        d = self.decoder
        return d.model(input_ids=self.ids, past_key_values=d.cache, cache_position=self.positions,
                       use_cache=True, logits_at=self.last).logits

    def _capture(self, pool: Any) -> None:
        import torch
        graph, self.logits = _capture_graph(self._run, self.decoder.device, pool, warmups=1)
        # A graph's first launch also uploads it: pay that here, not in the first request.
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
    """(graph, output) of `run`, warmed first on a side stream since nothing lazy may happen in a capture."""
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
    """Whether the model brings its own static cache (by capability: gpu/ does not import engines/)."""
    return callable(getattr(model, "make_static_cache", None))


def _static_cache(model: Any, batch: int, max_len: int) -> Any:
    """The native model's own cache, else transformers' StaticCache."""
    if _is_native(model):
        return model.make_static_cache(batch, max_len)
    from transformers import StaticCache
    return StaticCache(config=model.config, max_cache_len=max_len)


def build(model: Any, batches: list[int], max_len: int, device: Any, capture: bool,
          prefill_lengths: dict[int, list[int]] | None = None) -> tuple[dict, str | None]:
    """(StaticDecoders by batch size, None), or ({}, reason) where it failed."""
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
