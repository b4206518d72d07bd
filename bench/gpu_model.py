"""The GPU benchmarks' model: Qwen2-1.5B's shape with random bf16 weights and a
tokenizer trained locally (nothing to download), for `warmup-agent bench` on a GPU.

    python -m bench.gpu_model DIR [--qwen-chat] [--device cpu]     # prints the model's directory

--qwen-chat gives it Qwen2's chat tokens and template (transformers serve parses
answers with them; see qwen_chat_tokenizer).  llama.cpp takes the plain one,
converted by tools/gguf_convert.py.  On the CPU it is the agent's embedded model.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(path: str, device: str, qwen_chat: bool = False) -> str:
    """The 1.5B-shaped model on a GPU; the embedded model on the CPU (smoke check).
    qwen_chat: give it Qwen2's chat format and a tokenizer that covers its vocabulary
    (see qwen_chat_tokenizer); the run then uses its own directory, `path` + "-qwenchat"."""
    from warmup_agent.model.embedded import add_chat_template, ensure_embedded_model
    if device == "cpu":
        return ensure_embedded_model(path)
    if qwen_chat:
        path += "-qwenchat"
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                    f"from bench.bench_gpu_cold_start import make_model; make_model({path!r})"], check=True, cwd=ROOT)
    if qwen_chat:
        qwen_chat_tokenizer(path)
    else:
        add_chat_template(path)
    return path


# Qwen2's chat tokens and their ids in its vocabulary.
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
QWEN_CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                      "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def qwen_chat_tokenizer(model_dir: str) -> int:
    """Make the bench model's locally trained tokenizer look like Qwen2's to a server; returns
    how many ids it gained.

    Why (found on the CPU with a tiny model): `transformers serve` parses a qwen2 model's
    answer with Qwen's response template, which starts at "<|im_start|>assistant". Under
    the trained tokenizer's "<s>role" chat format the parser never finds that anchor: the
    server streamed the rendered prompt as its first chunk and the whole answer as one
    chunk at the end, so the bench's time to first token, and the agent's per-length test,
    timed a 4-7 ms echo (H200 tfserve run 3). And that tokenizer has 2048 entries against
    the model's 151936 ids, so nearly every sampled token had no text to stream.

    So: Qwen2's chat tokens at Qwen2's ids, its ChatML template, <|im_end|> as the end of
    an answer, and a plain word (" w2048", ...) for every other id the tokenizer lacks.
    The words are BPE vocabulary with no merge leading to them, so encoding is unchanged."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    vocab_size = config["vocab_size"]
    path = os.path.join(model_dir, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    tok["added_tokens"] += [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for t, i in QWEN_SPECIALS.items()]
    # In the BPE vocabulary too: `tokenizers` keeps an added token's id only when the
    # vocabulary has it, else numbers it after the vocabulary's size.
    vocab.update(QWEN_SPECIALS)
    taken = set(vocab.values()) | {a["id"] for a in tok["added_tokens"]}
    added = 0
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"\u0120w{i}"] = i      # \u0120 is the byte-level alphabet's space
            added += 1
    with open(path, "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    cpath = os.path.join(model_dir, "tokenizer_config.json")
    with open(cpath) as f:
        tcfg = json.load(f)
    tcfg.update(chat_template=QWEN_CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
    with open(cpath, "w") as f:
        json.dump(tcfg, f, indent=2)
    end = QWEN_SPECIALS["<|im_end|>"]
    for name in ("config.json", "generation_config.json"):
        p = os.path.join(model_dir, name)
        if os.path.exists(p):
            with open(p) as f:
                c = json.load(f)
            c.update(eos_token_id=end, pad_token_id=QWEN_SPECIALS["<|endoftext|>"], bos_token_id=None)
            if name == "generation_config.json":
                # Qwen2-1.5B-Instruct's own sampling. `transformers serve` samples only where the
                # generation config says so; greedy, this random model with tied embeddings
                # repeats the prompt's last token ("\n"), which the Qwen parser holds back as
                # trailing space until the answer ends.
                c.update(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
            with open(p, "w") as f:
                json.dump(c, f, indent=2)
    return added + len(QWEN_SPECIALS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="where to write the model (an existing one is reused)")
    ap.add_argument("--qwen-chat", action="store_true", help="Qwen2's chat tokens and template (transformers serve)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the embedded model instead")
    args = ap.parse_args()
    print(make_model(args.dir, args.device, qwen_chat=args.qwen_chat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
