"""The exporter under load while warmups run (short CI version of
bench/bench_load.py): every request answered, no errors.  Latency is the
benchmark's business, not a test's (the CI machine is shared)."""
from __future__ import annotations

from bench import loadgen
from tests.helpers.servers import free_port


def test_metrics_and_readyz_under_load_while_warming(tmp_path, embedded_model, data_dir):
    port = free_port()
    agent = loadgen.start_agent(port, str(tmp_path), {"WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "1",
                                                      "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8, 16]"}, data_dir)
    try:
        loadgen.wait_for(port, lambda s: s != "DOWN", 60, agent)   # load from the first answer on
        rewarmer = loadgen.Rewarmer(port)
        rewarmer.start()
        results, _ = loadgen.run_load(port, rate=150, seconds=8, workers=16)
        rewarmer.stop_event.set()
        rewarmer.join()
        loadgen.wait_for(port, "SERVING", 120, agent)      # the warmup that met the load still succeeds
    finally:
        rc = loadgen.stop_agent(agent)
    errors = [r for r in results if r[2]]
    assert len(results) == 150 * 8
    assert not errors, errors[:5]
    assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]
    # The load met a warmup (the first one, and any re-warm once SERVING).
    assert "PRELOAD" in rewarmer.seen, rewarmer.seen
