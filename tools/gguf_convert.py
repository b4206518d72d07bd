#!/usr/bin/env python3
"""Convert a Hugging Face model directory to a GGUF file for llama.cpp's `llama-server`.

Runs the `convert_hf_to_gguf.py` of the llama.cpp tree that tools/build_llama_server.py
uses (llama-cpp-python 0.3.36's vendored copy, extracted under
<data_dir>/llama.cpp/0.3.36-src; fetched on first use, or from --from-tarball), with
PYTHONPATH=<tree>/gguf-py:<tree>, in a child process of this Python (it needs torch,
transformers and numpy: the agent's `test` extras).

Without MODEL_DIR: the agent's embedded model (created under data_dir if missing; needs
the agent importable).  The GGUF is cached next to the model directory, as
<parent>/<model dir name>-<outtype>.gguf, and not converted again while it is newer than
every *.safetensors and config of the model.  The GGUF path is the last line of stdout.

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a test
string, and refuses one it does not know ("BPE pre-tokenizer was not recognized"), such
as the embedded model's locally trained byte-level BPE.  Then this script answers
"qwen2" (a GPT-2-style byte-level split that llama-server accepts; "gpt2" converts but
the server refuses the file).  The tree's files are not edited: the child process
replaces TextModel.get_vocab_base_pre before running the converter.  It also makes the
converter look for tokenizer.model before it imports sentencepiece, so a model without one
converts without sentencepiece installed (a model with one needs it).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.build_llama_server import BuildError, default_data_dir, prepare_source  # noqa: E402 (after the sys.path line)

FALLBACK_PRE = "qwen2"

# Run in the child: patch the vocabulary pre-tokenizer lookup, then run the converter as
# __main__ (it finds `conversion` in sys.modules, already patched).
_WRAPPER = r"""
import logging, runpy, sys
import conversion.base as base
FALLBACK = sys.argv[1]
_orig = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        logging.getLogger("gguf_convert").warning(
            "BPE pre-tokenizer not recognized: using %r", FALLBACK)
        return FALLBACK
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
# It imports sentencepiece before it looks for tokenizer.model: look first, so that a
# byte-level BPE model (tokenizer.json only) converts without sentencepiece installed.
_orig_spm = base.TextModel._create_vocab_sentencepiece
def _create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return _orig_spm(self)
base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
# --render-pad-tokens: ids past the tokenizer's vocabulary ([PADn], UNUSED) become
# user-defined tokens whose text is their name.  A random model samples them all the
# time; as UNUSED they render no text and llama-server streams no chunk for them, so a
# client could not time its tokens.  A real model never samples them.
if sys.argv[3] == "1":
    import gguf
    _orig_vb = base.TextModel.get_vocab_base
    def get_vocab_base(self):
        tokens, toktypes, tokpre = _orig_vb(self)
        toktypes = [gguf.TokenType.USER_DEFINED if t == gguf.TokenType.UNUSED and str(tok).startswith("[PAD") else t
                    for tok, t in zip(tokens, toktypes)]
        return tokens, toktypes, tokpre
    base.TextModel.get_vocab_base = get_vocab_base
script = sys.argv[2]
sys.argv = sys.argv[3:]
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


def log(msg: str) -> None:
    print(f"gguf_convert: {msg}", file=sys.stderr, flush=True)


def default_outfile(model_dir: Path, outtype: str) -> Path:
    return model_dir.parent / f"{model_dir.name}-{outtype}.gguf"


def up_to_date(gguf: Path, model_dir: Path) -> bool:
    if not gguf.is_file() or gguf.stat().st_size == 0:
        return False
    inputs = [p for pat in ("*.safetensors", "*.bin", "config.json", "tokenizer*.json")
              for p in model_dir.glob(pat)]
    return all(gguf.stat().st_mtime > p.stat().st_mtime for p in inputs)


def convert(tree: Path, model_dir: Path, out: Path, outtype: str, python: str, render_pad_tokens: bool = False) -> None:
    script = tree / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise BuildError(f"convert: {script} missing")
    tmp = out.with_name(out.name + ".part")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree / "gguf-py"), str(tree)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    cmd = [python, "-c", _WRAPPER, FALLBACK_PRE, str(script), "1" if render_pad_tokens else "0",
           str(model_dir), "--outfile", str(tmp), "--outtype", outtype]
    log(f"convert: {model_dir} -> {out} ({outtype})")
    try:
        proc = subprocess.run(cmd, env=env, stdout=sys.stderr)
    except OSError as e:
        raise BuildError(f"convert: cannot run {python}: {e}") from None
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise BuildError(f"convert: convert_hf_to_gguf.py exited with {proc.returncode}")
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", type=Path,
                    help="Hugging Face model directory (default: the agent's embedded model)")
    ap.add_argument("--outtype", choices=("bf16", "f16", "f32"), default="bf16", help="weight type (default bf16)")
    ap.add_argument("--outfile", type=Path, help="GGUF path (default: <model dir>-<outtype>.gguf next to the model)")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="where the llama.cpp tree and the embedded model live (default as build_llama_server.py)")
    ap.add_argument("--from-tarball", type=Path, metavar="T.tar.gz",
                    help="take the llama.cpp tree from build_llama_server.py --source-tarball output (no download)")
    ap.add_argument("--python", default=sys.executable, help="Python that runs the converter (default: this one)")
    ap.add_argument("--force", action="store_true", help="convert even when the GGUF is up to date")
    ap.add_argument("--render-pad-tokens", action="store_true",
                    help="ids past the tokenizer's vocabulary render their [PADn] name as text (a random model samples "
                         "them; as unused tokens llama-server streams nothing for them, so a client cannot time them); "
                         "the default file name gets -padtext")
    a = ap.parse_args(argv)

    data_dir = a.data_dir or default_data_dir()
    try:
        if a.model_dir is None:
            try:
                from warmup_agent.model.embedded import ensure_embedded_model
            except ImportError as e:
                raise BuildError(f"embedded model: cannot import warmup_agent ({e}); pass MODEL_DIR") from None
            model_dir = Path(ensure_embedded_model(str(data_dir)))
        else:
            model_dir = a.model_dir.resolve()
        if not (model_dir / "config.json").is_file():
            raise BuildError(f"model: {model_dir} has no config.json")
        out = (a.outfile or default_outfile(model_dir, a.outtype + ("-padtext" if a.render_pad_tokens else ""))).resolve()
        if not a.force and up_to_date(out, model_dir):
            log("cached")
            print(out)
            return 0
        root = data_dir / "llama.cpp"
        root.mkdir(parents=True, exist_ok=True)
        tree = prepare_source(root, a.from_tarball)
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(tree, model_dir, out, a.outtype, a.python, a.render_pad_tokens)
    except BuildError as e:
        print("gguf_convert: error: " + " ".join(str(e).split()), file=sys.stderr)
        return 1
    except OSError as e:
        print(f"gguf_convert: error: {e}", file=sys.stderr)
        return 1
    log(f"{out.stat().st_size / 1e6:.1f} MB")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
