"""Users' requests to the torch engine, run in batches on the warmed shapes.

A scheduler thread collects requests for a short window and pads each batch to the
smallest warmed batch size that holds it, since those are the shapes warmup ran and
solidify captured.  Batching is static: the static cache has one position for the
whole batch, so a request cannot join a batch already decoding.  Each batch runs
under the engine lock, so agent probes never share the model or its static caches
with users.  A request's events go to its `deliver` callback, from the scheduler thread.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("warmup_agent.engines.torch_batcher")

#: Seconds to wait for more requests after a batch's first; every lone request pays it.
DEFAULT_WINDOW_SECONDS = 0.003
#: The largest batch when the engine warmed no batch sizes (solidify never ran).
DEFAULT_MAX_BATCH = 8


class ServedEngine(Protocol):
    """What the batcher needs of the torch engine."""
    model: Any
    tokenizer: Any
    device: Any

    @property
    def model_path(self) -> str: ...

    def serving_model(self) -> Any: ...
    def static_decoders(self) -> dict: ...
    def warmed_batch_sizes(self) -> list[int]: ...


@dataclass(frozen=True)
class Sampling:
    """One request's sampling.  temperature 0: greedy."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Delta:
    """New answer text; the first token always sends one, even empty, to mark time to first token."""
    text: str
    first: bool


@dataclass(frozen=True)
class Done:
    finish_reason: str          # "stop" (EOS or a stop string), "length", "cancelled"
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Done | Failed


@dataclass
class Job:
    """One request in the scheduler: its prompt, sampling, and where its events go."""
    prompt: list[int]
    sampling: Sampling
    deliver: Callable[[Event], None]
    cancelled: bool = False
    finished: bool = False

    def cancel(self) -> None:
        """The client went away: the row leaves at the next step.  Safe from any thread."""
        self.cancelled = True


@dataclass
class BatchRecord:
    """One batch run."""
    size: int                  # requests in it
    padded: int                # the batch size it ran at
    path: str                  # "static" or "eager"
    steps: int = 0             # forward passes after the prefill
    cancelled: int = 0
    seconds: float = 0.0


@dataclass
class Counters:
    requests: int = 0
    batches: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    completion_tokens: int = 0
    running: int = 0           # rows of the running batch not yet ended
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))


def special_ids(model_dir: str) -> tuple[frozenset[int], frozenset[int]]:
    """(EOS ids, ids kept out of the text) from config.json and generation_config.json,
    whose EOS list is the chat model's."""
    eos: set[int] = set()
    hidden: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            with open(os.path.join(model_dir, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = data.get(key)
            ids = {v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)}
            hidden |= ids
            if key == "eos_token_id":
                eos |= ids
    return frozenset(eos), frozenset(hidden)


class Detokenizer:
    """Incremental text of a growing list of token ids, with stop strings.

    Decodes a short window (as transformers' TextStreamer and vLLM do) and withholds
    an incomplete UTF-8 sequence or a possible stop-string start until it is settled."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str], hidden: frozenset[int]):
        self._decode, self._stop, self._hidden = decode, tuple(s for s in stop if s), hidden
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = self._read = 0
        self.text = ""
        self._sent = 0            # characters of `text` already handed out

    def add(self, token: int) -> tuple[str, bool]:
        """(text to send now, whether a stop string ended the answer)."""
        if token not in self._hidden:
            self._ids.append(token)
            before = self._decode(self._ids[self._prefix:self._read])
            now = self._decode(self._ids[self._prefix:])
            if len(now) > len(before) and not now.endswith("\ufffd"):
                self.text += now[len(before):]
                self._prefix, self._read = self._read, len(self._ids)
        if self._stop:
            start = max(0, self._sent - self._hold)
            hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                return self.flush(), True
        safe = len(self.text) - self._hold
        if safe <= self._sent:
            return "", False
        out, self._sent = self.text[self._sent:safe], safe
        return out, False

    def flush(self) -> str:
        """The withheld rest, at the end of the answer."""
        out, self._sent = self.text[self._sent:], len(self.text)
        return out


class _Row:
    """One job's place in a running batch."""

    def __init__(self, job: Job, detok: Detokenizer, generator: Any):
        self.job, self.detok, self.generator = job, detok, generator
        self.produced = 0
        self.done = False


class _StaticRun:
    """The batch through the engine's static decoder."""
    path = "static"

    def __init__(self, decoder: Any, prompts: list[list[int]], device: Any):
        import torch
        self.decoder, self.position = decoder, len(prompts[0])
        self.logits = decoder.prefill(torch.tensor(prompts, dtype=torch.long).to(device))

    def step(self, tokens: Any) -> Any:
        self.logits = self.decoder.decode(tokens, self.position)
        self.position += 1
        return self.logits


class _EagerRun:
    """The batch through the model with a growing cache, left-padded."""
    path = "eager"

    def __init__(self, model: Any, prompts: list[list[int]], pad: int, device: Any):
        import torch
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, longest - len(p):] = 1
        self.model, self.mask = model, mask.to(device)
        with torch.inference_mode():
            out = model(input_ids=ids.to(device), attention_mask=self.mask, use_cache=True)
        self.past, self.logits = out.past_key_values, out.logits[:, -1, :]

    def step(self, tokens: Any) -> Any:
        import torch
        with torch.inference_mode():
            self.mask = torch.cat([self.mask, torch.ones_like(tokens)], dim=1)
            out = self.model(input_ids=tokens, attention_mask=self.mask, past_key_values=self.past, use_cache=True)
        self.past, self.logits = out.past_key_values, out.logits[:, -1, :]
        return self.logits


def attention_without_cudnn() -> contextlib.AbstractContextManager:
    """SDPA without cuDNN, whose attention builds a plan per new sequence length.

    The switch is process-wide, so it is held only while a batch runs under the engine lock."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:      # torch < 2.3
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def sample(logits: Any, temperature: float, top_p: float, generator: Any) -> Any:
    """One token id (a 1-element device tensor) from one row of logits [vocab]."""
    import torch
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        # Keep tokens whose mass before them is under top_p, so the first always stays.
        sorted_probs, order = probs.sort(descending=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return order[choice]
    return torch.multinomial(probs, 1, generator=generator)


class Batcher:
    """The scheduler thread and its counters."""

    def __init__(self, engine: ServedEngine, lock: Any, window: float = DEFAULT_WINDOW_SECONDS):
        self.engine, self.lock, self.window = engine, lock, window
        self.counters = Counters()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._eos, self._hidden = special_ids(engine.model_path)
        self._closing = False
        self._running_since: float | None = None
        self._last_end: float | None = None
        self._current: list[Job] = []     # the running batch's requests (close() cancels them)
        self._thread = threading.Thread(target=self._loop, name="torch-serving", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._closing:
            job.deliver(Failed("the engine is shutting down"))
            return
        self.counters.requests += 1
        self._queue.put(job)

    @property
    def idle(self) -> bool:
        """No batch is running."""
        return self._running_since is None

    def served_within(self, seconds: float) -> float | None:
        """Seconds since a user batch last ran (0 while one runs), if at most `seconds`; else None."""
        if self._running_since is not None:
            return 0.0
        if self._last_end is None:
            return None
        age = time.monotonic() - self._last_end
        return age if age <= seconds else None

    def close(self, timeout: float = 30.0) -> None:
        """Fail queued requests, cancel the running batch and join the thread: a forward pass
        in flight at interpreter exit aborts the process."""
        self._closing = True
        for running in list(self._current):
            running.cancel()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.deliver(Failed("the engine is shutting down"))
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def batch_sizes(self) -> list[int]:
        return sorted(set(self.engine.warmed_batch_sizes()))

    def _loop(self) -> None:
        while not self._closing:
            try:
                first = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if first is None:
                break
            jobs = self._collect(first)
            live = [j for j in jobs if not j.cancelled and not self._closing]
            for j in jobs:
                if j.cancelled:
                    self._end(j, Done("cancelled", 0))
                elif self._closing:
                    self._end(j, Failed("the engine is shutting down"))
            if live:
                self._run(live)

    def _collect(self, first: Job) -> list[Job]:
        """The first job and those arriving within the window, up to the largest warmed batch."""
        sizes = self.batch_sizes()
        most = sizes[-1] if sizes else DEFAULT_MAX_BATCH
        jobs = [first]
        deadline = time.monotonic() + self.window
        while len(jobs) < most:
            remaining = deadline - time.monotonic()
            try:
                job = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:              # close(): leave it for the loop
                self._queue.put(None)
                break
            jobs.append(job)
        return jobs

    def _end(self, job: Job, event: Done | Failed) -> None:
        if job.finished:
            return
        job.finished = True
        c = self.counters
        if isinstance(event, Failed):
            c.failed += 1
        elif event.finish_reason == "cancelled":
            c.cancelled += 1
        else:
            c.finished += 1
        try:
            job.deliver(event)
        except Exception:  # noqa: BLE001 - the client's side is gone; nothing to tell
            log.debug("could not deliver the end of a request", exc_info=True)

    def _run(self, jobs: list[Job]) -> None:
        with self.lock:
            self._current = jobs
            self._running_since = time.monotonic()
            self.counters.running = len(jobs)
            record = BatchRecord(size=len(jobs), padded=len(jobs), path="eager")
            try:
                self._decode(jobs, record)
            except Exception as e:  # noqa: BLE001 - one failed batch must not end the scheduler
                log.exception("a batch of %d user requests failed", len(jobs))
                for j in jobs:
                    self._end(j, Failed(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
            finally:
                record.seconds = time.monotonic() - self._running_since
                self.counters.batches += 1
                self.counters.recent.append(record)
                self.counters.running = 0
                self._current = []
                self._running_since = None
                self._last_end = time.monotonic()
        log.debug("user batch: %d requests at batch size %d, %s path, %d steps, %d cancelled, %.1f ms", record.size,
                  record.padded, record.path, record.steps, record.cancelled, record.seconds * 1e3)

    def _decode(self, jobs: list[Job], record: BatchRecord) -> None:
        import torch
        engine = self.engine
        model, tokenizer, device = engine.serving_model(), engine.tokenizer, engine.device
        if model is None or tokenizer is None:
            raise RuntimeError("the model is not loaded")
        sizes = self.batch_sizes()
        padded = min((b for b in sizes if b >= len(jobs)), default=len(jobs))
        prompts = [j.prompt for j in jobs] + [jobs[0].prompt] * (padded - len(jobs))
        budget = max(j.sampling.max_tokens for j in jobs)
        decoder = engine.static_decoders().get(padded)
        rows = [_Row(j, Detokenizer(tokenizer.decode, j.sampling.stop, self._hidden), self._generator(j, device))
                for j in jobs]
        with torch.inference_mode(), attention_without_cudnn():
            run: _StaticRun | _EagerRun
            if (decoder is not None and len({len(p) for p in prompts}) == 1
                    and len(prompts[0]) + budget <= decoder.max_len):
                run = _StaticRun(decoder, prompts, device)
            else:
                pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
                run = _EagerRun(model, prompts, pad, device)
            record.padded, record.path = padded, run.path
            self._steps(run, rows, record)

    def _steps(self, run: _StaticRun | _EagerRun, rows: list[_Row], record: BatchRecord) -> None:
        logits = run.logits
        while True:
            tokens = logits.argmax(dim=-1)                     # greedy and padding rows
            for i, row in enumerate(rows):
                s = row.job.sampling
                if not row.done and s.temperature > 0:
                    tokens[i] = sample(logits[i], s.temperature, s.top_p, row.generator)[0]
            chosen = tokens.tolist()                           # the step's one device-to-host transfer
            for row, token in zip(rows, chosen[:len(rows)], strict=True):
                if not row.done:
                    self._advance(row, token, record)
            if all(r.done for r in rows):
                break
            logits = run.step(tokens[:, None])
            record.steps += 1

    def _advance(self, row: _Row, token: int, record: BatchRecord) -> None:
        """One token for one row: its text, and whether the row ends here."""
        job, s = row.job, row.job.sampling
        if job.cancelled:
            row.done = True
            record.cancelled += 1
            self.counters.running -= 1
            self._end(job, Done("cancelled", row.produced))
            return
        row.produced += 1
        self.counters.completion_tokens += 1
        first = row.produced == 1
        reason = None
        if token in self._eos:
            text, reason = row.detok.flush(), "stop"
        else:
            text, stopped = row.detok.add(token)
            if stopped:
                reason = "stop"
            elif row.produced >= s.max_tokens:
                text, reason = text + row.detok.flush(), "length"
        if text or first:
            job.deliver(Delta(text, first))
        if reason is not None:
            row.done = True
            self.counters.running -= 1
            self._end(job, Done(reason, row.produced))

    @staticmethod
    def _generator(job: Job, device: Any) -> Any:
        """A per-request generator, so a seeded request's answer does not depend on its batch."""
        if job.sampling.temperature <= 0:
            return None
        import torch
        g = torch.Generator(device=device)
        if job.sampling.seed is not None:
            g.manual_seed(job.sampling.seed)
        else:
            g.seed()
        return g


def warm_user_paths(engine: ServedEngine, shapes: list[tuple[int, int]]) -> None:
    """Run once what users' batches use beyond the agent's warmup (the masked eager path,
    sampling), since a cold first mixed-length batch is slow.  Called under the engine lock."""
    import torch
    model, tokenizer, device = engine.serving_model(), engine.tokenizer, engine.device
    if model is None or tokenizer is None:
        return
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sample_ids = tokenizer.encode("warm " * 8, add_special_tokens=False) or [0]
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    # One short length per batch size: first-use costs are per kernel, not per length.
    shortest: dict[int, int] = {}
    for length, batch in shapes:
        if batch >= 2 and length >= 2:
            shortest[batch] = min(length, shortest.get(batch, length))
    with torch.inference_mode(), attention_without_cudnn():
        for batch, length in sorted(shortest.items()):
            prompts = [(sample_ids * (length // len(sample_ids) + 1))[:length - (i % 2)] for i in range(batch)]
            run = _EagerRun(model, prompts, pad, device)
            run.step(run.logits.argmax(dim=-1)[:, None])
        logits = torch.randn(int(model.lm_head.weight.shape[0]), device=device)
        sample(logits, 0.7, 0.9, generator).tolist()
        sample(logits, 1.0, 1.0, generator).tolist()
