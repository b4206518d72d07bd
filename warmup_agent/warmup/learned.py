"""What users send, learned from the proxy: the shapes of their requests, never their text.

The seed's warm-up is built from real traffic.  Every user request passes the agent's
proxy, which reports its shape here (`Shape`: endpoint, sampling family, prompt length in
tokens, max_tokens, stream, answer length, model name).  The profile keeps a decayed
weight per shape bin, so its size is bounded by the bins, not by the traffic, and old
traffic fades (a half-life counted in requests).  It is persisted in the data dir
(atomically) and shared through the kernel cache's Redis (signed), so a restart, a wake
and a new pod of the deployment warm what the users of the others sent.

    p = LearnedProfile()
    p.observe(Shape("chat", "sampled", 612, 64, True, 40, "my-model"))
    p.traffic_profile(coverage=0.9)      # a warmup.traffic.TrafficProfile to warm

Only numbers and a few names are kept: sampling parameters that are numbers or booleans
(temperature, top_p, ...); a family whose parameters carry text (stop strings, a JSON
schema) is kept by its name and warmed with the defaults of warmup.traffic.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from warmup_agent.warmup import traffic

FORMAT = 1
FILE_NAME = "learned_profile.json"
HALF_LIFE_REQUESTS = 5000.0
# Prompt lengths fall in geometric bins (ratio 1.25): about 50 up to 128k tokens.
_RATIO = 1.25
MAX_MODELS = 8                 # model names kept (the rest counted under "other")
MAX_BINS = 512                 # a bound whatever comes: the lightest bins go first
# Sampling parameters kept as they were sent: numbers and booleans only, never text.
NUMERIC_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "n", "logprobs", "top_logprobs")


@dataclass(frozen=True)
class Shape:
    """One user request as the proxy saw it: no text."""
    endpoint: str                  # chat | completions
    family: str                    # warmup.traffic.family_of
    prompt_tokens: int
    max_tokens: int
    stream: bool
    answer_tokens: int | None = None
    model: str | None = None


def shape_of(endpoint: str, body: dict[str, Any], prompt_tokens: int | None,
             answer_tokens: int | None) -> tuple[Shape, dict[str, Any]]:
    """The shape of a request body (and the numeric sampling parameters of its family);
    `prompt_tokens` as the server counted it, else estimated from the characters."""
    if prompt_tokens is None:
        prompt_tokens = estimate_tokens(body)
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16   # the OpenAI default
    model = body.get("model")
    shape = Shape(endpoint, traffic.family_of(body), max(1, int(prompt_tokens)), int(max_tokens),
                  bool(body.get("stream")), answer_tokens, model if isinstance(model, str) else None)
    params = {k: v for k, v in body.items() if k in NUMERIC_SAMPLING and isinstance(v, (int, float, bool))}
    return shape, params


def estimate_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens from characters (about 4 a token in English) where the server's
    answer did not say: a bin's length, not an exact count."""
    if "messages" in body:
        chars = 0
        for m in body.get("messages") or ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return max(1, chars // 4 + 8 * len(body.get("messages") or ()))    # a chat template's few tokens a turn
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return max(1, len(prompt))
    return max(1, len(prompt) // 4) if isinstance(prompt, str) else 1


def length_bin(tokens: int) -> int:
    return int(math.log(max(1, tokens)) / math.log(_RATIO))


class LearnedProfile:
    """The decayed histogram of users' request shapes; thread-safe."""

    def __init__(self, half_life: float = HALF_LIFE_REQUESTS) -> None:
        self.half_life = half_life
        # (endpoint, family, model, stream, prompt bin, max_tokens) -> [weight, longest prompt, longest answer]
        self.bins: dict[tuple, list[float]] = {}
        self.families: dict[str, dict[str, Any]] = {}
        self.seen = 0                   # requests observed in all (not decayed)
        self.updated_at: float | None = None     # wall clock of the newest request
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.bins)

    @property
    def weight(self) -> float:
        return sum(b[0] for b in self.bins.values())

    def observe(self, shape: Shape, params: dict[str, Any] | None = None, now: float | None = None) -> None:
        models = {k[2] for k in self.bins}
        model = shape.model if shape.model in models or len(models) < MAX_MODELS else "other"
        key = (shape.endpoint, shape.family, model, shape.stream, length_bin(shape.prompt_tokens), shape.max_tokens)
        with self._lock:
            self.seen += 1
            self.updated_at = time.time() if now is None else now
            if self.seen % 100 == 0:
                self._decay(0.5 ** (100 / self.half_life))
            b = self.bins.setdefault(key, [0.0, 0, 0])
            b[0] += 1.0
            b[1] = max(b[1], shape.prompt_tokens)
            b[2] = max(b[2], shape.answer_tokens or 0)
            if shape.family not in self.families or (params and not self.families[shape.family]):
                self.families[shape.family] = dict(params or {})
            if len(self.bins) > MAX_BINS:
                lightest = min(self.bins, key=lambda k: self.bins[k][0])
                del self.bins[lightest]

    def _decay(self, factor: float) -> None:
        for k in list(self.bins):
            self.bins[k][0] *= factor
            if self.bins[k][0] < 1e-3:
                del self.bins[k]

    def covering(self, coverage: float) -> list[tuple[tuple, list[float]]]:
        """The heaviest bins that together hold `coverage` of the weight, heaviest first."""
        with self._lock:
            ranked = sorted(self.bins.items(), key=lambda kv: -kv[1][0])
        total = sum(b[0] for _, b in ranked)
        out, held = [], 0.0
        for k, b in ranked:
            if total and held >= coverage * total:
                break
            out.append((k, b))
            held += b[0]
        return out

    def traffic_profile(self, coverage: float = 1.0, max_lengths: int = 8) -> traffic.TrafficProfile | None:
        """What to warm: the endpoints and families users send (most used first), the
        prompt lengths of the bins that cover `coverage` of their requests, their longest
        answer.  None before any request was seen."""
        bins = self.covering(coverage)
        if not bins:
            return None
        endpoints: dict[str, float] = {}
        families: dict[str, float] = {}
        for (endpoint, family, *_), b in bins:
            endpoints[endpoint] = endpoints.get(endpoint, 0.0) + b[0]
            families[family] = families.get(family, 0.0) + b[0]
        lengths = [int(b[1]) for _, b in bins]
        answer = max(max(int(b[2]) for _, b in bins), 1)
        asked = max(k[5] for k, _ in bins)
        return traffic.TrafficProfile(
            endpoints=sorted(endpoints, key=lambda e: -endpoints[e]),
            families={f: self._params(f) for f in sorted(families, key=lambda f: -families[f])},
            prompt_lengths=traffic.spread(lengths, max_lengths),
            max_tokens=max(1, min(asked, answer)) if answer > 1 else asked,
            source=f"learned from {self.seen} user request(s)", requests_seen=self.seen)

    def _params(self, family: str) -> dict[str, Any]:
        """The family's parameters as users sent them, where numbers; else the defaults."""
        kept = self.families.get(family) or {}
        default = dict(traffic.FAMILY_DEFAULTS.get(family, traffic.FAMILY_DEFAULTS["sampled"]))
        return {**default, **kept} if family not in ("stop", "json_schema") else default

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"format": FORMAT, "half_life": self.half_life, "seen": self.seen, "updated_at": self.updated_at,
                    "families": self.families,
                    "bins": [[list(k), v] for k, v in self.bins.items()]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LearnedProfile:
        """A profile from to_dict's form; ValueError where it is not one."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a learned profile of format {FORMAT}")
        p = cls(float(d.get("half_life") or HALF_LIFE_REQUESTS))
        p.seen = int(d.get("seen") or 0)
        p.updated_at = d.get("updated_at")
        fams = d.get("families") or {}
        p.families = {str(f): {k: v for k, v in (v or {}).items()
                               if k in NUMERIC_SAMPLING and isinstance(v, (int, float, bool))}
                      for f, v in fams.items()}
        for key, value in d.get("bins") or ():
            endpoint, family, model, stream, lbin, max_tokens = key
            p.bins[(str(endpoint), str(family), model, bool(stream), int(lbin), int(max_tokens))] = \
                [float(value[0]), int(value[1]), int(value[2])]
        return p

    def merge(self, other: LearnedProfile) -> None:
        """Add `other`'s weights (another pod's users, a file from an earlier start)."""
        theirs = other.to_dict()
        with self._lock:
            for key, value in theirs["bins"]:
                b = self.bins.setdefault(tuple(key), [0.0, 0, 0])
                b[0] += value[0]
                b[1], b[2] = max(b[1], value[1]), max(b[2], value[2])
            for f, params in theirs["families"].items():
                self.families.setdefault(f, params)
            self.seen += theirs["seen"]
            if theirs["updated_at"] and (self.updated_at is None or theirs["updated_at"] > self.updated_at):
                self.updated_at = theirs["updated_at"]

    def save(self, data_dir: str) -> str:
        from warmup_agent.atomic_file import write_json_atomic
        os.makedirs(data_dir, exist_ok=True)
        path = os.path.join(data_dir, FILE_NAME)
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def load(cls, data_dir: str) -> LearnedProfile | None:
        """The profile saved in `data_dir`, None where there is none or it cannot be read."""
        import json
        try:
            with open(os.path.join(data_dir, FILE_NAME), encoding="utf-8") as f:
                return cls.from_dict(json.load(f))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, IndexError):
            return None
