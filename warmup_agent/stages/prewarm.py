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
utilisation ramp is sampled from here to the end of solidify.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from warmup_agent import memory_budget, traffic
from warmup_agent.errors import EngineError
from warmup_agent.gpu import sizing
from warmup_agent.stages.context import StageContext
from warmup_agent.states import State
from warmup_agent.traffic import PromptFactory, Shape, grid

if TYPE_CHECKING:  # types only: pipeline imports the stages
    from warmup_agent.pipeline import Agent

log = logging.getLogger("warmup_agent.stages.prewarm")


def warmup_lengths(cfg, tokenize) -> list[int]:
    source = cfg["prewarm.length_source"]
    drawn: list[int] = []
    if source == "gaussian":
        drawn = traffic.gaussian_lengths(cfg["prewarm.sampled_lengths"], cfg["prewarm.length_mean"], cfg["prewarm.length_sd"],
                                         max_length=cfg["prewarm.max_prompt_length"] or None)
    elif source == "sample_file":
        if not cfg["prewarm.prompts_file"]:
            raise EngineError("invalid_config", "key 'prewarm.prompts_file': length_source sample_file needs a file of real prompts")
        try:
            drawn = traffic.lengths_from_sample(cfg["prewarm.prompts_file"], tokenize, cfg["prewarm.sampled_lengths"])
        except ValueError as e:
            raise EngineError("invalid_config", f"key 'prewarm.prompts_file': {e}") from None
    extra = cfg["prewarm.max_prompt_length"] if source != "grid" else 0
    return traffic.warmup_lengths(cfg["prewarm.prompt_lengths"], drawn, extra)


def warmup_batches(cfg, facts, free_bytes: int | None, max_length: int) -> list[int]:
    if cfg["prewarm.batch_sizes_from_memory"] and free_bytes and facts.kv_bytes_per_token:
        return sizing.batch_sizes_from_memory(free_bytes - (facts.weight_bytes or 0), facts.kv_bytes_per_token,
                                              max_length + cfg["prewarm.max_new_tokens"], cap=cfg["prewarm.max_batch"])
    return cfg["prewarm.batch_sizes"]


def _fit_budget(agent: Agent, lengths: list[int], batches: list[int], max_new: int) -> list[int]:
    """With prewarm.memory_budget_bytes set, measure one shape (the longest
    prompt at the smallest batch) and keep the batch sizes whose extrapolated
    cost fits the budget (warmup_agent/memory_budget.py)."""
    budget = agent.cfg["prewarm.memory_budget_bytes"]
    if not budget:
        return batches
    prompts = agent.prompts
    assert prompts is not None, "prewarm makes the prompt factory before it measures"
    shape = Shape(max(lengths), min(batches))
    _, cost = memory_budget.measure_peak_rss(
        lambda: agent.send(prompts.batch(shape), "warmup", max_new_tokens=max_new))
    return memory_budget.plan(batches, shape.prompt_tokens, cost / (shape.batch * shape.prompt_tokens), budget).batches


def _start_ramp(agent: Agent, ctx: StageContext) -> None:
    from warmup_agent.gpu.ramp import RampSampler
    ctx.ramp = None
    interval = agent.cfg["gpu.ramp_sample_interval_seconds"]
    if ctx.gpu is not None and interval > 0:
        ctx.ramp = RampSampler.for_gpu(ctx.gpu.uuid, interval)
        if ctx.ramp is not None:
            ctx.ramp.start()


def load_profile(agent: Agent, lengths: list[int]) -> traffic.TrafficProfile:
    """The traffic to warm: learned from prewarm.requests_file, else the default
    (greedy and sampled on every API the server answers), limited to openai.api."""
    cfg, engine = agent.cfg, agent.engine
    path = cfg["prewarm.requests_file"]
    if path:
        text = engine.text
        if text is None:
            raise EngineError("invalid_config", "key 'prewarm.requests_file': prompts are counted with the model's "
                              "tokenizer; give --model DIR (model.path) with a tokenizer.json")
        try:
            profile = traffic.load_requests_file(path, text.count_chat, text.count_text)
        except ValueError as e:
            raise EngineError("invalid_config", f"key 'prewarm.requests_file': {e}") from None
        except Exception as e:  # noqa: BLE001 - a template error on a logged body
            raise EngineError("invalid_config", f"key 'prewarm.requests_file': {path}: {type(e).__name__}: {e}") from None
    else:
        profile = traffic.default_profile(engine.apis, cfg["prewarm.max_output_tokens"], [])
    missing = [e for e in profile.endpoints if e not in engine.apis]
    if missing:
        log.warning(f"the traffic uses {', '.join(missing)} but the server does not answer it: not warmed")
    profile.endpoints = [e for e in profile.endpoints if e in engine.apis] or list(engine.apis)
    return profile


def warm_profile(agent: Agent, ctx: StageContext, lengths: list[int], batches: list[int], detail: dict,
                 t_start: float) -> None:
    """Warm the traffic profile: prefill shapes, then each family at each batch size
    with the longest answer.  A family the server refuses (HTTP 400) is recorded
    and skipped: user requests of that family fail on it as well, warm or not."""
    agent.profile = profile = load_profile(agent, lengths)
    plan = profile.warm_requests(batches, lengths, agent.cfg["prewarm.max_new_tokens"],
                                 decode_coverage=agent.cfg["prewarm.decode_coverage"])
    refused: dict[str, str] = {}
    warmed = set()
    for i, batch in enumerate(plan):
        agent.checkpoint()
        head = batch[0]
        if head.family in refused:
            continue
        try:
            agent.send_requests(batch, "warmup")
            warmed.add((head.prompt_tokens, len(batch)))
        except EngineError as e:
            if head.family == "greedy" or e.reason != "request_failed" or "HTTP 4" not in e.message:
                raise
            refused[head.family] = e.message
            log.warning(f"the server refuses sampling family {head.family}: {e.message}")
        agent.progress.step(i + 1, len(plan), f"{head.endpoint} {head.family} len={head.prompt_tokens} "
                                               f"batch={len(batch)} out={head.max_tokens}")
    ctx.profile_summary = summary = {
        "source": profile.source, "requests_seen": profile.requests_seen, "endpoints": profile.endpoints,
        "families": sorted(f for f in profile.families if f not in refused), "refused_families": refused,
        "prompt_lengths": profile.prompt_lengths, "max_tokens": profile.max_tokens,
        "capabilities": dict(agent.engine.capabilities)}
    detail.update(shapes=len(warmed), requests=agent.warmup_requests, lengths=sorted({r.prompt_tokens for b in plan for r in b}),
                  batches=batches, profile=summary,
                  seconds={"traffic": time.perf_counter() - t_start})
    ctx.warmed_shapes = sorted(warmed)


def run(agent: Agent, ctx: StageContext, detail: dict) -> None:
    cfg, engine = agent.cfg, agent.engine
    agent.move(State.PRELOAD)
    _start_ramp(agent, ctx)

    clock = time.perf_counter
    # Weights before the tokenizer: the engine reads them while transformers is
    # still being imported in the background (torch engine), so the import is
    # paid once, overlapped, instead of before the weights.
    t0 = clock()
    engine.load_weights()
    agent.checkpoint()
    t1 = clock()
    engine.load_tokenizer()
    agent.checkpoint()
    t2 = clock()
    facts = engine.facts()
    agent.engine_facts = vars(facts)
    quant = engine.quantization     # warmup_agent/quantization.py (issue 16)
    if quant is not None:
        agent.metrics.warmup_model_quantization_info.info(quant.labels())
        detail["quantization"] = quant.as_dict()
    report = engine.load_report
    if report is not None:
        detail["weight_load"] = report.as_dict()
        if report.seconds > 0:
            agent.metrics.warmup_weight_load_bytes_per_second.set(report.bytes / report.seconds)
    if engine.skeleton_wait_seconds is not None:
        detail["waited_for_transformers_import_seconds"] = engine.skeleton_wait_seconds
    agent.sm.record_fingerprint(engine.weight_fingerprint())
    t3 = clock()

    agent.prompts = prompts = PromptFactory(engine.tokenize)
    lengths = warmup_lengths(cfg, engine.tokenize)
    batches = warmup_batches(cfg, facts, ctx.gpu_free_bytes, max(lengths))
    max_new = cfg["prewarm.max_new_tokens"]
    if engine.speaks_profile:
        warm_profile(agent, ctx, lengths, batches, detail, t3)
        detail["seconds"].update(weights=t1 - t0, tokenizer=t2 - t1, fingerprint=t3 - t2)
        agent.move(State.PRIME)
        return
    try:
        batches = _fit_budget(agent, lengths, batches, max_new)
        shapes = grid(lengths, batches)
        backoff = memory_budget.BackOff()   # a shape that runs out of memory drops its batch size and larger ones
        per_shape = cfg["prewarm.requests_per_shape"]
        total = len(shapes) * per_shape
        done = 0
        warmed = []
        for shape in shapes:
            for _ in range(per_shape):
                agent.checkpoint()
                def send_one(shape=shape) -> float:
                    return agent.send(prompts.batch(shape), "warmup", max_new_tokens=max_new)
                backoff.run(shape.batch, send_one)
                done += 1
                agent.progress.step(done, total, f"len={shape.prompt_tokens} batch={shape.batch}")
            if backoff.allows(shape.batch):
                warmed.append(shape)
    except memory_budget.BudgetExceeded as e:
        agent.fail(e.reason, str(e))
    detail.update(shapes=len(warmed), requests=agent.warmup_requests, lengths=lengths, batches=batches,
                  dropped_batches=sorted({s.batch for s in shapes} - {s.batch for s in warmed}),
                  seconds={"weights": t1 - t0, "tokenizer": t2 - t1, "fingerprint": t3 - t2, "traffic": clock() - t3})
    ctx.warmed_shapes = [(s.prompt_tokens, s.batch) for s in warmed]
    agent.move(State.PRIME)
