"""The agent's failures: a named reason (warmup_agent/failures.py) and a one-line message.

This module imports nothing of the agent, so any layer may raise these.
"""
from __future__ import annotations


class ReasonedError(Exception):
    """A failure with a named `reason` and a one-line `message` (also `str(e)`)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class EngineError(ReasonedError):
    """A failure of the model or engine."""


class AgentFailure(ReasonedError):
    """The warmup failed, or stopped (reason "draining")."""
