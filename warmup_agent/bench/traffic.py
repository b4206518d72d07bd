"""The bench's traffic: streamed chat requests drawn by one seeded generator.

Each start gets one request shape (a prompt length, an answer length, sampling),
drawn from the requests file when one is given, else from a built-in mix of
lengths; start i of every condition gets the same shape, so the conditions meet
the same traffic.  Every request of a start (the first, the steady ones, the
burst) is that shape with a new prefix and new words, so no prefix or prompt
cache can answer it.
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

from warmup_agent.warmup.requests_file import check_file, read_error

#: The bench's conditions, in the order a start cycles through them.
# spawn-alone and spawn-agent: a user's request sent at the spawn (bench/spawn.py), to the
# server alone and through the agent's proxy; nothing else is measured in those starts.
CONDITIONS = ("alone", "oneshot", "agent", "spawn-alone", "spawn-agent")

# Plain words: any tokenizer splits them into few tokens, so a prompt of N words
# stays within a small context.
WORDS = tuple("""the a order delivery address office week customer account payment card refund
price invoice ship box parcel late early today tomorrow please help change update cancel
return size colour item store online phone email message reply question answer problem
issue team manager service support time day month year first last next new old good bad
fast slow open close start stop check send read write find keep make give take show tell
ask need want like know think see look come go get put call work play run move live city
street house room door window table chair book paper letter note list plan idea report
data file page line word name number code key value test result error model system
""".split())

# The built-in mix: (weight, prompt words low, high), a chat service's spread of
# short questions, paragraphs and pasted documents.  Scaled to --max-context.
MIX = ((0.5, 0.02, 0.10), (0.35, 0.10, 0.30), (0.15, 0.30, 0.55))
LONGER_BY = 12     # words the new-length control adds: a length no earlier request had
NEW_LENGTH_DRAWS = 200   # draws of a length inside the traffic's range, LONGER_BY words from any used
MIN_APART = 4            # words, where the range holds no length LONGER_BY from a start's own
SAMPLINGS = ({"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.0, "top_p": 0.95})


class TrafficError(Exception):
    """A requests file that cannot be used; str() is the one line to show."""


@dataclass
class Shape:
    """One start's requests: `body` is an OpenAI chat body (no model, no stream
    fields) whose last user message gets a fresh prefix per request."""
    body: dict[str, Any]
    source: str                     # "mix" or "FILE:LINE"
    prompt_words: int = 0

    def describe(self) -> dict[str, Any]:
        keys = ("max_tokens", "temperature", "top_p", "top_k")
        return {"source": self.source, "prompt_words": self.prompt_words,
                **{k: self.body[k] for k in keys if k in self.body}}


@dataclass
class Traffic:
    """The run's generator: `shape(i)` for start i, `request(shape)` for each request."""
    seed: int
    max_context: int = 2048
    max_tokens: int = 32
    file_bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed ^ 0x5EED)

    def shape(self, start: int) -> Shape:
        """Start `start`'s shape, the same for every condition (seed, start)."""
        rng = random.Random(self.seed * 1_000_003 + start)
        if self.file_bodies:
            source, body = rng.choice(self.file_bodies)
            return _shape_of_body(source, body, self.max_tokens)
        words = self._mix_words(rng)
        body = {"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))}],
                "max_tokens": rng.randint(max(4, self.max_tokens // 2), self.max_tokens), **rng.choice(SAMPLINGS)}
        return Shape(body, "mix", words)

    def _budget(self) -> int:
        """The mix's scale in words: a word is 1-3 tokens; prompt and answer fit the context."""
        return max(8, self.max_context // 3 - self.max_tokens)

    def _mix_words(self, rng: random.Random) -> int:
        """One prompt length drawn from the built-in mix, in words."""
        _, lo, hi = rng.choices(MIX, weights=[w for w, _, _ in MIX])[0]
        return max(4, int(rng.uniform(lo, hi) * self._budget()))

    def length_range(self) -> tuple[int, int]:
        """The shortest and longest prompt, in words, this traffic draws."""
        if self.file_bodies:
            words = [_shape_of_body(source, body, self.max_tokens).prompt_words for source, body in self.file_bodies]
            return min(words), max(words)
        return max(4, int(MIX[0][1] * self._budget())), max(4, int(MIX[-1][2] * self._budget()))

    def unused_length(self, start: int, used: list[int], apart: int = LONGER_BY) -> int | None:
        """A length in words that this traffic draws (from a file: any between its shortest and
        longest), `apart` words from each of `used`, else the farthest drawn at least
        MIN_APART away; the same in every condition; None: none."""
        rng = random.Random(self.seed * 1_000_003 + start + 0x1E9)
        lo, hi = self.length_range()
        best, best_gap = None, MIN_APART - 1
        for _ in range(NEW_LENGTH_DRAWS):
            words = rng.randint(lo, hi) if self.file_bodies else self._mix_words(rng)
            gap = min(abs(words - u) for u in used) if used else apart
            if gap >= apart:
                return words
            if gap > best_gap:
                best, best_gap = words, gap
        return best

    def at_length(self, shape: Shape, words: int) -> Shape:
        """`shape` with `words` prompt words: a file's last user message cut or lengthened once here."""
        body = copy.deepcopy(shape.body)
        if shape.source != "mix":
            last = next(m for m in reversed(body["messages"]) if m.get("role") == "user")
            own = _text(last.get("content")).split()
            keep = max(1, words - (shape.prompt_words - len(own)))
            own = own[:keep] + [self._rng.choice(WORDS) for _ in range(keep - len(own))]
            last["content"] = " ".join(own)
            words = sum(len(_text(m.get("content")).split()) for m in body["messages"])
        return Shape(body, shape.source, words)

    def longer(self, shape: Shape, words: int = LONGER_BY) -> Shape:
        """`shape` with `words` more prompt words: a prompt length the server has not seen."""
        body = copy.deepcopy(shape.body)
        if shape.source != "mix":
            last = next(m for m in reversed(body["messages"]) if m.get("role") == "user")
            last["content"] = _text(last.get("content")) + " " + " ".join(self._rng.choice(WORDS) for _ in range(words))
        return Shape(body, shape.source, shape.prompt_words + words)

    def request(self, shape: Shape) -> dict[str, Any]:
        """A new request of `shape`: a fresh prefix, and new words for the mix's prompts."""
        body = copy.deepcopy(shape.body)
        rng = self._rng
        prefix = f"{rng.randrange(10**6):06d} {' '.join(rng.choice(WORDS) for _ in range(3))}: "
        last = next(m for m in reversed(body["messages"]) if m.get("role") == "user")
        if shape.source == "mix":
            last["content"] = " ".join(rng.choice(WORDS) for _ in range(shape.prompt_words))
        last["content"] = prefix + _text(last.get("content"))
        return body


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # content parts: keep their text
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _shape_of_body(source: str, body: dict[str, Any], max_tokens: int) -> Shape:
    out = {k: v for k, v in body.items() if k not in ("model", "stream", "stream_options", "n")}
    if "prompt" in out:            # a completions line: the same text as one user message
        out["messages"] = [{"role": "user", "content": _text(out.pop("prompt"))}]
    out.setdefault("max_tokens", out.pop("max_completion_tokens", max_tokens))
    words = sum(len(_text(m.get("content")).split()) for m in out["messages"])
    return Shape(out, source, words)


def load_requests_file(path: str) -> list[tuple[str, dict[str, Any]]]:
    """The usable lines of a requests file (JSON Lines of OpenAI request bodies)."""
    try:
        check = check_file(path)
    except OSError as e:
        raise TrafficError(read_error(path, e)) from None
    bodies = [(f"{path}:{n}", b) for n, b in check.good
              if any(m.get("role") == "user" for m in b.get("messages") or []) or isinstance(b.get("prompt"), str)]
    if not bodies:
        shown = "; ".join(f"line {n}: {why}" for n, why in check.bad[:3])
        raise TrafficError(f"{path}: no usable request (a chat body with a user message, or a text prompt)"
                           + (f"; {shown}" if shown else ""))
    return bodies
