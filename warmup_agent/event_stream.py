"""The JSON events of an OpenAI-style event stream (server-sent events), read one way
for every stream the agent reads: its warmup requests and probes
(engines/openai/client.py) and the users'-path request before SERVING
(proxy/user_path.py).  On the ground floor of the layers, so both may import it."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from warmup_agent.errors import EngineError


class EventStream:
    """The JSON events of an OpenAI-style event stream (`data: {...}` lines), read
    from `lines` up to `data: [DONE]`; `done` says whether [DONE] came.  An error
    event (`{"error": ...}`, what vLLM and llama-server send when a request fails
    mid-stream) raises EngineError("request_failed") with `where` in its message; a
    data line that is not JSON raises ValueError.  The one reader of the agent's
    streams: its warmup requests and probes (StreamingClient) and the users'-path
    request before SERVING (proxy/user_path.py)."""

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
