"""Synthetic warmup traffic: prompts of exact token lengths, and the profile of what real traffic sends.

Every shape and code path a server has not seen pays its own first-call cost (allocator
buckets, kernel plans, compilation), so warmup covers the ones real traffic uses.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Repeated and cut to length, so prompt length is controlled in tokens.
_SEED_TEXT = ("Warmup request for a model server that just started: the agent sends "
              "synthetic prompts of every length and batch size that real traffic uses, "
              "so that the first real request is as fast as the thousandth. ")


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    batch: int


def grid(prompt_lengths: list[int], batch_sizes: list[int]) -> list[Shape]:
    """Every (length, batch) pair, small first, so a failure on a huge shape comes after the common ones."""
    return [Shape(n, b) for b, n in itertools.product(sorted(set(batch_sizes)), sorted(set(prompt_lengths)))]


class PromptFactory:
    """Builds token-id prompts of exact lengths from the engine's own tokenizer."""

    def __init__(self, tokenize: Any) -> None:
        self._tokens = tokenize(_SEED_TEXT * 4) or [0]

    def prompt(self, length: int, variant: int = 0) -> list[int]:
        # Rotated by `variant` so prompts in one batch do not hit each other's cache.
        base = self._tokens
        start = variant % len(base)
        out: list[int] = []
        while len(out) < length:
            out.extend(base[start:])
            start = 0
        return out[:length]

    def batch(self, shape: Shape) -> list[list[int]]:
        return [self.prompt(shape.prompt_tokens, i) for i in range(shape.batch)]


def gaussian_lengths(count: int, mean: float = 23.0, sd: float = 5.0, seed: int = 0,
                     max_length: int | None = None) -> list[int]:
    """`count` prompt lengths from N(mean, sd), at least 1; seeded, so a pod warms the same shapes each start."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = max(1, round(rng.gauss(mean, sd)))
        out.append(min(n, max_length) if max_length else n)
    return out


def lengths_from_sample(path: str, tokenize: Any, count: int, seed: int = 0) -> list[int]:
    """`count` prompt lengths drawn from a file of real prompts, one per line."""
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
    """The configured and drawn lengths, plus the power-of-two grid up to max_length (0: none)."""
    grid_part = power_of_two_grid(max_length) if max_length else []
    return sorted(set(configured) | set(drawn) | set(grid_part))


# Sampling "families": code paths with their own first-call cost (top-p sorting, penalties,
# logprobs, stop strings, n > 1, JSON-schema grammars), with default parameters for each.
FAMILY_DEFAULTS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.7, "top_p": 0.9},
    "top_k": {"temperature": 0.7, "top_k": 40},
    "penalties": {"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logprobs": {"temperature": 0.0, "logprobs": True, "top_logprobs": 2},
    "stop": {"temperature": 0.0, "stop": ["\n\n"]},
    "n": {"temperature": 0.7, "n": 2},
    "json_schema": {"temperature": 0.0, "response_format": {"type": "json_schema", "json_schema": {
        "name": "warmup", "schema": {"type": "object", "properties": {"answer": {"type": "string"}}}}}},
}
# Body keys that are not sampling parameters.
_NOT_SAMPLING = {"model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                 "user", "seed", "metadata", "store"}
ENDPOINTS = ("chat", "completions")


def family_of(body: dict) -> str:
    """The code path a request body takes, most specific first."""
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") in ("json_schema", "json_object"):
        return "json_schema"
    if (body.get("n") or 1) > 1:
        return "n"
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs"):
        return "logprobs"
    if body.get("stop"):
        return "stop"
    if any(body.get(k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")):
        return "penalties"
    if body.get("top_k") not in (None, -1, 0):
        return "top_k"
    temperature = body.get("temperature", 1.0)   # the OpenAI default
    return "greedy" if temperature == 0 else "sampled"


@dataclass(frozen=True)
class WarmRequest:
    """One warmup request; `prompt_tokens` includes the chat template's tokens."""
    endpoint: str
    prompt_tokens: int
    max_tokens: int
    family: str
    params: tuple = ()           # sorted (key, json-text) pairs, hashable

    @property
    def sampling(self) -> dict:
        import json
        return {k: json.loads(v) for k, v in self.params}


def _frozen(params: dict) -> tuple:
    import json
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in params.items()))


@dataclass
class TrafficProfile:
    endpoints: list[str]                 # most used first
    families: dict[str, dict]            # family -> sampling parameters to send
    prompt_lengths: list[int]
    max_tokens: int                      # longest answer to warm
    source: str = "default"              # or the requests file
    requests_seen: int = 0
    bad_lines: dict = field(default_factory=lambda: {"count": 0, "first_lines": []})   # lines left out as bad
    family_lines: dict[str, int] = field(default_factory=dict)   # family -> file line its parameters came from


def decode_tiles(lengths: list[int], answer: int) -> list[int]:
    """Prompt lengths, one answer apart, whose answers together decode at every sequence length."""
    lo, hi = min(lengths), max(lengths)
    return sorted(set(range(lo, hi, max(1, answer))) | {hi})


def probe_endpoint(profile: "TrafficProfile") -> str:
    """The endpoint a user most likely sends to first: chat where the profile has it."""
    return "chat" if "chat" in profile.endpoints else profile.endpoints[0]


def probe_family(profile: "TrafficProfile") -> str:
    """The family a user most likely sends first: sampled where the profile has it."""
    return "sampled" if "sampled" in profile.families else next(iter(profile.families))


def default_profile(endpoints: Sequence[str], max_tokens: int, prompt_lengths: list[int]) -> TrafficProfile:
    """The profile without a requests file: greedy and sampled on every endpoint."""
    return TrafficProfile(endpoints=list(endpoints), families={k: dict(FAMILY_DEFAULTS[k]) for k in ("greedy", "sampled")},
                          prompt_lengths=list(prompt_lengths), max_tokens=max_tokens)


def load_requests_file(path: str, count_chat: Any, count_text: Any, max_lengths: int = 8,
                       bad_lines: str = "skip") -> TrafficProfile:
    """A profile learned from JSON Lines of OpenAI request bodies, as a gateway logs them.

    Bad lines raise ValueError (bad_lines="fail") or are counted in the profile ("skip")."""
    from collections import Counter

    from warmup_agent.warmup import requests_file
    endpoints: Counter = Counter()
    families: dict[str, dict] = {}
    family_lines: dict[str, int] = {}
    lengths: list[int] = []
    max_tokens = 0
    check = requests_file.FileCheck(path)
    try:
        for i, body, problem in requests_file.scan(path):
            if problem is not None:
                if bad_lines == "fail":
                    raise ValueError(f"{path}:{i}: {problem}")
                check.bad_count += 1
                if len(check.bad) < requests_file.KEEP_BAD:
                    check.bad.append((i, problem))
                continue
            check.good_count += 1
            if "messages" in body:
                endpoints["chat"] += 1
                lengths.append(count_chat(body["messages"]))
            else:
                endpoints["completions"] += 1
                prompt = body["prompt"]
                lengths.append(len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
                               else count_text(prompt if isinstance(prompt, str) else str(prompt)))
            max_tokens = max(max_tokens, body.get("max_tokens") or body.get("max_completion_tokens") or 16)  # the OpenAI default
            fam = family_of(body)
            if fam not in families:
                families[fam] = {k: v for k, v in body.items() if k not in _NOT_SAMPLING}
                family_lines[fam] = i
    except OSError as e:
        raise ValueError(requests_file.read_error(path, e)) from None
    error = check.error() if bad_lines == "fail" else check.skip_error()
    if error:
        raise ValueError(error)
    return TrafficProfile(endpoints=[e for e, _ in endpoints.most_common()], families=families,
                          prompt_lengths=spread(lengths, max_lengths), max_tokens=max_tokens,
                          source=path, requests_seen=len(lengths), bad_lines=check.bad_lines(),
                          family_lines=family_lines)


def merged(first: TrafficProfile, second: TrafficProfile, max_lengths: int = 8) -> TrafficProfile:
    """Both profiles' traffic: `first`'s endpoints and families first, the prompt lengths
    of both (spread over at most max_lengths), the longer answer."""
    return TrafficProfile(endpoints=list(dict.fromkeys([*first.endpoints, *second.endpoints])),
                          families={**first.families, **{k: v for k, v in second.families.items()
                                                         if k not in first.families}},
                          prompt_lengths=spread([*first.prompt_lengths, *second.prompt_lengths], max_lengths),
                          max_tokens=max(first.max_tokens, second.max_tokens),
                          source=f"{first.source} and {second.source}",
                          requests_seen=first.requests_seen + second.requests_seen, bad_lines=first.bad_lines,
                          family_lines=first.family_lines)


def spread(values: list[int], k: int) -> list[int]:
    """At most k distinct values at the quantiles 0, 1/(k-1), ..., 1."""
    s = sorted(set(values))
    if len(s) <= k:
        return s
    ordered = sorted(values)
    picks = {ordered[round(i * (len(ordered) - 1) / (k - 1))] for i in range(k)}
    return sorted(picks)


def probe_request(profile: TrafficProfile, prompt_tokens: int, max_tokens: int) -> WarmRequest:
    """The readiness probe: what a user most likely sends first."""
    endpoint = probe_endpoint(profile)
    family = probe_family(profile)
    params = dict(profile.families[family])
    params.pop("n", None)     # one answer per probe: its tokens are timed
    return WarmRequest(endpoint, prompt_tokens, max_tokens, family, _frozen(params))
