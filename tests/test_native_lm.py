"""The native Llama/Qwen2 forward (engines/torch/native_lm.py, issue 25) against transformers.

transformers is the reference: the same checkpoint loaded both ways (the torch
engine with model.implementation native, and with transformers) must give the
same logits in float32, on one prompt and on a left-padded batch, and the same
greedy tokens through the growing cache and through the static-cache decode
that CUDA graphs capture.  Models: the embedded Llama, a tiny Qwen2 with q/k/v
biases and tied embeddings, a tiny Llama with attention/MLP biases and llama3
rope scaling.  Then: what is not eligible falls back and says why, and the
native path never imports transformers (a whole CLI run, in a subprocess)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.paths import ROOT
from warmup_agent.engines.torch import native_config
from warmup_agent.errors import EngineError

torch = pytest.importorskip("torch")
ATOL = 1e-4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tiny(embedded_model: str, out: str, kind: str) -> str:
    """A random float32 model of `kind` beside the embedded model's tokenizer.
    initializer_range 0.2 (not 0.02): greedy decode then picks varied tokens, so
    token-for-token comparisons mean something."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    shape = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 initializer_range=0.2, pad_token_id=2, bos_token_id=1, eos_token_id=2)
    if kind == "qwen2":
        config = Qwen2Config(**shape, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = Qwen2ForCausalLM
    else:   # llama with every bias and llama3 rope scaling
        config = LlamaConfig(**shape, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = LlamaForCausalLM
    torch.manual_seed(1)
    model = cls(config)
    if kind == "qwen2":   # transformers initialises biases to zero: make them count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.2)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(embedded_model, name), out)
    return out


@pytest.fixture(scope="module")
def models(embedded_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("native")
    return {"embedded_llama": embedded_model,
            "qwen2_bias_tied": _tiny(embedded_model, str(d / "qwen2"), "qwen2"),
            "llama_bias_llama3_rope": _tiny(embedded_model, str(d / "llama3"), "llama3")}


def _engine(path: str, implementation: str):
    from warmup_agent.engines.torch.engine import TorchEngine
    e = TorchEngine(path, dtype="float32", device="cpu", implementation=implementation)
    e.load_weights()
    e.load_tokenizer()
    return e


@pytest.fixture(scope="module")
def pairs(models):
    return {name: (_engine(path, "native"), _engine(path, "transformers")) for name, path in models.items()}


NAMES = ["embedded_llama", "qwen2_bias_tied", "llama_bias_llama3_rope"]


@pytest.mark.parametrize("name", NAMES)
def test_native_is_native_and_the_reference_is_transformers(pairs, name):
    native, ref = pairs[name]
    assert type(native.model).__name__ == "NativeCausalLM" and native.facts().extra["implementation"] == "native"
    assert type(ref.model).__module__.startswith("transformers.")
    assert ref.facts().extra == {"implementation": "transformers",
                                 "implementation_reason": "model.implementation is transformers"}
    # The same tensors under the same names: the fingerprint PRIME checks, validation and the loader all agree.
    assert list(native.model.state_dict()) == list(ref.model.state_dict())
    assert native.weight_fingerprint() == ref.weight_fingerprint()
    assert native.facts().parameter_count == ref.facts().parameter_count


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers_on_a_prompt_and_a_left_padded_batch(pairs, name):
    native, ref = pairs[name]
    torch.manual_seed(0)
    ids = torch.randint(3, 2048, (3, 21))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0          # left padding, as TorchEngine.generate pads
    mask[2, :1] = 0
    with torch.inference_mode():
        a, b = native.model(input_ids=ids[1:2]).logits, ref.model(input_ids=ids[1:2]).logits
        assert a.shape == b.shape and (a - b).abs().max().item() < ATOL
        a = native.model(input_ids=ids, attention_mask=mask).logits
        b = ref.model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(a).all()   # padded rows too: no NaN leaks into the real tokens' keys
    real = mask.bool()               # padding positions' logits are meaningless on both sides
    assert (a - b)[real].abs().max().item() < ATOL
    assert a[real].std().item() > 0.1   # the comparison is over logits that vary


def _prompts(engine, lengths):
    t = engine.tokenize("the first request after readyz is as fast as the thousandth one, every time " * 2)
    return [t[i:i + n] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_through_the_growing_cache(pairs, name):
    native, ref = pairs[name]
    prompts = _prompts(native, [5, 12])       # unequal: left-padded, with a mask that grows per step
    native.generate(prompts, max_new_tokens=16)
    ref.generate(prompts, max_new_tokens=16)
    assert native.last_output.tolist() == ref.last_output.tolist()
    assert len(set(native.last_output[1].tolist())) > 1 or name == "embedded_llama"


@pytest.mark.parametrize("name", NAMES)
def test_static_cache_decode_equals_transformers(pairs, name):
    """The decode step graphs.py captures on a GPU, run eagerly (capture=False)."""
    from warmup_agent.gpu import graphs
    native, ref = pairs[name]
    decoders, reason = graphs.build(native.model, [2], 64, native.device, capture=False)
    assert reason is None and type(decoders[2].cache).__name__ == "StaticKV"
    prompts = _prompts(native, [10, 10])      # equal lengths: the static path serves them
    native._decoders = decoders
    try:
        native.generate(prompts, max_new_tokens=16)
        static = native.last_output.clone()
    finally:
        native._decoders = {}
    ref.generate(prompts, max_new_tokens=16)
    assert static.tolist() == ref.last_output.tolist()


# --- padded prefill (what gpu/graphs.py captures per warmed prompt length) -----------------------
def _padded(native, lengths_by_batch, max_len=64):
    from warmup_agent.gpu import graphs
    decoders, reason = graphs.build(native.model, sorted(lengths_by_batch), max_len, native.device,
                                    capture=False, prefill_lengths=lengths_by_batch)
    assert reason is None
    return decoders


@pytest.mark.parametrize("name", NAMES)
def test_padded_prefill_logits_equal_the_exact_prompt(pairs, name):
    """A prompt right-padded to a longer prefill length gives its last real token's
    logits as transformers computes them on the exact prompt: the padding is never seen."""
    native, ref = pairs[name]
    decoder = _padded(native, {1: [8, 16, 32]})[1]
    for n, bucket in ((5, 8), (16, 16), (20, 32)):
        ids = torch.tensor(_prompts(native, [n]))
        before = decoder.prefill_for(n).served
        got = decoder.prefill(ids)
        assert decoder.prefill_for(n).length == bucket and decoder.prefill_for(n).served == before + 1
        with torch.inference_mode():
            want = ref.model(input_ids=ids).logits[:, -1, :]
        assert (got - want).abs().max().item() < ATOL, n
    assert decoder.prefill_for(33) is None       # longer than every length: eager


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_after_a_padded_prefill_equal_transformers(pairs, name):
    """Decode continues over the padding's cache slots (overwriting them), after a
    longer request left its keys in the cache: the tokens are transformers' own."""
    native, ref = pairs[name]
    requests = (_prompts(native, [30]), _prompts(native, [6]), _prompts(native, [11, 11]))
    native._decoders = _padded(native, {1: [16, 32], 2: [16]})
    try:
        outputs = []
        for prompts in requests:
            native.generate(prompts, max_new_tokens=12)
            outputs.append(native.last_output.clone())
        served = {b: {n: p.served for n, p in d.prefills.items()} for b, d in native._decoders.items()}
    finally:
        native._decoders = {}
    assert served == {1: {16: 1, 32: 1}, 2: {16: 1}}
    for prompts, got in zip(requests, outputs, strict=True):
        ref.generate(prompts, max_new_tokens=12)
        assert got.tolist() == ref.last_output.tolist(), [len(p) for p in prompts]


def test_a_one_token_request_uses_the_padded_prefill_where_one_fits(pairs):
    """The readiness probe (one output token) is served by the padded prefill;
    a prompt longer than every prefill length, or with no decoder for its batch
    size, still runs eagerly through the growing cache."""
    native, ref = pairs["embedded_llama"]
    native._decoders = _padded(native, {1: [16]})
    try:
        [r] = native.generate(_prompts(native, [12]), max_new_tokens=1)
        short = native.last_output.clone()
        native.generate(_prompts(native, [20]), max_new_tokens=1)
        native.generate(_prompts(native, [12, 12]), max_new_tokens=1)
        served = native._decoders[1].prefills[16].served
    finally:
        native._decoders = {}
    assert served == 1 and r.output_tokens == 1 and r.first_token_seconds > 0
    ref.generate(_prompts(native, [12]), max_new_tokens=1)
    assert short.tolist() == ref.last_output.tolist()


def test_transformers_models_get_no_padded_prefill(pairs):
    _, ref = pairs["qwen2_bias_tied"]
    decoders = _padded(ref, {1: [16]})
    assert decoders[1].prefills == {} and decoders[1].prefill_for(4) is None


def test_structure_validation_uses_the_native_reference(pairs):
    from warmup_agent.readiness import validation
    native, _ = pairs["qwen2_bias_tied"]
    check = validation.check_structure(native)
    assert check.result == "passed" and check.detail["parameters"] == check.detail["expected_parameters"]


# --- eligibility ---------------------------------------------------------------------------------
def _llama(**over):
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    return {**base, **over}


@pytest.mark.parametrize("over, reason", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type 'mistral'"),
    ({"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "remote code"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope type 'linear'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "sliding window"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"hidden_size": "big"}, "hidden_size is 'big'"),
])
def test_ineligible_configs_name_the_reason(over, reason):
    assert reason in native_config.ineligible_reason(_llama(**over))


def test_eligible_configs_read_as_transformers_reads_them():
    cfg = native_config.parse(_llama(rope_theta=5e5, rope_scaling=None, attention_bias=True))
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.qkv_bias, cfg.o_bias) == (4, 2, 5e5, True, True)
    q = native_config.parse(_llama(model_type="qwen2", architectures=["Qwen2ForCausalLM"], head_dim=8,
                                   tie_word_embeddings=True, use_sliding_window=False))
    assert (q.head_dim, q.qkv_bias, q.o_bias, q.tie_word_embeddings) == (8, True, False, True)


def _with_config(embedded_model, tmp_path, **over) -> str:
    d = str(tmp_path / "m")
    shutil.copytree(embedded_model, d)
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(over)
    json.dump(cfg, open(path, "w"))
    return d


def test_an_ineligible_model_falls_back_to_transformers_and_says_why(embedded_model, tmp_path):
    from warmup_agent.engines.torch.engine import TorchEngine
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    d = _with_config(embedded_model, tmp_path, rope_parameters=rope)
    e = TorchEngine(d, device="cpu")          # model.implementation auto
    e.load_weights()
    e.load_tokenizer()
    assert type(e.model).__module__.startswith("transformers.")
    assert e.facts().extra == {"implementation": "transformers", "implementation_reason": "rope type 'linear' (native: default, llama3)"}
    assert e.generate([e.tokenize("hello there")], max_new_tokens=3)[0].output_tokens == 3
    forced = TorchEngine(d, device="cpu", implementation="native")
    with pytest.raises(EngineError) as err:
        forced.load_weights()
    assert err.value.reason == "native_unsupported" and "rope type 'linear'" in err.value.message
    assert "\n" not in err.value.message


def test_a_broken_tokenizer_json_is_tokenizer_invalid_on_the_native_path(embedded_model, tmp_path):
    from warmup_agent.engines.torch.engine import TorchEngine
    d = _with_config(embedded_model, tmp_path)
    open(os.path.join(d, "tokenizer.json"), "w").write("garbage")
    e = TorchEngine(d, device="cpu", implementation="native")
    with pytest.raises(EngineError) as err:
        e.load_tokenizer()
    assert err.value.reason == "tokenizer_invalid" and "\n" not in err.value.message


def test_the_native_tokenizer_pads_and_encodes_as_transformers_does(pairs):
    native, ref = pairs["embedded_llama"]
    text = "warm the first request, then the thousandth"
    assert native.tokenizer.pad_token_id == ref.tokenizer.pad_token_id == 2
    assert native.tokenize(text) == ref.tokenize(text)
    assert native.tokenizer.decode(native.tokenize(text)) == ref.tokenizer.decode(ref.tokenize(text))


# --- no transformers on the native path ------------------------------------------------------------
def _cli_modules(model: str, record: str, data_dir: str, implementation: str) -> dict:
    """The CLI run to SERVING (--once) in a fresh interpreter; which modules it imported."""
    code = textwrap.dedent(f"""
        import json, sys
        from warmup_agent.cli import main
        try:
            rc = main(["run", "--model", {model!r}, "--once", "--no-progress", "--listen", "127.0.0.1:0",
                       "--data-dir", {data_dir!r}, "--record", {record!r}])
        except SystemExit as e:
            rc = e.code
        mods = sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers."))
        print(json.dumps({{"rc": rc, "transformers": mods[:5], "torch": "torch" in sys.modules}}))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env.update(PYTHONPATH=ROOT, WARMUP_AGENT_MODEL_IMPLEMENTATION=implementation, WARMUP_AGENT_MODEL_DEVICE="cpu",
               WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[8]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("implementation", ["auto", "transformers"])
def test_the_native_path_never_imports_transformers(embedded_model, data_dir, tmp_path, implementation):
    """auto on the embedded Llama: SERVING with torch and no transformers module at
    all.  The transformers run is the control: the same check sees its import."""
    record = str(tmp_path / "record.json")
    out = _cli_modules(embedded_model, record, data_dir, implementation)
    assert out["rc"] == 0 and out["torch"], out
    facts = json.load(open(record))["engine_facts"]
    if implementation == "auto":
        assert out["transformers"] == [], out
        assert facts["extra"] == {"implementation": "native", "implementation_reason": ""}
    else:
        assert "transformers" in out["transformers"], out
        assert facts["extra"]["implementation"] == "transformers"


def test_the_skeleton_is_built_without_initialising_weights_or_importing_dynamo():
    """The meta-device skeleton of a Qwen2-1.5B-shaped config: nothing is initialised
    (every weight comes from the checkpoint), and so torch._dynamo is never imported.
    nn.Embedding's normal_ on meta goes through torch._refs, which imported it: 3 s of
    GIL-bound imports beside the weight load, measured on the H200 (issue 25)."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    script = """
import json, sys, torch
from bench.bench_gpu_cold_start import QWEN2_1_5B
from warmup_agent.engines.torch import native_config, native_lm
cfg = dict(QWEN2_1_5B, model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu",
           rms_norm_eps=1e-6, rope_theta=1e6, torch_dtype="bfloat16")
model, expected, tied = native_lm.build_skeleton(native_config.parse(cfg), torch.bfloat16)
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "tensors": len(expected),
                  "meta": all(p.is_meta for p in model.parameters())}))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {"dynamo": False, "tensors": 339, "meta": True}, found
