"""Synthetic warmup traffic: prompts of exact token lengths over the shape grid.

Seed 003's generator draws short prompts around a typical length; we cover the
grid of prompt lengths x batch sizes that real traffic will use, because a
shape never seen before pays its own first-call tax (allocator buckets, kernel
plans, compilation) on a user's request.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

# Plain text that any BPE tokenizer splits into many tokens; repeated and cut to
# the exact length needed, so prompt length is controlled in tokens, not words.
_SEED_TEXT = ("Warmup request for a model server that just started: the agent sends "
              "synthetic prompts of every length and batch size that real traffic uses, "
              "so that the first real request is as fast as the thousandth. ")


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    batch: int


def grid(prompt_lengths: list[int], batch_sizes: list[int]) -> list[Shape]:
    """Every (length, batch) pair, small first: a failure on a huge shape should
    not come before the common shapes are warm."""
    return [Shape(l, b) for b, l in itertools.product(sorted(set(batch_sizes)), sorted(set(prompt_lengths)))]


class PromptFactory:
    """Builds token-id prompts of exact lengths from the engine's own tokenizer."""

    def __init__(self, tokenize):
        self._tokens = tokenize(_SEED_TEXT * 4) or [0]

    def prompt(self, length: int, variant: int = 0) -> list[int]:
        # Rotate by `variant` so prompts in one batch differ (no accidental cache hits).
        base = self._tokens
        start = variant % len(base)
        out = []
        while len(out) < length:
            out.extend(base[start:])
            start = 0
        return out[:length]

    def batch(self, shape: Shape) -> list[list[int]]:
        return [self.prompt(shape.prompt_tokens, i) for i in range(shape.batch)]
