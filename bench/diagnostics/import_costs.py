"""What the torch engine's imports cost (issue 25): wall clock in fresh processes.

    python -m bench.diagnostics.import_costs --model DIR [--repeat 3] [--drop-caches] [--out JSON]

Each variant runs in a new interpreter, after `import torch` (which every
variant pays, and which is timed on its own), so the numbers are the extra
cost of each way of getting what the engine needs:
  auto_model        `from transformers import AutoConfig, AutoModelForCausalLM`, config read
  auto_model_build  the same, plus the model skeleton built on the meta device
  direct_model      the model's own configuration and modelling modules
                    (transformers.models.<type>.modeling_<type>), as the engine now imports
  direct_build      the same, plus the skeleton on the meta device
  auto_tokenizer    `AutoTokenizer.from_pretrained(DIR)`
  tokenizers_lib    `tokenizers.Tokenizer.from_file(DIR/tokenizer.json)`
  engine_tokenizer  the engine's own tokenizer path (warmup_agent.engines.torch.engine)
For auto_model and direct_model it also records whether torch._dynamo,
transformers.generation and transformers.models.auto.modeling_auto were
imported, and the module count.  With --importtime the auto_model variant
runs once more under `python -X importtime` and the largest cumulative
entries are listed.  --drop-caches (root) empties the page cache before each
variant's first run: the "cold-ish" figure (files on local disk, not a cold
container image).

Answered (H200, bench/results/import_costs_h200.json, after `import torch` at
2.6-3.4 s; the CPU table is in docs/architecture.md): importing the model's own
modelling module saves nothing over Auto* (7.7 against 7.9 s with the skeleton built on
the meta device: transformers 5 pulls in the same stack either way); AutoTokenizer alone
6.8 s for the same reason, tokenizers' own Tokenizer 0.008 s.  The start was bound by
the transformers import, which the native forward (engines/torch/native_lm.py) avoids.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = "import time, sys, json; t0 = time.perf_counter(); import torch; t_torch = time.perf_counter() - t0\n"
WATCH = ("torch._dynamo", "transformers.generation.utils", "transformers.models.auto.modeling_auto",
         "transformers.integrations", "tokenizers", "transformers.tokenization_utils_base")

VARIANTS = {
    "auto_model": """
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained(MODEL)
""",
    "auto_model_build": """
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained(MODEL)
with torch.device("meta"):
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
""",
    "direct_model": """
from warmup_agent.engines.torch import model_classes
build, cfg = model_classes.resolve(MODEL)
""",
    "direct_build": """
from warmup_agent.engines.torch import model_classes
build, cfg = model_classes.resolve(MODEL)
with torch.device("meta"):
    m = build(cfg, dtype=torch.bfloat16)
""",
    "auto_tokenizer": """
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(MODEL)
tok.encode("hello world")
""",
    "tokenizers_lib": """
import tokenizers
tok = tokenizers.Tokenizer.from_file(MODEL + "/tokenizer.json")
tok.encode("hello world")
""",
    "engine_tokenizer": """
from warmup_agent.engines.torch.engine import TorchEngine
e = TorchEngine(MODEL, device="cpu")
e.load_tokenizer()
""",
}


def run_variant(name: str, model: str) -> dict:
    body = VARIANTS[name]
    code = (PRELUDE + f"MODEL = {model!r}\nt1 = time.perf_counter()\n" + body
            + "t_variant = time.perf_counter() - t1\n"
            + "print(json.dumps({'torch': t_torch, 'variant': t_variant, 'modules': len(sys.modules), "
            + f"'loaded': [m for m in {list(WATCH)!r} if m in sys.modules]}}))\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{name}: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_wall"] = wall
    return out


def importtime(model: str, body: str, top: int = 25) -> list[tuple[str, float]]:
    """Largest cumulative import times (seconds) under python -X importtime."""
    code = f"import torch\nMODEL = {model!r}\n" + body
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    rows = []
    for line in r.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cum, name = (p.strip() for p in line[len("import time:"):].split("|"))
        rows.append((name.strip(), int(cum) / 1e6))
    rows.sort(key=lambda x: -x[1])
    return rows[:top]


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--importtime", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    result: dict = {"model": args.model, "python": sys.version.split()[0], "variants": {}}
    try:
        import importlib.util

        import torch
        import transformers
        import transformers.modeling_utils as mu
        # Without a cached .pyc every start compiles the sources again (a read-only
        # site-packages, say): worth knowing before blaming the import itself.
        pyc = importlib.util.cache_from_source(mu.__file__)
        result.update(torch=torch.__version__, transformers=transformers.__version__,
                      transformers_pyc_cached=os.path.exists(pyc), site_writable=os.access(os.path.dirname(pyc), os.W_OK))
        print(f"torch {torch.__version__} transformers {transformers.__version__} pyc cached {result['transformers_pyc_cached']}")
    except ImportError:
        pass
    for name in args.variants.split(","):
        cold = None
        if args.drop_caches and drop_caches():
            cold = run_variant(name, args.model)
        warm = [run_variant(name, args.model) for _ in range(args.repeat)]
        row = {"warm_seconds_median": statistics.median(w["variant"] for w in warm),
               "warm_seconds": [round(w["variant"], 3) for w in warm],
               "torch_import_seconds_median": statistics.median(w["torch"] for w in warm),
               "modules": warm[-1]["modules"], "loaded": warm[-1]["loaded"]}
        if cold:
            row.update(cold_seconds=cold["variant"], cold_torch_import_seconds=cold["torch"])
        result["variants"][name] = row
        print(f"{name:18s} warm {row['warm_seconds_median']:.3f} s {row['warm_seconds']}"
              + (f"  cold {cold['variant']:.3f} s (torch cold {cold['torch']:.2f} s)" if cold else "")
              + f"  torch {row['torch_import_seconds_median']:.2f} s  modules {row['modules']}  loaded {row['loaded']}",
              flush=True)
    if args.importtime:
        result["importtime_auto_model"] = importtime(args.model, VARIANTS["auto_model"])
        result["importtime_direct_model"] = importtime(args.model, VARIANTS["direct_model"])
        for key in ("importtime_auto_model", "importtime_direct_model"):
            print(key)
            for n, s in result[key][:25]:
                print(f"  {s:7.3f} s  {n}")
    if args.out:
        from bench.provenance import write_result
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
