"""A missing or corrupt model directory: one clear line, exit code 3, a named
reason in model_loading_failures_total, and never SERVING."""
import json
import os
import shutil

import pytest

from exporter.metrics import AgentMetrics
from tests.conftest import run_agent
from warmup_agent import config
from warmup_agent.engines.torch.engine import TorchEngine
from warmup_agent.pipeline import Agent
from warmup_agent.states import State


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def truncate_shard(d):
    shard = os.path.join(d, "model.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)


def lying_header(d):
    """A header whose offsets promise more bytes than the file holds."""
    shard = os.path.join(d, "model.safetensors")
    with open(shard, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4096
    new = json.dumps(header).encode()
    with open(shard, "wb") as f:
        f.write(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def wrong_shapes(d):
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    json.dump(cfg, open(cfg_path, "w"))


CASES = {
    "missing_dir": (lambda d: shutil.rmtree(d), "model_dir_missing"),
    "empty_config": (lambda d: open(os.path.join(d, "config.json"), "w").close(), "config_invalid"),
    "non_json_config": (lambda d: open(os.path.join(d, "config.json"), "w").write("{not json"), "config_invalid"),
    "no_weights": (lambda d: os.remove(os.path.join(d, "model.safetensors")), "weights_missing"),
    "truncated_shard": (truncate_shard, "weights_corrupt"),
    "lying_header": (lying_header, "weights_corrupt"),
    "shape_mismatch": (wrong_shapes, "weights_shape_mismatch"),
    "corrupt_tokenizer": (lambda d: open(os.path.join(d, "tokenizer.json"), "w").write("garbage"), "tokenizer_invalid"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_model_fails_with_named_reason_and_never_serves(case, embedded_model, tmp_path):
    breaker, reason = CASES[case]
    d = copy_model(embedded_model, tmp_path / "model")
    breaker(d)
    metrics = AgentMetrics()
    cfg = config.load(env={"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]"})
    agent = Agent(cfg, TorchEngine(d), metrics=metrics)
    assert agent.run() == State.FAILED
    assert agent.sm.failure_reason == reason, agent.sm.failure_message
    assert State.SERVING not in [s for s, _ in agent.sm.history]
    assert metrics.registry.get_sample_value("model_loading_failures_total", {"reason": reason}) == 1.0
    assert "\n" not in agent.sm.failure_message


@pytest.mark.parametrize("case", ["missing_dir", "truncated_shard", "shape_mismatch"])
def test_cli_broken_model_exits_3_with_one_error_line(case, embedded_model, tmp_path, data_dir):
    breaker, reason = CASES[case]
    d = copy_model(embedded_model, tmp_path / "model")
    breaker(d)
    rec = tmp_path / "run.json"
    r = run_agent("run", "--once", "--no-progress", "--model", d, "--data-dir", data_dir,
                  "--listen", "127.0.0.1:0", "--record", str(rec))
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    errors = [l for l in r.stderr.splitlines() if " ERROR " in l]
    assert len(errors) == 1 and reason in errors[0] and d in errors[0], r.stderr
    record = json.loads(rec.read_text())
    assert record["final_state"] == "FAILED" and record["failure_reason"] == reason
    assert "SERVING" not in [t["state"] for t in record["transitions"]]
