"""The life watch's restart judgement (warmup_agent/readiness/life.py): two reads of a
server's start time within a second are the same process, a read that failed is unknown,
and a later start time is a restart, warmed again.

The reads are scripted (the server side is tested in tests/test_server_signals.py and,
with the CPU vLLM, in the same file); readiness, the breaker, the
state machine and the metrics are the agent's own.
"""
from __future__ import annotations

from exporter.metrics import AgentMetrics
from exporter.recorder import Recorder
from warmup_agent import config
from warmup_agent.readiness.life import SAME_PROCESS_SECONDS, ServerLife
from warmup_agent.readiness.runtime import Readiness
from warmup_agent.states import State, StateMachine


class ScriptedReads:
    """A server that answers /health and whose start time reads as scripted (None: the read failed)."""
    kind = None
    url = "http://127.0.0.1:1"
    health_path = "/health"

    def __init__(self, identities):
        self.identities = list(identities)

    def health(self):
        return None

    def identity(self):
        return self.identities.pop(0)


def watch_all(identities):
    """The actions of one watch tick per scripted read, the restarts counted, the final state."""
    cfg = config.load(env={})
    metrics = AgentMetrics()
    sm = StateMachine(Recorder(metrics))
    readiness = Readiness(cfg.readiness, cfg.breaker, sm, Recorder(metrics))
    for st in (State.PRELOAD, State.PRIME, State.SERVING):
        sm.transition(st)
    life = ServerLife(ScriptedReads(identities), sm, readiness, Recorder(metrics),    # type: ignore[arg-type]
                      sleeps_when_idle=False, ready_while_asleep=False, has_fallback=False)
    actions = [life.watch() for _ in identities]
    restarts = {d: metrics.registry.get_sample_value("warmup_server_restarts_total", {"detected_by": d})
                for d in ("start_time", "came_back")}
    return actions, restarts, sm.state


def test_reads_of_one_process_within_the_tolerance_are_the_same_process():
    # one source read again: the same figure, or a clock tick off
    actions, restarts, state = watch_all([1000.0, 1000.01, 999.99, 1000.0 + SAME_PROCESS_SECONDS])
    assert actions == ["probe"] * 4
    assert restarts == {"start_time": 0, "came_back": 0} and state == State.SERVING


def test_a_failed_read_is_unknown_not_a_restart():
    actions, restarts, state = watch_all([1000.0, None, None, 1000.0])
    assert actions == ["probe"] * 4
    assert restarts == {"start_time": 0, "came_back": 0} and state == State.SERVING


def test_unknown_at_first_then_known_is_no_restart():
    actions, restarts, _ = watch_all([None, 1000.0, 1000.0])
    assert actions == ["probe"] * 3 and restarts["start_time"] == 0


def test_a_later_start_time_is_a_restart_warmed_again():
    # a server restarted within a second of the last start (a CPU llama-server re-warms in 0.5 s)
    actions, restarts, _ = watch_all([1000.0, None, 1000.0 + 0.3])
    assert actions == ["probe", "probe", "rewarm"]
    assert restarts == {"start_time": 1, "came_back": 0}
