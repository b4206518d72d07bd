"""What the per-length test found about a server, remembered for its next start (issue 40).

Prewarm's per-length test (stages/prewarm.py) sends a probe pair at a fresh prompt
length; where the first probe was cold beyond its control, a second pair at another
fresh length tells a one-time cost from one that every new prompt length pays.  The
answer is the server's, not the start's: the same server, model, settings and GPU give
it again, so measuring it at every start is time on the critical path for nothing.

So the test's outcome is kept in `<data_dir>/server-findings.json`, one entry per
server (`server_key`), and the next start of the same server reads it: where each new
length paid in prefill and decode did not pay per length, the gate's first probe goes
alone (no control, no second pair: stages/prewarm.py, first_probe_alone) and the record
says so ("remembered", with when and where it was measured).  Any
other outcome runs the test as before, and writes its outcome.  A start that remembered
runs no test, so a server that changed under the same name, model, requests at once and
GPUs keeps its old finding until the file is removed.  Where the kernel cache shares
through Redis, the findings are shared there too (kernel_cache/shared_findings.py): the chart's
data directory is an emptyDir, so without it every new pod would measure again.

What the second fresh length paid beyond its control (`new_length_excess`, fractions
of the control's times) is kept too: it is what a user's first request at a length no
request reached pays, and a start that remembers it exports it as its
first-request figures (readiness/probes.py).  Its own first pair cannot say it: that
first probe also paid the start's one-time costs.  An entry without it (an older
agent's) is measured again.

The file is the agent's own (a few hundred bytes, written atomically); a file that
cannot be read or parsed is logged once and ignored, never a failed start.
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
#: The keys of the per-length test's outcome that are remembered.
KEPT = ("prefill_pays_each_new_length", "pays")
#: ... and the second pair's excess over its control, where both pairs ran (Controlled.excess).
EXCESS = "new_length_excess"


def server_key(server: str | None, model: str | None, concurrency: int, gpus: list[str]) -> str:
    """Which server a finding is about: its name, the model it serves, how many requests
    it takes at once and the GPUs of the host (a different build, model, slot count or
    GPU may pay differently).  A short hash, with the parts readable beside it in the file."""
    parts = json.dumps([server or "?", model or "?", int(concurrency), sorted(gpus)])
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


class SharedStore(Protocol):
    """What Findings needs of the store every pod shares (kernel_cache/shared_findings.py,
    a layer above this one: it knows Redis and the kernel cache's secret)."""

    @property
    def where(self) -> str: ...

    def get(self, key: str) -> dict | None: ...

    def put(self, key: str, entry: dict) -> None: ...


class Findings:
    """The findings file of one data directory, and the findings every pod shares where
    the kernel cache has a shared tier (`shared`: kernel_cache/shared_findings.py)."""

    def __init__(self, data_dir: str, shared: SharedStore | None = None):
        self.path = os.path.join(data_dir, FILENAME)
        self.shared = shared

    def _load(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("%s: not readable as the agent's server findings (%s); measuring again", self.path, e)
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> dict | None:
        """The remembered outcome for `key`, with `measured_at` and `from` (where it was
        read); None where none is.  This data directory's file first; else the shared
        entry, which is then kept in the file too (a restart needs no Redis)."""
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
        """Remember the per-length test's `outcome` for `key`; `about` names the server
        (readable parts of the key).  A write that fails is logged, not raised."""
        entry = {**{k: bool(outcome.get(k)) for k in KEPT}, "about": about,
                 "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if (excess := excess_of(outcome)) is not None:
            entry[EXCESS] = excess
        self._write(key, entry)
        if self.shared is not None:
            self.shared.put(key, entry)

    def _write(self, key: str, entry: dict) -> None:
        data = self._load()
        data[key] = entry
        folder = os.path.dirname(self.path) or "."
        try:
            os.makedirs(folder, exist_ok=True)
            # mode 0o600 as tempfile.mkstemp made it; a failed write leaves no temporary file behind
            write_json_atomic(self.path, data, mode=0o600, prefix=".wa-findings-", indent=1, sort_keys=True)
        except OSError as e:
            log.warning("cannot write the server findings to %s: %s", self.path, e)


def _valid(entry: Any) -> TypeGuard[dict]:
    return isinstance(entry, dict) and all(isinstance(entry.get(k), bool) for k in KEPT)


def excess_of(entry: dict | None) -> dict | None:
    """The entry's `new_length_excess` ({"ttft": f, "total": f}, each a number >= 0), or
    None where it has none or a malformed one."""
    excess = (entry or {}).get(EXCESS)
    if not isinstance(excess, dict):
        return None
    kept: dict[str, float] = {}
    for k in ("ttft", "total"):
        v = excess.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
            return None
        kept[k] = float(v)
    return kept


def skips_second_pair(remembered: dict | None) -> bool:
    """Whether a remembered outcome makes the second probe pair say nothing new: each new
    length paid in prefill, decode did not pay per length (the second pair's decode
    ratios are not needed), and what the second fresh length paid is kept (the figures
    a user's first request meets)."""
    return bool(remembered and remembered.get("prefill_pays_each_new_length") and not remembered.get("pays")
                and excess_of(remembered) is not None)
