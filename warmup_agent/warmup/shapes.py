"""The in-process engines' shape grid, warmed by measured benefit (issue 25).

The torch and vllm engines are warmed over a grid of (prompt length, batch size)
shapes (warmup_agent/warmup/traffic.py `grid`).  Each shape is a benefit.Path (endpoint
"generate", family "greedy") and is sent until it is warm by the rules of
warmup_agent/warmup/benefit.py, and no longer: a shape whose first call already matches
the steady level that earlier shapes measured gets no second call; a shape still
getting faster gets another, up to `max_calls`.  The first shape has no steady
level to match, so it gets at least two calls (the second tells whether the first
was cold).  There is no time budget: the grid is the configured one.

Nothing here talks to an engine: `send(shape) -> Call` is given by the caller
(stages/prewarm.py), so the rules are unit-tested on their own.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from warmup_agent.warmup import benefit
from warmup_agent.warmup.benefit import Call, Outcome, Path
from warmup_agent.warmup.traffic import Shape

ENDPOINT, FAMILY = "generate", "greedy"


class Dropped(Exception):
    """Raised by `send` when a shape cannot be sent (its batch size ran out of memory)."""


def path_of(shape: Shape) -> Path:
    return Path(ENDPOINT, FAMILY, shape.batch, shape.prompt_tokens)


def warm_grid(shapes: Sequence[Shape], send: Callable[[Shape], Call], tol: float, max_calls: int) -> list[Outcome]:
    """Warm every shape, in the given order, until it is warm; one Outcome per shape."""
    steady = benefit.SteadyLevels()
    budget = benefit.Budget(0.0, "none: every shape of the configured grid is warmed")
    outcomes: list[Outcome] = []
    for shape in shapes:
        path = path_of(shape)

        def send_path(_path: Path, shape: Shape = shape) -> Call:
            return send(shape)
        try:
            outcomes.append(benefit.warm_path(path, send_path, steady, budget, tol, max(1, max_calls)))
        except Dropped as e:
            outcomes.append(Outcome(path, "skipped", str(e)))
    return outcomes


def summary(outcomes: Sequence[Outcome]) -> dict:
    """For the run record: how many shapes ended how, and the calls sent."""
    return {"paths": dict(Counter(o.result for o in outcomes)), "calls": sum(len(o.calls) for o in outcomes)}
