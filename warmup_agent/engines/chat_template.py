"""A model's chat template, read, compiled and rendered as transformers does (issue 73).

The one renderer of both engines: the openai engine sizes its warmup prompts with it
(engines/text_prompts.py) and the torch engine serves users' chat requests with it
(engines/torch/serving.py), so the prompt warmed is the prompt served.

A small copy of transformers' own setup (transformers/utils/chat_template_utils.py,
`_compile_jinja_template` and `render_jinja_template`), not a call to it: the openai
engine must work in a plain `pip install .` without transformers
(tests/test_minimal_install.py).  What a template sees is the same: jinja2's immutable
sandbox with trim_blocks, lstrip_blocks and loop controls; `tojson` that keeps `<` and
non-ASCII text as they are (jinja2's own escapes them for HTML) and takes json.dumps'
indent, separators and sort_keys; the globals `raise_exception`, `strftime_now` and the
guarded `dict` and `namespace`; the `{% generation %}` block (rendered as its body);
messages without their None-valued keys; and `messages`, `tools`, `documents`,
`add_generation_prompt` and the tokenizer's special tokens as variables.  Checked
against transformers 5.25; transformers requires jinja2>=3.1.6 (sandbox escapes before).
tests/test_chat_template.py compares it with transformers' apply_chat_template.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

#: The tokenizer's special tokens that transformers passes to a template (its special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateRefused(Exception):
    """The template called raise_exception(message): it refuses these messages."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: Any) -> None:
    raise TemplateRefused(str(message))


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _generation_extension() -> Any:
    """transformers' AssistantTracker, without the tracking: `{% generation %}x{% endgeneration %}` renders x."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return Generation


def _safe_globals() -> dict[str, Any]:
    """transformers' `dict` and `namespace`: a template can build dicts and namespaces but
    not reach their internals (a namespace refuses underscore-prefixed names)."""
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2 Namespace's signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                                    f"but got {name!r}. Please rename the attribute.")

    return {"dict": TemplateDict(), "namespace": TemplateNamespace}


def compile_template(source: str) -> Any:
    """The template compiled as transformers compiles it (a jinja2.Template).

    Raises jinja2.TemplateError when the source does not compile."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals.update(_safe_globals())
    return env.from_string(source)


#: Names a message's reasoning comes under; templates read the first (transformers' _REASONING_FIELDS).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _message(message: dict) -> dict:
    """transformers' normalization: keys whose value is None dropped, reasoning under each of its names."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render(template: Any, messages: list[dict], special: dict[str, Any] | None = None,
           add_generation_prompt: bool = True) -> str:
    """The prompt text, as transformers' apply_chat_template(tokenize=False) gives it.

    Raises TemplateRefused (raise_exception) or jinja2.TemplateError."""
    return str(template.render(messages=[_message(m) for m in messages], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **(special or {})))


def _tokenizer_config(model_dir: str) -> dict:
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def read_source(model_dir: str) -> str | None:
    """The template's source: chat_template.jinja, else tokenizer_config.json's `chat_template`
    (the "default" of a list of named ones); None when the model has none."""
    try:
        with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
            text = f.read()
        if text:
            return text
    except OSError:
        pass
    template = _tokenizer_config(model_dir).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _token_text(value: Any) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def special_tokens(model_dir: str) -> dict[str, str]:
    """The special tokens a template may use (bos_token, eos_token, ...), as text: transformers'
    special_tokens_map (since 5.0, the named tokens only)."""
    cfg = _tokenizer_config(model_dir)
    out: dict[str, str] = {}
    for key in SPECIAL_TOKENS:
        text = _token_text(cfg.get(key))
        if text is not None:
            out[key] = text
    return out
