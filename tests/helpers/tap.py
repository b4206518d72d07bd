"""A TCP tap between the bench and a real server: an independent observer of the
very requests the bench sends, for the bench tests' first-TTFT check.

  python -m tests.helpers.tap --port PORT --log FILE -- SERVER COMMAND ... {inner} ...

It starts the server on a free inner port (`{inner}` in its command), listens on
PORT and forwards every connection both ways.  For each chat request it appends one
JSON line to FILE: when the request's first byte came in, when the first streamed
token went back out and when the answer ended, read from the server's bytes with
its own HTTP and SSE parsing (none of the bench's code).  SIGTERM stops the server,
then the tap.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time


class Answer:
    """Parses the server's side of one connection as it goes by: status line and
    headers, the chunked framing if any, then SSE lines; `first` is the monotonic
    time of the first token event (or of an end before any token)."""

    def __init__(self) -> None:
        self.head = b""
        self.chunked: bool | None = None
        self.raw = b""          # body bytes still framed
        self.body = b""         # de-framed body, up to the last whole line
        self.first: float | None = None

    def feed(self, data: bytes, now: float) -> None:
        if self.chunked is None:
            self.head += data
            if b"\r\n\r\n" not in self.head:
                return
            head, data = self.head.split(b"\r\n\r\n", 1)
            self.chunked = b"transfer-encoding: chunked" in head.lower()
        if self.chunked:
            self.raw += data
            while True:
                size_end = self.raw.find(b"\r\n")
                if size_end < 0:
                    break
                size = int(self.raw[:size_end].split(b";")[0] or b"0", 16)
                if len(self.raw) < size_end + 2 + size + 2:
                    break
                self.body += self.raw[size_end + 2:size_end + 2 + size]
                self.raw = self.raw[size_end + 2 + size + 2:]
        else:
            self.body += data
        *lines, self.body = self.body.split(b"\n")
        for line in lines:
            self._line(line.strip(), now)

    def _line(self, line: bytes, now: float) -> None:
        if self.first is not None or not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            return
        try:
            event = json.loads(line[5:])
        except ValueError:
            return
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if isinstance(text, str) and ("role" not in delta or delta["role"] is None or text):
                self.first = now
            elif choice.get("finish_reason"):
                self.first = now


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: Answer | None) -> None:
    try:
        while data := await reader.read(65536):
            if answer is not None:
                answer.feed(data, time.monotonic())
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass


async def _serve(port: int, inner: int, log_path: str) -> None:
    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        first = await c_reader.read(65536)
        t_request = time.monotonic()
        try:
            s_reader, s_writer = await asyncio.open_connection("127.0.0.1", inner)
        except OSError:           # the server is not listening yet: as a refused connection
            c_writer.close()
            return
        chat = first.startswith(b"POST /v1/chat/completions")
        answer = Answer() if chat else None
        s_writer.write(first)
        await asyncio.gather(_pipe(c_reader, s_writer, None), _pipe(s_reader, c_writer, answer))
        if answer is not None:
            with open(log_path, "a") as f:
                f.write(json.dumps({"tap_pid": os.getpid(), "t_request": t_request, "t_first": answer.first,
                                    "t_end": time.monotonic()}) + "\n")

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        inner = s.getsockname()[1]
    command = a.command[1:] if a.command[:1] == ["--"] else a.command    # only the separator, not a "--" of the server's
    cmd = [w.replace("{inner}", str(inner)) for w in command]
    server = subprocess.Popen(cmd)        # in the tap's process group, so the bench's group checks see it

    def stop(signum: int, frame: object) -> None:
        server.terminate()
        sys.exit(server.wait())

    signal.signal(signal.SIGTERM, stop)
    try:      # its timestamps taken as the bytes pass, not after the server's busy threads
        os.nice(-10)
    except OSError:
        pass
    loop = asyncio.new_event_loop()
    task = loop.create_task(_serve(a.port, inner, a.log))
    loop.run_until_complete(asyncio.wait([task, loop.run_in_executor(None, server.wait)],
                                         return_when=asyncio.FIRST_COMPLETED))
    return server.wait()


if __name__ == "__main__":
    sys.exit(main())
