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
(`warm_profile`, warmup_agent/benefit.py).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from warmup_agent import benefit, memory_budget, shape_warmup, traffic
from warmup_agent.errors import EngineError
from warmup_agent.gpu import sizing
from warmup_agent.stages.context import StageContext
from warmup_agent.states import State
from warmup_agent.traffic import Shape, grid

if TYPE_CHECKING:  # types only
    from warmup_agent.config import Config
    from warmup_agent.engines.base import EngineFacts

log = logging.getLogger("warmup_agent.stages.prewarm")


def warmup_lengths(cfg: Config, tokenize: Callable[[str], list[int]]) -> list[int]:
    source = cfg.prewarm.length_source
    drawn: list[int] = []
    if source == "gaussian":
        drawn = traffic.gaussian_lengths(cfg.prewarm.sampled_lengths, cfg.prewarm.length_mean, cfg.prewarm.length_sd,
                                         max_length=cfg.prewarm.max_prompt_length or None)
    elif source == "sample_file":
        if not cfg.prewarm.prompts_file:
            raise EngineError("invalid_config", "key 'prewarm.prompts_file': length_source sample_file needs a file of real prompts")
        try:
            drawn = traffic.lengths_from_sample(cfg.prewarm.prompts_file, tokenize, cfg.prewarm.sampled_lengths)
        except ValueError as e:
            raise EngineError("invalid_config", f"key 'prewarm.prompts_file': {e}") from None
    extra = cfg.prewarm.max_prompt_length if source != "grid" else 0
    return traffic.warmup_lengths(cfg.prewarm.prompt_lengths, drawn, extra)


def warmup_batches(cfg: Config, facts: EngineFacts, free_bytes: int | None, max_length: int) -> list[int]:
    if cfg.prewarm.batch_sizes_from_memory and free_bytes and facts.kv_bytes_per_token:
        return sizing.batch_sizes_from_memory(free_bytes - (facts.weight_bytes or 0), facts.kv_bytes_per_token,
                                              max_length + cfg.prewarm.max_new_tokens, cap=cfg.prewarm.max_batch)
    return cfg.prewarm.batch_sizes


def _fit_budget(ctx: StageContext, lengths: list[int], batches: list[int], max_new: int) -> list[int]:
    """With prewarm.memory_budget_bytes set, measure one shape (the longest
    prompt at the smallest batch) and keep the batch sizes whose extrapolated
    cost fits the budget (warmup_agent/memory_budget.py)."""
    budget = ctx.cfg.prewarm.memory_budget_bytes
    if not budget:
        return batches
    prompts = ctx.driver.prompts
    assert prompts is not None, "prewarm makes the prompt factory before it measures"
    shape = Shape(max(lengths), min(batches))
    _, cost = memory_budget.measure_peak_rss(
        lambda: ctx.driver.send(prompts.batch(shape), "warmup", max_new_tokens=max_new))
    return memory_budget.plan(batches, shape.prompt_tokens, cost / (shape.batch * shape.prompt_tokens), budget).batches


def _start_ramp(ctx: StageContext) -> None:
    from warmup_agent.gpu.ramp import RampSampler
    ctx.ramp = None
    interval = ctx.cfg.gpu.ramp_sample_interval_seconds
    if ctx.gpu is not None and interval > 0:
        ctx.ramp = RampSampler.for_gpu(ctx.gpu.uuid, interval)
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
        try:
            profile = traffic.load_requests_file(path, text.count_chat, text.count_text,
                                                 bad_lines=cfg.prewarm.requests_file_bad_lines)
        except ValueError as e:
            raise EngineError("invalid_config", f"key 'prewarm.requests_file': {e}") from None
        except Exception as e:  # noqa: BLE001 - a template error on a logged body
            raise EngineError("invalid_config", f"key 'prewarm.requests_file': {path}: {type(e).__name__}: {e}") from None
    else:
        profile = traffic.default_profile(engine.apis, cfg.prewarm.max_output_tokens, [])
    missing = [e for e in profile.endpoints if e not in engine.apis]
    if missing:
        log.warning(f"the traffic uses {', '.join(missing)} but the server does not answer it: not warmed")
    profile.endpoints = [e for e in profile.endpoints if e in engine.apis] or list(engine.apis)
    return profile


def _refused(e: EngineError) -> bool:
    """The server answered the request with HTTP 4xx (it refuses what was asked),
    as opposed to failing or being unreachable."""
    return e.reason == "request_failed" and "HTTP 4" in e.message


# Why a prompt-length path got no call (the run record, /startupz).
NEW_LENGTHS_WARM = "the per-length test's fresh prompt lengths prefilled at steady speed"


def remedy_for(server: str | None) -> str:
    """What removes a per-sequence-length decode cost, in the user's words."""
    if server == "transformers serve":
        return ("set TORCH_CUDNN_SDPA_DEPRIORITIZED=1 in the server's environment "
                "(PyTorch's cuDNN attention builds a plan per sequence length)")
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
    """Warm the traffic profile by measured benefit (warmup_agent/benefit.py):
    1. the anchor path (the probe family on the main endpoint, smallest batch, the
       longest profile prompt) until it stops getting faster: the steady level;
    2. the per-length test: two calls at sequence lengths no request reached; decode
       slower than steady by more than prewarm.per_length_ratio means the server
       pays per length (logged with its remedy, exported);
    3. every other family and endpoint, then every profile length (prefill only;
       none when the per-length test's fresh lengths prefilled at steady speed),
       then every larger batch size, each until warm;
    4. decode coverage of the profile's lengths, when the server pays per length
       (prewarm.decode_coverage auto) or always.
    All under one time budget; a path the budget did not reach is skipped, and the
    record says so.  A family the server refuses (HTTP 4xx) is skipped too: user
    requests of that family fail on it as well, warm or not."""
    from warmup_agent.benefit import Path
    w = _ProfileWarmup(ctx, load_profile(ctx, lengths), lengths, batches)
    # 1. the anchor: the steady level every other path is compared with
    w.warm(Path(w.ep0, w.fam0, w.b0, w.hi))
    # 2. does the server pay per sequence length?
    per_length = w.per_length_test()
    # 3. the other paths, each until warm
    w.other_paths(per_length, batches)
    # 4. decode coverage over the profile's lengths
    coverage = w.decode_coverage(per_length)
    w.record(per_length, coverage, batches, detail, t_start)


class _ProfileWarmup:
    """The state of one `warm_profile`: the budget, the steady levels, what was sent
    and decoded, the outcome of every path, the families the server refuses."""

    def __init__(self, ctx: StageContext, profile: traffic.TrafficProfile, lengths: list[int], batches: list[int]):
        from warmup_agent.traffic import probe_endpoint, probe_family
        pc = ctx.cfg.prewarm
        self.ctx, self.pc = ctx, pc
        ctx.profile = self.profile = profile
        seconds, why = benefit.budget_for(ctx.engine.server_start_seconds, pc.budget_ratio, pc.budget_min_seconds,
                                          pc.budget_seconds)
        self.budget = benefit.Budget(seconds, why)
        ctx.metrics.warmup_budget_seconds.set(seconds)
        self.tol, self.max_calls = pc.converge_tolerance, pc.max_calls_per_path
        self.answer = max(2, min(pc.warm_answer_tokens, profile.max_tokens))
        self.fam0 = probe_family(profile)
        self.ep0 = probe_endpoint(profile)
        self.b0 = min(batches) if batches else 1
        self.plens = sorted(set(profile.prompt_lengths) or set(lengths))
        self.lo, self.hi = self.plens[0], self.plens[-1]
        self.steady = benefit.SteadyLevels()
        self.refused: dict[str, str] = {}
        self.decoded: list[tuple[int, int]] = []     # (prompt, prompt + answer) ranges decoded so far
        self.outcomes: list[benefit.Outcome] = []
        self.sent = 0

    def send(self, path: benefit.Path, tokens: int | None = None) -> benefit.Call:
        from warmup_agent.traffic import WarmRequest, _frozen
        ctx, profile = self.ctx, self.profile
        tokens = self.answer if tokens is None else tokens
        ctx.checkpoint()
        req = WarmRequest(path.endpoint, path.prompt_tokens, tokens, path.family, _frozen(profile.families[path.family]))
        results = ctx.driver.send([req] * path.batch, "warmup")
        self.decoded.append((path.prompt_tokens, path.prompt_tokens + tokens))
        self.sent += 1
        ctx.progress.step(self.sent, self.sent + 1, f"{path.label} out={tokens}")
        return benefit.call_of(results)

    def warm(self, path: benefit.Path, tokens: int | None = None) -> None:
        profile = self.profile
        if path.family in self.refused:
            self.outcomes.append(benefit.Outcome(path, "skipped", f"the server refuses family {path.family}"))
            return
        try:
            self.outcomes.append(benefit.warm_path(path, lambda p: self.send(p, tokens), self.steady, self.budget,
                                                   self.tol, self.max_calls))
        except EngineError as e:
            if not _refused(e) or path.family == self.fam0:
                raise
            self.refused[path.family] = e.message
            line = profile.family_lines.get(path.family)
            src = f" (first seen at {profile.source}:{line})" if line else ""
            log.warning(f"the server refuses sampling family {path.family}{src}: {e.message}")
            self.outcomes.append(benefit.Outcome(path, "skipped", f"the server refuses family {path.family}"))

    def per_length_test(self) -> dict:
        """Two calls at fresh sequence lengths against the anchor's steady decode and prefill."""
        from warmup_agent.benefit import Path
        ctx, steady, b0 = self.ctx, self.steady, self.b0
        per_length: dict = {"tested": False}
        steady_tpot = steady.tpot_ref(b0)
        if steady_tpot is None or self.budget.exhausted():
            return per_length
        fresh = benefit.fresh_lengths(self.lo, self.hi, self.decoded, 2, self.answer)
        try:
            calls = [self.send(Path(self.ep0, self.fam0, b0, n)) for n in fresh]
        except EngineError as e:
            # A server that refuses a length (its context is shorter, say): not a reason
            # to fail the start; the finding is "not measured" and says why.
            if not _refused(e):
                raise
            log.warning(f"the per-length test could not run: {e.message}")
            calls = []
            per_length = {"tested": False, "error": e.message}
        pays, ratios = benefit.pays_per_length(calls, steady_tpot, self.pc.per_length_ratio)
        if calls:
            prefill_pays = not benefit.prefill_warm(list(zip(fresh, calls, strict=False)), steady, b0, self.tol)
            per_length = {"tested": True, "pays": pays, "ratios": ratios, "lengths": [c.prompt_tokens for c in calls],
                          "steady_tpot_ms": round(steady_tpot * 1e3, 3), "prefill_pays": prefill_pays,
                          "ttft_ms": [round(c.ttft * 1e3, 2) for c in calls],
                          "steady_ttft_ms": round((steady.ttft_ref(b0, self.hi) or 0) * 1e3, 2)}
            server = [c.server_prefill for c in calls if c.server_prefill is not None]
            server_ref = steady.prefill_ref(b0, self.hi)
            if len(server) == len(calls) and server_ref is not None:
                # the server's own prefill clock decided prefill_pays (benefit.prefill_warm),
                # against the anchor's steady prefill scaled to each length
                per_length["server_prefill_ms"] = [round(v * 1e3, 3) for v in server]
                per_length["steady_server_prefill_ms"] = round(server_ref * 1e3, 3)
                per_length["server_prefill_ref_ms"] = [round((steady.prefill_ref_at(b0, n) or 0) * 1e3, 3)
                                                       for n in fresh]
        if ratios:
            ctx.metrics.warmup_per_length_decode_ratio.set(min(ratios))
        if pays:
            remedy = remedy_for(ctx.engine.server_name)
            per_length["remedy"] = remedy
            ctx.metrics.warmup_per_length_remedy_info.labels(remedy=remedy).set(1)
            # over the same references benefit.prefill_warm judged prefill_pays by
            first = [c.ttft / ref for n, c in zip(fresh, calls, strict=False)
                     if (ref := steady.ttft_ref(b0, n))] if per_length.get("prefill_pays") else []
            log.warning(per_length_line(ratios, first, remedy))
        return per_length

    def other_paths(self, per_length: dict, batches: list[int]) -> None:
        """Every other family and endpoint, every profile length (prefill), every larger batch."""
        from warmup_agent.benefit import Path
        profile, ep0, fam0, b0, hi = self.profile, self.ep0, self.fam0, self.b0, self.hi
        for fam in profile.families:
            if fam != fam0:
                self.warm(Path(ep0, fam, b0, hi))
        for ep in profile.endpoints:
            if ep != ep0:
                for fam in profile.families:
                    if not (fam == "json_schema" and ep != "chat"):
                        self.warm(Path(ep, fam, b0, hi))
        for n in reversed(self.plens[:-1]):
            if per_length.get("prefill_pays") is False:
                # Two lengths nothing had reached already prefilled at the anchor's steady
                # speed: this server pays nothing per prompt length, so these calls would
                # only cost time (on llama.cpp, 5 of its 9 warmup calls).
                self.outcomes.append(benefit.Outcome(Path(ep0, fam0, b0, n), "skipped", NEW_LENGTHS_WARM))
                continue
            self.warm(Path(ep0, fam0, b0, n), tokens=1)      # prefill at this length; decode is the anchor's
        for b in sorted(set(batches)):
            if b != b0:
                self.warm(Path(ep0, fam0, b, hi))

    def decode_coverage(self, per_length: dict) -> dict:
        """Decode over the profile's lengths, when the server pays per length (auto) or always."""
        from warmup_agent.benefit import Path
        from warmup_agent.traffic import decode_tiles
        budget, profile = self.budget, self.profile
        mode = self.pc.decode_coverage
        coverage: dict = {"mode": mode, "tiles": [], "skipped_tiles": []}
        if mode == "always" or (mode == "auto" and per_length.get("pays")):
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

    def record(self, per_length: dict, coverage: dict, batches: list[int], detail: dict, t_start: float) -> None:
        """The probes' length and answer, the paths' metrics, /startupz's summary, the record."""
        ctx, profile, budget, outcomes, refused = self.ctx, self.profile, self.budget, self.outcomes, self.refused
        # The probes' length: a profile length no warmup request used, as a user's would be.
        used = {a for a, _ in self.decoded}
        probe_length = self.plens[len(self.plens) // 2]
        while probe_length in used:
            probe_length += 1
        ctx.probe_length = probe_length
        ctx.first_probe_tokens = profile.max_tokens
        ctx.decoded_ranges, ctx.profile_lengths = list(self.decoded), list(self.plens)
        counts = Counter(o.result for o in outcomes)
        for result in ("warm_on_first_call", "converged", "still_improving", "skipped"):
            ctx.metrics.warmup_paths.labels(result=result).set(counts[result])
        skipped = [{"path": o.path.label, "reason": o.reason} for o in outcomes if o.result == "skipped"]
        ctx.warmup_summary = summary = {
            "budget": budget.as_dict(), "per_length": per_length, "decode_coverage": coverage, "paths": dict(counts),
            "skipped": skipped, "requests": self.sent, "probe_length": probe_length}
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
    server = engine.name == "openai"
    if not server:
        _start_ramp(ctx)

    clock = time.perf_counter
    # Weights before the tokenizer: the engine reads them while transformers is
    # still being imported in the background (torch engine), so the import is
    # paid once, overlapped, instead of before the weights.
    t0 = clock()
    engine.load_weights()
    ctx.checkpoint()
    if server:
        _start_ramp(ctx)
    t1 = clock()
    engine.load_tokenizer()
    ctx.checkpoint()
    t2 = clock()
    facts = engine.facts()
    ctx.engine_facts = vars(facts)
    quant = engine.quantization     # warmup_agent/quantization/ (issue 16)
    if quant is not None:
        ctx.metrics.warmup_model_quantization_info.info(quant.labels())
        detail["quantization"] = quant.as_dict()
    report = engine.load_report
    if report is not None:
        detail["weight_load"] = report.as_dict()
        if report.seconds > 0:
            ctx.metrics.warmup_weight_load_bytes_per_second.set(report.bytes / report.seconds)
    if engine.skeleton_wait_seconds is not None:
        # the wait for the background import + skeleton: transformers' on that path, torch alone on the native one
        detail["waited_for_skeleton_seconds"] = engine.skeleton_wait_seconds
    ctx.sm.record_fingerprint(engine.weight_fingerprint())
    t3 = clock()

    prompts = ctx.driver.start_prompts()
    lengths = warmup_lengths(cfg, engine.tokenize)
    batches = warmup_batches(cfg, facts, ctx.gpu_free_bytes, max(lengths))
    max_new = cfg.prewarm.max_new_tokens
    if engine.speaks_profile:
        warm_profile(ctx, lengths, batches, detail, t3)
        detail["seconds"].update(weights=t1 - t0, tokenizer=t2 - t1, fingerprint=t3 - t2)
        ctx.move(State.PRIME)
        return
    try:
        batches = _fit_budget(ctx, lengths, batches, max_new)
        shapes = grid(lengths, batches)
        backoff = memory_budget.BackOff()   # a shape that runs out of memory drops its batch size and larger ones
        # Each shape until its calls stop getting faster or match the steady level
        # (warmup_agent/shape_warmup.py, issue 25); requests_per_shape raises the cap.
        cap = max(cfg.prewarm.requests_per_shape, cfg.prewarm.max_calls_per_path)
        done = 0

        def send_shape(shape: Shape) -> shape_warmup.Call:
            nonlocal done
            ctx.checkpoint()
            results = backoff.run(shape.batch, lambda: ctx.driver.send(prompts.batch(shape), "warmup", max_new_tokens=max_new))
            if results is None:
                raise shape_warmup.Dropped(f"batch {shape.batch} dropped: out of memory")
            done += 1
            ctx.progress.step(done, max(len(shapes), done + 1), f"len={shape.prompt_tokens} batch={shape.batch}")
            return benefit.call_of(results)
        outcomes = shape_warmup.warm_grid(shapes, send_shape, cfg.prewarm.converge_tolerance, cap)
        warmed = [s for s, o in zip(shapes, outcomes, strict=True) if o.calls and backoff.allows(s.batch)]
        detail.update(warmup=shape_warmup.summary(outcomes), paths=[o.as_dict() for o in outcomes])
    except memory_budget.BudgetExceeded as e:
        ctx.fail(e.reason, str(e))
    detail.update(shapes=len(warmed), requests=ctx.driver.warmup_requests, lengths=lengths, batches=batches,
                  dropped_batches=sorted({s.batch for s in shapes} - {s.batch for s in warmed}),
                  seconds={"weights": t1 - t0, "tokenizer": t2 - t1, "fingerprint": t3 - t2, "traffic": clock() - t3})
    ctx.warmed_shapes = [(s.prompt_tokens, s.batch) for s in warmed]
    ctx.move(State.PRIME)
