"""The context a server gives each concurrent request (warmup_agent/server/context.py,
issue 72 part 3): read from the server where it says, else from its command line; the
profile warmup sizes what it sends together to it, and leaves out a prompt length that
can never fit with one log line."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from warmup_agent import config
from warmup_agent.engines.base import RequestResult
from warmup_agent.server.context import SPARE, ServerContext, from_command, from_model_entry, from_props, of_server
from warmup_agent.stages.profile_warmup import ProfileWarmup
from warmup_agent.warmup import traffic

# What the vendored llama-server (llama-cpp-python 0.3.36) answers on GET /props with
# -c 2048 and its automatic slots: 4 slots, one unified pool, each slot's context the pool's.
LLAMA_PROPS = {"default_generation_settings": {"params": {}, "n_ctx": 2048}, "total_slots": 4,
               "model_alias": "tiny", "is_sleeping": False}
LLAMA = ["llama-server", "-m", "m.gguf", "-c", "2048", "--port", "8080"]
VLLM = ["python", "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "/m", "--max-model-len", "256"]


@pytest.mark.parametrize("command, per_request, shared", [
    (LLAMA, 2048, 2048),                                          # automatic slots: one pool, shared
    ([*LLAMA, "-np", "2"], 1024, 2048),                           # a pool per slot: its share
    (["llama-server", "-m", "m.gguf", "--ctx-size=4096", "--parallel", "4"], 1024, 4096),
    (VLLM, 256, None),                                            # each request its max_model_len
    (["vllm", "serve", "/m", "--max-model-len", "2K"], 2048, None),
    (["vllm", "serve", "/m", "--max-model-len", "2k"], 2000, None),
    (["python3", "-m", "sglang.launch_server", "--context-length", "8192"], 8192, None),
])
def test_the_command_line_says_the_context_through_the_kinds_table(command, per_request, shared):
    said = from_command(command)
    assert said == ServerContext(per_request, shared, "its command line")


@pytest.mark.parametrize("command", [
    ["llama-server", "-m", "m.gguf"],                  # the model's own: only the server knows
    ["llama-server", "-m", "m.gguf", "-c", "0"],       # 0: the model's own
    ["vllm", "serve", "/m", "--max-model-len", "auto"],
    ["transformers", "serve", "/m"],                   # a kind without a context option
    ["my-server", "-c", "2048"],                       # not a kind of the table
    None,
])
def test_a_command_line_that_does_not_say(command):
    assert from_command(command) is None


def test_four_at_once_share_llama_servers_pool_and_one_alone_has_it_all():
    fit = of_server(LLAMA_PROPS, None, LLAMA)
    assert fit is not None and fit.source == "the server and its command line"
    # each request keeps SPARE tokens aside (the server may count its prompt a little longer)
    assert SPARE == 4 and (fit.each(1), fit.each(2), fit.each(4)) == (2044, 1020, 508)
    # the failed start: 4 concurrent 600-token prompts with 2-token answers
    assert not fit.fits([602] * 4) and fit.fits([602] * 3) and fit.fits([506 + 2] * 4)
    assert not fit.fits([507 + 2] * 4) and not fit.fits([2045])
    assert fit.prompt_for(4, 600, 2) == 506 and fit.prompt_for(2, 600, 2) == 600
    assert fit.prompt_for(1, 3000, 8) == 2036


def test_the_server_alone_says_enough_and_its_word_comes_first():
    # openai.url: no command line; the slots share the slot's context (the automatic pool)
    fit = of_server(LLAMA_PROPS, None, None)
    assert fit == ServerContext(2048, 2048, "the server") and fit.each(4) == 508
    # a pool per slot (-np 4 -c 8192): the slot's 2048 each, 4 at once
    per_slot = of_server({**LLAMA_PROPS, "default_generation_settings": {"n_ctx": 2048}}, None,
                         ["llama-server", "-m", "m.gguf", "-c", "8192", "-np", "4"])
    assert per_slot is not None and per_slot.each(4) == 2044 and per_slot.each(1) == 2044
    # a slot capped below -c (by the model's training context): the server's word wins
    capped = of_server({"default_generation_settings": {"n_ctx": 512}, "total_slots": 1}, None, LLAMA)
    assert capped is not None and capped.each(1) == 508
    # vLLM's /v1/models
    vllm = of_server(None, {"id": "tiny", "object": "model", "max_model_len": 256}, VLLM)
    assert vllm == ServerContext(256, None, "the server") and vllm.each(4) == 252
    assert from_model_entry({"id": "m", "meta": {"n_ctx": 1024, "n_ctx_train": 2048}}) == 1024
    assert from_props({"total_slots": "x"}) == (None, None) and from_props(None) == (None, None)
    # neither says: nothing is sized
    assert of_server(None, {"id": "m"}, ["transformers", "serve", "/m"]) is None
    assert ServerContext(None).each(4) is None and ServerContext(None).prompt_for(4, 600, 2) == 600


def test_prompt_for_is_none_where_not_even_the_answer_fits():
    assert ServerContext(64, 64).prompt_for(4, 600, 12) is None
    assert ServerContext(64, 64).prompt_for(4, 600, 11) == 1


class _Driver:
    """Answers every request at once; keeps each group sent together."""

    def __init__(self) -> None:
        self.groups: list[list[traffic.WarmRequest]] = []

    def send(self, reqs, kind, give_way=None):
        self.groups.append(list(reqs))
        return [RequestResult(0.01, 0.02, r.prompt_tokens, r.max_tokens) for r in reqs]


def _warmup(fit: ServerContext | None, lengths: list[int]) -> tuple[ProfileWarmup, _Driver]:
    cfg = config.load(env={"WARMUP_AGENT_PREWARM_BEHIND_USERS": "false"})    # the batches now, not after SERVING
    driver = _Driver()
    profile = traffic.TrafficProfile(endpoints=["chat"], families={"sampled": {"temperature": 0.7},
                                                                   "greedy": {"temperature": 0.0}},
                                     prompt_lengths=lengths, max_tokens=16, source="requests.jsonl")
    ctx = SimpleNamespace(cfg=cfg, driver=driver, recorder=SimpleNamespace(warmup=lambda stats: None),
                          progress=SimpleNamespace(step=lambda *a: None), checkpoint=lambda: None, users_first=None,
                          engine=SimpleNamespace(server_start_seconds=1.0, concurrency=4, text=None,
                                                 server_context=fit))
    return ProfileWarmup(ctx, profile, [16], [1, 2, 4]), driver


def test_requests_sent_together_fit_the_servers_context():
    """The issue's start: a requests file of 600-token prompts, batches 1, 2 and 4, 4 slots
    sharing -c 2048.  Every group sent together fits; the batch of 4 sends prompts of 506."""
    fit = of_server(LLAMA_PROPS, None, LLAMA)
    w, driver = _warmup(fit, [600])
    w.other_paths([1, 2, 4])
    assert driver.groups and all(fit.fits(r.prompt_tokens + r.max_tokens for r in g) for g in driver.groups)
    assert {(len(g), g[0].prompt_tokens) for g in driver.groups if len(set(g)) == 1 and len(g) == 4} == {(4, 506)}
    labels = {o.path.label for o in w.outcomes}
    assert "chat/sampled/batch4/len506" in labels and "chat/sampled/batch2/len600" in labels
    w.decode_coverage()                       # 16-token answers after 600-token prompts fit one slot
    assert all(fit.fits(r.prompt_tokens + r.max_tokens for r in g) for g in driver.groups)
    # without the server's context the same warmup overflows it (what failed the start)
    w, driver = _warmup(None, [600])
    w.other_paths([1, 2, 4])
    assert any(not fit.fits(r.prompt_tokens + r.max_tokens for r in g) for g in driver.groups)


def test_a_prompt_that_never_fits_is_left_out_with_one_log_line(caplog):
    fit = ServerContext(2048, 2048, "the server")
    with caplog.at_level(logging.WARNING, logger="warmup_agent.stages.prewarm"):
        w, driver = _warmup(fit, [300, 600, 3000])
    lines = [r.getMessage() for r in caplog.records if "never fit" in r.getMessage()]
    assert len(lines) == 1 and "[3000]" in lines[0] and "requests.jsonl" in lines[0]
    assert w.plens == [300, 600] and w.hi == 600 and w.dropped_lengths == [3000]
    # none of the traffic's lengths fits: the grid's that do
    w, _ = _warmup(ServerContext(256, None, "the server"), [600, 3000])
    assert w.plens == [16]
    # a group that does not fit is shortened to its share, the answer first
    reqs = w.fitted([traffic.WarmRequest("chat", 250, 16, "sampled")] * 2)
    assert [(r.prompt_tokens, r.max_tokens) for r in reqs] == [(250, 2)] * 2 and w.resized == 2
    reqs = w.fitted([traffic.WarmRequest("chat", 300, 16, "sampled")])
    assert [(r.prompt_tokens, r.max_tokens) for r in reqs] == [(251, 1)]
