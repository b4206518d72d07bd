"""Stage 2, pre-warm (PRELOAD -> PRIME): tokenizer, weights, synthetic traffic.

Weights load progressively on a GPU (warmup_agent/gpu/loader.py: forward
order, pinned staging, overlapped copies, integrity checks).  The weight
fingerprint is taken once they are loaded and checked again before SERVING.
The synthetic traffic generator (seed 003 §1) covers the prompt lengths
(configured, drawn from a Gaussian or learned from a sample of real prompts,
plus the power-of-two grid) x the batch sizes (configured, or derived from free
GPU memory and the real KV bytes per token, seed 000 §4.2); each shape gets a
prefill and prewarm.max_new_tokens - 1 decode steps, and every request is
marked as warmup so it never counts as user traffic.  On a GPU the NVML
utilisation ramp is sampled from here to the end of solidify.  An engine that
speaks the traffic profile (openai) is warmed by measured benefit instead
(`warm_profile`, warmup_agent/warmup/benefit.py).
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from exporter.recorder import LoadStats, WarmupStats
from warmup_agent.errors import EngineError
from warmup_agent.gpu import sizing
from warmup_agent.server.kinds import BY_NAME
from warmup_agent.stages.context import StageContext
from warmup_agent.states import State
from warmup_agent.warmup import benefit, findings, memory_budget, traffic
from warmup_agent.warmup import shapes as shape_warmup
from warmup_agent.warmup.traffic import Shape, grid

if TYPE_CHECKING:  # types only
    from warmup_agent.config_sections import PrewarmSection
    from warmup_agent.engines.base import EngineFacts
    from warmup_agent.engines.text_prompts import TextPrompts

log = logging.getLogger("warmup_agent.stages.prewarm")


def warmup_lengths(pc: PrewarmSection, tokenize: Callable[[str], list[int]]) -> list[int]:
    source = pc.length_source
    drawn: list[int] = []
    if source == "gaussian":
        drawn = traffic.gaussian_lengths(pc.sampled_lengths, pc.length_mean, pc.length_sd,
                                         max_length=pc.max_prompt_length or None)
    elif source == "sample_file":
        if not pc.prompts_file:
            raise EngineError("invalid_config", "key 'prewarm.prompts_file': length_source sample_file needs a file of real prompts")
        try:
            drawn = traffic.lengths_from_sample(pc.prompts_file, tokenize, pc.sampled_lengths)
        except ValueError as e:
            raise EngineError("invalid_config", f"key 'prewarm.prompts_file': {e}") from None
    extra = pc.max_prompt_length if source != "grid" else 0
    return traffic.warmup_lengths(pc.prompt_lengths, drawn, extra)


def warmup_batches(pc: PrewarmSection, facts: EngineFacts, free_bytes: int | None, max_length: int) -> list[int]:
    if pc.batch_sizes_from_memory and free_bytes and facts.kv_bytes_per_token:
        return sizing.batch_sizes_from_memory(free_bytes - (facts.weight_bytes or 0), facts.kv_bytes_per_token,
                                              max_length + pc.max_new_tokens, cap=pc.max_batch)
    return pc.batch_sizes


def _fit_budget(ctx: StageContext, lengths: list[int], batches: list[int], max_new: int) -> list[int]:
    """With prewarm.memory_budget_bytes set, measure one shape (the longest
    prompt at the smallest batch) and keep the batch sizes whose extrapolated
    cost fits the budget (warmup_agent/warmup/memory_budget.py)."""
    budget = ctx.cfg.prewarm.memory_budget_bytes
    if not budget:
        return batches
    prompts = ctx.driver.prompts
    assert prompts is not None, "prewarm makes the prompt factory before it measures"
    shape = Shape(max(lengths), min(batches))
    _, cost = memory_budget.measure_peak_rss(
        lambda: ctx.driver.send(prompts.batch(shape), "warmup", max_new_tokens=max_new))
    return memory_budget.plan(batches, shape.prompt_tokens, cost / (shape.batch * shape.prompt_tokens), budget).batches


def _make_ramp(ctx: StageContext) -> None:
    """The GPU-utilisation ramp's sampler (NVML opened), not yet sampling."""
    from warmup_agent.gpu.ramp import RampSampler
    ctx.ramp = None
    interval = ctx.cfg.gpu.ramp_sample_interval_seconds
    if ctx.gpu is not None and interval > 0:
        ctx.ramp = RampSampler.for_gpu(ctx.gpu.uuid, interval)


def _start_ramp(ctx: StageContext) -> None:
    if ctx.ramp is not None:
        ctx.ramp.start()


def load_profile(ctx: StageContext, lengths: list[int]) -> traffic.TrafficProfile:
    """The traffic to warm: learned from prewarm.requests_file, else the default
    (greedy and sampled on every API the server answers), limited to openai.api."""
    cfg, engine = ctx.cfg, ctx.engine
    path = cfg.prewarm.requests_file
    if path:
        text = engine.text
        if text is None:
            raise EngineError("invalid_config", "key 'prewarm.requests_file': prompts are counted with the model's "
                              "tokenizer; give --model DIR (model.path) with a tokenizer.json")
        profile = read_requests_file(ctx, text.count_chat, text.count_text)
    else:
        profile = traffic.default_profile(engine.apis, cfg.prewarm.max_output_tokens, [])
    missing = [e for e in profile.endpoints if e not in engine.apis]
    if missing:
        log.warning(f"the traffic uses {', '.join(missing)} but the server does not answer it: not warmed")
    profile.endpoints = [e for e in profile.endpoints if e in engine.apis] or list(engine.apis)
    return profile


def read_requests_file(ctx: StageContext, count_chat: Callable[[list[dict]], int],
                       count_text: Callable[[str], int]) -> traffic.TrafficProfile:
    """prewarm.requests_file as a traffic profile, its prompts counted by the given
    functions; a file that cannot be read is the configuration's error (one line)."""
    path = ctx.cfg.prewarm.requests_file
    assert path, "called with prewarm.requests_file set"
    try:
        return traffic.load_requests_file(path, count_chat, count_text, bad_lines=ctx.cfg.prewarm.requests_file_bad_lines)
    except ValueError as e:
        raise EngineError("invalid_config", f"key 'prewarm.requests_file': {e}") from None
    except Exception as e:  # noqa: BLE001 - a template error on a logged body
        raise EngineError("invalid_config", f"key 'prewarm.requests_file': {path}: {type(e).__name__}: {e}") from None


def traffic_lengths(ctx: StageContext) -> list[int]:
    """In-process engines: the prompt lengths of prewarm.requests_file, counted with the
    model's chat template and tokenizer, warmed in the shape grid like the configured
    lengths.  Solidify then captures a prefill per warmed length (native model), and a
    user's prompt is padded up to the shortest captured length that holds it
    (gpu/graphs.py) instead of prefilling eagerly at a length nothing ran: on a GPU a
    warm in-process engine served a request 11 tokens longer than any before at 1.4-1.9x
    steady (bench/results/gpu_inproc_proxy_h200_issue41_run1.json)."""
    from warmup_agent.engines.text_prompts import TextPrompts
    model_dir = ctx.engine.model_path
    if not model_dir or not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        log.warning("prewarm.requests_file: the model has no tokenizer.json to count its prompts with; "
                    "its lengths are not warmed")
        return []
    text = TextPrompts.from_model_dir(model_dir, "")
    count_chat = text.count_chat if text.has_chat_template else (
        lambda messages: text.count_text(" ".join(str(m.get("content", "")) for m in messages)))
    profile = read_requests_file(ctx, count_chat, text.count_text)
    log.info(f"prewarm.requests_file: warming its prompt lengths {profile.prompt_lengths} too")
    return list(profile.prompt_lengths)


def _refused(e: EngineError) -> bool:
    """The server answered the request with HTTP 4xx (it refuses what was asked),
    as opposed to failing or being unreachable."""
    return e.reason == "request_failed" and "HTTP 4" in e.message


#: Prompt tokens of a settle request (`_ProfileWarmup.settle`): a short chat turn, at
#: least SETTLE_OPENING_SHARE times the template's opening (settle_prompt_tokens).
SETTLE_PROMPT_TOKENS = 64
SETTLE_OPENING_SHARE = 12


def settle_prompt_tokens(text: TextPrompts | None) -> int:
    """The settle request's prompt length: short, yet long enough that the chat
    template's opening (the tokens every chat prompt begins with) is under a tenth of
    it.  llama-server gives a request the slot whose prompt it shares more than
    `--slot-prompt-similarity` (0.1) of, else the least recently used one.  A 27-token
    settle request shared 0.156 (the 4-5 opening tokens) with every slot, so it went
    to the slot of the last long request and waited 19-23 ms while the server saved
    that slot's prompt to its prompt cache; a request given the least recently used
    slot waited 2-3.6 ms (GPU, the server's own slot log in run 9's agent log; in run
    11 every agent request took the LRU slot, docs/benchmarks.md; 64 tokens took it on
    the CPU build too)."""
    opening = text.opening_tokens() if text is not None else 0
    return max(SETTLE_PROMPT_TOKENS, SETTLE_OPENING_SHARE * opening)


#: The length ladder (`_ProfileWarmup.ladder`, prewarm.length_ladder): its first rung, and
#: the ratio between rungs.
LADDER_FIRST, LADDER_RATIO = 48, 1.5


def ladder_lengths(hi: int) -> list[int]:
    """The rungs of the length ladder: LADDER_FIRST tokens up, LADDER_RATIO apart, to `hi`."""
    rungs: list[int] = []
    n = float(LADDER_FIRST)
    while round(n) <= hi:
        rungs.append(round(n))
        n *= LADDER_RATIO
    return rungs

# Why a prompt-length path got no call (the run record, /startupz).
NEW_LENGTHS_WARM = "the per-length test's fresh prompt lengths prefilled no slower than their controls"
EACH_NEW_LENGTH_PAYS = ("each prompt length pays once on this server, whatever else was warmed (the per-length "
                        "test's second fresh length paid as its first did): warming the profile's lengths would "
                        "not spare a user's first request at another length")
ONE_TIME_COST = ("the per-length test's first fresh length paid and its second did not: a one-time cost, "
                 "already paid")


def length_skip_reason(per_length: dict) -> str | None:
    """Why the profile's prompt lengths are not worth a call each, from the per-length
    test; None: warm them (the test did not run).  In every outcome of the test the
    calls would buy nothing: no fresh length paid; or one paid and the next did not (a
    one-time cost, paid); or each new length pays (llama.cpp and transformers
    serve: 20-40 ms at every length not seen before, so a user's first request at a
    length the warmup did not send pays it anyway)."""
    if not per_length.get("tested"):
        return None
    if not per_length.get("prefill_pays"):
        return NEW_LENGTHS_WARM
    return EACH_NEW_LENGTH_PAYS if per_length.get("prefill_pays_each_new_length") else ONE_TIME_COST


def remedy_for(server: str | None) -> str:
    """What removes a per-sequence-length decode cost, in the user's words."""
    kind = BY_NAME.get(server or "")
    if kind is not None and kind.remedy:
        return kind.remedy
    return ("the server's attention builds a plan per sequence length; for a PyTorch server set "
            "TORCH_CUDNN_SDPA_DEPRIORITIZED=1 in its environment, or keep prewarm.decode_coverage auto")


def per_length_line(decode_ratios: list[float], first_token_ratios: list[float], remedy: str) -> str:
    """The one log line of a server that pays per sequence length. The first tokens are
    named where the fresh lengths also prefilled slow: on `transformers serve` with its
    defaults a prompt length it had not seen cost 63-67 ms more to first token than the
    same length again (bench/results/diag_server_fresh_h200_default_run*.json), on every
    new length, not only the first request's; the agent's own test read 2-4x there."""
    line = ("the server pays per sequence length: decode at new lengths ran "
            + ", ".join(f"{r:.1f}x" for r in decode_ratios) + " its steady time per token")
    if first_token_ratios:
        line += (", and their first tokens came " + ", ".join(f"{r:.1f}x" for r in first_token_ratios)
                 + " its steady first token")
    return line + f"; remedy: {remedy}"


def warm_profile(ctx: StageContext, lengths: list[int], batches: list[int], detail: dict,
                 t_start: float) -> None:
    """Warm the traffic profile by measured benefit (warmup_agent/warmup/benefit.py):
    1. every family and endpoint other than the probes' and every larger batch size:
       one call each, as many at once as the server takes (engine.concurrency), then
       the same again as their controls; only a path whose first call was cold beyond
       its control gets more (benefit.warm_wave);
    2. decode coverage of the profile's lengths (prewarm.decode_coverage always);
    3. the settle request (discovery's request stands in for it where nothing was sent
       yet: settle_unless_discovery_did), then the per-length test, which is the gate's
       first probe pair:
       a first probe at a prompt length no request reached and its control (the same
       length again, after the same predecessor).  A cold first probe is followed by a
       second pair at another fresh length: together they say whether decode is slower
       at new sequence lengths than at the same length again by more than
       prewarm.per_length_ratio (the server pays per length: logged with its remedy,
       exported), and whether prefill pays at each new length or paid once.  Where
       decode pays (decode_coverage auto), the profile's lengths get decode coverage
       and the gate sends a new first pair.  The profile's prompt lengths get no call
       of their own: in every outcome of the test the call would buy nothing
       (length_skip_reason).
    All under one time budget; a path the budget did not reach is skipped, and the
    record says so.  A family the server refuses (HTTP 4xx) is skipped too: user
    requests of that family fail on it as well, warm or not.  Probes double as the last
    warmup and the warmup's last test as the first probe pair.

    There is no anchor path before them any more (a first call and its control at the
    longest profile prompt, the steady level): the server's first real request is
    discovery's (engines/openai/discovery.py), which pays its one-time cost, and the
    probe pair measures what a first request at a fresh length pays beyond its
    control, and a second pair tells a one-time cost from one each new length pays.
    On llama.cpp on a GPU the anchor's pair found nothing (46 ms against its
    control's 48 ms, then the probe pair 36 against 35;
    bench/results/gpu_server_llamacpp_h200_issue40_run4.json), and its
    two long requests and their settle cost 0.18-0.25 s of the 0.44-0.51 s between
    the server's /health and /readyz, where the bare server answers its first user
    0.13 s after /health."""
    w = _ProfileWarmup(ctx, load_profile(ctx, lengths), lengths, batches)
    # 1. the other paths, one call each, at once, then their controls
    w.other_paths(batches)
    # 2. decode coverage over the profile's lengths (always)
    coverage = w.decode_coverage(always_only=True)
    # 3. leave the server as a plain start leaves it, then the per-length test = the first probe pair
    w.settle_unless_discovery_did()
    w.choose_probe_length()
    per_length = w.per_length_test()
    if w.pc.decode_coverage == "auto" and per_length.get("pays"):
        coverage = w.decode_coverage()
        w.settle()
        ctx.first_pairs = []        # the gate sends a new first pair, with the profile's longest answer
        ctx.first_probe_tokens = w.profile.max_tokens
    w.skip_lengths(per_length)
    w.record(per_length, coverage, batches, detail, t_start)


class _ProfileWarmup:
    """The state of one `warm_profile`: the budget, the steady levels, what was sent
    and decoded, the outcome of every path, the families the server refuses."""

    def __init__(self, ctx: StageContext, profile: traffic.TrafficProfile, lengths: list[int], batches: list[int]):
        from warmup_agent.warmup.traffic import probe_endpoint, probe_family
        pc = ctx.cfg.prewarm
        self.ctx, self.pc = ctx, pc
        ctx.profile = self.profile = profile
        seconds, why = benefit.budget_for(ctx.engine.server_start_seconds, pc.budget_ratio, pc.budget_min_seconds,
                                          pc.budget_seconds)
        self.budget = benefit.Budget(seconds, why)
        ctx.recorder.warmup(WarmupStats(budget_seconds=seconds))
        self.tol, self.max_calls = pc.converge_tolerance, pc.max_calls_per_path
        self.answer = max(2, min(pc.warm_answer_tokens, profile.max_tokens))
        self.fam0 = probe_family(profile)
        self.ep0 = probe_endpoint(profile)
        self.b0 = min(batches) if batches else 1
        self.plens = sorted({*profile.prompt_lengths} or {*lengths})
        self.lo, self.hi = self.plens[0], self.plens[-1]
        self.steady = benefit.SteadyLevels()
        self.refused: dict[str, str] = {}
        self.decoded: list[tuple[int, int]] = []     # (prompt, prompt + answer) ranges decoded so far
        self.outcomes: list[benefit.Outcome] = []
        self.sent = 0
        #: How many requests the server serves at once: a wave's calls go out in chunks of it.
        self.concurrency = max(1, int(ctx.engine.concurrency))
        #: The last requests sent together: the predecessor a control must follow too.
        self.last: list[traffic.WarmRequest] = []
        self.replayed = 0       # requests re-sent as predecessors of controls
        self.replays = 0        # ... in this many sends
        self.settled = 0        # settle requests sent
        self.settle_tokens = settle_prompt_tokens(ctx.engine.text)
        self.settled_by_discovery = False  # discovery's request stood in for the first settle request

    def request(self, path: benefit.Path, tokens: int | None = None) -> traffic.WarmRequest:
        from warmup_agent.warmup.traffic import WarmRequest, _frozen
        tokens = self.answer if tokens is None else tokens
        return WarmRequest(path.endpoint, path.prompt_tokens, tokens, path.family,
                           _frozen(self.profile.families[path.family]))

    def send_requests(self, reqs: list[traffic.WarmRequest], label: str) -> list:
        """Send `reqs` together (fresh prompts every time); they become the predecessor.
        (The record's paths, per-length test, decode tiles and replays account for
        every request sent here: tests/helpers/warmup_record.py adds them up.)"""
        self.ctx.checkpoint()
        results = self.ctx.driver.send(reqs, "warmup")
        self.decoded += [(r.prompt_tokens, r.prompt_tokens + r.max_tokens) for r in reqs]
        self.last = list(reqs)
        self.sent += 1
        self.ctx.progress.step(self.sent, self.sent + 1, label)
        return results

    def send(self, path: benefit.Path, tokens: int | None = None) -> benefit.Call:
        req = self.request(path, tokens)
        return benefit.call_of(self.send_requests([req] * path.batch, f"{path.label} out={req.max_tokens}"))

    def send_wave(self, paths: Sequence[benefit.Path], tokens: dict[benefit.Path, int]) -> list[benefit.Call]:
        """One call per path, in chunks of as many requests as the server takes at once
        (a path's batch stays in one chunk); the Call of each path, in order."""
        calls: dict[int, benefit.Call] = {}
        chunk: list[int] = []

        def flush() -> None:
            if not chunk:
                return
            reqs = [self.request(paths[i], tokens.get(paths[i])) for i in chunk for _ in range(paths[i].batch)]
            results = self.send_requests(reqs, f"{len(chunk)} path(s) at once")
            at = 0
            for i in chunk:
                calls[i] = benefit.call_of(results[at:at + paths[i].batch])
                at += paths[i].batch
            chunk.clear()
        for i, p in enumerate(paths):
            if chunk and sum(paths[j].batch for j in chunk) + p.batch > self.concurrency:
                flush()
            chunk.append(i)
        flush()
        return [calls[i] for i in range(len(paths))]

    def replay_for(self, length: int, batch: int) -> Callable[[], None] | None:
        """What re-sends the last requests before a control, where a call of `length`
        tokens, `batch` at once, would not be as good a predecessor
        (benefit.harder_predecessor).  None: no replay needed."""
        last = list(self.last)
        if not last or not benefit.harder_predecessor(len(last), max(r.prompt_tokens for r in last), batch, length):
            return None
        return self._replay(last, "a control")

    def _replay(self, last: list[traffic.WarmRequest], before: str) -> Callable[[], None]:
        """What re-sends `last` (counted in the record's replays)."""
        def replay() -> None:
            self.send_requests(last, f"replay of {len(last)} request(s) before {before}")
            self.replayed += len(last)
            self.replays += 1
        return replay

    def replay_before_probe_control(self, length: int, batch: int) -> Callable[[], None] | None:
        """What re-sends the last requests (the settle request) before a probe's control,
        unless they were the probe's own shape.  Not only where they were harder
        (replay_for): on llama.cpp on a GPU a control right after its first probe (285
        prompt tokens) paid as much as the first did after the short settle request (39 ms
        against 37, 7 ms less prefill), because the next request pays for saving its
        predecessor's slot, so the pair said "not cold" where users met 1.3-1.6x steady
        (run at 544597f).  The settle request is one short request: re-sending it costs
        0.01-0.02 s."""
        last = list(self.last)
        if not last or (len(last) == batch and all(r.prompt_tokens == length for r in last)):
            return None
        return self._replay(last, "a probe's control")

    def settle(self) -> None:
        """The settle request: one short request (settle_prompt_tokens, one output token),
        alone.  The warmup leaves long prompts in the server's slots; on llama.cpp the next
        request after much longer ones pays 60-100 ms in its slot, warm or not (GPU: the
        first user request after the warmup's 854-928-token prompts came at 1.57x steady,
        after a plain start's one short request at 1.12x).  This request pays that
        instead, and the probes and the users' first request then follow the same short
        request (the ready stage sends it again just before SERVING).  One, not one per
        slot at once: a request right after concurrent ones pays for them too (issue 40),
        and the wave's two sends before the probes' control and at the end cost 0.06-0.08 s
        of a GPU llama.cpp start where one request costs 0.01-0.02 s."""
        self.send_requests([self.settle_request()], "settle: 1 short request")
        self.settled += 1

    def settle_request(self) -> traffic.WarmRequest:
        return self.request(benefit.Path(self.ep0, self.fam0, 1, self.settle_tokens), 1)

    def settle_unless_discovery_did(self) -> None:
        """The settle request, unless prewarm has sent nothing yet: then the server's
        last request was discovery's (engines/openai/discovery.py: a few prompt tokens,
        one output token, alone), which leaves the server as the settle request does.
        It becomes the predecessor a probe's control follows (a settle request is sent
        before the control instead of a replay).  On llama.cpp on a GPU the settle
        request right after discovery's took 35-40 ms of the time to ready."""
        if self.sent:
            self.settle()
        else:
            self.last = [self.settle_request()]
            self.settled_by_discovery = True

    def warm(self, path: benefit.Path, tokens: int | None = None) -> None:
        if path.family in self.refused:
            self.outcomes.append(benefit.Outcome(path, "skipped", f"the server refuses family {path.family}"))
            return
        try:
            self.outcomes.append(benefit.warm_path(path, lambda p: self.send(p, tokens), self.steady, self.budget,
                                                   self.tol, self.max_calls,
                                                   replay=self.replay_for(path.prompt_tokens, path.batch)))
        except EngineError as e:
            if not _refused(e) or path.family == self.fam0:
                raise
            self.refuse(path.family, e)
            self.outcomes.append(benefit.Outcome(path, "skipped", f"the server refuses family {path.family}"))

    def refuse(self, family: str, e: EngineError) -> None:
        self.refused[family] = e.message
        line = self.profile.family_lines.get(family)
        src = f" (first seen at {self.profile.source}:{line})" if line else ""
        log.warning(f"the server refuses sampling family {family}{src}: {e.message}")

    def warm_together(self, paths: list[benefit.Path], tokens: dict[benefit.Path, int]) -> None:
        """benefit.warm_wave over `paths`; a family the server refuses is found one path
        at a time (the wave cannot tell whose request was refused) and skipped."""
        paths = [p for p in paths if p.family not in self.refused]
        try:
            self.outcomes += benefit.warm_wave(paths, lambda ps: self.send_wave(ps, tokens),
                                               lambda p: self.send(p, tokens.get(p)), self.steady, self.budget,
                                               self.tol, self.max_calls)
        except EngineError as e:
            if not _refused(e):
                raise
            for p in paths:
                self.warm(p, tokens.get(p))

    def per_length_test(self) -> dict:
        """Does the server pay per sequence length?  Fresh prompt lengths, each with its
        control (the same length again, a fresh prompt, after the same predecessor): the
        gate's first probe pair at the probes' length, which no request reached
        (StageContext.probe_pair).  A first probe cold beyond its control paid either a
        one-time cost or one that each new length pays: a second probe pair at another
        fresh length tells which (each new length pays when both paid in prefill).  The
        probe pairs are the gate's first (StageContext.first_pairs).  One request at a
        time, because requests at once are batched into other shapes than a user's
        request alone."""
        ctx = self.ctx
        tokens = self.pc.per_length_tokens
        ctx.probe_log.restart()         # these probes are the gate's first

        def send(n: int | None) -> None:
            ctx.probe(max_tokens=n)
        probe_pairs, ctx.first_pairs = [], []
        assert ctx.probe_length is not None, "choose_probe_length runs first"
        known = self.remembered()
        if findings.skips_second_pair(known):
            assert known is not None
            return self.first_probe_alone(known, tokens)
        lengths: list[int] = [ctx.probe_length]
        pair, d = ctx.probe_pair(send, tokens, replay=True)
        probe_pairs.append(pair)
        ctx.first_pairs.append(d)
        ladder: list[int] = []      # prewarm.length_ladder, off by default (its key says why)
        if d["cold"] and self.pc.length_ladder and benefit.prefill_cold(pair, self.tol):
            ladder = self.ladder()
        fresh = benefit.fresh_lengths(self.lo, self.hi, [*self.decoded, (lengths[0], lengths[0] + tokens)], 1, tokens)[0]
        # Only inside the profile's range: a length above it may be past what the server takes.
        if d["cold"] and fresh <= self.hi:
            lengths.append(fresh)
            ctx.probe_length = fresh
            # The exported figures are this pair's: where each new length pays, its first
            # probe paid what a user's first request at a new length pays, without the
            # one-time costs the first pair's first probe may have paid too.  After a
            # ladder its first follows the settle request again, and so does its control.
            pair, d = ctx.probe_pair(send, tokens, replay=bool(ladder))
            probe_pairs.append(pair)
            ctx.first_pairs.append(d)
        fresh_cold = [benefit.prefill_cold(p, self.tol) for p in probe_pairs]
        each_length = len(fresh_cold) == 2 and all(fresh_cold)
        pairs = probe_pairs
        pays, ratios = benefit.pays_per_length(pairs, self.pc.per_length_ratio)
        cold = [benefit.prefill_cold(pair, self.tol) for pair in pairs]
        per_length = {"tested": True, "pays": pays, "ratios": ratios, "lengths": lengths,
                      "probe_pair": True,
                      "prefill_pays": any(cold),
                      # the second fresh length paid too, after the first was warm: each new
                      # length pays once, whatever else was warmed
                      "prefill_pays_each_new_length": each_length,
                      "pairs": [pair.as_dict() for pair in pairs],
                      # prompt lengths of the ladder sent between the two fresh lengths
                      "ladder": ladder,
                      # re-sent before the probe pairs' controls (also in ready's first_probe_pairs)
                      "replayed_requests": sum(d["replayed_requests"] for d in ctx.first_pairs)}
        if all(pair.first.server_prefill is not None and pair.control.server_prefill is not None for pair in pairs):
            per_length["server_prefill_ms"] = [[round(pair.first.server_prefill * 1e3, 3),  # type: ignore[operator]
                                                round(pair.control.server_prefill * 1e3, 3)]  # type: ignore[operator]
                                               for pair in pairs]
        self.keep_finding(per_length, pairs, None)
        remedy = remedy_for(ctx.engine.server_name) if pays else None
        ctx.recorder.warmup(WarmupStats(per_length_ratios=list(ratios), per_length_remedy=remedy))
        if remedy is not None:
            per_length["remedy"] = remedy
            first = [pair.first.ttft / pair.control.ttft for pair in pairs] if per_length["prefill_pays"] else []
            log.warning(per_length_line(ratios, first, remedy))
        return per_length

    def first_probe_alone(self, known: dict, tokens: int) -> dict:
        """The per-length test of a server measured before, where each new prompt length
        paid in prefill and decode did not pay per length (findings.skips_second_pair):
        the gate's first probe goes alone, at a length no request reached, as a user's
        first request will.  No control and no second pair: they would measure again what
        the finding says, and the first pair's control and the settle request re-sent
        before it cost 0.07-0.08 s of the 0.23-0.30 s between the server's /health and
        /readyz (llama.cpp on a GPU, docs/benchmarks.md, where that first pair was cold in every start
        that remembered).  The exported figures are 1 + the remembered excess; the gate
        opens on this probe's own time to first token and per output token, against the
        thresholds (ready: StageContext.first_probe_alone)."""
        ctx = self.ctx
        ctx.probe(max_tokens=tokens)
        ctx.first_probe_alone = True
        per_length: dict[str, Any] = {"tested": True, "pays": False, "ratios": [], "lengths": [ctx.probe_length],
                      "probe_pair": False, "prefill_pays": True, "prefill_pays_each_new_length": True,
                      "pairs": [], "ladder": [], "replayed_requests": 0}
        self.keep_finding(per_length, [], known)
        per_length["remembered"]["control"] = ("skipped: the first probe went alone, as the users' first request "
                                               "will; its control would measure what the finding says")
        ctx.recorder.warmup(WarmupStats(per_length_ratios=[], per_length_remedy=None))
        return per_length

    def keep_finding(self, per_length: dict, pairs: list[benefit.Controlled], skipped_for: dict | None) -> None:
        """The per-length test's outcome and the findings file: where both pairs ran and
        each new length paid, what the second fresh length paid beyond its control (a
        user's first request at a length nothing reached pays it; that first paid none of
        the start's one-time costs) goes with the outcome, which is remembered.  Where the
        second pair was skipped for the finding `skipped_for`, the gate's figures are the
        remembered excess, not the first pair's (readiness/probes.py), and the record says so."""
        if per_length["prefill_pays_each_new_length"] and len(pairs) == 2:
            per_length[findings.EXCESS] = pairs[1].excess()
        if skipped_for is None:
            if self.pc.remember_findings and len(pairs) == 2:
                self.remember(per_length)
            return
        excess = findings.excess_of(skipped_for)
        assert excess is not None, "skips_second_pair checked it"
        when = skipped_for.get("measured_at")
        self.ctx.probe_log.remembered_new_length({**excess, "measured_at": when})
        per_length["remembered"] = {"from": skipped_for["from"], "measured_at": when,
                                    "second_pair": "skipped: each new prompt length paid in prefill when "
                                                   "this server was measured before",
                                    findings.EXCESS: excess,
                                    "first_request_figures": "1 + what the second fresh length paid beyond "
                                                             "its control when this server was measured"}

    @functools.cached_property
    def _findings(self) -> tuple[findings.Findings, str, dict]:
        """The findings store (one Redis client, the secret read once, for both the read and
        the write of a start), this server's key and what names it."""
        ctx = self.ctx
        gpus = [str(g.get("name")) for g in ctx.host_facts.get("gpus", []) if isinstance(g, dict)]
        server, model = ctx.engine.server_name, ctx.engine.capabilities.get("model")
        key = findings.server_key(server, model, self.concurrency, gpus)
        about = {"server": server, "model": model, "concurrency": self.concurrency, "gpus": gpus}
        from warmup_agent.kernel_cache.shared_findings import SharedFindings
        return findings.Findings(ctx.cfg.data_dir, SharedFindings.from_config(ctx.cfg.kernel_cache)), key, about

    def remembered(self) -> dict | None:
        """This server's per-length outcome from an earlier start (prewarm.remember_findings)."""
        if not self.pc.remember_findings:
            return None
        store, key, _ = self._findings
        return store.get(key)

    def remember(self, per_length: dict) -> None:
        """Keep a whole per-length test's outcome (both pairs ran) for the next start."""
        store, key, about = self._findings
        store.put(key, per_length, about)

    def ladder(self) -> list[int]:
        """One request (one output token) at each rung of the length ladder, one at a
        time (requests sent together are prefilled as one batch of their summed length),
        then the settle request.  A new prompt length pays most where no request of a
        similar length has run yet: on llama.cpp on a GPU 6-13 ms more than the same
        length again without a ladder, 0-4.5 ms after one, and the first prompt over the
        short ones paid 40 ms (bench/results/diag_llamacpp_length_h200_run2.json).  Rungs
        no larger than the profile's longest prompt, each skipped where a request of
        that length was sent already or the budget ran out.  Returns the lengths sent."""
        sent: list[int] = []
        done = {a for a, _ in self.decoded}
        for n in ladder_lengths(self.hi):
            if n in done:
                continue
            if self.budget.exhausted():
                break
            self.send_requests([self.request(benefit.Path(self.ep0, self.fam0, 1, n), 1)], f"ladder: {n} tokens")
            sent.append(n)
        if sent:
            self.settle()
        return sent

    def other_paths(self, batches: list[int]) -> None:
        """Every other family and endpoint, every larger batch: one call each, together
        (benefit.warm_wave)."""
        from warmup_agent.warmup.benefit import Path
        profile, ep0, fam0, b0, hi = self.profile, self.ep0, self.fam0, self.b0, self.hi
        paths: list[Path] = [Path(ep0, fam, b0, hi) for fam in profile.families if fam != fam0]
        for ep in profile.endpoints:
            if ep != ep0:
                paths += [Path(ep, fam, b0, hi) for fam in profile.families if not (fam == "json_schema" and ep != "chat")]
        paths += [Path(ep0, fam0, b, hi) for b in sorted({*batches}) if b != b0]
        self.warm_together(paths, {})

    def skip_lengths(self, per_length: dict) -> None:
        """The profile's other prompt lengths, recorded as skipped with what the
        per-length test said about them (length_skip_reason)."""
        from warmup_agent.warmup.benefit import Path
        reason = length_skip_reason(per_length) or "the per-length test did not run"
        for n in reversed(self.plens):
            self.outcomes.append(benefit.Outcome(Path(self.ep0, self.fam0, self.b0, n), "skipped", reason))

    def decode_coverage(self, always_only: bool = False) -> dict:
        """Decode over the profile's lengths: with prewarm.decode_coverage always, or
        (not `always_only`) auto, which the caller sends once the per-length test found
        that the server pays per length."""
        from warmup_agent.warmup.benefit import Path
        from warmup_agent.warmup.traffic import decode_tiles
        budget, profile = self.budget, self.profile
        mode = self.pc.decode_coverage
        coverage: dict = {"mode": mode, "tiles": [], "skipped_tiles": []}
        if mode == "always" or (mode == "auto" and not always_only):
            for n in decode_tiles(self.plens, profile.max_tokens):
                if budget.exhausted():
                    coverage["skipped_tiles"].append(n)
                    continue
                self.send(Path(self.ep0, self.fam0, self.b0, n), profile.max_tokens)
                coverage["tiles"].append(n)
            if coverage["skipped_tiles"]:
                log.warning(f"warmup budget ({budget.seconds:.1f} s: {budget.why}) ran out before decode coverage of "
                            f"prompt lengths {coverage['skipped_tiles']}: the first answers from there may decode cold")
        return coverage

    def choose_probe_length(self) -> None:
        """The probes' length: a profile length no warmup request used, as a user's
        would be.  The probes ask for readiness.probe_max_tokens; where decode pays per
        sequence length the gate's new first probe asks for the profile's longest
        answer (warm_profile: its whole answer is then what the first user meets)."""
        used = {a for a, _ in self.decoded}
        probe_length = self.plens[len(self.plens) // 2]
        while probe_length in used:
            probe_length += 1
        self.ctx.probe_length = probe_length
        self.ctx.first_probe_tokens = None
        self.ctx.replay_for = self.replay_before_probe_control

    def record(self, per_length: dict, coverage: dict, batches: list[int], detail: dict, t_start: float) -> None:
        """The probes' length and answer, the paths' metrics, /startupz's summary, the record."""
        ctx, profile, budget, outcomes, refused = self.ctx, self.profile, self.budget, self.outcomes, self.refused
        used = {a for a, _ in self.decoded}
        probe_length = ctx.probe_length
        ctx.settle = self.settle
        ctx.decoded_ranges, ctx.profile_lengths = list(self.decoded), list(self.plens)
        counts = Counter(o.result for o in outcomes)
        ctx.recorder.warmup(WarmupStats(paths={result: counts[result] for result in
                                               ("warm_on_first_call", "converged", "still_improving", "skipped")}))
        skipped = [{"path": o.path.label, "reason": o.reason} for o in outcomes if o.result == "skipped"]
        ctx.warmup_summary = summary = {
            "budget": budget.as_dict(), "per_length": per_length, "decode_coverage": coverage, "paths": dict(counts),
            "skipped": skipped, "requests": self.sent, "probe_length": probe_length, "at_once": self.concurrency,
            "replayed_requests": self.replayed, "replays": self.replays, "settle_requests": self.settled,
            "settle_prompt_tokens": self.settle_tokens, "settled_by_discovery": self.settled_by_discovery,
            "ladder_requests": len(per_length.get("ladder", []))}
        if budget.exhausted():
            unreached = sum(1 for o in outcomes if o.result == "skipped" and o.reason == "budget")
            log.warning(f"warmup budget of {budget.seconds:.1f} s ({budget.why}) ran out: "
                        f"{unreached} path(s) not warmed; readiness probes decide")
        ctx.profile_summary = profile_summary = {
            "source": profile.source, "requests_seen": profile.requests_seen, "endpoints": profile.endpoints,
            "families": sorted(f for f in profile.families if f not in refused), "refused_families": refused,
            "prompt_lengths": profile.prompt_lengths, "max_tokens": profile.max_tokens,
            "bad_lines": profile.bad_lines, "capabilities": dict(ctx.engine.capabilities)}
        detail.update(shapes=len({(o.path.prompt_tokens, o.path.batch) for o in outcomes if o.calls}),
                      requests=ctx.driver.warmup_requests, lengths=sorted(used), batches=batches,
                      profile=profile_summary, warmup=summary, paths=[o.as_dict() for o in outcomes],
                      seconds={"traffic": time.perf_counter() - t_start})
        ctx.warmed_shapes = sorted({(o.path.prompt_tokens, o.path.batch) for o in outcomes if o.calls})


def run(ctx: StageContext, detail: dict) -> None:
    cfg, engine = ctx.cfg, ctx.engine
    ctx.move(State.PRELOAD)
    # A server engine's load_weights is the server's own start-up, not warmup: its
    # ramp starts once the server is healthy. Also, NVML read every 50 ms from here
    # would run beside the server creating its CUDA context, for nothing the ramp uses.
    server = engine.loads_by_starting_server
    # NVML is opened here either way: not on the way from the server's /health to its
    # first request.
    _make_ramp(ctx)
    if not server:
        _start_ramp(ctx)

    clock = time.perf_counter
    # Weights before the tokenizer: the engine reads them while transformers is
    # still being imported in the background (torch engine), so the import is
    # paid once, overlapped, instead of before the weights.  A server engine's
    # tokenizer comes first: it loads while the server (spawned before the stages)
    # starts, instead of after it is healthy, on the way to the first request.
    steps = {"tokenizer": engine.load_tokenizer, "weights": engine.load_weights}
    seconds: dict[str, float] = {}
    for name in (("tokenizer", "weights") if server else ("weights", "tokenizer")):
        t = clock()
        steps[name]()
        ctx.checkpoint()
        seconds[name] = clock() - t
        if server and name == "weights":
            _start_ramp(ctx)
    remedy = " ".join(f"{k}={v}" for k, v in sorted(engine.applied_remedy.items()))
    if remedy:
        log.info(f"openai.apply_server_remedy: the server was started with {remedy} "
                 f"({engine.server_name} pays per sequence length without it)")
        ctx.recorder.load(LoadStats(server_remedy=remedy))
        detail["server_remedy_applied"] = remedy
    facts = engine.facts()
    ctx.engine_facts = vars(facts)
    quant = engine.quantization     # warmup_agent/quantization/ (issue 16)
    if quant is not None:
        ctx.recorder.load(LoadStats(quantization=quant.labels()))
        detail["quantization"] = quant.as_dict()
    report = engine.load_report
    if report is not None:
        detail["weight_load"] = report.as_dict()
        ctx.recorder.load(LoadStats(weight_bytes=report.bytes, weight_seconds=report.seconds))
    if engine.skeleton_wait_seconds is not None:
        # the wait for the background import + skeleton: transformers' on that path, torch alone on the native one
        detail["waited_for_skeleton_seconds"] = engine.skeleton_wait_seconds
    t = clock()
    ctx.sm.record_fingerprint(engine.weight_fingerprint())
    seconds["fingerprint"] = clock() - t
    t3 = clock()

    ctx.driver.start_prompts()
    lengths = warmup_lengths(cfg.prewarm, engine.tokenize)
    if not engine.speaks_profile and cfg.prewarm.requests_file:
        lengths = sorted({*lengths, *traffic_lengths(ctx)})
    batches = warmup_batches(cfg.prewarm, facts, ctx.gpu_free_bytes, max(lengths))
    if engine.speaks_profile:
        warm_profile(ctx, lengths, batches, detail, t3)
        detail["seconds"].update(seconds)
    else:
        warm_shape_grid(ctx, lengths, batches, detail)
        detail["seconds"] = {**seconds, "traffic": clock() - t3}
    ctx.move(State.PRIME)


def warm_shape_grid(ctx: StageContext, lengths: list[int], batches: list[int], detail: dict) -> None:
    """The in-process engines' (prompt length x batch size) grid, each shape until its
    calls stop getting faster or match the steady level (warmup_agent/warmup/shapes.py,
    issue 25; prewarm.requests_per_shape raises the cap).  Sets ctx.warmed_shapes and
    ctx.replay_for (the last shape, re-sent before the first probe's control)."""
    cfg, prompts = ctx.cfg, ctx.driver.prompts
    assert prompts is not None, "prewarm makes the prompt factory before the grid"
    max_new = cfg.prewarm.max_new_tokens
    try:
        batches = _fit_budget(ctx, lengths, batches, max_new)
        shapes = grid(lengths, batches)
        backoff = memory_budget.BackOff()   # a shape that runs out of memory drops its batch size and larger ones
        cap = max(cfg.prewarm.requests_per_shape, cfg.prewarm.max_calls_per_path)
        done = 0
        last: list[Shape] = []        # the predecessor of the first probe

        def send_shape(shape: Shape) -> shape_warmup.Call:
            nonlocal done
            ctx.checkpoint()
            results = backoff.run(shape.batch, lambda: ctx.driver.send(prompts.batch(shape), "warmup", max_new_tokens=max_new))
            if results is None:
                raise shape_warmup.Dropped(f"batch {shape.batch} dropped: out of memory")
            last[:] = [shape]
            done += 1
            ctx.progress.step(done, max(len(shapes), done + 1), f"len={shape.prompt_tokens} batch={shape.batch}")
            return benefit.call_of(results)
        outcomes = shape_warmup.warm_grid(shapes, send_shape, cfg.prewarm.converge_tolerance, cap)
        warmed = [s for s, o in zip(shapes, outcomes, strict=True) if o.calls and backoff.allows(s.batch)]
        detail.update(warmup=shape_warmup.summary(outcomes), paths=[o.as_dict() for o in outcomes])
    except memory_budget.BudgetExceeded as e:
        ctx.fail(e.reason, str(e))
    detail.update(shapes=len(warmed), requests=ctx.driver.warmup_requests, lengths=lengths, batches=batches,
                  dropped_batches=sorted({s.batch for s in shapes} - {s.batch for s in warmed}))
    ctx.warmed_shapes = [(s.prompt_tokens, s.batch) for s in warmed]

    def replay_for(length: int, batch: int) -> Callable[[], None] | None:
        if not last or not benefit.harder_predecessor(last[0].batch, last[0].prompt_tokens, batch, length):
            return None
        shape = last[0]

        def replay() -> None:
            try:
                send_shape(shape)
            except shape_warmup.Dropped:
                pass        # out of memory now: the control follows what the first probe followed anyway
        return replay
    ctx.replay_for = replay_for
