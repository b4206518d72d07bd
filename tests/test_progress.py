"""The progress display promises what the readiness gate really needs."""
import io

from warmup_agent.run.progress import Progress, summary_table


def test_probe_progress_counts_toward_min_probes_not_max_probes():
    out = io.StringIO()
    p = Progress(out, tty=False)
    p.stage_started(4, 4, "ready")
    for n in range(1, 11):
        p.probe(n, n, needed=10, limit=200, ttft=0.005)
    text = out.getvalue()
    assert "/200" not in text and "200" not in text, text
    assert "[4/4] ready 1/10 probes ttft=5.0ms" in text
    # thresholds still not met after the 10 needed: now say so, and where it gives up
    p.probe(11, 11, needed=10, limit=200, ttft=0.005)
    assert out.getvalue().splitlines()[-1] == "[4/4] ready 11 probes, P50/P90 over threshold; gives up after 200 ttft=5.0ms"


def test_probe_progress_on_a_terminal_draws_a_bar_to_min_probes():
    out = io.StringIO()
    p = Progress(out, tty=True)
    p.stage_started(4, 4, "ready")
    p.probe(10, 10, needed=10, limit=200, ttft=0.004)
    assert "[####################] 10/10 probes ttft=4.0ms" in out.getvalue()


def test_summary_total_includes_startup():
    record = {"startup_seconds": 4.5, "final_state": "SERVING",
              "stages": [{"name": n, "phase": i + 1, "duration_seconds": 0.25, "status": "ok"}
                         for i, n in enumerate(("reserve", "prewarm", "solidify", "ready"))]}
    lines = summary_table(record).splitlines()
    assert lines[2].split() == ["startup", "0", "4.500", "ok"]
    assert lines[-1].split() == ["total", "5.500", "SERVING"]


def test_summary_shows_a_stage_still_running():
    """A re-warm that began between SERVING and the summary (CI: POST /admin/rewarm 2 ms
    after SERVING in tests/test_load.py) leaves its prewarm running in the record; the
    table says so instead of failing on its missing duration (which killed the agent)."""
    stages = [{"name": n, "phase": i + 1, "duration_seconds": 0.25, "status": "ok"}
              for i, n in enumerate(("reserve", "prewarm", "solidify", "ready"))]
    stages.append({"name": "prewarm", "phase": 2, "duration_seconds": None, "status": "running"})
    lines = summary_table({"startup_seconds": 1.0, "final_state": "PRELOAD", "stages": stages}).splitlines()
    assert lines[-2].split() == ["prewarm", "2", "-", "running"]
    assert lines[-1].split() == ["total", "2.000", "PRELOAD"]
