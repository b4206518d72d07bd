"""The embedded default model: a small random Llama and a locally trained tokenizer, in Hugging Face layout.

Many hosts and CI reach no model hub, yet the agent must run end to end on a real model.
Built deterministically; head_dim 64 so vLLM's CPU attention backend serves it too.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

from warmup_agent.atomic_file import write_json_atomic

RECIPE = "v1"
SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)

# A chat template, without which `transformers serve` refuses /v1/chat/completions.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}")

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _corpus(words: int = 60000, seed: int = 0) -> list[str]:
    """Pseudo-words, enough for byte-level BPE to reach a vocabulary of 2048."""
    rng = random.Random(seed)
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(6000)]
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(vocab))
        if len(line) >= 12:
            lines.append(" ".join(line) + ".")
            line = []
    return lines


def _train_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": "</s>", "model_max_length": SHAPE["max_position_embeddings"],
                   "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}, f, indent=2)


def _build_model(out_dir: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
                         torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


def embedded_model_dir(data_dir: str) -> str:
    return os.path.join(data_dir, "models", f"embedded-llama-{RECIPE}")


def ensure_embedded_model(data_dir: str) -> str:
    """Return the embedded model directory, built aside and renamed into place on first use."""
    final = embedded_model_dir(data_dir)
    if os.path.exists(os.path.join(final, ".complete")):
        add_chat_template(final)
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=parent)
    try:
        _train_tokenizer(tmp)
        _build_model(tmp)
        with open(os.path.join(tmp, ".complete"), "w") as f:
            f.write(RECIPE + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # Another agent finished first (the target exists): use theirs.
            if not os.path.exists(os.path.join(final, ".complete")):
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def add_chat_template(model_dir: str, template: str = CHAT_TEMPLATE) -> None:
    """Add our chat template to an older model's tokenizer_config.json, atomically."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("chat_template"):
        return
    cfg["chat_template"] = template
    write_json_atomic(path, cfg, indent=2)
