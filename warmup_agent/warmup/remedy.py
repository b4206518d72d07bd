"""openai.apply_server_remedy auto (issue 71): a server never measured starts as written;
after a start that found it paying per length, the next gets the remedy and keeps it while
steady decode is no slower (SLOWER_RATIO).  Kept in `<data_dir>/server-remedy.json`."""
from __future__ import annotations

import hashlib
import json
import os
import statistics
from dataclasses import dataclass

from warmup_agent.warmup.findings import EntryFile, now_iso

FILENAME = "server-remedy.json"
#: "No slower" within this: the gate's decode window is a few probes on a shared GPU.
SLOWER_RATIO = 1.05


@dataclass(frozen=True)
class Decision:
    """Apply the remedy, and why (one line for the log)."""
    apply: bool
    why: str


def remedy_key(kind: str, model: str | None, env: dict[str, str]) -> str:
    """A short hash of what the verdict is about: the server kind, its model and the remedy."""
    parts = json.dumps([kind, model or "?", sorted(env.items())])
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


class RemedyMemory:
    """The remedy verdicts of one data directory."""

    def __init__(self, data_dir: str):
        self.file = EntryFile(os.path.join(data_dir, FILENAME), "server remedy verdicts", ".wa-remedy-")
        self.path = self.file.path

    def get(self, key: str) -> dict:
        entry = self.file.load().get(key)
        return entry if isinstance(entry, dict) else {}

    def put(self, key: str, entry: dict) -> None:
        self.file.write(key, {**entry, "measured_at": now_iso()})


def decide(mode: str, entry: dict) -> Decision:
    """Apply the remedy at this start?  `entry` is RemedyMemory.get(key)."""
    if mode == "always":
        return Decision(True, "openai.apply_server_remedy is always")
    if mode == "never":
        return Decision(False, "openai.apply_server_remedy is never")
    if entry.get("verdict") == "slower":
        return Decision(False, f"steady decode was slower with it ({_ms(entry.get('steady_tpot_with'))} against "
                               f"{_ms(entry.get('steady_tpot_without'))} a token without)")
    if entry.get("pays") is True:
        if entry.get("verdict") == "no_slower":
            return Decision(True, f"measured: without it the server paid per length, and steady decode was no "
                                  f"slower with it ({_ms(entry.get('steady_tpot_with'))} against "
                                  f"{_ms(entry.get('steady_tpot_without'))} a token)")
        return Decision(True, "without it the server paid per length; this start measures its steady decode with it")
    if entry.get("pays") is False:
        return Decision(False, "measured: the server does not pay per length without it")
    return Decision(False, "not measured on this server yet: this start finds whether it pays per length without it")


def learn(entry: dict, applied: bool, pays: bool | None, decode_tpots: list[float]) -> dict:
    """The entry after SERVING: `pays` prewarm's per-length finding (None: not tested)."""
    tpot = statistics.median(decode_tpots) if decode_tpots else None
    out = dict(entry)
    if not applied:
        if pays is not None:
            out["pays"] = pays
        if tpot is not None:
            out["steady_tpot_without"] = tpot
        return out
    if tpot is None:
        return out
    out["steady_tpot_with"] = tpot
    without = out.get("steady_tpot_without")
    if isinstance(without, (int, float)) and without > 0:
        out["verdict"] = "no_slower" if tpot <= without * SLOWER_RATIO else "slower"
    return out


def _ms(seconds: object) -> str:
    return f"{seconds * 1e3:.2f} ms" if isinstance(seconds, (int, float)) else "?"
