"""Text prompts of an exact token length (chat template included), for servers that take text only.

Decode/encode round trips can merge tokens at a boundary, so the length is searched
for, not assumed.  Needs only `tokenizers` and jinja2, not transformers.
"""
from __future__ import annotations

import json
import os
from typing import Any


class ChatTemplateMissing(Exception):
    pass


class TextPrompts:
    """Prompts from a tokenizers.Tokenizer and an optional chat template (jinja2 source)."""

    def __init__(self, tokenizer: Any, template: str | None = None, special: dict | None = None, seed_text: str = "") -> None:
        self.tok = tokenizer
        self.special = special or {}
        self._template = None
        if template:
            import jinja2
            import jinja2.sandbox
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)

            def raise_exception(message: Any) -> None:
                raise jinja2.exceptions.TemplateError(message)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(template)
        self._ids = self.encode(seed_text * 8) or [0]

    @classmethod
    def from_model_dir(cls, model_dir: str, seed_text: str) -> "TextPrompts":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        cfg: dict = {}
        try:
            with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            pass
        template = cfg.get("chat_template")
        if isinstance(template, list):      # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and os.path.exists(os.path.join(model_dir, "chat_template.jinja")):
            with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
                template = f.read()
        special = {k: (v if isinstance(v, str) else (v or {}).get("content", "")) for k, v in cfg.items()
                   if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(tok, template, special, seed_text)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def render(self, messages: list[dict]) -> str:
        if self._template is None:
            raise ChatTemplateMissing("the model's tokenizer_config.json has no chat_template")
        return self._template.render(messages=messages, add_generation_prompt=True, **self.special)

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
