"""The measured-benefit warmup of a traffic profile, for a server engine.

`ProfileWarmup` holds one warmup's state and its steps: the other paths' wave, decode
coverage, the settle request, the per-length test (the gate's first probe pairs), the
length ladder, the replays before controls, the findings kept for the next start and
the record.  stages/prewarm.py `warm_profile` drives it; the rules it applies are
warmup/benefit.py's.  It sees the stage context through `WarmupContext` only.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from exporter.recorder import WarmupStats
from warmup_agent.errors import EngineError
from warmup_agent.server.kinds import BY_NAME
from warmup_agent.warmup import benefit, findings, traffic

if TYPE_CHECKING:  # types only
    from exporter.recorder import Recorder
    from warmup_agent.config_sections import KernelCacheSection, PrewarmSection
    from warmup_agent.driver import EngineDriver
    from warmup_agent.engines.base import Engine
    from warmup_agent.engines.text_prompts import TextPrompts
    from warmup_agent.readiness.probes import ProbeLog
    from warmup_agent.run.progress import Progress
    from warmup_agent.server.context import ServerContext

# The stage's logger: these lines are the prewarm stage's.
log = logging.getLogger("warmup_agent.stages.prewarm")


class WarmupSettings(Protocol):
    @property
    def prewarm(self) -> PrewarmSection: ...
    @property
    def kernel_cache(self) -> KernelCacheSection: ...
    @property
    def data_dir(self) -> str: ...


class WarmupContext(Protocol):
    """What the warmup reads and sets of the stage context (stages/context.py)."""
    @property
    def cfg(self) -> WarmupSettings: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def driver(self) -> EngineDriver: ...
    @property
    def recorder(self) -> Recorder: ...
    @property
    def progress(self) -> Progress: ...
    @property
    def probe_log(self) -> ProbeLog: ...
    @property
    def host_facts(self) -> dict: ...

    profile: traffic.TrafficProfile | None
    probe_length: int | None
    first_probe_tokens: int | None
    replay_for: Callable[[int, int], Callable[[], None] | None] | None
    settle: Callable[[], None] | None
    let_users_in: Callable[[], Callable[[], None]] | None
    users_first: Callable[[], None] | None
    length_warmup_pays: bool
    first_pairs: list[dict]
    first_probe_alone: bool
    decoded_ranges: list[tuple[int, int]]
    profile_lengths: list[int]
    warmup_summary: dict | None
    profile_summary: dict | None
    warmed_shapes: list[tuple[int, int]]

    def checkpoint(self) -> None: ...
    def probe(self, decode: bool = True, max_tokens: int | None = None) -> float: ...
    def probe_pair(self, probe: Callable[[int | None], object], tokens: int | None,
                   replay: bool) -> tuple[benefit.Controlled, dict]: ...


def _refused(e: EngineError) -> bool:
    """The server answered HTTP 4xx: it refuses what was asked (not failed, not unreachable)."""
    return e.reason == "request_failed" and "HTTP 4" in e.message


#: The settle request's prompt tokens: at least this many, and at least
#: SETTLE_OPENING_SHARE times the chat template's opening (settle_prompt_tokens).
# After SERVING the paths left behind the users have at least this long (they wait for quiet).
BEHIND_BUDGET_SECONDS = 60.0
GIVE_WAY_TRIES = 20      # then the batch is sent whatever users do: the warm-up ends
SETTLE_PROMPT_TOKENS = 64
SETTLE_OPENING_SHARE = 12


def settle_prompt_tokens(text: TextPrompts | None) -> int:
    """Short, yet long enough that the template's opening is under a tenth of the prompt:
    llama-server gives a request the slot whose prompt it shares more than
    `--slot-prompt-similarity` (0.1) of, else the least recently used one, and a settle
    request sent to the last long request's slot waits while the server saves that slot
    (docs/benchmarks.md)."""
    opening = text.opening_tokens() if text is not None else 0
    return max(SETTLE_PROMPT_TOKENS, SETTLE_OPENING_SHARE * opening)


#: The length ladder (prewarm.length_ladder): its first rung, and the ratio between rungs.
LADDER_FIRST, LADDER_RATIO = 48, 1.5


def ladder_lengths(hi: int) -> list[int]:
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


#: Where each new length pays, a first request pays for its block of this many tokens (docs/benchmarks.md).
LENGTH_BLOCK_TOKENS = 16


def length_blocks(lo: int, hi: int, sent: Iterable[int]) -> list[int]:
    """One prompt length in each LENGTH_BLOCK_TOKENS block that [lo, hi] reaches and no
    length in `sent` falls in: the block's middle, inside [lo, hi]."""
    b = LENGTH_BLOCK_TOKENS
    covered = {n // b for n in sent}
    return [min(hi, max(lo, k * b + b // 2)) for k in range(lo // b, hi // b + 1) if k not in covered]


def length_skip_reason(per_length: dict) -> str | None:
    """Why the profile's prompt lengths get no call each; None: warm them (no test ran).
    Whatever the test found, a call would buy nothing: no fresh length paid, or a
    one-time cost was paid already, or each new length pays (a user's first request at
    a length the warmup did not send pays anyway)."""
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
    """The log line of a server that pays per sequence length; the first tokens are named
    where the fresh lengths also prefilled slow."""
    line = ("the server pays per sequence length: decode at new lengths ran "
            + ", ".join(f"{r:.1f}x" for r in decode_ratios) + " its steady time per token")
    if first_token_ratios:
        line += (", and their first tokens came " + ", ".join(f"{r:.1f}x" for r in first_token_ratios)
                 + " its steady first token")
    return line + f"; remedy: {remedy}"


class ProfileWarmup:
    """One profile warmup: the budget, the steady levels, what was sent and decoded, the
    outcome of every path, the families the server refuses.

    Requests sent together fit the server's context (`server_context`): a wave's chunk
    holds what fits at once, a batch path's prompts are as long as its batch fits, and
    a prompt length that never fits is left out with one log line."""

    #: The context the server gives requests sent at once; None: unknown, nothing sized.
    server_context: ServerContext | None = None
    #: The profile's prompt lengths that never fit it, and requests sent shorter to fit it.
    dropped_lengths: list[int] = []
    resized = 0

    def __init__(self, ctx: WarmupContext, profile: traffic.TrafficProfile, lengths: list[int], batches: list[int]):
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
        self.server_context = ctx.engine.server_context
        self.plens = self.fitting_lengths(sorted({*profile.prompt_lengths} or {*lengths}), lengths)
        self.lo, self.hi = self.plens[0], self.plens[-1]
        self.steady = benefit.SteadyLevels()
        self.refused: dict[str, str] = {}
        self.decoded: list[tuple[int, int]] = []     # (prompt, prompt + answer) ranges decoded so far
        self.stale_finding = False
        self.outcomes: list[benefit.Outcome] = []
        self.sent = 0
        #: Requests the server serves at once: a wave goes out in chunks of this many.
        self.concurrency = max(1, int(ctx.engine.concurrency))
        #: The last requests sent together: the predecessor a control must follow too.
        self.last: list[traffic.WarmRequest] = []
        self.replayed = 0       # requests re-sent as predecessors of controls
        self.replays = 0        # ... in this many sends
        self.settled = 0        # settle requests sent
        self.settle_tokens = settle_prompt_tokens(ctx.engine.text)
        self.settled_by_discovery = False  # discovery's request stood in for the first settle request
        #: Paths left for after SERVING (prewarm.behind_users), and what waits for the users to be quiet.
        self.behind: list[benefit.Path] = []
        #: Prompt lengths, one per block of the users' range, sent after SERVING where each new length pays.
        self.behind_lengths: list[int] = []
        self.before_send: Callable[[], None] | None = ctx.users_first
        self.give_way: Callable[[], bool] | None = None

    def fitting_lengths(self, wanted: list[int], grid: list[int]) -> list[int]:
        """The prompt lengths of `wanted` that fit the server's context with the warmup's
        answer and the probes'; the others can never be served and are left out, with one
        log line.  Where none fits: the grid's that do, else the longest that fits."""
        fit = self.server_context
        room = fit.each(1) if fit is not None else None
        if fit is None or room is None:
            return wanted
        need = max(self.answer, self.pc.per_length_tokens)
        self.dropped_lengths = [n for n in wanted if n + need > room]
        if self.dropped_lengths:
            log.warning(f"prompt lengths {self.dropped_lengths} of the traffic ({self.profile.source}) never fit the "
                        f"server's context of {room} tokens a request, prompt and answer (read from {fit.source}): not warmed")
        return ([n for n in wanted if n + need <= room] or [n for n in grid if n + need <= room]
                or [max(1, room - need)])

    def length_at(self, batch: int, length: int) -> int | None:
        """`length`, or the longest prompt that `batch` requests sent at once (with the
        warmup's answer) fit in the server's context; None: none fits."""
        fit = self.server_context
        return length if fit is None else fit.prompt_for(batch, length, self.answer)

    def answer_at(self, length: int, tokens: int) -> int:
        """`tokens`, or as many as one request of `length` prompt tokens has room for."""
        room = self.server_context.each(1) if self.server_context is not None else None
        return tokens if room is None else max(1, min(tokens, room - length))

    def fitted(self, reqs: list[traffic.WarmRequest]) -> list[traffic.WarmRequest]:
        """`reqs`, or where they do not fit the server's context together, each shortened
        to its share: the answer first (to one token), then the prompt."""
        fit = self.server_context
        if fit is None or fit.fits(r.prompt_tokens + r.max_tokens for r in reqs):
            return reqs
        room = fit.each(len(reqs))
        if room is None:
            return reqs
        out = []
        for r in reqs:
            answer = max(1, min(r.max_tokens, room - r.prompt_tokens))
            out.append(dataclasses.replace(r, prompt_tokens=max(1, min(r.prompt_tokens, room - answer)),
                                           max_tokens=answer))
        self.resized += sum(a != b for a, b in zip(reqs, out, strict=True))
        return out

    def request(self, path: benefit.Path, tokens: int | None = None) -> traffic.WarmRequest:
        from warmup_agent.warmup.traffic import WarmRequest, _frozen
        tokens = self.answer if tokens is None else tokens
        return WarmRequest(path.endpoint, path.prompt_tokens, tokens, path.family,
                           _frozen(self.profile.families[path.family]))

    def send_requests(self, reqs: list[traffic.WarmRequest], label: str) -> list:
        """Send `reqs` together (fresh prompts); they become the predecessor.  The record
        accounts for every request sent here (tests/helpers/warmup_record.py)."""
        if self.before_send is not None:
            self.before_send()
        self.ctx.checkpoint()
        reqs = self.fitted(reqs)
        results = self.send_giving_way(reqs)
        self.decoded += [(r.prompt_tokens, r.prompt_tokens + r.max_tokens) for r in reqs]
        self.last = list(reqs)
        self.sent += 1
        self.ctx.progress.step(self.sent, self.sent + 1, label)
        return results

    def send(self, path: benefit.Path, tokens: int | None = None) -> benefit.Call:
        req = self.request(path, tokens)
        return benefit.call_of(self.send_requests([req] * path.batch, f"{path.label} out={req.max_tokens}"))

    def send_wave(self, paths: Sequence[benefit.Path], tokens: dict[benefit.Path, int]) -> list[benefit.Call]:
        """One call per path, in chunks the server takes at once, as many requests as it
        serves together and whose prompts and answers fit its context together (a path's
        batch stays in one chunk); the Call of each path, in order."""
        calls: dict[int, benefit.Call] = {}
        chunk: list[int] = []

        def sizes(i: int) -> list[int]:
            return [paths[i].prompt_tokens + tokens.get(paths[i], self.answer)] * paths[i].batch

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
            if chunk and (sum(paths[j].batch for j in chunk) + p.batch > self.concurrency or (
                    self.server_context is not None
                    and not self.server_context.fits([n for j in [*chunk, i] for n in sizes(j)]))):
                flush()
            chunk.append(i)
        flush()
        return [calls[i] for i in range(len(paths))]

    def replay_for(self, length: int, batch: int) -> Callable[[], None] | None:
        """What re-sends the last requests before a control where they were a harder
        predecessor than `batch` calls of `length` tokens (benefit.harder_predecessor)."""
        last = list(self.last)
        if not last or not benefit.harder_predecessor(len(last), max(r.prompt_tokens for r in last), batch, length):
            return None
        return self._replay(last, "a control")

    def _replay(self, last: list[traffic.WarmRequest], before: str) -> Callable[[], None]:
        def replay() -> None:
            self.send_requests(last, f"replay of {len(last)} request(s) before {before}")
            self.replayed += len(last)
            self.replays += 1
        return replay

    def replay_before_probe_control(self, length: int, batch: int) -> Callable[[], None] | None:
        """What re-sends the last requests (the settle request) before a probe's control,
        unless they were the probe's own shape, harder or not: on llama.cpp a request pays
        for saving its predecessor's slot, so a control right after its first probe pays
        as the first did and the pair would read "not cold"."""
        last = list(self.last)
        if not last or (len(last) == batch and all(r.prompt_tokens == length for r in last)):
            return None
        return self._replay(last, "a probe's control")

    def settle(self) -> None:
        """One short request (settle_prompt_tokens, one output token), alone.  A request
        after much longer or concurrent ones pays for them in its slot on llama.cpp, warm
        or not; this one pays that instead, and the probes and the users' first request
        follow the same short request (ready sends it again just before SERVING)."""
        self.send_requests([self.settle_request()], "settle: 1 short request")
        self.settled += 1

    def settle_request(self) -> traffic.WarmRequest:
        return self.request(benefit.Path(self.ep0, self.fam0, 1, self.settle_tokens), 1)

    def settle_unless_discovery_did(self) -> None:
        """The settle request, unless nothing was sent yet: then discovery's request (short,
        one token, alone) left the server as a settle request would, and a settle request
        stands as the predecessor a probe's control re-sends."""
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
        """benefit.warm_wave over `paths`; where the server refuses a family, the wave cannot
        tell whose request it was, so the paths go one at a time."""
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
        """Does the server pay per sequence length?  The gate's first probe pair at the
        probes' length, which no request reached: a first probe and its control (the same
        length again, after the same predecessor).  Where the first was cold, a second
        pair at another fresh length tells a one-time cost from one each new length pays.
        One request at a time: requests sent together are batched unlike a user's."""
        ctx = self.ctx
        tokens = self.pc.per_length_tokens
        ctx.probe_log.restart()         # these probes are the gate's first

        def send(n: int | None) -> None:
            if self.before_send is not None:
                self.before_send()
            ctx.probe(max_tokens=n)
        probe_pairs, ctx.first_pairs = [], []
        assert ctx.probe_length is not None, "choose_probe_length runs first"
        known = self.remembered()
        if findings.skips_second_pair(known):
            assert known is not None
            alone = self.first_probe_alone(known, tokens)
            if alone is not None:
                ctx.length_warmup_pays = False
                return alone
        lengths: list[int] = [ctx.probe_length]
        pair, d = ctx.probe_pair(send, tokens, replay=True)
        probe_pairs.append(pair)
        ctx.first_pairs.append(d)
        ladder: list[int] = []      # prewarm.length_ladder, off by default (its key says why)
        if d["cold"] and self.pc.length_ladder and benefit.prefill_cold(pair, self.tol):
            ladder = self.ladder()
        fresh = benefit.fresh_lengths(self.lo, self.hi, [*self.decoded, (lengths[0], lengths[0] + tokens)], 1, tokens)[0]
        # Only inside the profile's range: a longer one may be past what the server takes.
        if d["cold"] and fresh <= self.hi:
            lengths.append(fresh)
            ctx.probe_length = fresh
            # The exported figures are this pair's: its first paid what a first request at
            # a new length pays, without the start's one-time costs.  After a ladder both
            # its probes follow the settle request.
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
                      # the second fresh length paid too: each new length pays, whatever was warmed
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
        ctx.length_warmup_pays = pays
        remedy = remedy_for(ctx.engine.server_name) if pays else None
        ctx.recorder.warmup(WarmupStats(per_length_ratios=list(ratios), per_length_remedy=remedy))
        if remedy is not None:
            per_length["remedy"] = remedy
            first = [pair.first.ttft / pair.control.ttft for pair in pairs] if per_length["prefill_pays"] else []
            log.warning(per_length_line(ratios, first, remedy))
        return per_length

    def first_probe_alone(self, known: dict, tokens: int) -> dict | None:
        """The per-length test of a server remembered to pay in prefill at each new length
        and not in decode (findings.skips_second_pair): the gate's first probe goes alone,
        as a user's first request will, with no control and no second pair (they would
        measure the finding again).  The exported figures are 1 + the remembered excess;
        ready opens the gate on this probe against the thresholds (None: measure again)."""
        ctx = self.ctx
        ttft, length = ctx.probe(max_tokens=tokens), ctx.probe_length
        assert length is not None, "choose_probe_length runs first"
        self.decoded.append((length, length + tokens))
        fresh = [n for n in benefit.fresh_lengths(self.lo, self.hi, self.decoded, 1, tokens) if n <= self.hi]
        if not findings.still_holds(known, ttft) and fresh:
            then = (findings.excess_of(known) or {}).get(findings.FIRST_TTFT)
            log.info(f"the remembered per-length finding ({known.get('measured_at')}) no longer holds: the first probe "
                     f"took {ttft * 1e3:.1f} ms, against {f'{then * 1e3:.1f} ms' if then else 'no time kept'} "
                     "when measured; measuring again")
            ctx.probe_length = fresh[0]
            ctx.probe_log.restart()
            self.stale_finding = True    # replaced by this start's outcome, whatever it is
            return None
        ctx.first_probe_alone = True
        if ctx.let_users_in is not None:
            # nothing sent spares a user's new length, discovery paid the one-time cost: users first
            self.before_send = ctx.users_first = ctx.let_users_in()
        per_length: dict[str, Any] = {"tested": True, "pays": False, "ratios": [], "lengths": [ctx.probe_length],
                      "probe_pair": False, "prefill_pays": True, "prefill_pays_each_new_length": True,
                      "pairs": [], "ladder": [], "replayed_requests": 0}
        self.keep_finding(per_length, [], known)
        per_length["remembered"]["control"] = ("skipped: the first probe went alone, as the users' first request "
                                               "will; its control would measure what the finding says")
        ctx.recorder.warmup(WarmupStats(per_length_ratios=[], per_length_remedy=None))
        return per_length

    def keep_finding(self, per_length: dict, pairs: list[benefit.Controlled], skipped_for: dict | None) -> None:
        """Where both pairs ran and each new length paid, what the second fresh length paid
        beyond its control goes with the outcome, which is remembered.  Where the second
        pair was skipped for the finding `skipped_for`, the gate's figures are the
        remembered excess (readiness/probes.py), and the record says so."""
        if per_length["prefill_pays_each_new_length"] and len(pairs) == 2:
            per_length[findings.EXCESS] = pairs[1].excess()
        if skipped_for is None:
            if self.pc.remember_findings and (len(pairs) == 2 or self.stale_finding):
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
        """The findings store (one Redis client, the secret read once), this server's key
        and what names it."""
        ctx = self.ctx
        gpus = [str(g.get("name")) for g in ctx.host_facts.get("gpus", []) if isinstance(g, dict)]
        server, model = ctx.engine.server_name, ctx.engine.capabilities.get("model")
        remedy = dict(ctx.engine.applied_remedy)
        key = findings.server_key(server, model, self.concurrency, gpus, remedy)
        about = {"server": server, "model": model, "concurrency": self.concurrency, "gpus": gpus,
                 **({"remedy": remedy} if remedy else {})}
        from warmup_agent.kernel_cache.shared_findings import SharedFindings
        return findings.Findings(ctx.cfg.data_dir, SharedFindings.from_config(ctx.cfg.kernel_cache)), key, about

    def remembered(self) -> dict | None:
        """This server's per-length outcome from an earlier start (prewarm.remember_findings)."""
        if not self.pc.remember_findings:
            return None
        store, key, _ = self._findings
        return store.get(key)

    def remember(self, per_length: dict) -> None:
        store, key, about = self._findings
        store.put(key, per_length, about)

    def ladder(self) -> list[int]:
        """One request (one output token) per rung of the length ladder, one at a time
        (requests sent together prefill as one batch), then the settle request: a new
        prompt length pays most where no similar length ran yet.  Rungs up to the
        profile's longest prompt, skipping lengths already sent; returns those sent."""
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
        """Every other family and endpoint, every larger batch: one call each, together.
        A batch's prompts are as long as the server's context holds that many at once."""
        from warmup_agent.warmup.benefit import Path
        profile, ep0, fam0, b0 = self.profile, self.ep0, self.fam0, self.b0
        paths: list[Path] = []
        for b in sorted({*batches, b0}):
            hi = self.length_at(b, self.hi)
            if hi is None:
                reason = f"{b} requests at once do not fit the server's context"
                self.outcomes.append(benefit.Outcome(Path(ep0, fam0, b, self.hi), "skipped", reason))
            elif b == b0:
                paths += [Path(ep0, fam, b0, hi) for fam in profile.families if fam != fam0]
                for ep in profile.endpoints:
                    if ep != ep0:
                        paths += [Path(ep, fam, b0, hi) for fam in profile.families
                                  if not (fam == "json_schema" and ep != "chat")]
            else:
                paths.append(Path(ep0, fam0, b, hi))
        if self.pc.behind_users:
            now = [p for p in paths if p.batch == b0 and profile.source != "default"]
            self.behind = [p for p in paths if p not in now]
            paths = now
        self.warm_together(paths, {})

    def send_giving_way(self, reqs: list[traffic.WarmRequest]) -> list:
        """driver.send; behind the users, a batch that gave way to a user is sent again after them."""
        for _ in range(GIVE_WAY_TRIES - 1):
            try:
                return self.ctx.driver.send(reqs, "warmup", give_way=self.give_way)
            except EngineError as e:
                if e.reason != "gave_way" or self.before_send is None:
                    raise
                self.stopped_for_users += 1
                self.before_send()
        return self.ctx.driver.send(reqs, "warmup")

    def warm_behind(self, quiet: Callable[[], None], give_way: Callable[[], bool] | None = None) -> dict:
        """After SERVING: the paths other_paths left for later, then one 1-token request per block of
        the users' lengths, each sent once `quiet()`, stopped while `give_way()`.  What it sent."""
        if not (self.behind or self.behind_lengths):
            return {}
        from warmup_agent.warmup.benefit import Path
        t0 = time.perf_counter()
        first = len(self.outcomes)
        self.budget = benefit.Budget(max(self.budget.seconds, BEHIND_BUDGET_SECONDS), "behind the users")
        self.before_send, self.give_way = quiet, give_way
        self.stopped_for_users = 0
        sent: list[int] = []
        try:
            if self.behind:
                self.warm_together(self.behind, {})
            for n in self.behind_lengths:     # one at a time: requests sent together prefill as one batch
                if self.budget.exhausted():
                    break
                self.send_requests([self.request(Path(self.ep0, self.fam0, 1, n), 1)], f"behind: {n} tokens")
                sent.append(n)
        finally:
            self.before_send = self.give_way = None
            self.behind, self.behind_lengths = [], []
        outcomes = self.outcomes[first:]
        return {"seconds": round(time.perf_counter() - t0, 3), "paths": [o.as_dict() for o in outcomes],
                "lengths": sent, "stopped_for_users": self.stopped_for_users}

    def skip_lengths(self, per_length: dict) -> None:
        """The profile's prompt lengths, recorded as skipped with length_skip_reason."""
        from warmup_agent.warmup.benefit import Path
        reason = length_skip_reason(per_length) or "the per-length test did not run"
        for n in reversed(self.plens):
            self.outcomes.append(benefit.Outcome(Path(self.ep0, self.fam0, self.b0, n), "skipped", reason))
        if self.pc.behind_users and per_length.get("prefill_pays_each_new_length"):
            # What before SERVING could not spare, behind the users can: every block of their range.
            sent = [a for a, _ in self.decoded] + list(per_length.get("lengths") or [])   # warm-up's and probes'
            self.behind_lengths = length_blocks(self.lo, self.hi, sent)

    def decode_coverage(self, always_only: bool = False) -> dict:
        """Decode over the profile's lengths with prewarm.decode_coverage always, or auto
        unless `always_only` (sent once the per-length test found that decode pays)."""
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
        """The probes' length: a profile length no warmup request used, as a user's would be."""
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
        spent = budget.as_dict()
        ctx.recorder.warmup(WarmupStats(paths={result: counts[result] for result in
                                               ("warm_on_first_call", "converged", "still_improving", "skipped")},
                                        budget_spent_seconds=spent["spent_seconds"]))
        skipped = [{"path": o.path.label, "reason": o.reason} for o in outcomes if o.result == "skipped"]
        ctx.warmup_summary = summary = {
            "budget": spent, "per_length": per_length, "decode_coverage": coverage, "paths": dict(counts),
            "skipped": skipped, "requests": self.sent, "probe_length": probe_length, "at_once": self.concurrency,
            "replayed_requests": self.replayed, "replays": self.replays, "settle_requests": self.settled,
            "settle_prompt_tokens": self.settle_tokens, "settled_by_discovery": self.settled_by_discovery,
            "ladder_requests": len(per_length.get("ladder", [])),
            "server_context": (None if self.server_context is None else
                               {**self.server_context.as_dict(), "dropped_lengths": list(self.dropped_lengths),
                                "resized_requests": self.resized})}
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
