"""Stage 4, ready (PRIME -> SERVING): probe until the gate opens, validate, then serve
if the weight fingerprint taken at PRELOAD still matches."""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

from exporter.recorder import CheckStats, Recorder, TaxStats
from warmup_agent.readiness import cold_decode, validation
from warmup_agent.readiness.probes import FirstRequest, Probe
from warmup_agent.readiness.verdict import DecodeTest, Verdict
from warmup_agent.stages.context import StageContext

log = logging.getLogger(__name__)


def run(ctx: StageContext, detail: dict) -> None:
    cfg = ctx.cfg
    rd = ctx.readiness
    max_probes = cfg.readiness.max_probes
    profile_probes = ctx.engine.speaks_profile and ctx.profile is not None
    alone = profile_probes and ctx.first_probe_alone
    min_probes = rd.gate_min_probes(profile_probes, alone)
    # Decode is gated only where probes time it.
    gate_decode = cfg.readiness.require_decode and profile_probes
    if not ctx.first_pairs and not alone:
        # a re-warm: its first probe is a first request again
        ctx.probe_log.restart()

    pairs: list[dict] = []

    def verdict() -> Verdict:
        if not gate_decode:
            return rd.verdict(min_probes)
        # A first probe no slower than its control leaves no cold decode to wait for: only
        # the absolute threshold remains.  Else decode must stop getting faster.
        warm = alone or (pairs and not pairs[-1]["cold"])
        ratio = math.inf if warm else cfg.readiness.tpot_convergence_ratio
        return rd.verdict(min_probes, DecodeTest(ctx.probe_log.decode, cfg.readiness.tpot_p90_threshold_seconds, ratio))
    sent = len(ctx.probe_log.gate_probes)        # prewarm's first pairs, where it sent them

    def probe(max_tokens: int | None) -> None:
        nonlocal sent
        ctx.checkpoint()
        ttft = ctx.probe(max_tokens=max_tokens)
        sent += 1
        ctx.progress.probe(sent, rd.probes_in_window(), min_probes, max_probes, ttft)

    detail["first_pairs_from_prewarm"] = len(ctx.first_pairs)
    if not alone:
        pairs += first_probe_pairs(ctx, probe, max_probes)
    detail["first_probe_pairs"] = pairs
    detail["first_probe_alone"] = alone
    ctx.first_pairs, ctx.first_probe_alone = [], False   # a re-warm's prewarm sends its own
    for _ in range(sent, max_probes):
        if verdict().open:
            break
        if cfg.readiness.probe_interval_seconds:
            time.sleep(cfg.readiness.probe_interval_seconds)
        probe(None)
    final = verdict()
    if not final.open:
        ctx.fail(final.reason, f"after {max_probes} probes {final.message}")
    freeze_first_request(ctx)
    learn_remedy(ctx, detail)
    # the gate's probes are probes[gate_first_probe:probes] of the record
    detail.update(probes=len(ctx.probe_log.probes), gate_first_probe=ctx.probe_log.gate_start,
                  probe_prompt_tokens=ctx.probe_length)
    if cfg.validation.enabled:
        validate(ctx, detail)
    if ctx.settle is not None and cfg.readiness.settle_before_serving:
        before = ctx.driver.warmup_requests
        ctx.settle()        # the users' first request follows what the first probe followed
        detail["settle_requests"] = ctx.driver.warmup_requests - before
    if ctx.user_path_request is not None:
        # warms the listener-to-model path; outside the engine lock, which the batcher takes
        detail["user_path_request"] = ctx.user_path_request()
    with ctx.driver.busy():
        fingerprint = ctx.engine.weight_fingerprint()
    if not ctx.sm.serve(fingerprint):
        ctx.checkpoint()


def freeze_first_request(ctx: StageContext) -> None:
    """Freeze and export the first-request figures."""
    figures = ctx.probe_log.freeze(cold_decode_of(ctx))
    if figures is not None and figures.cold_decode:
        c = figures.cold_decode
        log.info(f"the server pays per decode length: the first probe's whole answer ran {c['probe_total_tax']:.2f}x "
                 f"steady, {c['probe_unreached_steps']} unreached decode steps at {c['step_cost_ms']:.1f} ms more each; "
                 f"after the probes, a first request at the profile's prompt lengths meets {c['mean_unreached_steps']:g} "
                 f"on average (at most {c['worst_unreached_steps']}, from {c['worst_prompt_tokens']} tokens): "
                 f"whole-answer tax {c['total_tax']:.2f}x exported")
    if figures is not None:
        ctx.recorder.first_request(TaxStats(figures.ttft_tax, figures.total_tax, remembered=figures.new_length is not None))


def learn_remedy(ctx: StageContext, detail: dict) -> None:
    """For the next start's remedy (auto): whether this server paid per length, its steady decode."""
    per_length = (ctx.warmup_summary or {}).get("per_length") or {}
    pays = per_length.get("pays") if per_length.get("tested") else None
    entry = ctx.engine.learn_remedy(pays, ctx.probe_log.decode.values())
    if entry is None:
        return
    detail["server_remedy"] = {"applied": bool(ctx.engine.applied_remedy), "why": ctx.engine.remedy_why, **entry}
    if entry.get("verdict") == "slower":
        log.warning("openai.apply_server_remedy: steady decode was slower with the server's remedy "
                    f"({entry['steady_tpot_with'] * 1e3:.2f} ms against {entry['steady_tpot_without'] * 1e3:.2f} ms "
                    "a token without it); the next start goes without it")


def first_probe_pairs(ctx: StageContext, probe: Callable[[int | None], None], max_probes: int) -> list[dict]:
    """Send first-probe pairs (StageContext.probe_pair), going on from any prewarm sent.
    A first probe cold beyond its control means the warmup left something cold, which
    it has now paid, so another pair follows, up to prewarm.max_calls_per_path."""
    cfg = ctx.cfg
    profile_probes = ctx.engine.speaks_profile and ctx.profile is not None
    tokens = ctx.first_probe_tokens if profile_probes else None
    pairs: list[dict] = list(ctx.first_pairs)
    each_length_pays = bool(((ctx.warmup_summary or {}).get("per_length") or {}).get("prefill_pays_each_new_length"))
    # Where each new prompt length pays, the last pair was cold because its length was
    # new: a pair at that length would find it warm, one at another length would pay
    # again, and neither says what a user meets.  No more pairs then.
    while (not pairs or (pairs[-1]["cold"] and not each_length_pays)) and len(pairs) < cfg.prewarm.max_calls_per_path \
            and len(ctx.probe_log.gate_probes) + 2 <= max_probes:
        _, pair = ctx.probe_pair(probe, tokens, replay=not pairs)
        pairs.append(pair)
    if pairs and pairs[-1]["cold"] and not each_length_pays:
        log.warning(f"the first probe was still slower than its control after {len(pairs)} pair(s) "
                    f"({pairs[-1]['first_ttft_ms']:.1f} ms against {pairs[-1]['control_ttft_ms']:.1f} ms): "
                    "something a first request meets stays cold; the exported first-request tax says how much")
    return pairs


def cold_decode_of(ctx: StageContext) -> Callable[[FirstRequest, list[Probe]], dict | None] | None:
    """The first user's whole-answer prediction, where decode pays per sequence length."""
    summary = ctx.warmup_summary or {}
    if not summary.get("per_length", {}).get("pays") or ctx.profile is None or ctx.probe_length is None:
        return None
    prompt, warmup, lengths = ctx.probe_length, list(ctx.decoded_ranges), list(ctx.profile_lengths)

    def predict(fr: FirstRequest, probes: list[Probe]) -> dict | None:
        return cold_decode.first_answer(fr, prompt, warmup, [(prompt, prompt + p.output_tokens) for p in probes],
                                        lengths)
    return predict


def export_fp8_ranges(recorder: Recorder, check: validation.Check) -> None:
    recorder.check(CheckStats(check.name, fp8_ranges=check.detail.get("ranges", {})))


def validate(ctx: StageContext, detail: dict) -> None:
    """Structure, numerics, performance; the first failure fails the agent with its reason."""
    cfg = ctx.cfg
    factory = ctx.driver.prompts
    assert factory is not None, "prewarm makes the prompt factory before ready validates"
    prompts = [factory.prompt(n) for n in sorted({8, cfg.readiness.probe_prompt_length})]
    checks: list[validation.Check] = []

    def record(c: validation.Check) -> None:
        checks.append(c)
        detail.setdefault("validation", {})[c.name] = {"result": c.result, "message": c.message, **c.detail}
        ctx.recorder.check(CheckStats(c.name, c.result))
        if not c.ok:
            ctx.fail(c.reason, c.message)

    with ctx.driver.busy():
        record(validation.check_structure(ctx.engine))
        record(validation.check_numerics(ctx.engine, prompts, cfg.validation.logits_mean_min,
                                         cfg.validation.logits_mean_max, cfg.validation.logits_abs_max))
        if cfg.validation.fp8_ranges:
            fp8 = validation.check_fp8_ranges(ctx.engine, cfg.validation.fp8_max_saturated_ratio,
                                              cfg.validation.fp8_max_roundtrip_error)
            export_fp8_ranges(ctx.recorder, fp8)
            record(fp8)
    # Last: a baseline is recorded only for a model that passed the other two.
    path = cfg.validation.baseline_file
    if path:
        p50 = ctx.readiness.window_p50()
        if p50 is None:   # readiness.window_seconds aged every sample out since the gate opened
            record(validation.Check("performance", "skipped", "no probe left in the window (readiness.window_seconds)"))
        else:
            record(validation.check_performance(p50, os.path.expanduser(path),
                                                validation.baseline_key(ctx.engine, ctx.sm.fingerprint),
                                                cfg.validation.performance_factor))
    else:
        record(validation.Check("performance", "skipped", "no validation.baseline_file"))
