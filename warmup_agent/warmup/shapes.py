"""The torch and vllm engines' shape grid, each shape warmed by benefit.py's rules, with no time budget."""
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
    """Warm every shape in order; one Outcome per shape."""
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
