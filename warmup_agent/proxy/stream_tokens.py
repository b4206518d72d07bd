"""The output tokens of a streamed answer that carries no usage.

Most clients stream without `stream_options.include_usage`, so the proxy counts the
content chunks in a copy of the body as it relays it.  Servers stream one token a
chunk, and some send a token as a chunk with empty text, so chunks are counted, not
text.  Not counted: the opening role-only chunk, the closing finish_reason-only one,
usage and error events, and `[DONE]`.  A usage event, where one comes, wins.
"""
from __future__ import annotations

import json


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


class StreamTokens:
    """Counts the tokens of an SSE body fed in pieces, however they split."""

    __slots__ = ("_buf", "count", "usage")

    def __init__(self) -> None:
        self._buf = b""
        self.count = 0
        self.usage: int | None = None

    @property
    def tokens(self) -> int:
        return self.usage if self.usage is not None else self.count

    def feed(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else bytes(data)
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")   # a CR split from its LF is joined at the next feed
        start = 0
        while (end := buf.find(b"\n\n", start)) >= 0:
            self._event(buf[start:end])
            start = end + 2
        self._buf = buf[start:]

    def _event(self, event: bytes) -> None:
        if b'"choices"' not in event and b'"usage"' not in event:
            return
        payload = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
        try:
            obj = json.loads(payload)
            choices, usage = obj.get("choices"), obj.get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(choices, list):
            self.count += sum(1 for c in choices if _is_token(c))
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage = usage["completion_tokens"]
