"""The ground floor of the agent's failures: a named reason and one line.

Everything that fails a warmup for a reason a person can act on says two things:
`reason`, a name from warmup_agent/failures.py (the label of
`model_loading_failures_total{reason}` and the run record's `failure_reason`),
and `message`, one line for the user (never a traceback).  `ReasonedError` is
that shape; the concrete errors derive from it.

This module imports nothing of the agent, so any layer may raise these: the GPU
helpers (gpu/loader.py, gpu/deadline.py), the server supervisor, the model
directory checks and the engines all import from here, not from the engines.
"""
from __future__ import annotations


class ReasonedError(Exception):
    """A failure with a named `reason` and a one-line `message` (also `str(e)`)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class EngineError(ReasonedError):
    """A failure of the model or engine with a named reason (goes into
    model_loading_failures_total{reason}).  `message` is one line for the user.
    Also importable from warmup_agent.engines.base and warmup_agent.engines."""


class AgentFailure(ReasonedError):
    """The warmup failed (or stopped: reason "draining") with a named reason; the
    state machine is FAILED or DRAINING.  Raised by the stages through
    StageContext.fail/checkpoint/move; also importable from warmup_agent.pipeline."""
