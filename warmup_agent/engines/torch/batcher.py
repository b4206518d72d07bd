"""Users' requests to the torch engine, run in batches on the warmed shapes (issue 41).

One scheduler thread takes requests (`Job`: prompt token ids and the request's
own sampling) from a queue.  When one arrives it waits `window` seconds (a few
ms) for others, up to the largest warmed batch size, and runs them as one batch:

- the batch is padded to the smallest warmed batch size that holds it (dummy rows
  repeat the first prompt), because those are the shapes warmup ran and, on a
  GPU, the ones solidify captured CUDA graphs for;
- prompts of one length whose answers fit the static cache go through the
  engine's static decoder of that batch size (its captured prefill and decode
  step, gpu/graphs.py); anything else (prompts of different lengths, no decoder:
  the CPU) runs eagerly, left-padded with an attention mask, exactly as
  TorchEngine.generate does;
- each step's logits are sampled per row (temperature, top_p, a seeded
  generator per request), then one transfer brings the batch's tokens to the host;
- a row ends at EOS, a stop string or its max_tokens; a cancelled row (the client
  went away) ends at the next step.  The batch ends when every row has.

Requests that arrive while a batch runs wait for it to end and then go together
as the next batch (static batching: a row cannot join a batch already decoding,
because the static cache has one position for the whole batch).

The whole batch runs under the engine lock, the one the agent's driver holds
around its own engine calls (driver.py): a watch probe, a re-warm's solidify and
a user batch never use the model (or the static caches, which a probe of the
same batch size would overwrite) at the same time.

Every event for a request (text, end, failure) goes to its `deliver` callback,
called from the scheduler thread; the HTTP side (engines/torch/serving.py) hands them to
its event loop.
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

#: How long the scheduler waits for more requests after the first of a batch (seconds):
#: every lone request pays it, so it stays short.  TorchEngine.options["batch_window_seconds"].
DEFAULT_WINDOW_SECONDS = 0.003
#: The largest batch when the engine warmed no batch sizes (solidify never ran).
DEFAULT_MAX_BATCH = 8


class ServedEngine(Protocol):
    """What the batcher needs of the torch engine (engines/torch/engine.py)."""
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
    """New text of the answer (may be empty: the first token always sends one,
    so the client's first byte marks the first token)."""
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
        """The client went away: the row leaves its batch at the next step (or the
        request never runs).  Safe from any thread."""
        self.cancelled = True


@dataclass
class BatchRecord:
    """One batch run: what the counters and tests read."""
    size: int                  # requests in it
    padded: int                # the batch size it ran at
    path: str                  # "static" (the engine's static decoder) or "eager"
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
    running: int = 0           # rows of the batch running now, not yet ended
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))


def special_ids(model_dir: str) -> tuple[frozenset[int], frozenset[int]]:
    """(EOS ids, ids kept out of the text) from config.json and generation_config.json.
    generation_config's EOS list is the chat model's (Qwen2: <|im_end|> beside
    <|endoftext|>).  BOS, EOS and pad never show in the answer's text."""
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
    """Text of a growing list of token ids, one token at a time, with stop strings.

    Decodes a short window of tokens (from `prefix`) rather than the whole answer
    each step, and withholds text that ends in an incomplete UTF-8 sequence
    (U+FFFD) until the next token completes it: the windowed scheme of
    transformers' TextStreamer and vLLM.  Text that could be the start of a stop
    string is withheld too, so a stop string never reaches the client."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str], hidden: frozenset[int]):
        self._decode, self._stop, self._hidden = decode, tuple(s for s in stop if s), hidden
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = self._read = 0
        self.text = ""            # decoded so far (stop string cut off once found)
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
    """The batch through the engine's static decoder (captured graphs on a GPU)."""
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
    """The batch through the model with a growing cache, left-padded: as TorchEngine.generate."""
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
    """Scaled-dot-product attention without cuDNN's backend, for users' batches: cuDNN
    attention builds a plan for each sequence length it meets (prewarm.decode_coverage
    in docs/config.md), and users' prompts and answers reach new
    lengths all the time.  torch's switch is process-wide, so it is held only while a
    batch runs, under the engine lock: nothing else runs the model meanwhile."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:      # torch < 2.3: its default order
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def sample(logits: Any, temperature: float, top_p: float, generator: Any) -> Any:
    """One token id (a 1-element device tensor) from one row of logits [vocab]."""
    import torch
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        # Nucleus: the most probable tokens whose mass before them is under top_p
        # (so the first one always stays).
        sorted_probs, order = probs.sort(descending=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return order[choice]
    return torch.multinomial(probs, 1, generator=generator)


class Batcher:
    """The scheduler thread and its counters (see the module docstring)."""

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

    # -- the HTTP side ------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        if self._closing:
            job.deliver(Failed("the engine is shutting down"))
            return
        self.counters.requests += 1
        self._queue.put(job)

    @property
    def idle(self) -> bool:
        """No batch is running (its counters are final)."""
        return self._running_since is None

    def served_within(self, seconds: float) -> float | None:
        """Seconds since a user batch last ran (0 while one runs) when at most
        `seconds`, else None: the agent pauses its watch probes meanwhile
        (Engine.others_served_within)."""
        if self._running_since is not None:
            return 0.0
        if self._last_end is None:
            return None
        age = time.monotonic() - self._last_end
        return age if age <= seconds else None

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread: queued requests fail, the running batch's rows are
        cancelled and it ends at its next step.  Joined, so no forward pass is in
        flight when the interpreter finalises (that aborts the process)."""
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

    # -- the scheduler thread -------------------------------------------------------------------
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
                elif self._closing:        # close() came while the batch was forming
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
            if job is None:              # close(): let the loop see it after this batch
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
            tokens = logits.argmax(dim=-1)                     # greedy rows, and the padding's rows
            for i, row in enumerate(rows):
                s = row.job.sampling
                if not row.done and s.temperature > 0:
                    tokens[i] = sample(logits[i], s.temperature, s.top_p, row.generator)[0]
            chosen = tokens.tolist()                           # the one device-to-host transfer of the step
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
        """A generator of the request's own on the model's device: seeded, the same
        request gives the same answer whatever else shares its batch."""
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
    """Run once, before SERVING, what users' batches run beyond the agent's own warmup
    (TorchEngine.solidify calls it, under the engine lock it already holds): the
    eager path with left padding and its attention mask, at each warmed batch size of
    two or more (its shortest warmed length), and the sampling kernels (warmup
    decodes greedily): a cold first batch of mixed lengths takes seconds."""
    import torch
    model, tokenizer, device = engine.serving_model(), engine.tokenizer, engine.device
    if model is None or tokenizer is None:
        return
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sample_ids = tokenizer.encode("warm " * 8, add_special_tokens=False) or [0]
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    # One length per batch size: the masked path's first-use costs are per kernel, not per
    # length; a long prompt would cost seconds on a CPU for nothing.
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
