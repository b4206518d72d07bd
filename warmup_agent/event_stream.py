"""The JSON events of an OpenAI-style event stream, read one way for every stream the
agent reads.  It imports nothing above errors.py, so any layer may use it."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from warmup_agent.errors import EngineError


class EventStream:
    """The `data: {...}` events of `lines` up to `data: [DONE]`; `done` says whether
    it came.  An error event, what servers send when a request fails mid-stream,
    raises EngineError; a data line that is not JSON raises ValueError."""

    def __init__(self, lines: Iterable[bytes], where: str):
        self.lines, self.where, self.done = lines, where, False

    def __iter__(self) -> Iterator[dict]:
        for raw in self.lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return
            msg = json.loads(data)
            if msg.get("error"):
                raise EngineError("request_failed", f"{self.where}: {str(msg['error'])[:300]}")
            yield msg
