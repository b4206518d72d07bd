"""The model's tokenizer.json through `tokenizers` alone, for the native path (no transformers)."""
from __future__ import annotations

import json
import os
from typing import Any

from warmup_agent.errors import EngineError


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pad_text(model_dir: str) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            with open(os.path.join(model_dir, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        pad = _token_text(data.get("pad_token")) if isinstance(data, dict) else None
        if pad is not None:
            return pad
    return None


class NativeTokenizer:
    """tokenizers.Tokenizer with what the engine needs: encode, decode and pad_token_id."""

    def __init__(self, tok: Any, pad_token_id: int | None) -> None:
        self.tok = tok
        self.pad_token_id = pad_token_id

    @classmethod
    def from_model_dir(cls, model_dir: str) -> NativeTokenizer:
        """Raise EngineError tokenizer_invalid for a broken tokenizer.json."""
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - any library error here means broken tokenizer files
            raise EngineError("tokenizer_invalid", f"{model_dir}: cannot load the tokenizer: {_one_line(e)}") from None
        pad = _pad_text(model_dir)
        return cls(tok, tok.token_to_id(pad) if pad is not None else None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))
