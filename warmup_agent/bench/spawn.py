"""A user who arrives the moment the pod starts (`warmup-agent bench --spawn-arrival`).

Scale from zero: the request that woke the deployment is already waiting when the
server is spawned, and nobody else can serve it.  The bench sends one streamed chat
request at the spawn, to what users reach (the server alone; the agent's proxy under
the agent), and sends it again only when it is refused: a connection nobody accepts
yet, or a 503.  What it measures is what that user meets: the seconds from the spawn
to their whole answer, and how many refusals they had to retry through.
"""
from __future__ import annotations

import time
from typing import Any

from warmup_agent.bench import client

RETRY_SECONDS = 0.05      # a client that retries at once; the official one waits 0.5-8 s


def arrive(base_url: str, model: str | None, body: dict[str, Any], spawned_at: float,
           timeout: float) -> dict[str, Any]:
    """Send `body` to base_url until it is answered; its figures, timed from `spawned_at`
    (time.monotonic()).  Raises client.RequestFailed for any other failure, or when
    nothing answers within `timeout` seconds of the spawn."""
    refused = unavailable = 0
    while True:
        sent = time.monotonic()
        try:
            answer = client.stream_chat(base_url, model, body)
        except client.RequestFailed as e:
            if e.status == 503:
                unavailable += 1
            elif e.kind == "no_answer":
                refused += 1           # not listening yet, or reset while it starts
            else:
                raise
            if time.monotonic() - spawned_at > timeout:
                raise client.RequestFailed(f"no answer {timeout:g} s after the spawn; last: {e}", e.status, e.kind) \
                    from None
            time.sleep(RETRY_SECONDS)
            continue
        return {"seconds": sent - spawned_at + answer.total, "ttft_seconds": sent - spawned_at + answer.ttft,
                "sent_after_spawn_seconds": sent - spawned_at, "refused_connections": refused,
                "status_503": unavailable, "chunks": answer.chunks}
