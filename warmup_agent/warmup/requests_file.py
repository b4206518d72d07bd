"""Checking `prewarm.requests_file` (JSON Lines of OpenAI request bodies) with the config.

Checked before any server loads a model, so a bad line of a gateway log is reported as file,
line and field, not as an HTTP 500 later.  Structure and types only: no tokenizer here.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: How many bad lines a FileCheck keeps and a message lists.
KEEP_BAD = 100
SHOW_BAD = 5

_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "function")
_ROLES = frozenset(_CHAT_ROLES)
_MAX_SHOWN = 40   # characters of a bad value quoted in a message (a line may be 10 MB)


def _show(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "..."


def _problem(name: str, value: Any, expected: str) -> str:
    return f"field '{name}': got {_show(value)}; expected {expected}"


def _is_int(v: Any) -> bool:
    return type(v) is int                 # not bool: true is no count


def _in(lo: float, hi: float) -> Any:
    """A number from lo to hi (not a bool, not NaN)."""
    return lambda v: (type(v) is float or type(v) is int) and lo <= v <= hi


def _int_from(lo: int) -> Any:
    return lambda v: type(v) is int and v >= lo


_INF = float("inf")

# field -> (check, expected).  null is accepted for each (the API's "not set").
_SAMPLING: dict[str, tuple[Any, str]] = {
    "temperature": (_in(0, 2), "a number from 0 to 2"),
    "top_p": (_in(0, 1), "a number from 0 to 1"),
    "top_k": (_int_from(-1), "an integer > 0 (-1 or 0: no top-k)"),
    "min_p": (_in(0, 1), "a number from 0 to 1"),
    "n": (_int_from(1), "an integer > 0"),
    "best_of": (_int_from(1), "an integer > 0"),
    "max_tokens": (_int_from(1), "an integer > 0"),
    "max_completion_tokens": (_int_from(1), "an integer > 0"),
    "presence_penalty": (_in(-2, 2), "a number from -2 to 2"),
    "frequency_penalty": (_in(-2, 2), "a number from -2 to 2"),
    "repetition_penalty": (lambda v: (type(v) is float or type(v) is int) and 0 < v < _INF, "a number > 0"),
    "stop": (lambda v: type(v) is str or (type(v) is list and all(type(s) is str for s in v)),
             "a string or a list of strings"),
    "top_logprobs": (_int_from(0), "an integer >= 0"),
    "seed": (_is_int, "an integer"),
    "stream": (lambda v: type(v) is bool, "true or false"),
    "model": (lambda v: type(v) is str, "a string"),
    "response_format": (lambda v: type(v) is dict and type(v.get("type")) is str,
                        "an object with a string 'type' (text, json_object or json_schema)"),
}
_CHAT_LOGPROBS = (lambda v: type(v) is bool, "true or false")
_COMPLETIONS_LOGPROBS = (lambda v: type(v) is bool or (type(v) is int and v >= 0), "an integer >= 0")
_CHAT_RULES = {**_SAMPLING, "logprobs": _CHAT_LOGPROBS}
_COMPLETIONS_RULES = {**_SAMPLING, "logprobs": _COMPLETIONS_LOGPROBS}


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return _problem("messages", messages, "a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for j, m in enumerate(messages):   # the common case first and cheap: a file may hold a million lines
        if type(m) is dict and m.get("role") in _ROLES and type(m.get("content")) is str:
            continue
        problem = _check_message(m)
        if problem:
            return f"field 'messages[{j}]{problem}"
    return None


def _check_message(m: Any) -> str | None:
    """The problem of one message, from the field name on."""
    if not isinstance(m, dict):
        return "': got " + _show(m) + "; expected an object with role and content"
    role = m.get("role")
    if role not in _ROLES:
        if "role" not in m:
            return f".role': missing; expected one of {', '.join(_CHAT_ROLES)}"
        return f".role': got {_show(role)}; expected one of {', '.join(_CHAT_ROLES)}"
    if "content" not in m:
        if role == "assistant" and ("tool_calls" in m or "function_call" in m):
            return None
        return ".content': missing; expected a string or a list of content parts"
    content = m["content"]
    if isinstance(content, str) or (content is None and role == "assistant"):
        return None
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
        return None
    return (f".content': got {_show(content)}; expected a string or a list of content parts "
            "({\"type\": \"text\", \"text\": ...})")


def _check_prompt(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_int(t) and t >= 0 for t in prompt):
            return None
        if all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt):
            return None
    return _problem("prompt", prompt, "a string, a list of strings, or a non-empty list of token ids")


def check_body(body: Any) -> list[str]:
    """The problems of one request body, each naming its field and what was expected."""
    if not isinstance(body, dict):
        kind = {list: "a JSON list", str: "a JSON string", bool: "a JSON boolean", type(None): "null"}.get(
            type(body), "a JSON number")
        return [f"got {kind}; expected a JSON object (one OpenAI request body)"]
    has_messages, has_prompt = "messages" in body, "prompt" in body
    if has_messages and has_prompt:
        return ["fields 'messages' and 'prompt' both set; expected one: messages (/v1/chat/completions) "
                "or prompt (/v1/completions)"]
    if not has_messages and not has_prompt:
        return ["no field 'messages' or 'prompt'; expected a /v1/chat/completions body (messages) "
                "or a /v1/completions body (prompt)"]
    problems: list[str] = []
    p = _check_messages(body["messages"]) if has_messages else _check_prompt(body["prompt"])
    if p:
        problems.append(p)
    # Unknown fields are left to the server; known ones are checked in the body's order.
    rules = _CHAT_RULES if has_messages else _COMPLETIONS_RULES
    for name, value in body.items():
        rule = rules.get(name)
        if rule is not None and value is not None and not rule[0](value):
            problems.append(_problem(name, value, rule[1]))
    if has_prompt and "max_completion_tokens" in body:
        problems.append("field 'max_completion_tokens': a /v1/chat/completions field; expected max_tokens "
                        "in a /v1/completions body (prompt)")
    return problems


_raw_decode = json.JSONDecoder().raw_decode


def _parse(text: str) -> Any:
    """json.loads(text), faster on one body per line: no whitespace regex unless the line needs it."""
    if text[:1] in (" ", "\t", "\ufeff"):          # a byte-order mark some editors write
        return json.loads(text.lstrip(" \t\ufeff"))
    body, end = _raw_decode(text)
    if text[end:].strip():
        raise json.JSONDecodeError("Extra data", text, end)
    return body


def _line_problem(raw: bytes, last: bool) -> tuple[Any, str | None]:
    """(body, None) for a good line, (None, reason) for a bad one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, (f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                      "expected one UTF-8 JSON request body per line")
    try:
        body = _parse(text)
    except json.JSONDecodeError as e:
        where = f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"
        if last and not raw.endswith(b"\n"):
            return None, (f"truncated last line (no newline at the end; {where}); "
                          "expected one complete JSON request body per line")
        return None, f"not JSON ({where}); expected one OpenAI request body per line"
    except RecursionError:
        return None, "not JSON (nested too deeply); expected one OpenAI request body per line"
    problems = check_body(body)
    if problems:
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        return None, problems[0] + more
    return body, None


def scan(path: str) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, body, problem) for each non-blank line, streamed; OSError if unreadable."""
    with open(path, "rb") as f:
        prev, n = b"", 0
        for i, raw in enumerate(f, 1):
            if prev:
                yield (n, *_line_problem(prev, False))
            prev, n = (raw, i) if raw.strip() else (b"", 0)
        if prev:
            yield (n, *_line_problem(prev, True))


@dataclass
class FileCheck:
    """What check_file found.  `bad` keeps the first KEEP_BAD bad lines."""
    path: str
    good: list[tuple[int, dict]] = field(default_factory=list)   # (line number, body); empty unless keep_good
    good_count: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)     # (line number, reason)
    bad_count: int = 0
    endpoints: set[str] = field(default_factory=set)              # of the good lines: "chat", "completions"

    def bad_lines(self) -> dict:
        """The count and the first line numbers."""
        return {"count": self.bad_count, "first_lines": [n for n, _ in self.bad[:SHOW_BAD]]}

    def first_lines_text(self) -> str:
        shown = ", ".join(str(n) for n, _ in self.bad[:SHOW_BAD])
        return shown + (", ..." if self.bad_count > SHOW_BAD else "")

    def error(self) -> str | None:
        """The error for policy fail: the first bad line, or a file with no request; None if good."""
        if self.bad_count:
            line, reason = self.bad[0]
            more = (f" ({self.bad_count} bad lines in all, at lines {self.first_lines_text()})"
                    if self.bad_count > 1 else "")
            return f"{self.path}:{line}: {reason}{more}"
        if not self.good_count:
            return f"{self.path}: no requests; expected one OpenAI request body per line"
        return None

    def skip_error(self) -> str | None:
        """The one line for policy skip: only a file without one good line fails."""
        if self.good_count:
            return None
        if not self.bad_count:
            return self.error()
        return (f"{self.path}: no good requests: all {self.bad_count} lines are bad "
                f"(lines {self.first_lines_text()}); first: {self.path}:{self.bad[0][0]}: {self.bad[0][1]}")

    def skip_warning(self) -> str | None:
        """The one warning line for policy skip; None when no line was skipped."""
        if not self.bad_count:
            return None
        line, reason = self.bad[0]
        total = self.good_count + self.bad_count
        return (f"key 'prewarm.requests_file': {self.path}: skipped {self.bad_count} bad "
                f"line{'s' if self.bad_count > 1 else ''} of {total} (lines {self.first_lines_text()}); "
                f"first: {self.path}:{line}: {reason}")


def check_file(path: str, keep_good: bool = True) -> FileCheck:
    """Check every line of a requests file (keep_good=False only counts the good ones); OSError if unreadable."""
    out = FileCheck(path)
    for i, body, problem in scan(path):
        if problem is None:
            out.good_count += 1
            out.endpoints.add("chat" if "messages" in body else "completions")
            if keep_good:
                out.good.append((i, body))
        else:
            out.bad_count += 1
            if len(out.bad) < KEEP_BAD:
                out.bad.append((i, problem))
    return out


def read_error(path: str, e: OSError) -> str:
    """The one line for a file that cannot be read."""
    return f"{path}: cannot read the requests file: {e.strerror or e}"
