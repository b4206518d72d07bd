"""Text prompts of an exact token length (chat template included), for servers that take text only.

Decode/encode round trips can merge tokens at a boundary, so the length is searched
for, not assumed.  Needs only `tokenizers` and jinja2, not transformers: the chat template
is rendered by engines/chat_template.py, as transformers renders it.
"""
from __future__ import annotations

import os
from typing import Any

from warmup_agent.engines import chat_template


class ChatTemplateMissing(Exception):
    pass


class TextPrompts:
    """Prompts from a tokenizers.Tokenizer and an optional chat template (jinja2 source)."""

    def __init__(self, tokenizer: Any, template: str | None = None, special: dict | None = None, seed_text: str = "") -> None:
        self.tok = tokenizer
        self.special = special or {}
        self._template = chat_template.compile_template(template) if template else None
        self._ids = self.encode(seed_text * 8) or [0]

    @classmethod
    def from_model_dir(cls, model_dir: str, seed_text: str) -> "TextPrompts":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        return cls(tok, chat_template.read_source(model_dir), chat_template.special_tokens(model_dir), seed_text)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def render(self, messages: list[dict]) -> str:
        if self._template is None:
            raise ChatTemplateMissing("the model's tokenizer_config.json has no chat_template")
        return chat_template.render(self._template, messages, self.special)

    def count_chat(self, messages: list[dict]) -> int:
        """Prompt tokens of a chat request: the rendered template, tokenized."""
        return len(self.encode(self.render(messages)))

    def opening_tokens(self) -> int:
        """Tokens the template puts before the user's content (0 without a template)."""
        if self._template is None:
            return 0
        marker = "\u2063warmup-agent\u2063"
        rendered = self.render([{"role": "user", "content": marker}])
        if marker not in rendered:      # a template that rewrites the content: no opening known
            return 0
        return len(self.encode(rendered.split(marker)[0]))

    def count_text(self, text: str) -> int:
        return len(self.encode(text))

    def _content(self, k: int, variant: int) -> str:
        base = self._ids
        start = variant % len(base)
        ids: list[int] = []
        while len(ids) < k:
            ids.extend(base[start:])
            start = 0
        return self.tok.decode(ids[:k])

    def _fit(self, length: int, variant: int, measure: Any) -> tuple[str, int]:
        """Content text whose measured length is `length` (or the closest found)."""
        k = max(0, length - measure(""))
        best = ("", measure(""))
        seen = set()
        for _ in range(12):
            if k in seen:
                break
            seen.add(k)
            text = self._content(k, variant)
            n = measure(text)
            if abs(n - length) < abs(best[1] - length):
                best = (text, n)
            if n == length:
                break
            k = max(0, k + (length - n))
        return best

    def text(self, length: int, variant: int = 0) -> tuple[str, int]:
        """A completions prompt: (text, its token count)."""
        return self._fit(length, variant, self.count_text)

    def messages(self, length: int, variant: int = 0) -> tuple[list[dict], int]:
        """A one-message chat whose rendered prompt is `length` tokens: (messages, count)."""
        text, n = self._fit(length, variant, lambda t: self.count_chat([{"role": "user", "content": t}]))
        return [{"role": "user", "content": text}], n
