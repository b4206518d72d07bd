"""What users send, learned as shapes (warmup/learned.py) and kept (readiness/traffic_memory.py),
issue 72: bounded whatever the traffic, never text, persisted atomically, shared through
a real Redis (signed), and turned into the traffic profile the warm-up sends."""
from __future__ import annotations

import json
import os
import random

from exporter.metrics import AgentMetrics
from exporter.recorder import Recorder
from tests.test_per_length_finding import SECRET, kernel_cache
from warmup_agent.kernel_cache.shared_findings import SharedFindings
from warmup_agent.readiness.traffic_memory import TrafficMemory
from warmup_agent.warmup.learned import MAX_BINS, LearnedProfile, Shape, estimate_tokens, shape_of

MARKER = "zebra-quartz-7731"


def traffic(rng: random.Random, n: int):
    """n requests of a service: mostly ~600-token chats, some short completions."""
    for _ in range(n):
        if rng.random() < 0.8:
            yield Shape("chat", "sampled", int(rng.gauss(600, 60)), rng.choice((128, 256)), True,
                        rng.randint(20, 120), "my-model")
        else:
            yield Shape("completions", "greedy", rng.randint(8, 64), 16, False, 16, "my-model")


def test_the_profile_stays_the_same_size_after_10000_requests_as_after_1000():
    rng = random.Random(72)
    p = LearnedProfile()
    for s in traffic(rng, 1000):
        p.observe(s, {"temperature": 0.7})
    size_1k, bins_1k = len(json.dumps(p.to_dict())), len(p)
    for s in traffic(rng, 9000):
        p.observe(s, {"temperature": 0.7})
    assert p.seen == 10_000
    # a few rare lengths (the tails of the traffic) add a bin or three, and decay takes them again
    assert len(p) <= 1.25 * bins_1k + 2 and len(json.dumps(p.to_dict())) <= 1.3 * size_1k, (len(p), bins_1k)
    bins_10k, size_10k = len(p), len(json.dumps(p.to_dict()))
    for s in traffic(rng, 40_000):
        p.observe(s, {"temperature": 0.7})
    assert len(p) <= bins_10k + 2 and len(json.dumps(p.to_dict())) <= 1.1 * size_10k, (len(p), bins_10k)
    # traffic made to defeat the bins (a new max_tokens each time) is bounded too
    for i in range(5 * MAX_BINS):
        p.observe(Shape("chat", "sampled", 100, 1000 + i, True))
    assert len(p) <= MAX_BINS


def test_what_is_warmed_is_what_users_sent():
    p = LearnedProfile()
    for s in traffic(random.Random(1), 2000):
        p.observe(s, {"temperature": 0.7, "top_p": 0.9})
    prof = p.traffic_profile(coverage=0.5)
    assert prof is not None and prof.endpoints == ["chat"] and list(prof.families) == ["sampled"]
    assert prof.families["sampled"]["temperature"] == 0.7
    # half the requests are ~600-token chats: the heaviest bins, all of them
    assert all(450 <= n <= 800 for n in prof.prompt_lengths), prof.prompt_lengths
    most = p.traffic_profile(coverage=0.9)
    assert most.endpoints[0] == "chat" and any(500 <= n <= 700 for n in most.prompt_lengths)
    whole = p.traffic_profile(coverage=1.0)
    assert "completions" in whole.endpoints and min(whole.prompt_lengths) <= 64
    assert LearnedProfile().traffic_profile() is None


def test_a_shape_holds_no_text():
    body = {"model": "m", "messages": [{"role": "user", "content": MARKER * 40}], "max_tokens": 32,
            "temperature": 0.5, "stop": [MARKER], "stream": True, "user": MARKER,
            "response_format": {"type": "json_schema", "json_schema": {"name": MARKER}}}
    shape, params = shape_of("chat", body, None, 12)
    assert shape.prompt_tokens == estimate_tokens(body) > 100 and shape.max_tokens == 32 and shape.stream
    p = LearnedProfile()
    p.observe(shape, params)
    dumped = json.dumps(p.to_dict()) + repr(p.traffic_profile())
    assert MARKER not in dumped
    assert shape_of("completions", {"prompt": [1, 2, 3]}, None, None)[0].prompt_tokens == 3
    assert shape_of("chat", body, 377, 12)[0].prompt_tokens == 377        # the server's count wins


def test_kept_in_the_data_dir_and_shared_through_redis(tmp_path, redis_server):
    rec = Recorder(AgentMetrics())
    shared = SharedFindings.from_config(kernel_cache(redis_server.url))
    a = TrafficMemory(str(tmp_path / "pod-a"), rec, shared, shared_key="m")
    for s in traffic(random.Random(2), 300):
        a.observe(s, {"temperature": 0.7})
    a.stop()
    saved = os.listdir(tmp_path / "pod-a")
    assert saved == ["learned_profile.json"], saved          # the temporary file renamed in place
    # the same data dir: a restart, a wake, a new start
    again = TrafficMemory(str(tmp_path / "pod-a"), rec, None, shared_key="m")
    assert again.profile.seen == 300 and len(again.profile) == len(a.profile)
    # a new pod, its data dir empty, sharing the first one's Redis
    b = TrafficMemory(str(tmp_path / "pod-b"), rec, SharedFindings.from_config(kernel_cache(redis_server.url)),
                      shared_key="m")
    assert b.profile.seen == 300
    assert b.profile.traffic_profile(1.0).prompt_lengths == a.profile.traffic_profile(1.0).prompt_lengths
    # another secret: not trusted, not used
    c = TrafficMemory(str(tmp_path / "pod-c"), rec, SharedFindings.from_config(
        kernel_cache(redis_server.url, secret="another secret of 32 bytes......")), shared_key="m")
    assert c.profile.seen == 0
    assert SECRET
    # exported: its size and the time of its newest request
    reg = rec.metrics.registry
    assert reg.get_sample_value("warmup_learned_profile_shapes") == len(c.profile) == 0
    assert reg.get_sample_value("warmup_learned_profile_updated_timestamp_seconds") == a.profile.updated_at


def test_a_damaged_file_is_a_fresh_profile(tmp_path):
    (tmp_path / "learned_profile.json").write_text("{not json")
    assert LearnedProfile.load(str(tmp_path)) is None
    memory = TrafficMemory(str(tmp_path), Recorder(AgentMetrics()))
    assert memory.profile.seen == 0


def test_watch_probes_send_the_lengths_users_send_in_turn(embedded_model, tmp_path):
    """Issue 72: after SERVING, a quiet spell must not let the users' paths go cold, so
    the watch probes take the learned prompt lengths in turn (before any user: None, the
    probe length prewarm chose)."""
    from tests.test_proxy import make_agent
    from warmup_agent.states import State
    agent = make_agent(embedded_model, State.SERVING)
    assert agent._watch_length() is None
    agent.readiness.traffic = TrafficMemory(str(tmp_path), agent.recorder)
    for s in traffic(random.Random(3), 500):
        agent.readiness.traffic.observe(s)
    wanted = agent.readiness.traffic.profile.traffic_profile(0.95).prompt_lengths
    sent = [agent._watch_length() for _ in range(2 * len(wanted))]
    assert sorted(set(sent)) == sorted(wanted) and len(wanted) >= 2
