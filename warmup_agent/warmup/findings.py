"""What prewarm's per-length test found about a server, remembered for its next start.

The outcome belongs to the server (name, model, slots, GPUs), not to one start, so it is
kept in `<data_dir>/server-findings.json` and, where the kernel cache shares through
Redis, for every pod (the chart's data directory is an emptyDir).  A remembered server
skips the test until the file is removed, even if it changed under the same key.  An
unreadable file is logged and ignored, never a failed start.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from typing import Any, Protocol, TypeGuard

from warmup_agent.atomic_file import write_json_atomic

log = logging.getLogger("warmup_agent.warmup")

FILENAME = "server-findings.json"
KEPT = ("prefill_pays_each_new_length", "pays")
#: What a fresh length pays beyond its control, the first-request figure a remembering start exports.
EXCESS = "new_length_excess"
FIRST_TTFT = "first_ttft_seconds"     # in EXCESS: the second fresh length's own time to first token
STILL_HOLDS_BAND = (0.5, 3.0)    # slower: this start's own one-time costs may add to it


def server_key(server: str | None, model: str | None, concurrency: int, gpus: list[str],
               remedy: dict[str, str] | None = None) -> str:
    """A short hash of what may make a server pay differently: name, model, slots, GPUs, remedy."""
    parts: list = [server or "?", model or "?", int(concurrency), sorted(gpus)]
    if remedy:
        parts.append(sorted(remedy.items()))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


class SharedStore(Protocol):
    """The store every pod shares (kernel_cache/shared_findings.py, a layer above this one)."""

    @property
    def where(self) -> str: ...

    def get(self, key: str) -> dict | None: ...

    def put(self, key: str, entry: dict) -> None: ...


class EntryFile:
    """Entries by key in one JSON file: unreadable reads as {}, a failed write is logged."""

    def __init__(self, path: str, what: str, prefix: str):
        self.path, self.what, self.prefix = path, what, prefix

    def load(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("%s: not readable as the agent's %s (%s); measuring again", self.path, self.what, e)
            return {}
        return data if isinstance(data, dict) else {}

    def write(self, key: str, entry: dict) -> None:
        data = self.load()
        data[key] = entry
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            write_json_atomic(self.path, data, mode=0o600, prefix=self.prefix, indent=1, sort_keys=True)
        except OSError as e:
            log.warning("cannot write the %s to %s: %s", self.what, self.path, e)


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Findings:
    """The findings file of one data directory, backed by the shared store where there is one."""

    def __init__(self, data_dir: str, shared: SharedStore | None = None):
        self.file = EntryFile(os.path.join(data_dir, FILENAME), "server findings", ".wa-findings-")
        self.path = self.file.path
        self.shared = shared

    def _load(self) -> dict:
        return self.file.load()

    def get(self, key: str) -> dict | None:
        """The remembered outcome for `key` with `from`, or None; a shared entry is copied to the file."""
        entry = self._load().get(key)
        if _valid(entry):
            return {**entry, "from": self.path}
        if self.shared is None:
            return None
        shared = self.shared.get(key)
        if not _valid(shared):
            return None
        self._write(key, shared)
        return {**shared, "from": self.shared.where}

    def put(self, key: str, outcome: dict, about: dict) -> None:
        """Remember `outcome` for `key`, with `about` as the key's readable parts; failures are logged."""
        entry = {**{k: bool(outcome.get(k)) for k in KEPT}, "about": about,
                 "measured_at": now_iso()}
        if (excess := excess_of(outcome)) is not None:
            entry[EXCESS] = excess
        self._write(key, entry)
        if self.shared is not None:
            self.shared.put(key, entry)

    def _write(self, key: str, entry: dict) -> None:
        self.file.write(key, entry)


def _valid(entry: Any) -> TypeGuard[dict]:
    return isinstance(entry, dict) and all(isinstance(entry.get(k), bool) for k in KEPT)


def excess_of(entry: dict | None) -> dict | None:
    """The entry's `new_length_excess` ({"ttft": f, "total": f}), or None if absent or malformed."""
    excess = (entry or {}).get(EXCESS)
    if not isinstance(excess, dict):
        return None
    kept: dict[str, float] = {}
    for k in ("ttft", "total"):
        v = _seconds(excess.get(k))
        if v is None:
            return None
        kept[k] = v
    first = _seconds(excess.get(FIRST_TTFT))     # absent in findings written before it was kept
    if first:
        kept[FIRST_TTFT] = first
    return kept


def _seconds(v: object) -> float | None:
    """A finite, non-negative number (not a bool) as a float, else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"):
        return float(v)
    return None


def still_holds(remembered: dict, first_ttft_now: float) -> bool:
    """Whether a lone first probe's TTFT now is within STILL_HOLDS_BAND of the remembered fresh length's."""
    then = (excess_of(remembered) or {}).get(FIRST_TTFT)
    return then is not None and STILL_HOLDS_BAND[0] <= first_ttft_now / then <= STILL_HOLDS_BAND[1]


def skips_second_pair(remembered: dict | None) -> bool:
    """Whether a remembered outcome already says all a second probe pair would."""
    return bool(remembered and remembered.get("prefill_pays_each_new_length") and not remembered.get("pays")
                and excess_of(remembered) is not None)
