"""The output tokens of a streamed answer that carries no usage.

Most clients stream without `stream_options.include_usage`, so the proxy counts the
content chunks in a copy of the body as it relays it.  Servers stream one token a
chunk, and some send a token as a chunk with empty text, so chunks are counted, not
text.  Not counted: the opening role-only chunk, the closing finish_reason-only one,
usage and error events, and `[DONE]`.  A usage event, where one comes, wins (the last
one, where several do).

While the answer streams, the pieces are only kept (up to SETTLE_BYTES bytes; then
they are counted).  They are cut into events and read when the answer's tokens are
asked for, from the last event back, so an answer that ends with its usage reads that
one event instead of every chunk's, and one without reads each event once, as before.
"""
from __future__ import annotations

import json
from typing import Any

#: Bytes kept before they are cut and counted, so a long answer holds little (about 300
#: events of a chat stream: most answers are read once, at their end).
SETTLE_BYTES = 64 * 1024

# json.loads(bytes) without its wrappers, for the common payload (see _parse).
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _is_token(choice: object) -> bool:
    """Whether one streamed choice carries a token (see the module's docstring)."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        piece = delta.get("content")
        if piece is None:
            piece = delta.get("reasoning_content", delta.get("reasoning"))
        opening = "role" in delta
    else:
        piece, opening = choice.get("text"), False
    if not isinstance(piece, str):
        return False
    return bool(piece) or (not opening and choice.get("finish_reason") is None)


def _load(payload: bytes) -> Any:
    """json.loads(payload); raises ValueError where it would.  A payload that is one
    object (`{...}`, in UTF-8) goes straight to the decoder's scanner: json.loads would
    decode it as UTF-8 too (its second byte is not NUL), and text after the object's
    closing brace cannot be only whitespace, so a scan that stops short fails it."""
    if payload[:1] == b"{" and payload[-1:] == b"}" and payload[1] != 0:
        text = payload.decode("utf-8", "surrogatepass")
        try:
            obj, end = _SCAN(text, 0)
        except StopIteration:
            raise ValueError("not JSON") from None
        if end != len(text):
            raise ValueError("extra data")
        return obj
    return json.loads(payload)


def _parse(event: bytes) -> tuple[int, int | None] | None:
    """One event's (tokens, usage's completion_tokens or None); None for an event that
    is neither (no choices or usage, not JSON, not an object)."""
    if b'"choices"' not in event and b'"usage"' not in event:
        return None
    if event[:5] == b"data:" and b"\n" not in event:       # one line: the usual event
        payload = event[5:].lstrip(b" ")
    else:
        payload = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        obj = _load(payload)
        choices, usage = obj.get("choices"), obj.get("usage")
    except (ValueError, AttributeError, RecursionError):    # nested past the parser's depth: no event either
        return None
    tokens = 0
    if isinstance(choices, list):
        for choice in choices:
            if _is_token(choice):
                tokens += 1
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return tokens, usage["completion_tokens"]
    return tokens, None


class StreamTokens:
    """Counts the tokens of an SSE body fed in pieces, however they split."""

    __slots__ = ("_parts", "_held", "_buf", "_events", "_count", "_usage")

    def __init__(self) -> None:
        self._parts: list[bytes] = []      # fed, not yet cut into events
        self._held = 0                     # their bytes
        self._buf = b""                    # the start of an event not yet whole
        self._events: list[bytes] = []     # cut apart, not yet read
        self._count = 0
        self._usage: int | None = None

    def feed(self, data: bytes) -> None:
        self._parts.append(bytes(data))
        self._held += len(data)
        if self._held >= SETTLE_BYTES:
            self._settle()

    @property
    def tokens(self) -> int:
        """The last usage event's completion_tokens, else the counted chunks."""
        self._cut()
        events = self._events
        if events:
            read = []
            for event in reversed(events):          # the usage event comes last
                parsed = _parse(event)
                if parsed is not None:
                    if parsed[1] is not None:
                        return parsed[1]
                    read.append(parsed[0])
            self._events = []                        # none has usage: all are read, count them
            self._count += sum(read)
        return self._usage if self._usage is not None else self._count

    @property
    def count(self) -> int:
        """The token chunks counted, whatever the usage says."""
        self._settle()
        return self._count

    @property
    def usage(self) -> int | None:
        """The last usage event's completion_tokens, None without one."""
        self._settle()
        return self._usage

    def _cut(self) -> None:
        """Cut what was fed into events (split at blank lines; CRLF read as LF)."""
        parts, self._parts = self._parts, []
        if not parts:
            return
        self._held = 0
        buf = self._buf
        text = b"".join((buf, *parts)) if buf else b"".join(parts)
        if b"\r" not in text:
            # split() finds the blank lines left to right, as piece by piece would.
            events = text.split(b"\n\n")
            self._buf = events.pop()
            self._events += events
            return
        out = self._events
        for data in parts:                            # piece by piece: where a CR and its LF split matters
            buf = buf + data if buf else data
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n")   # a CR split from its LF is joined at the next piece
            start = 0
            while (end := buf.find(b"\n\n", start)) >= 0:
                out.append(buf[start:end])
                start = end + 2
            buf = buf[start:] if start else buf
        self._buf = buf

    def _settle(self) -> None:
        """Cut and read everything fed, in order."""
        self._cut()
        events, self._events = self._events, []
        for event in events:
            parsed = _parse(event)
            if parsed is not None:
                self._count += parsed[0]
                if parsed[1] is not None:
                    self._usage = parsed[1]
