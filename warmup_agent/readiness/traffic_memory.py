"""The agent's memory of what its users send: the learned traffic profile, kept.

The proxy reports each user request's shape (never its text) to the gate, which hands it
here.  The profile (warmup/learned.py) is loaded at start from the data dir and merged
with what other pods shared through the kernel cache's Redis; it is saved atomically
every SAVE_SECONDS while it changes and at stop, and shared again then.  So a restart,
a wake and a new start with the same data dir, or a new pod of the deployment, warm
what users sent before.  Trouble with the file or Redis is one warning line.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from exporter.recorder import LearnedStats, Recorder
from warmup_agent.periodic import Periodic
from warmup_agent.warmup.learned import LearnedProfile, Shape

if TYPE_CHECKING:
    from warmup_agent.kernel_cache.shared_findings import SharedFindings

log = logging.getLogger("warmup_agent.readiness.traffic")

SAVE_SECONDS = 10.0
SHARED_PREFIX = "learned-profile:"


class TrafficMemory:
    """`data_dir`: where the profile is kept; `shared`: the kernel cache's findings store
    in Redis (None: not shared), the profile under `shared_key` (the model's).  Weights
    merged from Redis at each start are counted again by later merges: approximate, and
    what is warmed follows the shapes' order, not their exact weights."""

    def __init__(self, data_dir: str, recorder: Recorder, shared: SharedFindings | None = None,
                 save_seconds: float = SAVE_SECONDS, shared_key: str = "model"):
        self.data_dir, self.recorder, self.shared = data_dir, recorder, shared
        self.shared_key = SHARED_PREFIX + shared_key
        self.profile = LearnedProfile.load(data_dir) or LearnedProfile()
        loaded = self.profile.seen
        self._shared_seen = 0
        if shared is not None:
            entry = shared.get(self.shared_key)
            if entry is not None:
                try:
                    theirs = LearnedProfile.from_dict(entry)
                except (ValueError, TypeError, KeyError, IndexError):
                    log.warning("the learned traffic profile in %s is not one; ignored", shared.where)
                else:
                    self.profile.merge(theirs)
                    self._shared_seen = theirs.seen
        if self.profile.seen:
            log.info("traffic profile learned from %d user request(s) (%d here, %d shared): its shapes are warmed",
                     self.profile.seen, loaded, self.profile.seen - loaded)
        self._changed = False
        self._lock = threading.Lock()
        self._saver = Periodic(save_seconds, self.save, "traffic-memory")
        self._publish()

    def start(self) -> TrafficMemory:
        self._saver.start()
        return self

    def stop(self) -> None:
        self._saver.stop(timeout=5)
        self.save()

    def observe(self, shape: Shape, params: dict[str, Any] | None = None) -> None:
        """One user request's shape (the proxy, through the gate)."""
        self.profile.observe(shape, params)
        with self._lock:
            self._changed = True
        self._publish()

    def save(self) -> None:
        """Write the profile if it changed (atomically), and share it."""
        with self._lock:
            if not self._changed:
                return
            self._changed = False
        try:
            self.profile.save(self.data_dir)
        except OSError as e:
            log.warning("the learned traffic profile was not saved in %s: %s", self.data_dir, e)
        if self.shared is not None:
            self.shared.put(self.shared_key, self.profile.to_dict())

    def _publish(self) -> None:
        p = self.profile
        self.recorder.learned(LearnedStats(len(p), p.weight, p.updated_at))
