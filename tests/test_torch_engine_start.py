"""The torch engine's start (issue 25): the transformers import begins at prestart,
through the model's own modules, and the shape grid is warmed by measured benefit."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.paths import ROOT
from warmup_agent.engines.torch import model_classes
from warmup_agent.warmup import shapes as shape_warmup
from warmup_agent.warmup.benefit import Call
from warmup_agent.warmup.traffic import Shape


def _run(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_prestart_imports_the_model_and_builds_the_skeleton_before_load_weights(embedded_model):
    """The CLI calls prestart() as soon as the engine exists: the import then overlaps
    the agent's set-up, reserve and the weight read instead of following them."""
    out = _run(f"""
        import json, sys, time
        from warmup_agent.engines.torch.engine import TorchEngine
        e = TorchEngine({embedded_model!r}, device="cpu", implementation="transformers")
        before = "transformers" in sys.modules or "torch" in sys.modules
        e.prestart()
        t0 = time.time()
        while "transformers.models.llama.modeling_llama" not in sys.modules and time.time() - t0 < 120:
            time.sleep(0.05)
        while e.skeleton_build_seconds is None and time.time() - t0 < 120:
            time.sleep(0.05)
        imported = "transformers.models.llama.modeling_llama" in sys.modules
        e.load_weights()
        e.load_tokenizer()
        r = e.generate([e.tokenize("hello world")], max_new_tokens=2)[0]
        print(json.dumps({{"before": before, "imported": imported, "built": e.skeleton_build_seconds,
                          "wait": e.skeleton_wait_seconds, "model": type(e.model).__name__, "tokens": r.output_tokens}}))
    """)
    assert out["before"] is False          # creating the engine imports neither torch nor transformers
    assert out["imported"] and out["built"] is not None, out   # without load_weights
    assert out["wait"] < 1.0, out          # load_weights found the skeleton built
    assert out["model"] == "LlamaForCausalLM" and out["tokens"] == 2


def test_direct_classes_for_a_causal_lm_transformers_ships():
    found = model_classes.direct_classes({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    assert found is not None
    config_cls, model_cls = found
    assert (config_cls.__name__, model_cls.__name__) == ("Qwen2Config", "Qwen2ForCausalLM")
    assert model_cls.__module__ == "transformers.models.qwen2.modeling_qwen2"


@pytest.mark.parametrize("config", [
    {"model_type": "no_such_model", "architectures": ["NoSuchModelForCausalLM"]},   # unknown type
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "auto_map": {"AutoModelForCausalLM": "x.Y"}},
    {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},   # not a causal LM
    {"model_type": "llama"},                                                        # no architectures
    {"model_type": "../llama", "architectures": ["LlamaForCausalLM"]},              # not a module name
    {"model_type": "qwen2", "architectures": ["LlamaForCausalLM"]},                 # class not in that module
])
def test_anything_else_goes_the_auto_way(config):
    assert model_classes.direct_classes(config) is None


def test_resolve_falls_back_to_auto_for_an_unknown_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                      "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64}))
    build, config = model_classes.resolve(str(tmp_path))
    assert type(config).__name__ == "GPT2Config" and build.__qualname__.startswith("_BaseAutoModelClass")


# -- the shape grid by measured benefit ----------------------------------------------------
def _scripted(ttfts: dict) -> tuple:
    sent: list = []

    def send(shape: Shape) -> Call:
        k = (shape.prompt_tokens, shape.batch)
        n = sum(1 for s in sent if s == k)
        sent.append(k)
        series = ttfts[k]
        ttft = series[min(n, len(series) - 1)]
        return Call(ttft, ttft + 0.005, 2, shape.prompt_tokens)
    return send, sent


def test_a_shape_whose_first_call_matches_steady_gets_no_second_call():
    send, sent = _scripted({(8, 1): [0.5, 0.010, 0.010], (32, 1): [0.011, 0.011], (8, 2): [0.3, 0.012, 0.012]})
    outcomes = shape_warmup.warm_grid([Shape(8, 1), Shape(32, 1), Shape(8, 2)], send, tol=0.2, max_calls=4)
    assert [len(o.calls) for o in outcomes] == [3, 1, 3]
    assert [o.result for o in outcomes] == ["converged", "warm_on_first_call", "converged"]
    assert shape_warmup.summary(outcomes) == {"paths": {"converged": 2, "warm_on_first_call": 1}, "calls": 7}


def test_a_shape_still_getting_faster_gets_calls_up_to_the_cap():
    send, _ = _scripted({(8, 1): [0.8, 0.4, 0.2, 0.1, 0.05]})
    [o] = shape_warmup.warm_grid([Shape(8, 1)], send, tol=0.2, max_calls=3)
    assert o.result == "still_improving" and len(o.calls) == 3


def test_a_dropped_shape_is_recorded_as_skipped():
    def send(shape):
        if shape.batch > 1:
            raise shape_warmup.Dropped("batch 2 dropped: out of memory")
        return Call(0.01, 0.015, 2)
    outcomes = shape_warmup.warm_grid([Shape(8, 1), Shape(8, 2)], send, tol=0.2, max_calls=4)
    assert outcomes[1].result == "skipped" and "out of memory" in outcomes[1].reason


@pytest.mark.slow
def test_prewarm_stops_warming_a_shape_once_its_calls_match_steady(embedded_model):
    """Through the prewarm stage on the embedded model: with requests_per_shape 3, a
    shape whose first call matches steady is sent once (it used to be sent 3 times)."""
    from exporter.metrics import AgentMetrics
    from warmup_agent import config
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.pipeline import Agent
    from warmup_agent.stages import prewarm

    script = {(8, 1): [0.5, 0.010, 0.010], (32, 1): [0.011]}
    calls: list = []

    class Scripted(TorchEngine):
        def generate(self, prompts, max_new_tokens=1, warmup=False):
            results = super().generate(prompts, max_new_tokens, warmup)
            k = (len(prompts[0]), len(prompts))
            n = calls.count(k)
            calls.append(k)
            ttft = script[k][min(n, len(script[k]) - 1)]
            for r in results:
                r.first_token_seconds, r.total_seconds = ttft, ttft + 0.005
            return results

    cfg = config.load(env={"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8, 32]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
                           "WARMUP_AGENT_PREWARM_REQUESTS_PER_SHAPE": "3", "WARMUP_AGENT_MODEL_DEVICE": "cpu"})
    agent = Agent(cfg, Scripted(embedded_model, dtype=cfg.model.dtype, device="cpu"), metrics=AgentMetrics())
    detail: dict = {}
    try:
        prewarm.run(agent.context, detail)
    finally:
        agent.engine.close()
    assert calls == [(8, 1)] * 3 + [(32, 1)]
    assert [p["result"] for p in detail["paths"]] == ["converged", "warm_on_first_call"]
    assert detail["warmup"]["calls"] == 4 and agent.context.warmed_shapes == [(8, 1), (32, 1)]
