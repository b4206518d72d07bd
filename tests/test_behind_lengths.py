"""Behind the users, the users' whole length range (issue 71, item 2): where each new
prompt length pays (the per-length test's second fresh length paid as its first did), no
length is warmed before SERVING, and after it one 1-token request goes to each 16-token
block of the users' range that nothing reached yet, one at a time, each only when the
users are quiet.  A first user request at a new length then meets a warmed block."""
from __future__ import annotations

from types import SimpleNamespace

from warmup_agent.stages.profile_warmup import LENGTH_BLOCK_TOKENS, ProfileWarmup, length_blocks
from warmup_agent.warmup import benefit


def test_one_length_in_each_block_the_range_reaches_and_nothing_reached():
    assert LENGTH_BLOCK_TOKENS == 16
    # 50..130 reaches the blocks 48-63, 64-79, ... 128-143; 64 (a probe) covers its own
    assert length_blocks(50, 130, [64]) == [56, 88, 104, 120, 130]
    assert length_blocks(16, 31, []) == [24]
    assert length_blocks(16, 31, [17]) == []
    assert length_blocks(100, 100, []) == [100]             # one length: itself


def warmup(behind_users: bool, sent: list, quiet: list) -> ProfileWarmup:
    w = object.__new__(ProfileWarmup)
    w.pc = SimpleNamespace(behind_users=behind_users)
    w.ep0, w.fam0, w.b0, w.answer = "chat", "sampled", 1, 2
    w.lo, w.hi = 40, 100
    w.plens = [40, 70, 100]
    w.decoded, w.outcomes, w.behind, w.behind_lengths = [(64, 72)], [], [], []
    w.sent, w.last, w.before_send, w.server_context = 0, [], None, None
    w.budget = benefit.Budget(1.0, "test")
    w.profile = SimpleNamespace(families={"sampled": {"temperature": 0.7}})
    w.ctx = SimpleNamespace(checkpoint=lambda: None, progress=SimpleNamespace(step=lambda *a: None),
                            driver=SimpleNamespace(send=lambda reqs, kind, give_way=None: sent.append(
                                [(r.prompt_tokens, r.max_tokens, kind, len(quiet)) for r in reqs]) or [None] * len(reqs)))
    return w


def test_where_each_length_pays_the_blocks_go_behind_the_users_one_at_a_time():
    sent: list = []
    quiet: list = []
    w = warmup(True, sent, quiet)
    w.skip_lengths({"prefill_pays_each_new_length": True, "lengths": [64, 90]})
    assert w.behind_lengths == [40, 56, 100]          # 64-79 (the warm-up's 64) and 80-95 (a probe's 90) reached
    assert sent == []                                  # nothing before SERVING
    done = w.warm_behind(lambda: quiet.append(1))
    assert done["lengths"] == [40, 56, 100]
    # one request each, 1 token, marked warmup, each after its own wait for quiet
    assert sent == [[(40, 1, "warmup", 1)], [(56, 1, "warmup", 2)], [(100, 1, "warmup", 3)]]
    assert w.behind_lengths == [] and w.before_send is None


def test_no_blocks_where_lengths_do_not_pay_or_nothing_goes_behind():
    for behind_users, per_length in ((True, {"prefill_pays_each_new_length": False}),
                                     (False, {"prefill_pays_each_new_length": True})):
        w = warmup(behind_users, [], [])
        w.skip_lengths(per_length)
        assert w.behind_lengths == []
        assert w.warm_behind(lambda: None) == {}
