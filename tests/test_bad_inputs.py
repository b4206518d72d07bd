"""Bad input, through the real CLI: one clear line (file, key, value,
expectation), the right exit code, a named reason in
model_loading_failures_total and the run record, never SERVING, no traceback.

The issue's cases and where each is tested (the others are not repeated here):

| case | test |
|---|---|
| truncated safetensors shard | test_bad_model.py (engine + CLI) |
| header that lies about sizes | test_bad_model.py (engine), here (CLI) |
| tensor shapes that do not match config.json | test_bad_model.py (engine + CLI) |
| SHA-256 manifest mismatch (prewarm.weights_manifest) | here |
| empty / non-JSON config.json | test_bad_model.py (engine), here (CLI) |
| corrupt tokenizer file | test_bad_model.py (engine), here (CLI) |
| missing tokenizer files | here |
| missing model directory / no weights | test_bad_model.py |
| unreadable model directory | here (root without CAP_DAC_OVERRIDE: see below) |
| model larger than memory | here (a sparse shard whose bytes really exist) |
| YAML syntax error, unknown key, wrong type, negative threshold, P50 > P90, port out of range | test_config.py (loader), here (CLI) |
| listen port already in use | test_config.py (CLI) |
| bad web config file / admin token | test_security.py |
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import psutil
import pytest

from tests.conftest import ROOT, run_agent
from tests.test_bad_model import lying_header


def copy_model(src, tmp_path) -> str:
    d = str(tmp_path / "model")
    shutil.copytree(src, d)
    return d


def run_model(d, tmp_path, data_dir, env=None, prefix=()):
    """Run the CLI on model dir d; return (completed process, run record)."""
    rec = tmp_path / "run.json"
    args = ["run", "--once", "--no-progress", "--model", d, "--data-dir", data_dir, "--listen", "127.0.0.1:0",
            "--record", str(rec)]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    full_env.update({"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]"}, **(env or {}))
    r = subprocess.run([*prefix, sys.executable, "-m", "warmup_agent", *args], cwd=ROOT, env=full_env,
                       capture_output=True, text=True, timeout=180)
    return r, json.loads(rec.read_text())


def assert_model_failure(r, record, reason, *in_line):
    assert r.returncode == 3, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [l for l in r.stderr.splitlines() if " ERROR " in l]
    assert len(errors) == 1, r.stderr[-2000:]
    assert reason in errors[0] and all(s in errors[0] for s in in_line), errors[0]
    assert record["final_state"] == "FAILED" and record["failure_reason"] == reason
    assert "SERVING" not in [t["state"] for t in record["transitions"]]


def flip_data_byte(d):
    """Same size, header intact: only a checksum can tell."""
    shard = os.path.join(d, "model.safetensors")
    with open(shard, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n + 1000)
        b = f.read(1)
        f.seek(8 + n + 1000)
        f.write(bytes([b[0] ^ 0x40]))


def test_sha256_manifest_mismatch(embedded_model, tmp_path, data_dir):
    d = copy_model(embedded_model, tmp_path)
    manifest = tmp_path / "SHA256SUMS"
    out = subprocess.run(["sha256sum", "model.safetensors"], cwd=d, capture_output=True, text=True, check=True).stdout
    manifest.write_text(out)
    flip_data_byte(d)
    r, record = run_model(d, tmp_path, data_dir, {"WARMUP_AGENT_PREWARM_WEIGHTS_MANIFEST": str(manifest)})
    assert_model_failure(r, record, "weights_corrupt", "model.safetensors", "does not match the manifest")


def test_missing_tokenizer_files(embedded_model, tmp_path, data_dir):
    d = copy_model(embedded_model, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        os.remove(os.path.join(d, name))
    r, record = run_model(d, tmp_path, data_dir)
    assert_model_failure(r, record, "tokenizer_invalid", d)


@pytest.mark.parametrize("case", ["lying_header", "empty_config", "non_json_config", "corrupt_tokenizer"])
def test_damaged_model_through_the_cli(case, embedded_model, tmp_path, data_dir):
    d = copy_model(embedded_model, tmp_path)
    if case == "lying_header":
        lying_header(d)
        reason, where = "weights_corrupt", os.path.join(d, "model.safetensors")
    elif case == "corrupt_tokenizer":
        open(os.path.join(d, "tokenizer.json"), "w").write("garbage")
        reason, where = "tokenizer_invalid", d
    else:
        open(os.path.join(d, "config.json"), "w").write("" if case == "empty_config" else "{not json")
        reason, where = "config_invalid", os.path.join(d, "config.json")
    r, record = run_model(d, tmp_path, data_dir)
    assert_model_failure(r, record, reason, where)


def test_unreadable_model_directory(embedded_model, tmp_path, data_dir):
    """Tests run as root, and root reads a chmod-000 directory anyway.  So the agent
    runs as root *without* CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (setpriv drops them
    from the bounding set), as in a pod with `capabilities: drop: [ALL]`: then the
    permission bits apply to it and the directory really is unreadable."""
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) not installed")
    d = copy_model(embedded_model, tmp_path)
    os.chmod(d, 0)
    try:
        r, record = run_model(d, tmp_path, data_dir,
                              prefix=("setpriv", "--bounding-set=-dac_override,-dac_read_search"))
    finally:
        os.chmod(d, 0o755)
    assert_model_failure(r, record, "model_dir_unreadable", d, "not readable")


def test_model_larger_than_memory(embedded_model, tmp_path, data_dir):
    """A model whose weights really are larger than this machine's memory: the
    vocabulary is grown until the embedding and LM head need twice the available
    memory, config.json says so, the safetensors header lays the tensors out, and
    the shard has exactly that many bytes (a sparse file: it costs no disk)."""
    d = copy_model(embedded_model, tmp_path)
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    shard = os.path.join(d, "model.safetensors")
    with open(shard, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    old_vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    available = psutil.virtual_memory().available
    new_vocab = math.ceil(2 * available / (2 * hidden * 2 * 2))   # 2 tensors, bf16 (2 B) loaded as fp32 (x2)
    offset, new_header = 0, {"__metadata__": header.get("__metadata__", {"format": "pt"})}
    for name, t in sorted((k, v) for k, v in header.items() if k != "__metadata__"):
        shape = [new_vocab if (i == 0 and s == old_vocab) else s for i, s in enumerate(t["shape"])]
        size = math.prod(shape) * {"BF16": 2, "F16": 2, "F32": 4}[t["dtype"]]
        new_header[name] = {"dtype": t["dtype"], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(new_header).encode()
    with open(shard, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)
    cfg["vocab_size"] = new_vocab
    json.dump(cfg, open(cfg_path, "w"))
    assert os.path.getsize(shard) > available
    r, record = run_model(d, tmp_path, data_dir)
    assert_model_failure(r, record, "insufficient_memory", d, "GiB of memory is available")


CONFIG_CASES = [
    ("readiness:\n  min_probes: [1, 2\n", "YAML syntax error at line"),
    ("readiness:\n  p50_treshold_seconds: 0.5\n", "did you mean 'readiness.p50_threshold_seconds'"),
    ("readiness:\n  min_probes: ten\n", "key 'readiness.min_probes': got 'ten'; expected an integer > 0"),
    ("readiness:\n  p50_threshold_seconds: 3.0\n", "expected at most readiness.p90_threshold_seconds"),
    ("exporter:\n  listen: 127.0.0.1:70000\n", "port in 0..65535"),
    ("prewarm:\n  memory_budget_bytes: -1\n", "key 'prewarm.memory_budget_bytes': got -1"),
]


@pytest.mark.slow  # an agent process
@pytest.mark.parametrize("text,expected", CONFIG_CASES, ids=[c[1][:30] for c in CONFIG_CASES])
def test_bad_config_through_the_cli_is_exit_2_and_one_line(text, expected, tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    r = run_agent("run", "--once", "--config", str(path), timeout=60)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and str(path) in lines[0] and expected in lines[0], lines
