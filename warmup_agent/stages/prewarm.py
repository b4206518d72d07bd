"""Stage 2, pre-warm (PRELOAD -> PRIME): weights, tokenizer, fingerprint, warmup traffic.

The weight fingerprint taken here is checked again before SERVING.  The in-process
engines warm the prompt length x batch size grid (`warm_shape_grid`, warmup/shapes.py),
lengths configured, drawn or learned and batch sizes configured or derived from free
GPU memory; an engine that speaks the traffic profile is warmed by measured benefit
(`warm_profile`, stages/profile_warmup.py).  Every request is marked warmup, never user
traffic.  On a GPU the NVML utilisation ramp is sampled from here to the end of solidify.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from exporter.recorder import LoadStats
from warmup_agent.errors import EngineError
from warmup_agent.gpu import sizing
from warmup_agent.stages.context import StageContext
from warmup_agent.stages.profile_warmup import ProfileWarmup
from warmup_agent.states import State
from warmup_agent.warmup import benefit, memory_budget, traffic
from warmup_agent.warmup import shapes as shape_warmup
from warmup_agent.warmup.traffic import Shape, grid

if TYPE_CHECKING:  # types only
    from warmup_agent.config_sections import PrewarmSection
    from warmup_agent.engines.base import EngineFacts

log = logging.getLogger("warmup_agent.stages.prewarm")
# The learned shapes warmed before SERVING: those that hold this share of users' requests.
USERS_COVERAGE = 0.95


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
    """With prewarm.memory_budget_bytes set: the batch sizes whose cost, extrapolated
    from one shape (longest prompt, smallest batch), fits the budget."""
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
    """The traffic to warm: what users sent through the proxy (learned, readiness/
    traffic_memory.py) and prewarm.requests_file, merged where both exist; else the
    default (greedy and sampled on every API the server answers); limited to openai.api."""
    cfg, engine = ctx.cfg, ctx.engine
    path = cfg.prewarm.requests_file
    learned = ctx.readiness.traffic.profile.traffic_profile(USERS_COVERAGE) if ctx.readiness.traffic else None
    if path:
        text = engine.text
        if text is None:
            raise EngineError("invalid_config", "key 'prewarm.requests_file': prompts are counted with the model's "
                              "tokenizer; give --model DIR (model.path) with a tokenizer.json")
        profile = read_requests_file(ctx, text.count_chat, text.count_text)
        if learned is not None:
            profile = traffic.merged(profile, learned)
    elif learned is not None:
        profile = learned
    else:
        profile = traffic.default_profile(engine.apis, cfg.prewarm.max_output_tokens, [])
    if learned is not None:
        log.info(f"warming what users sent: {learned.source}, prompt lengths {learned.prompt_lengths}, "
                 f"answers up to {learned.max_tokens} tokens")
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
    """In-process engines: the prompt lengths of prewarm.requests_file (chat template and
    tokenizer), warmed in the grid so that solidify captures a prefill at each and a
    user's prompt is padded up to a captured length instead of prefilled eagerly."""
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


def warm_profile(ctx: StageContext, lengths: list[int], batches: list[int], detail: dict,
                 t_start: float) -> None:
    """Warm the traffic profile by measured benefit, under one time budget (a path it
    does not reach is skipped, and the record says so):
    1. every other family, endpoint and larger batch: one call each, at once, then their
       controls; a path cold beyond its control gets more (benefit.warm_wave);
    2. decode coverage of the profile's lengths (prewarm.decode_coverage always);
    3. the settle request, then the per-length test, which is the gate's first probe
       pair.  Where decode pays per length (decode_coverage auto) the lengths get decode
       coverage and the gate sends a new first pair.  The profile's prompt lengths get no
       call of their own (length_skip_reason).
    No anchor path precedes them: discovery's request already paid the server's
    one-time cost, and the probe pairs measure what a fresh length pays."""
    w = ProfileWarmup(ctx, load_profile(ctx, lengths), lengths, batches)
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
        assert ctx.probe_length is not None, "choose_probe_length ran"
        ctx.first_probe_tokens = w.answer_at(ctx.probe_length, w.profile.max_tokens)
    w.skip_lengths(per_length)
    w.record(per_length, coverage, batches, detail, t_start)
    detail["behind_users"] = [p.label for p in w.behind]
    detail["behind_users_lengths"] = list(w.behind_lengths)
    ctx.warm_behind = w.warm_behind if w.behind or w.behind_lengths else None


def run(ctx: StageContext, detail: dict) -> None:
    cfg, engine = ctx.cfg, ctx.engine
    ctx.move(State.PRELOAD)
    # A server engine's load_weights is the server's own start-up: its ramp starts once
    # the server is healthy, not beside its CUDA start.  NVML opens here either way, off
    # the path from the server's /health to its first request.
    server = engine.loads_by_starting_server
    _make_ramp(ctx)
    if not server:
        _start_ramp(ctx)

    clock = time.perf_counter
    # In-process: weights first, overlapping the background transformers import.  A
    # server engine: tokenizer first, loaded while the server (already spawned) starts.
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
        log.info(f"openai.apply_server_remedy: the server was started with {remedy}: {engine.remedy_why}")
        ctx.recorder.load(LoadStats(server_remedy=remedy))
        detail["server_remedy_applied"] = remedy
    elif engine.remedy_why is not None:
        log.info(f"openai.apply_server_remedy: the server was started without its remedy: {engine.remedy_why}")
    facts = engine.facts()
    ctx.engine_facts = vars(facts)
    quant = engine.quantization
    if quant is not None:
        ctx.recorder.load(LoadStats(quantization=quant.labels()))
        detail["quantization"] = quant.as_dict()
    report = engine.load_report
    if report is not None:
        detail["weight_load"] = report.as_dict()
        ctx.recorder.load(LoadStats(weight_bytes=report.bytes, weight_seconds=report.seconds))
    if engine.skeleton_wait_seconds is not None:
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
    calls stop getting faster (warmup/shapes.py).  Sets ctx.warmed_shapes and
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
