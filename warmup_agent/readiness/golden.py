"""The same answers after a wake or a restart (issue 72).

A server can come back from a wake or a restart answering nonsense while every health
check passes (vLLM #29341: a level-2 wake that served garbage).  At the first SERVING the
agent asks the server a few fixed prompts of its own (never users' text), greedy, and keeps
the answers; after every wake and restart of the same served model it asks again before
SERVING.  Answers that disagree are a named failure: the pod never serves a model that
answers otherwise than the one it warmed.  A different served model (the name on
/v1/models) is a new model: its answers are recorded anew.

Greedy answers of one model agree from token to token, but a GPU's kernels may flip a late
token between two runs: an answer agrees when its first tokens (ids where the server gives
them, else its first characters) are the same, and the check fails only when most prompts
disagree.  Asking costs three short completions (about 0.1 s on a CPU llama-server).
"""
from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass

log = logging.getLogger("warmup_agent.readiness.golden")

PROMPTS = ("The first three prime numbers are", "Water boils at a temperature of", "A B C D E F")
MAX_TOKENS = 6
FIRST_TOKENS = 2          # token ids that must agree
FIRST_CHARS = 6           # characters that must agree where the server gives no ids


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[int, ...] | None

    def agrees(self, other: Answer) -> bool:
        if self.tokens and other.tokens:
            return self.tokens[:FIRST_TOKENS] == other.tokens[:FIRST_TOKENS]
        return self.text[:FIRST_CHARS] == other.text[:FIRST_CHARS]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json",
                                                                               "X-Warmup": "true"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.load(r))


def served_model(base_url: str, timeout: float = 5.0) -> str | None:
    """The first model on /v1/models, None where the server does not say."""
    try:
        with urllib.request.urlopen(base_url + "/v1/models", timeout=timeout) as r:
            data = json.load(r).get("data") or []
        return str(data[0]["id"]) if data else None
    except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError, TypeError):
        return None


def ask(base_url: str, model: str, timeout: float = 30.0) -> list[Answer] | None:
    """The server's greedy answers to PROMPTS; None where it did not answer them all."""
    out = []
    ids_field = True        # vLLM's return_token_ids; a server that refuses it is asked without
    try:
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0}
            try:
                reply = _post(base_url + "/v1/completions", {**body, "return_token_ids": True} if ids_field else body,
                              timeout)
            except urllib.error.HTTPError as e:
                if e.code != 400 or not ids_field:
                    raise
                ids_field = False
                reply = _post(base_url + "/v1/completions", body, timeout)
            choice = (reply.get("choices") or [{}])[0]
            ids = choice.get("token_ids") or choice.get("tokens")
            out.append(Answer(str(choice.get("text") or ""),
                              tuple(int(t) for t in ids) if isinstance(ids, list) and all(
                                  isinstance(t, int) for t in ids) else None))
    except (OSError, urllib.error.URLError, ValueError, TypeError) as e:
        log.warning("golden answers: the server did not answer (%s); not checked", e)
        return None
    return out


class GoldenAnswers:
    """The answers of the model the pod warmed, asked of the server at `base_url`."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        self.url, self.timeout = base_url.rstrip("/"), timeout
        self.model: str | None = None
        self.answers: list[Answer] | None = None

    def record(self) -> bool:
        """Ask and keep the answers (the first SERVING, or a new model); False where the
        server did not answer."""
        model = served_model(self.url)
        answers = ask(self.url, model, self.timeout) if model else None
        if answers is None:
            return False
        self.model, self.answers = model, answers
        log.info("golden answers recorded for %s: %d fixed greedy prompts, asked again after a wake or a restart",
                 model, len(answers))
        return True

    def check(self) -> str | None:
        """None when the server answers as before (or a new model, whose answers are
        recorded now, or nothing to compare); else one line saying what differs."""
        if self.answers is None:
            return None
        model = served_model(self.url)
        if model is None:
            return None
        if model != self.model:
            log.info("golden answers: the server now serves %s (was %s), a new model: recording its answers",
                     model, self.model)
            self.record()
            return None
        now = ask(self.url, model, self.timeout)
        if now is None:
            return None
        differ = [i for i, (a, b) in enumerate(zip(self.answers, now, strict=True)) if not a.agrees(b)]
        if 2 * len(differ) <= len(PROMPTS):
            return None
        return (f"{len(differ)} of the {len(PROMPTS)} fixed greedy prompts are answered otherwise than when "
                f"{model} was warmed (first: {self.answers[differ[0]].text[:24]!r} then, "
                f"{now[differ[0]].text[:24]!r} now)")
