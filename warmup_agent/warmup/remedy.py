"""Whether a supervised server starts with its kind's known per-length remedy
(openai.apply_server_remedy: auto, issue 71).  A server never measured starts as written;
where that start found it paying per length, the next one gets the remedy and compares its
steady time per token; no slower (SLOWER_RATIO), later starts keep it, else none does.
Kept per server command in `<data_dir>/server-remedy.json`; an unreadable file is ignored.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import statistics
from dataclasses import dataclass

from warmup_agent.atomic_file import write_json_atomic

log = logging.getLogger("warmup_agent.warmup")

FILENAME = "server-remedy.json"
#: "No slower" within this: the gate's decode window is a few probes on a shared GPU.
SLOWER_RATIO = 1.05
MODES = ("auto", "always", "never")


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
        self.path = os.path.join(data_dir, FILENAME)

    def _load(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("%s: not readable as the agent's server remedy verdicts (%s); measuring again", self.path, e)
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> dict:
        entry = self._load().get(key)
        return entry if isinstance(entry, dict) else {}

    def put(self, key: str, entry: dict) -> None:
        data = self._load()
        data[key] = {**entry, "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            write_json_atomic(self.path, data, mode=0o600, prefix=".wa-remedy-", indent=1, sort_keys=True)
        except OSError as e:
            log.warning("cannot write the server remedy verdicts to %s: %s", self.path, e)


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
