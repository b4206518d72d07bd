"""The whole answer a first user meets on a server that pays per decode length.

Such a server pays extra on each decode step at a sequence length no earlier request
reached.  The first probe meets all such steps of its answer and warms them, so the
user after it meets fewer, and the probe's own whole-answer tax overstates the user's.
Where prewarm found that decode pays per length, the tax is predicted instead:

  step cost  (first probe's extra decode time over steady) / its unreached steps
  unreached  per profile prompt length, the steps of an answer as long as the first
             probe's that neither the warmup nor the probes reached; their mean
  tax        (steady whole answer + extra time to first token
              + step cost x mean unreached) / steady whole answer

The mean over the profile, because a user's first request lands where the traffic
does.  A `prompt`-token prompt answered with `tokens` tokens decodes at sequence
lengths prompt + 1 .. prompt + tokens - 1; the first token comes from the prefill.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from warmup_agent.readiness.probes import FirstRequest

Ranges = Sequence[tuple[int, int]]      # (prompt tokens, prompt tokens + output tokens) per request


def steps(prompt: int, tokens: int) -> range:
    """The sequence lengths an answer's decode steps attend over."""
    return range(prompt + 1, prompt + tokens)


def reached(ranges: Iterable[tuple[int, int]]) -> set[int]:
    """Every sequence length some decode step of `ranges` attended over."""
    seen: set[int] = set()
    for prompt, end in ranges:
        seen.update(steps(prompt, end - prompt))
    return seen


def unreached(prompt: int, tokens: int, seen: set[int]) -> int:
    """How many of an answer's decode steps fall at lengths nothing reached."""
    return sum(1 for n in steps(prompt, tokens) if n not in seen)


def first_answer(fr: FirstRequest, probe_prompt: int, warmup: Ranges, probes: Ranges,
                 lengths: Sequence[int]) -> dict | None:
    """The predicted whole-answer tax and its parts; None where the probe's own figure
    stands (no steady level, nothing unreached, or no decode slower than steady)."""
    measured = fr.measured_total_tax
    if measured is None or fr.steady_total_seconds is None or fr.steady_ttft_seconds is None \
            or fr.output_tokens < 2 or not lengths:
        return None
    before = reached(warmup)
    probe_steps = unreached(probe_prompt, fr.output_tokens, before)
    steady_decode = fr.steady_total_seconds - fr.steady_ttft_seconds
    extra_decode = (fr.total_seconds - fr.ttft_seconds) - steady_decode
    if probe_steps == 0 or extra_decode <= 0:
        return None
    step_cost = extra_decode / probe_steps
    seen = before | reached(probes)
    per_length = {n: unreached(n, fr.output_tokens, seen) for n in sorted(set(lengths))}
    mean_steps = sum(per_length.values()) / len(per_length)
    worst = max(per_length, key=lambda n: per_length[n])
    extra_first_token = max(0.0, fr.ttft_seconds - fr.steady_ttft_seconds)
    total = fr.steady_total_seconds + extra_first_token + step_cost * mean_steps
    return {"total_tax": total / fr.steady_total_seconds, "probe_total_tax": measured,
            "step_cost_ms": round(step_cost * 1e3, 3), "probe_unreached_steps": probe_steps,
            "answer_tokens": fr.output_tokens, "unreached_steps": per_length,
            "mean_unreached_steps": round(mean_steps, 2),
            "worst_prompt_tokens": worst, "worst_unreached_steps": per_length[worst]}
