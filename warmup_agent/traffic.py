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
    return [Shape(n, b) for b, n in itertools.product(sorted(set(batch_sizes)), sorted(set(prompt_lengths)))]


class PromptFactory:
    """Builds token-id prompts of exact lengths from the engine's own tokenizer."""

    def __init__(self, tokenize):
        self._tokens = tokenize(_SEED_TEXT * 4) or [0]

    def prompt(self, length: int, variant: int = 0) -> list[int]:
        # Rotate by `variant` so prompts in one batch differ (no accidental cache hits).
        base = self._tokens
        start = variant % len(base)
        out: list[int] = []
        while len(out) < length:
            out.extend(base[start:])
            start = 0
        return out[:length]

    def batch(self, shape: Shape) -> list[list[int]]:
        return [self.prompt(shape.prompt_tokens, i) for i in range(shape.batch)]


# --- the synthetic warmup traffic generator (seed 003 §1) ---------------------------------
def gaussian_lengths(count: int, mean: float = 23.0, sd: float = 5.0, seed: int = 0,
                     max_length: int | None = None) -> list[int]:
    """`count` prompt lengths drawn from N(mean, sd), rounded, at least 1 (seed 003's
    default generator: mean 23 tokens, sd 5).  Seeded: the same pod warms the same shapes."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = max(1, round(rng.gauss(mean, sd)))
        out.append(min(n, max_length) if max_length else n)
    return out


def lengths_from_sample(path: str, tokenize, count: int, seed: int = 0) -> list[int]:
    """Prompt lengths learned from a file of real prompts (one per line): `count`
    lengths drawn from their empirical token-length distribution."""
    import random
    try:
        with open(path, encoding="utf-8") as f:
            lengths = [len(tokenize(line.rstrip("\n"))) for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"{path}: cannot read the prompt sample file: {e.strerror}") from None
    lengths = [n for n in lengths if n > 0]
    if not lengths:
        raise ValueError(f"{path}: no non-empty prompts; expected one real prompt per line")
    rng = random.Random(seed)
    return [rng.choice(lengths) for _ in range(count)]


def power_of_two_grid(max_length: int, smallest: int = 1) -> list[int]:
    """1, 2, 4, ... up to max_length (and max_length itself when it is not a power of two)."""
    out, n = [], max(1, smallest)
    while n <= max_length:
        out.append(n)
        n *= 2
    if max_length > 0 and (not out or out[-1] != max_length):
        out.append(max_length)
    return out


def warmup_lengths(configured: list[int], drawn: list[int], max_length: int) -> list[int]:
    """The lengths to warm: the configured ones, the drawn ones, and the power-of-two
    grid up to max_length (0: the longest configured length caps nothing extra)."""
    grid_part = power_of_two_grid(max_length) if max_length else []
    return sorted(set(configured) | set(drawn) | set(grid_part))
