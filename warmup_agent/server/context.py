"""The context a server gives each concurrent request: how many tokens, prompt and
answer together, each of n requests sent at once may hold.

Read from the server where it says: llama.cpp's `GET /props` (its slot's context,
`default_generation_settings.n_ctx`, and `total_slots`) and `GET /v1/models` (vLLM's
`max_model_len`, llama.cpp's `meta.n_ctx`); else from its command line through the
server kinds' table (server/kinds.py: llama-server `-c`/`--ctx-size` and
`-np`/`--parallel`, vLLM `--max-model-len`).

llama-server's `-c` is one KV pool that its slots share: with the automatic slot
count (the default: 4 slots, one unified pool) each slot may hold all of it, but
requests running at once hold it together, and when it is full every running
request fails ("Context size has been exceeded").  vLLM gives each request
`max_model_len` and queues what its KV cache cannot hold at once.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from warmup_agent.server.command import option
from warmup_agent.server.kinds import ServerKind, kind_of_command

#: Tokens each request keeps spare: the server's tokenizer and chat template may count a
#: prompt a token or two longer than the agent's copy of them does.
SPARE = 4
SERVER, COMMAND_LINE, BOTH = "the server", "its command line", "the server and its command line"


@dataclass(frozen=True)
class ServerContext:
    """`per_request`: the most tokens one request may hold (llama.cpp's slot context,
    vLLM's max_model_len); `shared`: the tokens all requests running at once hold
    together (llama.cpp's -c); None: no such limit known.  `source` says where they
    were read: SERVER, COMMAND_LINE or BOTH."""
    per_request: int | None
    shared: int | None = None
    source: str = "the server"

    def each(self, n: int) -> int | None:
        """Tokens (prompt + answer) each of `n` requests sent at once may hold, SPARE
        kept aside; None: unknown."""
        limits = [x for x in (self.per_request, self.shared // max(1, n) if self.shared else None) if x]
        return max(0, min(limits) - SPARE) if limits else None

    def fits(self, sizes: Iterable[int]) -> bool:
        """Whether requests of these sizes (prompt + answer tokens each), sent at once,
        all fit with SPARE tokens each."""
        sizes = [s + SPARE for s in sizes]
        if self.per_request and any(s > self.per_request for s in sizes):
            return False
        return not (self.shared and sum(sizes) > self.shared)

    def prompt_for(self, n: int, prompt: int, answer: int) -> int | None:
        """The longest prompt, at most `prompt` tokens, that each of `n` requests sent at
        once with `answer` output tokens may have; None: not even one token fits."""
        room = self.each(n)
        if room is None:
            return prompt
        longest = min(prompt, room - answer)
        return longest if longest >= 1 else None

    def as_dict(self) -> dict:
        return {"per_request_tokens": self.per_request, "shared_tokens": self.shared, "source": self.source}


def _tokens(text: str | None) -> int | None:
    """A token count as a server's option takes it ("2048"; vLLM also "2k" = 2000 and
    "2K" = 2048); None where it is not a positive count (llama.cpp's 0: the model's own)."""
    if not text:
        return None
    text = text.strip()
    scale = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        return None
    return value if value > 0 else None


def _first(command: list[str], flags: tuple[str, ...]) -> str | None:
    for flag in flags:
        value = option(command, flag)
        if value is not None:
            return value
    return None


def from_command(command: list[str] | None, kind: ServerKind | None = None) -> ServerContext | None:
    """What the command line says, through its kind's `context_flags`; None: nothing.
    A shared context split among slots given on the command line (llama-server -np N:
    a pool of its own per slot, unless --kv-unified) gives each request its share."""
    if not command:
        return None
    kind = kind or kind_of_command(command)
    if kind is None or not kind.context_flags:
        return None
    total = _tokens(_first(command, kind.context_flags))
    if total is None:
        return None
    if not kind.context_shared:
        return ServerContext(total, None, COMMAND_LINE)
    slots = _tokens(_first(command, kind.slots_flags)) if kind.slots_flags else None
    return ServerContext(total // slots if slots else total, total, COMMAND_LINE)


def from_props(props: Mapping | None) -> tuple[int | None, int | None]:
    """llama.cpp's `GET /props`: (its slot's context, its slots); None where not said."""
    if not isinstance(props, Mapping):
        return None, None
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, Mapping) else None
    n_ctx = n_ctx if n_ctx is not None else props.get("n_ctx")
    slots = props.get("total_slots")
    return (n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None,
            slots if isinstance(slots, int) and slots > 0 else None)


def from_model_entry(entry: Mapping | None) -> int | None:
    """The served model's entry in `GET /v1/models`: vLLM's (and SGLang's) `max_model_len`,
    llama.cpp's `meta.n_ctx`; None where not said."""
    if not isinstance(entry, Mapping):
        return None
    meta = entry.get("meta")
    for value in (entry.get("max_model_len"), meta.get("n_ctx") if isinstance(meta, Mapping) else None):
        if isinstance(value, int) and value > 0:
            return value
    return None


def of_server(props: Mapping | None, model_entry: Mapping | None, command: list[str] | None,
              kind: ServerKind | None = None) -> ServerContext | None:
    """The server's own word (`props`: its GET /props, `model_entry`: its model in GET
    /v1/models), completed by its command line; None: neither says.

    The slot's context is the most one request may hold.  Slots that share one pool
    hold the command line's -c together; where the command line does not say, the
    slot's context is taken as the pool (so it is with the automatic slot count; with
    a pool per slot that asks less than it could, never more)."""
    said = from_command(command, kind)
    slot_ctx, slots = from_props(props)
    per_request = slot_ctx or from_model_entry(model_entry)
    if per_request is None:
        return said
    shared = None
    if slots is not None and slots > 1:
        shared = said.shared if said is not None and said.shared else per_request
    elif said is not None:
        shared = said.shared
    source = BOTH if said is not None and shared is not None and shared == said.shared else SERVER
    return ServerContext(per_request, shared, source)
