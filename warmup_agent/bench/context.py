"""The context the bench's built-in prompts fit: --max-context where given, else what
the server gives each of the burst's requests at once (server/context.py), read from
its command line (server/kinds.py) or, where that does not say, from the server
itself, started alone once before the measured starts (its /props and /v1/models).
Never more than DEFAULT_TOKENS: the built-in mix is a chat service's spread of
lengths, not the longest prompt a server takes."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from warmup_agent.bench import client, process
from warmup_agent.bench.start import Setup
from warmup_agent.server.context import ServerContext, from_command, of_server

#: The built-in mix's scale where the server gives more, and where nothing says what it gives.
DEFAULT_TOKENS = 2048
LOOK_LOG = "context-look.log"


@dataclass
class PromptContext:
    """`tokens` each built-in prompt and its answer fit; `source` says where they come from."""
    tokens: int
    source: str
    server: dict[str, Any] | None = None     # what the server's context was read as

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "source": self.source, "server": self.server}


def resolve(override: int | None, setup: Setup, at_once: int,
            note: Callable[[str], None] = lambda line: None, needed: bool = True) -> PromptContext:
    """--max-context (`override`), else the server's context for `at_once` requests at
    once (its command line, else one start of it alone, announced through `note`), at
    most DEFAULT_TOKENS.  Not `needed` (the prompts come from a requests file): not read."""
    if override:
        return PromptContext(override, "--max-context")
    if not needed:
        return PromptContext(DEFAULT_TOKENS, "not used: the requests file's prompts are sent as they are")
    said = from_command(setup.command)
    if said is None:
        note("the server's command line does not say its context: reading it from the server, started alone once")
        said = look(setup)
    room = said.each(max(1, at_once)) if said is not None else None
    if said is None or room is None:
        return PromptContext(DEFAULT_TOKENS, "default: the server did not say its context")
    return PromptContext(min(DEFAULT_TOKENS, room), f"read from {said.source}, {max(1, at_once)} request(s) at once",
                         said.as_dict())


def _json(text: str | None) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def look(setup: Setup) -> ServerContext | None:
    """Start the server alone, read its context where it says it, stop it; None: it
    did not get healthy or says nothing.  Its output goes to LOGS/context-look.log."""
    port = setup.port if setup.port is not None else process.free_port()
    command = setup.server_command(port)
    base = f"http://[{setup.host}]:{port}" if ":" in setup.host else f"http://{setup.host}:{port}"
    s = process.spawn(command, os.path.join(setup.logs, LOOK_LOG), env=setup.env)
    try:
        deadline = s.t0 + setup.ready_timeout
        while client.get_status(base + setup.health_path) != 200:
            if s.exited() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        props = _json(client.get_text(base + "/props"))
        models = _json(client.get_text(base + "/v1/models"))
        data = models.get("data") if isinstance(models, dict) else None
        entries = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        entry = next((m for m in entries if m.get("id") == setup.model), entries[0] if entries else None)
        return of_server(props if isinstance(props, dict) else None, entry, command)
    except BaseException:
        process.kill_now(s)
        raise
    finally:
        if s.exited() is None:
            process.stop(s, setup.stop_timeout)
